"""Many small CPU tensors take flat passes (``stats.tensor_stats.FlatPlan``): every statistic of a
snapshot equals the one the per-tensor path (``torch._foreach_*``, ``std_mean``) takes on the same
run, with and without a pre_step hook, with a NaN step, a large tensor beside the small ones, and a
frozen parameter (its gradient missing: the per-tensor path that step)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import inspector
from inspector.stats import step_stats
from inspector.stats.tensor_stats import SEGMENT_COUNT, SEGMENT_MAX, FlatPlan

KEYS = (
    "grad_norm_raw",
    "grad_norm",
    "grad_mean",
    "grad_std",
    "grad_absmax_raw",
    "grad_absmax",
    "nan_count",
    "inf_count",
    "param_norm",
    "update_ratio",
)


class Many(nn.Module):
    def __init__(self, n: int, large: bool, sparse: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(n))
        # a sparse gradient neither first nor last among the parameters
        self.emb = nn.Embedding(10, 3, sparse=True) if sparse else None
        self.tail = nn.Linear(3, 3) if sparse else None
        self.big = nn.Linear(300, 300) if large else None  # 90,000 weights: past SEGMENT_MAX

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.layers:
            x = torch.tanh(lin(x))
        if self.emb is not None and self.tail is not None:
            x = torch.tanh(self.tail(x + self.emb(torch.tensor([1, 4, 4])).sum(0)))
        out = x.sum()
        if self.big is not None:
            out = out + self.big(x.sum(-1, keepdim=True).expand(-1, 300)).square().mean()
        return out


def run(
    flat: bool, large: bool, hook: bool, monkeypatch: pytest.MonkeyPatch, case: str = "plain"
) -> tuple[list[dict[str, Any]], bool]:
    """``case``: "plain"; "sparse" (one sparse gradient amid the dense ones); "appears" (a
    gradient missing the first steps, there from step 4); "vanishes" (one there until step 3,
    None after); "double" (the model turned to float64 at step 4, after the plan was made)."""
    with monkeypatch.context() as m:
        if not flat:
            m.setattr(step_stats.FlatPlan, "of", staticmethod(lambda tensors: None))
        torch.manual_seed(0)
        model = Many(SEGMENT_COUNT + 8, large, sparse=case == "sparse")
        # (SGD's momentum buffers keep their dtype: none where the model changes dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.0 if case == "double" else 0.9)
        insp = inspector.attach(model, opt, every=1)
        used = insp._stats._flat is not None
        if hook:
            insp.add_hook("clip_value", target="layers.1*", threshold=1e-3)
        gen = torch.Generator().manual_seed(1)
        snaps = []
        for s in range(6):
            model.layers[3].weight.requires_grad_(s != 2)  # step 3: one gradient missing
            if case == "appears":
                model.layers[7].bias.requires_grad_(s >= 3)
            elif case == "vanishes":
                model.layers[9].weight.requires_grad_(s < 3)
            elif case == "double" and s == 3:
                model.double()
            opt.zero_grad(set_to_none=True)
            x = torch.randn(4, 3, generator=gen).to(model.layers[0].weight.dtype)
            model(x).backward()
            if s == 4:
                with torch.no_grad():
                    model.layers[5].bias.grad[0] = math.nan
            opt.step()
            snaps.append(insp.latest())
        insp.close()
    return snaps, used


def close(a: Any, b: Any) -> bool:
    if a is None or b is None or isinstance(a, str) or isinstance(b, str):
        return a == b
    return a == pytest.approx(b, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("case", ["plain", "sparse", "appears", "vanishes", "double"])
@pytest.mark.parametrize("large", [False, True])
@pytest.mark.parametrize("hook", [False, True])
def test_flat_passes_equal_the_per_tensor_statistics(large: bool, hook: bool, case: str, monkeypatch) -> None:
    got, used = run(True, large, hook, monkeypatch, case)
    want, unused = run(False, large, hook, monkeypatch, case)
    assert used and not unused
    for g, w in zip(got, want, strict=True):
        assert g["step"] == w["step"]
        for key in KEYS:
            bad = [(i, a, b) for i, (a, b) in enumerate(zip(g[key], w[key], strict=True)) if not close(a, b)]
            assert not bad, f"step {g['step']} {key}: {bad[:5]}"
        for key in ("total_norm_raw", "total_norm", "total_norm_backward"):
            assert close(g[key], w[key]), key
        assert g["groups"].keys() == w["groups"].keys()
        # (every parameter with a gradient has its statistics: none blanked by another's)
        assert all(v is not None for v in g["grad_norm"][: 2 * 3]), f"step {g['step']}: {g['grad_norm']}"
    assert got[4]["nan_count"][insp_index(got, "layers.5.bias")] == 1


def insp_index(snaps: list[dict[str, Any]], name: str) -> int:
    names = [f"layers.{i}.{w}" for i in range(SEGMENT_COUNT + 8) for w in ("weight", "bias")]
    return names.index(name)


def test_a_plan_needs_many_small_cpu_tensors_of_one_dtype() -> None:
    small = [torch.zeros(3) for _ in range(SEGMENT_COUNT)]
    assert FlatPlan.of(small) is not None
    assert FlatPlan.of(small[:-1]) is None
    assert FlatPlan.of([*small[:-1], torch.zeros(3, dtype=torch.float64)]) is None
    assert FlatPlan.of([*small[:-1], torch.zeros(3, dtype=torch.complex64)]) is None
    plan = FlatPlan.of([*small, torch.zeros(SEGMENT_MAX + 1)])
    assert plan is not None and plan.large == [SEGMENT_COUNT]


def test_a_plan_fits_only_tensors_laid_out_as_planned() -> None:
    """Every tensor is checked, not only the count and the first and last: a sparse one, one of
    another shape, dtype (not a real float) or device, anywhere in the list, takes the per-tensor
    path; the whole list in another float dtype still fits."""
    shapes = [(3, 3), (3,)] * (SEGMENT_COUNT // 2 + 2)
    xs = [torch.randn(s) for s in shapes]
    plan = FlatPlan.of(xs)
    assert plan is not None and plan.fits(xs)
    mid = 5
    sp = torch.zeros(3).to_sparse()
    for odd in (
        sp,
        torch.zeros(4),
        torch.zeros(1, 3),
        torch.zeros(3, dtype=torch.complex64),
        torch.zeros(3, dtype=torch.int64),
        torch.zeros(3, device="meta"),
    ):
        assert not plan.fits([*xs[:mid], odd, *xs[mid + 1 :]]), odd
    assert not plan.fits(xs[:-1])
    assert plan.fits([x.double() for x in xs])
    a, n, m, s = plan.stats([x.double() for x in xs])
    want = torch.stack([x.double().norm() for x in xs]).float()
    assert torch.allclose(n, want)


@pytest.mark.parametrize("large", [False, True])
def test_flat_passes_read_nothing_on_unsampled_steps_and_once_on_sampled_ones(large: bool) -> None:
    from .test_host_reads import Reads

    torch.manual_seed(0)
    model = Many(SEGMENT_COUNT + 8, large)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    reads = Reads()
    reads.install()
    try:
        with inspector.attach(model, opt, every=3) as insp:
            assert insp._stats._flat is not None
            gen = torch.Generator().manual_seed(1)
            for s in range(1, 9):

                def one() -> None:
                    opt.zero_grad(set_to_none=True)
                    model(torch.randn(4, 3, generator=gen)).backward()
                    opt.step()

                got = reads.step(one)
                latest = insp.latest()
                sampled = latest is not None and latest["step"] == s
                assert len(got) <= (1 if sampled else 0), f"step {s}: " + "\n".join(got)
                assert s <= 2 or not reads.made, reads.made
            assert [x["step"] for x in insp.snapshots()] == [1, 4, 7]
    finally:
        reads.uninstall()
