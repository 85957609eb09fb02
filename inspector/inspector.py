"""The Inspector: the public API, a facade over the parts that do the work.

:class:`Inspector` builds its parts, each the one owner of its state, hands each its
collaborators, and delegates to them (docs/ARCHITECTURE.md, "Parts"):

- :class:`~inspector.step.clock.StepClock`: completed steps, a step under way, sampling;
- :class:`~inspector.step.gate.PauseGate` (with :class:`~inspector.step.gate.TrainingState`):
  running, finished or closed, the pause and single steps, the training thread and the safe point;
- :class:`~inspector.step.events.EventLog`: events and their sequence numbers;
- :class:`~inspector.step.lifecycle.StepLifecycle`: the step hooks on the model and the optimizer,
  the ``pre_step`` work, the step boundary, and the one edit rule (``submit()``, ``apply_edits()``);
  under ``torch.distributed`` it builds the :class:`~inspector.step.dist_sync.DistributedSync`,
  and the :class:`~inspector.hooks.amp.ScalerWatch` it is given sees a GradScaler's skips;
- :class:`~inspector.whatif.checkpoints.Checkpoints`: ``checkpoint()`` and ``rewind()``;
- :class:`~inspector.dashboard.Dashboard`: ``serve()``, ``wait()`` and ``show()`` (the only module
  that loads the server);
- :class:`~inspector.wrappers.Attached`: the model, optimizer, scaler, FSDP2 layout and control plane.

What else lives where: the hook registry in :mod:`inspector.hooks.registry`, the applying of edits
in :mod:`inspector.hooks.edits`, the torch hooks on parameters and modules in
:mod:`inspector.hooks.torch_hooks`, the statistics and the snapshot in
:mod:`inspector.stats.step_stats`, NaN/Inf findings and their events in
:mod:`inspector.stats.nonfinite`, the rows exchanged under ``torch.distributed`` in
:mod:`inspector.distributed`, recorded scalars in :mod:`inspector.step.scalars`, and the records'
way to subscribers in :mod:`inspector.feed`. ``close()`` removes every torch hook of ours.

Threads: only the training thread (the one that runs ``optimizer.step()``, or the root
forward) registers or removes torch hooks. Edits from other threads are validated at once
and applied at the next safe point (``StepLifecycle.submit``): by the training thread at its next
root forward or step boundary (at once when it is held by a pause), by the caller itself between
steps when the change registers no torch hook, or at once when training has finished
(docs/ARCHITECTURE.md, "One edit").
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from . import distributed
from .dashboard import Dashboard
from .feed import Feed
from .hooks.amp import ScalerWatch, check_optimizer
from .hooks.edits import Edits
from .hooks.handles import HookHandle
from .hooks.owned import claim, release, unhide
from .hooks.registry import PRESET_FORMAT, Registry
from .hooks.targets import match
from .hooks.torch_hooks import TorchHooks
from .rules import Rules
from .stats.deferred import Deferred
from .stats.flight import DEFAULT_SIZE as DEFAULT_FLIGHT
from .stats.flight import FlightRecorder
from .stats.groups import Groups, check_user_groups
from .stats.histsel import HIST_BINS, HIST_CAP, HistSelection
from .stats.noise_scale import DEFAULT_EMA, NoiseScale, check_noise_options
from .stats.nonfinite import NonfiniteReport
from .stats.optim_state import OptimProbe
from .stats.sharded import backward_sources, layout_of
from .stats.step_stats import StepStats
from .stats.telemetry import Cadence, check_cadence
from .step.clock import StepClock
from .step.events import EventLog
from .step.gate import PauseGate
from .step.lifecycle import StepLifecycle
from .step.scalars import Recorder, check_scalars
from .whatif.checkpoints import DEFAULT_KEEP, Checkpoints, parse_memory
from .whatif.skip import BatchCursor
from .wire.errors import AttachError, CheckpointError, HookError, InspectorError, RewindPending, shown
from .wrappers import Attached, enabled_scaler, is_compiled, named_tensors, param_info, real_optimizer

__all__ = ["Inspector", "Options", "attach", "HIST_CAP", "HIST_BINS"]


def _one_optimizer(optimizer: Any) -> None:
    if isinstance(optimizer, list | tuple):
        raise AttachError(
            "attach() takes one optimizer: its step is the step boundary. For several optimizers (a GAN, "
            "say) attach one Inspector per optimizer, each with the model part that optimizer steps"
        )


@dataclass(frozen=True)
class Options:
    """How an Inspector measures (the options of :func:`attach`, which documents each; checked when
    made). The framework callbacks take the same options."""

    budget: float = 0.03  # our cost as a fraction of the step: sample every k-th step to stay under it
    every: int | None = None  # sample every N-th step instead of budgeting (1: every step)
    hist_every: int = 10  # histograms every this many sampled steps
    per_rank_stats: bool = True  # under DDP: each rank's local gradient norms (a hook per parameter)
    dist_timeout: float = 60.0  # under torch.distributed: seconds a rank waits in our control collective
    checkpoints: int = DEFAULT_KEEP  # checkpoints kept in host memory; 0 turns them off
    checkpoint_every: int | None = None  # an automatic checkpoint every N steps; None: none
    checkpoint_memory: int | str | None = None  # the kept checkpoints' host memory at most ("2GB")
    checkpoint_dir: str | os.PathLike[str] | None = None  # checkpoints' state on disk (DCP), not in memory
    # {parameter glob: group name}, in order (first match wins; the rest is "other"); None: the default
    groups: Mapping[str, str] | None = None
    noise_scale: bool = True  # the gradient noise scale (inspector.stats.noise_scale)
    batch_size: int | None = None  # examples per micro-batch on one rank; None: inferred from the forward
    noise_ema: float = DEFAULT_EMA  # the noise scale's smoothing per sampled step
    # the flight recorder's steps (every tensor's norms, on the device) and spike detection; 0: off
    # (the default: about 50 us a step on the CPU, visible on a tiny model; docs/performance.md)
    flight: int = 0
    optim_state: bool = True  # the optimizer's state and update geometry (inspector.stats.optim_state)

    def __post_init__(self) -> None:
        check_cadence(self.budget, self.every, self.hist_every)
        check_user_groups(self.groups)
        check_noise_options(self.noise_scale, self.batch_size, self.noise_ema)
        if not isinstance(self.optim_state, bool):
            raise AttachError(f"optim_state: True or False (got {self.optim_state!r})")
        if isinstance(self.flight, bool) or not isinstance(self.flight, int) or not 0 <= self.flight <= 65536:
            raise AttachError(
                f"flight: the steps kept, an integer from 0 (off) to 65536 (got {self.flight!r})"
            )
        n = self.checkpoint_every
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise AttachError(f"checkpoint_every: None or a number of steps, at least 1 (got {n!r})")
        try:
            parse_memory(self.checkpoint_memory)
        except ValueError as e:
            raise AttachError(f"checkpoint_memory: {e}") from None


class Inspector:
    """Watches and edits the gradients of one model and optimizer. Create with :func:`attach`.

    A facade: it builds its parts, each the one owner of its state, and delegates to them (see
    docs/ARCHITECTURE.md). The parts get their collaborators here, not the Inspector: only the
    dashboard (the seam that hands its public API to the server) and, as an anchor that reads
    nothing, the lifecycle (whose step hooks on the model keep it alive) hold it.
    """

    def __init__(
        self,
        model: nn.Module | Mapping[str, Tensor],
        optimizer: torch.optim.Optimizer | None = None,
        *,
        scaler: Any = None,
        options: Options | None = None,
    ) -> None:
        opts = options if options is not None else Options()
        _one_optimizer(optimizer)
        optimizer = real_optimizer(optimizer) if optimizer is not None else None
        named, module_objs = named_tensors(model)
        params = [n for n, _ in named]
        tensors = [p for _, p in named]
        layout = layout_of(model, params, tensors)  # FSDP2 (refuses what it cannot handle)
        scaler = enabled_scaler(scaler)
        check_optimizer(optimizer, scaler)
        # under torch.distributed: a control plane shared by every rank (a collective call)
        plane = distributed.ControlPlane(timeout=opts.dist_timeout) if distributed.active() else None
        at = Attached(
            root=model if isinstance(model, nn.Module) else None,
            params=params,
            tensors=tensors,
            modules=module_objs,
            optimizer=optimizer,
            scaler=scaler,
            layout=layout,
            dist=plane,
        )
        self._at = at
        self.params: list[str] = params
        self.modules: list[str] = list(module_objs)
        self.rank = at.rank

        # the parts; the lock is the one of the Inspector's state (the gate's condition holds it)
        self._lock = lock = threading.RLock()
        self._feed = feed = Feed()
        self._clock = clock = StepClock()
        self._gate = gate = PauseGate(lock, clock, feed)
        self._events = events = EventLog(lock, feed)
        self._reg = reg = Registry(
            params,
            self.modules,
            scaler=scaler is not None,
            distributed=plane is not None,
            compiled=is_compiled(model),
            is_script=gate.on_training_thread,
        )
        self._cadence = cadence = Cadence(float(opts.budget), opts.every)
        lifecycle: list[StepLifecycle] = []  # (built below; the hooks' failures go to it, not to self)
        self._groups = groups = Groups(params, check_user_groups(opts.groups))
        self._hooks = hooks = TorchHooks(
            params,
            tensors,
            module_objs,
            is_sampled=lambda: clock.sampled,
            on_failure=lambda spec, param, err: lifecycle[0].hook_failed(spec, param, err),
            scaler=scaler,
            per_rank=plane is not None and opts.per_rank_stats,
            layout=layout,
            group_of=groups.of,
        )
        self._edits = edits = Edits(reg, hooks, feed, events.emit, gate.cond)
        self._stats = stats = StepStats(params, tensors, layout, groups)
        if opts.optim_state:  # the optimizer's state and update geometry (FSDP2: the state only)
            stats.optim = OptimProbe(tensors, groups, optimizer)
        self._nonfinite = nonfinite = NonfiniteReport(params, events.emit)
        self._hist = hist = HistSelection(params, opts.hist_every)
        # device values on their way to the host (NaN/Inf checks, records), under the Inspector's lock
        self._deferred = deferred = Deferred(lock)
        self._records = records = Recorder(feed, lock, deferred)
        # every step's norms on the device, and the spike detector (rank 0 only: see stats/flight.py)
        self._flight: FlightRecorder | None = None
        if opts.flight and at.rank == 0:
            self._flight = FlightRecorder(
                params,
                groups,
                deferred=deferred,
                publish=feed.publish,
                emit=events.emit,
                lock=lock,
                size=opts.flight,
            )
        # batches(): the data position, and the windows a rewind skips (inspector.whatif.skip);
        # while it drops a window's batches, the lifecycle's between_batches (built below) lets a
        # pause hold and requests be carried out there
        self._cursor = cursor = BatchCursor(
            lock, lambda: clock.step + 1, between=lambda: steps.between_batches()
        )
        # checkpoint() and rewind(): inspector.whatif.checkpoints
        self._branches = branches = Checkpoints(
            opts.checkpoints,
            at,
            gate=gate,
            clock=clock,
            events=events,
            reg=reg,
            edits=edits,
            hooks=hooks,
            cadence=cadence,
            nonfinite=nonfinite,
            records=records,
            deferred=deferred,
            feed=feed,
            data=cursor,
            every=opts.checkpoint_every,
            memory=opts.checkpoint_memory,
            directory=opts.checkpoint_dir,
        )
        self._lifecycle = steps = StepLifecycle(
            at,
            lock=lock,
            clock=clock,
            gate=gate,
            events=events,
            feed=feed,
            reg=reg,
            hooks=hooks,
            edits=edits,
            stats=stats,
            nonfinite=nonfinite,
            hist=hist,
            deferred=deferred,
            records=records,
            cadence=cadence,
            scaler=ScalerWatch(scaler),
            branches=branches,
            owner=self,
            flight=self._flight,
            data=cursor,
        )
        lifecycle.append(self._lifecycle)
        self._noise = self._noise_scale(opts, at, groups, events)
        stats.noise = self._noise
        if self._lifecycle.sync is not None:  # the ranks' spread per group too
            self._lifecycle.sync.group_members = lambda: groups.members
        if (
            self._noise is not None
            and self._noise.mode in ("ddp", "fsdp")
            and self._lifecycle.sync is not None
        ):
            self._lifecycle.sync.noise_cols = self._noise.columns  # its values ride in the rows
        self._dashboard = Dashboard(self, gate, lambda: self._lifecycle.apply_edits(torch_ok=True))
        # rules (inspector.rules): their actions call this facade's public methods, at the boundary
        self._rules = Rules(
            {
                "add_hook": self.add_hook,
                "update_hook": self.update_hook,
                "pause": self.pause,
                "checkpoint": lambda label=None: self._branches.checkpoint(label, origin="rule"),
                "rewind": self.rewind,
                "checkpoints": self._branches.list,
                "step": lambda: clock.step,
                "params": params,
                "group_names": lambda: groups.names,
            },
            events.emit,
            rank=at.rank,
            distributed=plane is not None,
        )
        self._lifecycle.rules = self._rules
        records.watch = self._rules  # a rule on a recorded value gets each step's once it arrived
        if self._lifecycle.sync is not None:
            self._lifecycle.sync.rules = self._rules  # rank 0's decisions ride in the exchange

        claim(self, tensors, optimizer)  # refuses a second attach to the same parameters
        self._lifecycle.register()
        if self._noise is not None:
            self._noise.register()

    def _noise_scale(
        self, opts: Options, at: Attached, groups: Groups, events: EventLog
    ) -> NoiseScale | None:
        """The gradient noise scale instrument (inspector.stats.noise_scale), or None when it is off."""
        if not opts.noise_scale:
            return None
        mode: str | None = "accumulation"
        reason = None
        world = 1
        rank_sq = None
        sources = None
        if at.dist is not None:
            if opts.per_rank_stats:
                mode, world = ("fsdp" if at.layout is not None else "ddp"), at.dist.world
                sync = self._lifecycle.sync
                rank_sq = (lambda: sync.noise_mean) if sync is not None else None
                if at.layout is not None and at.root is not None:
                    sources = backward_sources(at.root, at.tensors)
            else:
                mode, reason = None, "under DDP and FSDP2 it needs attach(..., per_rank_stats=True)"
        elif at.layout is not None:
            mode, reason = None, "under FSDP2 it needs the job's process group (torch.distributed)"
        return NoiseScale(
            at.tensors,
            groups,
            root=at.root,
            is_sampled=lambda: self._clock.sampled,
            batch_size=opts.batch_size,
            ema=float(opts.noise_ema),
            mode=mode,
            reason=reason,
            world=world,
            scaler=at.scaler,
            rank_sq=rank_sq,
            sources=sources,
            on_failure=lambda message: events.emit("telemetry_error", message=message),
        )

    @contextlib.contextmanager
    def stood_aside(self) -> Iterator[None]:
        """Every hook of ours off the model and optimizer, and their claim released, for as long as
        the block runs (``inspector.compare`` trains the attached model with Inspectors of its own);
        then all back, this Inspector's state (step, hooks, noise streams, cadence) untouched.
        Between steps only."""
        with self._lock:
            self._check_open()
            if self._clock.under_way:
                raise InspectorError(
                    "compare() on an attached model runs between steps: a step is under way here"
                )
            self._lifecycle.detach()
            self._hooks.detach()
            if self._noise is not None:
                self._noise.close()
            release(self)
        try:
            yield
        finally:
            with self._lock:
                claim(self, self._at.tensors, self._at.optimizer)
                self._lifecycle.register()
                self._hooks.sync()
                if self._noise is not None:
                    self._noise.register()
                self._clock.forget_gap()  # the comparison's time is no step of this run

    # ================================================================= public API
    def _check_open(self) -> None:
        if self._gate.closed:
            raise InspectorError("this Inspector is closed")
        if self._at.dist is not None and self.rank != 0 and not self._gate.on_training_thread():
            raise InspectorError(
                "under torch.distributed, edits from another thread go to rank 0 (which serves "
                f"the dashboard); this is rank {self.rank}"
            )

    @property
    def step(self) -> int:
        """Completed optimizer steps (the number of the last step boundary)."""
        return self._clock.step

    @property
    def groups(self) -> dict[str, Any]:
        """The partition of ``params`` into groups, as plain data (a fresh copy): ``{"source": "tree" |
        "user", "names": [...], "members": [[parameter index, ...], ...], "stacks": [{"name",
        "groups", "blocks", "kinds"}, ...]}``. Each snapshot's ``groups`` aggregates are aligned
        with ``names``; see :mod:`inspector.stats.groups` for how the partition is made."""
        return self._groups.describe()

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called (every hook of ours is then gone)."""
        return self._gate.closed

    @property
    def config_version(self) -> int:
        """How many hook changes have been applied."""
        return self._reg.version

    @property
    def state(self) -> dict[str, Any]:
        """``{"state": "running" | "paused" | "finished", "step": N, "held": bool}``.

        ``held`` is true once a pause has taken hold: the training thread waits at the boundary
        of step N (``state`` says "paused" as soon as it is asked for, while a step may still run).
        """
        return self._gate.state()

    @property
    def cost(self) -> dict[str, Any]:
        """The inspector's own measured cost: ``{"overhead": fraction of the wall-clock step,
        "sampled_every": k, "step_s", "sampled_s", "unsampled_s"}`` (recent averages, seconds) and
        ``"sampled_steps"``: how many steps were chosen for the full statistics so far, the next
        one included when it is."""
        return {
            "overhead": self._cadence.overhead,
            "sampled_every": self._cadence.k,
            **self._cadence.costs,
            "sampled_steps": self._clock.sampled_count,
        }

    @property
    def memory(self) -> dict[str, int]:
        """Host and device bytes the inspector keeps between steps: ``{"update_sample"`` (the
        parameters' sample for the update ratio, on their device), ``"snapshots"`` (the ring of
        recent snapshots, accounted from their lengths: at least what it holds, at most 1.6 times it), ``"checkpoints"`` (host memory), ``"flight"`` (the flight
        recorder's ring), ``"optim_sample"`` (the previous sampled gradient's sample, on the
        gradients' device: :mod:`inspector.stats.optim_state`)``}``."""
        return {
            "update_sample": self._stats.resident_bytes,
            "snapshots": self._feed.ring_bytes,
            "checkpoints": self._branches.bytes,
            "flight": self._flight.bytes if self._flight is not None else 0,
            "optim_sample": self._stats.optim.resident_bytes if self._stats.optim is not None else 0,
        }

    def param_info(self) -> list[dict[str, Any]]:
        """``[{"name", "shape", "numel", "module", "requires_grad", "dtype"}]`` in ``params`` order."""
        return param_info(self.params, self._at.tensors, modules=self._at.root is not None)

    def match_targets(self, glob: str, point: str = "pre_step") -> list[str]:
        """The names ``glob`` matches at ``point`` (module names for "module", else parameter names)."""
        if point not in ("pre_step", "post_accumulate", "module"):
            raise HookError(("point",), f"must be pre_step, post_accumulate or module (got {shown(point)})")
        if not isinstance(glob, str):
            raise HookError(("glob",), f"must be a string (got {shown(glob)})")
        return match(self.modules if point == "module" else self.params, glob)

    # ----------------------------------------------------------------- hooks
    def add_hook(
        self,
        kind: str | Callable[[str, Tensor], Any],
        target: str = "*",
        point: str | None = None,
        *,
        enabled: bool = True,
        params: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> HookHandle:
        """Add a hook; returns its handle. ``kind`` is a kind name or your own callable.

        The kind's parameters come as keywords (``add_hook("clip_value", threshold=1.0)``) or as a
        ``params`` mapping (``add_hook("clip_value", params={"threshold": 1.0})``, for parameters
        read from elsewhere: any key is taken as a parameter, even one named like an argument here).

        A callable becomes kind ``python``: it is called as ``fn(name, param) -> None`` for
        each target, and edits ``param.grad`` in place (at ``pre_step`` by default, or at
        ``post_accumulate`` once per backward).

        Raises:
            HookError: invalid kind, target, point or parameter (or one given both ways); nothing changes.
            RewindPending: a rewind waits for the next step boundary (it would put its checkpoint's
                hooks back over this one); the same holds for every other hook change.
        """
        fn = None
        if callable(kind):
            fn, kind = kind, "python"
        if params is not None and not isinstance(params, Mapping):
            raise HookError(
                ("params",), f"must be a mapping of parameter names to values (got {shown(params)})"
            )
        both = sorted(set(params or ()) & set(kwargs))
        if both:
            raise HookError(("params", both[0]), "given both in params and as a keyword")
        params = {**(params or {}), **kwargs}
        with self._lock:
            self._check_open()
            self._refuse_while_rewinding()
            spec, change = self._reg.add(kind, target, point, params, enabled, fn=fn)
            self._lifecycle.submit(change)
            return HookHandle(self, spec.id, accepted=spec.to_dict())

    def update_hook(
        self,
        hook_id: str,
        *,
        params: Mapping[str, Any] | None = None,
        enabled: bool | None = None,
        target: str | None = None,
        position: int | None = None,
    ) -> dict[str, Any]:
        """Change a hook as one edit: ``params`` are merged (only the given keys change)."""
        with self._lock:
            self._check_open()
            self._refuse_while_rewinding()
            _, change = self._reg.update(
                hook_id, params=params, enabled=enabled, target=target, position=position
            )
            if change is not None:
                self._lifecycle.submit(change)
            return self.hook_spec(hook_id)

    def remove_hook(self, hook_id: str, *, missing_ok: bool = False) -> None:
        with self._lock:
            if self._gate.closed:
                return
            self._refuse_while_rewinding()
            try:
                change = self._reg.remove(hook_id)
            except KeyError:
                if missing_ok:
                    return
                raise
            self._lifecycle.submit(change)

    def _refuse_while_rewinding(self) -> None:
        """A hook change while a rewind waits for its boundary would be undone by it, unseen:
        refused (lock held). See inspector/whatif/checkpoints.py."""
        cp = self._branches.pending_rewind()
        if cp is not None:
            raise RewindPending(cp.id, cp.step)

    def hook(self, hook_id: str) -> HookHandle:
        """The handle of an existing hook (raises HookNotFound)."""
        with self._lock:
            self._reg.get(hook_id)
            return HookHandle(self, hook_id)

    def hook_spec(self, hook_id: str) -> dict[str, Any]:
        with self._lock:
            for s in self._reg.view():
                if s.id == hook_id:
                    return s.to_dict()
            self._reg.get(hook_id)  # raises HookNotFound
            raise AssertionError("unreachable")

    def hooks(self) -> list[dict[str, Any]]:
        """The requested config as dicts, in position order (``applied_step`` None while pending)."""
        with self._lock:
            return [s.to_dict() for s in self._reg.view()]

    def export_hooks(self) -> dict[str, Any]:
        """A preset of the current hooks (no ids), for ``import_hooks``. Python hooks are left out."""
        with self._lock:
            hooks = [s.preset() for s in self._reg.requested if s.kind != "python"]
        return {"format": PRESET_FORMAT, "version": 1, "hooks": hooks}

    def import_hooks(self, preset: Mapping[str, Any] | list[Any]) -> list[dict[str, Any]]:
        """Replace every hook with the preset's, as one change. Validated whole first."""
        with self._lock:
            self._check_open()
            self._refuse_while_rewinding()
            change = self._reg.import_(preset)
            self._lifecycle.submit(change)
            return self.hooks()

    # ----------------------------------------------------------------- data
    def record(self, **scalars: Any) -> None:
        """Record scalars (floats or one-element tensors, read on the host without a sync of their step).

        While a step is under way (from the model's forward, or for a dict of tensors its backward,
        until ``optimizer.step()``) they attach to that step; after ``step()`` and before the next
        forward (backward), to the step just completed. ``begin_step()`` marks a step under way by
        hand. Every step's records reach the ``scalars`` stream: a sampled step's with its snapshot,
        an unsampled step's a few steps later (read together with later ones; a step or two later
        while a rule reads the loss). Several records of one key in one step are averaged.
        """
        vals = check_scalars(scalars)
        with self._lock:
            late = not self._clock.under_way and self._clock.step > 0
            self._records.add(vals, late=late)

    def snapshots(self, since: int | None = None) -> list[dict[str, Any]]:
        """Snapshots still in the ring buffer with ``step > since``, as wire dicts."""
        return [s.to_dict() for s in self._feed.snapshots_since(since)]

    def latest(self) -> dict[str, Any] | None:
        snap = self._feed.latest()
        return snap.to_dict() if snap is not None else None

    def events(self, since: int | None = None) -> list[dict[str, Any]]:
        """Events with ``seq > since``."""
        return self._feed.events_since(since)

    def subscribe(
        self, callback: Callable[[str, Any], None], *, lossless: bool = False
    ) -> Callable[[], None]:
        """Call ``callback(kind, payload)`` for every record, off the training thread.

        ``kind`` is ``"snapshot"`` (payload: the snapshot's wire dict, shared by every consumer:
        read-only), ``"scalars"`` (``{"step", "loss", "scalars"}``), ``"hooks"``
        (``{"config_version", "hooks"}``), ``"event"`` (an event dict), ``"flight"`` (a flight
        recorder dump: see :meth:`flight_recorder`) or ``"training"``
        (``{"state", "step", "held"}``: after a pause, resume or single step, when a pause
        takes hold, and once when training ends: ``finish()``, ``wait()`` or ``close()``).
        Errors in the callback are caught and counted. Hooks and events always
        arrive; snapshots and scalars are dropped for a callback more than 256 of them behind,
        unless ``lossless`` (then each arrives, late: keep such a callback quick). Returns a
        function that unsubscribes.
        """
        return self._feed.subscribe(callback, lossless=lossless)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every record published so far has been handed to the subscribers (the
        server's history among them); False when ``timeout`` seconds passed first."""
        return self._feed.flush(timeout)

    def set_spike_detection(
        self,
        *,
        enabled: bool | None = None,
        z: float | None = None,
        warmup: int | None = None,
        alpha: float | None = None,
        cooldown: int | None = None,
    ) -> dict[str, Any]:
        """Change the spike detector's settings (those given; all or nothing) and return them all.

        A ``spike`` event is a robust z-score above ``z`` (default 6) of the loss, the global
        gradient norm or a group's norm against its own EMA (weight ``alpha``, default 0.02) of
        log-norms, once the signal has seen ``warmup`` steps (default 50); at most one per signal
        per ``cooldown`` steps (default 50). See docs/instruments.md, "Spikes and the flight recorder".

        Raises:
            HookError: a bad value (its ``loc`` names the field); nothing is changed.
            InspectorError: the recorder and the detector are off (``attach(..., flight=N)`` turns
                them on), or a rank other than 0.
        """
        if self._flight is None:
            raise InspectorError(
                f"spike detection is off: attach(..., flight={DEFAULT_FLIGHT}) turns it on (rank 0 only)"
            )
        change = {"enabled": enabled, "z": z, "warmup": warmup, "alpha": alpha, "cooldown": cooldown}
        return self._flight.configure(**change)

    @property
    def spike_detection(self) -> dict[str, Any] | None:
        """The spike detector's settings (None when the flight recorder is off)."""
        return self._flight.settings.to_dict() if self._flight is not None else None

    def flight_recorder(self) -> dict[str, Any]:
        """Read the flight recorder now (one device-to-host transfer): every tensor's gradient norm
        (raw and final), the loss and the NaN/Inf flag of each of the last ``flight`` steps, oldest
        first: ``{"reason": "request", "step", "size", "bytes", "params", "groups", "rows": [{"step",
        "loss", "nonfinite", "norm_raw", "norm", "groups_raw", "raw", "final"}, ...]}`` (a
        non-finite value reads "nan"/"inf", a parameter without a gradient None). The dump is also
        published (the dashboard stores and shows it).

        Raises:
            InspectorError: the recorder is off (``attach(..., flight=N)`` turns it on), or a rank
                other than 0.
        """
        if self._flight is None:
            raise InspectorError(
                f"the flight recorder is off: attach(..., flight={DEFAULT_FLIGHT}) turns it on (rank 0 only)"
            )
        return self._flight.read_now()

    def add_event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Record and broadcast an event (used by the server: ``server_error``, ``history_paused``...)."""
        return self._events.emit(kind, **fields)

    def set_hist_params(self, names: list[str]) -> None:
        """Parameters that get histograms (with the clients' subscriptions; capped at 8)."""
        self.set_hist_subscription("", names)

    def set_hist_subscription(self, key: str, names: list[str]) -> None:
        """Histogram parameters wanted by one consumer (``key``); ``[]`` drops it."""
        unknown = [n for n in names if n not in self.params]
        if unknown:
            raise HookError(("hist",), f"unknown parameter {shown(unknown[0])}")
        with self._lock:
            self._hist.set(key, names)

    @property
    def hist_params(self) -> list[str]:
        """The capped union of histogram parameters, in the order they were asked for."""
        with self._lock:
            return self._hist.names

    # ----------------------------------------------------------------- rules (inspector.rules)
    def add_rule(self, rule: Mapping[str, Any] | None = None, /, **fields: Any) -> dict[str, Any]:
        """Add a rule "when SIGNAL OP THRESHOLD [for K steps] then ACTION", evaluated at every step
        boundary from values already on the host (see inspector/rules.py and docs/rules-and-agents.md): ``insp.add_rule(signal="nonfinite", op=">", threshold=0,
        action="rewind_skip")``. Returns the rule with its id (``"r1"``...) and state.

        Raises:
            HookError: a bad field (its ``loc`` names it); nothing is changed.
        """
        with self._lock:
            self._check_open()
            return self._rules.add({**(rule or {}), **fields})

    def update_rule(
        self, rule_id: str, change: Mapping[str, Any] | None = None, /, **fields: Any
    ) -> dict[str, Any]:
        """Change some fields of a rule (``enabled=True`` also clears its failures): given as
        ``change`` (a mapping: any key is checked, none taken for an argument) or as keywords.

        Raises:
            HookError: no such rule, or a bad field; nothing is changed.
        """
        with self._lock:
            return self._rules.update(rule_id, {**(change or {}), **fields})

    def remove_rule(self, rule_id: str) -> None:
        """Remove a rule. Raises HookError when there is none with that id."""
        with self._lock:
            self._rules.remove(rule_id)

    @property
    def rules(self) -> list[dict[str, Any]]:
        """The rules, each with its definition and ``state`` (streak, fired, failures, last firing)."""
        with self._lock:
            return self._rules.list()

    def export_rules(self) -> dict[str, Any]:
        """The rules as a preset ``{"rules": [...]}`` (for ``load_rules``, ``attach(rules=...)``)."""
        with self._lock:
            return self._rules.export()

    def save_rules(self, path: str | os.PathLike[str]) -> None:
        """Write the rules to a JSON file (``export_rules()``)."""
        data = self.export_rules()
        Rules.write(path, data)

    def load_rules(self, preset: Any) -> list[dict[str, Any]]:
        """Add the rules of a preset: its name (``"safe overnight"``, ``"clip on spike"``), a path
        to a JSON file, ``{"rules": [...]}`` or a list of rules. All or nothing.

        Raises:
            HookError: a bad rule (``loc`` starts with ``("rules", index)``) or an unreadable file.
        """
        with self._lock:
            self._check_open()
            return self._rules.load(preset)

    def set_rule_handler(self, action: str, fn: Callable[[dict[str, Any]], Any] | None) -> None:
        """What an action provided by the caller does (the dashboard registers ``end_shadow``):
        ``fn(args)`` runs on the training thread at the boundary where a rule fires; what it
        returns is the firing's ``result``, what it raises its ``rule_failed`` reason."""
        with self._lock:
            self._rules.set_handler(action, fn)

    # ----------------------------------------------------------------- control
    def pause(self) -> dict[str, Any]:
        """Hold the training thread at the next step boundary."""
        return self._gate.pause()

    def resume(self) -> dict[str, Any]:
        return self._gate.resume()

    def step_once(self) -> dict[str, Any]:
        """Let exactly one more step run, then hold at its boundary."""
        return self._gate.step_once()

    # ----------------------------------------------------------------- loops that need telling
    def begin_step(self) -> None:
        """Mark a step as under way, as the root module's forward pre-hook does.

        Only needed in loops that never call the attached root module itself (they call a
        submodule): records made after this attach to the coming step, and edits that register
        torch hooks are applied now, before the backward.
        """
        self._lifecycle.begin_step()

    def mark_step(self) -> None:
        """The step boundary for loops without a torch optimizer.

        Call it after ``backward()`` and **before** your own update: it runs the ``pre_step`` hooks
        on the gradients (so the update reads what they made), takes the statistics and publishes
        the snapshot. Called after the update instead, the hooks would edit gradients nobody reads
        while the page shows them applied. ``update_ratio`` is null in such a loop: the update
        happens after the boundary, where we cannot see it.

        Your update must skip a parameter whose gradient is None, as torch's optimizers do:
        ``freeze`` sets its targets' gradients to None, and ``nan_guard`` ``skip`` every gradient
        of the step.

            for x, y in data:
                loss = loss_fn(model(x), y)
                loss.backward()
                insp.mark_step()                # hooks, statistics, snapshot
                with torch.no_grad():
                    for p in params:
                        if p.grad is not None:  # None: frozen, or the step skipped
                            p -= lr * p.grad    # your update sees the hooks' edits
                        p.grad = None
        """
        self._lifecycle.mark_step()

    def expect_last_step(self, step: int) -> None:
        """Say that the run ends with step ``step`` (optimizer steps since ``attach``), so that step is
        sampled: a run's final state is always shown, whatever the cadence. A loop that knows its
        length (the framework callbacks do) calls it before training; a step that was not sampled
        cannot be measured afterwards (its gradients are gone or edited by then).

        Raises:
            HookError: ``step`` is not a positive integer.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise HookError(("step",), f"must be a positive integer (got {shown(step)})")
        self._cadence.last_step = step

    def finish(self) -> None:
        """Training is over (state ``finished``); edits from other threads apply at once from now.

        ``wait()`` does this and then blocks; call ``finish()`` to keep serving without blocking.
        A last iteration that the scaler skipped is reported now (no forward comes after it).
        """
        self._lifecycle.finish()

    def forget_gap(self) -> None:
        """The time from now to the next step boundary is no step's (for a loop that runs
        something else between two steps, a benchmark its other variants): the cadence, which
        keeps the inspector's cost within ``budget`` of the step's wall time, does not count it."""
        self._clock.forget_gap()

    # ----------------------------------------------------------------- checkpoints
    def checkpoint(self, label: str | None = None) -> str:
        """Save the model's, the optimizer's (and scaler's) and the inspector's state to host memory.

        Taken at the next step boundary, or at once when called from the training thread between
        steps, while training is held at a boundary (paused), or after training finished. Only the
        newest ``checkpoints`` (an ``attach`` option, default 3) are kept, within
        ``checkpoint_memory``; ``insp.checkpoints.list()`` lists them. Under torch.distributed
        call it on every rank: every rank takes its own (DDP: its state_dict; FSDP2: its shards) at
        the same boundary, with the same id (docs/distributed.md).

        Returns:
            The checkpoint's id (``"c1"``, ``"c2"``, ...), for :meth:`rewind`.

        Raises:
            CheckpointError: checkpoints cannot be right here (the message says why: without a
                torch optimizer, ``checkpoints=0``, the control collective failed ...), or one would not fit ``checkpoint_memory`` alone (the
                message names the budget and the sizes).
        """
        return self._branches.checkpoint(label, origin="loop")

    def rewind(
        self, checkpoint: str | os.PathLike[str], skip: Any = None, *, step: int | None = None
    ) -> dict[str, Any]:
        """Go back to a checkpoint: state, step counter and hook config become the checkpoint's.

        Carried out by the training thread at the next step boundary (at once from the training
        thread between steps, or while held at a boundary). Your data loader goes on: the next
        batches are not those that followed the checkpoint the first time. Subscribers get a
        ``rewind`` event (the server keeps the abandoned steps as a branch run of their own).
        Under torch.distributed call it on every rank: it is carried out on every rank at the same
        boundary, or refused on every rank (``CheckpointError`` naming the first rank that cannot,
        a ``rewind_error`` event on each), nothing changed.

        Or to a checkpoint the loop wrote itself: ``checkpoint`` a ``torch.distributed.checkpoint``
        directory (a ``pathlib.Path``, or a string other than an id ``c1``, ``c2`` ...) of
        ``{"model": model.state_dict(), "optimizer": optimizer.state_dict()}`` (the layouts read:
        inspector/whatif/dcp_store.py), ``step`` the step it was written at (else the one that
        ``attach(..., checkpoint_dir=...)`` recorded beside it). Its model and optimizer state are
        read back in place; the hook config, noise streams and scaler stay as they are. Checked
        before anything changes: a directory missing, partial (no ``.metadata``, a data file
        missing or short) or of another model (keys, shapes, parameter groups) is refused.

        Args:
            checkpoint: the checkpoint's id, or a DCP directory.
            skip: batches the new branch does not receive, by their index in
                :meth:`batches` (see inspector/whatif/skip.py): ``"since_checkpoint"`` (those
                received since the checkpoint, up to the incident), ``N`` (the N batches from the
                checkpoint's data position; those not received yet are drawn and dropped) or
                ``(first, last)``. Recorded as a ``batches_skipped`` event. None: no skip.

        Returns:
            ``{"checkpoint", "step", "done"}``: ``done`` is true when it was carried out already.

        Raises:
            CheckpointNotFound: no such checkpoint kept. CheckpointError: refused (see checkpoint();
                a directory: missing, partial, of another model, its step unknown).
            HookError: ``skip`` cannot be honoured (``loc`` ``("skip",)``, the reason); nothing changed.
        """
        if isinstance(checkpoint, os.PathLike) or (
            isinstance(checkpoint, str) and re.fullmatch(r"c\d+", checkpoint) is None
        ):
            return self._branches.rewind_dir(checkpoint, step, skip)
        if step is not None:
            raise CheckpointError("step= is for a directory: a checkpoint's step is its own")
        return self._branches.rewind(checkpoint, skip)

    def batches(self, iterable: Any) -> Iterator[Any]:
        """Iterate ``iterable`` (a DataLoader, any iterable), counting its batches, so that a
        rewind can skip some: ``for batch in insp.batches(loader): ...``, once per epoch.

        Each batch gets the next index in the data order (from 0, across epochs); a checkpoint
        records the index of the next batch; ``rewind(cp, skip=...)`` names a window of indices the
        loop does not receive again (those not yet received are drawn and dropped here). Reads no
        tensor. See inspector/whatif/skip.py.

        Raises:
            TypeError: ``iterable`` is not iterable.
        """
        return self._cursor.wrap(iterable)

    def take_batch(self) -> bool:
        """For a loop whose batches a trainer draws (the Lightning and Hugging Face callbacks call
        it): count one batch the trainer handed out (per micro-batch), as :meth:`batches` does.
        True when it falls in a window a rewind skips: the caller must let it have no effect (the
        trainer drew it already); a step whose batches were all dropped makes no update (every
        gradient of the optimizer is set to None at the step, a ``step_skipped`` event with reason
        ``batches_skipped``). Reads no tensor. See inspector/whatif/skip.py."""
        return self._cursor.take()

    @property
    def data_position(self) -> dict[str, Any]:
        """``{"position", "used", "epochs", "dropped", "pending", "windows"}``: the index of the next
        batch of :meth:`batches`, the batches dropped so far, the window still to drop, the
        windows skipped (newest 100)."""
        return self._cursor.state()

    @property
    def checkpoints(self) -> Checkpoints:
        """The checkpoints: ``.list()``, ``.summary()``, ``.bytes``, ``.keep``, ``.add_state(...)``."""
        return self._branches

    # ----------------------------------------------------------------- the dashboard
    def serve(
        self,
        host: str = "127.0.0.1",
        port: int | None = None,
        token: str | None = None,
        read_only: bool = False,
        db: str | os.PathLike[str] | bool | None = None,
        *,
        frame_ancestors: Sequence[str] = (),
    ) -> str | None:
        """Serve the dashboard from a background thread of this process; returns its URL.

        Loads the ``server`` package shipped with ``inspector`` (even when the working
        directory has a ``server.py`` of its own). Under ``torch.distributed`` only rank 0
        serves; on the other ranks this returns None.

        Args:
            host: bind address; anything but loopback requires a token (generated when None and
                printed once in the returned URL).
            port: TCP port. None (the default): 8000, or when that is taken (a second run on the
                same box) the next free one of the 50 after it, printed as Jupyter does; an explicit
                port that is taken raises ``PortInUse``; 0 picks any free one.
            token: the access token.
            read_only: serve the dashboard and the stream, refuse every command (403).
            db: the history file: None for ``./gradient-inspector.sqlite``, a path for that
                file, False for no history on disk.
            frame_ancestors: origins whose pages may show the dashboard in a frame, e.g.
                ``["https://hub.example.com"]``; none by default (no other page can frame it).
                :meth:`show` allows a notebook's own.
        """
        self._check_open()
        return self._dashboard.serve(
            host=host, port=port, token=token, read_only=read_only, db=db, frame_ancestors=frame_ancestors
        )

    @property
    def url(self) -> str | None:
        """The dashboard's URL while it is served from this process (``serve()``), else None."""
        return self._dashboard.url

    def wait(self) -> None:
        """Keep serving after training ended, until Ctrl-C; edits apply at once meanwhile.

        Prints where it serves and how to stop it (a warning when nothing is served: then it
        only holds the process until Ctrl-C). Returns once ``close()`` has finished.
        """
        self._dashboard.wait()

    def show(self, height: int = 720, *, frame_ancestors: Sequence[str] = ()) -> Any:
        """The dashboard inline in a notebook (an iframe; served first if need be), which it lets
        frame it: loopback pages and VS Code's webviews, and ``frame_ancestors`` (your notebook
        server's origin when it is not on loopback, e.g. ``["https://hub.example.com"]``).
        See inspector/notebook.py."""
        return self._dashboard.show(height, frame_ancestors=frame_ancestors)

    def _repr_html_(self) -> str:  # a notebook's display: a link to the dashboard (inspector/notebook.py)
        return self._dashboard.status_html()

    def requested_config(self) -> tuple[int, list[dict[str, Any]]]:
        """``(config_version, hooks)`` of the requested hook configuration, read together: the
        hooks as ``hooks()`` lists them, and the ``config_version`` they have once every pending
        change is applied (the applied count plus the changes pending). The server records it
        before it acknowledges a change, so the change outlives a crash right after the reply."""
        with self._lock:
            return self._reg.version + len(self._reg.pending), [s.to_dict() for s in self._reg.view()]

    # ----------------------------------------------------------------- closing
    def close(self) -> None:
        """Remove every hook of ours and stop the server; idempotent. A call while another thread
        is closing returns once that close has finished (so ``wait()`` never returns early)."""
        closing, ended = self._gate.begin_close()
        if not closing:
            return
        if ended:
            self._gate.publish()  # training is over: subscribers learn it once, before the feed closes
        lifecycle = self._lifecycle
        lifecycle.check_scaler_skip()  # the last iteration, when the scaler skipped it
        release(self)
        try:
            lifecycle.send_last()
        except Exception as e:  # the last late records are lost, but close() must finish: say so
            warnings.warn(
                f"inspector: the last step's late records could not be sent ({shown(e)})",
                RuntimeWarning,
                stacklevel=2,
            )
        lifecycle.detach()
        self._hooks.remove_all()
        if self._noise is not None:
            self._noise.close()
        if self._at.root is not None:
            for m in self._at.root.modules():
                unhide(m)
        self._feed.flush()  # deliver the last records to the server (and its history) before it stops
        self._dashboard.stop()
        self._feed.close()
        self._reg.fns.clear()
        self._stats.close()
        self._branches.release()  # the checkpoints' host memory (a full copy of the state each)
        self._gate.end_close()

    def __enter__(self) -> Inspector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Inspector {len(self.params)} params, step {self._clock.step}, {len(self._reg.requested)} hooks>"


def attach(
    model: nn.Module | Mapping[str, Tensor],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    scaler: Any = None,
    budget: float = 0.03,
    every: int | None = None,
    hist_every: int = 10,
    per_rank_stats: bool = True,
    dist_timeout: float = 60.0,
    checkpoints: int = DEFAULT_KEEP,
    checkpoint_every: int | None = None,
    checkpoint_memory: int | str | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    groups: Mapping[str, str] | None = None,
    noise_scale: bool = True,
    batch_size: int | None = None,
    noise_ema: float = DEFAULT_EMA,
    flight: int = 0,
    optim_state: bool = True,
    rules: Any = None,
) -> Inspector:
    """Attach an inspector to ``model`` (an ``nn.Module`` or ``{name: leaf tensor}``).

    Args:
        model: what to watch; wrapper prefixes (DDP's ``module.``, ``torch.compile``'s
            ``_orig_mod.``) are stripped from names.
        optimizer: its ``step()`` is the step boundary. Without one, call ``insp.mark_step()``.
        scaler: a ``torch.amp.GradScaler``: statistics are then of unscaled gradients, skipped
            steps are reported, and modifying ``post_accumulate`` hooks are refused.
        budget: the inspector's own cost as a fraction of the step; the full statistics are
            sampled every k-th step to stay under it (hooks and NaN/Inf checks run every step).
        every: sample every N-th step instead of budgeting (``every=1``: every step).
        hist_every: histograms every this many sampled steps.
        per_rank_stats: under DDP, measure each rank's local (pre-all-reduce) gradient norms with
            a post-accumulate hook on every parameter: the snapshot's ``ranks`` spread, and the
            rank named in NaN/Inf events. Off saves that hook's cost (see bench/ddp_overhead.py).
        dist_timeout: under ``torch.distributed``, seconds a rank waits in the inspector's
            control collective before it gives up coordinating (a peer raised or exited).
        checkpoints: how many checkpoints (``insp.checkpoint()``, ``checkpoint_every``'s, and the
            dashboard's automatic one before each hook change) are kept in host memory, the
            newest; 0 turns them off.
        checkpoint_every: an automatic checkpoint at the boundary of every step whose number is
            a multiple of N (None, the default: none). See inspector/whatif/checkpoints.py.
        checkpoint_memory: the host memory the kept checkpoints may hold, per process: bytes
            (int) or a size such as ``"2GB"`` or ``"512MiB"``; the oldest are dropped to make
            room, and one that does not fit alone is refused with the reason. None: no bound.
        checkpoint_dir: keep each checkpoint's model and optimizer state on disk instead: one
            ``torch.distributed.checkpoint`` directory per checkpoint under this path, written
            by ``async_save`` (the step waits for the copy to host memory only; under
            torch.distributed every rank writes its part with ``dcp.save``), the newest
            ``checkpoints`` kept, read back in place by a rewind (inspector/whatif/dcp_store.py).
            A write that fails (a full disk) is a ``checkpoint_error`` event; training goes on.
        groups: how the parameters are grouped for the group views and each snapshot's group
            aggregates: ``{"glob": "group name", ...}``, in order; a parameter goes to the first
            glob that matches its name, the others to the group ``"other"``. None (default):
            groups from the model's structure, at most 60 (``insp.groups`` shows them).
        noise_scale: measure the gradient noise scale ``B_simple`` (each snapshot's ``noise_scale``),
            from the per-rank gradients under DDP and FSDP2 or the micro-batches of gradient accumulation
            (see inspector/stats/noise_scale.py); False turns it off (the field is then None).
        batch_size: examples per micro-batch on one rank (every micro-batch), for the noise scale;
            None (default): the leading dimension of the model's first tensor argument at each
            forward (micro-batches of uneven sizes: see inspector/stats/noise_scale.py).
        noise_ema: the noise scale's smoothing per sampled step, in [0, 1) (default 0.95: about 20
            sampled steps).
        flight: the flight recorder's steps (0, the default: off; 256 is a good size): every
            tensor's raw and final gradient norm, the loss and the NaN/Inf flag of each of the
            last ``flight`` steps, kept on the device (``flight x (2 x tensors + 1) x 4`` bytes, each
            row rounded up to 512 on a GPU) and read on a spike, a NaN/Inf or ``insp.flight_recorder()``; it also feeds spike
            detection (``set_spike_detection``). Off by default: its fixed cost, about 50 us a
            step on a CPU, shows on a model whose step takes a fraction of a millisecond.
        optim_state: measure the optimizer's state and the update's geometry on sampled steps
            (each snapshot's ``optim``: Adam's moments and the share of ``v`` below ``eps**2``, the
            effective step, the cosines of update and gradient and of consecutive sampled gradients;
            see inspector/stats/optim_state.py); False turns it off (the field is then None).
        rules: rules to start with (see ``Inspector.load_rules``): a preset's name, a path to a
            JSON file, ``{"rules": [...]}`` or a list; None (default): none.

    Under ``torch.distributed`` (an initialised process group of 2 or more) call ``attach`` on
    every rank, at the same point: it creates a gloo control group (a collective call).

    Returns:
        The :class:`Inspector`; also a context manager that closes it.
    """
    _one_optimizer(optimizer)  # (before the options: the first mistake is the one named)
    options = Options(
        budget=budget,
        every=every,
        hist_every=hist_every,
        per_rank_stats=per_rank_stats,
        dist_timeout=dist_timeout,
        checkpoints=checkpoints,
        checkpoint_every=checkpoint_every,
        checkpoint_memory=checkpoint_memory,
        checkpoint_dir=checkpoint_dir,
        groups=groups,
        noise_scale=noise_scale,
        batch_size=batch_size,
        noise_ema=noise_ema,
        flight=flight,
        optim_state=optim_state,
    )
    insp = Inspector(model, optimizer, scaler=scaler, options=options)
    if rules is not None:
        try:
            insp.load_rules(rules)
        except BaseException:
            insp.close()
            raise
    return insp
