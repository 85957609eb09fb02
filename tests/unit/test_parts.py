"""The Inspector composed of parts (docs/ARCHITECTURE.md): a facade with no base class of ours,
parts that never hold the Inspector, a handle that holds it weakly, the training state's checked
transitions, and the end of training pushed once to subscribers."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
from torch import nn

import inspector
from inspector.feed import Feed
from inspector.step.clock import StepClock
from inspector.step.gate import PauseGate, TrainingState
from tests.support import wait_until


def _attached() -> tuple[nn.Module, torch.optim.Optimizer, inspector.Inspector]:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return model, opt, inspector.attach(model, opt, every=1)


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(5, 4)).pow(2).mean().backward()
    opt.step()


def test_the_inspector_is_a_facade_with_no_base_class_of_ours():
    assert inspector.Inspector.__mro__ == (inspector.Inspector, object)


def test_no_part_holds_the_inspector_but_the_seam_and_the_anchor():
    """The parts get their collaborators, not the Inspector: only the dashboard, which hands the
    Inspector's public API to the server, and the lifecycle's anchor (read by nothing: its step
    hooks on the model keep the Inspector alive) refer to it."""
    _, _, insp = _attached()
    try:
        holders = {
            (name, key)
            for name, part in vars(insp).items()
            if hasattr(part, "__dict__")
            for key, v in vars(part).items()
            if v is insp
        }
        assert holders == {("_dashboard", "_core"), ("_lifecycle", "_owner")}
    finally:
        insp.close()


def test_an_attached_inspector_lives_while_its_hooks_are_on_the_model():
    """`inspector.attach(model, opt)` with the result dropped still watches (as torch's hooks
    keep what they call alive): it is collected only once close() took its hooks away."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    inspector.attach(model, opt, every=1)
    gc.collect()
    insp = inspector.attached(model)
    assert insp is not None
    _step(model, opt)
    assert insp.step == 1 and insp.latest()["step"] == 1
    ref = weakref.ref(insp)
    insp.close()
    del insp
    gc.collect()
    assert ref() is None and inspector.attached(model) is None


def test_a_handle_does_not_keep_its_inspector_alive():
    """As torch's RemovableHandle holds its hook table weakly (test_no_extra_ref_to_module)."""
    model, opt, insp = _attached()
    handle = insp.add_hook("clip_norm", max_norm=1.0)
    _step(model, opt)
    assert handle.spec["applied_step"] == 1
    insp.close()
    del insp
    gc.collect()
    handle.remove()  # harmless once the Inspector is gone
    with pytest.raises(inspector.InspectorError, match="its Inspector is gone"):
        handle.update(max_norm=2.0)


def test_the_training_state_moves_only_forwards():
    clock, feed = StepClock(), Feed()
    gate = PauseGate(threading.RLock(), clock, feed)
    assert gate.state()["state"] == "running" and not gate.finished
    with gate.cond:
        assert gate.finish() is True
        assert gate.finish() is False  # finished already: nothing to announce again
    assert gate.state()["state"] == "finished" and gate.safe_point()
    assert gate.begin_close() == (True, False)  # closing, but training had ended before
    assert gate.closed and gate.state()["state"] == "finished" and not gate.safe_point()
    assert gate.begin_close() == (False, False)  # idempotent
    with gate.cond, pytest.raises(RuntimeError, match="cannot go from closed to finished"):
        gate._move(TrainingState.FINISHED)
    gate.end_close()
    feed.close()


@pytest.mark.parametrize("finish_first", [True, False])
def test_the_end_of_training_is_pushed_once(finish_first):
    """finish() tells subscribers training is over (a `training` record), once; a close after it
    does not say it again; a close of a running Inspector says it."""
    model, opt, insp = _attached()
    got: list[dict] = []
    insp.subscribe(lambda kind, payload: got.append(payload) if kind == "training" else None)
    _step(model, opt)
    if finish_first:
        insp.finish()
        wait_until(lambda: got, what="the finished training record")
    insp.close()
    assert [g["state"] for g in got] == ["finished"], got
    assert got[0]["step"] == 1


def test_the_step_clock_saves_and_restores_what_a_rewind_needs():
    clock = StepClock()
    clock.begin()
    clock.complete()
    clock.decide_next(False)
    clock.mark_boundary()
    saved = clock.state_dict()
    assert saved == {"step": 1, "sampled": False, "sampled_count": 1}
    clock.begin()
    clock.complete()
    clock.decide_next(True)
    clock.load_state_dict(saved)
    assert clock.state_dict() == saved and not clock.under_way
    assert clock.wall(0.0) is None  # the time since the last boundary is no step's


def test_forget_gap_is_public_and_the_cadence_counts_no_wall_time_for_that_step():
    model, opt, insp = _attached()
    try:
        _step(model, opt)
        insp.forget_gap()
        assert insp._clock.wall(1e9) is None
        _step(model, opt)
        assert insp._clock.wall(1e9) is not None
    finally:
        insp.close()


def test_memory_reports_what_is_resident():
    model, opt, insp = _attached()
    try:
        _step(model, opt)
        mem = insp.memory
        assert set(mem) == {"update_sample", "snapshots", "checkpoints", "flight", "optim_sample"}
        assert mem["update_sample"] > 0 and mem["snapshots"] > 0 and mem["checkpoints"] == 0
        assert 0 < mem["optim_sample"] <= mem["update_sample"]  # (the gradients' sample: at most as large)
        insp.checkpoint()
        assert insp.memory["checkpoints"] == insp.checkpoints.bytes > 0
    finally:
        insp.close()
