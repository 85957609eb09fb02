"""The inspector's resident memory against the model's parameter memory (issue 12, point 3).

    .venv/bin/python bench/memory.py

For each CPU workload of bench/overhead.py (the seed MLP, the wide MLP, the tiny GPT) and a
GPT-2-small-sized model built on the meta device's shapes (no training: its update-ratio sample is
sized from the shapes, which is all the bound depends on), prints what the inspector keeps from one
step to the next (``StepStats.resident_bytes``: the update-ratio sample of
:mod:`inspector.update_ratio`) as bytes and as a share of the parameters' bytes, after training a
few steps with ``every=1`` (every step sampled). The bound is ``max(10 % of the parameters'
bytes, 1 MiB)``. bench/gpu_check.py measures the peak extra device memory on a GPU.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import inspector  # noqa: E402
from inspector.scenarios import make  # noqa: E402
from inspector.update_ratio import BUDGET, FLOOR, sample_numel, strides  # noqa: E402


def trained(name: str) -> tuple[int, int, int]:
    """(parameter bytes, resident bytes, largest parameter bytes) after 5 sampled steps."""
    if name == "wide":
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 1024), nn.ReLU(), nn.Linear(1024, 10)
        )
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        x, y = torch.randn(128, 784), torch.randint(0, 10, (128,))

        def step() -> None:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    else:
        sc = make(name)
        model, opt = sc.model, sc.optimizer

        def step() -> None:
            sc.step()

    with inspector.attach(model, opt, every=1) as insp:
        for _ in range(5):
            step()
        resident = insp._stats.resident_bytes
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    return sum(sizes), resident, max(sizes)


def gpt2_small_shapes() -> tuple[int, int]:
    """(parameter bytes in bf16, resident bytes) of a 12-layer d768 GPT's update-ratio sample."""
    d, v, ctx = 768, 50257, 1024
    shapes = [torch.Size([v, d]), torch.Size([ctx, d])]
    for _ in range(12):
        shapes += [torch.Size([d])] * 4 + [torch.Size([3 * d, d]), torch.Size([3 * d])]
        shapes += [torch.Size([d, d]), torch.Size([d]), torch.Size([4 * d, d]), torch.Size([4 * d])]
        shapes += [torch.Size([d, 4 * d]), torch.Size([d])]
    shapes += [torch.Size([d])] * 2
    item = [2] * len(shapes)
    s = strides(shapes, item)
    pbytes = sum(math.prod(x) * 2 for x in shapes)
    kept = sum(sample_numel(x, k) * 2 for x, k in zip(shapes, s, strict=True))
    return pbytes, kept


def main() -> int:
    print(f"bound: max({BUDGET:.0%} of the parameters' bytes, {FLOOR / 2**20:.0f} MiB)\n")
    print(f"{'workload':18} {'params':>10} {'resident':>10} {'share':>7} {'bound':>10}")
    for name in ("mlp", "wide", "tiny_gpt"):
        pbytes, resident, _ = trained(name)
        bound = max(BUDGET * pbytes, FLOOR)
        print(
            f"{name:18} {pbytes / 2**20:8.2f}Mi {resident / 2**20:8.2f}Mi {100 * resident / pbytes:6.1f}% "
            f"{bound / 2**20:8.2f}Mi"
        )
        assert resident <= bound, name
    pbytes, kept = gpt2_small_shapes()
    print(
        f"{'gpt2-small (bf16)':18} {pbytes / 2**20:8.1f}Mi {kept / 2**20:8.2f}Mi {100 * kept / pbytes:6.1f}% "
        f"{BUDGET * pbytes / 2**20:8.2f}Mi  (from shapes)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
