"""The inspector's resident memory against the model's parameter memory.

    .venv/bin/python bench/memory.py

For each CPU workload of bench/overhead.py (the seed MLP, the wide MLP, the tiny GPT) and a
GPT-2-small-sized model built on the meta device's shapes (no training: its update-ratio sample is
sized from the shapes, which is all the bound depends on), prints what the inspector keeps from one
step to the next (``StepStats.resident_bytes``: the update-ratio sample of
:mod:`inspector.stats.update_ratio`) as bytes and as a share of the parameters' bytes, after training a
few steps with ``every=1`` (every step sampled). The bound is ``max(10 % of the parameters'
bytes, 1 MiB)``. bench/gpu_check.py measures the peak extra device memory on a GPU.

Transient memory (``--no-transient`` skips it): the most bytes that tensors made by the
inspector's own ops hold at once during sampled steps, with every parameter's histogram taken
every sampled step, against the largest parameter's bytes (the bound; a histogram's
scratch of 2^18 float32 values and their bins comes on top). A row with a ``pre_step`` hook that
edits every gradient in place shows the raw copies histograms then need, within the largest
parameter (``histsel.COPY_FLOOR``). On the CPU
there is no allocator counter to read, so a ``TorchDispatchMode`` counts each tensor an op makes
new memory for while the innermost ``inspector.*`` frame on the stack is not a demo scenario's
(whose models are the user's code here), until the tensor is freed (by its
Python object's lifetime: a view that outlives its base is not counted, nor the allocator's own
slack). Each workload also in bfloat16 parameters where it trains so on the CPU (the wide MLP).
"""

from __future__ import annotations

import argparse
import math
import sys
import weakref
from pathlib import Path

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import inspector  # noqa: E402
from inspector.scenarios import make  # noqa: E402
from inspector.stats.update_ratio import BUDGET, FLOOR, sample_numel, strides  # noqa: E402


class OursLive(TorchDispatchMode):
    """The peak bytes of live tensors made by the inspector's own ops (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0

    def _release(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        f = sys._getframe(1)
        while f is not None and not f.f_globals.get("__name__", "").startswith("inspector."):
            f = f.f_back
        if f is None or f.f_globals["__name__"].startswith("inspector.scenarios"):
            return out  # not ours: the model (a demo scenario's too), the optimizer
        seen = {
            a.untyped_storage().data_ptr()
            for a in pytree.tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor)
        }
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                nbytes = t.untyped_storage().nbytes()
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._release, nbytes)
        return out


def trained(
    name: str, dtype: torch.dtype = torch.float32, transient: bool = False, hook: str | None = None
) -> tuple[int, int, int, int]:
    """(parameter bytes, resident bytes, largest parameter bytes, transient peak bytes or -1)
    after 5 sampled steps (with ``transient``: 3 more, each with every histogram, measured)."""
    if name == "wide":
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 1024), nn.ReLU(), nn.Linear(1024, 10)
        ).to(dtype)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        x, y = torch.randn(128, 784, dtype=dtype), torch.randint(0, 10, (128,))

        def step() -> None:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    else:
        sc = make(name)
        model, opt = sc.model, sc.optimizer

        def step() -> None:
            sc.step()

    peak = -1
    with inspector.attach(model, opt, every=1, hist_every=1) as insp:
        insp.set_hist_params(insp.params)
        if hook is not None:  # an in-place pre_step hook on every parameter
            insp.add_hook(hook, target="*", **{"clip_norm": {"max_norm": 0.01}}.get(hook, {}))
        for _ in range(5):
            step()
        resident = insp.memory["update_sample"]
        if transient:
            with OursLive() as mode:
                for _ in range(3):
                    step()
            peak = mode.peak
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    return sum(sizes), resident, max(sizes), peak


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


def _size(n: float) -> str:
    return f"{n / 2**20:.2f}Mi" if n >= 2**20 else f"{n / 2**10:.1f}Ki"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--no-transient", action="store_true", help="leave out the transient memory (slow on the CPU)"
    )
    args = ap.parse_args(argv)
    print(
        f"resident bound: max({BUDGET:.0%} of the parameters' bytes, {FLOOR / 2**20:.0f} MiB); transient bound: the largest parameter\n"
        "(a histogram's 1.25 MiB scratch on top)\n"
    )
    print(
        f"{'workload':24} {'params':>10} {'resident':>10} {'share':>7} {'bound':>10}"
        f"   {'transient':>10} {'largest p':>10} {'ratio':>6}"
    )
    rows = [
        ("mlp", torch.float32, None),
        ("wide", torch.float32, None),
        ("wide", torch.bfloat16, None),
        ("tiny_gpt", torch.float32, None),
        ("wide", torch.float32, "clip_norm"),  # (raw copies for the histograms: see docs/instruments.md)
    ]
    for name, dtype, hook in rows:
        pbytes, resident, largest, peak = trained(name, dtype, transient=not args.no_transient, hook=hook)
        bound = max(BUDGET * pbytes, FLOOR)
        label = name if dtype == torch.float32 else f"{name} ({str(dtype).split('.')[-1]})"
        label += f" + {hook}" if hook else ""
        tail = "" if peak < 0 else f"   {_size(peak):>10} {_size(largest):>10} {peak / largest:6.2f}"
        print(
            f"{label:24} {pbytes / 2**20:8.2f}Mi {resident / 2**20:8.2f}Mi {100 * resident / pbytes:6.1f}% "
            f"{bound / 2**20:8.2f}Mi" + tail
        )
        assert resident <= bound, label
    pbytes, kept = gpt2_small_shapes()
    print(
        f"{'gpt2-small (bf16)':24} {pbytes / 2**20:8.1f}Mi {kept / 2**20:8.2f}Mi {100 * kept / pbytes:6.1f}% "
        f"{BUDGET * pbytes / 2**20:8.2f}Mi  (from shapes)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
