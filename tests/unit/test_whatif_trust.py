"""Rewinds that must not break or mislead a run: a rewind that cannot be carried out changes
nothing, and a rewound run replays as it ran (its NaN events, its sampled steps)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import inspector
from tests.unit.test_whatif import Loop, same_tensors


def test_a_rewind_that_cannot_be_carried_out_changes_nothing():
    loop = Loop()
    insp = loop.insp
    loop.run(range(3))
    cp = insp.checkpoint()
    loop.run(range(3, 5))
    h = insp.add_hook("clip_norm", target="*", max_norm=1.0)
    loop.run(range(5, 6))
    extra = nn.Parameter(torch.zeros(3))
    loop.opt.add_param_group({"params": [extra]})  # the optimizer gained a group since cp
    model, opt = copy.deepcopy(loop.model.state_dict()), copy.deepcopy(loop.opt.state_dict())
    hooks, step = insp.hooks(), insp.step
    assert insp.rewind(cp)["done"] is False
    (err,) = [e for e in insp.events() if e["kind"] == "rewind_error"]
    assert "no longer fits the optimizer" in err["message"] and "2 parameter groups" in err["message"]
    assert same_tensors(loop.model.state_dict(), model), "the model keeps today's weights"
    assert same_tensors(loop.opt.state_dict(), opt)
    assert (insp.hooks(), insp.step) == (hooks, step)
    assert insp.checkpoints.rewinds == 0
    loop.step(6)  # training goes on, with the hook in force
    assert insp.step == step + 1 and insp.hook(h.id).spec["applied_step"] is not None
    insp.close()


def test_a_nan_replayed_after_a_rewind_is_reported_again():
    loop = Loop()
    insp = loop.insp
    x, y = loop.batches[7]
    loop.batches[7] = (x * float("nan"), y)  # step 8's batch: NaN gradients from there on (Adam)
    loop.run(range(7))
    cp = insp.checkpoint()  # step 7: the next step is the first NaN one
    loop.run(range(7, 10))
    insp.rewind(cp)  # the abandoned branch was in a NaN streak when it was left
    loop.run(range(7, 10))
    insp.finish()
    found = [e for e in insp.events() if e["kind"] == "nonfinite"]
    assert [e["step"] for e in found] == [8], "the replay's first NaN step is reported, as the first time"
    assert found[0]["streak"] == 1
    insp.close()


def test_a_rewind_restores_the_cadence_sampled_and_histogram_steps_alike():
    loop = Loop(every=3, hist_every=2)
    insp = loop.insp
    insp.set_hist_subscription("test", [insp.params[0]])

    def sampled() -> list[tuple[int, bool]]:
        return [(s["step"], bool(s.get("hist"))) for s in insp.snapshots() if s["step"] > 5]

    loop.run(range(5))
    cp = insp.checkpoint()
    loop.run(range(5, 16))
    first = sampled()
    assert [s for s, _ in first] == [7, 10, 13, 16]
    insp.rewind(cp)
    loop.run(range(5, 16))
    assert sampled() == first, "the same sampled steps, the same histogram steps"
    insp.close()


def test_an_evaluation_forward_between_steps_is_no_step():
    loop = Loop()
    insp = loop.insp
    loop.run(range(3))
    ref = copy.deepcopy(loop.model.state_dict())
    x, y = loop.batches[40]
    with torch.no_grad():  # validation between two steps
        val = nn.functional.mse_loss(loop.model(x), y)
    insp.record(val_loss=val)
    cp = insp.checkpoint("after validation")  # "taken now between steps", as docs/your-loop.md says
    assert insp.checkpoints.list()[-1]["taken"] and insp.checkpoints.list()[-1]["step"] == 3
    with torch.inference_mode():
        loop.model(x)
    loop.run(range(3, 6))
    insp.rewind(cp)
    assert insp.step == 3 and same_tensors(loop.model.state_dict(), ref), "the rewind restores step 3"
    insp.close()


def test_close_releases_the_checkpoints_host_memory():
    import gc
    import weakref

    loop = Loop()
    insp = loop.insp
    loop.run(range(3))
    cp = insp.checkpoints.get(insp.checkpoint())
    held = weakref.ref(next(iter(cp.model.values())))
    del cp
    insp.close()
    gc.collect()
    assert held() is None, "a closed Inspector holds no checkpoint"
    assert insp.checkpoints.bytes == 0 and insp.checkpoints.list() == []


def test_an_lr_scheduler_registered_with_add_state_is_rewound_with_the_run():
    loop = Loop()
    insp = loop.insp
    sched = torch.optim.lr_scheduler.StepLR(loop.opt, step_size=4, gamma=0.5)
    insp.checkpoints.add_state("scheduler", sched.state_dict, sched.load_state_dict)

    def run(batches) -> list[float]:
        lrs = []
        for i in batches:
            loop.step(i)
            sched.step()
            lrs.append(loop.opt.param_groups[0]["lr"])
        return lrs

    run(range(6))
    cp = insp.checkpoint()
    first = run(range(6, 14))
    insp.rewind(cp)
    assert sched.last_epoch == 6 and loop.opt.param_groups[0]["lr"] == 5e-3
    assert run(range(6, 14)) == first, "the schedule goes on from where it was at the checkpoint"
    insp.close()


def scaled_loop(**attach):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    insp = inspector.attach(model, opt, scaler=scaler, every=1, **attach)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen)) for _ in range(30)]

    def step(i: int) -> tuple[float, int]:
        x, y = batches[i]
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        return scaler.get_scale(), int(scaler.state_dict()["_growth_tracker"])

    return insp, step


def test_a_rewind_at_a_boundary_under_a_grad_scaler_restores_the_scaler_exactly():
    from tests.unit.test_whatif_queue import elsewhere

    insp, step = scaled_loop()
    for i in range(3):
        step(i)
    cp = insp.checkpoint()  # between steps: after step 3's update()
    first = [step(i) for i in range(3, 9)]
    elsewhere(insp.rewind, cp)  # as from the dashboard: carried out at the next boundary
    step(9)  # its boundary (inside scaler.step()) rewinds; its update() then runs
    assert insp.step == 3
    replay = [step(i) for i in range(3, 9)]
    assert replay == first, "scale and growth tracker as the first time (no early doubling)"
    assert not [e for e in insp.events() if e["kind"] == "step_skipped"], "loading the scaler is no skip"
    insp.close()


def test_a_checkpoint_taken_at_a_boundary_under_a_grad_scaler_holds_the_scaler_as_between_steps():
    from tests.unit.test_whatif_queue import elsewhere

    insp, step = scaled_loop()
    for i in range(3):
        step(i)
    cp = elsewhere(insp.checkpoint)
    step(3)  # taken at step 4's boundary, inside scaler.step(), before its update()
    first = [step(i) for i in range(4, 9)]
    insp.rewind(cp)  # between steps: at once
    assert insp.step == 4
    assert [step(i) for i in range(4, 9)] == first
    insp.close()


def test_a_rewind_from_another_thread_restores_the_cadence_too():
    from tests.unit.test_whatif_queue import elsewhere

    loop = Loop(every=3)
    insp = loop.insp
    loop.run(range(6))
    cp = elsewhere(insp.checkpoint)  # taken at step 7's boundary (step 7 sampled, 8 and 9 not)
    loop.run(range(6, 16))
    first = [s["step"] for s in insp.snapshots() if s["step"] > 7]
    assert first == [10, 13, 16]
    elsewhere(insp.rewind, cp)
    loop.step(16)  # step 17's boundary rewinds to step 7
    loop.run(range(7, 16))
    assert [s["step"] for s in insp.snapshots() if s["step"] > 7] == first
    insp.close()


def compare_setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: min(1.0, (e + 1) / 5))  # a warm-up
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen)) for _ in range(10)]

    def step(batch):
        x, y = batch
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        return loss

    return model, opt, sched, scaler, batches, step


def test_compare_with_a_scheduler_and_a_scaler_in_step_fn_starts_each_branch_alike():
    model, opt, sched, scaler, batches, step = compare_setup()
    for b in batches[:2]:
        step(b)
    before = (sched.state_dict(), opt.param_groups[0]["lr"], scaler.state_dict())
    cmp = inspector.compare(
        model, opt, step, batches, hooks_a=[], hooks_b=[], schedulers=sched, scaler=scaler
    )
    assert cmp.a.losses == cmp.b.losses, "the same hooks on both branches: the same losses"
    assert (sched.state_dict(), opt.param_groups[0]["lr"], scaler.state_dict()) == before, "put back"
    with pytest.raises(inspector.HookError, match="schedulers"):
        inspector.compare(model, opt, step, batches, schedulers=[object()])


def test_compare_on_an_attached_model_works_and_puts_the_inspector_back():
    model, opt, sched, scaler, batches, step = compare_setup()
    insp = inspector.attach(model, opt, scaler=scaler, every=1)
    h = insp.add_hook("clip_norm", target="*", max_norm=0.05)
    for b in batches[:3]:
        step(b)
    state = (insp.step, insp.hooks(), len(insp.snapshots()))
    weights = copy.deepcopy(model.state_dict())
    cmp = inspector.compare(model, opt, step, batches, hooks_b=[], schedulers=sched, scaler=scaler)
    assert len(cmp.a.losses) == len(cmp.b.losses) == 10
    assert (insp.step, insp.hooks(), len(insp.snapshots())) == state, "the comparison is no step of this run"
    assert same_tensors(model.state_dict(), weights)
    step(batches[3])  # the inspector is back: its step, its hook, its snapshot
    assert insp.step == 4 and insp.snapshots()[-1]["total_norm"] <= 0.05 * (1 + 1e-5)
    assert insp.hook(h.id).spec["enabled"]
    insp.close()


def test_compare_with_a_warm_up_scheduler_not_passed_warns_naming_schedulers():
    """A scheduler step_fn steps but compare() was not given: branch B starts where A's warm-up left
    it. Said (a CompareWarning naming schedulers=, and the result's warnings); passed, nothing is."""
    model, opt, sched, scaler, batches, step = compare_setup()
    start_lr = opt.param_groups[0]["lr"]
    with pytest.warns(inspector.CompareWarning, match="schedulers=") as caught:
        cmp = inspector.compare(model, opt, step, batches, hooks_a=[], hooks_b=[], scaler=scaler)
    assert len(caught) == 1
    assert cmp.a.lrs[0] == cmp.b.lrs[0] == [start_lr]  # the optimizer's lr comes back
    # the reference: LambdaLR's 0.1 * min(1, (e + 1) / 5) at epoch e; the second step of A at
    # epoch 1, of B at epoch 11 (A's ten steps left it at 10)
    assert cmp.a.lrs[1] == pytest.approx([0.1 * 2 / 5], rel=1e-12)
    assert cmp.b.lrs[1] == pytest.approx([0.1], rel=1e-12)
    (w,) = cmp.warnings
    assert w["step"] == 2 and "schedulers=" in w["message"] and "step 2" in w["message"]

    model, opt, sched, scaler, batches, step = compare_setup()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", inspector.CompareWarning)
        cmp = inspector.compare(
            model, opt, step, batches, hooks_a=[], hooks_b=[], schedulers=sched, scaler=scaler
        )
    assert cmp.warnings == []
    assert cmp.a.lrs == cmp.b.lrs and cmp.a.lrs[0] == [opt.param_groups[0]["lr"]]
    assert cmp.a.lrs[1] != cmp.a.lrs[0]  # the warm-up moves it: the same moves in both


def test_compare_does_not_warn_for_a_rate_driven_by_the_loss_or_by_the_batch():
    """No false alarm: a rate that follows the losses (which the hooks make differ, as a
    ReduceLROnPlateau's does), and a rate step_fn sets from the batch (the same in both branches)."""
    import warnings

    model, opt, _, _, batches, _ = compare_setup()

    def by_loss(batch):
        x, y = batch
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        for g in opt.param_groups:
            g["lr"] = 0.05 * loss.item()  # the next step's rate, from this step's loss
        return loss

    def by_batch(batch):
        x, y = batch
        for g in opt.param_groups:
            g["lr"] = 0.01 * (1 + float(x[0, 0].abs()))
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    scale = [{"kind": "scale", "target": "*", "params": {"factor": 0.01}}]
    with warnings.catch_warnings():
        warnings.simplefilter("error", inspector.CompareWarning)
        cmp = inspector.compare(model, opt, by_loss, batches, hooks_a=[], hooks_b=scale)
        assert cmp.warnings == [] and cmp.a.lrs[2] != cmp.b.lrs[2]  # the losses differ: so do the rates
        cmp = inspector.compare(model, opt, by_batch, batches, hooks_a=[], hooks_b=scale)
        assert cmp.warnings == [] and cmp.a.lrs == cmp.b.lrs


def test_the_learning_rate_check_passes_over_a_step_whose_param_groups_differ_between_branches():
    """A param group added in one branch only (an optimizer's add_param_group in step_fn) leaves
    no rate to compare at that step: no warning there, and compare() does not fail after both
    branches have trained; a rate that differs at a later step with the same groups still warns."""
    from inspector.whatif.compare import Branch, _lr_drift

    a = Branch("a", [], losses=[1.0, 0.5, 0.25], lrs=[[0.1], [0.1], [0.1]])
    b = Branch("b", [], losses=[1.0, 0.5, 0.25], lrs=[[0.1], [0.1, 0.2], [0.1]])
    assert _lr_drift(a, b) is None
    b.lrs[2] = [0.3]
    step, why = _lr_drift(a, b)
    assert step == 3 and "schedulers=" in why
