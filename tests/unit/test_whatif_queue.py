"""The queue of checkpoint and rewind requests under concurrency: two rewinds before one boundary,
a hook change asked for while a rewind waits, the bound on waiting requests, and a rewind at the
checkpoint's own step. Requests come from another thread while the loop (this thread) stands
between two steps, so each race happens the same way every time: nothing is carried out until
the test runs the next step."""

from __future__ import annotations

import copy
import threading

import pytest

import inspector
from tests.unit.test_whatif import Loop, same_tensors


def elsewhere(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on another thread (as a server thread calls it); its result, or
    the exception it raised."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    assert not t.is_alive()
    return out.get("error", out.get("value"))


def test_a_rewind_to_a_checkpoint_an_earlier_rewind_dropped_is_refused():
    loop = Loop()
    insp = loop.insp
    loop.run(range(3))
    c1 = insp.checkpoint("c1")  # the training thread between steps: taken now, at step 3
    ref = copy.deepcopy(loop.model.state_dict())
    loop.run(range(3, 5))
    c2 = insp.checkpoint("c2")  # step 5: on the steps the rewind to c1 abandons
    loop.run(range(5, 7))
    assert elsewhere(insp.rewind, c1)["done"] is False
    assert elsewhere(insp.rewind, c2)["done"] is False
    loop.step(7)  # step 8 runs; both requests are carried out at its boundary, in order
    assert insp.step == 3, "the main run stays at c1's step: it never jumps onto the abandoned branch"
    assert same_tensors(loop.model.state_dict(), ref)
    events = insp.events()
    rewinds = [e for e in events if e["kind"] == "rewind"]
    assert [(e["from_step"], e["step"]) for e in rewinds] == [(8, 3)]
    (refused,) = [e for e in events if e["kind"] == "rewind_error"]
    assert refused["checkpoint"] == c2 and refused["step"] == 3
    assert f"checkpoint {c2} is gone" in refused["message"]
    assert "abandoned" in refused["message"] and f"rewind to {c1}" in refused["message"]
    assert [c["id"] for c in insp.checkpoints.list()] == [c1]
    with pytest.raises(inspector.CheckpointNotFound):
        insp.rewind(c2)
    loop.run(range(10, 13))
    assert [s["step"] for s in insp.snapshots()] == list(range(1, 7)), "steps 4-8 left the ring; 4-6 anew"
    insp.close()


def test_a_hook_change_while_a_rewind_waits_is_refused_and_changes_nothing():
    loop = Loop()
    insp = loop.insp
    loop.run(range(3))
    cp = insp.checkpoint()
    h1 = insp.add_hook("clip_norm", target="*", max_norm=1.0)
    loop.run(range(3, 6))
    before = (insp.hooks(), insp.config_version)
    elsewhere(insp.rewind, cp)
    for change in (
        lambda: insp.add_hook("scale", target="*", factor=0.5),
        lambda: insp.update_hook(h1.id, params={"max_norm": 2.0}),
        lambda: insp.remove_hook(h1.id),
        lambda: insp.import_hooks({"hooks": []}),
    ):
        err = elsewhere(change)
        assert isinstance(err, inspector.RewindPending), err
        assert f"rewind to checkpoint {cp} (step 3)" in str(err) and "after it" in str(err)
    assert (insp.hooks(), insp.config_version) == before, "a refused change changes nothing"
    loop.step(6)
    assert insp.step == 3 and insp.hooks() == [], "the rewind put the checkpoint's hooks back"
    h = elsewhere(insp.add_hook, "scale", target="*", factor=0.5)  # after the rewind: accepted
    assert isinstance(h, inspector.HookHandle) and h.accepted["kind"] == "scale"
    loop.step(7)
    assert [x["kind"] for x in insp.hooks()] == ["scale"] and insp.hooks()[0]["applied_step"] == 4
    insp.close()


def test_waiting_requests_are_bounded_by_keep_and_a_repeated_rewind_is_one_request():
    loop = Loop(checkpoints=2)
    insp = loop.insp
    loop.run(range(2))
    cp = insp.checkpoint()
    loop.run(range(2, 4))
    taken = []
    for _ in range(2):
        taken.append(elsewhere(insp.checkpoints.request, "from a page"))
    assert [t["taken"] for t in taken] == [False, False]
    err = elsewhere(insp.checkpoint, "one too many")
    assert isinstance(err, inspector.CheckpointBusy) and "2 checkpoint requests wait" in str(err)
    assert len(insp.checkpoints.list()) == 1 + 2, "the refused one is not listed"
    assert elsewhere(insp.rewind, cp) == {"checkpoint": cp, "step": 2, "done": False}
    assert elsewhere(insp.rewind, cp) == {"checkpoint": cp, "step": 2, "done": False}  # a double click
    loop.step(4)
    assert insp.checkpoints.rewinds == 1, "a repeated rewind to the same checkpoint is carried out once"
    assert [e["kind"] for e in insp.events()].count("rewind") == 1
    insp.close()


def test_a_rewind_at_the_checkpoints_own_step_abandons_nothing():
    loop = Loop()
    insp = loop.insp
    loop.run(range(5))
    c1 = insp.checkpoint()
    insp.add_hook("noise", target="*", std=1.0)  # after the checkpoint, at the same step
    c2 = insp.checkpoint()
    events = insp.events()
    for _ in range(3):  # a double click, a script that retries
        assert insp.rewind(c1) == {"checkpoint": c1, "step": 5, "done": True}
        assert insp.step == 5 and insp.hooks() == [], "the hooks are the checkpoint's again"
    rewinds = [e for e in insp.events() if e["kind"] == "rewind"]
    assert [(e["from_step"], e["step"]) for e in rewinds] == [(5, 5)] * 3
    assert all(e["seq_after"] == e["seq_until"] for e in rewinds), "no event is an abandoned branch's"
    assert "no step abandoned" in rewinds[-1]["message"]
    assert insp.events()[: len(events)] == events, "every event so far stays on the run"
    assert [c["id"] for c in insp.checkpoints.list()] == [c1, c2], "no checkpoint was on an abandoned step"
    assert [s["step"] for s in insp.snapshots()] == list(range(1, 6))
    insp.rewind(c2)
    assert [h["kind"] for h in insp.hooks()] == ["noise"]
    loop.run(range(5, 7))
    assert insp.step == 7
    insp.close()


def test_requests_carried_out_at_one_boundary_share_one_copy():
    loop = Loop()
    insp = loop.insp
    loop.run(range(3))
    ids = [elsewhere(insp.checkpoint, f"page {i}") for i in range(3)]
    loop.step(3)
    cps = [insp.checkpoints.get(i) for i in ids]
    assert [c.step for c in cps] == [4, 4, 4]
    assert cps[0].model is cps[1].model is cps[2].model, "one copy of the state for the three"
    assert insp.checkpoints.bytes == cps[0].bytes > 0, "counted once"
    ref = copy.deepcopy(loop.model.state_dict())
    loop.run(range(4, 8))
    insp.rewind(ids[1])
    assert same_tensors(loop.model.state_dict(), ref)
    loop.run(range(4, 6))
    insp.rewind(ids[0])  # the rewind to ids[1] loaded a fresh copy: the shared one is as taken
    assert same_tensors(loop.model.state_dict(), ref)
    insp.close()
