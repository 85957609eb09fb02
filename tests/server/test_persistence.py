"""History survives a kill -9: `demo --db FILE`, SIGKILL, then `replay FILE` and `export`."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

WINDOW = 1.0  # the writer's promise: history at most this far behind


@pytest.mark.slow
def test_kill_9_then_replay_holds_history_and_hook_changes(cli_server, tmp_path):
    db = tmp_path / "run.sqlite"
    demo = cli_server(["demo", "--no-wait", "--db", str(db), "--steps-per-second", "40"])
    c = demo.client
    observed: list[tuple[float, int]] = []

    def step() -> int:
        s = c.get("/api/session").json()["training"]["step"]
        observed.append((time.monotonic(), s))
        return s

    deadline = time.monotonic() + 60
    while step() < 10:
        assert time.monotonic() < deadline
    hook = c.post(
        "/api/hooks", json={"kind": "clip_value", "target": "0.*", "params": {"threshold": 0.5}}
    ).json()
    while c.get("/api/hooks").json()[0]["applied_step"] is None:
        assert time.monotonic() < deadline
    assert c.patch(f"/api/hooks/{hook['id']}", json={"params": {"threshold": 0.25}}).status_code == 200
    assert c.post("/api/hooks", json={"kind": "nan_guard", "target": "*"}).status_code == 201
    while any(h["applied_step"] is None for h in c.get("/api/hooks").json()) or step() < 60:
        assert time.monotonic() < deadline
    applied = c.get("/api/events").json()["events"]
    applied = [e for e in applied if e["kind"] == "hook_applied"]
    assert len(applied) == 3
    final_hooks = c.get("/api/hooks").json()

    demo.proc.kill()  # SIGKILL: no shutdown, no final flush
    killed_at = time.monotonic()
    demo.proc.wait(10)
    safe = max(s for t, s in observed if t <= killed_at - WINDOW)

    replay = cli_server(["replay", str(db)])
    rc = replay.client
    steps = [s["step"] for s in rc.get("/api/snapshots", params={"since": 0}).json()["snapshots"]]
    assert set(range(1, safe + 1)) <= set(steps), f"missing steps before {safe}"
    events = rc.get("/api/events").json()["events"]
    assert [e["seq"] for e in events if e["kind"] == "hook_applied"] == [e["seq"] for e in applied]
    session = rc.get("/api/session").json()
    assert session["mode"] == "replay" and session["read_only"] is True and session["live"] is False
    assert [(h["id"], h["params"]) for h in session["hooks"]] == [(h["id"], h["params"]) for h in final_hooks]
    assert rc.post("/api/training/pause").status_code == 403
    assert rc.post("/api/hooks", json={"kind": "freeze"}).status_code == 403
    runs = rc.get("/api/runs").json()["runs"]
    assert [r["id"] for r in runs] == [1], "replay adds no run"
    from websockets.sync.client import connect

    with connect(f"ws://127.0.0.1:{replay.port}/ws", proxy=None, max_size=None) as ws:
        hello = json.loads(ws.recv(timeout=10))
        assert hello["type"] == "hello" and hello["session"]["mode"] == "replay"
        assert hello["history"][-1]["step"] == steps[-1]
        ws.send(json.dumps({"type": "pause", "request_id": 1}))
        assert json.loads(ws.recv(timeout=10))["status"] == 403
    replay.stop()

    # export reads the same file, also while nothing serves it
    out = tmp_path / "run.jsonl"
    subprocess.run(
        [sys.executable, "-m", "server", "export", str(db), "--format", "jsonl", "-o", str(out)],
        check=True,
        cwd=tmp_path,
        env=demo_env(),
        timeout=120,
    )
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["type"] == "run" and lines[0]["scenario"] == "mlp"
    hooks_lines = [x for x in lines if x["type"] == "hooks"]
    assert [len(x["hooks"]) for x in hooks_lines][-1] == 2
    assert {x["data"]["step"] for x in lines if x["type"] == "snapshot"} >= set(range(1, safe + 1))


def demo_env() -> dict:
    import os
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    return {**os.environ, "PYTHONPATH": str(repo) + os.pathsep + os.environ.get("PYTHONPATH", "")}
