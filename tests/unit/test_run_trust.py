"""Training must not break or be misled: the guards act on the whole step, a loop without an
optimizer is told what it lacks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import inspector


def test_nan_guard_skip_skips_the_optimizers_unwatched_parameters_too():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    scale = nn.Parameter(torch.ones(()))  # learnable, outside the attached module
    opt = torch.optim.SGD([*model.parameters(), scale], lr=0.1)
    insp = inspector.attach(model[0], opt, every=1)  # a part of the model, as attach(model.encoder, opt)
    insp.add_hook("nan_guard", target="*", action="skip")
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    for bad in (False, True, False):
        opt.zero_grad()
        loss = nn.functional.mse_loss(scale * model(x * (float("nan") if bad else 1.0)), y)
        loss.backward()
        before = [p.detach().clone() for p in (scale, *model.parameters())]
        opt.step()
        after = [p.detach() for p in (scale, *model.parameters())]
        if bad:
            assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True)), (
                "the whole step skipped"
            )
    assert all(torch.isfinite(p).all() for p in (scale, *model.parameters()))
    assert [e["kind"] for e in insp.events()].count("step_skipped") == 1
    insp.close()


@pytest.mark.parametrize("hook", [("freeze", {}), ("nan_guard", {"action": "skip"})])
def test_the_mark_step_loop_its_docstring_shows_runs_with_freeze_and_skip(hook):
    import textwrap

    doc = inspector.Inspector.mark_step.__doc__
    loop = textwrap.dedent(doc[doc.index("for x, y in data:") :]).strip()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    params = list(model.parameters())
    insp = inspector.attach(model, every=1)
    kind, params_ = hook
    insp.add_hook(kind, target="0.*", **params_)
    x = torch.randn(8, 3)
    data = [(x, torch.randn(8, 1)), (x * float("nan"), torch.randn(8, 1)), (x, torch.randn(8, 1))]
    first = model[0].weight.detach().clone()
    exec(loop, {"torch": torch, "data": data, "model": model, "params": params, "insp": insp,
                "loss_fn": nn.functional.mse_loss, "lr": 0.1})  # fmt: skip
    assert insp.step == 3
    if kind == "freeze":
        assert torch.equal(model[0].weight, first), "the frozen layer is not updated"
    else:
        assert all(torch.isfinite(p).all() for p in params), "the NaN step was skipped"
    insp.close()


def test_a_model_saved_whole_while_attached_loads_with_weights_only(tmp_path):
    import copy
    import pickle

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    insp = inspector.attach(model, opt, every=1)
    insp.add_hook("module_log", target="0", point="module", grad_input=True)
    x = torch.randn(8, 3)
    model(x).sum().backward()
    opt.step()
    path = tmp_path / "model.pt"
    torch.save(model, path)  # as pytorch/examples' word_language_model does every epoch
    with torch.serialization.safe_globals([nn.Sequential, nn.Linear, nn.ReLU]):
        loaded = torch.load(path, weights_only=True)  # the default since torch 2.6
    assert torch.equal(loaded(x), model(x))
    for copied in (loaded, copy.deepcopy(model), torch.optim.swa_utils.AveragedModel(model).module):
        for m in copied.modules():
            assert not m._forward_pre_hooks and not m._forward_hooks, "nothing of ours in a copy"
            assert "__getstate__" not in m.__dict__
    assert b"inspector" not in pickle.dumps(model) and b"gradient_inspector" not in pickle.dumps(model)
    before = len(insp.snapshots())
    model(x).sum().backward()
    opt.step()
    assert len(insp.snapshots()) == before + 1, "the original stays inspected"
    torch.save(opt, tmp_path / "opt.pt")
    insp.close()
    assert all("__getstate__" not in m.__dict__ for m in model.modules()), "close() leaves nothing"


def test_a_loop_without_an_optimizer_or_mark_step_is_told_what_it_lacks():
    torch.manual_seed(0)
    x, y = torch.randn(8, 3), torch.randn(8, 1)

    def by_hand(model, insp, n: int, mark: bool) -> None:
        for _ in range(n):
            nn.functional.mse_loss(model(x), y).backward()
            if mark:
                insp.mark_step()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.01 * p.grad
                    p.grad = None

    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    insp = inspector.attach(model)  # the README's two lines, around a loop that updates by hand
    by_hand(model, insp, inspector.step.lifecycle.NO_BOUNDARY_AFTER - 1, mark=False)
    assert not [e for e in insp.events() if e["kind"] == "no_step_boundary"]
    with pytest.warns(RuntimeWarning, match=r"no step boundary.*insp\.mark_step\(\)"):
        by_hand(model, insp, 1, mark=False)
    by_hand(model, insp, 100, mark=False)  # said once
    (ev,) = [e for e in insp.events() if e["kind"] == "no_step_boundary"]
    assert "mark_step()" in ev["message"] and insp.step == 0
    insp.close()

    model = nn.Sequential(nn.Linear(3, 1))
    insp = inspector.attach(model)
    by_hand(model, insp, 3 * inspector.step.lifecycle.NO_BOUNDARY_AFTER, mark=True)  # as documented: silent
    assert insp.step == 3 * inspector.step.lifecycle.NO_BOUNDARY_AFTER
    assert not [e for e in insp.events() if e["kind"] == "no_step_boundary"]
    insp.close()


@pytest.mark.parametrize("rule", [False, True])
@pytest.mark.parametrize("every", [1, 4])
def test_records_made_per_micro_batch_give_the_steps_mean_on_both_sides_of_step(every, rule):
    """(``rule``: a rule on the loss has every step's records sent at its boundary, the late ones
    averaged in after: the same means, and the rule fires on them.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    insp = inspector.attach(model, opt, every=every)
    if rule:
        insp.add_rule(signal="loss", op=">", threshold=0, action="alert", cooldown=0)
    sent: dict[int, object] = {}
    messages: list[int] = []
    insp.subscribe(lambda kind, p: sent.__setitem__(p["step"], p["loss"]) if kind == "scalars" else None)
    insp.subscribe(lambda kind, p: messages.append(p["step"]) if kind == "scalars" else None)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    for step in range(1, 6):
        opt.zero_grad()
        for micro in range(2):  # two micro-batches; the last one's record comes after step()
            nn.functional.mse_loss(model(x), y).backward()
            if micro == 0:
                insp.record(loss=0.0 + step, acc=torch.tensor(0.0))
        opt.step()
        insp.record(loss=3.0 + step, acc=torch.tensor(1.0))
    insp.finish()
    insp.close()  # every message delivered
    assert {s: sent[s] for s in range(1, 6)} == {s: 1.5 + s for s in range(1, 6)}, "the mean of both"
    for snap in insp.snapshots():
        assert snap["loss"] == 1.5 + snap["step"] and snap["scalars"]["acc"] == 0.5
    sampled = {snap["step"] for snap in insp.snapshots()}
    assert all(messages.count(s) == 1 for s in range(1, 6) if s not in sampled), messages  # the mean, once
    if rule:  # steps 1-3: step 5's boundary was the last one (a late record's value: two later)
        fired = [(e["step"], e["value"]) for e in insp.events() if e["kind"] == "rule_fired"]
        assert fired == [(s, 1.5 + s) for s in range(1, 4)]


def test_the_snapshot_ring_is_bounded_in_bytes_whatever_the_models_size():
    from dataclasses import replace

    from inspector.feed import MAX_RING_BYTES, Feed, approx_bytes

    model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(150)])  # 300 parameter tensors
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with inspector.attach(model, opt, every=1, checkpoints=0) as insp:
        model(torch.randn(2, 1)).sum().backward()
        opt.step()
        (snap,) = insp._feed.snapshots
        assert insp._feed.max_bytes == MAX_RING_BYTES
    per = approx_bytes(snap)
    feed = Feed(max_bytes=10 * per + per // 2)
    for step in range(1, 51):
        feed.publish("snapshot", replace(snap, step=step))
    assert [s.step for s in feed.snapshots] == list(range(41, 51)), "the newest that fit"
    assert feed.ring_bytes == 10 * per <= feed.max_bytes
    feed.drop_after(45, (0, 0))
    assert feed.ring_bytes == 5 * per


@pytest.mark.parametrize("optim", ["sgd", "adam"])
def test_the_snapshot_rings_accounted_bytes_are_what_the_process_holds(optim):
    """The ring's accounting (``approx_bytes``, ``ring_bytes``) against what emptying the ring
    frees (tracemalloc, independent of the accounting), at 300 tensors with every step sampled
    and the wire dicts made (as the server has them made): never below it, at most 1.6 times it
    (nulls and small counts are no float objects: SGD's optimizer lists are all null);
    so a ring bounded at ``max_bytes`` holds no more than that."""
    import gc
    import tracemalloc

    from inspector.feed import approx_bytes

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(150)])  # 300 parameter tensors
    make = torch.optim.Adam if optim == "adam" else torch.optim.SGD
    opt = make(model.parameters(), lr=0.0)
    insp = inspector.attach(model, opt, every=1, checkpoints=0)
    insp.subscribe(lambda kind, payload: None)  # (the wire dicts made, as the server's are)

    def step() -> None:
        opt.zero_grad()
        model(torch.randn(2, 1)).sum().backward()
        opt.step()

    step()
    insp._feed.flush()
    feed = insp._feed
    feed.max_bytes = 12 * approx_bytes(feed.snapshots[-1])  # (about 12 snapshots: 40 steps overflow it)
    feed.drop_after(0, (0, 0))
    gc.collect()
    tracemalloc.start()
    try:
        for _ in range(40):
            step()
        feed.flush()
        gc.collect()
        kept, accounted = len(feed.snapshots), feed.ring_bytes
        assert 5 < kept < 40 and accounted <= feed.max_bytes
        before = tracemalloc.get_traced_memory()[0]
        feed.drop_after(0, (0, 0))  # the ring emptied: what it held is freed
        gc.collect()
        held = before - tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
        insp.close()
    assert held <= accounted <= 1.6 * held, (held / kept, accounted / kept)
    assert held <= feed.max_bytes


def test_a_hook_on_every_parameter_reaches_those_unfrozen_later():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for p in model[0].parameters():
        p.requires_grad_(False)  # gradual unfreezing: the first layer joins later
    insp = inspector.attach(model, opt, every=1)
    insp.add_hook("clip_value", target="*", point="post_accumulate", threshold=1e-3)
    x, y = torch.randn(8, 3) * 100, torch.randn(8, 1) * 100
    seen = {}
    insp.add_hook(lambda name, p: seen.__setitem__(name, float(p.grad.abs().max())), target="*")

    def step() -> None:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    step()
    step()
    thr = float(torch.tensor(1e-3))  # the threshold as the float32 gradient holds it
    assert "0.weight" not in seen and seen["2.weight"] <= thr
    for p in model[0].parameters():
        p.requires_grad_(True)
    step()
    assert seen["0.weight"] <= thr and seen["0.bias"] <= thr, "clipped once unfrozen"
    snap = insp.snapshots()[-1]
    assert snap["grad_norm"][insp.params.index("0.weight")] is not None
    insp.close()


@pytest.mark.parametrize("amp", [None, "unfused", "fused"])
def test_the_users_own_clipping_does_not_hide_what_backward_produced(amp):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=amp == "fused")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if amp else None
    insp = inspector.attach(model, opt, scaler=scaler, every=1)
    x, y = torch.randn(8, 3) * 10, torch.randn(8, 1) * 100
    for clip in (False, True):
        opt.zero_grad()
        for _ in range(2):  # two micro-batches
            loss = nn.functional.mse_loss(model(x), y) / 2
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler is not None and amp == "unfused":
            scaler.unscale_(opt)
        grads = [
            p.grad.detach().clone() / (scaler.get_scale() if amp == "fused" else 1.0)
            for p in model.parameters()
        ]
        truth = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
        if clip:  # nanoGPT's own clip between backward() and step()
            if amp == "fused":
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        snap = insp.latest()
        assert snap["total_norm_backward"] == pytest.approx(truth, rel=1e-5), "as backward left them"
        assert snap["total_norm_raw"] == pytest.approx(1.0 if clip else truth, rel=1e-5), (
            "as the step saw them"
        )
    insp.close()


class _Half(nn.Module):
    """Its output is a view of part of its input (the first half of the features)."""

    def forward(self, x):  # noqa: ANN001, ANN201
        return x[:, :4]


def test_module_log_sees_a_view_that_a_later_module_modifies_in_place():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Flatten(0), nn.ReLU(inplace=True), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(4, 4)
    # the truth: the gradient of Flatten's output (= of ReLU's input, as ReLU read it)
    h = model[0](x).flatten().detach().requires_grad_(True)
    model[3](torch.relu(h)).sum().backward()
    truth = float(h.grad.norm())
    model.zero_grad()
    insp = inspector.attach(model, opt, every=1)
    insp.add_hook("module_log", target="*", point="module", grad_input=True)
    model(x).sum().backward()
    opt.step()
    mods = insp.latest()["modules"]
    assert mods["1"]["grad_output_norm"] == pytest.approx(truth, rel=1e-6), "Flatten's output: a view"
    assert mods["2"]["grad_input_norm"] == pytest.approx(truth, rel=1e-6), "ReLU(inplace=True)'s input"
    insp.close()

    half = nn.Sequential(nn.Linear(4, 8), _Half(), nn.ReLU(inplace=True), nn.Linear(4, 1))
    opt = torch.optim.SGD(half.parameters(), lr=0.0)
    insp = inspector.attach(half, opt, every=1)
    insp.add_hook("module_log", target="1", point="module")
    half(x).sum().backward()
    opt.step()
    entry = insp.latest()["modules"]["1"]
    assert entry["grad_output_norm"] is None and "modified in place" in entry["note"], "null, with why"
    insp.close()
