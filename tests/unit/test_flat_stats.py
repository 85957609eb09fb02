"""Many small CPU tensors take flat passes (``stats.tensor_stats.FlatPlan``): every statistic of a
snapshot equals the one the per-tensor path (``torch._foreach_*``, ``std_mean``) takes on the same
run, with and without a pre_step hook, with a NaN step, a large tensor beside the small ones (alone,
or with larger ones of one shape, which are stacked), and a frozen parameter (its gradient missing:
the per-tensor path that step)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import inspector
from inspector.stats import step_stats, tensor_stats
from inspector.stats.tensor_stats import SEGMENT_COUNT, SEGMENT_MAX, STACK_MAX, FlatPlan

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
    """``large``: False; True (one tensor past STACK_MAX beside the small ones); "stacked" (that one
    and four Linear(40, 40) whose weights, 1,600 elements each, past SEGMENT_MAX, are stacked)."""

    def __init__(self, n: int, large: bool | str, sparse: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(n))
        # a sparse gradient neither first nor last among the parameters
        self.emb = nn.Embedding(10, 3, sparse=True) if sparse else None
        self.tail = nn.Linear(3, 3) if sparse else None
        self.big = nn.Linear(300, 300) if large else None  # 90,000 weights: past STACK_MAX
        self.mids = nn.ModuleList(nn.Linear(40, 40) for _ in range(4 if large == "stacked" else 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.layers:
            x = torch.tanh(lin(x))
        if self.emb is not None and self.tail is not None:
            x = torch.tanh(self.tail(x + self.emb(torch.tensor([1, 4, 4])).sum(0)))
        out = x.sum()
        if self.big is not None:
            out = out + self.big(x.sum(-1, keepdim=True).expand(-1, 300)).square().mean()
        if len(self.mids):
            h = x.sum(-1, keepdim=True).expand(-1, 40)
            for lin in self.mids:
                h = torch.tanh(lin(h))
            out = out + h.square().mean()
        return out


def run(
    flat: bool, large: bool | str, hook: bool, monkeypatch: pytest.MonkeyPatch, case: str = "plain"
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
                    if large == "stacked":  # a stacked one's too
                        model.mids[2].weight.grad[3, 7] = math.nan
            opt.step()
            snaps.append(insp.latest())
        insp.close()
    return snaps, used


def close(a: Any, b: Any) -> bool:
    if a is None or b is None or isinstance(a, str) or isinstance(b, str):
        return a == b
    return a == pytest.approx(b, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("case", ["plain", "sparse", "appears", "vanishes", "double"])
@pytest.mark.parametrize("large", [False, True, "stacked"])
@pytest.mark.parametrize("hook", [False, True])
def test_flat_passes_equal_the_per_tensor_statistics(
    large: bool | str, hook: bool, case: str, monkeypatch
) -> None:
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
    if large == "stacked":
        names = [n for n, _ in Many(SEGMENT_COUNT + 8, large, sparse=case == "sparse").named_parameters()]
        assert [got[4]["nan_count"][names.index(f"mids.{k}.weight")] for k in range(4)] == [0, 0, 1, 0]


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_stacked_tensors_read_as_each_one_alone(dtype: torch.dtype, monkeypatch) -> None:
    """Larger tensors of one shape are stacked (several stacks of at most STACK_BYTES: made small
    here), interleaved with others, one past STACK_MAX (loose) and one of a shape of its own:
    each one's norm, abs-max, mean and population std equal torch's of that tensor alone, in
    parameter order, NaN and Inf included."""
    monkeypatch.setattr(tensor_stats, "STACK_BYTES", 3 * 1100 * 8)  # 3 rows a stack in float64
    gen = torch.Generator().manual_seed(0)
    shapes = [(3,)] * SEGMENT_COUNT + [(11, 100), (1100,), (50, 40)] * 5 + [(STACK_MAX + 1,), (7, 200)]
    xs = [(torch.randn(s, generator=gen) * (1 + k % 4) + (k % 3)).to(dtype) for k, s in enumerate(shapes)]
    xs[SEGMENT_COUNT + 4].view(-1)[17] = math.nan
    xs[SEGMENT_COUNT + 6].view(-1)[5] = math.inf
    plan = FlatPlan.of(xs)
    assert plan is not None and len(plan._stacks) == 3 and len(plan._loose) == 2
    assert plan.cheap_norms is False  # (loose ones among them: the probe takes foreach_norm)
    am, norms, mean, sd = plan.stats(xs)
    assert torch.equal(plan.norms(xs).isnan(), norms.isnan())
    for k, x in enumerate(xs):
        w = x.double()
        want = (w.abs().max(), w.norm(), w.mean(), w.std(correction=0))
        for name, a, b in zip(("absmax", "norm", "mean", "std"), (am, norms, mean, sd), want, strict=True):
            if math.isnan(b) or math.isinf(b):
                assert math.isnan(a[k]) == math.isnan(b) and math.isinf(a[k]) == math.isinf(b), (k, name)
            else:
                assert a[k].item() == pytest.approx(b.item(), rel=1e-5, abs=1e-7), (k, name)
        n = plan.norms(xs)[k].item()
        assert (math.isnan(n) and math.isnan(want[1])) or n == pytest.approx(
            want[1].item(), rel=1e-5, nan_ok=True
        )


def test_a_deep_stack_of_blocks_is_probed_as_one_vector() -> None:
    """A model of repeated blocks (every larger tensor shares its shape with another): the every-step
    NaN/Inf probe is the plan's one vector of norms (read on the host with one copy), not a list of
    one 0-dim tensor per gradient."""
    torch.manual_seed(0)
    model = Many(SEGMENT_COUNT + 8, "stacked")
    model.big = None  # (the only loose one)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with inspector.attach(model, opt, every=10**9) as insp:
        plan = insp._stats._flat
        assert plan is not None and plan.cheap_norms and plan.large
        model(torch.randn(4, 3)).backward()
        got = insp._stats.probe()
        assert got is not None and isinstance(got[1], torch.Tensor) and got[1].shape == (len(plan.small) + 4,)
        want = torch.stack([p.grad.norm() for p in model.parameters()])
        assert torch.allclose(got[1], want, rtol=1e-6)
