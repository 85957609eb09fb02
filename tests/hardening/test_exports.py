"""Exports from a crafted database: "Copy as Python" writes no code it did not quote, and
`export --format csv` quotes cells a spreadsheet would run."""

from __future__ import annotations

import ast
import csv
import io

import httpx

from server.app import create_app
from server.cli import main
from server.history.export import python_code
from server.history.storage import HistoryStore
from server.serving import ThreadedServer
from server.settings import Settings
from server.sources import ReplaySource

INJECTED = "x=__import__('os').system('touch pwned'),y"  # a params key that closes the call
HOOKS = [
    {"id": "h1", "kind": "clip_value", "target": "*", "point": "pre_step", "params": {INJECTED: 1.0}},
    {"id": "h2", "kind": "scale", "target": "0.*", "point": "pre_step", "params": {"factor": 2.0}},
    {"id": "h3", "kind": "python", "target": "*", "params": {"fn": "f\nimport os; os.system('id')"}},
]
FORMULAS = ['=HYPERLINK("http://evil.example","x")', "+1+1", "-2+3", "@SUM(A1)", "\tx"]
PARAMS = [{"name": n, "shape": [1], "numel": 1, "module": ""} for n in [*FORMULAS, "0.weight"]]


def crafted_db(path):
    store = HistoryStore(path)
    store.start_writer()
    run = store.new_run(params=PARAMS, modules=[""], scenario="mlp")
    store.add_snapshot(
        run,
        {
            "step": 1,
            "time": 1.0,
            "config_version": 1,
            "loss": None,
            "scalars": {},
            "grad_norm": [1.0] * len(PARAMS),
            "total_norm": float("-inf"),
            "events": [],
        },
    )
    store.add_hooks(run, 1, HOOKS)
    store.close()
    return run


def only_add_hook_calls_with_literals(code: str) -> list[ast.Call]:
    """Every statement is `insp.add_hook(<literals>)`: nothing else would run."""
    calls = []
    for stmt in ast.parse(code).body:
        assert isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call), ast.dump(stmt)
        call = stmt.value
        assert ast.unparse(call.func) == "insp.add_hook", ast.unparse(call)
        for arg in [*call.args, *(k.value for k in call.keywords)]:
            ast.literal_eval(arg)  # raises on anything but a literal
        calls.append(call)
    return calls


def test_copy_as_python_from_a_crafted_replay_writes_no_code(tmp_path):
    """The replay's preset holds only hooks that validate (the crafted key is left out),
    and python_code quotes whatever it is given, keys and names included."""
    db = tmp_path / "crafted.sqlite"
    crafted_db(db)
    store = HistoryStore(db, read_only=True)
    source = ReplaySource(store)
    server = ThreadedServer(create_app(source, Settings(port=0)), Settings(port=0))
    server.start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", trust_env=False, timeout=10) as c:
            preset = c.get("/api/hooks/export").json()
            code = c.get("/api/hooks/export", params={"format": "python"}).text
        assert [h["kind"] for h in preset["hooks"]] == ["scale"], preset
    finally:
        server.stop()
        store.close()
    assert "__import__" not in code
    (call,) = only_add_hook_calls_with_literals(code)
    assert ast.literal_eval(call.args[0]) == "scale"

    code = python_code({"hooks": HOOKS})  # unvalidated input: still nothing but literals
    calls = only_add_hook_calls_with_literals(code)
    assert len(calls) == 2
    (params,) = [k for k in calls[0].keywords if k.arg == "params"]
    assert ast.literal_eval(params.value) == {INJECTED: 1.0}
    assert all(line.startswith(("#", "insp.add_hook(")) for line in code.splitlines()), code
    inf = python_code([{"kind": "clip_norm", "target": "*", "params": {"max_norm": float("inf")}}])
    assert "max_norm=float('inf')" in inf, inf


def test_csv_export_quotes_cells_a_spreadsheet_would_run(tmp_path, capsys):
    """Names beginning with = + - @ or a tab get a leading quote (OWASP); numbers,
    "-inf" included, are left as they are."""
    db = tmp_path / "crafted.sqlite"
    crafted_db(db)
    assert main(["export", str(db), "--format", "csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out, newline="")))
    names = [r["param"] for r in rows]
    assert names == ["'" + n for n in FORMULAS] + ["0.weight"], names
    assert {r["total_norm"] for r in rows} == {"-inf"}
