"""Checkpoints in host memory or on disk, and rewinding to one: ``insp.checkpoint()``,
``insp.rewind(id)``, ``insp.rewind(path)``.

A :class:`Checkpoint` holds what the next steps of a run depend on:

- the model's ``state_dict()`` (parameters and buffers; for a dict of tensors, the tensors),
  copied to host memory;
- the optimizer's ``state_dict()`` (momentum, Adam's moments, the param groups' lr ...),
  deep-copied to host memory, and the ``GradScaler``'s when one is attached;
- with ``attach(..., checkpoint_dir=PATH)`` the model's and optimizer's state go to a
  ``torch.distributed.checkpoint`` directory under PATH instead, one per checkpoint (the newest
  ``keep`` kept, ``path`` in its ``info()``), read back in place by a rewind: see
  :mod:`inspector.whatif.dcp_store` (a write that fails is a ``checkpoint_error`` event; a
  directory that is missing, partial or of another model is refused, nothing changed);
- the inspector's own state: the step counter, the hook config in force (specs with their ids,
  the Python callables of ``python`` hooks), every ``noise`` hook's generator states, every
  ``zclip`` hook's running statistics of the norm, the
  cadence (which steps are sampled next, and so get statistics and histograms) and the streak of
  non-finite steps (so a rewound run samples, and reports NaN/Inf, as it did the first time);
- what a caller registered with :meth:`Checkpoints.add_state` (the demo: its data stream).

The global RNG, the user's data loader and LR schedulers are not saved: after a rewind in your own
loop the loader goes on, so the next batches differ from those of the abandoned branch, and a
scheduler goes on counting unless it was registered with :meth:`Checkpoints.add_state` (the
learning rate itself comes back with the optimizer's state).
A checkpoint records the data position of ``insp.batches(loader)`` (the index of the next batch),
and ``rewind(id, skip=...)`` names a window of batches the new branch does not receive, recorded
as a ``batches_skipped`` event: see :mod:`inspector.whatif.skip`.

When things happen: a request (a checkpoint, a rewind) is carried out by the training thread at
a **step boundary**, never while a step is under way: at the next boundary, or at once when the
caller is the training thread between two steps, when training is held at a boundary (paused:
the held thread does it), or when training has finished. :meth:`Checkpoints.service` is that
safe point; ``StepLifecycle.apply_edits`` calls it wherever it applies edits with the torch hooks in
reach, and a loop that owns its thread (the demo) may call it between steps.

Only the newest ``keep`` checkpoints are kept (``attach(..., checkpoints=K)``, default 3; 0
turns checkpoints off); ``bytes`` is their host memory (that of a state on disk not counted). The queue is bounded the same way: at most
``keep`` checkpoint requests and ``keep`` rewind requests wait for a boundary (one more is refused
with :class:`~inspector.wire.errors.CheckpointBusy`; a rewind to a checkpoint that already has one
waiting is the same request), so no client can make the training thread copy the model more
often than it keeps copies.

Automatic checkpoints (``attach(..., checkpoint_every=N)``): at the boundary of every step whose
number is a multiple of N (:meth:`Checkpoints.scheduled`, called by the boundary after the rules
acted), with the same machinery; not at a boundary whose rules asked for a rewind, nor while the
newest step checked has non-finite gradients (its state would be no place to go back to). Such a
boundary first waits for the step's own NaN/Inf check (the copy to host memory that follows
waits for the device anyway), so a step's non-finite gradients are known before its state is kept.
Each checkpoint says where it came from (``origin``: ``auto``, ``rule``, ``page`` or ``loop``), when
it was taken (``time``) and how long the copy took (``took``, seconds).

A memory budget (``attach(..., checkpoint_memory="2GB")``, per process; decimal units KB, MB, GB,
TB and binary ones KiB, MiB, GiB, TiB, or an int of bytes): the kept checkpoints never hold more.
Before a copy is made, its size is read from the ``state_dict()``s (no copy); the oldest kept
ones are dropped until it fits beside the newest (so the newest that fit are kept, never more than
``keep``); one that would not fit alone is refused: ``insp.checkpoint()`` raises
:class:`~inspector.wire.errors.CheckpointError` naming the budget and the sizes, an automatic one
files a ``checkpoint_error`` event (once for each reason in a row, not every N steps) and training
goes on.

Checkpoints are refused, with the reason, where a
restore cannot be right: without a torch optimizer (a ``mark_step()`` loop: the update's
state is the user's), with an optimizer or a scaler that has no ``state_dict()``, under FSDP2
without a process group, and once the control collective failed under ``torch.distributed``.

Under ``torch.distributed`` (DDP, FSDP2) every rank keeps its own checkpoints, taken and restored
at the same boundary (:func:`capture_state`, :func:`restore_state`: DDP, each rank's
``state_dict()``; FSDP2, its shards through ``get_state_dict``/``set_state_dict``). A request
from the training thread (the script, a rule's action: made on every rank alike) is carried out
at once on every rank, after one broadcast that brings rank 0's waiting requests along and gives
every rank the same next id. A request from another thread (rank 0's server, the agent; another
rank's are refused) waits in ``outbox`` until the next boundary's exchange carries it to every
rank (:mod:`inspector.step.dist_sync`), where every rank carries it out. A rewind is first checked
on every rank (the checkpoint kept there, its state fitting, its skip window), the verdicts are
exchanged (one ``all_gather_object`` on the control plane's gloo group), and then carried out on
every rank or refused on every rank (a ``rewind_error`` naming the first rank that refused; from
the script, ``CheckpointError``), nothing changed. A rank that dies or does not answer makes that
exchange fail within the group's timeout (``attach(..., dist_timeout=60)``): the other ranks
refuse the rewind there (``rewind_error`` and ``distributed_error``), their state unchanged, and
stop coordinating. With ``checkpoint_dir`` every rank writes its part of one DCP directory (rank 0
makes it; the verdicts are exchanged before the collective write) and reads it back after the
rewind's verdicts (:mod:`inspector.whatif.dcp_store`); ``insp.rewind(path)`` is called on every
rank and goes through the same verdicts.

A rewind: the model, optimizer and scaler get the checkpoint's state in place (the same
objects, so every hook stays valid; gradients are set to None), the step counter goes back
to the checkpoint's step, the hook config becomes the checkpoint's (one change, action
``rewind``, announced like any other), noise streams and zclip's statistics resume where they were, the snapshots
of the abandoned branch leave the ring buffer, and a ``rewind`` event (``step``: the
checkpoint's step, ``from_step``) tells subscribers (the server keeps the abandoned branch
as a run of its own). Records made after the abandoned step's boundary are dropped.
Checkpoints taken on the abandoned branch are dropped too (their directories deleted): a rewind to one of them that was
still waiting is refused (a ``rewind_error`` event naming why), never carried out onto the
branch just left. A rewind at the checkpoint's own step (nothing to abandon: a double click,
a script that retries) puts state and hooks back and abandons no step (``from_step`` equals
``step``; the server records no branch).

While a rewind waits for its boundary, hook changes are refused
(:class:`~inspector.wire.errors.RewindPending`, see :meth:`Checkpoints.pending_rewind`): the rewind
would put the checkpoint's hooks back over them unseen. Changes asked for before the rewind
request apply first, and the rewind then undoes them, as it undoes every change since its
checkpoint.

A rewind to a directory the loop wrote itself (:meth:`Checkpoints.rewind_dir`,
``insp.rewind(path, step=N)``) puts back the model's and optimizer's state and the step counter;
the inspector's own state (hooks, noise streams, zclip's statistics, the scaler) stays as it is,
and the cadence restarts at the next step. Checkpoints kept of steps after ``N`` are dropped.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import shutil
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as tdist
from torch import Tensor

from ..hooks.zclip import ZClipState
from ..wire.errors import (
    CheckpointBusy,
    CheckpointError,
    CheckpointNotFound,
    InspectorError,
    describe_error,
    shown,
)
from ..wire.records import HookSpec
from .dcp_store import DiskStore, check_dir, dir_step, live_state, load_dir, wait_written
from .skip import BatchCursor, check_skip

if TYPE_CHECKING:
    from ..feed import Feed
    from ..hooks.edits import Edits
    from ..hooks.registry import Registry
    from ..hooks.torch_hooks import TorchHooks
    from ..stats.deferred import Deferred
    from ..stats.nonfinite import NonfiniteReport
    from ..stats.telemetry import Cadence
    from ..step.clock import StepClock
    from ..step.events import EventLog
    from ..step.gate import PauseGate
    from ..step.scalars import Recorder
    from ..wrappers import Attached

__all__ = [
    "Checkpoint",
    "Checkpoints",
    "HostShard",
    "capture_state",
    "restore_state",
    "host_copy",
    "nbytes",
    "parse_memory",
    "DEFAULT_KEEP",
    "ORIGINS",
]

DEFAULT_KEEP = 3
# who asked for a checkpoint: checkpoint_every, a rule, the server (page, agent, HTTP), the loop
ORIGINS = ("auto", "rule", "page", "loop")

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_memory(x: Any) -> int | None:
    """``checkpoint_memory``: None, a positive int of bytes, or a string such as ``"2GB"``,
    ``"512MiB"``, ``"1.5 GB"`` (KB, MB, GB, TB: powers of 1000; KiB, MiB, GiB, TiB: of 1024).
    Raises ValueError saying what is accepted."""
    if x is None:
        return None
    if isinstance(x, int) and not isinstance(x, bool):
        if x <= 0:
            raise ValueError(f"must be a positive number of bytes (got {x})")
        return x
    if isinstance(x, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*", x)
        unit = m.group(2).lower() if m else None
        if m and unit in _UNITS:
            n = int(float(m.group(1)) * _UNITS[unit])
            if n <= 0:
                raise ValueError(f"must be more than 0 bytes (got {x!r})")
            return n
    raise ValueError(
        f"a number of bytes (int) or a size such as '2GB' or '512MiB' (units B, KB, MB, GB, TB, "
        f"KiB, MiB, GiB, TiB), got {shown(x)}"
    )


@dataclass
class HostShard:
    """This rank's shard of a ``DTensor`` (FSDP2), on the host: its local tensor, and what gives it
    back as a ``DTensor`` on its device (:func:`fresh`). ``shape``: the full tensor's."""

    local: Tensor
    mesh: Any
    placements: tuple[Any, ...]
    shape: torch.Size
    stride: tuple[int, ...]
    device: torch.device

    def dtensor(self) -> Any:
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            self.local.to(self.device, copy=True),
            self.mesh,
            self.placements,
            run_check=False,
            shape=self.shape,
            stride=self.stride,
        )


def _is_dtensor(x: Any) -> bool:
    cls = type(x)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


def host_copy(x: Any) -> Any:
    """``x`` with every tensor copied (detached) to host memory; containers rebuilt, other values
    deep-copied. Nothing of the result shares storage with ``x``. A ``DTensor`` keeps this rank's
    shard only (:class:`HostShard`)."""
    if _is_dtensor(x):
        local = x.to_local()
        return HostShard(
            local.detach().to("cpu", copy=True),
            x.device_mesh,
            tuple(x.placements),
            x.shape,
            tuple(x.stride()),
            local.device,
        )
    if isinstance(x, Tensor):
        return x.detach().to("cpu", copy=True)
    if isinstance(x, dict):
        return {k: host_copy(v) for k, v in x.items()}
    if isinstance(x, list):
        return [host_copy(v) for v in x]
    if isinstance(x, tuple):
        return tuple(host_copy(v) for v in x)
    return copy.deepcopy(x)


def fresh(x: Any) -> Any:
    """A copy of a stored state to hand to ``load_state_dict`` (which may keep the tensors it is
    given: training would then change the checkpoint). A :class:`HostShard` becomes a ``DTensor``
    on its device again."""
    if isinstance(x, HostShard):
        return x.dtensor()
    if isinstance(x, Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: fresh(v) for k, v in x.items()}
    if isinstance(x, list):
        return [fresh(v) for v in x]
    if isinstance(x, tuple):
        return tuple(fresh(v) for v in x)
    return copy.deepcopy(x)


def nbytes(x: Any) -> int:
    """Bytes of the tensors in ``x`` (nested containers; of a shard, this rank's part)."""
    if isinstance(x, HostShard):
        return nbytes(x.local)
    if isinstance(x, Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, dict):
        return sum(nbytes(v) for v in x.values())
    if isinstance(x, list | tuple):
        return sum(nbytes(v) for v in x)
    return 0


@dataclass
class Checkpoint:
    """One saved state (see the module docstring); ``step`` is None until it is taken."""

    id: str
    label: str | None
    auto: bool  # taken before a change from the page, which waits for it (holds_changes)
    requested: float
    origin: str = "loop"  # ORIGINS: checkpoint_every ("auto"), a rule, the server ("page"), the loop
    step: int | None = None
    time: float | None = None  # wall-clock time it was taken
    took: float | None = None  # seconds the copy took
    model: Any = None
    optim: Any = None
    scaler: Any = None
    hooks: tuple[HookSpec, ...] = ()
    fns: dict[str, Any] = field(default_factory=dict)
    generators: dict[str, dict[Any, Tensor]] = field(default_factory=dict)
    zclip: dict[str, dict[str, Any]] = field(default_factory=dict)  # zclip hooks' statistics, on the host
    extra: dict[str, Any] = field(default_factory=dict)
    seq: int = 0  # the last event's seq when it was taken
    config_version: int = 0
    bytes: int = 0
    dropped: str | None = None  # why a rewind dropped it (taken on the branch that rewind abandoned)
    cadence: dict[str, Any] = field(default_factory=dict)  # which steps are sampled next, and counted
    nonfinite: dict[str, Any] = field(default_factory=dict)  # the non-finite streak's state
    position: int | None = None  # the data position: the index of the next batch (whatif/skip.py)
    # on disk (checkpoint_dir, or rewind(path)): the DCP directory holding the model's and the
    # optimizer's state (model and optim are then None), and its write while under way
    path: str | None = None
    pending: Any = None
    disk_bytes: int = 0

    def info(self) -> dict[str, Any]:
        """``{"id", "label", "auto", "origin", "step", "time", "took", "bytes", "path", "taken",
        "config_version", "hooks"}`` (``path``: its directory on disk, else None)."""
        return {
            "id": self.id,
            "label": self.label,
            "auto": self.auto,
            "origin": self.origin,
            "step": self.step,
            "time": self.time,
            "took": self.took,
            "bytes": self.bytes,
            "path": self.path,
            "taken": self.step is not None,
            "config_version": self.config_version,
            "hooks": [s.to_dict() for s in self.hooks],
        }


class Checkpoints:
    """An Inspector's checkpoints and its queue of checkpoint and rewind requests.

    Built from the parts whose state a checkpoint holds and a rewind restores, each through its
    own ``state_dict()``/``load_state_dict()`` or methods: the step clock, the hook registry and
    the edits that apply it, the torch hooks' noise streams, the cadence, the non-finite report,
    the records, the feed's rings, the event log; the pause gate's condition is the lock.
    """

    def __init__(
        self,
        keep: int,
        attached: Attached,
        *,
        gate: PauseGate,
        clock: StepClock,
        events: EventLog,
        reg: Registry,
        edits: Edits,
        hooks: TorchHooks,
        cadence: Cadence,
        nonfinite: NonfiniteReport,
        records: Recorder,
        deferred: Deferred,
        feed: Feed,
        data: BatchCursor | None = None,
        every: int | None = None,
        memory: int | str | None = None,
        directory: str | os.PathLike[str] | None = None,
    ) -> None:
        from ..wire.errors import HookError

        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise HookError(("checkpoints",), f"must be a non-negative integer (got {shown(keep)})")
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise HookError(("checkpoint_every",), f"must be None or a positive integer (got {shown(every)})")
        try:
            self.budget = parse_memory(memory)  # bytes the kept checkpoints may hold; None: no bound
        except ValueError as e:
            raise HookError(("checkpoint_memory",), str(e)) from None
        self.every = every  # an automatic checkpoint at every step that is a multiple of it
        if directory is not None and not isinstance(directory, str | os.PathLike):
            raise HookError(("checkpoint_dir",), f"must be a path or None (got {shown(directory)})")
        self._at = attached
        self._gate = gate
        self._clock = clock
        self._events = events
        self._reg = reg
        self._edits = edits
        self._hooks = hooks
        self._cadence = cadence
        self._nonfinite = nonfinite
        self._records = records
        self._deferred = deferred
        self._feed = feed
        self.keep = keep
        self._items: OrderedDict[str, Checkpoint] = OrderedDict()
        self._queue: deque[tuple[str, Checkpoint]] = deque()  # ("checkpoint" | "rewind", cp)
        self._refused: dict[str, str] = {}  # a rewind refused as it was carried out: why
        self._next = 1
        self.rewinds = 0  # rewinds carried out so far
        self._states: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        self._data = data  # the data position and skipped windows (whatif/skip.py)
        self._data_keys: set[str] = set()  # states that are the data stream's (add_state(..., data=True))
        self._skips: dict[str, tuple[Any, Any]] = {}  # a waiting rewind's skip: (checked, as asked)
        # The scaler at a boundary inside scaler.step(): its update() for this iteration is still
        # to come, so what a checkpoint keeps of it is read, and what a rewind gives it is loaded,
        # after that update (settle_scaler(), at the next forward): a checkpoint holds the scaler
        # as between two steps, wherever it was taken or restored
        self._scaler_later: list[Checkpoint] = []  # taken, their scaler state still to read
        self._scaler_restore: Any = None  # a rewind's scaler state still to load
        self.scaler_pending = False
        self.on_request: list[Callable[[], None]] = []  # called after a request is queued (any thread)
        self._auto_why: str | None = None  # why the last automatic checkpoint was not taken (its key)
        self.auto_refused: str | None = None  # ... and the reason as filed (summary(); the page shows it)
        # where the model's and optimizer's state live: host memory, or a DCP directory each
        # under ``directory`` (inspector/whatif/dcp_store.py)
        # (under torch.distributed: written over the control plane's gloo group, rank 0 making the
        # directory every rank writes its part of)
        dist = attached.dist
        self._disk = (
            DiskStore(
                directory,
                group=dist.group if dist is not None else None,
                rank=dist.rank if dist is not None else 0,
            )
            if directory is not None
            else None
        )
        if self._disk is not None:
            self._disk.on_failure = self._write_failed
        # under torch.distributed: the job's control plane. Every rank holds the same queue: a
        # request from another thread (rank 0's server) waits in ``outbox`` until an exchange carries
        # it to every rank (:meth:`outgoing`, :meth:`receive`); one from the training thread (the
        # script or a rule, on every rank alike) first takes rank 0's outbox along (:meth:`_sync`)
        self._plane = attached.dist
        self.outbox: list[tuple[str, Checkpoint]] = []
        self.sync_failed: Callable[[BaseException], None] | None = None  # the control plane failed

    # ------------------------------------------------------------ refusals
    def refusal(self) -> str | None:
        """Why checkpoints cannot be right for this Inspector, or None."""
        at = self._at
        if self.keep == 0:
            return "checkpoints are off for this Inspector (attach(..., checkpoints=0))"
        if at.layout is not None and at.dist is None:
            return "under FSDP2 checkpoints need the job's process group (torch.distributed, 2 ranks or more)"
        if at.dist is not None and at.dist.broken:
            return (
                f"the control collective failed ({at.dist.broken}): a checkpoint or a rewind needs "
                "every rank at the same step boundary"
            )
        opt = at.optimizer
        if opt is None:
            return (
                "without a torch optimizer (a mark_step() loop) the update's own state is yours: "
                "checkpoints need the optimizer's state_dict()"
            )
        if not callable(getattr(opt, "state_dict", None)) or not callable(
            getattr(opt, "load_state_dict", None)
        ):
            return f"the optimizer {type(opt).__name__} has no state_dict()/load_state_dict()"
        sc = at.scaler
        if sc is not None and not (
            callable(getattr(sc, "state_dict", None)) and callable(getattr(sc, "load_state_dict", None))
        ):
            return f"the scaler {type(sc).__name__} has no state_dict()/load_state_dict(): its scale would be lost"
        root = at.root
        if root is not None and not callable(getattr(root, "load_state_dict", None)):
            return f"the model {type(root).__name__} has no load_state_dict()"
        return None

    def _check(self) -> None:
        why = self.refusal()
        if why is not None:
            raise CheckpointError(why)

    # ------------------------------------------------------------ requests (any thread)
    def add_state(
        self, key: str, save: Callable[[], Any], load: Callable[[Any], None], *, data: bool = False
    ) -> None:
        """Save ``save()`` with every checkpoint (under ``key``) and call ``load(value)`` on a rewind
        (the training thread, at a boundary). What ``save`` returns is copied (tensors to host
        memory, the rest deep-copied), so a live ``state_dict()`` will do: for an LR scheduler,
        ``add_state("scheduler", sched.state_dict, sched.load_state_dict)``. ``data``: this state
        is the data stream's (the batches come again from the checkpoint's position after a
        rewind): ``insp.batches``'s position then goes back with it (inspector/whatif/skip.py)."""
        with self._gate.cond:
            self._states[key] = (save, load)
            if data:
                self._data_keys.add(key)
            else:
                self._data_keys.discard(key)

    def checkpoint(self, label: str | None = None, *, auto: bool = False, origin: str | None = None) -> str:
        """Request a checkpoint; returns its id (``c1``, ``c2``, ...). See the module docstring."""
        return str(self.request(label, auto=auto, origin=origin)["id"])

    def request(
        self, label: str | None = None, *, auto: bool = False, origin: str | None = None
    ) -> dict[str, Any]:
        """Request a checkpoint; returns its ``info()`` as of the request (``taken`` true when it
        was taken at once), so a reply never depends on its still being kept afterwards.
        ``auto``: taken before a change from the page (the change waits for it); ``origin``: who
        asks (``ORIGINS``; default ``page`` when ``auto``, else ``loop``).

        Raises:
            CheckpointBusy: ``keep`` checkpoint requests wait for the next boundary already.
            CheckpointError: checkpoints cannot be right here (the message says why), or one
                would not fit the memory budget (``checkpoint_memory``) alone.
        """
        from ..wire.errors import HookError

        if label is not None and not isinstance(label, str):
            raise HookError(("label",), f"must be a string or None (got {shown(label)})")
        origin = origin if origin is not None else ("page" if auto else "loop")
        if origin not in ORIGINS:
            raise HookError(("origin",), f"must be one of {', '.join(ORIGINS)} (got {shown(origin)})")
        with self._gate.cond:
            if self._gate.closed:
                raise InspectorError("this Inspector is closed")
            self._check()
            remote = self._remote()
            if remote is False:
                self._sync()  # rank 0's waiting requests first, and its next id
            if self.budget is not None:
                try:
                    size = self._state_size()
                except Exception:  # the optimizer's state changing under way: checked when taken
                    size = 0
                why = self._over_budget(size)
                if why is not None:
                    raise CheckpointError(why)
            self._bound("checkpoint")
            cp = Checkpoint(f"c{self._next}", label[:200] if label else None, auto, time.time(), origin)
            self._next += 1
            if remote:
                self.outbox.append(("checkpoint", cp))
                self._wake()
                return cp.info()
            self._queue.append(("checkpoint", cp))
            self._kick()
            return cp.info()

    def rewind(self, cp_id: str, skip: Any = None) -> dict[str, Any]:
        """Request a rewind to checkpoint ``cp_id``; returns ``{"checkpoint", "step", "done"}``
        (``done``: carried out already; else at the next boundary). A rewind to ``cp_id`` that
        waits already is this request too (a double click rewinds once; its ``skip`` becomes this
        one's). ``skip``: a window of batches that the new branch does not receive
        (inspector/whatif/skip.py); refused with HookError (``loc`` ``skip``), nothing changed,
        when it cannot be honoured."""
        checked = check_skip(skip)
        with self._gate.cond:
            if self._gate.closed:
                raise InspectorError("this Inspector is closed")
            self._check()
            remote = self._remote()
            if remote is False:
                return self._dist_rewind(cp_id, checked, skip)
            cp = self._find(cp_id)
            if cp.path is not None and (cp.pending is None or cp.pending.done()):
                wait_written(cp.path, cp.pending)  # on disk: refused now when it is not whole
                check_dir(self._at, cp.path)
            if checked is not None:
                self._plan(cp, checked)  # refused now, before anything is queued
            if remote:
                waiting = any(kind == "rewind" and c is cp for kind, c in self.outbox)
                if not waiting:
                    self._bound("rewind")
                    self.outbox.append(("rewind", cp))
                self._skips.pop(cp.id, None)
                if checked is not None:
                    self._skips[cp.id] = (checked, skip)
                self._wake()
                return {"checkpoint": cp.id, "step": cp.step, "done": False}
            waiting = any(kind == "rewind" and c is cp for kind, c in self._queue)
            if not waiting:
                self._bound("rewind")
            self._skips.pop(cp.id, None)
            if checked is not None:
                self._skips[cp.id] = (checked, skip)
            if waiting:
                return {"checkpoint": cp.id, "step": cp.step, "done": False}
            self._queue.append(("rewind", cp))
            before = self.rewinds
            self._kick()
            return {"checkpoint": cp.id, "step": cp.step, "done": self.rewinds > before}

    # ------------------------------------------------------------ automatic checkpoints
    def due(self, step: int) -> bool:
        """Whether step ``step``'s boundary is one for an automatic checkpoint (``checkpoint_every``)
        that can be taken here: then the boundary first waits for the step's own NaN/Inf check."""
        return self.every is not None and step % self.every == 0 and self.refusal() is None

    def scheduled(self, step: int) -> None:
        """Step ``step``'s boundary, after the rules acted (the training thread, lock held): queue
        the automatic checkpoint of a step that is a multiple of ``checkpoint_every``, carried out
        with the other requests right after (``StepLifecycle.apply_edits``). Not taken where a
        rewind was asked for here (or carried out already), nor while the newest step checked has
        non-finite gradients; one that cannot be taken files ``checkpoint_error`` once for each
        reason in a row. Under torch.distributed every rank is here at the same boundary (the step
        is the same everywhere, and the exchange brought every rank's NaN/Inf findings of this
        step): one broadcast first brings rank 0's waiting requests and its next id, so the
        checkpoint has the same id on every rank, and it is taken here, on every rank."""
        if self.every is None or step % self.every:
            return
        if self._plane is not None and self.refusal() is None:
            try:
                self._sync()  # (rank 0's requests are queued here too, carried out below)
            except CheckpointError as e:
                self._auto_refused("error", step, str(e))
                return
        self._schedule(step)
        if self._plane is not None and self._queue:
            self._kick()  # every rank, at this boundary

    def _schedule(self, step: int) -> None:
        if self._clock.step != step or any(kind == "rewind" for kind, _ in self._queue):
            return  # a rewind takes the run elsewhere: this step's state is not where it goes on
        why = self.refusal()
        if why is not None:
            self._auto_refused("refused", step, why)
            return
        if self._nonfinite.state_dict()["streak"]:
            self._auto_refused(
                "nonfinite",
                step,
                f"the newest step checked has non-finite gradients: the state at step {step} is "
                "not kept (the kept checkpoints are from before)",
            )
            return
        if sum(1 for k, _ in self._queue if k == "checkpoint") >= self.keep:
            return  # keep requests wait already: this boundary takes them
        cp = Checkpoint(f"c{self._next}", None, False, time.time(), "auto")
        self._next += 1  # (under torch.distributed every rank's id alike, whatever the budget says)
        if self.budget is not None:
            try:
                why = self._over_budget(self._state_size())
            except Exception as e:  # never take training down
                from ..wire.errors import describe_error

                why = f"its size could not be read: {describe_error(e)}"
            if why is not None:
                self._auto_refused("budget", step, why)
                return
        self._queue.append(("checkpoint", cp))

    def _auto_refused(self, key: str, step: int, why: str) -> None:
        """An automatic checkpoint not taken: a ``checkpoint_error`` event, once for each reason in
        a row (lock held)."""
        self.auto_refused = f"automatic checkpoint at step {step} not taken: {why}"
        if key == self._auto_why:
            return
        self._auto_why = key
        self._events.emit("checkpoint_error", message=self.auto_refused, step=step, origin="auto", reason=key)

    def _state_size(self) -> int:
        """Bytes of the model's, optimizer's and scaler's state as a checkpoint now would hold them,
        read from their ``state_dict()``s (no copy)."""
        at = self._at
        n = nbytes(at.root.state_dict()) if at.root is not None else nbytes(list(at.tensors))
        n += nbytes(at.optimizer.state_dict())  # type: ignore[union-attr]
        if at.scaler is not None:
            n += nbytes(at.scaler.state_dict())
        return n

    def _over_budget(self, size: int) -> str | None:
        """Why a checkpoint of ``size`` bytes cannot be kept within ``checkpoint_memory``, or None."""
        if self.budget is None or size <= self.budget:
            return None
        return (
            f"a checkpoint of this model, optimizer and scaler holds {_size(size)} ({size} bytes), more "
            f"than the checkpoint memory budget of {_size(self.budget)} ({self.budget} bytes, "
            f"attach(..., checkpoint_memory=...)) allows alone; the {len(self._items)} kept hold "
            f"{_size(self.bytes)}"
        )

    def _make_room(self, size: int) -> list[str]:
        """Drop the oldest kept checkpoints until one of ``size`` bytes fits beside the rest, within
        ``keep`` and the budget (lock held); returns the ids dropped for the budget."""
        dropped = []
        while self._items and len(self._items) >= self.keep:
            self._forget_dir(self._items.popitem(last=False)[1])
        while self._items and self.budget is not None and self.bytes + size > self.budget:
            cp_id, old = self._items.popitem(last=False)
            self._forget_dir(old)
            dropped.append(cp_id)
        return dropped

    # ------------------------------------------------------------ under torch.distributed
    def _remote(self) -> bool | None:
        """None: one process. False: the training thread under torch.distributed (the script or a
        rule, every rank alike: carried out now, on every rank). True: another thread (rank 0's
        server, the agent): it waits in the outbox for the next exchange (lock held)."""
        if self._plane is None:
            return None
        if self._gate.on_training_thread():
            return False
        if self._plane.rank != 0:
            raise InspectorError(
                "under torch.distributed, checkpoint and rewind requests from another thread go to "
                f"rank 0 (which serves the dashboard); this is rank {self._plane.rank}"
            )
        if self._gate.finished:
            raise CheckpointError(
                "training has finished: under torch.distributed a checkpoint or a rewind needs every "
                "rank at a step boundary, and the ranks no longer meet at one"
            )
        return True

    def _wake(self) -> None:
        self._gate.cond.notify_all()  # a held rank 0 exchanges at once
        for fn in list(self.on_request):
            try:
                fn()
            except Exception:  # a waker's bug must not fail the request
                pass

    def outgoing(self) -> tuple[list[tuple[Any, ...]], int]:
        """Rank 0's requests waiting for the exchange, as plain values, and its next id (lock held)."""
        out = []
        for kind, cp in self.outbox:
            skip = self._skips.get(cp.id, (None, None))[1] if kind == "rewind" else None
            out.append((kind, cp.id, cp.label, cp.auto, skip))
        return out, self._next

    def receive(self, sent: tuple[list[tuple[Any, ...]], int]) -> None:
        """Every rank (rank 0 included) queues the requests an exchange carried from rank 0, in its
        order, with its ids (lock held); they are carried out at that boundary, on every rank."""
        requests, next_id = sent
        rank0 = self._plane is not None and self._plane.rank == 0
        sent_keys = {(kind, cid) for kind, cid, *_ in requests}
        mine = {(kind, cp.id): cp for kind, cp in self.outbox if (kind, cp.id) in sent_keys}
        if rank0:  # (one cancelled since it was sent is every rank's now)
            self.outbox = [(kind, cp) for kind, cp in self.outbox if (kind, cp.id) not in sent_keys]
        for kind, cid, label, auto, skip in requests:
            if kind == "checkpoint":
                cp = mine.get((kind, cid)) or Checkpoint(cid, label, auto, time.time())
            else:
                cp = self._lookup(cid)
                if skip is not None and cp.id not in self._skips:
                    try:
                        self._skips[cp.id] = (check_skip(skip), skip)
                    except InspectorError as e:  # (rank 0 accepted it: the verdict will say)
                        cp = self._missing(cid, describe_error(e))
            self._queue.append((kind, cp))
        if not rank0:
            self._next = next_id

    def _sync(self) -> None:
        """The training thread under torch.distributed, on every rank at the same point of the
        script: one broadcast brings rank 0's waiting requests (queued on every rank, before this
        one) and its next id, so every rank names the next checkpoint alike (lock held)."""
        plane = self._plane
        try:
            sent = plane.broadcast(self.outgoing() if plane.rank == 0 else None)
        except Exception as e:
            if self.sync_failed is not None:
                self.sync_failed(e)
            raise CheckpointError(
                f"the control collective failed ({describe_error(e)}): nothing changed"
            ) from e
        self.receive(sent)

    def _lookup(self, cp_id: str) -> Checkpoint:
        """``cp_id`` on this rank, or a stand-in whose rewind every rank refuses (the verdict)."""
        try:
            return self._find(cp_id)
        except CheckpointNotFound as e:
            return self._missing(cp_id, f"{e} on rank {self._plane.rank}")

    def _missing(self, cp_id: str, why: str) -> Checkpoint:
        cp = Checkpoint(cp_id, None, False, time.time())
        cp.dropped = why
        return cp

    def _dist_rewind(self, cp_id: str, checked: Any, skip: Any) -> dict[str, Any]:
        """A rewind asked for by the training thread on every rank (the script, a rule): carried out
        now on every rank, or refused on every rank (lock held)."""
        self._sync_for_rewind(cp_id)
        cp = self._lookup(cp_id)
        if not any(kind == "rewind" and c.id == cp.id for kind, c in self._queue):
            self._bound("rewind")
            self._queue.append(("rewind", cp))
        done = self._carry_out_rewind(cp, checked, skip)
        return {"checkpoint": cp.id, "step": cp.step, "done": done}

    def _dist_rewind_dir(self, cp: Checkpoint, checked: Any, skip: Any) -> dict[str, Any]:
        """``rewind(path)`` on every rank under torch.distributed: queued after rank 0's waiting
        requests and carried out now, the directory checked on every rank and the verdicts
        exchanged before ``dcp.load`` (refused on every rank, nothing changed) (lock held)."""
        self._sync_for_rewind(cp.id)
        self._queue = deque((k, c) for k, c in self._queue if not (k == "rewind" and c.id == cp.id))
        self._bound("rewind")
        self._queue.append(("rewind", cp))
        done = self._carry_out_rewind(cp, checked, skip)
        return {"checkpoint": None, "path": cp.path, "step": cp.step, "done": done}

    def _sync_for_rewind(self, cp_id: str) -> None:
        """:meth:`_sync` before a rewind: the others not reached, refused here as any refusal is."""
        try:
            self._sync()
        except CheckpointError as e:
            self._events.emit(
                "rewind_error", message=describe_error(e), checkpoint=cp_id, step=self._clock.step
            )
            raise

    def _carry_out_rewind(self, cp: Checkpoint, checked: Any, skip: Any) -> bool:
        """The queued rewind to ``cp``, with its skip, carried out now on every rank (its verdicts
        exchanged in ``_restore``); whether it was, or CheckpointError with every rank's refusal."""
        self._skips.pop(cp.id, None)
        if checked is not None:
            self._skips[cp.id] = (checked, skip)
        before = self.rewinds
        self._refused.pop(cp.id, None)
        self._kick()
        why = self._refused.pop(cp.id, None)
        if why is not None:
            raise CheckpointError(why)
        return self.rewinds > before

    def plane_failed(self) -> None:
        """The control collective failed (a rank died or did not answer in time): the requests that
        wait for it can reach no other rank; each is refused here with the reason (lock held)."""
        why = self.refusal() or "the control collective failed"
        waiting, self.outbox = [*self._queue, *self.outbox], []
        self._queue.clear()
        for kind, cp in waiting:
            self._skips.pop(cp.id, None)
            self._events.emit(
                f"{kind}_error",
                message=f"CheckpointError: {why}; nothing changed",
                checkpoint=cp.id,
                step=self._clock.step,
            )
        self._gate.cond.notify_all()  # a wait() for one gives up on it

    def _agree(self, why: str | None, payload: Any = None) -> Any:
        """Every rank's verdict on the rewind (or disk checkpoint) at hand (None: it can be carried
        out here): carried out on every rank, or refused on every rank with the first refusal (lock
        held). Returns rank 0's ``payload`` (the directory of a disk checkpoint)."""
        plane = self._plane
        if plane.broken:
            raise CheckpointError(f"the control collective failed earlier ({plane.broken}): nothing changed")
        try:
            gathered: list[Any] = [None] * plane.world
            tdist.all_gather_object(gathered, (why, payload), group=plane.group)
            verdicts = [g[0] for g in gathered]
        except Exception as e:
            if self.sync_failed is not None:
                self.sync_failed(e)
            raise CheckpointError(
                f"the ranks could not agree on it ({describe_error(e)}): nothing changed on this rank"
            ) from e
        refused = [(r, v) for r, v in enumerate(verdicts) if v is not None]
        if refused:
            r, v = refused[0]
            raise CheckpointError(f"refused on every rank: rank {r} cannot carry it out: {v}")
        return gathered[0][1]

    def _dist_dir(self, cp: Checkpoint, why: str | None) -> str:
        """Under torch.distributed with ``checkpoint_dir``, every rank at the same boundary: rank 0
        makes ``cp``'s directory, and every rank's verdict is exchanged before the write (a
        collective that one rank must not skip): its path, or CheckpointError on every rank."""
        path = None
        if why is None and self._plane.rank == 0:
            try:
                path = self._disk.prepare(cp.id, cp.step, cp.label)
            except Exception as e:
                why = describe_error(e)
        try:
            return self._agree(why, path)
        except CheckpointError:
            if path is not None:
                shutil.rmtree(path, ignore_errors=True)
            raise

    def _seekable(self) -> bool:
        """Whether a rewind puts the data stream back too (a state registered with ``data=True``)."""
        return bool(self._data_keys)

    def _plan(self, cp: Checkpoint, checked: tuple[Any, ...]) -> tuple[int, int] | None:
        """The window of a rewind to ``cp`` with ``checked`` (from check_skip), or HookError."""
        if self._data is None:
            from ..wire.errors import HookError

            raise HookError(("skip",), "this Inspector keeps no data position")
        position = cp.position if cp.position is not None else self._data.position
        return self._data.plan(position, checked, seekable=self._seekable())

    def _bound(self, kind: str) -> None:
        """Refuse a request of ``kind`` when ``keep`` of them wait already (lock held)."""
        waiting = sum(1 for k, _ in (*self._queue, *self.outbox) if k == kind)
        if waiting >= self.keep:
            raise CheckpointBusy(
                f"{waiting} {kind} requests wait for the next step boundary already (at most "
                f"{self.keep}, the number of checkpoints kept): ask again after it"
            )

    def pending_rewind(self) -> Checkpoint | None:
        """The checkpoint of the first rewind waiting for a boundary, or None."""
        with self._gate.cond:
            return next((cp for kind, cp in (*self._queue, *self.outbox) if kind == "rewind"), None)

    def _find(self, cp_id: Any) -> Checkpoint:
        cp = self._items.get(cp_id) if isinstance(cp_id, str) else None
        if cp is None:
            cp = next(
                (c for kind, c in (*self._queue, *self.outbox) if kind == "checkpoint" and c.id == cp_id),
                None,
            )
        if cp is None:
            raise CheckpointNotFound(cp_id, self.keep)
        return cp

    def _kick(self) -> None:
        """Carry the queue out now where that is safe; else wake whoever will (lock held)."""
        if self._gate.safe_point():
            self._run_queue()
        else:
            self._gate.cond.notify_all()  # a training thread held at a boundary carries it out
            for fn in list(self.on_request):
                try:
                    fn()
                except Exception:  # a waker's bug must not fail the request
                    pass

    def wait(self, cp_id: str, timeout: float) -> bool:
        """Block until checkpoint ``cp_id`` is taken (True) or ``timeout`` s pass (False)."""
        cond = self._gate.cond
        with cond:
            return bool(
                cond.wait_for(
                    lambda: (
                        (cp_id in self._items and self._items[cp_id].step is not None)
                        or not any(c.id == cp_id for _, c in (*self._queue, *self.outbox))
                    ),
                    timeout,
                )
            ) and (cp_id in self._items)

    def cancel(self, cp_id: str) -> None:
        """Forget a checkpoint request not carried out yet (a waiter gave up on it)."""
        with self._gate.cond:
            self._queue = deque((k, c) for k, c in self._queue if not (k == "checkpoint" and c.id == cp_id))
            if self._plane is None or self._plane.rank != 0:
                return
            # rank 0: one still in the outbox has reached no rank; one carried already is every rank's
            self.outbox = [(k, c) for k, c in self.outbox if not (k == "checkpoint" and c.id == cp_id)]

    def discard(self, cp_id: str) -> None:
        """Forget a checkpoint (taken or not): the change it was taken for was refused."""
        self.cancel(cp_id)
        with self._gate.cond:
            self._items.pop(cp_id, None)

    def release(self) -> None:
        """Forget every checkpoint and request (``close()``): their host memory goes with them,
        even while the Inspector object lives on."""
        with self._gate.cond:
            for cp in self._items.values():  # checkpoint writes under way end first (whole or gone)
                if cp.pending is not None:
                    cp.pending.exception()
            self._items.clear()
            self._queue.clear()
            self.outbox.clear()
            self._skips.clear()
            self._scaler_later, self._scaler_restore, self.scaler_pending = [], None, False
            self._gate.cond.notify_all()  # a wait() for a request gives up on it

    @property
    def queued(self) -> bool:
        return bool(self._queue)

    @property
    def holds_changes(self) -> bool:
        """An automatic checkpoint waits for a boundary: hook changes wait for it
        (``StepLifecycle.apply_edits``)."""
        return any(kind == "checkpoint" and cp.auto for kind, cp in self._queue)

    # ------------------------------------------------------------ the safe point
    def service(self, *, owner: bool = False) -> None:
        """Carry queued requests out now, if this is a safe point: the training thread between steps
        (``owner``: the caller owns the training loop and says it is between steps, e.g. the demo's
        thread before its first step), training finished, or held at a boundary on this thread."""
        if not self._queue:
            return
        with self._gate.cond:
            if self._gate.closed or not (owner or self._gate.safe_point()):
                return
            self._run_queue()

    def _run_queue(self) -> None:
        """Carry out the queue (the caller holds the lock, at a safe point)."""
        last: Checkpoint | None = None  # the one taken last in this pass
        while self._queue:
            kind, cp = self._queue.popleft()
            try:
                if kind == "checkpoint":
                    self._take(cp, last)
                    last = cp
                else:
                    last = None
                    self._restore(cp, self._skips.pop(cp.id, None))
            except Exception as e:  # never take training down: report it
                if kind == "rewind":
                    self._refused[cp.id] = str(e) if isinstance(e, CheckpointError) else describe_error(e)
                if kind == "checkpoint" and cp.origin == "auto":
                    self._auto_refused("error", self._clock.step, describe_error(e))
                else:
                    self._events.emit(
                        f"{kind}_error", message=describe_error(e), checkpoint=cp.id, step=self._clock.step
                    )
            else:
                if kind == "checkpoint" and cp.origin == "auto":
                    self._auto_why = self.auto_refused = None  # taken: a later refusal is told again
        self._gate.cond.notify_all()

    # ------------------------------------------------------------ taking
    def _update_to_come(self) -> bool:
        """Whether the attached scaler's ``update()`` for this iteration is still to come: inside
        ``scaler.step()`` (our boundary), its per-optimizer record holds the iteration's inf checks;
        ``update()`` clears it (no device read)."""
        at = self._at
        states = getattr(at.scaler, "_per_optimizer_states", None)
        if at.scaler is None or at.optimizer is None or not isinstance(states, dict):
            return False
        st = states.get(id(at.optimizer))
        return bool(st and st.get("found_inf_per_device"))

    def settle_scaler(self) -> bool:
        """After the scaler's ``update()`` (the next forward, ``finish()``, ``close()``): read the
        scaler state of checkpoints taken inside ``scaler.step()``, and load a rewind's. True when
        the scaler was written."""
        if not self.scaler_pending:
            return False
        with self._gate.cond:
            sc, later, restore = self._at.scaler, self._scaler_later, self._scaler_restore
            self._scaler_later, self._scaler_restore, self.scaler_pending = [], None, False
            if sc is None:
                return False
            if later:
                state = host_copy(sc.state_dict())
                for cp in later:
                    cp.scaler = state
                    cp.bytes += nbytes(state)
            if restore is not None:
                sc.load_state_dict(fresh(restore))
            return restore is not None

    def _take(self, cp: Checkpoint, last: Checkpoint | None = None) -> None:
        """Take ``cp`` now. Requests carried out together at one safe point (``last``: the one
        taken just before, nothing changed since) share one copy of the state: a burst of
        requests costs the training thread one copy, not one each."""
        at, reg = self._at, self._reg
        t0 = time.perf_counter()
        cp.step, cp.time = self._clock.step, time.time()
        dropped: list[str] = []
        if last is not None and last.step == cp.step and last.config_version == reg.version:
            # the stored states are never changed (a rewind loads fresh() copies of them)
            cp.model, cp.optim, cp.scaler = last.model, last.optim, last.scaler
            cp.path, cp.pending = last.path, last.pending
            disk_bytes = last.disk_bytes
            cp.hooks, cp.fns, cp.generators, cp.extra = last.hooks, last.fns, last.generators, last.extra
            cp.zclip = last.zclip
            cp.cadence, cp.nonfinite = last.cadence, last.nonfinite
        else:
            # the size first, from the state_dict()s (no copy): refused, or room made, before copying;
            # on disk (checkpoint_dir) the model's and optimizer's state take no host memory
            model = at.root.state_dict() if at.root is not None else list(at.tensors)
            optim = at.optimizer.state_dict()  # type: ignore[union-attr]
            scaler = at.scaler.state_dict() if at.scaler is not None else None
            size = nbytes([scaler] if self._disk is not None else [model, optim, scaler])
            why = self._over_budget(size)
            path = self._dist_dir(cp, why) if self._disk is not None and self._plane is not None else None
            if why is not None:
                raise CheckpointError(why)
            dropped = self._make_room(size)
            if self._disk is not None:  # the model's and optimizer's state to a DCP directory
                with _no_init_step(at) if at.layout is not None else contextlib.nullcontext():
                    state = live_state(at)  # (FSDP2: this rank's shards)
                cp.path, cp.pending = self._disk.save(cp.id, cp.step, cp.label, state, path=path)
                disk_bytes = nbytes(state)
            else:  # this process's (under FSDP2, this rank's shards)
                cp.model, cp.optim = capture_state(at)
            cp.scaler = host_copy(scaler) if scaler is not None else None
            cp.hooks = tuple(reg.applied)
            cp.fns = {s.id: reg.fns[s.id] for s in cp.hooks if s.id in reg.fns}
            cp.generators = {
                hid: {key: gen.get_state() for key, gen in st.generators.items()}
                for hid, st in self._hooks.states.items()
                if st.generators
            }
            cp.zclip = {
                hid: host_copy(st.zclip.state_dict())
                for hid, st in self._hooks.states.items()
                if st.zclip is not None
            }
            cp.extra = {key: host_copy(save()) for key, (save, _) in self._states.items()}
            clock = self._clock.state_dict()
            cp.cadence = {
                **self._cadence.state_dict(),
                "sampled": clock["sampled"],  # whether the step after cp.step is sampled
                "sampled_count": clock["sampled_count"],
            }
            cp.nonfinite = self._nonfinite.state_dict()
        cp.config_version = reg.version
        cp.position = self._data.position if self._data is not None else None
        if self._update_to_come():
            cp.scaler = None  # read after this iteration's update() (settle_scaler)
            self._scaler_later.append(cp)
            self.scaler_pending = True
        cp.bytes = nbytes(
            [
                cp.model,
                cp.optim,
                cp.scaler,
                list(cp.generators.values()),
                list(cp.zclip.values()),
                list(cp.extra.values()),
            ]
        )
        if cp.path is not None:  # its state's bytes on disk, counted in its size, not in host memory
            cp.disk_bytes = last.disk_bytes if last is not None and last.path == cp.path else disk_bytes
            cp.bytes += cp.disk_bytes
        self._items[cp.id] = cp
        while len(self._items) > self.keep:
            _, old = self._items.popitem(last=False)
            self._forget_dir(old)
        cp.took = time.perf_counter() - t0
        where = (
            f"{len(self._items)} kept, {_size(self.bytes)} in host memory"
            if cp.path is None
            else f"written to {cp.path}; {len(self._items)} kept"
        )
        self._events.emit(
            "checkpoint",
            checkpoint=cp.id,
            step=cp.step,
            label=cp.label,
            auto=cp.auto,
            origin=cp.origin,
            bytes=cp.bytes,
            took=cp.took,
            kept=len(self._items),
            kept_bytes=self.bytes,
            dropped=dropped,
            path=cp.path,
            message=f"checkpoint {cp.id} at step {cp.step}"
            + (f" ({cp.label})" if cp.label else "")
            + (" (automatic)" if cp.origin == "auto" else "")
            + f": {_size(cp.bytes)} in {cp.took * 1000:.0f} ms; {where}"
            + (
                f" (dropped {', '.join(dropped)} to stay within the {_size(self.budget)} budget)"
                if dropped and self.budget is not None
                else ""
            ),
        )
        cp.seq = self._events.seq  # its own event included: it belongs to every branch that starts here

    # ------------------------------------------------------------ restoring
    def _restore(self, cp: Checkpoint, skip: tuple[Any, Any] | None = None) -> None:
        try:
            if cp.dropped is not None:
                raise CheckpointError(f"checkpoint {cp.id} is gone: {cp.dropped}")
            if cp.step is None:
                raise CheckpointError(f"checkpoint {cp.id} was never taken")
            if cp.path is not None:  # on disk: its write ended, the directory still fits (else refused)
                wait_written(cp.path, cp.pending)
                check_dir(self._at, cp.path)
            else:
                check_restorable(self._at, cp)  # all or nothing: refused before anything is changed
            # the skipped window, against the data position now (refused before anything is changed)
            window = self._plan(cp, skip[0]) if skip is not None else None
        except Exception as e:
            if self._plane is None:
                raise
            self._agree(describe_error(e))  # every rank refuses, with the first refusal
            raise
        if self._plane is not None:
            self._agree(None)  # under torch.distributed: carried out on every rank, or on none
        from_step = self._clock.step
        abandoned = from_step > cp.step  # at the checkpoint's own step no step is abandoned
        # the abandoned branch's records go out as its own first; later late ones are dropped
        # (nothing abandoned: the late records of the checkpoint's own step still belong to it)
        self._records.flush_late(from_step)
        self._records.flush_pending()
        self._deferred.drain(wait=True)  # the abandoned steps' deferred checks and records, now
        if abandoned:
            self._records.abandon()
        self._edits.drain(from_step + 1, torch_ok=True)  # edits queued before the rewind
        # the abandoned branch's events: seq_after < seq <= seq_until (none when nothing is abandoned)
        seq_until = self._events.seq
        seq_after = cp.seq if abandoned else seq_until
        self._load(cp)
        self._feed.drop_after(cp.step, (seq_after, seq_until))
        if abandoned:
            for other in [
                c
                for c in self._items.values()
                # (a directory of the loop's own: those taken after its step)
                if (c.step is not None and c.step > cp.step if cp.id == cp.path else c.seq > cp.seq)
            ]:
                # taken on the abandoned branch: not on this one's timeline; a rewind to it that
                # still waits in the queue is refused (above), never carried onto the old branch
                other.dropped = (
                    f"it was taken at step {other.step}, on the steps {cp.step + 1}-{from_step} that "
                    f"the rewind to {cp.id} abandoned"
                )
                del self._items[other.id]
                self._forget_dir(other)
        self.rewinds += 1
        self._events.emit(
            "rewind",
            step=cp.step,
            from_step=from_step,
            checkpoint=cp.id,
            label=cp.label,
            rewinds=self.rewinds,
            seq_after=seq_after,
            seq_until=seq_until,
            config_version=self._reg.version,
            message=f"rewound from step {from_step} to step {cp.step} (checkpoint {cp.id}"
            + (f": {cp.label}" if cp.label else "")
            + (
                f"); steps {cp.step + 1}-{from_step} are kept as a branch of their own"
                if abandoned
                else "); no step abandoned: state and hooks are the checkpoint's again"
            ),
        )
        if self._data is not None:
            position = cp.position if cp.position is not None else self._data.position
            skipped = self._data.rewound(
                cp_id=cp.id,
                cp_step=cp.step,
                cp_position=position,
                from_step=from_step,
                window=window,
                seekable=self._seekable(),
                asked=skip[1] if skip is not None else None,
            )
            if skipped is not None:
                self._events.emit("batches_skipped", **skipped)
        self._gate.publish()

    def adopt(self, cp: Checkpoint) -> None:
        """Start this Inspector's run from another Inspector's checkpoint of the same model (a
        shadow copy): state, step, hooks and noise streams; no event. Call on its training thread."""
        with self._gate.cond:
            if not self._gate.safe_point():
                raise InspectorError("adopt() is for this Inspector's training thread, between steps")
            if cp.step is not None:
                if cp.path is not None:
                    wait_written(cp.path, cp.pending)
                    check_dir(self._at, cp.path)
                else:
                    check_restorable(self._at, cp)
            self._load(cp, exact=False)

    def _load(self, cp: Checkpoint, *, exact: bool = True) -> None:
        """Model, optimizer and scaler state, step counter, hook config (one ``rewind`` change),
        noise streams, cadence, non-finite streak and registered states of ``cp`` (lock held, at a
        safe point). ``exact``: the cadence as it was (a rewind: the same steps are sampled, and
        get histograms, as the first time); else the next step is sampled (a shadow's start)."""
        if cp.step is None:
            raise CheckpointError(f"checkpoint {cp.id} was never taken")
        if self._update_to_come():
            # this iteration's update() would run on the restored scaler: load it after that
            self._restore_state(cp, scaler=False)
            if any(c is cp for c in self._scaler_later):
                self._scaler_restore = None  # taken at this boundary: the update makes its state
            elif cp.scaler is not None:
                self._scaler_restore, self.scaler_pending = cp.scaler, True
        else:
            self._restore_state(cp)
        clock = self._clock
        if exact and cp.cadence:
            self._cadence.load_state_dict(cp.cadence)
            sampling = {"sampled": cp.cadence["sampled"], "sampled_count": cp.cadence["sampled_count"]}
        else:
            self._cadence.restart_at(cp.step + 1)  # the first step of the branch is sampled
            sampling = {"sampled": True, "sampled_count": clock.sampled_count}
        clock.load_state_dict({"step": cp.step, **sampling})  # (the time since the boundary is no step's)
        self._reg.restore(cp.hooks, cp.fns)  # queued: applied by the drain below
        self._edits.drain(cp.step + 1, torch_ok=True)
        set_generators(self._hooks.states, cp.generators)
        set_zclip(self._hooks.states, cp.zclip)
        self._nonfinite.load_state_dict(cp.nonfinite or {"last": None, "streak": 0})
        for key, (_, load) in self._states.items():
            if key in cp.extra:
                load(fresh(cp.extra[key]))

    def _restore_state(self, cp: Checkpoint, *, scaler: bool = True) -> None:
        """The model's, optimizer's (and scaler's) state of ``cp``: from host memory, or read back
        from its DCP directory in place."""
        if cp.path is None:
            restore_state(self._at, cp, scaler=scaler)
            return
        at = self._at
        # under torch.distributed a collective, every rank here (each checked it, then the verdict)
        with _no_init_step(at) if at.layout is not None else contextlib.nullcontext():
            load_dir(at, cp.path, group=self._plane.group if self._plane is not None else None)
        if scaler and cp.scaler is not None and self._at.scaler is not None:
            self._at.scaler.load_state_dict(fresh(cp.scaler))

    # ------------------------------------------------------------ on disk
    def _forget_dir(self, cp: Checkpoint) -> None:
        """Delete ``cp``'s directory once no kept checkpoint shares it (lock held)."""
        if self._disk is None or cp.path is None or any(c.path == cp.path for c in self._items.values()):
            return
        self._disk.forget(cp.path, cp.pending)

    def _write_failed(self, path: str, why: str) -> None:
        """A checkpoint's write failed (DCP's thread; its directory is gone): no longer kept, and
        a ``checkpoint_error`` event says why. Training goes on."""
        with self._gate.cond:
            lost = [c for c in self._items.values() if c.path == path]
            for c in lost:
                del self._items[c.id]
                c.dropped = why
        for c in lost or [None]:
            self._events.emit(
                "checkpoint_error",
                message=f"checkpoint {c.id if c else ''} at step {c.step if c else '?'}: {why}; "
                "not kept, training goes on",
                checkpoint=c.id if c else None,
                step=c.step if c else self._clock.step,
                path=path,
            )

    def rewind_dir(
        self, path: str | os.PathLike[str], step: int | None = None, skip: Any = None
    ) -> dict[str, Any]:
        """Request a rewind to a DCP directory the loop wrote itself (see
        inspector/whatif/dcp_store.py for the layouts read): its model and optimizer state, with
        ``step`` (else the step recorded beside it). Refused, nothing changed, with the reason:
        the directory missing, partial or of another model, the step unknown. Under
        torch.distributed call it on every rank at the same point of the script: every rank checks
        the directory, then the verdicts are exchanged (refused on every rank, or read back on
        every rank with ``dcp.load``). The hook config, noise streams and scaler stay as they are;
        the cadence restarts at the next step."""
        checked = check_skip(skip)
        path = os.fspath(path)
        if step is None:
            step = dir_step(path)
            if step is None:
                raise CheckpointError(
                    f"the step of {path} is unknown: give it (rewind(path, step=N)); no {path}/inspector.json names it"
                )
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step must be a non-negative integer (got {shown(step)})")
        with self._gate.cond:
            if self._gate.closed:
                raise InspectorError("this Inspector is closed")
            self._check()
            if self._plane is None:
                check_dir(self._at, path)  # refused now, before anything is queued
            # (under torch.distributed checked at the boundary, on every rank, then the verdict)
            cp = Checkpoint(path, None, False, time.time(), path=path)  # its id: the path
            cp.step, cp.time = step, time.time()
            reg = self._reg
            cp.hooks = tuple(reg.applied)
            cp.fns = {s.id: reg.fns[s.id] for s in cp.hooks if s.id in reg.fns}
            cp.generators = {
                hid: {key: gen.get_state() for key, gen in st.generators.items()}
                for hid, st in self._hooks.states.items()
                if st.generators
            }
            cp.zclip = {
                hid: host_copy(st.zclip.state_dict())
                for hid, st in self._hooks.states.items()
                if st.zclip is not None
            }
            cp.nonfinite = self._nonfinite.state_dict()
            cp.seq = self._events.seq
            cp.config_version = reg.version
            if self._plane is not None:
                if self._remote():
                    raise CheckpointError(
                        "under torch.distributed rewind(path) is called by the script on every rank "
                        "at the same point (the training thread), never from another thread"
                    )
                return self._dist_rewind_dir(cp, checked, skip)
            if checked is not None:
                self._plan(cp, checked)
            self._bound("rewind")
            if checked is not None:
                self._skips[cp.id] = (checked, skip)
            self._queue.append(("rewind", cp))
            before = self.rewinds
            self._kick()
            return {"checkpoint": None, "path": path, "step": step, "done": self.rewinds > before}

    # ------------------------------------------------------------ reading
    @property
    def bytes(self) -> int:
        """Host memory of the checkpoints kept (a copy shared by several counted once; the state
        of one on disk is not counted)."""
        return sum({(c.path or id(c.model)): c.bytes - c.disk_bytes for c in self._items.values()}.values())

    def get(self, cp_id: str) -> Checkpoint:
        with self._gate.cond:
            return self._find(cp_id)

    def list(self) -> list[dict[str, Any]]:
        """The checkpoints kept, oldest first, then the requested ones not taken yet (under
        torch.distributed, rank 0's waiting for the exchange last)."""
        with self._gate.cond:
            out = [c.info() for c in self._items.values()]
            return out + [c.info() for kind, c in (*self._queue, *self.outbox) if kind == "checkpoint"]

    def summary(self) -> dict[str, Any]:
        """``{"checkpoints": [...], "bytes", "keep", "rewinds", "refused", "every", "budget",
        "auto_refused"}`` (refused: the reason, or None; every: ``checkpoint_every``; budget:
        ``checkpoint_memory`` in bytes; auto_refused: why the last automatic checkpoint was not
        taken, None once one is)."""
        with self._gate.cond:
            return {
                "checkpoints": self.list(),
                "bytes": self.bytes,
                "keep": self.keep,
                "rewinds": self.rewinds,
                "refused": self.refusal(),
                "every": self.every,
                "budget": self.budget,
                "auto_refused": self.auto_refused,
            }


def check_restorable(at: Attached, cp: Checkpoint) -> None:
    """Raise CheckpointError, changing nothing, when ``cp``'s state no longer fits the model or the
    optimizer (a parameter or a parameter group added since, a shape changed): loading it would
    fail half-way, with the model's weights replaced and the optimizer's not."""
    if at.root is not None:
        now = at.root.state_dict()
        missing, extra = sorted(set(now) - set(cp.model)), sorted(set(cp.model) - set(now))
        if missing or extra:
            raise CheckpointError(
                f"checkpoint {cp.id} no longer fits the model: "
                + "; ".join(
                    part
                    for part in (
                        f"{len(missing)} entries added since ({', '.join(missing[:3])})" if missing else "",
                        f"{len(extra)} entries gone ({', '.join(extra[:3])})" if extra else "",
                    )
                    if part
                )
            )
        pairs = [(k, now[k], cp.model[k]) for k in now]
    else:
        if len(cp.model) != len(at.tensors):
            raise CheckpointError(
                f"checkpoint {cp.id} holds {len(cp.model)} tensors, the run {len(at.tensors)}"
            )
        pairs = [(str(i), t, saved) for i, (t, saved) in enumerate(zip(at.tensors, cp.model, strict=True))]
    for key, t, saved in pairs:
        if isinstance(t, Tensor) and isinstance(saved, Tensor | HostShard) and t.shape != saved.shape:
            raise CheckpointError(
                f"checkpoint {cp.id} no longer fits the model: {key} is {tuple(t.shape)}, "
                f"{tuple(saved.shape)} in the checkpoint"
            )
    groups, saved_groups = at.optimizer.param_groups, cp.optim.get("param_groups", [])
    if len(groups) != len(saved_groups):
        raise CheckpointError(
            f"checkpoint {cp.id} no longer fits the optimizer: it has {len(groups)} parameter groups, "
            f"the checkpoint {len(saved_groups)} (a group added or removed since)"
        )
    for i, (g, saved) in enumerate(zip(groups, saved_groups, strict=True)):
        if len(g["params"]) != len(saved.get("params", ())):
            raise CheckpointError(
                f"checkpoint {cp.id} no longer fits the optimizer: its parameter group {i} holds "
                f"{len(g['params'])} parameters, {len(saved.get('params', ()))} in the checkpoint"
            )


def capture_state(at: Attached) -> tuple[Any, Any]:
    """The model's and the optimizer's state, copied to host memory: ``(model, optim)``.

    One process and DDP: ``state_dict()`` of each (every rank its own copy). FSDP2: this rank's
    shards, through ``torch.distributed.checkpoint.state_dict.get_state_dict`` (keyed by the
    parameters' names, the optimizer's state included), each ``DTensor`` kept as a
    :class:`HostShard`. Every rank calls it at the same boundary (the control plane's requests)."""
    if at.layout is not None:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        with _no_init_step(at):
            model, optim = get_state_dict(at.root, at.optimizer)
        return host_copy(model), host_copy(optim)
    if at.root is not None:
        model = host_copy(at.root.state_dict())
    else:
        model = [host_copy(t) for t in at.tensors]
    return model, host_copy(at.optimizer.state_dict())  # type: ignore[union-attr]


def restore_state(at: Attached, cp: Checkpoint, *, scaler: bool = True) -> None:
    """Load ``cp``'s model, optimizer and scaler state into ``at``'s (in place; gradients None).
    The optimizer's first: ``Optimizer.load_state_dict`` checks its input before it changes
    anything, and the model's was checked (:func:`check_restorable`). FSDP2: this rank's shards,
    through ``set_state_dict`` (see :func:`capture_state`)."""
    if at.layout is not None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        with _no_init_step(at):
            set_state_dict(
                at.root, at.optimizer, model_state_dict=fresh(cp.model), optim_state_dict=fresh(cp.optim)
            )
        for t in at.tensors:
            t.grad = None
    else:
        at.optimizer.load_state_dict(fresh(cp.optim))
        with torch.no_grad():
            if at.root is not None:
                at.root.load_state_dict(fresh(cp.model))
            else:
                for t, saved in zip(at.tensors, cp.model, strict=True):
                    t.copy_(saved)
            for t in at.tensors:
                t.grad = None
    if scaler and cp.scaler is not None and at.scaler is not None:
        at.scaler.load_state_dict(fresh(cp.scaler))


class _no_init_step:
    """``get_state_dict``/``set_state_dict`` give an optimizer with no state yet (SGD without
    momentum, a run before its first step) a state by calling its ``step()`` on zero gradients, unless
    a parameter has a gradient: that step would be a step boundary of ours, and would start Adam's
    moments. While one is lent a zero gradient, none is taken (the state is read as it is)."""

    def __init__(self, at: Attached) -> None:
        self._opt = at.optimizer
        self._lent: Tensor | None = None

    def __enter__(self) -> None:
        opt = self._opt
        if opt.state:
            return
        params = [p for g in opt.param_groups for p in g["params"]]
        if any(p.grad is not None for p in params):
            return
        first = next((p for p in params if p.requires_grad), None)
        if first is not None:
            first.grad = torch.zeros_like(first)
            self._lent = first

    def __exit__(self, *exc: Any) -> None:
        if self._lent is not None:
            self._lent.grad = None


def set_generators(states: dict[str, Any], saved: dict[str, dict[Any, Tensor]]) -> None:
    """Give each hook's noise streams the saved generator states (none saved: fresh streams)."""
    for hid, st in states.items():
        gens = {}
        for key, state in saved.get(hid, {}).items():
            gen = torch.Generator(device=key[0])
            gen.set_state(state.clone())
            gens[key] = gen
        st.generators = gens


def set_zclip(states: dict[str, Any], saved: dict[str, dict[str, Any]]) -> None:
    """Give each ``zclip`` hook its saved statistics, on their device (none saved: a fresh start)."""
    for hid, st in states.items():
        st.zclip = ZClipState.from_state_dict(fresh(saved[hid])) if hid in saved else None


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"
