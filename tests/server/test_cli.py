"""The command line: --version, --help, export, and the errors it reports before serving."""

from __future__ import annotations

import csv
import io
import json
import socket
import subprocess
import sys

import pytest

from server.cli import SCENARIOS, build_parser, main
from server.history.storage import HistoryStore

PARAMS = [
    {"name": "0.weight", "shape": [2, 2], "numel": 4, "module": "0"},
    {"name": "0.bias", "shape": [2], "numel": 2, "module": "0"},
]


def make_db(path):
    store = HistoryStore(path)
    store.start_writer()
    run = store.new_run(params=PARAMS, modules=["", "0"], scenario="mlp")
    for step in (1, 2, 3):
        store.add_snapshot(
            run,
            {
                "step": step,
                "time": 10.0 + step,
                "config_version": 1,
                "loss": None,
                "scalars": {},
                "grad_norm": [1.0 * step, float("nan")],
                "grad_norm_raw": [2.0, None],
                "total_norm": 1.5,
                "events": [],
            },
        )
        store.add_scalars(run, {"step": step, "loss": 0.5, "scalars": {}})
    store.add_hooks(run, 1, [{"id": "h1", "kind": "freeze", "target": "*"}])
    store.add_event(run, {"seq": 1, "kind": "hook_applied", "time": 11.0})
    store.close()
    return run


def test_version(capsys):
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("gradient-inspector ") and out.strip().split()[-1][0].isdigit()


def test_help_texts_cover_every_option(capsys):
    parser = build_parser()
    text = parser.format_help()
    assert "demo" in text and "replay" in text and "export" in text and "token" in text
    for command, options in {
        "demo": [
            "--scenario",
            "--host",
            "--port",
            "--db",
            "--token",
            "--read-only",
            "--steps-per-second",
            "--hooks",
            "which scenario: mlp, exploding, nan, tiny_gpt, deep (default mlp)",
        ],
        "replay": ["FILE", "--run", "--host", "--port", "--token"],
        "export": ["FILE", "--run", "--format", "-o", "html"],
    }.items():
        with pytest.raises(SystemExit) as info:
            main([command, "--help"])
        assert info.value.code == 0
        out = " ".join(capsys.readouterr().out.split())  # the help as one line, however argparse wrapped it
        for option in options:
            assert option in out, (command, option)
    assert main([]) == 2


def test_demo_scenarios_are_the_cores_and_only_demo_imports_torch_for_them(capsys):
    from inspector.scenarios import SCENARIOS as CORE

    assert list(SCENARIOS) == list(CORE) and "nan" in SCENARIOS
    demo = build_parser()._subparsers._group_actions[0].choices["demo"]
    assert all(f"{name} (" in demo.description for name in CORE), (
        "the description's one-line hint per scenario"
    )
    with pytest.raises(SystemExit) as info:
        main(["demo", "--scenario", "bogus"])
    assert info.value.code == 2
    assert (
        "invalid choice: 'bogus' (choose from 'mlp', 'exploding', 'nan', 'tiny_gpt', 'deep')"
        in capsys.readouterr().err
    )
    # the names are read from the core (which imports torch) only when demo's help or --scenario needs them
    code = (
        "import sys\nfrom server import cli\nfor argv in (['--help'], ['replay', '--help'], ['export', '--help']):\n"
        "    try:\n        cli.main(argv)\n    except SystemExit:\n        pass\n"
        "print('torch imported:', 'torch' in sys.modules, file=sys.stderr)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stderr.strip() == "torch imported: False", out.stderr


def test_export_csv_and_jsonl(tmp_path, capsys):
    db = tmp_path / "h.sqlite"
    make_db(db)
    out = tmp_path / "out.csv"
    assert main(["export", str(db), "--format", "csv", "-o", str(out)]) == 0
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert len(rows) == 6 and [r["param"] for r in rows[:2]] == ["0.weight", "0.bias"]
    assert rows[0]["step"] == "1" and rows[0]["loss"] == "0.5" and rows[0]["grad_norm"] == "1.0"
    assert rows[1]["grad_norm"] == "nan" and rows[1]["grad_norm_raw"] == "" and rows[1]["total_norm"] == "1.5"

    assert main(["export", str(db), "--format", "jsonl"]) == 0
    lines = [json.loads(x) for x in io.StringIO(capsys.readouterr().out)]
    assert [x["type"] for x in lines] == ["run", "hooks", "event", "snapshot", "snapshot", "snapshot"]
    assert lines[0]["params"] == PARAMS and lines[3]["data"]["grad_norm"] == [1.0, "nan"]


def test_errors_are_reported_not_raised(tmp_path, capsys):
    assert main(["export", str(tmp_path / "missing.sqlite"), "--format", "csv"]) == 2
    assert "no such database" in capsys.readouterr().err
    db = tmp_path / "h.sqlite"
    make_db(db)
    assert main(["export", str(db), "--format", "csv", "--run", "7"]) == 2
    assert "no run 7" in capsys.readouterr().err
    assert main(["replay", str(db), "--run", "7"]) == 2
    assert "no run 7" in capsys.readouterr().err
    empty = tmp_path / "empty.sqlite"
    HistoryStore(empty).close()
    assert main(["replay", str(empty)]) == 2
    assert "holds no run" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["export", str(db), "--format", "xml"])
    assert "invalid choice" in capsys.readouterr().err


def test_demo_reports_a_bad_preset_and_a_taken_port(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps({"format": "gradient-inspector/hooks", "version": 1, "hooks": [{"kind": "nope"}]})
    )
    assert main(["demo", "--no-db", "--hooks", str(bad)]) == 2
    assert "--hooks" in capsys.readouterr().err
    assert main(["demo", "--no-db", "--hooks", str(tmp_path / "absent.json")]) == 2
    capsys.readouterr()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["demo", "--no-db", "--port", str(port)]) == 2
    assert "already in use" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--steps-per-second", "-3"])
    assert main(["demo", "--no-db", "--token", "short"]) == 2
