"""Worst now after a NaN ranks by origin (server/live/worst.py): on a real model whose one layer's
gradient overflows first, the first entry is that layer at the step plain torch finds, also once
the NaN has spread to every tensor (where the old ranking listed them in parameter order)."""

from __future__ import annotations

import math

import torch
from torch import nn

import inspector
from server.live.worst import WorstNow

BLOW_FROM = 20  # from this step the middle layer's gradient is multiplied by 1e10 a step more
STEPS = 30


class _Amplify(torch.autograd.Function):
    """The identity forward; the gradient times `scale` backward (the forward stays finite)."""

    @staticmethod
    def forward(ctx, w, scale):  # type: ignore[override]
        ctx.scale = scale
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g * ctx.scale, None


class Net(nn.Module):
    """Four linear layers; `layers.2`'s weight gradient is amplified from `BLOW_FROM` on, so it
    overflows to inf a few steps later while the forward (its weight, frozen by lr 0) stays
    finite; the SGD step then makes that weight NaN and the NaN reaches every tensor a step later."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k, layer in enumerate(self.layers):
            w = layer.weight
            if k == 2 and self.step >= BLOW_FROM:
                w = _Amplify.apply(w, 10.0 ** (10 * (self.step - BLOW_FROM + 1)))
            x = torch.tanh(nn.functional.linear(x, w, layer.bias))
        return x


def make() -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = Net()
    frozen = [net.layers[2].weight]
    others = [p for p in net.parameters() if all(p is not f for f in frozen)]
    opt = torch.optim.SGD([{"params": others, "lr": 0.05}, {"params": frozen, "lr": 0.0}])
    return net, opt


def train(net: Net, opt: torch.optim.Optimizer, steps: int, each=None) -> None:
    gen = torch.Generator().manual_seed(1)
    for s in range(1, steps + 1):
        net.step = s
        x = torch.randn(16, 8, generator=gen)
        opt.zero_grad(set_to_none=True)
        loss = (net(x) - x.flip(1)).pow(2).mean()
        loss.backward()
        if each is not None:
            each(s)
        opt.step()


def plain_torch_origin() -> tuple[int, list[str], int]:
    """(the first step with a non-finite gradient, the parameters non-finite then, the first step
    at which every gradient is), from plain torch, in float64 on the gradients as autograd left them."""
    net, opt = make()
    names = [n for n, _ in net.named_parameters()]
    bad_at: dict[int, list[str]] = {}

    def look(step: int) -> None:
        bad = [n for n, p in net.named_parameters() if not torch.isfinite(p.grad.double()).all()]
        if bad:
            bad_at[step] = bad

    train(net, opt, STEPS, look)
    first = min(bad_at)
    everyone = min(s for s, b in bad_at.items() if len(b) == len(names))
    return first, bad_at[first], everyone


def test_the_origin_ranks_first_after_the_nan_spreads_as_plain_torch_says():
    first, origin, everyone = plain_torch_origin()
    assert origin == ["layers.2.weight"] and everyone == first + 1, (first, origin, everyone)

    net, opt = make()
    insp = inspector.attach(net, opt, every=1)
    snaps: list[dict] = []
    insp.subscribe(lambda kind, payload: snaps.append(payload) if kind == "snapshot" else None, lossless=True)
    try:
        train(net, opt, STEPS, lambda s: None)
        insp.finish()
    finally:
        insp.close()
    tracker = WorstNow()
    ranked = {s["step"]: tracker.update(s) for s in sorted(snaps, key=lambda s: s["step"])}
    params = insp.params
    leads = {step: params[ranked[step][0]["param"]] for step in range(first, STEPS + 1)}
    assert set(leads.values()) == {origin[0]}, leads
    assert all(ranked[step][0]["z"] == "inf" and ranked[step][0]["since"] == first for step in leads)
    # after the spread every tensor is non-finite; the origin still leads, the others follow
    spread = ranked[everyone]
    assert all(w["z"] == "inf" for w in spread) and len(spread) == len(params)
    assert [w["since"] for w in spread] == [first] + [everyone] * (len(params) - 1)
    # the rise before it: the amplified gradient, a decade and more above its median from BLOW_FROM
    assert spread[0]["before"] is not None and spread[0]["before"]["step"] >= BLOW_FROM
    assert math.isfinite(spread[0]["before"]["z"]) and spread[0]["before"]["z"] > 10
