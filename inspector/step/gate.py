"""The pause gate: the training state (running, finished, closed) with its checked transitions,
the pause, the single steps it lets through, the training thread held at a boundary, and the one
rule for where the run's state may be touched from the thread asking.

Everything here is written under the gate's condition (the Inspector's lock), which also wakes
a held training thread: a pause, a resume, a single step, an edit or a request made while it is
held, ``close()``. The training thread reads ``should_hold()`` once without it, at a boundary
(to show what the step found before it holds: a pause asked a moment later holds there all the
same, under the lock).

The safe point (:meth:`PauseGate.safe_point`): the training thread between two steps, or any
thread once training has finished (and the Inspector is not closed). A held training thread is
the training thread between two steps: what other threads ask of it, it carries out while held.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from typing import Any

from ..feed import Feed
from .clock import StepClock

__all__ = ["PauseGate", "TrainingState"]


class TrainingState(enum.Enum):
    """The run's life: ``RUNNING`` -> ``FINISHED`` (``finish()``, ``wait()``) -> ``CLOSED``
    (``close()``; also straight from ``RUNNING``). Never backwards."""

    RUNNING = "running"
    FINISHED = "finished"
    CLOSED = "closed"


_NEXT = {
    TrainingState.RUNNING: {TrainingState.FINISHED, TrainingState.CLOSED},
    TrainingState.FINISHED: {TrainingState.CLOSED},
    TrainingState.CLOSED: set(),
}


class PauseGate:
    """Pause, resume and single steps; the hold at a boundary; the run's state; the safe point."""

    def __init__(self, lock: threading.RLock, clock: StepClock, feed: Feed) -> None:
        self.cond = threading.Condition(lock)
        self._clock = clock
        self._feed = feed
        self._state = TrainingState.RUNNING
        self._paused = False
        self._credit = 0  # single steps still allowed while paused
        self._waiting = False  # the training thread is held at a boundary
        self._train_tid = threading.get_ident()  # the training thread: the one that runs optimizer.step()
        self._closer: int | None = None  # the thread inside close(), until it has finished

    # ------------------------------------------------------------ the run's state
    @property
    def finished(self) -> bool:
        """Training ended: ``finish()`` or ``close()``."""
        return self._state is not TrainingState.RUNNING

    @property
    def closed(self) -> bool:
        return self._state is TrainingState.CLOSED

    @property
    def held(self) -> bool:
        """The training thread waits at a boundary now (or between two steps, where
        ``insp.batches`` drops a skipped window's batches: inspector/whatif/skip.py)."""
        return self._waiting

    def _move(self, to: TrainingState) -> None:
        """Go to ``to`` (lock held); a transition backwards is a bug of ours."""
        if to not in _NEXT[self._state]:
            raise RuntimeError(f"training cannot go from {self._state.value} to {to.value}")
        self._state = to
        self.cond.notify_all()

    def finish(self) -> bool:
        """Training is over; the caller's thread is the training thread from now (lock held).
        True when this call ended it (subscribers are then told, once)."""
        self._train_tid = threading.get_ident()
        if self._state is not TrainingState.RUNNING:
            return False
        self._move(TrainingState.FINISHED)
        return True

    def begin_close(self) -> tuple[bool, bool]:
        """Close: ``(closing, ended)``. ``closing`` is True for the caller that closes; a call while
        another thread closes returns False once that close has finished (so ``wait()`` never
        returns early). ``ended``: training was running until this close (not finished before), so
        subscribers are to be told it is over."""
        with self.cond:
            if self._state is TrainingState.CLOSED:
                closer = self._closer
                if closer is not None and closer != threading.get_ident():
                    self.cond.wait_for(lambda: self._closer is None, timeout=60.0)
                return False, False
            ended = self._state is TrainingState.RUNNING
            self._move(TrainingState.CLOSED)
            self._closer = threading.get_ident()
            return True, ended

    def end_close(self) -> None:
        """The close has finished: whoever waits for it may go on."""
        with self.cond:
            self._closer = None
            self.cond.notify_all()

    def state(self) -> dict[str, Any]:
        """``{"state": "running" | "paused" | "finished", "step", "held"}``."""
        with self.cond:
            s = "finished" if self.finished else ("paused" if self._paused else "running")
            return {"state": s, "step": self._clock.step, "held": self._waiting}

    def publish(self) -> dict[str, Any]:
        """Tell subscribers the training state changed (a ``training`` record); returns it."""
        state = self.state()
        self._feed.publish("training", state)
        return state

    # ------------------------------------------------------------ the training thread
    def on_training_thread(self) -> bool:
        return threading.get_ident() == self._train_tid

    def claim_thread(self) -> None:
        """This thread trains. Set under the lock: an edit from another thread holds the lock while
        it decides whether it is on the training thread (and then registers torch hooks), so it can
        never register one while this thread's forward runs."""
        tid = threading.get_ident()
        if self._train_tid != tid:
            with self.cond:
                self._train_tid = tid

    def safe_point(self) -> bool:
        """Whether the run's state may be read or replaced whole from this thread now: the
        training thread between two steps (held at a boundary included), or any thread once
        training has finished and the Inspector is open."""
        if self.finished:
            return not self.closed
        return self.on_training_thread() and not self._clock.under_way

    # ------------------------------------------------------------ pause
    def pause(self) -> dict[str, Any]:
        """Hold the training thread at the next step boundary."""
        with self.cond:
            self._paused, self._credit = True, 0
            self.cond.notify_all()
        return self.publish()

    def resume(self) -> dict[str, Any]:
        with self.cond:
            self._paused, self._credit = False, 0
            self.cond.notify_all()
        return self.publish()

    def step_once(self) -> dict[str, Any]:
        """Let exactly one more step run, then hold at its boundary."""
        with self.cond:
            self._paused = True
            self._credit += 1
            self.cond.notify_all()
        return self.publish()

    def should_hold(self) -> bool:
        """A boundary reached now holds (paused, no single step left, open)."""
        return self._paused and self._credit == 0 and not self.closed

    def decide_hold(self) -> bool:
        """At a boundary: whether it holds; a single step left is used up instead (lock held)."""
        hold = self.should_hold()
        if self._paused and self._credit > 0:
            self._credit -= 1  # a single step: run one more, hold at its boundary
        return hold

    def _held(self) -> None:
        """The pause has taken hold: say so once (lock held)."""
        if not self._waiting:
            self._waiting = True
            self.cond.notify_all()  # for whoever waits for the pause to take hold
            self.publish()

    def hold(self, serve: Callable[[], None]) -> None:
        """Hold the training thread here while paused (lock held), calling ``serve()`` (edits and
        requests from other threads) each time it is woken; a single step lets it go once."""
        while self.should_hold():
            self._held()
            serve()
            self.cond.wait()
        if self._credit > 0:
            self._credit -= 1
        self._waiting = False

    def wait_held(self, wake: Callable[[], bool], timeout: float) -> None:
        """Under torch.distributed, rank 0's part of a held boundary (lock held): wait until
        ``wake()``, a resume, a single step or close, or ``timeout`` (the job's heartbeat)."""
        self._held()
        self.cond.wait_for(
            lambda: wake() or not self._paused or self._credit > 0 or self.closed, timeout=timeout
        )

    def release(self) -> None:
        """The held boundary is over (every rank goes on)."""
        self._waiting = False
