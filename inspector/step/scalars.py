"""Scalars recorded with ``insp.record(...)``: checked at once, summed per step, averaged when read.

A record made while a step is under way belongs to that step (it travels in the step's
snapshot); one made after a boundary and before the next forward belongs to the step just
completed (a "late" record, sent as its own ``scalars`` message). Tensors stay on their device
until the step's one transfer (a sampled step) or a deferred copy read at a later boundary (see
:class:`Recorder`); several records of one key in one step are averaged, late ones with the
others (gradient accumulation with a record per micro-batch, the last after ``step()``: the
step's value is the mean of all of them, sampled or not).

A watcher (``Recorder.watch``: the rules) that wants the values gets each step's means once, when
the step is closed (its late records could come until the next step got under way) and its
values reached the host: at the next boundary for values recorded before ``step()``, at the one
after for late ones (on a GPU, once their copy has completed). While it wants them an unsampled
step's records are sent at its boundary instead of waiting for others (one ``non_blocking`` copy
a step beside the NaN/Inf check's, so the bound on copies in flight, ``Deferred.MAX_PENDING``, is
reached with the device about half as many steps behind; nothing is read before then).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from ..stats.deferred import Deferred
from ..stats.telemetry import Pack
from ..wire.errors import HookError, shown
from ..wire.records import jsonsafe

__all__ = ["Recorder", "Records", "accumulate", "check_scalars", "host_means"]

Records = dict[str, list[Any]]  # key -> [sum (float or 0-dim tensor), count]


def check_scalars(scalars: Mapping[str, Any]) -> dict[str, float | Tensor]:
    """Numbers and one-element tensors (detached, float32, 0-dim); anything else raises HookError."""
    vals: dict[str, float | Tensor] = {}
    for k, v in scalars.items():
        if isinstance(v, Tensor):
            if v.numel() != 1:
                raise HookError(
                    ("scalars", k), f"must be a number or a one-element tensor (got shape {tuple(v.shape)})"
                )
            t = v.detach()
            if t.dim():
                t = t.reshape(())
            vals[k] = t if t.dtype == torch.float32 else t.float()
        elif isinstance(v, int | float) and not isinstance(v, bool):
            if isinstance(v, int) and abs(v) > 2**1023:  # float(v) would raise OverflowError
                raise HookError(("scalars", k), "must be a number in the float range (got a larger integer)")
            vals[k] = float(v)
        else:
            raise HookError(("scalars", k), f"must be a number or a one-element tensor (got {shown(v)})")
    return vals


def _safe(x: Any) -> Any:
    """``jsonsafe(x)`` for a mean (a float, None or the odd other value), finite floats first."""
    if type(x) is float and x - x == 0.0:  # finite (inf - inf and nan - nan are NaN)
        return x
    return jsonsafe(x)


def accumulate(dest: Records, vals: Mapping[str, float | Tensor]) -> None:
    for k, v in vals.items():
        acc = dest.get(k)
        if acc is None:
            dest[k] = [v, 1]
        else:
            acc[0] = acc[0] + v
            acc[1] += 1


def host_means(records: Records) -> dict[str, float]:
    """Each key's mean on the host; the tensors among them in one transfer."""
    keys = list(records)
    tens = [records[k][0] for k in keys if isinstance(records[k][0], Tensor)]
    host = torch.stack([t.to(tens[0].device) for t in tens]).tolist() if tens else []
    it = iter(host)
    return {
        k: (next(it) if isinstance(records[k][0], Tensor) else records[k][0]) / records[k][1] for k in keys
    }


class Recorder:
    """One Inspector's records: the step under way's, the late ones, and unsampled steps' waiting ones.

    Every step with records gets a ``scalars`` message on ``feed``, in step order: a sampled step's
    values travel in its snapshot's transfer (:meth:`published`); an unsampled step's wait in
    ``pending`` (at most ``MAX_PENDING``) until a sampled step or a late record, and then go to the
    host through the Inspector's :class:`~inspector.stats.deferred.Deferred` queue (one ``non_blocking``
    copy, read at a later boundary), so that no record ever makes the host wait for the device; late
    records (after ``step()``) resend their step's message, merged. While ``watch`` wants the values
    (module docstring), an unsampled step's records are sent at its boundary and its one message
    goes out when the step is closed, late records averaged in. The caller holds ``lock`` around
    :meth:`add` and the ``current`` swap; the other methods take it themselves.
    """

    MAX_PENDING = 32  # unsampled steps whose records may wait for a later read

    def __init__(self, feed: Any, lock: Any, deferred: Deferred) -> None:
        self._feed = feed
        self._lock = lock
        self._deferred = deferred
        self.current: Records = {}  # the step under way's
        self.late: Records = {}  # made after the last boundary, before the next step got under way
        self.pending: list[tuple[int, Records]] = []  # unsampled steps', oldest first
        self.last_published = 0  # the last step whose snapshot went out
        # recent sampled steps: how many records of each key their snapshots' means are of (late
        # ones, read at a later boundary, are averaged in with that weight)
        self._counts: OrderedDict[int, dict[str, int]] = OrderedDict()
        self.discard_late = False  # a rewind: the late records still to come belong to the abandoned step
        # who gets each closed step's means (the rules): ``watch.wants_records`` says whether it
        # wants them now, ``watch.arrived(step, means)`` takes them (deferred consumers, lock held),
        # ``watch.forget_arrived()`` drops those not evaluated yet (a rewind)
        self.watch: Any = None
        self._final: dict[int, dict[str, Any]] = {}  # the means last sent of steps not closed yet
        # unsampled steps whose records were sent at their boundary (watched): how many of each key
        self._early: OrderedDict[int, dict[str, int]] = OrderedDict()

    def add(self, vals: Mapping[str, float | Tensor], *, late: bool) -> None:
        accumulate(self.late if late else self.current, vals)

    def take_current(self) -> Records:
        """The step under way's records, at its boundary; the next step starts with none (lock held)."""
        rec, self.current = self.current, {}
        return rec

    def forget_current(self) -> None:
        """The iteration under way made no update (a skipped step): its records go with it."""
        with self._lock:
            self.current = {}

    def abandon(self) -> None:
        """A rewind abandons the step just completed: its records, and the late ones still to come,
        belong to the branch left behind."""
        with self._lock:
            self.current = {}
            self.discard_late = True
            self._final.clear()
            self._early.clear()
            if self.watch is not None:
                self.watch.forget_arrived()

    def _watched(self) -> bool:
        return self.watch is not None and bool(self.watch.wants_records)

    def _send(self, step: int, loss: Any, scalars: dict[str, Any]) -> None:
        early = step in self._early
        if early or self._watched():  # (a later send of the step, its late records merged in, replaces it)
            self._final[step] = {**scalars, "loss": loss} if loss is not None else dict(scalars)
            while len(self._final) > 4 * self.MAX_PENDING:  # (steps never closed: a watcher come and gone)
                del self._final[next(iter(self._final))]
            if early:
                return  # its message goes out once the step is closed, all its records in (_close)
        self._publish(step, loss, scalars)

    def _publish(self, step: int, loss: Any, scalars: dict[str, Any]) -> None:
        payload = {
            "step": step,
            "loss": _safe(loss),
            "scalars": {str(k): _safe(v) for k, v in scalars.items()},
        }
        self._feed.publish("scalars", payload)

    def _later(
        self,
        items: list[tuple[int, Records]],
        send: Callable[[int, dict[str, float]], None],
        window: int | None,
    ) -> None:
        """``send(step, means)`` for each item once its tensors reached the host (deferred, in order).
        ``window``: the step under way now (its copy is read at a later boundary), None after training."""
        keys = [
            (i, k) for i, (_, rec) in enumerate(items) for k, acc in rec.items() if isinstance(acc[0], Tensor)
        ]
        pack = None
        if keys:
            pack = Pack()
            pack.add("rec", [items[i][1][k][0] for i, k in keys])

        def consume(values: dict[str, list[float]]) -> None:
            host = dict(zip(keys, values.get("rec", []), strict=True))
            for i, (step, rec) in enumerate(items):
                send(step, {k: host.get((i, k), acc[0]) / acc[1] for k, acc in rec.items()})

        self._deferred.submit(window, pack, consume)

    def _send_means(self, step: int, means: dict[str, float]) -> None:
        vals = dict(means)
        self._send(step, vals.pop("loss", None), vals)

    def published(self, snap: Any, rec: Records) -> None:
        """A sampled step's snapshot went out: earlier steps' records first, then its own."""
        self.last_published = snap.step
        self._counts[snap.step] = {k: acc[1] for k, acc in rec.items()}
        while len(self._counts) > 2 * self.MAX_PENDING:
            self._counts.popitem(last=False)
        self.flush_pending(snap.step)
        if rec:
            self._deferred.submit(None, None, lambda _: self._send(snap.step, snap.loss, snap.scalars))

    def defer(self, step: int, rec: Records) -> None:
        """An unsampled step's records wait (see the class docstring); sent now when watched (its
        late records, if any, are then averaged in as a sampled step's are)."""
        self.pending.append((step, rec))
        if self._watched():
            self._early[step] = {k: acc[1] for k, acc in rec.items()}
            while len(self._early) > 2 * self.MAX_PENDING:
                self._early.popitem(last=False)
            self.flush_pending(step)
        elif len(self.pending) >= self.MAX_PENDING:
            self.flush_pending(step)

    def flush_pending(self, window: int | None = None) -> None:
        """Send the waiting steps' records on their way to the host, in one copy (``window``: the
        step under way, whose boundaries read it later; None once training is over)."""
        pending, self.pending = self.pending, []
        if pending:
            self._later(pending, self._send_means, window)

    def flush_late(self, step: int) -> None:
        """Send the records made after step N's boundary as step N's, merged with N's own records when
        N was not sampled, and into N's snapshot in the feed's ring when it was. Step N is closed
        then: a watcher gets its means once everything sent before reached the host."""
        self._flush_late(step)
        if step in self._early or self._watched():
            self.flush_pending(step + 1)  # (a late record of an unsampled step, merged with its own)
            # after every copy of step N's values in the queue (FIFO): read at N + 1's boundary,
            # or at the first after its late records' copy
            self._deferred.submit(step, None, lambda _: self._close(step))

    def _close(self, step: int) -> None:
        """Step ``step``'s means reached the host, all of them: the watcher's (none recorded: nothing)."""
        means = self._final.pop(step, None)
        self._final.clear()  # (steps after it: a branch a rewind left)
        early = self._early.pop(step, None)
        if means is None:
            return
        if early is not None:  # an unsampled step sent at its boundary: its one message, now
            vals = dict(means)
            self._publish(step, vals.pop("loss", None), vals)
        if self.watch is not None:
            self.watch.arrived(step, means)

    def _flush_late(self, step: int) -> None:
        if not (self.late or self.discard_late):  # the usual case: nothing recorded after the boundary
            return
        with self._lock:
            late, self.late = self.late, {}
            if self.discard_late:
                self.discard_late, late = False, {}
        if not late:
            return
        if self.pending and self.pending[-1][0] == step:
            for k, (total, n) in self.pending.pop()[1].items():
                acc = late.get(k)
                late[k] = [total, n] if acc is None else [acc[0] + total, acc[1] + n]
        if step != self.last_published and step not in self._early:
            # an unsampled step: its message waits with the others
            self.pending.append((step, late))
            if len(self.pending) >= self.MAX_PENDING:
                self.flush_pending(step + 1)
            return
        self.flush_pending(step + 1)  # earlier steps first
        counts = {k: acc[1] for k, acc in late.items()}
        self._later([(step, late)], lambda s, means: self._send_late(s, means, counts), step + 1)

    def _send_late(self, step: int, means: dict[str, float], counts: dict[str, int]) -> None:
        """A sampled step's late records: averaged with the records its snapshot already holds
        (``published`` kept how many of each), so a step's value is the mean of all its records
        whichever side of ``step()`` they were made on, as for an unsampled step. The same for
        an unsampled step whose records were sent at its boundary (watched): averaged with the
        means sent then."""
        early = self._early.get(step)
        snap = None
        if early is not None:
            base = self._final.get(step)
        else:
            snap = self._feed.find(step)
            base = None if snap is None else {"loss": snap.loss, **snap.scalars}
        if base is None:
            vals = dict(means)
            self._send(step, vals.pop("loss", None), vals)
            return
        held = early if early is not None else self._counts.get(step, {})
        merged: dict[str, Any] = dict(base)
        for k, mean in means.items():
            old, n_old, n = merged.get(k), held.get(k, 0), counts.get(k, 1)
            if isinstance(old, float | int) and not isinstance(old, bool) and n_old > 0:
                merged[k] = (old * n_old + mean * n) / (n_old + n)
            else:
                merged[k] = mean
            held[k] = n_old + n
        if early is None:
            self._counts[step] = held
        loss = merged.pop("loss", None)
        if snap is not None:
            self._feed.replace_snapshot(replace(snap, loss=loss, scalars=merged))
        self._send(step, loss, merged)
