"""`gradient-inspector --help`, each subcommand's help, `--version`, and `python -m server`.

The console script and `python -m server` are run as real processes (all at once: each start
imports the web stack); the completeness checks walk the argparse parser in-process.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import inspector
from server import cli

SUBCOMMANDS = ("demo", "replay", "export")
# the options each subcommand must offer (its documented interface)
PROMISED = {
    "demo": (
        "--scenario",
        "--host",
        "--port",
        "--db",
        "--token",
        "--read-only",
        "--steps-per-second",
        "--hooks",
    ),
    "replay": ("FILE", "--run", "--host", "--port", "--token"),
    "export": ("FILE", "--run", "--format", "-o"),
}
CHOICES = {"demo": ("mlp", "exploding", "nan", "tiny_gpt", "deep"), "export": ("csv", "jsonl", "html")}


def console_script() -> str:
    beside = Path(sys.executable).parent / "gradient-inspector"  # the venv's bin/, also when not on PATH
    found = str(beside) if beside.is_file() else shutil.which("gradient-inspector")
    assert found, "the gradient-inspector console script is not installed (pip install -e .)"
    return found


COMMANDS = {
    "help": ["gradient-inspector", "--help"],
    **{f"{name} help": ["gradient-inspector", name, "--help"] for name in SUBCOMMANDS},
    "version": ["gradient-inspector", "--version"],
    "module help": ["-m", "server", "--help"],
    "module version": ["-m", "server", "--version"],
}


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> dict[str, subprocess.CompletedProcess[str]]:
    """Every command of COMMANDS run once, concurrently, from an empty directory."""
    cwd = tmp_path_factory.mktemp("cli")
    script = console_script()
    procs = {}
    for key, argv in COMMANDS.items():
        full = [script, *argv[1:]] if argv[0] == "gradient-inspector" else [sys.executable, *argv]
        procs[key] = (
            full,
            subprocess.Popen(full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd),
        )
    results = {}
    for key, (full, proc) in procs.items():
        out, err = proc.communicate(timeout=180)
        results[key] = subprocess.CompletedProcess(full, proc.returncode, out, err)
    return results


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, f"{result.args} exited {result.returncode}\n{result.stderr}"
    return result.stdout


@pytest.mark.slow
def test_top_level_help_lists_every_subcommand_and_version(ran):
    text = ok(ran["help"])
    assert text.startswith("usage: gradient-inspector")
    for word in (*SUBCOMMANDS, "--version", "token"):
        assert word in text, word


@pytest.mark.slow
@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_each_subcommand_help_exits_0_and_mentions_its_options(ran, name):
    text = ok(ran[f"{name} help"])
    assert text.startswith(f"usage: gradient-inspector {name}")
    for opt in PROMISED[name] + CHOICES.get(name, ()):
        assert opt in text, f"{name} --help does not mention {opt}"


@pytest.mark.slow
def test_version_prints_the_package_version(ran):
    expected = f"gradient-inspector {inspector.__version__}"
    assert ok(ran["version"]).strip() == expected
    assert importlib.metadata.version("gradient-inspector") == inspector.__version__


@pytest.mark.slow
def test_python_dash_m_server_is_the_same_command(ran):
    assert ok(ran["module help"]) == ok(ran["help"])
    assert ok(ran["module version"]) == ok(ran["version"])


# ----------------------------------------------------------------------------- in-process, fast
def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_every_subcommand_is_listed_and_every_option_has_help():
    parser = cli.build_parser()
    subs = subparsers(parser)
    assert tuple(subs) == SUBCOMMANDS
    for name, sub in [("", parser), *subs.items()]:
        text = sub.format_help()
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            label = action.option_strings[0] if action.option_strings else action.metavar or action.dest
            assert action.help and action.help != argparse.SUPPRESS, f"{name or 'top'}: {label} has no help"
            assert all(s in text for s in action.option_strings), f"{name}: {label} missing from the help"
            if action.choices is not None:
                assert all(str(c) in text for c in action.choices), f"{name}: choices of {label}"


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_help_exits_0_in_process(name, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([name, "--help"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: gradient-inspector {name}")


def test_no_subcommand_prints_help_and_fails(capsys):
    assert cli.main([]) == 2
    assert "demo" in capsys.readouterr().out
