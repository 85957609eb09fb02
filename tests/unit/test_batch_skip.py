"""``insp.batches(loader)`` and ``insp.rewind(cp, skip=...)``: which batches a rewound run receives,
the window recorded, and the refusals (inspector/whatif/skip.py)."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from torch import nn

import inspector
from inspector.scenarios import make
from inspector.whatif.skip import MAX_SKIP
from tests.support import wait_until


class IdLoop:
    """A user's loop over batches that carry their id (a float in every row): it records the ids of
    the batches it receives, in order, and the step each went to."""

    def __init__(self, per_epoch: int = 10, accumulate: int = 1) -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(2, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.insp = inspector.attach(self.model, self.opt)
        self.per_epoch = per_epoch
        self.accumulate = accumulate
        self.seen: list[int] = []
        self.steps: list[int] = []  # the step under way when each batch was received

    def epoch(self, e: int, on_step=None) -> None:
        data = [torch.full((2, 2), float(e * self.per_epoch + i)) for i in range(self.per_epoch)]
        n = 0
        for batch in self.insp.batches(data):
            self.seen.append(int(batch[0, 0]))
            self.steps.append(self.insp.step + 1)
            (self.model(batch).sum() / self.accumulate).backward()
            n += 1
            if n % self.accumulate == 0:
                self.opt.step()
                self.opt.zero_grad()
                if on_step is not None:
                    on_step(self.insp.step)

    def events(self, kind: str) -> list[dict]:
        return [e for e in self.insp.events() if e["kind"] == kind]


def test_a_skipped_window_is_not_received_again_and_the_rest_come_in_order_across_epochs():
    loop = IdLoop(per_epoch=10)
    insp = loop.insp
    cps: dict[str, str] = {}

    def on_step(step: int) -> None:
        if step == 3:
            cps["c"] = insp.checkpoint("before")
        if step == 6 and not insp.checkpoints.rewinds:
            # data position 3 at the checkpoint, 6 now: 9 batches from 3 = 3..11, past the epoch's end
            assert insp.rewind(cps["c"], skip=9)["done"]

    loop.epoch(0, on_step)
    loop.epoch(1, on_step)
    assert loop.seen == [0, 1, 2, 3, 4, 5] + list(range(12, 20))
    (ev,) = loop.events("batches_skipped")
    assert (ev["first"], ev["last"], ev["count"]) == (3, 11, 9)
    assert ev["received"] == 3 and ev["ahead"] == 6 and ev["steps"] == [4, 6]
    assert ev["checkpoint"] == cps["c"] and ev["step"] == 3 and ev["from_step"] == 6 and ev["seek"] is False
    assert "batches 3-11 skipped" in ev["message"]
    rewind = loop.events("rewind")[0]
    assert rewind["seq"] < ev["seq"]  # the window belongs to the new branch
    # the steps of the new branch: 4, 5, ... from batch 12 on
    assert loop.steps[6:] == list(range(4, 12))
    pos = insp.data_position
    assert pos["position"] == 20 and pos["dropped"] == 6 and pos["epochs"] == 2 and pos["pending"] is None
    assert [(w["first"], w["last"]) for w in pos["windows"]] == [(3, 11)]
    insp.close()


def test_since_the_checkpoint_under_gradient_accumulation_names_the_batches_and_their_steps():
    loop = IdLoop(per_epoch=20, accumulate=2)
    insp = loop.insp
    cps: dict[str, str] = {}

    def on_step(step: int) -> None:
        if step == 2:
            cps["c"] = insp.checkpoint()
        if step == 5 and not insp.checkpoints.rewinds:
            insp.rewind(cps["c"], skip="since_checkpoint")

    loop.epoch(0, on_step)
    # steps 3-5 received batches 4-9 (two each); after the rewind the loader goes on from 10
    (ev,) = loop.events("batches_skipped")
    assert (ev["first"], ev["last"], ev["received"], ev["ahead"]) == (4, 9, 6, 0)
    assert ev["steps"] == [3, 5]
    assert loop.seen == list(range(20))  # nothing dropped: those batches were received already
    assert loop.steps[10:12] == [3, 3]  # batch 10 goes to step 3 of the new branch
    insp.close()


def test_a_rewind_without_skip_is_as_before_the_loader_goes_on_and_nothing_is_recorded():
    loop = IdLoop(per_epoch=12)
    insp = loop.insp
    cps: dict[str, str] = {}

    def on_step(step: int) -> None:
        if step == 3:
            cps["c"] = insp.checkpoint()
        if step == 6 and not insp.checkpoints.rewinds:
            insp.rewind(cps["c"])

    loop.epoch(0, on_step)
    assert loop.seen == list(range(12))
    assert loop.events("batches_skipped") == []
    assert insp.step == 9 and insp.data_position["position"] == 12 and insp.data_position["dropped"] == 0
    insp.close()


@pytest.mark.parametrize(
    ("skip", "why"),
    [
        ("all", "must be"),
        (0, ">= 1"),
        (-2, ">= 1"),
        (True, "must be"),
        (2.5, "must be"),
        ((5, 3), "first <= last"),
        ([1, 2, 3], "two integers"),
        (range(4, 4), "non-empty"),
        ((1, 9), "starts before the checkpoint's data position 3"),
        ((4, 9), "must start at the checkpoint's data position 3"),
        (2, "skip at least 3"),
        ((3, 4), "must reach batch 5"),
        (10**12, "must be <= 100000 (MAX_SKIP"),
        ((3, 10**12), "more than 100000 (MAX_SKIP)"),
        ((3, 40), "more than your loader holds (10 batches"),
    ],
)
def test_a_skip_that_cannot_be_honoured_is_refused_with_the_reason_and_nothing_changes(skip, why):
    loop = IdLoop(per_epoch=10)
    insp = loop.insp
    got: dict[str, object] = {}

    def on_step(step: int) -> None:
        if step == 3:
            got["cp"] = insp.checkpoint()
        if step == 6 and "err" not in got:
            before = [p.detach().clone() for p in loop.model.parameters()]
            with pytest.raises(inspector.HookError) as e:
                insp.rewind(got["cp"], skip=skip)
            got["err"] = e.value
            assert insp.step == 6 and insp.checkpoints.rewinds == 0
            assert insp.checkpoints.pending_rewind() is None
            assert all(torch.equal(a, b) for a, b in zip(before, loop.model.parameters(), strict=True))

    loop.epoch(0, on_step)
    err = got["err"]
    assert err.loc == ("skip",) and why in err.msg, err.msg
    assert loop.seen == list(range(10)) and insp.step == 10
    assert not loop.events("rewind") and not loop.events("batches_skipped")
    assert insp.data_position["pending"] is None
    insp.close()


def test_skip_needs_the_data_position_and_a_batch_since_the_checkpoint():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    insp = inspector.attach(model, opt)
    for _ in range(2):  # a loop that does not go through insp.batches
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    cp = insp.checkpoint()
    with pytest.raises(inspector.HookError, match="insp.batches"):
        insp.rewind(cp, skip="since_checkpoint")
    for b in insp.batches([torch.ones(1, 2)]):
        model(b).sum().backward()
        opt.step()
    cp2 = insp.checkpoint()
    with pytest.raises(inspector.HookError, match="nothing to skip"):
        insp.rewind(cp2, skip="since_checkpoint")
    with pytest.raises(TypeError):
        insp.batches(3)
    assert insp.checkpoints.rewinds == 0
    insp.close()


def nan_run(insp_steps: int, rewind_at: int | None, skip):
    """The ``nan`` scenario (bad 30th batch) with its stream seekable and counted: checkpoint at
    step 20, then a rewind at ``rewind_at``. Returns (losses by step in order, the insp)."""
    sc = make("nan", seed=0)
    insp = inspector.attach(sc.model, sc.optimizer)
    insp.checkpoints.add_state("scenario", sc.data_state, sc.set_data_state, data=True)
    sc.batch_source = insp.batches(sc.stream())
    losses: list[tuple[int, float]] = []
    cp = None
    while len(losses) < insp_steps:
        loss = sc.step()
        losses.append((insp.step, float(loss)))
        if insp.step == 20 and cp is None:
            cp = insp.checkpoint()
        if rewind_at is not None and insp.step == rewind_at and not insp.checkpoints.rewinds:
            insp.rewind(cp, skip=skip)
    return losses, insp, sc


def reference_skipping(first: int, last: int, steps: int) -> list[float]:
    """The ``nan`` scenario alone, its batches ``first..last`` (0-based) drawn and thrown away."""
    sc = make("nan", seed=0)
    out = []
    while len(out) < steps:
        if sc.batches_drawn == first:
            for _ in range(last - first + 1):
                sc.draw_batch()
        out.append(float(sc.step()))
    return out


def test_a_seekable_stream_goes_back_and_drops_the_window_the_bad_batch_is_never_seen_again():
    losses, insp, sc = nan_run(32 + 25, rewind_at=32, skip="since_checkpoint")
    steps = [s for s, _ in losses]
    assert steps == list(range(1, 33)) + list(range(21, 46))
    assert math.isnan(losses[29][1])  # step 30 met the bad batch the first time
    after = [v for _, v in losses[32:]]
    assert all(math.isfinite(v) for v in after), after
    (ev,) = [e for e in insp.events() if e["kind"] == "batches_skipped"]
    assert (ev["first"], ev["last"], ev["seek"], ev["steps"]) == (20, 31, True, [21, 32])
    # ground truth: the scenario alone with batches 20..31 thrown away, bitwise
    ref = reference_skipping(20, 31, 20 + 25)
    assert after == ref[20:]
    assert sc.batches_drawn == insp.data_position["position"] == 32 + 25
    insp.close()


def test_a_seekable_stream_without_skip_replays_the_same_batches():
    losses, insp, _ = nan_run(40, rewind_at=25, skip=None)
    first = dict(losses[:25])
    again = losses[25:30]
    assert [s for s, _ in again] == [21, 22, 23, 24, 25]
    assert all(v == first[s] for s, v in again)  # the same batches, the same state: the same losses
    assert not [e for e in insp.events() if e["kind"] == "batches_skipped"]
    assert losses[34][0] == 30 and math.isnan(losses[34][1])  # the bad batch again, at step 30
    assert insp.data_position["position"] == 20 + 15  # back to the checkpoint's 20, then 15 steps
    insp.close()


def test_a_seekable_stream_takes_a_window_after_the_checkpoint():
    # from the checkpoint at batch 20: 20..24 come again, 25..29 (the bad one) are dropped
    losses, insp, _ = nan_run(32 + 20, rewind_at=32, skip=(25, 29))
    after = [v for _, v in losses[32:]]
    assert after == reference_skipping(25, 29, 20 + 20)[20:]
    assert all(math.isfinite(v) for v in after)
    (ev,) = [e for e in insp.events() if e["kind"] == "batches_skipped"]
    assert (ev["first"], ev["last"], ev["ahead"]) == (25, 29, 5)
    assert "the next batch is 20" in ev["message"]
    insp.close()


def test_a_later_rewind_without_skip_clears_the_window_an_earlier_one_left_take_batch():
    """``take_batch()`` as the Lightning and Hugging Face callbacks use it: a rewind with no skip
    abandons the window a rewind before it left pending, so the next steps make their updates."""
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    insp = inspector.attach(model, opt)

    def step() -> bool:
        drop = insp.take_batch()  # the trainer drew the batch; a dropped one has no effect
        if not drop:
            model(torch.ones(1, 2)).sum().backward()
        opt.step()
        opt.zero_grad()
        return drop

    for _ in range(3):
        step()
    cp = insp.checkpoint()  # step 3, data position 3
    step(), step()
    assert insp.rewind(cp, skip=20)["done"]  # batches 3..22: 5..22 still to come, dropped
    assert step() is True and insp.data_position["pending"] == [3, 22]
    cp2 = insp.checkpoint()  # step 4 of the new branch
    step()
    assert insp.rewind(cp2)["done"]  # no skip: the window above is abandoned with its branch
    for _ in range(3):
        before = model.weight.detach().clone()
        assert step() is False
        assert not torch.equal(before, model.weight)  # an update
    assert insp.data_position["pending"] is None
    assert [e["step"] for e in insp.events() if e["kind"] == "step_skipped"] == [4]
    insp.close()


class Dropping:
    """A training thread whose loader goes on (no len()) and that rewinds at step 5 to its
    checkpoint of step 3 with ``skip=MAX_SKIP`` (allowed: batches 3..100002); the loader waits
    for ``go`` once the window is being dropped, so the test acts while it is."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(2, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.insp = inspector.attach(self.model, self.opt)
        self.drawn = 0
        self.go, self.stop = threading.Event(), threading.Event()
        self.errors: list[BaseException] = []
        self.after_close: list[int] = []  # the index of the first batch the loop got once closed
        self.thread = threading.Thread(target=self._train, daemon=True)
        self.thread.start()
        wait_until(lambda: self.drawn >= 20, what="the window being dropped")

    def _loader(self):
        while not self.stop.is_set():
            self.drawn += 1
            if self.drawn == 20:
                self.go.wait(30)
            yield torch.full((1, 2), float(self.drawn - 1))

    def _train(self) -> None:
        insp, cp = self.insp, None
        try:
            for batch in insp.batches(self._loader()):
                if insp.closed:
                    self.after_close.append(int(batch[0, 0]))
                    return
                self.model(batch).sum().backward()
                self.opt.step()
                self.opt.zero_grad()
                if insp.step == 3 and cp is None:
                    cp = insp.checkpoint()
                if insp.step == 5 and not insp.checkpoints.rewinds:
                    assert insp.rewind(cp, skip=MAX_SKIP)["done"]
        except BaseException as e:  # reported by the test
            self.errors.append(e)

    def close(self) -> None:
        """close() from another thread: it must return."""
        closer = threading.Thread(target=self.insp.close, daemon=True)
        closer.start()
        closer.join(60)
        assert not closer.is_alive(), "close() returned"

    def end(self) -> None:
        self.stop.set()
        self.go.set()
        self.insp.close()


def test_a_pause_holds_and_close_returns_while_a_large_window_is_being_dropped():
    """While the training thread draws and drops a window's batches, a pause holds there (no step
    moves), a rewind asked meanwhile is carried out by the held thread, and close() returns."""
    run = Dropping()
    insp = run.insp
    try:
        assert insp.step == 3 and insp.data_position["pending"] == [3, 3 + MAX_SKIP - 1]
        insp.pause()
        run.go.set()
        wait_until(lambda: insp.state["held"], what="the pause to hold while dropping")
        assert insp.step == 3 and insp.data_position["pending"] is not None
        # a rewind asked while held there is carried out there: no skip, so no window is left
        insp.rewind(insp.checkpoints.list()[0]["id"])
        wait_until(lambda: insp.checkpoints.rewinds == 2, what="the second rewind")
        assert insp.data_position["pending"] is None and insp.state["held"]
        insp.resume()
        wait_until(lambda: insp.step >= 6, what="steps after the rewind")
        run.close()
        run.thread.join(60)
        assert not run.thread.is_alive() and not run.errors, run.errors
    finally:
        run.end()


def test_a_single_step_while_held_dropping_runs_one_step_then_holds():
    run = Dropping()
    insp = run.insp
    try:
        insp.pause()
        run.go.set()
        wait_until(lambda: insp.state["held"], what="the pause to hold while dropping")
        assert insp.step == 3 and insp.data_position["pending"] is not None
        insp.step_once()
        # the rest of the window is dropped, one step runs, and its boundary holds
        wait_until(lambda: insp.step == 4 and insp.state["held"], timeout=120, what="one step, then held")
        assert insp.data_position["pending"] is None and insp.data_position["dropped"] == MAX_SKIP - 2
        assert insp.step == 4 and not run.errors
    finally:
        run.end()


def test_close_ends_the_dropping_of_a_window():
    """close() while the training thread drops a window (not paused): the dropping ends, and the
    loop gets the batches as they come."""
    run = Dropping()
    try:
        run.close()
        run.go.set()
        run.thread.join(60)
        assert not run.thread.is_alive() and not run.errors, run.errors
        assert run.after_close and run.after_close[0] < MAX_SKIP, run.after_close
    finally:
        run.end()
