"""The step boundary of an :class:`~inspector.Inspector` (its optimizer's step post-hook): step N
is complete. Earlier steps' deferred checks are read, the cadence accounts the step, a sampled
step's snapshot is built and published (under ``torch.distributed`` every step's exchange runs,
:mod:`inspector.step.dist_boundary`), pending edits apply and a pause holds the training thread.

:class:`StepBoundary` is a base of :class:`~inspector.step.lifecycle.StepLifecycle`, which declares and
builds the state used here and holds the rest of the step.
"""

from __future__ import annotations

import time
from typing import Any

from ..stats.histsel import learning_rates
from ..wire.errors import describe_error
from .dist_boundary import DistributedBoundary

__all__ = ["StepBoundary"]


class StepBoundary(DistributedBoundary):
    """The boundary of a step; every attribute is the Inspector's (see lifecycle.py)."""

    _deferred: Any
    _optimizer: Any
    _feed: Any
    _t_ours: float
    _last_boundary: float | None
    _under_way: bool
    _step_events: list[dict[str, Any]]
    _records: Any
    _hist_chosen: list[int] | None

    def _boundary(self) -> None:
        """Step N is complete: report earlier steps' deferred checks, publish its snapshot, apply
        pending edits, honour a pause."""
        t0 = time.perf_counter()
        dist = self._dist is not None and not self._dist.broken
        # steps before this one whose check reached the host (never a wait, except under
        # torch.distributed: every rank reads the previous step's, for the exchange)
        if self._deferred:
            self._drain_deferred(before=self._step + 1, wait=dist)
        with self._lock:
            self._step += 1
            self._under_way = False
            self._hist_chosen = None  # (the next step chooses its own, even under a rewound number)
            step, sampled = self._step, self._sampled
            events, self._step_events = self._step_events, []
            rec, self._records.current = self._records.current, {}
            if sampled:
                # the config this step ran with: once the lock is released, a pre_step-only edit
                # from another thread may apply (no step is under way) and must not reach this
                # step's snapshot
                version, states = self._reg.version, list(self._hooks.states.values())
        now = time.perf_counter()
        wall = None if self._last_boundary is None else now - self._last_boundary
        self._cadence.observe(step, sampled, self._t_ours + self._hooks.take_spent() + (now - t0), wall)
        t1 = time.perf_counter()
        self._t_ours = 0.0
        hold = False
        if sampled or dist:
            hold = self._publish_step(
                step, sampled, dist, events, rec, version if sampled else 0, states if sampled else []
            )
        else:  # an unsampled step: its records wait (scalars.Recorder), its check is on its way
            self._stats.end_step()
            self._hooks.end_step()
            if rec:
                self._records.defer(step, rec)
        self._t_ours += time.perf_counter() - t1  # counted with the next step
        if dist:
            self._dist_hold(step, hold)
        else:
            if self._paused and self._credit == 0 and not self._closed:
                # about to hold: what this step found and recorded is shown now (before the wait,
                # which holds the lock; the drain takes it itself, and waits for a copy without it)
                self._records.flush_pending()
                self._drain_deferred(wait=True)
            with self._cond:
                # the next step's sampling is decided before edits and requests are carried out:
                # a checkpoint taken here holds it, as one taken between steps does, and a rewind
                # here restores it, nothing deciding again after it
                self._decide_next(step)
                self._drain_locked(torch_ok=True)
                while self._paused and self._credit == 0 and not self._closed:
                    if not self._waiting:
                        self._waiting = True
                        self._cond.notify_all()  # for whoever waits for the pause to take hold
                        self._publish_training()
                    self._drain_locked(torch_ok=True)
                    self._cond.wait()
                if self._credit > 0:
                    self._credit -= 1
                self._waiting = False
        self._last_boundary = time.perf_counter()

    def _publish_step(
        self,
        step: int,
        sampled: bool,
        dist: bool,
        events: list[dict[str, Any]],
        rec: Any,
        version: int,
        states: list[Any],
    ) -> bool:
        """A sampled step's snapshot (under torch.distributed, every step's exchange); returns
        whether the exchange says to hold (a pause under torch.distributed)."""
        exchanged: list[tuple[dict[str, Any] | None, bool]] = []

        def exchange(local_norms: list[float] | None) -> dict[str, Any] | None:
            exchanged.append(self._dist_exchange(step, sampled, first=True, local_norms=local_norms))
            with self._lock:  # events the exchange produced belong to this step
                events.extend(self._step_events)
                self._step_events = []
            return exchanged[0][0]

        snap = None
        if sampled:
            try:
                snap = self._stats.snapshot(
                    step=step,
                    config_version=version,
                    records=rec,
                    events=events,
                    ranks=exchange if dist else None,
                    states=states,
                    hooks=self._hooks,
                    lr=learning_rates(self._optimizer),
                    sampled_every=self._cadence.k,
                    overhead=self._cadence.overhead,
                )
            except Exception as e:  # never take training down for telemetry
                self._event(
                    "telemetry_error",
                    message=f"the snapshot could not be built: {describe_error(e)}",
                    step=step,
                )
        if dist and not exchanged:
            exchange(None)
        self._stats.end_step()
        self._hooks.end_step()
        if snap is not None:
            self._feed.publish("snapshot", snap)
            self._records.published(snap, rec)  # every step's records reach the scalars stream
        elif rec:
            self._records.defer(step, rec)
        return exchanged[0][1] if exchanged else False

    def _decide_next(self, step: int) -> None:
        self._sampled = self._cadence.is_sampled(step + 1)
        if self._sampled:
            self._sampled_count += 1
