"""NaN/Inf detection on every step without making the host wait for the device.

Every step's ``pre_step`` work ends by gathering, on the gradients' device, one small vector per
step (a :class:`~inspector.stats.telemetry.Pack`): a finiteness **probe** per gradient, what each
``nan_guard`` counted (its targets' NaN and Inf counts, ``pre_step`` and ``post_accumulate``), each
guarded module's flag and, under DDP, each local (pre-all-reduce) gradient norm. :meth:`Deferred.submit`
starts its copy to the host (``non_blocking`` into pinned memory on CUDA, with an event recorded
after it) and returns at once; nothing is read during the step.

A check is examined at a later step boundary: the next one (or the first after it whose copy has
completed: ``event.query()``, never a wait, while at most ``MAX_PENDING`` copies are in flight), and
at the latest by ``finish()``, ``close()`` or a pause, which wait for every copy. The same queue
(:class:`Deferred`) carries the tensors passed to ``record()`` on unsampled steps and after a
boundary, so that reading a loss never makes the host wait either. Under
``torch.distributed`` every rank waits for the previous step's check at each boundary (a copy
queued a whole step earlier, normally complete), so that the ranks report about the same step.
So a non-finite gradient of step N is reported at step N+1's boundary (later only when the device
runs more than a step behind), naming step N and the parameter.

The probe: on a sampled step each raw gradient's abs-max (which the snapshot needs anyway), finite
exactly when the gradient is; on an unsampled step its 2-norm (one fused ``torch._foreach_norm``,
or on the CPU a plan's flat and stacked passes, whichever is cheaper there), finite when the
gradient is, and NaN exactly when it holds a NaN. A
2-norm is also infinite for finite values whose float32 squares overflow (about 1e19 and up): such
a finding says so (``overflow_possible``), unless a guard's counts on that gradient tell.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .nonfinite import Findings
from .telemetry import Pack

__all__ = ["Check", "Deferred", "MAX_PENDING", "build_check", "guard_counts", "pack_guard_counts"]

MAX_PENDING = 8  # copies in flight before the oldest one is waited for (a device far behind)


@dataclass
class Check:
    """One step's deferred check: what its vector holds (host-side metadata) and the copy."""

    step: int
    index: list[int]  # parameter indices of the "probe" segment
    exact: bool  # the probe is an abs-max (sampled step); else a 2-norm (an inf may be an overflow)
    guards: list[tuple[list[int], str]] = field(default_factory=list)  # per "guard:k": indices, action
    post: list[tuple[int, str]] = field(default_factory=list)  # the "post" segment's (index, action)
    modules: list[str] = field(default_factory=list)  # the "module_bad" segment's modules
    local_index: list[int] = field(default_factory=list)  # the "local_norm" segment's parameters (DDP)
    shard_index: list[int] = field(default_factory=list)  # FSDP2: sharded parameters (probe = shard's)
    found: dict[int, tuple[int, int]] = field(default_factory=dict)  # host-read findings (skip guards)
    actions: dict[int, str] = field(default_factory=dict)  # host-known actions (skip)
    values: dict[str, list[float]] = field(default_factory=dict)  # the vector's host values, once read

    @property
    def plain(self) -> bool:
        """Nothing but the probe: no guard, module flag, backward finding or local norm to examine."""
        return not (self.guards or self.post or self.modules or self.local_index or self.found)

    def local_bad(self) -> int:
        """The first parameter whose local gradient (DDP: before the all-reduce; FSDP2: this rank's
        shard) was not finite on this rank, or -1."""
        v = self.values
        bad = [
            i for i, x in zip(self.local_index, v.get("local_norm", []), strict=True) if not math.isfinite(x)
        ]
        probe = dict(zip(self.index, v.get("probe", []), strict=True))
        bad += [i for i in self.shard_index if not math.isfinite(probe.get(i, 0.0))]
        return min(bad, default=-1)

    def findings(self) -> Findings:
        """The step's non-finite gradients, with counts where a guard took them."""
        v = self.values
        counts: dict[int, tuple[int, int]] = dict(self.found)
        actions: dict[int, str] = dict(self.actions)
        points: dict[int, str] = {}
        covered: set[int] = set()  # parameters whose counts a guard took (so its probe's inf is known)
        for i, nan, inf, action in guard_counts(self.guards, v):
            covered.add(i)
            if nan or inf:
                counts.setdefault(i, (nan, inf))
                actions.setdefault(i, action)
        flat = v.get("post", [])
        for j, (i, action) in enumerate(self.post):
            nan, inf = int(flat[2 * j]), int(flat[2 * j + 1])
            if nan or inf:  # found during the backward (and maybe zeroed since)
                counts[i] = (nan, inf)
                actions[i] = action
                points[i] = "post_accumulate"
        bad = set(counts)
        overflow: set[int] = set()
        for i, x in zip(self.index, v.get("probe", []), strict=True):
            if math.isfinite(x) or (i in covered and i not in counts):
                continue  # finite, or an inf 2-norm of finite values (a guard counted none)
            bad.add(i)
            if i not in counts:
                if math.isnan(x):
                    counts[i] = (-1, -1)  # NaN present, counts not taken
                else:
                    counts[i] = (0, -1)  # no NaN (it would make the norm NaN); Inf not counted
                    overflow.update(() if self.exact else (i,))
        bad_modules = [m for m, x in zip(self.modules, v.get("module_bad", []), strict=True) if x]
        return Findings(
            bad=sorted(bad),
            counts=counts,
            actions=actions,
            bad_modules=bad_modules,
            points=points,
            overflow_possible=sorted(overflow),
        )


def pack_guard_counts(pack: Pack, guards: list[Any]) -> list[tuple[list[int], str]]:
    """Add each ``pre_step`` guard's device counts (``ops.GuardResult.counts``) to ``pack`` as
    segment ``guard:k``; returns each one's ``(indices, action)``, in ``k`` order."""
    out: list[tuple[list[int], str]] = []
    for g in guards:
        if g.counts is not None:
            pack.add(f"guard:{len(out)}", g.counts)
            out.append((g.indices, g.action))
    return out


def guard_counts(
    entries: list[tuple[list[int], str]], values: dict[str, list[float]]
) -> Iterator[tuple[int, int, int, str]]:
    """``(index, nan, inf, action)`` per guarded parameter, from the host values of the segments
    :func:`pack_guard_counts` added, in guard order."""
    for k, (indices, action) in enumerate(entries):
        flat = values.get(f"guard:{k}", [])
        for j, i in enumerate(indices):
            yield i, int(flat[2 * j]), int(flat[2 * j + 1]), action


def build_check(
    step: int, raw: Any, guards: list[Any], skipped: bool, hooks: Any, layout: Any
) -> tuple[Check, Pack]:
    """Step ``step``'s check and its device vector: ``raw`` (a ``step_stats.RawRead``), what the
    ``pre_step`` guards found (``ops.GuardResult``), whether a ``skip`` guard skipped the step, what
    the torch hooks collected during the backward (``torch_hooks.TorchHooks``), the FSDP2 layout."""
    check = Check(step=step, index=raw.index, exact=raw.exact)
    pack = Pack()
    pack.add("probe", raw.probe)
    mods = hooks.guarded_modules()
    if mods:
        check.modules = mods
        pack.add("module_bad", [hooks.mod_bad[n] for n in mods])
    if raw.local_index:
        check.local_index = raw.local_index
        pack.add("local_norm", raw.local_norms)
    if layout is not None:
        check.shard_index = [i for i in raw.index if layout.sharded[i]]
    check.guards = pack_guard_counts(pack, guards)
    for g in guards:
        for f in g.found or ():
            check.found[f.index] = (f.nan, f.inf)
            check.actions[f.index] = g.action
    if skipped:
        for i in range(len(hooks.tensors)):
            check.actions.setdefault(i, "skip")
    post = hooks.take_post_findings()
    if post:
        check.post = [(i, action) for i, _, action in post]
        dev = post[0][1].device
        pack.add("post", torch.stack([c.to(dev) for _, c, _ in post]))
    return check, pack


class _Item:
    """One submission: ``flat`` (a 1-D float32 device tensor, or None) on its way to the host, and
    what consumes its values: ``consume(split(values))``, with ``split`` a Pack's ``unflatten``
    (named segments) or None (the plain list)."""

    __slots__ = ("step", "split", "host", "event", "consume")

    def __init__(
        self,
        step: int | None,
        flat: Tensor | list[Tensor] | None,
        split: Callable[[list[float]], Any] | None,
        consume: Callable[[Any], None],
    ):
        self.step = step
        self.split = split
        self.consume = consume
        self.event: Any = None  # a torch.cuda.Event recorded after the copy (None: on the host already)
        if flat is None or isinstance(flat, list) or flat.is_cpu:
            self.host = flat  # fresh CPU tensors of the step's, read at a later boundary
        elif flat.is_cuda:
            self.host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self.host.copy_(flat, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = flat.to("cpu", non_blocking=True)

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())

    def run(self) -> None:
        if self.host is None:  # nothing on the device (a pack-less submit): the consumer's turn in order
            self.consume({})
            return
        if self.event is not None and not self.event.query():
            self.event.synchronize()  # only where the caller chose to wait (finish, close, a pause)
        if isinstance(self.host, list):  # 0-dim CPU tensors (``submit_flat``)
            self.consume([x.item() for x in self.host])
            return
        values = self.host.tolist()
        self.consume(values if self.split is None else self.split(values))


class Deferred:
    """Device values on their way to the host, consumed in submission order (FIFO).

    ``submit(step, pack, consume)`` (or ``submit_flat``) starts one copy and returns; ``drain(before=N)`` calls each
    ``consume(values)`` whose copy completed, for items of steps before ``N``, stopping at the
    first that is not ready, so order is kept; ``drain(wait=True)`` waits for them all. An item
    with no device values (``pack=None``) is consumed at once when nothing is ahead of it.
    """

    def __init__(self, lock: threading.RLock | None = None) -> None:
        self._q: deque[_Item] = deque()
        # device copies among them (an item with an event): only these can fall behind, so only
        # these count towards MAX_PENDING (an item with nothing to copy is no copy in flight)
        self._copies = 0
        # close() may run on another thread than the training loop. The Inspector passes its own
        # lock: the consumers take it (an event, a finding), and a rewind drains while holding
        # it, so one lock for both leaves no order in which two threads could each hold one
        self._lock = lock if lock is not None else threading.RLock()

    def __len__(self) -> int:
        return len(self._q)

    def submit(
        self, step: int | None, pack: Pack | None, consume: Callable[[dict[str, list[float]]], None]
    ) -> None:
        flat = pack.flat() if pack is not None else None
        with self._lock:
            if flat is None and not self._q:
                consume({})
                return
            self._push(_Item(step, flat, None if flat is None else pack.unflatten, consume))  # type: ignore[union-attr]

    def _push(self, it: _Item) -> None:
        self._q.append(it)
        if it.event is not None:
            self._copies += 1

    def submit_flat(
        self, step: int, flat: Tensor | list[Tensor], consume: Callable[[list[float]], None]
    ) -> None:
        """Like :meth:`submit` for one unnamed 1-D float32 tensor (or a list of 0-dim CPU ones):
        ``consume`` gets its host list."""
        with self._lock:
            self._push(_Item(step, flat, None, consume))

    def drain(self, *, before: int | None = None, wait: bool = False) -> None:
        while True:
            with self._lock:
                if not self._q:
                    return
                it = self._q[0]
                if before is not None and it.step is not None and it.step >= before:
                    return
                ready = it.ready()
                if not (wait or ready or self._copies > MAX_PENDING):
                    return
                if ready:
                    self._q.popleft()
                    if it.event is not None:
                        self._copies -= 1
                    it.run()
                    continue
            # a copy still under way that we must wait for: waited for outside the lock (the
            # Inspector's: its other threads go on meanwhile), then consumed in order as above
            # (a caller that holds the lock already, a rewind, keeps it)
            it.event.synchronize()

    def clear(self) -> None:
        with self._lock:
            self._q.clear()
            self._copies = 0
