"""The Inspector: the public API, its locks and threads, and the step lifecycle.

Torch hooks registered (and nothing else; ``close()`` removes every one):

- ``optimizer.register_step_pre_hook``: the ``pre_step`` point. Runs once per optimizer
  step on the final gradients (accumulated, all-reduced under DDP, unscaled under a
  GradScaler): raw statistics, every enabled ``pre_step`` hook in ``position`` order,
  final statistics. With a closure (LBFGS, Lightning) it wraps the closure so that this
  work runs after the closure's backward, once per evaluation.
- ``optimizer.register_step_post_hook``: the step boundary. Snapshot N is published here,
  right after the N-th update; pending edits are applied; a pause holds the thread here.
- ``root.register_forward_pre_hook``: marks a step as under way (edits that register
  torch hooks are applied here, before the backward).
- ``param.register_post_accumulate_grad_hook`` and ``module.register_forward_hook``: only
  where an enabled ``post_accumulate`` or ``module`` hook needs them (and, under DDP, on every
  parameter for the per-rank spread); see :mod:`inspector.hooks.torch_hooks`, which owns them.

What lives where: the statistics and the snapshot in :mod:`inspector.stats.step_stats`, NaN/Inf
findings and their events in :mod:`inspector.stats.nonfinite`, the applying of edits in
:mod:`inspector.hooks.edits`, the rows exchanged under ``torch.distributed`` in
:mod:`inspector.distributed`, recorded scalars in :mod:`inspector.step.scalars`, and the records'
way to subscribers in :mod:`inspector.feed`.

Threads: only the training thread (the one that runs ``optimizer.step()``, or the root
forward) registers or removes torch hooks. Edits from other threads are validated at once
and applied by the training thread at the next safe point (DESIGN.md "Steps").
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from . import distributed
from .dashboard import Dashboard
from .feed import Feed
from .hooks import amp
from .hooks.edits import Edits
from .hooks.handles import HookHandle
from .hooks.owned import OwnedHook, claim, hide_from_copies, release, unhide
from .hooks.registry import PRESET_FORMAT, Registry
from .hooks.targets import match
from .hooks.torch_hooks import TorchHooks
from .stats.deferred import Deferred
from .stats.histsel import HIST_BINS, HIST_CAP, HistSelection
from .stats.nonfinite import NonfiniteReport
from .stats.sharded import layout_of
from .stats.step_stats import StepStats
from .stats.telemetry import Cadence, check_cadence
from .step.lifecycle import StepLifecycle
from .step.scalars import Recorder, check_scalars
from .whatif.checkpoints import DEFAULT_KEEP, Checkpoints
from .whatif.rewinding import Rewinding
from .wire.errors import AttachError, HookError, InspectorError, RewindPending, shown
from .wrappers import enabled_scaler, is_compiled, named_tensors, param_info, real_optimizer

__all__ = ["Inspector", "attach", "HIST_CAP", "HIST_BINS"]


class Inspector(Rewinding, StepLifecycle, Dashboard):
    """Watches and edits the gradients of one model and optimizer. Create with :func:`attach`."""

    def __init__(
        self,
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
    ) -> None:
        if isinstance(optimizer, list | tuple):
            raise AttachError(
                "attach() takes one optimizer: its step is the step boundary. For several optimizers (a GAN, "
                "say) attach one Inspector per optimizer, each with the model part that optimizer steps"
            )
        optimizer = real_optimizer(optimizer) if optimizer is not None else None
        check_cadence(budget, every, hist_every)
        named, module_objs = named_tensors(model)
        self._root: nn.Module | None = model if isinstance(model, nn.Module) else None
        self.params: list[str] = [n for n, _ in named]
        self.modules: list[str] = list(module_objs)
        self._tensors: list[Tensor] = [p for _, p in named]
        self._layout = layout_of(model, self.params, self._tensors)  # FSDP2 (refuses what it cannot handle)
        self._optimizer = optimizer
        self._scaler = enabled_scaler(scaler)
        amp.check_optimizer(optimizer, self._scaler)

        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        # under torch.distributed: a control plane shared by every rank (a collective call)
        self._dist = distributed.ControlPlane(timeout=dist_timeout) if distributed.active() else None
        self.rank = self._dist.rank if self._dist is not None else 0
        self._reg = Registry(
            self.params,
            self.modules,
            scaler=self._scaler is not None,
            distributed=self._dist is not None,
            compiled=is_compiled(model),
            is_script=lambda: threading.get_ident() == self._train_tid,
        )
        self._feed = Feed()
        self._cadence = Cadence(float(budget), every)
        self._hooks = TorchHooks(
            self.params,
            self._tensors,
            module_objs,
            is_sampled=lambda: self._sampled,
            on_failure=self._hook_failed,
            scaler=self._scaler,
            per_rank=self._dist is not None and per_rank_stats,
            layout=self._layout,
        )
        self._edits = Edits(self._reg, self._hooks, self._feed, self._event, self._cond)
        self._stats = StepStats(self.params, self._tensors, self._layout)
        self._nonfinite = NonfiniteReport(self.params, self._event)
        self._hist = HistSelection(self.params, hist_every)
        # device values on their way to the host (NaN/Inf checks, records), under the Inspector's lock
        self._deferred = Deferred(self._lock)
        self._records = Recorder(self._feed, self._lock, self._deferred)
        self._handles: list[Any] = []  # the step hooks (optimizer pre/post, root forward pre)

        self._init_step_state()
        self._branches = Checkpoints(
            self, checkpoints
        )  # checkpoint() and rewind(): inspector.whatif.checkpoints
        self._server: Any = None
        self._closer: int | None = None  # the thread inside close(), until it has finished

        claim(self, self._tensors, optimizer)  # refuses a second attach to the same parameters
        self._register_step_hooks()

    def _register_step_hooks(self) -> None:
        """The step hooks (optimizer pre/post, root forward pre, a backward hook where needed)."""
        optimizer = self._optimizer
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(self._on_step_pre))
            self._handles.append(optimizer.register_step_post_hook(self._on_step_post))
        if self._root is None or optimizer is None:
            # a dict of tensors: its first backward of a step marks the step under way; without an
            # optimizer, backward passes with no mark_step() are counted (to say what is missing)
            first = next((t for t in self._tensors if t.requires_grad), None)
            if first is not None:
                self._handles.append(first.register_post_accumulate_grad_hook(OwnedHook(self._on_backward)))
        if self._root is not None and getattr(self._root, "_compiled_call_impl", None) is None:
            # (a root compiled in place, model.compile(), would trace this hook into its graph: there the
            # step is marked under way by the optimizer's step pre-hook instead, as for a dict of tensors)
            self._handles.append(self._root.register_forward_pre_hook(OwnedHook(self._on_forward_pre)))
            # on sampled steps, a hook on the output's gradient (the backward's start) has the
            # gradients' norm taken at the backward's end: no hook is kept on any parameter
            self._handles.append(self._root.register_forward_hook(OwnedHook(self._on_forward_out)))
            hide_from_copies(self._root)  # torch.save(model) and deepcopy carry none of our hooks

    @contextlib.contextmanager
    def _stood_aside(self) -> Iterator[None]:
        """Every hook of ours off the model and optimizer, and their claim released, for as long as
        the block runs (``inspector.compare`` trains the attached model with Inspectors of its own);
        then all back, this Inspector's state (step, hooks, noise streams, cadence) untouched.
        Between steps only."""
        with self._cond:
            self._check_open()
            if self._under_way:
                raise InspectorError(
                    "compare() on an attached model runs between steps: a step is under way here"
                )
            for h in self._handles:
                h.remove()
            self._handles.clear()
            self._hooks.detach()
            release(self)
        try:
            yield
        finally:
            with self._cond:
                claim(self, self._tensors, self._optimizer)
                self._register_step_hooks()
                self._hooks.sync()
                self._last_boundary = None  # the comparison's time is no step of this run

    # ================================================================= public API
    def _check_open(self) -> None:
        if self._closed:
            raise InspectorError("this Inspector is closed")
        if self._dist is not None and self.rank != 0 and threading.get_ident() != self._train_tid:
            raise InspectorError(
                "under torch.distributed, edits from another thread go to rank 0 (which serves "
                f"the dashboard); this is rank {self.rank}"
            )

    @property
    def step(self) -> int:
        """Completed optimizer steps (the number of the last step boundary)."""
        return self._step

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
        return self._training_state()

    @property
    def cost(self) -> dict[str, Any]:
        """The inspector's own measured cost: ``{"overhead": fraction of the wall-clock step,
        "sampled_every": k, "step_s", "sampled_s", "unsampled_s"}`` (recent averages, seconds)."""
        return {"overhead": self._cadence.overhead, "sampled_every": self._cadence.k, **self._cadence.costs}

    def param_info(self) -> list[dict[str, Any]]:
        """``[{"name", "shape", "numel", "module", "requires_grad", "dtype"}]`` in ``params`` order."""
        return param_info(self.params, self._tensors, modules=self._root is not None)

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
            self._submit(change)
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
                self._submit(change)
            return self.hook_spec(hook_id)

    def remove_hook(self, hook_id: str, *, missing_ok: bool = False) -> None:
        with self._lock:
            if self._closed:
                return
            self._refuse_while_rewinding()
            try:
                change = self._reg.remove(hook_id)
            except KeyError:
                if missing_ok:
                    return
                raise
            self._submit(change)

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
            self._submit(change)
            return self.hooks()

    # ----------------------------------------------------------------- data
    def record(self, **scalars: Any) -> None:
        """Record scalars (floats or one-element tensors, read on the host without a sync of their step).

        While a step is under way (from the model's forward, or for a dict of tensors its backward,
        until ``optimizer.step()``) they attach to that step; after ``step()`` and before the next
        forward (backward), to the step just completed. ``begin_step()`` marks a step under way by
        hand. Every step's records reach the ``scalars`` stream: a sampled step's with its snapshot,
        an unsampled step's a few steps later (read together with later ones). Several records of
        one key in one step are averaged.
        """
        vals = check_scalars(scalars)
        with self._lock:
            late = not self._under_way and self._step > 0
            self._records.add(vals, late=late)

    def snapshots(self, since: int | None = None) -> list[dict[str, Any]]:
        """Snapshots still in the ring buffer with ``step > since``, as wire dicts."""
        with self._feed._lock:
            snaps = list(self._feed.snapshots)
        return [s.to_dict() for s in snaps if since is None or s.step > since]

    def latest(self) -> dict[str, Any] | None:
        with self._feed._lock:
            return self._feed.snapshots[-1].to_dict() if self._feed.snapshots else None

    def events(self, since: int | None = None) -> list[dict[str, Any]]:
        """Events with ``seq > since``."""
        with self._feed._lock:
            return [e for e in self._feed.events if since is None or e["seq"] > since]

    def subscribe(
        self, callback: Callable[[str, Any], None], *, lossless: bool = False
    ) -> Callable[[], None]:
        """Call ``callback(kind, payload)`` for every record, off the training thread.

        ``kind`` is ``"snapshot"`` (payload: the snapshot's wire dict, shared by every consumer:
        read-only), ``"scalars"`` (``{"step", "loss", "scalars"}``), ``"hooks"``
        (``{"config_version", "hooks"}``), ``"event"`` (an event dict) or ``"training"``
        (``{"state", "step", "held"}``: after a pause, resume or single step, and when a pause
        takes hold). Errors in the callback are caught and counted. Hooks and events always
        arrive; snapshots and scalars are dropped for a callback more than 256 of them behind,
        unless ``lossless`` (then each arrives, late: keep such a callback quick). Returns a
        function that unsubscribes.
        """
        return self._feed.subscribe(callback, lossless=lossless)

    def add_event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Record and broadcast an event (used by the server: ``server_error``, ``history_paused``...)."""
        return self._event(kind, **fields)

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

    # ----------------------------------------------------------------- control
    def pause(self) -> dict[str, Any]:
        """Hold the training thread at the next step boundary."""
        with self._cond:
            self._paused, self._credit = True, 0
            self._cond.notify_all()
        return self._publish_training()

    def resume(self) -> dict[str, Any]:
        with self._cond:
            self._paused, self._credit = False, 0
            self._cond.notify_all()
        return self._publish_training()

    def step_once(self) -> dict[str, Any]:
        """Let exactly one more step run, then hold at its boundary."""
        with self._cond:
            self._paused = True
            self._credit += 1
            self._cond.notify_all()
        return self._publish_training()

    def close(self) -> None:
        """Remove every hook of ours and stop the server; idempotent. A call while another thread
        is closing returns once that close has finished (so ``wait()`` never returns early)."""
        with self._cond:
            if self._closed:
                closer = self._closer
                if closer is not None and closer != threading.get_ident():
                    self._cond.wait_for(lambda: self._closer is None, timeout=60.0)
                return
            self._closed = True
            self._closer = threading.get_ident()
            self._finished = True
            self._cond.notify_all()
        self._check_scaler_skip()  # the last iteration, when the scaler skipped it
        release(self)
        try:
            self._flush_late()
            self._records.flush_pending()
            self._drain_deferred(wait=True)  # the last steps' NaN/Inf checks and records
        except Exception as e:  # the last late records are lost, but close() must finish: say so
            warnings.warn(
                f"inspector: the last step's late records could not be sent ({shown(e)})",
                RuntimeWarning,
                stacklevel=2,
            )
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._hooks.remove_all()
        if self._root is not None:
            for m in self._root.modules():
                unhide(m)
        self._feed.flush()  # deliver the last records to the server (and its history) before it stops
        server, self._server = self._server, None
        if server is not None:
            server.stop()
        self._feed.close()
        self._reg.fns.clear()
        self._stats.close()
        self._branches.release()  # the checkpoints' host memory (a full copy of the state each)
        with self._cond:
            self._closer = None  # closed: whoever waits for it may go on
            self._cond.notify_all()

    def __enter__(self) -> Inspector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Inspector {len(self.params)} params, step {self._step}, {len(self._reg.requested)} hooks>"


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
        checkpoints: how many checkpoints (``insp.checkpoint()``, and the dashboard's automatic
            one before each hook change) are kept in host memory; 0 turns them off.

    Under ``torch.distributed`` (an initialised process group of 2 or more) call ``attach`` on
    every rank, at the same point: it creates a gloo control group (a collective call).

    Returns:
        The :class:`Inspector`; also a context manager that closes it.
    """
    return Inspector(
        model,
        optimizer,
        scaler=scaler,
        budget=budget,
        every=every,
        hist_every=hist_every,
        per_rank_stats=per_rank_stats,
        dist_timeout=dist_timeout,
        checkpoints=checkpoints,
    )
