"""Helpers shared by the tests, scripts/ and bench/: polling against a deadline, free ports,
`gradient-inspector` server processes, and Debian's Chromium.

Standard library only (httpx and playwright are imported where they are used), so that
scripts/screenshots.py and bench/*.py import it from a checkout, with the repository root on
``sys.path``, exactly as the tests do.
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def wait_until(
    pred: Callable[[], Any], timeout: float = 10.0, what: str = "condition", interval: float = 0.01
) -> Any:
    """Poll ``pred`` until it returns something truthy (returned); fail naming ``what`` after ``timeout`` s.

    For conditions in other threads or processes that offer nothing to await; the interval
    only bounds how often ``pred`` runs, the deadline bounds the wait.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def stop_process(proc: subprocess.Popen[Any], grace: float = 15.0) -> int:
    """SIGTERM, then SIGKILL after ``grace`` seconds; always reaped. Returns the exit status
    (``-signal.SIGKILL`` when it had to be killed)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return proc.returncode


# ----------------------------------------------------------------------------- server processes
def cli_command() -> list[str]:
    """The `gradient-inspector` script of this interpreter's environment, else `python -m server`."""
    script = Path(sys.executable).with_name("gradient-inspector")
    return [str(script)] if script.exists() else [sys.executable, "-m", "server"]


def repo_env(**extra: str) -> dict[str, str]:
    """This process's environment with the checkout first on PYTHONPATH (a subprocess runs this
    checkout's code even where the installed package is another copy), unbuffered output, and ``extra``."""
    path = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **extra}


# urllib would follow the *_proxy environment variables; a loopback poll goes direct
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def wait_for_server(
    process: subprocess.Popen[Any], url: str, timeout: float = 60.0, *, output: Callable[[], str] = lambda: ""
) -> None:
    """Poll ``url`` until it answers 200 (datasette's ``wait_for_server``).

    Fails (``AssertionError``, with ``output()``: the server's output so far) as soon as
    ``process`` exits, or when ``timeout`` seconds pass first. Stopping the process is the
    caller's business.
    """
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise AssertionError(
                f"the server exited with {process.returncode} before {url} answered:\n{output()}"
            )
        try:
            with _DIRECT.open(url, timeout=max(0.1, min(5.0, deadline - time.monotonic()))) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):  # not listening yet, or not ready (HTTPError is a URLError)
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"the server did not answer {url} within {timeout} s:\n{output()}")
        time.sleep(0.05)  # the poll's interval; the deadline above bounds the wait


class ServerProcess:
    """A server as a subprocess on 127.0.0.1:``port``, started and waited on until
    ``GET /api/health`` answers 200 (`wait_for_server`).

    Its stdout and stderr go, merged, to a file in ``log_dir`` (``log()`` reads it), or nowhere
    when ``log_dir`` is None. A server that exits, or is not up within ``timeout`` s, fails the
    start with its output and is stopped. ``env`` defaults to `repo_env()`, ``cwd`` to ``log_dir``.
    ``client`` is an httpx client on the server (sending ``token`` as a bearer token, when
    given), made on first use. Stop it with ``stop()``, or use it as a context manager.
    """

    def __init__(
        self,
        argv: list[str],
        *,
        port: int,
        log_dir: Path | None,
        env: Mapping[str, str] | None = None,
        cwd: Path | str | None = None,
        timeout: float = 60.0,
        token: str | None = None,
    ) -> None:
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        self.url = self.base + "/"
        self.token = token
        self.log_path = (
            Path(log_dir) / f"server-{port}-{time.monotonic_ns()}.log" if log_dir is not None else None
        )
        self._log = open(self.log_path, "wb") if self.log_path else None  # noqa: SIM115 (closed in stop())
        try:
            self.proc = subprocess.Popen(
                argv,
                cwd=cwd if cwd is not None else log_dir,
                env=dict(repo_env() if env is None else env),
                stdout=self._log or subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
        except BaseException:
            if self._log is not None:
                self._log.close()
            raise
        try:
            wait_for_server(self.proc, self.base + "/api/health", timeout, output=self.log)
        except BaseException:
            self.stop()
            raise

    def log(self) -> str:
        """The server's output so far (all of it once stopped)."""
        if self.log_path is None:
            return "(the server's output was not kept)"
        if self._log is not None and not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    @functools.cached_property
    def client(self) -> Any:
        """An ``httpx.Client`` with ``base`` as its base URL, closed by ``stop()``."""
        import httpx

        headers = {"authorization": f"Bearer {self.token}"} if self.token else {}
        return httpx.Client(base_url=self.base, trust_env=False, timeout=10.0, headers=headers)

    def get(self, path: str, **kwargs: Any) -> Any:
        """``GET path`` through ``client``: the JSON body, or an error for a status other than 2xx."""
        r = self.client.get(path, **kwargs)
        r.raise_for_status()
        return r.json()

    def stop(self, grace: float = 15.0) -> int:
        """SIGTERM, then SIGKILL after ``grace`` s (`stop_process`); returns the exit status.
        Harmless to call again."""
        code = stop_process(self.proc, grace)
        if "client" in self.__dict__:
            self.client.close()
        if self._log is not None and not self._log.closed:
            self._log.close()
        return code

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def start_cli(
    args: Iterable[str],
    *,
    log_dir: Path | None,
    port: int | None = None,
    command: list[str] | None = None,
    **kwargs: Any,
) -> ServerProcess:
    """``COMMAND ARGS --port PORT`` as a `ServerProcess`: ``command`` defaults to `cli_command()`,
    ``port`` to a free one; ``kwargs`` go to `ServerProcess`."""
    port = port or free_port()
    argv = [*(command if command is not None else cli_command()), *args, "--port", str(port)]
    return ServerProcess(argv, port=port, log_dir=log_dir, **kwargs)


def start_demo(
    log_dir: Path | None,
    *,
    scenario: str = "mlp",
    rate: float | str = 10.0,
    db: Path | str | None = None,
    extra: Iterable[str] = (),
    wait: bool = False,
    hint_pause: bool = False,
    **kwargs: Any,
) -> ServerProcess:
    """``gradient-inspector demo --scenario SCENARIO --steps-per-second RATE --db DB --no-wait
    --no-pause-before-hint EXTRA`` (``--no-db`` when ``db`` is None; without ``--no-wait`` when
    ``wait``: training then starts with the first page; without ``--no-pause-before-hint`` when
    ``hint_pause``: the scenario then pauses before its hint's step) as a `ServerProcess`;
    ``kwargs`` go to `start_cli`."""
    history = ["--db", str(db)] if db is not None else ["--no-db"]
    no_wait = [] if wait else ["--no-wait"]
    no_pause = [] if hint_pause else ["--no-pause-before-hint"]
    args = [
        "demo",
        "--scenario",
        scenario,
        "--steps-per-second",
        str(rate),
        *history,
        *no_wait,
        *no_pause,
        *extra,
    ]
    return start_cli(args, log_dir=log_dir, **kwargs)


# ----------------------------------------------------------------------------- Chromium
# Debian's chromium run headless by Playwright; Playwright's own browser download cannot run here.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
NO_CHROMIUM = "no Chromium: run `bash scripts/setup.sh --browser` (installs Debian's chromium)"


def chromium_path() -> str | None:
    """``$GI_CHROMIUM``, else /usr/bin/chromium, else ``chromium`` on PATH; None when there is none."""
    for candidate in (os.environ.get("GI_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium")):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def launch_chromium(playwright: Any) -> Any:
    """Chromium launched through a started ``sync_playwright()`` (its ``Browser``, which the
    caller closes). Raises ``FileNotFoundError`` (`NO_CHROMIUM`) when there is no Chromium."""
    path = chromium_path()
    if path is None:
        raise FileNotFoundError(NO_CHROMIUM)
    return playwright.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
