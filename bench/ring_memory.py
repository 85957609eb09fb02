"""The snapshot ring's host memory: what it accounts (``Feed.ring_bytes``) against what the
process really holds.

    .venv/bin/python bench/ring_memory.py                   # 300 tensors, every=1, 3,000 steps
    .venv/bin/python bench/ring_memory.py --tensors 3000 --steps 600

A model of ``--tensors`` parameter tensors (``Linear(1, 1)`` layers, weight and bias), attached
with ``every=1`` (every step sampled), trained ``--steps`` steps with a subscriber that does
nothing (the wire dicts are made, as the server has them made: ``--no-subscriber`` leaves them
out). Prints the snapshots kept, the ring's accounted bytes, the bytes it really holds (the
drop in tracemalloc's traced memory when the ring is emptied, a measure independent of the
accounting) and the process's resident memory (``VmRSS``) after attaching and at the end, so
its growth over the run against the ring's bound (``inspector.feed.MAX_RING_BYTES``).
"""

from __future__ import annotations

import argparse
import gc
import sys
import tracemalloc
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import inspector  # noqa: E402
from inspector.feed import MAX_RING_BYTES  # noqa: E402

MiB = 1 << 20


def rss() -> int:
    """The process's resident memory in bytes (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=300, help="parameter tensors (even; default 300)")
    ap.add_argument("--steps", type=int, default=3000, help="steps trained (default 3000)")
    ap.add_argument("--no-subscriber", action="store_true", help="no subscriber: no wire dicts made")
    ap.add_argument("--tracemalloc", action="store_true", help="trace the run (slower) and measure the ring")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(args.tensors // 2)])
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(2, 1)
    insp = inspector.attach(model, opt, every=1, checkpoints=0)
    if not args.no_subscriber:
        insp.subscribe(lambda kind, payload: None)

    def step() -> None:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()

    for _ in range(5):  # (allocations made once: the statistics' plans, the feed's thread)
        step()
    insp._feed.flush()
    gc.collect()
    if args.tracemalloc:
        tracemalloc.start()
    r0 = rss()
    for _ in range(args.steps):
        step()
    insp._feed.flush()
    gc.collect()
    r1 = rss()
    feed = insp._feed
    kept, accounted = len(feed.snapshots), feed.ring_bytes
    held = None
    if args.tracemalloc:
        before = tracemalloc.get_traced_memory()[0]
        with feed._lock:
            feed.snapshots.clear()
            feed._sizes.clear()
            feed.ring_bytes = 0
        gc.collect()
        held = before - tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
    insp.close()
    print(
        f"{args.tensors} tensors, every=1, {args.steps} steps, wire dicts {'no' if args.no_subscriber else 'yes'}"
    )
    print(f"snapshots kept              {kept}")
    print(
        f"ring accounted (ring_bytes) {accounted / MiB:7.1f} MiB ({accounted / max(kept, 1) / 1e3:.0f} KB a snapshot)"
    )
    if held is not None:
        print(
            f"ring held (tracemalloc)     {held / MiB:7.1f} MiB ({held / max(kept, 1) / 1e3:.0f} KB a snapshot)"
        )
    print(f"bound (MAX_RING_BYTES)      {MAX_RING_BYTES / MiB:7.1f} MiB")
    print(f"resident growth (VmRSS)     {(r1 - r0) / MiB:7.1f} MiB ({r0 / MiB:.0f} -> {r1 / MiB:.0f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
