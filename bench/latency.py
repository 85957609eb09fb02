"""Step-to-client latency: how long after the step boundary a websocket client holds the snapshot.

    .venv/bin/python bench/latency.py                       # 50 steps/s, 1 and 10 clients, 10 s each
    .venv/bin/python bench/latency.py --rate 50 --clients 1,10 --seconds 10 --scenario mlp

A `gradient-inspector demo` server runs in one process; the clients run in another
(asyncio, one connection each). Latency = receive time - the snapshot's `time`
(stamped by the core at the step boundary; both processes read the same clock).
The first `--warmup` seconds are dropped. The goal is p95 < 100 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.request import urlopen

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support import start_demo  # noqa: E402


def get_json(url: str) -> dict:
    with urlopen(url, timeout=10) as r:
        return json.load(r)


async def client_main(url: str, n: int, seconds: float, warmup: float) -> dict:
    """n clients on one event loop; returns their latencies (seconds) and message counts."""
    from websockets.asyncio.client import connect

    latencies: list[list[float]] = [[] for _ in range(n)]
    start = time.time()

    async def one(i: int) -> None:
        async with connect(url, max_size=None, proxy=None) as ws:
            while True:
                remaining = start + warmup + seconds - time.time()
                if remaining <= 0:
                    return
                try:
                    text = await asyncio.wait_for(ws.recv(), remaining)
                except TimeoutError:
                    return
                now = time.time()
                if now - start < warmup:
                    continue
                msg = json.loads(text)
                if msg["type"] == "snapshot":
                    latencies[i].append(now - msg["data"]["time"])

    await asyncio.gather(*(one(i) for i in range(n)))
    return {"latencies": latencies}


def run_clients(url: str, n: int, seconds: float, warmup: float) -> list[list[float]]:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--client",
            url,
            "--n",
            str(n),
            "--seconds",
            str(seconds),
            "--warmup",
            str(warmup),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=seconds + warmup + 120,
    )
    return json.loads(out.stdout)["latencies"]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate", type=float, default=50.0, help="training steps per second (default 50)")
    parser.add_argument(
        "--clients",
        default="0,1,10",
        help="client counts to measure (default 0,1,10; 0: the step rate with no client)",
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per count (default 10)")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds dropped first (default 2)")
    parser.add_argument("--scenario", default="mlp", help="demo scenario (default mlp)")
    parser.add_argument("--client", help=argparse.SUPPRESS)  # internal: run clients against this URL
    parser.add_argument("--n", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.client:
        print(json.dumps(asyncio.run(client_main(args.client, args.n, args.seconds, args.warmup))))
        return

    with tempfile.TemporaryDirectory() as tmp:
        server = start_demo(
            Path(tmp),
            scenario=args.scenario,
            rate=args.rate,
            db=os.path.join(tmp, "bench.sqlite"),
            timeout=120,
        )
        port, base = server.port, server.base
        try:
            print(
                f"scenario {args.scenario}, cap {args.rate:g} steps/s, {args.seconds:g} s per row, "
                f"clients in another process; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
            )
            print(f"{'clients':>7} {'steps/s':>8} {'snapshots':>9} {'p50 ms':>7} {'p95 ms':>7} {'max ms':>7}")
            for n in [int(x) for x in args.clients.split(",")]:
                s0, t0 = get_json(base + "/api/session")["training"]["step"], time.monotonic()
                if n == 0:
                    time.sleep(args.seconds)
                    s1, t1 = get_json(base + "/api/session")["training"]["step"], time.monotonic()
                    print(f"{0:>7} {(s1 - s0) / (t1 - t0):>8.1f}")
                    continue
                lat = run_clients(f"ws://127.0.0.1:{port}/ws", n, args.seconds, args.warmup)
                s1, t1 = get_json(base + "/api/session")["training"]["step"], time.monotonic()
                flat = [x for per in lat for x in per]
                if not flat:
                    print(f"{n:>7} no snapshots received")
                    continue
                print(
                    f"{n:>7} {(s1 - s0) / (t1 - t0):>8.1f} {len(flat):>9} {pct(flat, 0.5) * 1e3:>7.1f} "
                    f"{pct(flat, 0.95) * 1e3:>7.1f} {max(flat) * 1e3:>7.1f}"
                )
                per_client = [statistics.median(x) * 1e3 for x in lat if x]
                print(f"{'':>7} per-client median ms: min {min(per_client):.1f}, max {max(per_client):.1f}")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
