"""Shared by the hardening tests and bench/load.py, bench/soak.py: a websocket client swarm in
another process, process memory, waiting for the core's hook changes, and the history store's
documented size bounds."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from tests.support import wait_until

REPO = Path(__file__).resolve().parents[2]


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process, from /proc (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


class Swarm:
    """`python -m tests.hardening.swarm ...`: websocket clients in another process (see swarm.py).

    `start()` returns once every client has its hello; `finish()` tells it to stop and returns
    its JSON report."""

    def __init__(
        self,
        url: str,
        *,
        readers: int,
        slow: int,
        stalled: int,
        reconnect: int,
        slow_delay: float = 0.2,
        reconnect_delay: float = 0.5,
        timeout: float = 60.0,
    ) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.hardening.swarm",
                "--url",
                url,
                "--readers",
                str(readers),
                "--slow",
                str(slow),
                "--stalled",
                str(stalled),
                "--reconnect",
                str(reconnect),
                "--slow-delay",
                str(slow_delay),
                "--reconnect-delay",
                str(reconnect_delay),
            ],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.timeout = timeout

    def start(self) -> None:
        line = self._line(self.timeout)
        assert line.strip() == "READY", f"swarm did not start: {line!r}\n{self._stderr()}"

    def _line(self, timeout: float) -> str:
        out: list[str] = []
        reader = threading.Thread(target=lambda: out.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if not out:
            self.kill()
            raise AssertionError(f"swarm: no output within {timeout} s\n{self._stderr()}")
        return out[0]

    def _stderr(self) -> str:
        if self.proc.poll() is None:
            return ""
        return self.proc.stderr.read() if self.proc.stderr else ""

    def finish(self) -> dict[str, Any]:
        self.proc.stdin.write("stop\n")
        self.proc.stdin.flush()
        line = self._line(self.timeout)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.kill()
        self._close_pipes()
        try:
            return json.loads(line)
        except ValueError:
            raise AssertionError(f"swarm: bad report {line!r}\n{self._stderr()}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self._close_pipes()

    def _close_pipes(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None and not pipe.closed:
                try:
                    pipe.close()
                except OSError:
                    pass


# -- the core's hook changes --------------------------------------------------------------------------


def quiesce(insp: Any, timeout: float = 20.0) -> int:
    """Wait until no accepted hook change is still pending in the core (training must be running,
    or paused: a paused training thread applies changes at once); returns `config_version`.

    Reads the registry's pending queue: the public API shows the requested config, not whether
    a removal is still pending."""
    wait_until(lambda: not insp._reg.pending, timeout, "pending hook changes to be applied")
    return int(insp.config_version)


# -- the history store's documented bounds (server/history/storage.py, "Thinning rule") -------------------------


def thinning_bound(latest: int, window: int, *, slack: int = 256 + 512) -> int:
    """The most rows the thinning rule keeps for a run whose newest step is `latest`: `window`
    in full, then about `window / 2` per octave of age (one more for an octave's edge), plus
    `slack` for the steps written since the last thinning pass (it runs every 64 steps; 256 is
    room to spare) and one commit's batch."""
    octaves = 0
    while window * 2**octaves <= latest:
        octaves += 1
    return window + octaves * (window // 2 + 1) + slack


# -- the soak (bench/soak.py, and a short form in test_soak.py) ----------------------------------------


def logical_size(conn: sqlite3.Connection) -> int:
    """The database's size in bytes as this connection reads it: page count times page size, the
    committed pages in the WAL included (what the file holds once the WAL is checkpointed)."""
    return int(conn.execute("PRAGMA page_count").fetchone()[0]) * int(
        conn.execute("PRAGMA page_size").fetchone()[0]
    )


def file_size(path: str | os.PathLike[str]) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def run_soak(
    steps: int,
    db: str | os.PathLike[str],
    *,
    every: int | None = 1,
    clients: bool = True,
    sample_s: float = 2.0,
    progress: Any = None,
    timeout: float = 3600.0,
) -> dict[str, Any]:
    """Train the `mlp` demo scenario uncapped for `steps` steps with history on, served, with
    websocket clients in another process (a reader, a slow reader, one that never reads, one
    that reconnects every 2 s); sample memory, the database and the queues every `sample_s`.

    Returns `{"samples": [...], "summary": {...}}`; `progress(sample)` is called per sample."""
    import time

    import torch

    import inspector
    from inspector import scenarios
    from server.app import create_app
    from server.history.storage import HistoryStore
    from server.live.demo import Trainer
    from server.live.source import LiveSource
    from server.serving import ThreadedServer
    from server.settings import Settings

    torch.set_num_threads(1)  # as the demo does for mlp
    sc = scenarios.make("mlp", seed=0)
    insp = inspector.attach(sc.model, sc.optimizer, every=every)
    trainer = Trainer(sc, insp, steps_per_second=None)
    store = HistoryStore(db)
    source = LiveSource(
        insp,
        mode="demo",
        store=store,
        trainer=trainer,
        owns_inspector=True,
        scenario={"name": sc.name, "description": sc.description, "try_this": sc.try_this},
    )
    app = create_app(source, Settings(port=0))
    server = ThreadedServer(app, Settings(port=0), quiet=True)
    t0 = time.monotonic()
    server.start()
    crowd = None
    if clients:
        crowd = Swarm(
            f"ws://127.0.0.1:{server.port}/ws", readers=1, slow=1, stalled=1, reconnect=1, reconnect_delay=2.0
        )
        crowd.start()
    reader = sqlite3.connect(f"file:{os.fspath(db)}?mode=ro", uri=True, check_same_thread=False)
    samples: list[dict[str, Any]] = []

    def sample() -> dict[str, Any]:
        hub_clients = list(app.state.hub.clients.values())
        run = source.run_id
        snap_rows = reader.execute("SELECT count(*) FROM snapshots WHERE run = ?", (run,)).fetchone()[0]
        scalar_rows = reader.execute("SELECT count(*) FROM scalars WHERE run = ?", (run,)).fetchone()[0]
        s = {
            "t": round(time.monotonic() - t0, 2),
            "step": insp.step,
            "rss": rss_bytes(),
            "db": file_size(db),
            "wal": file_size(f"{os.fspath(db)}-wal"),
            # the database's size as a reader sees it (its pages in the file and in the WAL): the
            # file alone jumps whenever the writer checkpoints the WAL into it
            "logical": logical_size(reader),
            "snapshot_rows": snap_rows,
            "scalar_rows": scalar_rows,
            "writer_queue": store._queue.qsize(),
            "paused": store.paused_reason,
            "dropped": store.dropped,
            "clients": len(hub_clients),
            "max_controls": max((len(c.controls) for c in hub_clients), default=0),
            "max_backlog_bytes": max((c.backlog_bytes for c in hub_clients), default=0),
            "pending_snapshots": sum(c.snapshot is not None for c in hub_clients),
            "recent_scalars": len(source._recent_scalars),
        }
        samples.append(s)
        if progress is not None:
            progress(s)
        return s

    try:
        next_sample = time.monotonic()
        while insp.step < steps:
            if trainer.error is not None:
                raise RuntimeError(f"training stopped: {trainer.error!r}")
            if time.monotonic() > t0 + timeout:
                raise RuntimeError(f"soak: {insp.step} of {steps} steps after {timeout} s")
            if time.monotonic() >= next_sample:
                sample()
                next_sample += sample_s
            time.sleep(0.05)  # polling the step count: a measurement loop, not a synchronisation
        trainer.stop()
        train_s = time.monotonic() - t0
        last = sample()
        report = crowd.finish() if crowd is not None else None
    finally:
        if crowd is not None:
            crowd.kill()
        server.stop()
        source.stop()  # idempotent: flushes and closes the store when the lifespan did not
    final_step = insp.step
    run = source.run_id
    rows = {
        t: reader.execute(
            f"SELECT count(*), coalesce(sum(length(data)), 0) FROM {t} WHERE run = ?", (run,)
        ).fetchone()
        for t in ("snapshots", "scalars")
    }
    newest = reader.execute("SELECT max(step) FROM snapshots WHERE run = ?", (run,)).fetchone()[0]
    with_events = reader.execute(
        "SELECT count(*) FROM snapshots WHERE run = ? AND n_events > 0", (run,)
    ).fetchone()[0]
    logical_end = logical_size(reader)
    reader.close()
    window = store.full_window
    summary = {
        "steps": final_step,
        "every": every,
        "seconds": round(train_s, 1),
        "steps_per_second": round(final_step / train_s, 1),
        "rss_start": samples[0]["rss"],
        "rss_max": max(s["rss"] for s in samples),
        "rss_end": last["rss"],
        "db_bytes": file_size(db),
        "db_logical": logical_end,
        "wal_bytes": file_size(f"{os.fspath(db)}-wal"),
        "wal_max": max(s["wal"] for s in samples),  # the WAL's size at its largest sample
        "snapshot_rows": rows["snapshots"][0],
        "snapshot_payload": rows["snapshots"][1],
        "scalar_rows": rows["scalars"][0],
        "scalar_payload": rows["scalars"][1],
        "snapshot_bound": thinning_bound(final_step, window) + with_events,
        "scalar_bound": thinning_bound(final_step, 16 * window),
        "newest_snapshot": newest,
        "snapshots_with_events": with_events,
        "max_writer_queue": max(s["writer_queue"] for s in samples),
        "max_controls": max(s["max_controls"] for s in samples),
        "max_backlog_bytes": max(s["max_backlog_bytes"] for s in samples),
        "max_clients": max(s["clients"] for s in samples),
        "paused": [s["paused"] for s in samples if s["paused"]],
        "dropped": last["dropped"],
        "clients": report,
    }
    return {"samples": samples, "summary": summary}


def check_soak(result: dict[str, Any], *, rss_growth: int = 48 << 20, db_growth: float = 1.5) -> list[str]:
    """What a soak must show (an empty list when it does):

    - the rows in the database within the thinning rule's bound, the newest step recorded;
    - no write failed, nothing dropped, the writer's queue never backed up;
    - every client's queue bounded: at most a few control messages waiting;
    - memory bounded: RSS grows by less than `rss_growth` bytes from a quarter of the run to its end;
    - the file grows with the log of the run: from half the run to the end, by a factor under
      `db_growth` (sizes as a reader sees them, WAL included: the file alone jumps at each of the
      writer's checkpoints), and it stays under twice the payload the bound allows (B-tree pages, free
      pages left by thinning) plus 1 MiB;
    - the WAL is checkpointed and truncated: no sample saw it past twice `WAL_LIMIT` (it may pass
      the limit by what one commit wrote, or for as long as readers hold the checkpoint off).
    """
    from server.history.storage import WAL_LIMIT

    s, samples = result["summary"], result["samples"]
    fails = []
    if s["snapshot_rows"] > s["snapshot_bound"]:
        fails.append(f"snapshots: {s['snapshot_rows']} rows > bound {s['snapshot_bound']}")
    if s["scalar_rows"] > s["scalar_bound"]:
        fails.append(f"scalars: {s['scalar_rows']} rows > bound {s['scalar_bound']}")
    if s["newest_snapshot"] is None or s["newest_snapshot"] < s["steps"] - 1:
        fails.append(f"newest snapshot recorded {s['newest_snapshot']}, training reached {s['steps']}")
    if s["paused"] or s["dropped"]:
        fails.append(f"history paused {s['paused'][:1]} / dropped {s['dropped']}")
    if s["max_writer_queue"] > 5000:
        fails.append(f"the writer's queue reached {s['max_writer_queue']} items")
    if s["max_controls"] > 64 or s["max_backlog_bytes"] > 1 << 20:
        fails.append(f"a client's queue grew: {s['max_controls']} messages, {s['max_backlog_bytes']} bytes")
    quarter = next(x for x in samples if x["step"] >= s["steps"] // 4)
    half = next(x for x in samples if x["step"] >= s["steps"] // 2)
    if s["rss_max"] - quarter["rss"] > rss_growth:
        fails.append(
            f"RSS grew by {(s['rss_max'] - quarter['rss']) / 2**20:.1f} MiB after step {quarter['step']}"
        )
    if half["logical"] and s["db_logical"] > db_growth * half["logical"]:
        fails.append(
            f"the database grew from {half['logical']} bytes at step {half['step']} to {s['db_logical']}"
        )
    per_snap = s["snapshot_payload"] / max(1, s["snapshot_rows"])
    per_scalar = s["scalar_payload"] / max(1, s["scalar_rows"])
    allowed = 2 * (s["snapshot_bound"] * per_snap + s["scalar_bound"] * per_scalar) + (1 << 20)
    if s["db_bytes"] > allowed:
        fails.append(f"the database is {s['db_bytes']} bytes, over {allowed:.0f}")
    if s["wal_max"] > 2 * WAL_LIMIT:
        fails.append(f"the WAL reached {s['wal_max']} bytes")
    return fails
