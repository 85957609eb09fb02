"""The update-to-parameter ratio of a model too large to keep whole, and histograms of non-finite gradients."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import inspector
from inspector.stats.update_ratio import BUDGET, FLOOR, sample_numel, strides


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_a_sampled_update_ratio_is_within_a_few_percent_of_the_exact_one(opt_name):
    model = _model()
    params = list(model.parameters())
    opt = (
        torch.optim.SGD(params, lr=0.1, momentum=0.9)
        if opt_name == "sgd"
        else torch.optim.Adam(params, lr=1e-3)
    )
    x, y = torch.randn(64, 1024), torch.randint(10, (64,))
    with inspector.attach(model, opt, every=1) as insp:
        for _ in range(3):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            before = [p.detach().clone() for p in params]
            opt.step()
            exact = [
                float((p.detach() - b).norm() / p.detach().norm())
                for p, b in zip(params, before, strict=True)
            ]
            got = insp.latest()["update_ratio"]
            for i, (g, e) in enumerate(zip(got, exact, strict=True)):
                assert g == pytest.approx(e, rel=0.05), (i, insp.params[i])
        # the large weights were sampled, not kept whole, within the bound
        total = sum(p.numel() * p.element_size() for p in params)
        assert FLOOR < BUDGET * total
        assert 0 < insp.memory["update_sample"] <= BUDGET * total


def test_an_update_that_lives_in_some_columns_is_estimated_within_a_few_percent():
    """A block stride sharing a factor with a row's block count keeps the same columns in every
    row (s = 4 on a 1024-wide weight: block columns 0, 4, 8, ...): an SGD update confined to
    columns 16-63 (blocks 1 to 3, following three input features' scale) would read as almost 0."""
    w = nn.Parameter(torch.randn(1024, 1024))
    opt = torch.optim.SGD([w], lr=0.1)
    with inspector.attach({"w": w}, opt, every=1) as insp:
        g = torch.zeros(1024, 1024)
        g[:, 16:64] = torch.randn(1024, 48)
        w.grad = g
        before = w.detach().clone()
        insp.begin_step()
        opt.step()
        exact = float((w.detach() - before).norm() / w.detach().norm())
        got = insp.latest()["update_ratio"][0]
        assert insp._stats.update._strides[0] > 1  # sampled, not kept whole
    assert got == pytest.approx(exact, rel=0.05)


@pytest.mark.parametrize("big", [False, True])
def test_samples_of_one_shape_share_a_buffer_and_read_as_each_one_alone(big):
    """On the CPU the samples of one shape and dtype are rows of one buffer (copied by one stack,
    subtracted a stack at a time, reduced along the rows): the same update norms and differences
    as each tensor's own, in float32, float64 and bfloat16, kept whole (a small model) or
    block-sampled (``big``: past the budget, every s-th block of 16)."""
    from inspector.stats.update_ratio import UpdateProbe, sample_view

    torch.manual_seed(0)
    many = 96 if big else 12  # (96 of 128 KiB: past the 10 % budget's floor)
    ps = (
        [torch.randn(128, 256) if big else torch.randn(48, 48) for _ in range(many)]
        + [torch.randn(96, 48, dtype=torch.bfloat16) for _ in range(3)]
        + [torch.randn(40, 40, dtype=torch.float64) for _ in range(2)]
        + [torch.randn(33, 7)]  # (a shape of its own: a buffer of its own)
    )
    probe = UpdateProbe()
    probe.keep(ps)
    before = [p.clone() for p in ps]
    for p in ps:
        p.add_(torch.randn_like(p), alpha=1e-2)
    got = probe.update_norms(ps)
    bufs, st, scale = probe.differences()
    assert (max(st) > 1) is big
    assert sorted(len(idx) for idx, _ in probe._stacks) == [2, 3, many], "three stacks, one loose"
    for i, (p, b) in enumerate(zip(ps, before, strict=True)):
        diff = sample_view(b, st[i]) - sample_view(p, st[i])
        assert torch.equal(bufs[i], diff), i
        want = (
            float(torch.linalg.vector_norm(diff.float() if diff.dtype == torch.bfloat16 else diff)) * scale[i]
        )
        assert float(got[i]) == pytest.approx(want, rel=1e-5), i
        assert got[i].dtype == torch.float32 and got[i].dim() == 0


def test_strides_terminate_when_the_small_parameters_alone_fill_the_budget():
    shapes = [torch.Size([4096])] * 100 + [torch.Size([3686425])]  # 1,638,400 B of small ones
    s = strides(shapes, [4] * 101)
    total = sum(sh.numel() * 4 for sh in shapes)
    assert sum(sample_numel(sh, k) * 4 for sh, k in zip(shapes, s, strict=True)) <= BUDGET * total


def test_strides_keep_within_the_budget_and_keep_small_parameters_whole():
    shapes = [torch.Size([50257, 768]), torch.Size([768]), torch.Size([3072, 768]), torch.Size([10_000_000])]
    item = [2, 2, 2, 2]
    s = strides(shapes, item)
    total = sum(sh.numel() * b for sh, b in zip(shapes, item, strict=True))
    kept = sum(sample_numel(sh, k) * b for sh, k, b in zip(shapes, s, item, strict=True))
    assert s[1] == 1 and all(k > 1 for k in (s[0], s[2], s[3]))
    assert kept <= BUDGET * total


@pytest.mark.parametrize("edited", [False, True])
def test_a_histogram_of_a_gradient_with_nan_and_inf_counts_its_finite_values_only(edited):
    """The fast histogram takes its range from min/max, which NaN or Inf spoil; the snapshot's
    transfer shows the non-finite abs-max and the histogram is taken again without them."""
    t = torch.zeros(8, requires_grad=True)
    with inspector.attach({"t": t}, every=1) as insp:
        insp.set_hist_params(["t"])
        if edited:  # a pre_step hook edits it in place: the raw histogram is of the copy kept before
            insp.add_hook("nan_guard", target="t", action="zero")
        t.grad = torch.tensor([1.0, 2.0, 3.0, 4.0, float("nan"), float("inf"), -float("inf"), 2.5])
        insp.mark_step()
        h = insp.latest()["hist"]["t"]
    assert sum(h["raw"]) == 5  # the five finite values
    # common edges for raw and final: the zeroed final gradient brings 0 in
    assert h["edges"][0] == (0.0 if edited else 1.0) and h["edges"][-1] == pytest.approx(4.0)
    if edited:  # zeroed: eight zeros, all in the first bin
        assert sum(h["final"]) == h["final"][0] == 8
    else:
        assert h["final"] == h["raw"]


def test_under_fsdp2_a_parameter_not_sharded_gets_its_exact_histogram_too():
    """Under FSDP2 only sharded parameters take the range-across-ranks (exact) path; a replicated
    one takes the fast path, so it too needs the second look when it holds NaN or Inf."""
    from inspector.hooks.torch_hooks import TorchHooks
    from inspector.stats.sharded import Layout
    from inspector.stats.step_stats import StepStats

    w = nn.Parameter(torch.zeros(1000))
    w.grad = torch.linspace(-2.0, 3.0, 1000)
    w.grad[10] = math.inf
    stats = StepStats(["w"], [w], Layout([False], None, 1, 0))
    hooks = TorchHooks(["w"], [w], {}, is_sampled=lambda: True, on_failure=lambda *a: None)
    raw = stats.raw(hooks, True, [0])
    stats.final(raw, hooks_ran=False, guards=[], touched=set())
    snap = stats.snapshot(
        step=1,
        config_version=0,
        records={},
        events=[],
        ranks=None,
        states=[],
        hooks=hooks,
        lr=[],
        sampled_every=1,
        overhead=None,
    )
    h = snap.hist["w"]
    assert sum(h["raw"]) == 999 and h["edges"][0] == -2.0 and h["edges"][-1] == pytest.approx(3.0)


def test_a_model_with_an_empty_parameter_is_inspected_on_every_step():
    """An empty parameter among others: every statistic of every step is taken, and the empty
    one reads 0 norms (the fused inf-norm kernel refuses an empty tensor, so such a set takes the
    per-tensor path)."""
    w, e = nn.Parameter(torch.randn(3)), nn.Parameter(torch.zeros(0))
    opt = torch.optim.SGD([w, e], lr=0.1)
    with inspector.attach({"w": w, "e": e}, opt, every=1) as insp:
        insp.set_hist_params(["w", "e"])
        for _ in range(3):
            opt.zero_grad()
            ((w * w).sum() + e.sum()).backward()
            opt.step()
        snap = insp.latest()
    assert snap["step"] == 3
    errors = [ev for ev in insp.events() if ev["kind"] in ("telemetry_error", "hook_error")]
    assert errors == [], errors
    assert snap["grad_norm"][1] == 0.0 and snap["grad_absmax"][1] == 0.0
    assert snap["grad_norm"][0] > 0 and snap["grad_absmax"][0] > 0
