"""The update-to-parameter ratio of a model too large to keep whole, and histograms of non-finite gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import inspector
from inspector.update_ratio import BUDGET, FLOOR, sample_numel, strides


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
        assert 0 < insp._stats.resident_bytes <= BUDGET * total


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
