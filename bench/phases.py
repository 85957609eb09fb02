"""Where the inspector's cost lands within a training step: each phase timed alone, plain and attached.

    .venv/bin/python bench/phases.py            # the seed MLP, defaults: about 20 seconds
    .venv/bin/python bench/phases.py --every 1  # every step sampled

The seed MLP (Linear(10, 10) -> ReLU -> Linear(10, 1), batch 32, SGD) trains on two copies of the
same model in one process, one plain and one attached, in interleaved blocks; each phase of a
step (``zero_grad``, forward, backward, ``optimizer.step()``, ``insp.record(loss=...)``) is timed
with ``time.perf_counter`` and the medians over blocks are printed side by side. The inspector's
own code runs in the forward (the root's forward pre-hook) and in ``optimizer.step()`` (its step
pre- and post-hooks): what the other phases gain attached is what running our code does to the
step around it (the caches it evicts). The inspector's own accounting (``Cadence.costs``) is
printed below for comparison.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import inspector  # noqa: E402

PHASES = ("zero_grad", "forward", "backward", "step", "record")


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _block(model: nn.Module, opt: torch.optim.Optimizer, insp: object | None, n: int, x, y) -> list[float]:  # type: ignore[no-untyped-def]
    """Mean seconds per step of each phase over ``n`` steps."""
    pc = time.perf_counter
    total = [0.0] * len(PHASES)
    for _ in range(n):
        t0 = pc()
        opt.zero_grad()
        t1 = pc()
        loss = nn.functional.mse_loss(model(x), y)
        t2 = pc()
        loss.backward()
        t3 = pc()
        opt.step()
        t4 = pc()
        if insp is not None:
            insp.record(loss=loss)  # type: ignore[attr-defined]
        t5 = pc()
        for i, d in enumerate((t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            total[i] += d
    return [t / n for t in total]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--every", type=int, default=None, help="attach(every=N) (default: the budgeted cadence)")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved blocks per variant (default 15)")
    ap.add_argument("--steps", type=int, default=300, help="steps per block (default 300)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    x, y = torch.randn(32, 10), torch.randn(32, 1)
    plain, attached = _model(), _model()
    insp = inspector.attach(*attached, every=args.every)
    _block(*plain, None, 1000, x, y)  # warm-ups: past the cadence's dense start
    _block(*attached, insp, 1000, x, y)
    p_rows, a_rows = [], []
    for _ in range(args.rounds):
        p_rows.append(_block(*plain, None, args.steps, x, y))
        a_rows.append(_block(*attached, insp, args.steps, x, y))
    print(
        f"seed MLP, {'every=' + str(args.every) if args.every else 'defaults'}; us per step, medians of {args.rounds} blocks"
    )
    print(f"{'phase':10} {'plain':>8} {'attached':>9} {'added':>8}")
    tp = ta = 0.0
    for i, name in enumerate(PHASES):
        p = statistics.median(r[i] for r in p_rows) * 1e6
        a = statistics.median(r[i] for r in a_rows) * 1e6
        tp, ta = tp + p, ta + a
        print(f"{name:10} {p:8.1f} {a:9.1f} {a - p:+8.1f}")
    print(f"{'total':10} {tp:8.1f} {ta:9.1f} {ta - tp:+8.1f}")
    costs = {k: None if v is None else round(v * 1e6, 1) for k, v in insp._cadence.costs.items()}
    print(f"the inspector's own accounting (us): {costs}")
    insp.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
