"""Load: the step rate of `gradient-inspector demo` with 20 websocket clients, against none.

    .venv/bin/python bench/load.py                                  # tiny_gpt, uncapped: ~7 min
    .venv/bin/python bench/load.py --scenario mlp --seconds 15      # a quick look
    .venv/bin/python bench/load.py --reconnect-delay 0              # reconnecting clients with no backoff

The server is `gradient-inspector demo --scenario S --steps-per-second 0` (no cap, history on,
every step sampled, torch's default threads for tiny_gpt) in a process of its own; the clients
run in another (tests/hardening/swarm.py): 8 read everything, 4 read one message every 0.2 s,
4 never read (not even at the TCP level), 4 reconnect in a loop (hello, three snapshots, close,
`--reconnect-delay` s, again; the dashboard's shortest backoff is 0.5 s).

Windows of `--seconds` each, alternating: no clients, 20 clients, no clients, ... (`--rounds`
loaded windows, each between two unloaded ones, a fresh set of clients each time): the machine
is shared, so each loaded window is compared with the mean of its two neighbours, and the
median of those ratios is the figure. Reported per window: the step rate (the server's own step
count, polled every 2 s) and the server's CPU seconds per step (/proc: training plus serving);
then the server's RSS, and what the clients saw (snapshots in order, closes, reconnect cycles,
hello latency). Exit status 1 when a client saw steps out of order or the server's RSS grew by
more than 256 MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from urllib.request import urlopen

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.hardening.tools import Swarm, rss_bytes  # noqa: E402
from tests.support import start_demo  # noqa: E402


def get_json(url: str) -> dict:
    with urlopen(url, timeout=30) as r:
        return json.load(r)


class Demo:
    """The demo server (tests/support.py's `start_demo`: on a free port, up once /api/health
    answers; its output in a log file beside the database)."""

    def __init__(self, scenario: str, rate: str, db: str) -> None:
        self.server = start_demo(Path(db).parent, scenario=scenario, rate=rate, db=db, cwd=REPO, timeout=120)
        self.proc = self.server.proc
        self.port = self.server.port
        self.base = self.server.base

    def step(self) -> int:
        return int(get_json(f"{self.base}/api/session")["training"]["step"])

    def rss(self) -> int:
        return rss_bytes(self.proc.pid)

    def cpu(self) -> float:
        """CPU seconds (user + system) the server process has used."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.server.stop(30)


def window(demo: Demo, seconds: float, rss: list[int]) -> dict[str, float]:
    """The step rate over `seconds` (the server's step count, polled every 2 s) and the server's
    CPU seconds per step."""
    s0, c0, t0 = demo.step(), demo.cpu(), time.monotonic()
    while time.monotonic() < t0 + seconds:
        rss.append(demo.rss())
        time.sleep(min(2.0, max(0.0, t0 + seconds - time.monotonic())))  # a measurement window
    s1, c1 = demo.step(), demo.cpu()
    steps = s1 - s0
    return {
        "rate": steps / (time.monotonic() - t0),
        "steps": steps,
        "cpu_per_step": (c1 - c0) / steps if steps else float("nan"),
    }


def show(label: str, w: dict[str, float]) -> None:
    print(
        f"  {label:11s} {w['rate']:8.3f} steps/s ({w['steps']} steps), server CPU {w['cpu_per_step'] * 1e3:.1f} ms/step",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", default="tiny_gpt", choices=("mlp", "exploding", "nan", "tiny_gpt"))
    p.add_argument("--rate", default="0", help="the demo's --steps-per-second (default 0: no cap)")
    p.add_argument("--seconds", type=float, default=45.0, help="length of each window (default 45)")
    p.add_argument("--rounds", type=int, default=4, help="loaded windows (default 4)")
    p.add_argument("--warmup", type=float, default=10.0)
    p.add_argument("--readers", type=int, default=8)
    p.add_argument("--slow", type=int, default=4)
    p.add_argument("--stalled", type=int, default=4)
    p.add_argument("--reconnect", type=int, default=4)
    p.add_argument("--reconnect-delay", type=float, default=0.5)
    args = p.parse_args(argv)

    db = str(Path(tempfile.mkdtemp(prefix="gi-load-")) / "load.sqlite")
    n = args.readers + args.slow + args.stalled + args.reconnect
    print(
        f"load: {args.scenario}, --steps-per-second {args.rate}, {n} clients, windows of {args.seconds:.0f} s",
        flush=True,
    )
    demo = Demo(args.scenario, args.rate, db)
    fails: list[str] = []
    offs: list[dict[str, float]] = []
    ons: list[dict[str, float]] = []
    reports: list[dict] = []
    rss_first: list[int] = []
    rss_off: list[int] = []
    rss_on: list[int] = []
    try:
        t_end = time.monotonic() + args.warmup
        while demo.step() < 2 or time.monotonic() < t_end:
            time.sleep(0.5)
        offs.append(window(demo, args.seconds, rss_first))
        show("no clients", offs[-1])
        for _ in range(args.rounds):
            crowd = Swarm(
                f"ws://127.0.0.1:{demo.port}/ws",
                readers=args.readers,
                slow=args.slow,
                stalled=args.stalled,
                reconnect=args.reconnect,
                reconnect_delay=args.reconnect_delay,
                timeout=300,
            )
            crowd.start()
            ons.append(window(demo, args.seconds, rss_on))
            reports.append(crowd.finish())
            final = demo.step()
            show(f"{n} clients", ons[-1])
            offs.append(window(demo, args.seconds, rss_off))
            show("no clients", offs[-1])
    finally:
        demo.stop()

    ratios = [
        on["rate"] / statistics.mean([a["rate"], b["rate"]])
        for on, a, b in zip(ons, offs[:-1], offs[1:], strict=True)
    ]
    cpu = [
        on["cpu_per_step"] / statistics.mean([a["cpu_per_step"], b["cpu_per_step"]])
        for on, a, b in zip(ons, offs[:-1], offs[1:], strict=True)
    ]
    print(
        f"\nstep rate with {n} clients / without: median {statistics.median(ratios):.2f} "
        f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)}); without clients "
        f"{statistics.median(o['rate'] for o in offs):.3f} steps/s, with {statistics.median(o['rate'] for o in ons):.3f}"
    )
    print(
        f"server CPU per step with / without: median {statistics.median(cpu):.2f} "
        f"(rounds: {', '.join(f'{r:.2f}' for r in cpu)})"
    )
    rss_base, rss_load, rss_after = rss_first, rss_on, rss_off
    report = {"stalled": reports[-1]["stalled"], "clients": [c for r in reports for c in r["clients"]]}
    growth = max(rss_load + rss_after) - max(rss_base)
    print(
        f"server RSS: {max(rss_base) / 2**20:.0f} MiB in the first window, {max(rss_load) / 2**20:.0f} MiB at most "
        f"with clients, {rss_after[-1] / 2**20:.0f} MiB at the end"
    )
    by_kind: dict[str, list[dict]] = {}
    for c in report["clients"]:
        by_kind.setdefault(c["kind"], []).append(c)
        if c["violations"] or c["errors"]:
            fails.append(f"{c['kind']} {c['index']}: {c['violations'][:2]} {c['errors'][:2]}")
    hellos = sorted(h for c in report["clients"] for h in c["hello_s"])
    for kind, cs in by_kind.items():
        print(
            f"  {kind:9s}: snapshots {[c['snapshots'] for c in cs]}, closes {[c['close_codes'] for c in cs]}"
            + (f", cycles {[c['cycles'] for c in cs]}" if kind == "reconnect" else "")
            + f", last step seen {max((c['last_step'] or 0) for c in cs)} of {final}"
        )
    if hellos:
        print(
            f"  hello: {len(hellos)}, p50 {hellos[len(hellos) // 2]:.3f} s, "
            f"p95 {hellos[int(len(hellos) * 0.95)]:.3f} s"
        )
    print(f"  stalled clients (never read): {report['stalled']}")
    if growth > 256 << 20:
        fails.append(f"server RSS grew by {growth / 2**20:.0f} MiB")
    print("OK" if not fails else "FAILED:\n  " + "\n  ".join(fails))
    return 1 if fails else 0


if __name__ == "__main__":
    raise SystemExit(main())
