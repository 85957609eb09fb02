"""Hooks do exactly what they say: sparse gradients, per-step
hook effects, the post-accumulate NaN guard's report rate, and ``grad_input`` of in-place modules."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import inspector
from tests.unit.conftest import GradCapture, batch, loss_of, seed_mlp, train_step

TOKENS = torch.tensor([1, 2, 3, 2, 7])


def sparse_model() -> nn.Sequential:
    """An ``Embedding(sparse=True)`` (a sparse gradient) before a Linear (dense ones)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 3))


def sparse_loss(model: nn.Module) -> torch.Tensor:
    return model(TOKENS).pow(2).sum()


def raw_grads(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter's gradient on a copy of ``model``, with no inspector attached."""
    ref = copy.deepcopy(model)
    sparse_loss(ref).backward()
    return [p.grad.detach().clone() for p in ref.parameters()]


def errors(insp: inspector.Inspector) -> list[dict]:
    return [e for e in insp.events() if e["kind"] in ("hook_error", "telemetry_error")]


def _clip_norm(max_norm: float, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    return [g * min(1.0, max_norm / (float(g.norm()) + 1e-6)) for g in grads]


def _clip_global(max_norm: float, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    total = math.sqrt(sum(float(g.norm()) ** 2 for g in grads))
    return [g * min(1.0, max_norm / (total + 1e-6)) for g in grads]


# kind, params, the expected final dense gradients from (raw dense gradients, dense parameters)
DENSE_CASES = [
    ("clip_value", {"threshold": 0.5}, lambda gs, ps: [g.clamp(-0.5, 0.5) for g in gs]),
    ("clip_norm", {"max_norm": 0.1, "mode": "per_tensor"}, lambda gs, ps: _clip_norm(0.1, gs)),
    ("scale", {"factor": 0.5}, lambda gs, ps: [g * 0.5 for g in gs]),
    ("l2", {"lam": 0.1}, lambda gs, ps: [g + 0.1 * p for g, p in zip(gs, ps, strict=True)]),
    ("nan_guard", {"action": "zero"}, lambda gs, ps: gs),  # all finite: nothing to do
]


@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize("point", ["pre_step", "post_accumulate"])
@pytest.mark.parametrize(("kind", "params", "expect"), DENSE_CASES, ids=[c[0] for c in DENSE_CASES])
def test_sparse_gradient_is_left_alone_and_the_hook_keeps_working_on_every_dense_target(
    kind, params, expect, point, every
):
    model = sparse_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: every step sees the same gradients
    ref = raw_grads(model)
    want = expect(ref[1:], [p.detach() for p in list(model.parameters())[1:]])
    with inspector.attach(model, opt, every=every) as insp:
        h = insp.add_hook(kind, target="*", point=point, **params)
        cap = GradCapture(opt)
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            sparse_loss(model).backward()
            opt.step()
            assert cap.grads[0].layout == torch.sparse_coo
            assert torch.equal(cap.grads[0].to_dense(), ref[0].to_dense())  # the sparse one: untouched
            for got, w in zip(cap.grads[1:], want, strict=True):
                assert torch.allclose(got, w, rtol=1e-5, atol=1e-7)  # every dense one: the hook's effect
        assert errors(insp) == []
        assert next(s for s in insp.hooks() if s["id"] == h.id)["enabled"] is True


def test_sparse_gradient_is_left_alone_by_global_clip_norm_over_the_dense_targets():
    model = sparse_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ref = raw_grads(model)
    with inspector.attach(model, opt, every=1) as insp:
        insp.add_hook("clip_norm", target="*", max_norm=0.1)
        cap = GradCapture(opt)
        opt.zero_grad(set_to_none=True)
        sparse_loss(model).backward()
        opt.step()
        assert errors(insp) == []
    assert torch.equal(cap.grads[0].to_dense(), ref[0].to_dense())
    for got, w in zip(cap.grads[1:], _clip_global(0.1, ref[1:]), strict=True):
        assert torch.allclose(got, w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("point", ["pre_step", "post_accumulate"])
def test_sparse_gradient_is_left_alone_by_noise_and_python_hooks(point):
    model = sparse_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ref = raw_grads(model)
    seen: list[str] = []

    def double(name: str, param: torch.Tensor) -> None:
        seen.append(name)
        param.grad.mul_(2.0)

    with inspector.attach(model, opt, every=1) as insp:
        insp.add_hook("noise", target="1.weight", point=point, std=0.1)
        insp.add_hook(double, target="*", point=point)
        cap = GradCapture(opt)
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            sparse_loss(model).backward()
            opt.step()
            assert torch.equal(cap.grads[0].to_dense(), ref[0].to_dense())
            assert not torch.allclose(cap.grads[1], 2 * ref[1])  # noise, then doubled
            assert torch.allclose(cap.grads[2], 2 * ref[2])
        assert errors(insp) == []
        assert all(s["enabled"] for s in insp.hooks())
    assert "0.weight" not in seen and {"1.weight", "1.bias"} <= set(seen)


def test_freeze_also_drops_a_sparse_gradient():
    model = sparse_model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with inspector.attach(model, opt, every=1) as insp:
        insp.add_hook("freeze", target="*")
        cap = GradCapture(opt)
        opt.zero_grad(set_to_none=True)
        sparse_loss(model).backward()
        opt.step()
        assert errors(insp) == []
    assert cap.grads == [None, None, None]
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("point", ["pre_step", "post_accumulate"])
def test_nan_guard_on_every_parameter_keeps_guarding_beside_a_sparse_gradient(point):
    model = sparse_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    poison = torch.tensor([1.0, math.nan, 1.0])  # the loss's weights: every gradient is NaN
    with inspector.attach(model, opt, every=1) as insp:
        h = insp.add_hook("nan_guard", target="*", point=point, action="zero")
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            (model(TOKENS) * poison).sum().backward()
            opt.step()
        assert errors(insp) == []
        assert next(s for s in insp.hooks() if s["id"] == h.id)["enabled"] is True
        found = [e for e in insp.events() if e["kind"] == "nonfinite"]
    # the guard zeroed every gradient, the sparse one's stored values included: nothing NaN reached the weights
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert found and found[0]["action_taken"] == "zero" and found[0]["point"] == point


# ---------------------------------------------------------------- 10: hook_effects per step


def _clip_counts(grads: list[torch.Tensor], thr: float, backwards: int) -> int:
    """Elements a post_accumulate clip_value changes over ``backwards`` backwards of the same batch."""
    total, acc = 0, [torch.zeros_like(g) for g in grads]
    for _ in range(backwards):
        acc = [a + g for a, g in zip(acc, grads, strict=True)]
        total += sum(int((a.abs() > thr).sum()) for a in acc)
        acc = [a.clamp(-thr, thr) for a in acc]
    return total


@pytest.mark.parametrize("backwards", [1, 2])
def test_post_accumulate_hook_effect_is_per_step_not_cumulative(mlp, backwards):
    x, y = batch()
    ref = copy.deepcopy(mlp)
    loss_of(ref, x, y).backward()
    grads = [p.grad.detach().clone() for p in ref.parameters()]
    thr = 0.01
    opt = torch.optim.SGD(mlp.parameters(), lr=0.0)  # lr 0: every step has the same gradients
    with inspector.attach(mlp, opt, every=1) as insp:
        h = insp.add_hook("clip_value", target="*", point="post_accumulate", threshold=thr)
        for _ in range(4):
            opt.zero_grad(set_to_none=True)
            for _ in range(backwards):  # gradient accumulation: the step's effect sums its backwards
                loss_of(mlp, x, y).backward()
            opt.step()
        changed = [s["hook_effects"][h.id]["changed"] for s in insp.snapshots()]
    assert changed == [_clip_counts(grads, thr, backwards)] * 4


@pytest.mark.parametrize("point", ["pre_step", "post_accumulate"])
def test_disabled_hook_reports_no_effect_and_a_removed_one_disappears(mlp, point):
    x, y = batch()
    opt = torch.optim.SGD(mlp.parameters(), lr=0.0)
    with inspector.attach(mlp, opt, every=1) as insp:
        a = insp.add_hook("clip_value", target="*", point=point, threshold=0.01)
        b = insp.add_hook("scale", target="*", point=point, factor=0.5)
        for _ in range(2):
            train_step(mlp, opt, x, y)
        assert set(insp.latest()["hook_effects"]) == {a.id, b.id}
        a.disable()
        b.remove()
        for _ in range(2):
            train_step(mlp, opt, x, y)
        after = [s["hook_effects"] for s in insp.snapshots() if s["step"] > 2]
        a.enable()
        train_step(mlp, opt, x, y)
        again = insp.latest()["hook_effects"]
    assert after == [{}, {}]
    assert set(again) == {a.id} and again[a.id]["changed"] > 0


# ---------------------------------------------------------------- 11: post_accumulate nan_guard rate


def _nan_run(point: str, action: str, backwards: int, steps: int = 20) -> list[dict]:
    model = seed_mlp()
    with torch.no_grad():
        model[0].weight[0, 0] = math.nan  # every step's loss and gradients are NaN: a persistent NaN
    x, y = batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with inspector.attach(model, opt, every=1) as insp:
        insp.add_hook("nan_guard", target="*", point=point, action=action)
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            for _ in range(backwards):
                loss_of(model, x, y).backward()
            opt.step()
        return [e for e in insp.events() if e["kind"] == "nonfinite"]


@pytest.mark.parametrize("backwards", [1, 2])
@pytest.mark.parametrize("action", ["report", "zero"])
def test_post_accumulate_nan_guard_reports_a_persistent_nan_at_the_pre_step_rate(action, backwards):
    pre = _nan_run("pre_step", action, backwards)
    post = _nan_run("post_accumulate", action, backwards)
    assert len(post) == len(pre) == 1  # a streak of 20 steps: reported on its first step
    ev = post[0]
    assert ev["step"] == 1 and ev["param"] == "0.weight" and ev["action_taken"] == action
    assert ev["point"] == "post_accumulate" and ev["streak"] == 1
    assert ev["nan"] == pre[0]["nan"] == 100 and ev["n_params"] == pre[0]["n_params"] == 4


def test_post_accumulate_nan_guard_streak_ends_when_the_gradients_are_finite_again(mlp):
    x, y = batch()
    opt = torch.optim.SGD(mlp.parameters(), lr=0.0)
    with inspector.attach(mlp, opt, every=1) as insp:
        insp.add_hook("nan_guard", target="*", point="post_accumulate", action="zero")
        for poisoned in (True, True, False, True):
            opt.zero_grad(set_to_none=True)
            loss = loss_of(mlp, x, y)
            (loss * math.nan if poisoned else loss).backward()
            opt.step()
    # the last step's finding is reported by the next boundary, or at close() at the latest
    found = [(e["step"], e["streak"]) for e in insp.events() if e["kind"] == "nonfinite"]
    assert found == [(1, 1), (4, 1)]


# ---------------------------------------------------------------- 12: grad_input of an in-place module


@pytest.mark.parametrize(
    ("module", "function"),
    [(nn.ReLU(inplace=True), torch.relu), (nn.Tanh(), torch.tanh)],
    ids=["relu_inplace", "tanh"],
)
def test_module_log_grad_input_of_an_inplace_module_is_the_real_input_gradient(module, function):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 10), module, nn.Linear(10, 1))
    x, y = batch()
    ref = copy.deepcopy(model)
    h = ref[0](x)
    a = function(h)  # the same function, out of place, so both tensors exist
    g_in, g_out = torch.autograd.grad(nn.functional.mse_loss(ref[2](a), y), [h, a])
    assert not torch.allclose(g_in, g_out)  # the activation changes the gradient: the two differ
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with inspector.attach(model, opt, every=1) as insp:
        insp.add_hook("module_log", target="1", grad_input=True)
        train_step(model, opt, x, y)
        mod = insp.latest()["modules"]["1"]
        assert errors(insp) == []
    assert mod["grad_input_norm"] == pytest.approx(float(g_in.norm()), rel=1e-5)
    assert mod["grad_output_norm"] == pytest.approx(float(g_out.norm()), rel=1e-5)


def test_a_grad_input_hook_on_the_root_removed_by_the_roots_own_forward_pre_hook_breaks_nothing():
    # the root's forward pre-hook applies pending edits; removing the root's grad_input pre-hook there
    # leaves torch calling it once more from its snapshot of the hooks, without kwargs
    import threading

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 4)
    with inspector.attach(model, opt, every=1) as insp:
        h = insp.add_hook("module_log", "", grad_input=True)
        model(x).sum().backward()
        opt.step()
        t = threading.Thread(target=h.remove)  # from another thread: applied at the next root forward
        t.start()
        t.join(10)
        model(x).sum().backward()  # must not raise
        opt.step()
        assert insp.step == 2 and not model._forward_pre_hooks_with_kwargs
