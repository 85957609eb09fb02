"""Automatic checkpoints (``attach(..., checkpoint_every=N)``), their listing, and the memory
budget (``checkpoint_memory``)."""

from __future__ import annotations

import copy
import math
import time

import pytest
import torch
from torch import nn

import inspector
from inspector.scenarios import make
from tests.unit.test_whatif import Loop, same_tensors


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """The bytes a checkpoint holds of the model's and the optimizer's tensors, counted here."""
    ts = list(model.state_dict().values())
    for st in opt.state_dict()["state"].values():
        ts += [v for v in st.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in ts)


def test_every_5_keep_3_after_step_40_keeps_steps_30_35_40_with_size_and_time():
    t0 = time.time()
    loop = Loop(checkpoint_every=5, checkpoints=3)
    insp = loop.insp
    try:
        loop.run(range(40))
        cps = insp.checkpoints.list()
        assert [c["step"] for c in cps] == [30, 35, 40]
        assert [c["id"] for c in cps] == ["c6", "c7", "c8"]  # one per multiple of 5: c1 at step 5
        size = state_bytes(loop.model, loop.opt)
        for c in cps:
            assert c["taken"] and c["origin"] == "auto" and c["label"] is None
            assert c["bytes"] == size > 0
            assert t0 <= c["time"] <= time.time() and 0 <= c["took"] < 60
        assert cps[0]["time"] <= cps[1]["time"] <= cps[2]["time"]
        summary = insp.checkpoints.summary()
        assert summary["checkpoints"] == cps and summary["every"] == 5 and summary["budget"] is None
        assert summary["bytes"] == 3 * size and summary["auto_refused"] is None
        events = [e for e in insp.events() if e["kind"] == "checkpoint"]
        assert [e["step"] for e in events] == [5, 10, 15, 20, 25, 30, 35, 40]
        assert all(e["origin"] == "auto" and e["bytes"] == size for e in events)
        # the loop's own and a rule's say so
        assert insp.checkpoints.get(insp.checkpoint("mine")).origin == "loop"
        insp.add_rule({"signal": "step", "op": "==", "threshold": 41, "action": "checkpoint"})
        loop.step(40)
        assert [(c["step"], c["origin"]) for c in insp.checkpoints.list()] == [
            (40, "auto"),
            (40, "loop"),
            (41, "rule"),
        ]
    finally:
        insp.close()


def test_a_rewind_to_an_automatic_checkpoint_is_bitwise_the_state_at_that_step():
    loop = Loop(checkpoint_every=5, checkpoints=3)
    insp = loop.insp
    try:
        loop.run(range(15))
        ref_model = copy.deepcopy(loop.model.state_dict())
        ref_opt = copy.deepcopy(loop.opt.state_dict())
        loop.run(range(15, 22))
        (cp,) = [c for c in insp.checkpoints.list() if c["step"] == 15]
        assert not same_tensors(loop.model.state_dict(), ref_model)
        assert insp.rewind(cp["id"])["done"] and insp.step == 15
        assert same_tensors(loop.model.state_dict(), ref_model)
        assert same_tensors(loop.opt.state_dict(), ref_opt)
        # the run goes on from there, and the schedule with it: the next one at step 20 again
        loop.run(range(15, 20))
        assert [c["step"] for c in insp.checkpoints.list()] == [10, 15, 20]
    finally:
        insp.close()


def test_memory_budget_drops_the_oldest_to_make_room_and_never_holds_more():
    probe = Loop()
    probe.run(range(1))
    size = state_bytes(probe.model, probe.opt)
    probe.insp.close()
    loop = Loop(checkpoint_every=2, checkpoints=5, checkpoint_memory=int(2.5 * size))
    insp = loop.insp
    try:
        for i in range(20):
            loop.step(i)
            assert insp.checkpoints.bytes <= 2.5 * size
        assert [c["step"] for c in insp.checkpoints.list()] == [18, 20]
        last = [e for e in insp.events() if e["kind"] == "checkpoint"][-1]
        assert last["dropped"] == ["c8"] and "budget" in last["message"]
        assert not [e for e in insp.events() if e["kind"] == "checkpoint_error"]
    finally:
        insp.close()


def test_a_checkpoint_past_the_budget_is_refused_with_the_reason_and_training_goes_on():
    loop = Loop(checkpoint_every=3, checkpoint_memory="1KB")
    insp = loop.insp
    try:
        loop.run(range(20))  # steps 3, 6, ... 18: refused each time, told once
        assert insp.step == 20 and insp.checkpoints.list() == [] and insp.checkpoints.bytes == 0
        (err,) = [e for e in insp.events() if e["kind"] == "checkpoint_error"]
        assert err["step"] == 3 and err["origin"] == "auto" and err["reason"] == "budget"
        size = state_bytes(loop.model, loop.opt)
        assert f"({size} bytes)" in err["message"] and "1000 bytes" in err["message"]
        assert "checkpoint_memory" in err["message"]
        assert insp.checkpoints.summary()["auto_refused"].startswith("automatic checkpoint at step 18")
        with pytest.raises(inspector.CheckpointError, match=r"budget of .*\(1000 bytes"):
            insp.checkpoint()
        assert insp.checkpoints.list() == []
        assert all(math.isfinite(v) for v in loop.losses.values())
    finally:
        insp.close()


@pytest.mark.parametrize(
    ("given", "parsed"),
    [(None, None), (4096, 4096), ("2GB", 2 * 10**9), ("512MiB", 512 * 2**20), ("1.5 kb", 1500), ("100", 100)],
)
def test_checkpoint_memory_takes_bytes_or_a_size(given, parsed):
    from inspector.whatif.checkpoints import parse_memory

    assert parse_memory(given) == parsed


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("checkpoint_memory", "2 bananas", "'2GB'"),
        ("checkpoint_memory", 0, "positive"),
        ("checkpoint_memory", True, "'512MiB'"),
        ("checkpoint_memory", "-1GB", "'2GB'"),
        ("checkpoint_every", 0, "at least 1"),
        ("checkpoint_every", 2.5, "at least 1"),
    ],
)
def test_bad_checkpoint_options_are_refused_at_attach_naming_the_option(option, value, says):
    model = nn.Linear(2, 1)
    with pytest.raises(inspector.AttachError, match=option) as e:
        inspector.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), **{option: value})
    assert says in str(e.value)


def test_safe_overnight_with_checkpoint_every_rewinds_past_an_inf_batch_and_ends_finite():
    """The ``nan`` scenario's batch of inf at step 30 (batch index 29), no checkpoint of the
    loop's own: the automatic ones give "safe overnight" one to go back to. Step 30 is a
    multiple of 5: its own check is read before its checkpoint would be taken, so the state
    after the inf batch is never kept, and the rule goes back to step 25."""
    sc = make("nan", seed=0)
    insp = inspector.attach(sc.model, sc.optimizer, rules="safe overnight", checkpoint_every=5)
    insp.checkpoints.add_state("scenario", sc.data_state, sc.set_data_state, data=True)
    sc.batch_source = insp.batches(sc.stream())
    losses = []
    try:
        while insp.step < 80:
            losses.append(float(sc.step()))
        assert math.isnan(losses[29])  # the first pass met the bad batch at step 30
        (fired,) = [e for e in insp.events() if e["kind"] == "rule_fired"]
        assert fired["result"]["rewound"] and fired["result"]["step"] == 25
        (skipped,) = [e for e in insp.events() if e["kind"] == "batches_skipped"]
        assert skipped["first"] <= 29 <= skipped["last"]
        assert all(math.isfinite(v) for v in losses[30:]) and insp.step == 80
        assert all(torch.isfinite(p).all() for p in sc.model.parameters())
        assert [c["step"] for c in insp.checkpoints.list()] == [70, 75, 80]
    finally:
        insp.close()


def test_without_an_optimizer_checkpoint_every_is_refused_once_and_training_goes_on():
    params = {"w": torch.zeros(3, requires_grad=True)}
    insp = inspector.attach(params, checkpoint_every=2)
    try:
        for _ in range(10):
            (params["w"] * 2).sum().backward()
            insp.mark_step()
        assert insp.step == 10
        (err,) = [e for e in insp.events() if e["kind"] == "checkpoint_error"]
        assert err["reason"] == "refused" and "optimizer" in err["message"]
    finally:
        insp.close()
