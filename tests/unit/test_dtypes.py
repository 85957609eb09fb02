"""The numbers are true, whatever the dtype, and on overflow.

Every statistic is checked against a plain-torch float64 reference of the gradients the
optimizer used (captured by a step pre-hook registered after ours).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import inspector
from tests.unit.conftest import GradCapture

ERROR_EVENTS = ("hook_error", "telemetry_error")


def errors(insp: Any) -> list[dict[str, Any]]:
    return [e for e in insp.events() if e["kind"] in ERROR_EVENTS]


def model_of(dtype: torch.dtype, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16, dtype=dtype), nn.Linear(16, 1, dtype=dtype))


def step(model: nn.Module, opt: torch.optim.Optimizer, dtype: torch.dtype, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 6, generator=g).to(dtype)
    opt.zero_grad(set_to_none=True)
    model(x).abs().pow(2).mean().backward()
    opt.step()


def reference(g: torch.Tensor) -> dict[str, Any]:
    """Plain torch in (complex) double precision: the norm of the complex values, torch's std,
    the largest magnitude; a complex gradient's mean is reported null."""
    w = g.detach().to(torch.complex128 if g.is_complex() else torch.float64)
    return {
        "norm": float(torch.linalg.vector_norm(w)),
        "std": float(torch.std(w)) if w.numel() > 1 else None,
        "mean": None if w.is_complex() else float(w.mean()),
        "absmax": float(w.abs().max()),
    }


def check_stats(snap: dict[str, Any], grads: list[torch.Tensor | None], rel: float) -> None:
    for i, g in enumerate(grads):
        assert g is not None
        ref = reference(g)
        assert snap["grad_norm"][i] == pytest.approx(ref["norm"], rel=rel)
        assert snap["grad_absmax"][i] == pytest.approx(ref["absmax"], rel=rel)
        if ref["std"] is None:
            assert snap["grad_std"][i] is None
        else:
            assert snap["grad_std"][i] == pytest.approx(ref["std"], rel=rel)
        if ref["mean"] is None:
            assert snap["grad_mean"][i] is None
        else:
            assert snap["grad_mean"][i] == pytest.approx(ref["mean"], rel=rel, abs=1e-7 * ref["norm"])


@pytest.mark.parametrize("every", [None, 1])
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_float64_and_complex64_models_train_with_correct_statistics(dtype: torch.dtype, every: int | None):
    model = model_of(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with inspector.attach(model, opt, every=every) as insp:
        insp.set_hist_params(["0.weight"])
        cap = GradCapture(opt)
        step(model, opt, dtype, 0)  # step 1 is always sampled
        snap = insp.latest()
        grads = cap.grads
        for s in range(1, 4):
            step(model, opt, dtype, s)
        assert errors(insp) == []
        assert insp.state["step"] == 4
    assert snap["step"] == 1
    check_stats(snap, grads, rel=1e-5)
    assert snap["grad_norm_raw"] == snap["grad_norm"]  # no hook
    assert snap["total_norm"] == pytest.approx(math.sqrt(sum(reference(g)["norm"] ** 2 for g in grads)))
    assert all(r is not None and r > 0 for r in snap["update_ratio"])
    # histograms of the values (complex: of the magnitudes), every element counted once
    h = snap["hist"]["0.weight"]
    assert sum(h["raw"]) == sum(h["final"]) == grads[0].numel()
    w = grads[0].abs() if dtype.is_complex else grads[0]
    assert h["edges"][0] == pytest.approx(float(w.min()), rel=1e-5)
    assert h["edges"][-1] == pytest.approx(float(w.max()), rel=1e-5)


KINDS = [
    ("clip_value", "pre_step", {"threshold": 0.01}),
    ("clip_value", "post_accumulate", {"threshold": 0.01}),
    ("clip_norm", "pre_step", {"max_norm": 0.1}),
    ("clip_norm", "post_accumulate", {"max_norm": 0.1, "mode": "per_tensor"}),
    ("zclip", "pre_step", {"warmup": 1, "z": 0.1}),
    ("scale", "pre_step", {"factor": 0.5}),
    ("scale", "post_accumulate", {"factor": 0.5}),
    ("l2", "pre_step", {"lam": 0.1}),
    ("l2", "post_accumulate", {"lam": 0.1}),
    ("noise", "pre_step", {"std": 0.01}),
    ("noise", "post_accumulate", {"std": 0.01}),
    ("nan_guard", "pre_step", {"action": "zero"}),
    ("nan_guard", "post_accumulate", {"action": "zero"}),
    ("freeze", "pre_step", {}),
]


@pytest.mark.parametrize(("kind", "point", "params"), KINDS, ids=[f"{k}-{p}" for k, p, _ in KINDS])
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_every_hook_kind_acts_on_float64_and_complex64_gradients(
    dtype: torch.dtype, kind: str, point: str, params: dict[str, Any]
):
    model = model_of(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with inspector.attach(model, opt, every=1) as insp:
        insp.set_hist_params(["0.weight"])
        h = insp.add_hook(kind, target="*", point=point, **params)
        cap = GradCapture(opt)
        for s in range(2):
            step(model, opt, dtype, s)
        assert errors(insp) == []
        snaps = insp.snapshots()
        assert insp.hooks()[0]["enabled"]
    last = snaps[-1]
    assert h.id in last["hook_effects"]
    if kind == "freeze":
        assert all(g is None for g in cap.grads)
        assert last["grad_norm"] == [None] * 4
        assert snaps[0]["hist"]["0.weight"]["final"] is None
        return
    check_stats(last, cap.grads, rel=1e-5)
    assert sum(snaps[0]["hist"]["0.weight"]["final"]) == 16 * 6
    if kind == "clip_value":  # every magnitude capped (complex: the phase kept)
        assert all(float(g.abs().max()) <= 0.01 * (1 + 1e-6) for g in cap.grads if g is not None)
        assert last["hook_effects"][h.id]["norm_ratio"] < 1
    if kind == "scale":
        assert last["hook_effects"][h.id]["norm_ratio"] == pytest.approx(0.5, rel=1e-5)


def test_clip_value_on_complex_gradients_clamps_each_magnitude_and_keeps_the_phase():
    p = nn.Parameter(torch.zeros(4, dtype=torch.complex64))
    opt = torch.optim.SGD([p], lr=0.1)
    g = torch.tensor([3 + 4j, 0.3 + 0.4j, 0, -6j], dtype=torch.complex64)
    with inspector.attach({"p": p}, opt, every=1) as insp:
        insp.add_hook("clip_value", target="p", threshold=1.0)
        cap = GradCapture(opt)
        p.grad = g.clone()
        opt.step()
        assert errors(insp) == []
    want = torch.tensor([0.6 + 0.8j, 0.3 + 0.4j, 0, -1j], dtype=torch.complex64)
    torch.testing.assert_close(cap.grads[0], want)


def run_grad(grad: torch.Tensor, hook: tuple[Any, dict[str, Any]] | None = None) -> dict[str, Any]:
    """One step of a one-parameter optimizer whose gradient is ``grad``; the snapshot."""
    p = nn.Parameter(torch.zeros_like(grad))
    opt = torch.optim.SGD([p], lr=0.0)
    with inspector.attach({"p": p}, opt, every=1) as insp:
        insp.set_hist_params(["p"])
        if hook is not None:
            insp.add_hook(hook[0], target="p", **hook[1])
        p.grad = grad.clone()
        opt.step()
        assert errors(insp) == []
        return insp.latest()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_float16_and_bfloat16_statistics_are_accumulated_in_float32(dtype: torch.dtype):
    n = 100_000
    ones = run_grad(torch.ones(n, dtype=dtype))
    assert ones["grad_mean"][0] == 1.0  # an fp16 sum of 100k ones is inf
    assert ones["grad_norm"][0] == pytest.approx(math.sqrt(n), rel=1e-6)
    assert ones["grad_std"][0] == pytest.approx(0.0, abs=1e-3)
    g = (1 + 0.1 * torch.randn(n, generator=torch.Generator().manual_seed(0))).to(dtype)
    snap = run_grad(g)
    ref = g.double()
    assert snap["grad_mean"][0] == pytest.approx(float(ref.mean()), rel=1e-5)
    assert snap["grad_std"][0] == pytest.approx(float(ref.std()), rel=1e-3)  # 4.6 % off in bf16 before
    assert snap["grad_norm"][0] == pytest.approx(float(ref.norm()), rel=1e-5)
    assert snap["grad_absmax"][0] == float(ref.abs().max())
    assert snap["total_norm"] == pytest.approx(float(ref.norm()), rel=1e-5)


def overflowing(n: int = 1000) -> torch.Tensor:
    """Finite float32 values near 1e25: their squares overflow float32, their norm does not."""
    return 1e25 * (1 + 0.1 * torch.randn(n, generator=torch.Generator().manual_seed(0)))


def test_finite_gradients_whose_float32_norm_overflows_read_the_same_raw_final_std_and_totals():
    g = overflowing()
    ref = g.double()
    norm, std = float(ref.norm()), float(ref.std())
    assert not math.isfinite(float(g.norm()))  # the float32 norm itself overflows
    snap = run_grad(g)
    assert snap["grad_norm_raw"][0] == snap["grad_norm"][0] == pytest.approx(norm, rel=1e-6)
    assert snap["total_norm_raw"] == snap["total_norm"] == pytest.approx(norm, rel=1e-6)
    assert snap["grad_std"][0] == pytest.approx(std, rel=1e-3)
    assert snap["grad_absmax_raw"][0] == snap["grad_absmax"][0] == pytest.approx(float(ref.abs().max()))
    assert snap["nan_count"][0] == snap["inf_count"][0] == 0
    assert sum(snap["hist"]["p"]["raw"]) == sum(snap["hist"]["p"]["final"]) == g.numel()
    # a hook that keeps the values large: its final statistics reduced the same way. The raw norm
    # is float32's inf here (what clip_grad_norm_ computes too): finding the overflow before the
    # hook runs would take a host read on every step, and after it the raw gradient is
    # gone; the raw abs-max and the counts still say the values are finite
    half = run_grad(g, ("scale", {"factor": 0.5}))
    assert half["grad_norm_raw"][0] == "inf"
    assert half["grad_absmax_raw"][0] == pytest.approx(float(ref.abs().max()))
    assert half["nan_count"][0] == half["inf_count"][0] == 0
    assert half["grad_norm"][0] == pytest.approx(norm / 2, rel=1e-6)
    assert half["grad_std"][0] == pytest.approx(std / 2, rel=1e-3)
    assert half["total_norm"] == pytest.approx(norm / 2, rel=1e-6)
    # a hook that makes ordinary values overflow the float32 norm: the final norm is still true
    big = run_grad(g / 1e20, ("scale", {"factor": 1e20}))
    assert big["grad_norm_raw"][0] == pytest.approx(norm / 1e20, rel=1e-5)
    assert big["grad_norm"][0] == pytest.approx(norm, rel=1e-5)
    assert big["grad_std"][0] == pytest.approx(std, rel=1e-3)
    assert big["total_norm"] == pytest.approx(norm, rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_finite_gradients_whose_sum_overflows_float32_read_their_true_mean_and_std(dtype: torch.dtype):
    """4000 values near 1e35: their sum (4e38) is beyond float32's range, in a float32 gradient's own
    sum and in the snapshot's float32 transfer alike. Their mean is taken again in float64 (the
    transfer shows an infinite sum beside a finite abs-max), so it reads 1e35, not inf, and the
    std comes from it (it read 0.0 for a float64 gradient)."""
    g = (1e35 * (1 + 0.1 * torch.randn(4000, generator=torch.Generator().manual_seed(0)))).to(dtype)
    ref = g.double()
    assert math.isfinite(float(ref.sum())) and not math.isfinite(float(ref.sum().float()))
    snap = run_grad(g)
    assert snap["grad_mean"][0] == pytest.approx(float(ref.mean()), rel=1e-6)
    assert snap["grad_std"][0] == pytest.approx(float(ref.std()), rel=1e-3)
    assert snap["grad_norm"][0] == pytest.approx(float(ref.norm()), rel=1e-6)


def test_overflowing_norms_raise_no_nonfinite_event():
    p = nn.Parameter(torch.zeros(1000))
    opt = torch.optim.SGD([p], lr=0.0)
    with inspector.attach({"p": p}, opt) as insp:
        for _ in range(3):  # sampled and unsampled steps
            p.grad = overflowing()
            opt.step()
        assert [e for e in insp.events() if e["kind"] == "nonfinite"] == []


def test_a_frozen_parameters_histogram_has_no_final_series():
    model = model_of(torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with inspector.attach(model, opt, every=1) as insp:
        insp.set_hist_params(["0.weight", "1.weight"])
        insp.add_hook("freeze", target="0.weight")
        step(model, opt, torch.float32, 0)
        snap = insp.latest()
    frozen, live = snap["hist"]["0.weight"], snap["hist"]["1.weight"]
    assert frozen["final"] is None  # on the wire: "final": null
    assert sum(frozen["raw"]) == 16 * 6 and len(frozen["edges"]) == 65
    assert sum(live["raw"]) == sum(live["final"]) == 16
    assert snap["grad_norm"][0] is None and snap["grad_norm_raw"][0] > 0


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_clip_norm_is_bitwise_clip_grad_norm_in_the_gradients_own_dtype(dtype, norm_type):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.Tanh(), torch.nn.Linear(30, 5)).to(dtype)
    (model(torch.randn(16, 20, dtype=dtype) * 10).pow(2).sum()).backward()
    ref = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    for r, p in zip(ref, model.parameters(), strict=True):
        r.grad = p.grad.clone()
    torch.nn.utils.clip_grad_norm_(ref, 0.5, norm_type)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = {}
    with inspector.attach(model, opt, every=1) as insp:
        insp.add_hook("clip_norm", target="*", max_norm=0.5, norm_type=norm_type)
        insp.add_hook(lambda name, p: seen.__setitem__(name, p.grad.clone()), target="*")
        opt.step()
        names = insp.params
    for name, r in zip(names, ref, strict=True):
        assert seen[name].dtype == dtype and torch.equal(seen[name], r.grad), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1000, 300_000])  # (300k: a float32 one on the CPU takes the chunked sweep)
def test_std_is_right_when_the_mean_dwarfs_it(dtype: torch.dtype, n: int):
    """A mean far larger than the spread: the std made from a sum and a norm lost every digit
    (1.0e-3 read 8.3e-4, 1e-4 read 0.0, a constant 3.9e-4 and at 1e25 1.9e21). Now each chunk's
    mean and spread are combined as Chan et al. do: within float32's rounding of the result."""
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(n, generator=gen)
    for mean, spread in ((1.0, 1e-3), (1.0, 1e-4), (3.0, 1e-5)):
        g = (mean + spread * noise).to(dtype)
        ref = g.double()
        snap = run_grad(g)
        assert snap["grad_std"][0] == pytest.approx(float(ref.std()), rel=1e-4), (mean, spread)
        assert snap["grad_mean"][0] == pytest.approx(float(ref.mean()), rel=1e-6)
    for value in (1.0, 0.1, 1e25):
        snap = run_grad(torch.full((n,), value, dtype=dtype))
        assert snap["grad_std"][0] == 0.0, value
        assert snap["grad_mean"][0] == pytest.approx(value, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_std_is_right_when_the_mean_dwarfs_it(dtype: torch.dtype):
    """float16 and bfloat16 in chunks converted to float32 (the scratch), combined in float64."""
    n = 600_000  # (more than two chunks)
    g = (1.0 + 0.01 * torch.randn(n, generator=torch.Generator().manual_seed(1))).to(dtype)
    ref = g.double()
    snap = run_grad(g)
    assert snap["grad_std"][0] == pytest.approx(float(ref.std()), rel=1e-4)
    assert snap["grad_mean"][0] == pytest.approx(float(ref.mean()), rel=1e-6)
    assert run_grad(torch.full((n,), 0.5, dtype=dtype))["grad_std"][0] == 0.0


def test_parts_combine_to_the_whole_s_mean_and_std_even_when_the_mean_dwarfs_the_spread():
    """What FSDP2's shards (and a large tensor's chunks) are combined with: uneven parts of a
    gradient of mean 1e3 and std 1e-2, each part's float32 mean and spread, combined in float64,
    give the whole's mean and std (a sum of squares minus n mean^2 gives noise here)."""
    from inspector.stats.tensor_stats import combine_moments

    g = 1e3 + 1e-2 * torch.randn(100_003, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    parts = list(torch.split(g.float(), [50_000, 30_000, 20_003]))
    means = torch.stack([p.double().mean() for p in parts]).float()
    sdevs = torch.stack([p.double().std(correction=0) for p in parts]).float()
    mean, sdev = combine_moments(means, sdevs, [p.numel() for p in parts])
    whole = torch.cat(parts).double()
    assert float(mean) == pytest.approx(float(whole.mean()), rel=1e-7)
    assert float(sdev) == pytest.approx(float(whole.std(correction=0)), rel=1e-4)
    # one row a tensor, one column a part: two wholes at once
    two_m, two_sd = combine_moments(
        torch.stack([means, means * 2]), torch.stack([sdevs, sdevs]), torch.tensor([[5, 3, 2]] * 2)
    )
    assert two_m.shape == two_sd.shape == (2,) and float(two_m[1]) == pytest.approx(
        2 * float(two_m[0]), rel=1e-12
    )
