"""DDP under torch.distributed: two gloo processes on 127.0.0.1, one config for the job.

The test drives rank 0's HTTP API while both ranks train (tests/distributed/worker.py) and then
checks every step of both ranks' logs: bitwise-identical parameters, the same config
version at the same step, and clip_norm equal to clip_grad_norm_ of the averaged gradients.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support import free_port

WORKER = Path(__file__).with_name("worker.py")
pytestmark = [pytest.mark.dist, pytest.mark.slow]


def poll(pred, timeout=60.0, what="condition", show=lambda: ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)  # polling an external process: nothing to await
    raise AssertionError(f"timed out waiting for {what} {show()}")


def log(out: Path, rank: int) -> list[dict]:
    path = out / f"rank{rank}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def last_step(out: Path, rank: int) -> int:
    rows = log(out, rank)
    return rows[-1]["step"] if rows else 0


def assert_script_hook_agrees(rows0: list[dict], rows1: list[dict], at: int) -> None:
    """The hook the script added at step ``at`` while a dashboard edit was pending on rank 0 has the
    same id on both ranks, and both ranks apply both hooks from that step."""
    sid0 = {r["script_id"] for r in rows0 if r["step"] >= at}
    sid1 = {r["script_id"] for r in rows1 if r["step"] >= at}
    assert sid0 == sid1 and len(sid0) == 1 and None not in sid0, (sid0, sid1)
    row = next(r for r in rows0 if r["step"] == at)
    applied = dict(row["applied"])
    assert applied[sid0.pop()] == at and sum(1 for s in applied.values() if s == at) == 2, row


def test_two_ranks_share_hooks_pause_and_report_per_rank(tmp_path):
    master, http_port = free_port(), free_port()
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master),
        "WORLD_SIZE": "2",
        "PYTHONUNBUFFERED": "1",
    }
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                "--steps",
                "300",
                "--rate",
                "40",
                "--out",
                str(tmp_path),
                "--port",
                str(http_port),
                "--nan-step",
                "12",
                "--interleave",
                "5",
            ],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    base = f"http://127.0.0.1:{http_port}"
    c = httpx.Client(base_url=base, timeout=10)
    try:

        def health():
            try:
                return c.get("/api/health").status_code == 200
            except httpx.TransportError:
                assert all(p.poll() is None for p in procs), "a worker died"
                return False

        poll(health, what="rank 0's server")
        session = lambda: c.get("/api/session").json()["training"]  # noqa: E731
        poll(lambda: session()["step"] >= 15, what="step 15")

        # a hook added through rank 0's API lands on both ranks at the same step
        r = c.post("/api/hooks", json={"kind": "clip_norm", "target": "*", "params": {"max_norm": 0.01}})
        assert r.status_code == 201, r.text
        applied = poll(lambda: c.get("/api/hooks").json()[-1]["applied_step"], what="applied_step")
        poll(
            lambda: min(last_step(tmp_path, 0), last_step(tmp_path, 1)) >= applied + 3,
            what="steps after the hook",
        )

        # pause holds both ranks at the same boundary; a single step advances both by one
        assert c.post("/api/training/pause").status_code == 202

        def held():
            s = session()
            # "held": the pause has taken hold (the state says "paused" as soon as it is asked for, while
            # the boundary under way may still let its step go: then a single step would run two)
            ok = (
                s["state"] == "paused"
                and s["held"]
                and last_step(tmp_path, 0) == last_step(tmp_path, 1) == s["step"] - 1
            )
            return s["step"] if ok else None

        held_at = poll(held, what="both ranks held")
        assert c.post("/api/training/step").status_code == 202
        poll(
            lambda: held() == held_at + 1,
            what="one more step on both ranks",
            show=lambda: f"held at {held_at}: {session()} {last_step(tmp_path, 0)} {last_step(tmp_path, 1)}",
        )
        assert last_step(tmp_path, 0) == last_step(tmp_path, 1) == held_at

        snaps = c.get("/api/snapshots", params={"limit": 20}).json()["snapshots"]
        events = c.get("/api/events").json()["events"]
        members = c.get("/api/session").json()["groups"]["members"]
        assert c.post("/api/training/resume").status_code == 202
        for p in procs:
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0, out
    finally:
        c.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()

    rows0, rows1 = log(tmp_path, 0), log(tmp_path, 1)
    assert len(rows0) == len(rows1) == 300
    for a, b in zip(rows0, rows1, strict=True):
        assert a["step"] == b["step"]
        assert a["sum"] == b["sum"], f"ranks diverged at step {a['step']}"
        assert a["version"] == b["version"], f"config differs at step {a['step']}"
        assert a["applied"] == b["applied"], f"hook ids differ at step {a['step']}"
    assert_script_hook_agrees(rows0, rows1, 5)
    for rows in (rows0, rows1):
        for row in rows:
            if row["step"] < applied:
                assert row["clip_err"] is None
            elif row["step"] != 12:
                assert row["clip_err"] is not None and row["clip_err"] < 1e-7, row

    # per-rank spread of the local, pre-all-reduce norms (different data on each rank)
    spread = snaps[-1]["ranks"]
    groupwise = {"group_norm_min", "group_norm_max", "group_argmin", "group_argmax"}
    assert set(spread) == {
        "norm_min",
        "norm_max",
        "argmin",
        "argmax",
        "rank_norm",
        "rank_nonfinite",
        *groupwise,
    }
    # per group: each rank's norm over the group's tensors is at least each member's on that rank
    assert all(len(spread[k]) == len(members) for k in groupwise)
    for g, m in enumerate(members):
        assert spread["group_norm_min"][g] <= spread["group_norm_max"][g]
        assert spread["group_norm_max"][g] >= max(spread["norm_max"][i] for i in m) * (1 - 1e-12)
        assert spread["group_norm_min"][g] >= max(spread["norm_min"][i] for i in m) * (1 - 1e-12)
        assert {spread["group_argmin"][g], spread["group_argmax"][g]} <= {0, 1}
    assert all(lo < hi for lo, hi in zip(spread["norm_min"], spread["norm_max"], strict=True))
    assert {*spread["argmin"], *spread["argmax"]} == {0, 1}
    # per rank (the world size's length): the whole model's local norm, and a NaN's rank
    assert len(spread["rank_norm"]) == len(spread["rank_nonfinite"]) == 2
    assert all(v is not None and v > 0 for v in spread["rank_norm"])
    assert spread["rank_norm"][0] != spread["rank_norm"][1]
    # the NaN fed on rank 1 only is reported naming rank 1 and the first parameter it reached
    nonfinite = [e for e in events if e["kind"] == "nonfinite"]
    assert nonfinite and nonfinite[0]["rank"] == 1 and nonfinite[0]["step"] == 12
    assert nonfinite[0]["param"] == "0.weight" and nonfinite[0]["action_taken"] == "skip"
    assert any(e["kind"] == "step_skipped" and e["step"] == 12 for e in events)


def test_a_vanishing_rank_does_not_hang_the_others(tmp_path):
    """Rank 1 exits inside optimizer.step(): rank 0 waits at most dist_timeout in our collective,
    reports distributed_error, and goes on until DDP's own all-reduce fails."""
    master = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master), "WORLD_SIZE": "2"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                "--steps",
                "100",
                "--rate",
                "200",
                "--out",
                str(tmp_path),
                "--die-at",
                "20",
                "--dist-timeout",
                "5",
            ],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert procs[1].returncode == 3
    assert procs[0].returncode == 0 and "PEER LOST" in outs[0], outs[0]
    report = json.loads((tmp_path / "events0.json").read_text())
    errors = [e for e in report["events"] if e["kind"] == "distributed_error"]
    assert len(errors) == 1 and errors[0]["step"] == 20, report
    assert len(log(tmp_path, 0)) == 20  # rank 0 completed step 20 on its own, then DDP failed
