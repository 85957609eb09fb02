"""Hook semantics: each kind equals its plain-torch reference, at the point it claims to run."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

import inspector
from tests.unit.conftest import GradCapture, batch, loss_of, reference_grads, seed_mlp, train_step


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_norm_global_equals_clip_grad_norm_(mlp, norm_type):
    x, y = batch()
    ref = copy.deepcopy(mlp)
    loss_of(ref, x, y).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type=norm_type)
    opt = torch.optim.SGD(mlp.parameters(), lr=0.1)
    with inspector.attach(mlp, opt) as insp:
        insp.add_hook("clip_norm", target="*", max_norm=0.05, norm_type=norm_type)
        cap = GradCapture(opt)
        train_step(mlp, opt, x, y)
    for got, p in zip(cap.grads, ref.parameters(), strict=True):
        assert close(got, p.grad)


def test_clip_norm_per_tensor(mlp):
    x, y = batch()
    ref = reference_grads(mlp, x, y)
    opt = torch.optim.SGD(mlp.parameters(), lr=0.1)
    with inspector.attach(mlp, opt) as insp:
        insp.add_hook("clip_norm", target="*", max_norm=0.1, mode="per_tensor")
        cap = GradCapture(opt)
        train_step(mlp, opt, x, y)
    for got, r in zip(cap.grads, ref, strict=True):
        expect = r * min(1.0, 0.1 / (float(r.norm()) + 1e-6))
        assert close(got, expect)


@pytest.mark.parametrize("point", ["pre_step", "post_accumulate"])
def test_clip_value_equals_clip_grad_value_(mlp, point):
    x, y = batch()
    ref = copy.deepcopy(mlp)
    loss_of(ref, x, y).backward()
    torch.nn.utils.clip_grad_value_(ref.parameters(), 0.02)
    opt = torch.optim.SGD(mlp.parameters(), lr=0.1)
    with inspector.attach(mlp, opt) as insp:
        insp.add_hook("clip_value", target="*", point=point, threshold=0.02)
        cap = GradCapture(opt)
        train_step(mlp, opt, x, y)
    for got, p in zip(cap.grads, ref.parameters(), strict=True):
        assert torch.equal(got, p.grad)


def test_scale_only_targets(mlp):
    x, y = batch()
    ref = reference_grads(mlp, x, y)
    opt = torch.optim.SGD(mlp.parameters(), lr=0.1)
    with inspector.attach(mlp, opt) as insp:
        insp.add_hook("scale", target="0.*", factor=0.1)
        cap = GradCapture(opt)
        train_step(mlp, opt, x, y)
    names = insp.params
    for name, got, r in zip(names, cap.grads, ref, strict=True):
        assert close(got, r * 0.1 if name.startswith("0.") else r), name


def test_l2_adds_lam_times_param(mlp):
    x, y = batch()
    ref = reference_grads(mlp, x, y)
    opt = torch.optim.SGD(mlp.parameters(), lr=0.1)
    before = [p.detach().clone() for p in mlp.parameters()]
    with inspector.attach(mlp, opt) as insp:
        insp.add_hook("l2", target="*", lam=0.01)
        cap = GradCapture(opt)
        train_step(mlp, opt, x, y)
    for got, r, p in zip(cap.grads, ref, before, strict=True):
        assert close(got, r + 0.01 * p)


def test_noise_uses_own_generator_and_is_reproducible(mlp):
    x, y = batch()
    results = []
    for _ in range(2):
        model = seed_mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(123)
        with inspector.attach(model, opt) as insp:
            insp.add_hook("noise", target="*", std=0.5, seed=7)
            cap = GradCapture(opt)
            train_step(model, opt, x, y)
        results.append(cap.grads)
        results.append(torch.rand(1))  # the global RNG was not consumed by the noise
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[2], strict=True))
    assert torch.equal(results[1], results[3])
    ref = reference_grads(seed_mlp(), x, y)
    assert not torch.allclose(results[0][0], ref[0])


def test_freeze_under_adam_does_not_move_the_parameter(mlp):
    opt = torch.optim.Adam(mlp.parameters(), lr=0.1, weight_decay=0.1)
    x, y = batch()
    train_step(mlp, opt, x, y)  # Adam has state (momentum) for every parameter now
    frozen = mlp[0].weight.detach().clone()
    with inspector.attach(mlp, opt) as insp:
        insp.add_hook("freeze", target="0.weight")
        for _ in range(3):
            train_step(mlp, opt, x, y)
    assert torch.equal(mlp[0].weight, frozen)
    assert not torch.equal(mlp[0].bias, frozen[0])  # the others still train


def test_zero_scale_does_move_under_adam_momentum(mlp):
    """Why freeze exists: a zero scale still lets Adam's momentum move the parameter."""
    opt = torch.optim.Adam(mlp.parameters(), lr=0.1)
    x, y = batch()
    train_step(mlp, opt, x, y)
    w = mlp[0].weight.detach().clone()
    with inspector.attach(mlp, opt) as insp:
        insp.add_hook("scale", target="0.weight", factor=0.0)
        train_step(mlp, opt, x, y)
    assert not torch.equal(mlp[0].weight, w)


def test_gradient_accumulation_pre_step_once_post_accumulate_per_backward(mlp):
    opt = torch.optim.SGD(mlp.parameters(), lr=0.1)
    calls = {"pre_step": 0, "post_accumulate": 0}

    def counter(point):
        def fn(name, param):
            calls[point] += 1

        return fn

    k = 4
    with inspector.attach(mlp, opt, every=1) as insp:
        insp.add_hook(counter("pre_step"), target="2.bias", point="pre_step")
        insp.add_hook(counter("post_accumulate"), target="2.bias", point="post_accumulate")
        for step in range(2):
            opt.zero_grad()
            for micro in range(k):
                x, y = batch(seed=10 * step + micro, n=8)
                (loss_of(mlp, x, y) / k).backward()
            opt.step()
        assert insp.step == 2
    assert calls == {"pre_step": 2, "post_accumulate": 2 * k}


def test_clip_value_bounds_the_final_gradient_at_both_points(mlp):
    """post_accumulate clamps the running sum after each backward, pre_step the final sum: both bound it."""
    opt = torch.optim.SGD(mlp.parameters(), lr=0.0)
    got = {}
    for point in ("pre_step", "post_accumulate"):
        model = seed_mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        with inspector.attach(model, opt) as insp:
            insp.add_hook("clip_value", target="*", point=point, threshold=1e-3)
            cap = GradCapture(opt)
            for micro in range(3):
                x, y = batch(seed=micro, n=8)
                loss_of(model, x, y).backward()
            opt.step()
        got[point] = cap.grads
    assert all(float(g.abs().max()) <= 1e-3 + 1e-9 for g in got["pre_step"])
    assert all(float(g.abs().max()) <= 1e-3 + 1e-9 for g in got["post_accumulate"])  # the last clamp wins too


def test_zero_grad_set_to_none_and_frozen_requires_grad(mlp):
    mlp[0].weight.requires_grad_(False)
    opt = torch.optim.SGD([p for p in mlp.parameters() if p.requires_grad], lr=0.1)
    with inspector.attach(mlp, opt, every=1) as insp:
        insp.add_hook("clip_value", target="*", threshold=0.01)
        insp.add_hook("scale", target="*", point="post_accumulate", factor=0.5)
        for s in range(3):
            train_step(mlp, opt, *batch(seed=s))
        snap = insp.latest()
    i = insp.params.index("0.weight")
    assert snap["grad_norm"][i] is None and snap["grad_norm_raw"][i] is None
    assert snap["param_norm"][i] is not None
    assert all(v is not None for j, v in enumerate(snap["grad_norm"]) if j != i)


def test_scaler_statistics_are_unscaled_and_post_accumulate_modifying_refused():
    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x, y = batch()
    ref = reference_grads(model, x, y)
    with inspector.attach(model, opt, scaler=scaler, every=1) as insp:
        with pytest.raises(inspector.HookError) as e:
            insp.add_hook("clip_value", target="*", point="post_accumulate", threshold=1.0)
        assert e.value.loc == ("point",) and "GradScaler" in e.value.msg
        insp.add_hook("nan_guard", target="*", point="post_accumulate")  # report only: allowed
        opt.zero_grad()
        scaler.scale(loss_of(model, x, y)).backward()
        scaler.step(opt)
        scaler.update()
        snap = insp.latest()
    for got, r in zip(snap["grad_norm"], ref, strict=True):
        assert got == pytest.approx(float(r.norm()), rel=1e-4)


def test_scaler_skipped_step_is_reported_and_not_counted():
    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with inspector.attach(model, opt, scaler=scaler, every=1) as insp:
        for s in range(3):
            x, y = batch(seed=s)
            if s == 1:
                x = x.clone()
                x[0, 0] = float("inf")  # this step's gradients overflow: the scaler skips it
            opt.zero_grad()
            scaler.scale(loss_of(model, x, y)).backward()
            scaler.step(opt)
            scaler.update()
        assert insp.step == 2
        skipped = [e for e in insp.events() if e["kind"] == "step_skipped"]
    assert len(skipped) == 1 and skipped[0]["reason"] == "scaler" and skipped[0]["step"] == 2


def test_lbfgs_closure_runs_pre_step_after_backward(mlp):
    opt = torch.optim.LBFGS(mlp.parameters(), lr=0.1, max_iter=4)
    x, y = batch()
    seen = []

    def check(name, param):
        seen.append(param.grad is not None)

    def closure():
        opt.zero_grad()
        loss = loss_of(mlp, x, y)
        loss.backward()
        return loss

    with inspector.attach(mlp, opt, every=1) as insp:
        insp.add_hook("clip_value", target="*", threshold=1e-3)
        insp.add_hook(check, target="2.bias")
        cap = GradCapture(opt)  # runs before the closure: sees nothing yet
        loss = opt.step(closure)
        snap = insp.latest()
    assert torch.is_tensor(loss)
    assert len(seen) >= 2 and all(seen)  # once per closure evaluation, always after backward
    assert all(g is None for g in cap.grads)
    assert max(v for v in snap["grad_absmax"] if v is not None) <= 1e-3 + 1e-9
    assert insp.step == 1


def test_live_edit_from_another_thread_lands_at_a_boundary(mlp):
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    with inspector.attach(mlp, opt, every=1) as insp:
        for s in range(2):
            train_step(mlp, opt, *batch(seed=s))
        # between steps (no step under way): a pre_step-only edit applies at once
        box = {}
        t = threading.Thread(
            target=lambda: box.update(h=insp.add_hook("clip_value", target="*", threshold=1e-4))
        )
        t.start()
        t.join()
        assert insp.hooks()[0]["applied_step"] == 3
        # during a step: the forward has started; the edit waits for the boundary
        opt.zero_grad()
        loss = loss_of(mlp, *batch(seed=5))
        t = threading.Thread(target=lambda: box["h"].update(threshold=1e-2))
        t.start()
        t.join()
        assert insp.hooks()[0]["applied_step"] is None  # pending
        assert insp.hooks()[0]["params"]["threshold"] == 1e-2  # the requested config
        version = insp.config_version
        loss.backward()
        opt.step()
        snap = insp.latest()
        assert snap["step"] == 3 and max(v for v in snap["grad_absmax"]) <= 1e-4 + 1e-9  # old value in force
        assert insp.config_version == version + 1
        assert insp.hooks()[0]["applied_step"] == 4
        train_step(mlp, opt, *batch(seed=6))
        snap = insp.latest()
        assert max(v for v in snap["grad_absmax"]) > 1e-4
        assert max(v for v in snap["grad_absmax"]) <= 1e-2 + 1e-9
        applied = [e for e in insp.events() if e["kind"] == "hook_applied"]
        assert [e["applied_step"] for e in applied] == [3, 4]


def test_post_accumulate_edit_from_another_thread_is_registered_by_the_training_thread(mlp):
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    registering_threads = []
    p = mlp[2].bias
    orig = p.register_post_accumulate_grad_hook

    with inspector.attach(mlp, opt, every=1) as insp:

        def spy(hook):
            registering_threads.append(threading.get_ident())
            return orig(hook)

        p.register_post_accumulate_grad_hook = spy  # instance attribute: only this tensor
        t = threading.Thread(
            target=lambda: insp.add_hook("scale", target="2.bias", point="post_accumulate", factor=0.0)
        )
        t.start()
        t.join()
        assert registering_threads == []  # not from the editing thread
        assert insp.hooks()[0]["applied_step"] is None
        train_step(mlp, opt, *batch())
        assert registering_threads == [threading.get_ident()]
        assert insp.hooks()[0]["applied_step"] == 1
        assert insp.latest()["grad_norm"][insp.params.index("2.bias")] == 0.0
    del p.register_post_accumulate_grad_hook


def test_invalid_edit_changes_nothing(mlp):
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    with inspector.attach(mlp, opt) as insp:
        h = insp.add_hook("clip_value", target="*", threshold=1.0)
        before, version = insp.hooks(), insp.config_version
        bad = [
            lambda: insp.add_hook("clip_value", target="*", threshold=-1),
            lambda: insp.add_hook("nope", target="*"),
            lambda: insp.add_hook("scale", target="*", factor=True),
            lambda: insp.add_hook("scale", target="*", factor=float("nan")),
            lambda: insp.add_hook("scale", target="no.such.*", factor=1.0),
            lambda: insp.add_hook("freeze", target="*", point="post_accumulate"),
            lambda: h.update(threshold=0),
            lambda: h.update(bogus=1),
            lambda: insp.update_hook(h.id, enabled="yes"),
            lambda: insp.add_hook("noise", target="*", std=0.1, seed=2**64),
            lambda: insp.import_hooks(
                [
                    {"kind": "clip_value", "target": "*", "params": {"threshold": 1}},
                    {"kind": "scale", "target": "*", "params": {}},
                ]
            ),
        ]
        for call in bad:
            with pytest.raises(inspector.HookError):
                call()
        assert insp.hooks() == before and insp.config_version == version
        with pytest.raises(inspector.HookNotFound):
            insp.hook("h999")


def test_record_before_and_after_step(mlp):
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    got = []
    with inspector.attach(mlp, opt, every=1) as insp:
        insp.subscribe(lambda kind, payload: got.append((kind, payload)))
        x, y = batch()
        opt.zero_grad()
        loss = loss_of(mlp, x, y)
        insp.record(loss=loss, acc=0.5)
        insp.record(acc=1.0)  # averaged within the step
        loss.backward()
        opt.step()
        assert insp.latest()["loss"] == pytest.approx(float(loss.detach()))
        assert insp.latest()["scalars"] == {"acc": 0.75}
        # after the step, before the next forward: attaches to step 1, sent late
        insp.record(val_loss=torch.tensor(2.0))
        train_step(mlp, opt, x, y)
    # a late record's tensor reaches the host a boundary later (never a wait), or at close()
    snaps = {s["step"]: s for s in insp.snapshots()}
    assert snaps[1]["scalars"] == {"acc": 0.75, "val_loss": 2.0}
    assert "val_loss" not in snaps[2]["scalars"]
    loss1 = float(loss.detach())
    sent = [p for k, p in got if k == "scalars" and p["step"] == 1]
    # step 1's records with its snapshot, then again merged with the late one (the later replaces it)
    assert sent == [
        {"step": 1, "loss": pytest.approx(loss1), "scalars": {"acc": 0.75}},
        {"step": 1, "loss": pytest.approx(loss1), "scalars": {"acc": 0.75, "val_loss": 2.0}},
    ]
