"""Soak: 100k steps of the `mlp` demo scenario, uncapped, with history on and websocket clients.

    .venv/bin/python bench/soak.py                      # 100,000 steps (minutes: see the closing line)
    .venv/bin/python bench/soak.py --steps 10000        # a shorter run
    .venv/bin/python bench/soak.py --every 2 --json soak.json

What runs: the demo's own pieces in this process (the scenario stepped by `server.live.demo.Trainer`
without a rate cap, `inspector.attach(..., every=1)` as `gradient-inspector demo` does, the
`LiveSource` recording to a fresh SQLite file, the app on uvicorn on a free loopback port), and
in another process four websocket clients: a reader, a slow reader, one that never reads (not
even at the TCP level) and one that reconnects every 2 s (tests/hardening/swarm.py).

What it checks (tests/hardening/tools.py, `check_soak`; a shorter form runs in CI as
tests/hardening/test_soak.py): rows within the store's thinning bound (server/history/storage.py: the
newest 1024 steps in full, then about 512 per doubling of age; scalars with a 16,384-step
window), the file growing with the log of the run's length and holding at most about twice what
it stores, the WAL checkpointed and truncated (never past twice its 2 MiB limit), no write
failure and no backed-up writer, every client's queue bounded, and the process's RSS flat after
the first quarter.
Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.hardening.tools import check_soak, run_soak  # noqa: E402


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--every", type=int, default=1, help="the inspector's sampling (default 1, as the demo)")
    p.add_argument("--db", default=None, help="the database file (default: a new temporary one)")
    p.add_argument("--sample-seconds", type=float, default=5.0)
    p.add_argument("--json", default=None, metavar="OUT", help="write the samples and the summary here")
    args = p.parse_args(argv)

    db = args.db or str(Path(tempfile.mkdtemp(prefix="gi-soak-")) / "soak.sqlite")
    print(f"soak: {args.steps} steps of mlp, every={args.every}, history in {db}", flush=True)
    last = [0.0]

    def progress(s: dict) -> None:
        if s["t"] - last[0] >= 30 or s["t"] < 1:
            last[0] = s["t"]
            print(
                f"  {s['t']:7.1f} s  step {s['step']:7d}  RSS {mib(s['rss'])}  db {mib(s['db'])} "
                f"(+wal {mib(s['wal'])})  rows {s['snapshot_rows']}/{s['scalar_rows']}  "
                f"writer queue {s['writer_queue']}  clients {s['clients']}",
                flush=True,
            )

    t0 = time.monotonic()
    result = run_soak(args.steps, db, every=args.every, sample_s=args.sample_seconds, progress=progress)
    s = result["summary"]
    fails = check_soak(result)
    clients = s.pop("clients") or {}
    print(
        f"\n{s['steps']} steps in {s['seconds']:.0f} s ({s['steps_per_second']:.0f} steps/s); "
        f"{time.monotonic() - t0:.0f} s in all"
    )
    print(
        f"RSS: {mib(s['rss_start'])} at the first sample, {mib(s['rss_max'])} at most, {mib(s['rss_end'])} at the end"
    )
    print(
        f"database: {mib(s['db_bytes'])} (+ WAL {mib(s['wal_bytes'])}, at most {mib(s['wal_max'])}); snapshots {s['snapshot_rows']} rows "
        f"(bound {s['snapshot_bound']}, payload {mib(s['snapshot_payload'])}), scalars {s['scalar_rows']} rows "
        f"(bound {s['scalar_bound']}, payload {mib(s['scalar_payload'])})"
    )
    print(
        f"queues: writer at most {s['max_writer_queue']} items; a client at most {s['max_controls']} control "
        f"messages / {s['max_backlog_bytes']} bytes waiting"
    )
    for c in clients.get("clients", []):
        print(
            f"  client {c['kind']}: {c['snapshots']} snapshots, cycles {c['cycles']}, closes {c['close_codes']}, "
            f"order violations {len(c['violations'])}, errors {c['errors'][:1]}"
        )
        if c["violations"] or c["errors"]:
            fails.append(f"client {c['kind']}: {c['violations'][:2]} {c['errors'][:2]}")
    if args.json:
        Path(args.json).write_text(json.dumps({**result, "summary": {**s, "clients": clients}}, indent=1))
    print("OK" if not fails else "FAILED:\n  " + "\n  ".join(fails))
    return 1 if fails else 0


if __name__ == "__main__":
    raise SystemExit(main())
