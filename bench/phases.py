"""Where the inspector's cost lands within a training step: each phase timed alone, plain and attached.

    .venv/bin/python bench/phases.py                            # the seed MLP, defaults: about 20 s
    .venv/bin/python bench/phases.py --every 1                  # every step sampled
    .venv/bin/python bench/phases.py --workload wide --every 1  # the wide MLP of bench/overhead.py

The seed MLP (Linear(10, 10) -> ReLU -> Linear(10, 1), batch 32, SGD), or bench/overhead.py's
wide MLP (784-2048-1024-10, batch 128, Adam; both on an MSE loss; with ``--every 1`` histograms of its first 8
parameters every 10 steps, as there), trains on two copies of the same model in one process, one
plain and one attached, in interleaved blocks; each phase of a step (``zero_grad``, forward,
backward, ``optimizer.step()``, ``insp.record(loss=...)``) is timed with ``time.perf_counter`` and
the medians over blocks are printed side by side. The inspector's own code runs in the forward
(the root's forward pre-hook) and in ``optimizer.step()`` (its step pre- and post-hooks): what
the other phases gain attached is what running our code does to the step around it (the caches
it evicts), and what ``optimizer.step()`` gains beyond the inspector's own accounting of its time
(``Cadence.costs``, printed below) is torch's dispatch of our hooks and the update's own slowdown.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import inspector  # noqa: E402

PHASES = ("zero_grad", "forward", "backward", "step", "record")


def _workload(name: str) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    if name == "wide":
        model = nn.Sequential(
            nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 1024), nn.ReLU(), nn.Linear(1024, 10)
        )
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        return model, opt, torch.randn(128, 784), torch.randn(128, 10)
    model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01), torch.randn(32, 10), torch.randn(32, 1)


def _block(
    model: nn.Module, opt: torch.optim.Optimizer, insp: Any, n: int, x: torch.Tensor, y: torch.Tensor
) -> list[float]:
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
            insp.record(loss=loss)
        t5 = pc()
        for i, d in enumerate((t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            total[i] += d
    return [t / n for t in total]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--workload", choices=("mlp", "wide"), default="mlp", help="the seed MLP (default) or the wide one"
    )
    ap.add_argument("--every", type=int, default=None, help="attach(every=N) (default: the budgeted cadence)")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved blocks per variant (default 15)")
    ap.add_argument("--steps", type=int, default=None, help="steps per block (default 300; wide: 10)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    wide = args.workload == "wide"
    steps = args.steps or (10 if wide else 300)
    p_model, p_opt, x, y = _workload(args.workload)
    a_model, a_opt, _, _ = _workload(args.workload)
    insp = inspector.attach(a_model, a_opt, every=args.every)
    if wide and args.every == 1:
        insp.set_hist_params(insp.params[:8])
    warm = 300 if wide else 1000  # the attached copy: past the cadence's dense start
    _block(p_model, p_opt, None, 30 if wide else warm, x, y)
    _block(a_model, a_opt, insp, warm, x, y)
    p_rows, a_rows = [], []
    for _ in range(args.rounds):
        p_rows.append(_block(p_model, p_opt, None, steps, x, y))
        insp.forget_gap()  # (the plain block is no step of its own: as in bench/overhead.py)
        a_rows.append(_block(a_model, a_opt, insp, steps, x, y))
    label = "wide MLP" if wide else "seed MLP"
    cadence = f"every={args.every}" if args.every else "defaults"
    print(f"{label}, {cadence}; us per step, medians of {args.rounds} blocks of {steps} steps")
    print(f"{'phase':10} {'plain':>9} {'attached':>9} {'added':>9}")
    tp = ta = 0.0
    for i, name in enumerate(PHASES):
        p = statistics.median(r[i] for r in p_rows) * 1e6
        a = statistics.median(r[i] for r in a_rows) * 1e6
        tp, ta = tp + p, ta + a
        print(f"{name:10} {p:9.1f} {a:9.1f} {a - p:+9.1f}")
    print(f"{'total':10} {tp:9.1f} {ta:9.1f} {ta - tp:+9.1f}")
    costs = {
        k: None if v is None else round(v * 1e6, 1)
        for k, v in {k: v for k, v in insp.cost.items() if k.endswith("_s")}.items()
    }
    print(f"the inspector's own accounting (us): {costs}")
    insp.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
