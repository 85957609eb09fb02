"""``post_accumulate`` edits under gradient accumulation: each micro-batch's contribution edited
once (``scale``, ``l2``, ``noise``), the accumulated kinds acting after each backward, the step's
effect the real one; checked against plain torch and a hand-written reference of the rule."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import inspector
from tests.unit.conftest import GradCapture, batch, loss_of, seed_mlp

MICRO = [batch(seed=s) for s in range(4)]  # four micro-batches of one step
THR = 0.02  # a clip_value threshold that clips part of every accumulated gradient


def plain_grads(model: nn.Module, micro=MICRO) -> list[list[torch.Tensor]]:
    """Each micro-batch's own gradients on a copy of ``model``, with no inspector attached."""
    out = []
    for x, y in micro:
        ref = copy.deepcopy(model)
        loss_of(ref, x, y).backward()
        out.append([p.grad.detach().clone() for p in ref.parameters()])
    return out


def plain_sum(model: nn.Module, micro=MICRO) -> list[torch.Tensor]:
    """The accumulated gradients of plain torch (backward after backward into ``.grad``)."""
    ref = copy.deepcopy(model)
    for x, y in micro:
        loss_of(ref, x, y).backward()
    return [p.grad.detach().clone() for p in ref.parameters()]


def accumulated_step(
    model: nn.Module, hooks: list[tuple[str, dict]], micro=MICRO, steps: int = 1
) -> tuple[list[torch.Tensor], dict, list[str]]:
    """``steps`` optimizer steps (lr 0: the same gradients every step) of ``len(micro)`` backwards each,
    with ``hooks`` at ``post_accumulate`` on every parameter in this order. Returns the gradients
    the optimizer saw at the last step, that step's snapshot and the hooks' ids."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    cap = GradCapture(opt)
    with inspector.attach(model, opt, every=1) as insp:
        ids = [insp.add_hook(k, target="*", point="post_accumulate", **p).id for k, p in hooks]
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            for x, y in micro:
                loss_of(model, x, y).backward()
            opt.step()
        snap = insp.latest()
        assert not [e for e in insp.events() if e["kind"] in ("hook_error", "telemetry_error")]
    return cap.grads, snap, ids


def close(a: list[torch.Tensor], b: list[torch.Tensor], rtol: float = 1e-5, atol: float = 1e-7) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


# ---------------------------------------------------------------- contributions edited once


@pytest.mark.parametrize("steps", [1, 3])
def test_scale_over_micro_batches_is_the_factor_times_the_sum(mlp, steps):
    got, _, _ = accumulated_step(mlp, [("scale", {"factor": 0.5})], steps=steps)
    close(got, [0.5 * g for g in plain_sum(mlp)])


def test_scale_under_accumulation_in_bfloat16():
    model = seed_mlp().to(torch.bfloat16)
    micro = [(x.bfloat16(), y.bfloat16()) for x, y in MICRO]
    got, _, _ = accumulated_step(model, [("scale", {"factor": 0.5})], micro=micro)
    # each contribution scaled by 0.5 (exact in bf16), then accumulated as plain torch accumulates
    close(got, [0.5 * g for g in plain_sum(model, micro)], rtol=0, atol=0)


@pytest.mark.parametrize(
    "hooks, rule",
    [
        ([("scale", {"factor": 0.5})], lambda g, p: g * 0.5),
        ([("scale", {"factor": -3.0})], lambda g, p: g * -3.0),
        ([("l2", {"lam": 0.1})], lambda g, p: g.add(p, alpha=0.1)),
        ([("l2", {"lam": 0.1}), ("scale", {"factor": 0.3})], lambda g, p: g.add(p, alpha=0.1).mul(0.3)),
        (
            [("clip_value", {"threshold": THR}), ("scale", {"factor": 0.3})],
            lambda g, p: g.clamp(-THR, THR) * 0.3,
        ),
        (
            [("scale", {"factor": 0.3}), ("clip_value", {"threshold": THR})],
            lambda g, p: (g * 0.3).clamp(-THR, THR),
        ),
    ],
)
def test_a_single_backward_is_edited_bit_for_bit_as_before(mlp, hooks, rule):
    got, _, _ = accumulated_step(mlp, hooks, micro=MICRO[:1])
    (raw,) = plain_grads(mlp, MICRO[:1])
    want = [rule(g, p.detach()) for g, p in zip(raw, mlp.parameters(), strict=True)]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_l2_over_micro_batches_adds_lam_param_once(mlp):
    got, _, _ = accumulated_step(mlp, [("l2", {"lam": 0.1})])
    close(got, [g + 0.1 * p.detach() for g, p in zip(plain_sum(mlp), mlp.parameters(), strict=True)])


def wide() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 512), nn.ReLU(), nn.Linear(512, 1))


@pytest.mark.parametrize("chain", [[], [("clip_value", {"threshold": 1e9})]])
def test_noise_over_micro_batches_is_one_draw(chain):
    """Head noise (``[noise]``) is drawn once; tail noise (``[clip_value, noise]``: a no-op clip) is
    taken back and drawn again from the same generator state: either way the step's gradient holds
    exactly the noise one backward would have had, of variance std**2."""
    std = 0.05
    hooks = [*chain, ("noise", {"std": std, "seed": 7})]
    model = wide()
    one, _, _ = accumulated_step(copy.deepcopy(model), hooks, micro=MICRO[:1])
    noise_one = [a - b for a, b in zip(one, plain_grads(model, MICRO[:1])[0], strict=True)]
    got, _, _ = accumulated_step(copy.deepcopy(model), hooks)
    noise = [a - b for a, b in zip(got, plain_sum(model), strict=True)]
    flat = torch.cat([n.flatten() for n in noise])
    assert flat.numel() > 5000
    assert abs(float(flat.std()) / std - 1) < 0.05  # four draws would read twice std
    close(noise, noise_one, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- chains: the documented rule


def reference(
    raw: list[list[torch.Tensor]], params: list[torch.Tensor], head, core, tail
) -> list[torch.Tensor]:
    """The documented rule, by hand: the head applied once to the step's sum (its contributions
    scaled, its additions made once), the core on the accumulated gradient after each backward,
    the tail once on the final value."""
    out = []
    for j, p in enumerate(params):
        acc = None
        for k, gs in enumerate(raw):
            g = head(gs[j], p, k == 0)
            acc = core(g if acc is None else acc + g)
        out.append(tail(acc, p))
    return out


def _clip(g: torch.Tensor) -> torch.Tensor:
    return g.clamp(-THR, THR)


CHAINS = {
    "clip_then_scale": (
        [("clip_value", {"threshold": THR}), ("scale", {"factor": 0.5})],
        (lambda g, p, first: g, _clip, lambda a, p: a * 0.5),
    ),
    "scale_then_clip": (
        [("scale", {"factor": 0.5}), ("clip_value", {"threshold": THR})],
        (lambda g, p, first: g * 0.5, _clip, lambda a, p: a),
    ),
    "l2_clip_scale": (
        [("l2", {"lam": 0.1}), ("clip_value", {"threshold": THR}), ("scale", {"factor": 0.5})],
        (lambda g, p, first: g + 0.1 * p if first else g, _clip, lambda a, p: a * 0.5),
    ),
    "clip_l2": (
        [("clip_value", {"threshold": THR}), ("l2", {"lam": 0.1})],
        (lambda g, p, first: g, _clip, lambda a, p: a + 0.1 * p),
    ),
    "middle_scale_acts_per_backward": (  # the one documented exception
        [("clip_value", {"threshold": THR}), ("scale", {"factor": 0.5}), ("clip_value", {"threshold": THR})],
        (lambda g, p, first: g, lambda a: _clip(_clip(a) * 0.5), lambda a, p: a),
    ),
}


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_chains_under_accumulation_follow_the_documented_rule(mlp, name):
    hooks, (head, core, tail) = CHAINS[name]
    got, _, _ = accumulated_step(mlp, hooks)
    params = [p.detach() for p in mlp.parameters()]
    want = reference(plain_grads(mlp), params, head, core, tail)
    close(got, want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- the step's effect


def _norm(ts: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in ts))


@pytest.mark.parametrize(
    "hooks, which",
    [
        ([("scale", {"factor": 0.5})], 0),
        ([("l2", {"lam": 0.1})], 0),
        ([("clip_value", {"threshold": 1e9}), ("scale", {"factor": 0.25})], 1),  # a tail scale
    ],
)
def test_hook_effect_is_the_real_ratio_of_the_step(mlp, hooks, which):
    """The norm ratio a hook reports is what it did to the step's gradient: the final gradient's
    norm over plain torch's accumulated one (the no-op clip changes nothing)."""
    got, snap, ids = accumulated_step(mlp, hooks, steps=2)
    real = _norm(got) / _norm(plain_sum(mlp))
    ratio = snap["hook_effects"][ids[which]]["norm_ratio"]
    assert ratio == pytest.approx(real, rel=1e-5)
    if hooks[which][0] == "scale":
        assert real == pytest.approx(abs(hooks[which][1]["factor"]), rel=1e-5)


def test_head_scale_changed_counts_every_contribution(mlp):
    _, snap, ids = accumulated_step(mlp, [("scale", {"factor": 0.5})])
    nonzero = sum(int((g != 0).sum()) for gs in plain_grads(mlp) for g in gs)
    assert snap["hook_effects"][ids[0]]["changed"] == nonzero


# ---------------------------------------------------------------- toggles, removal, close, autograd.grad


def our_tensor_hooks(model: nn.Module) -> int:
    return sum(
        len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) + len(p._backward_hooks or {})
        for p in model.parameters()
    )


def test_toggling_and_removing_restore_untouched_gradients(mlp):
    opt = torch.optim.SGD(mlp.parameters(), lr=0.0)
    cap = GradCapture(opt)
    plain = plain_sum(mlp)
    halved = [0.5 * g for g in plain_sum(mlp)]

    def step() -> list[torch.Tensor]:
        opt.zero_grad(set_to_none=True)
        for x, y in MICRO:
            loss_of(mlp, x, y).backward()
        opt.step()
        return cap.grads

    with inspector.attach(mlp, opt, every=1) as insp:
        clip = insp.add_hook("clip_value", target="*", point="post_accumulate", threshold=1e9)
        h = insp.add_hook("scale", target="*", point="post_accumulate", factor=0.5)  # a tail scale
        close(step(), halved)
        assert our_tensor_hooks(mlp) > 0
        h.disable()
        assert all(torch.equal(a, b) for a, b in zip(step(), plain, strict=True))
        h.enable()
        close(step(), halved)
        h.remove()
        clip.remove()
        assert all(torch.equal(a, b) for a, b in zip(step(), plain, strict=True))
        assert our_tensor_hooks(mlp) == 0
        insp.add_hook("scale", target="*", point="post_accumulate", factor=0.5)
        close(step(), halved)
    assert our_tensor_hooks(mlp) == 0  # close() leaves none


def test_autograd_grad_between_backwards_is_left_alone(mlp):
    """``torch.autograd.grad`` does not accumulate into ``.grad``: it gets plain gradients, and the
    step's accumulation is not disturbed."""
    opt = torch.optim.SGD(mlp.parameters(), lr=0.0)
    cap = GradCapture(opt)
    x0, y0 = MICRO[0]
    with inspector.attach(mlp, opt, every=1) as insp:
        insp.add_hook("clip_value", target="*", point="post_accumulate", threshold=1e9)
        insp.add_hook("scale", target="*", point="post_accumulate", factor=0.5)
        opt.zero_grad(set_to_none=True)
        for x, y in MICRO:
            loss_of(mlp, x, y).backward()
            side = torch.autograd.grad(loss_of(mlp, x0, y0), list(mlp.parameters()))
            close(list(side), plain_grads(mlp, MICRO[:1])[0], rtol=0, atol=0)
        opt.step()
    close(cap.grads, [0.5 * g for g in plain_sum(mlp)])


def test_zero_grad_to_none_between_backwards_starts_over(mlp):
    """Setting ``.grad`` to None (``zero_grad()``'s default) within a step starts the accumulation over."""
    opt = torch.optim.SGD(mlp.parameters(), lr=0.0)
    cap = GradCapture(opt)
    with inspector.attach(mlp, opt, every=1) as insp:
        insp.add_hook("l2", target="*", point="post_accumulate", lam=0.1)
        insp.add_hook("scale", target="*", point="post_accumulate", factor=0.5)
        for x, y in MICRO:
            opt.zero_grad(set_to_none=True)
            loss_of(mlp, x, y).backward()
        opt.step()
    last = plain_grads(mlp, MICRO[-1:])[0]
    close(cap.grads, [(g + 0.1 * p.detach()) * 0.5 for g, p in zip(last, mlp.parameters(), strict=True)])
