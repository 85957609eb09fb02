"""Faults: the database cannot be written or the disk fills, a replay reads
the file while a run records it, the server thread crashes in user mode.

The faults are injected three ways (tests run as root, so file permissions cannot): the
store's own fault hook (`HistoryStore.fault`, called before each commit), SQLite's `max_page_count`
on the writer's connection (a full database: SQLITE_FULL from SQLite itself), and a file-size
limit (`RLIMIT_FSIZE`) on a `gradient-inspector demo` process (a full disk: EFBIG from the
kernel), lifted from outside with `prlimit`.

In each case training goes on, a `history_paused` event goes out (to the socket too), the
session says why, and when writes succeed again `history_resumed` follows and the steps
trained meanwhile are in the file, without a gap.
"""

from __future__ import annotations

import json
import resource
import signal
import sqlite3
import subprocess
import sys
import threading

import httpx
import pytest
import torch
import uvicorn
from websockets.sync.client import connect

import inspector
import server.history.storage
from server.history.queries import HistoryQuery
from server.history.storage import HistoryStore
from tests.support import repo_env, start_demo, wait_until


def kinds(events) -> list[str]:
    return [e["kind"] for e in events]


def history_events(srv) -> list[dict]:
    return [e for e in srv.insp.events() if e["kind"].startswith("history_")]


def contiguous(steps: list[int], lo: int, hi: int) -> None:
    have = set(steps)
    missing = [s for s in range(lo, hi + 1) if s not in have]
    assert not missing, f"steps missing from the database: {missing[:10]} ({len(missing)} in all)"


def run_through_a_write_fault(srv, observer, break_writes, mend_writes, reason: str) -> None:
    srv.wait_step(5)
    obs = observer(srv.ws_url)
    c = srv.http()
    store = srv.source.store
    store.flush()
    assert history_events(srv) == []

    break_writes()
    paused = wait_until(
        lambda: [e for e in history_events(srv) if e["kind"] == "history_paused"], 20, "history_paused"
    )[0]
    assert reason in paused["reason"], paused
    first = srv.insp.step
    session = c.get("/api/session").json()
    assert session["history"]["paused"] and reason in session["history"]["paused"]
    srv.wait_step(first + 30)  # training goes on while nothing can be written
    wait_until(lambda: "history_paused" in kinds(obs.events), 10, "the event on the socket")
    assert c.get("/api/health").json() == {"status": "ok"}
    during = c.get("/api/snapshots", params={"limit": 5}).json()["snapshots"]
    assert during and during[-1]["step"] >= first + 25, "recent history is served from memory meanwhile"

    mend_writes()
    wait_until(lambda: "history_resumed" in kinds(history_events(srv)), 20, "history_resumed")
    assert kinds(history_events(srv)) == ["history_paused", "history_resumed"], "reported once each"
    wait_until(lambda: c.get("/api/session").json()["history"]["paused"] is None, 10, "session: not paused")
    wait_until(lambda: "history_resumed" in kinds(obs.events), 10, "the resume event on the socket")
    last = srv.wait_step(srv.insp.step + 5)
    # what the core published so far reaches the store's writer first (the feed's dispatcher hands
    # it over on a thread of its own: store.flush() alone covers only what the writer already has)
    assert srv.insp.flush()
    assert store.flush()
    run = srv.source.run_id
    contiguous(store.steps("snapshots", run), 1, last - 1)
    contiguous(store.steps("scalars", run), 1, last - 2)
    assert {"history_paused", "history_resumed"} <= set(kinds(store.events(run))), (
        "the events are recorded too"
    )
    assert store.dropped == 0
    obs.check()


@pytest.mark.slow
def test_a_failing_writer_pauses_history_and_resumes(live, observer):
    srv = live(rate=50.0)
    store = srv.source.store

    def full() -> None:
        raise sqlite3.OperationalError("database or disk is full")

    def set_fault() -> None:
        store.fault = full

    def clear_fault() -> None:
        store.fault = None

    run_through_a_write_fault(srv, observer, set_fault, clear_fault, "disk is full")


@pytest.mark.slow
def test_a_full_database_max_page_count(live, observer, monkeypatch):
    """SQLite itself refuses to grow the file: `PRAGMA max_page_count` set to the current size
    on the writer's own connection (run on the writer's thread, through the fault hook)."""
    writer: list[sqlite3.Connection] = []
    real_connect = server.history.storage.connect

    def spying_connect(path, *, create):
        conn = real_connect(path, create=create)
        if threading.current_thread().name == "gradient-inspector-store":
            writer.append(conn)
        return conn

    monkeypatch.setattr(server.history.storage, "connect", spying_connect)
    srv = live(rate=50.0)
    store = srv.source.store
    wait_until(lambda: writer, 10, "the writer's connection")
    conn = writer[0]
    limit: list[int] = []

    def cap() -> None:  # in the writer's thread, before its commit
        if limit:
            conn.execute(f"PRAGMA max_page_count = {limit[0]}")

    def fill_the_disk() -> None:
        pages = sqlite3.connect(store.path).execute("PRAGMA page_count").fetchone()[0]
        limit.append(pages)
        store.fault = cap

    def free_the_disk() -> None:
        limit[0] = 1 << 30

    run_through_a_write_fault(srv, observer, fill_the_disk, free_the_disk, "full")


def demo_with_a_file_size_limit(db, limit: int):
    """`gradient-inspector demo` in a process whose files may not grow past `limit` bytes
    (SIGXFSZ ignored, so a write past it fails with EFBIG instead of killing the process). The
    soft limit only: the hard one stays unlimited, so `prlimit` can lift it without privileges.
    Its output is not kept: a log file would be held to the same limit."""
    boot = (
        "import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.RLIM_INFINITY)); "
        "sys.argv = ['gradient-inspector'] + sys.argv[1:]; runpy.run_module('server', run_name='__main__')"
    )
    return start_demo(
        None,
        db=db,
        rate=50,
        command=[sys.executable, "-c", boot],
        cwd=db.parent,
        env=repo_env(PYTHONDONTWRITEBYTECODE="1"),
    )


@pytest.mark.slow
def test_a_full_disk_file_size_limit_in_a_demo_process(tmp_path):
    db = tmp_path / "h.sqlite"
    demo = demo_with_a_file_size_limit(db, 256 << 10)
    c = demo.client
    try:

        def events(kind):
            return [e for e in c.get("/api/events").json()["events"] if e["kind"] == kind]

        paused = wait_until(
            lambda: events("history_paused"), 60, "history_paused (the WAL reaching 256 KiB)"
        )[0]
        assert "cannot write" in paused["reason"]
        step = c.get("/api/session").json()["training"]["step"]
        wait_until(
            lambda: c.get("/api/session").json()["training"]["step"] >= step + 20, 30, "training goes on"
        )
        assert c.get("/api/session").json()["history"]["paused"]
        # the disk has room again
        resource.prlimit(
            demo.proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
        )
        wait_until(lambda: events("history_resumed"), 30, "history_resumed")
        assert len(events("history_paused")) == 1
        last = c.get("/api/session").json()["training"]["step"]
        wait_until(lambda: c.get("/api/session").json()["training"]["step"] >= last + 5, 30, "more steps")
    finally:
        code = demo.stop(20)
    assert code in (0, -signal.SIGTERM), code  # uvicorn re-raises SIGTERM once shut down
    store = HistoryStore(db, read_only=True)
    try:
        run = store.latest_run_id()
        steps = store.steps("snapshots", run)
        contiguous(steps, max(1, steps[-1] - 1023), steps[-1])
        assert steps[-1] >= last
        assert {"history_paused", "history_resumed"} <= set(kinds(store.events(run)))
    finally:
        store.close()


@pytest.mark.slow
def test_replay_and_export_read_the_file_while_a_run_records_it(cli_server, tmp_path):
    db = tmp_path / "h.sqlite"
    demo = cli_server(["demo", "--no-wait", "--db", str(db), "--steps-per-second", "50"])
    wait_until(lambda: demo.client.get("/api/session").json()["training"]["step"] >= 20, 30, "steps")
    replay = cli_server(["replay", str(db)])
    live_run = demo.client.get("/api/session").json()["run_id"]
    session = replay.client.get("/api/session").json()
    assert session["run_id"] == live_run and session["read_only"] is True and session["live"] is False

    newest = []

    def moved_on() -> bool:
        r = replay.client.get("/api/snapshots", params={"limit": 3})
        assert r.status_code == 200, r.text
        snaps = r.json()["snapshots"]
        if snaps and (not newest or snaps[-1]["step"] > newest[-1]):
            newest.append(snaps[-1]["step"])
        return len(newest) >= 4

    wait_until(moved_on, 30, "the replay to see new rows as they are committed")
    assert newest == sorted(newest)
    lag = demo.client.get("/api/session").json()["training"]["step"] - newest[-1]
    assert lag < 150, f"the replay is {lag} steps behind (history commits every 0.5 s)"
    with connect(f"ws://127.0.0.1:{replay.port}/ws", proxy=None, max_size=None) as ws:
        hello = json.loads(ws.recv(timeout=10))
        assert hello["type"] == "hello" and hello["history"]
    assert replay.client.post("/api/training/pause").status_code == 403
    out = subprocess.run(
        [sys.executable, "-m", "server", "export", str(db), "--format", "jsonl"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env=repo_env(),
    )
    assert out.returncode == 0, out.stderr
    assert sum(1 for line in out.stdout.splitlines() if '"step"' in line) >= 20
    runs = demo.client.get("/api/runs").json()["runs"]
    assert [r["id"] for r in runs] == [live_run], "replay and export add no run"
    assert replay.client.get("/api/runs").json()["runs"][0]["id"] == live_run
    assert demo.client.get("/api/health").json() == {"status": "ok"}


def test_a_crash_of_the_server_thread_while_serving(tmp_path, monkeypatch):
    """User mode: the server thread dies while a client is connected and history records; the
    user's loop never notices, `insp` reports it (a `server_error` event, the handle's error),
    and the history goes on recording: every step's snapshot and scalars,
    the server_error event and a hook change made after the crash."""
    crash = threading.Event()
    real_tick = uvicorn.Server.on_tick

    async def on_tick(self, counter):
        if crash.is_set():
            raise RuntimeError("injected crash")
        return await real_tick(self, counter)

    monkeypatch.setattr(uvicorn.Server, "on_tick", on_tick)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 4), torch.randn(8, 1)

    def train(insp, n):
        for _ in range(n):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            insp.record(loss=loss)

    db = tmp_path / "user.sqlite"
    insp = inspector.attach(model, opt, every=1)
    try:
        url = insp.serve(port=0, db=db)
        train(insp, 3)
        port = insp._dashboard.server.port
        with connect(f"ws://127.0.0.1:{port}/ws", proxy=None, max_size=None) as ws:
            assert json.loads(ws.recv(timeout=10))["type"] == "hello"
            at_crash = insp.step
            crash.set()
            # the user's loop keeps going; nothing raises into it
            wait_until(
                lambda: train(insp, 1) or any(e["kind"] == "server_error" for e in insp.events()),
                30,
                "server_error",
            )
        event = next(e for e in insp.events() if e["kind"] == "server_error")
        assert "injected crash" in event["message"]
        assert isinstance(insp._dashboard.error, RuntimeError) and "injected crash" in str(
            insp._dashboard.error
        )
        before = insp.step
        train(insp, 10)
        assert insp.step == before + 10
        hook = insp.add_hook("clip_value", target="*", threshold=1.0)  # applied at the next step
        train(insp, 5)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}api/health", timeout=2, trust_env=False)
        final = insp.step
    finally:
        insp.close()
    store = HistoryStore(db, read_only=True)
    try:
        run = store.latest_run_id()
        assert store.steps("snapshots", run) == list(range(1, final + 1)), "every step, after the crash too"
        assert final > at_crash
        assert [r["step"] for r in store.scalars(run)] == list(range(1, final + 1))
        events = store.events(run)
        assert any(e["kind"] == "server_error" and "injected crash" in e["message"] for e in events)
        assert any(e["kind"] == "hook_applied" and e["hook_id"] == hook.id for e in events)
        version, hooks = store.hooks(run)
        assert [h["id"] for h in hooks] == [hook.id] and hooks[0]["applied_step"] == final - 4
        assert store.run(run)["last_step"] == final
    finally:
        store.close()


def test_stopping_the_demo_records_the_last_steps(live):
    """The core hands messages over on its own thread, which may be steps behind training (a
    busy machine; here a slow second subscriber): stopping the server must not cut them off."""
    import time

    srv = live(rate=None)
    srv.wait_step(20)
    srv.insp.subscribe(lambda kind, payload: time.sleep(0.002))  # lag on purpose
    srv.wait_step(srv.insp.step + 200)
    srv.stop()
    store = HistoryStore(srv.db, read_only=True)
    try:
        run = store.latest_run_id()
        assert store.steps("snapshots", run)[-1] == srv.insp.step
        assert store.scalars(run, HistoryQuery(limit=1))[0]["step"] >= srv.insp.step - 1
    finally:
        store.close()
