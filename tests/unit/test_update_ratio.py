"""The update-to-parameter ratio of a model too large to keep whole: a bounded sample of rows."""

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
