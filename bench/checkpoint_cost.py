"""What an automatic checkpoint costs (``attach(..., checkpoint_every=N)``): time per checkpoint
and host memory, on the ``deep`` demo's model and on a plain model of 1,000 tensors.

    .venv/bin/python bench/checkpoint_cost.py                 # both models, ~1 min on a CPU
    .venv/bin/python bench/checkpoint_cost.py --blocks 9 --steps 10

Each model trains with Adam (the ``deep`` scenario's own data and loss) on one thread, attached once with ``checkpoint_every=1`` and
``checkpoints=3``. Blocks of ``--steps`` steps alternate: the schedule off
(``insp.checkpoints.every = None``) and on (a checkpoint at every step's boundary). A block's cost
per checkpoint is its time per step minus the mean of its two neighbouring off blocks' (the
machine is shared); the figure is the median over ``--blocks`` on-blocks. Also the median of the
copies' own ``took`` (the time inside the boundary, from the checkpoint's listing), the bytes of
one checkpoint (``list()``'s ``bytes``: the model's and Adam's tensors, about 3x the parameters)
and the process's RSS growth from before the first checkpoint (the C heap trimmed) to three
kept, per checkpoint (what the host really gave them, allocator included).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import inspector  # noqa: E402
from inspector.scenarios import make  # noqa: E402
from tests.hardening.tools import rss_bytes  # noqa: E402


def deep() -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None], str]:
    sc = make("deep", seed=0)
    # Adam in place of the demo's SGD: its moments are what a checkpoint mostly copies in a real run
    sc.optimizer = torch.optim.Adam(sc.model.parameters(), lr=1e-3)
    return sc.model, sc.optimizer, sc.step, "deep (110-block Llama, 993 tensors)"


def plain() -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None], str]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(500)])  # 1,000 tensors
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(8, 64)

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    return model, opt, step, "plain (500 Linear(64, 64), 1,000 tensors)"


def trim() -> None:
    """Free what can be freed, and give the C heap's free pages back (glibc), so that RSS growth
    after it is memory taken, not reused."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def measure(build, blocks: int, steps: int) -> dict:
    model, opt, step, name = build()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    insp = inspector.attach(model, opt, checkpoint_every=1, checkpoints=3)
    cps = insp.checkpoints
    try:
        cps.every = None
        for _ in range(3):
            step()  # Adam's state exists
        trim()
        rss0 = rss_bytes()
        cps.every = 1
        for _ in range(3):
            step()
        rss3 = rss_bytes()
        kept = cps.list()
        one = kept[-1]["bytes"]

        def block(on: bool) -> float:
            cps.every = 1 if on else None
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            return (time.perf_counter() - t0) / steps

        offs, ons, took = [block(False)], [], []
        for _ in range(blocks):
            ons.append(block(True))
            took += [c["took"] for c in cps.list()]
            offs.append(block(False))
        costs = [on - (offs[i] + offs[i + 1]) / 2 for i, on in enumerate(ons)]
        return {
            "name": name,
            "tensors": len(list(model.parameters())),
            "params": params,
            "bytes": one,
            "rss": (rss3 - rss0) / 3,
            "step": statistics.median(offs),
            "cost": statistics.median(costs),
            "took": statistics.median(took),
        }
    finally:
        insp.close()


def mb(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=7, help="on-blocks (each between two off-blocks)")
    ap.add_argument("--steps", type=int, default=10, help="steps a block")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = [measure(b, args.blocks, args.steps) for b in (deep, plain)]
    print(
        f"torch {torch.__version__}, 1 thread, Adam, checkpoints=3; medians of {args.blocks} interleaved blocks"
    )
    head = ("model", "params", "one checkpoint", "RSS growth each", "step", "cost each", "copy (took)")
    print(" | ".join(head))
    for r in rows:
        print(
            " | ".join(
                (
                    r["name"],
                    mb(r["params"]),
                    f"{mb(r['bytes'])} ({r['bytes'] / r['params']:.1f}x)",
                    mb(r["rss"]),
                    f"{r['step'] * 1e3:.1f} ms",
                    f"{r['cost'] * 1e3:.2f} ms",
                    f"{r['took'] * 1e3:.2f} ms",
                )
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
