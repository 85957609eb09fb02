"""The step lifecycle: what runs inside the user's root forward and ``optimizer.step()``, the
boundary that ends a step, and where and when edits apply.

:class:`StepLifecycle` is built by the Inspector from its parts and owns the step hooks it
registers on the model and the optimizer. Of the run's state it keeps only one step's scratch
(the backward's norms, the histograms chosen for the step under way) and two things said once
a run (a loop with no step boundary, a statistic that failed): the step number
and sampling are the :class:`~inspector.step.clock.StepClock`'s, the pause and the training
thread the :class:`~inspector.step.gate.PauseGate`'s, events the
:class:`~inspector.step.events.EventLog`'s, the scaler's skips the
:class:`~inspector.hooks.amp.ScalerWatch`'s, the exchange under ``torch.distributed`` the
:class:`~inspector.step.dist_sync.DistributedSync`'s. In order, one step:

1. ``on_forward_pre`` (the root module's forward pre-hook): the step is under way; late records
   of the previous step are flushed; pending edits that register torch hooks apply.
2. the backward: our ``post_accumulate`` and ``module`` hooks (:mod:`inspector.hooks.torch_hooks`).
3. ``on_step_pre`` (the optimizer's step pre-hook): ``pre_step_work``, after the closure's
   backward when there is one: raw statistics and NaN/Inf findings, every ``pre_step`` hook,
   final statistics (:mod:`inspector.stats.step_stats`).
4. the optimizer's update.
5. ``boundary`` (its step post-hook): earlier steps' deferred checks are read, the cadence
   accounts the step, a sampled step's snapshot is built and published (under
   ``torch.distributed`` every step's exchange runs), the rules act, an automatic checkpoint
   (``checkpoint_every``) is queued, pending edits and requests are carried out, a pause holds
   the thread.

Edits: :meth:`StepLifecycle.submit` decides where a validated change applies (now, or at the next
safe point); :meth:`StepLifecycle.apply_edits` is the one place they apply, and the one rule of
their order with checkpoints: a change from the dashboard waits for its automatic checkpoint,
then applies; requests (checkpoint, rewind) are carried out after it where no step is under way.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from typing import Any

import torch
from torch import Tensor, nn

from ..feed import Feed
from ..hooks import amp
from ..hooks.edits import Edits
from ..hooks.ops import GuardResult, apply_pre_step
from ..hooks.owned import OwnedHook, hide_from_copies
from ..hooks.registry import Change, Registry
from ..hooks.torch_hooks import TorchHooks
from ..stats.deferred import Check, Deferred, build_check
from ..stats.flight import FlightRecorder
from ..stats.histsel import HistSelection, learning_rates
from ..stats.nonfinite import NO_FINDINGS, NonfiniteReport
from ..stats.sharded import local
from ..stats.step_stats import RawRead, StepStats
from ..stats.telemetry import Cadence
from ..whatif.checkpoints import Checkpoints
from ..whatif.skip import BatchCursor
from ..wire.errors import InspectorError, describe_error
from ..wire.records import HookSpec
from ..wrappers import Attached
from .clock import StepClock
from .dist_sync import DistributedSync
from .events import EventLog
from .gate import PauseGate
from .scalars import Recorder

__all__ = ["StepLifecycle", "NO_BOUNDARY_AFTER"]


def _output_tensors(out: Any) -> list[Tensor]:
    """The tensors in a forward's output (a tensor, or a tuple, list or dict of them, one level)."""
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, list | tuple):
        return [t for t in out if isinstance(t, Tensor)]
    return [v for v in vars(out).values() if isinstance(v, Tensor)] if hasattr(out, "__dict__") else []


NO_BOUNDARY_AFTER = 50  # backward passes with no step boundary at all before a loop is told it lacks one


class StepLifecycle:
    """The step hooks, the ``pre_step`` work, the boundary and the edit rule (module docstring)."""

    def __init__(
        self,
        attached: Attached,
        *,
        lock: threading.RLock,
        clock: StepClock,
        gate: PauseGate,
        events: EventLog,
        feed: Feed,
        reg: Registry,
        hooks: TorchHooks,
        edits: Edits,
        stats: StepStats,
        nonfinite: NonfiniteReport,
        hist: HistSelection,
        deferred: Deferred,
        records: Recorder,
        cadence: Cadence,
        scaler: amp.ScalerWatch,
        branches: Checkpoints,
        owner: object,
        flight: FlightRecorder | None = None,
        data: BatchCursor | None = None,
    ) -> None:
        # the Inspector, kept (and nothing read of it): the step hooks on the user's model and
        # optimizer are this object's methods, so they keep the Inspector alive as long as they
        # are registered, as an Inspector's own bound methods did; close() removes them
        self._data = data  # take_batch(): a step whose batches were all dropped makes no update
        self._dropped = False  # this step's update was dropped so already
        self._owner = owner
        self._at = attached
        self._lock = lock
        self._clock = clock
        self._gate = gate
        self._events = events
        self._feed = feed
        self._reg = reg
        self._hooks = hooks
        self._edits = edits
        self._stats = stats
        self._nonfinite = nonfinite
        self._hist = hist
        self._deferred = deferred
        self._records = records
        self._cadence = cadence
        self._scaler = scaler
        self._branches = branches
        self._flight = flight  # every step's norms and the spike detector (None: off)
        # under torch.distributed: every boundary's exchange, the held boundary, script edits
        self.sync: DistributedSync | None = None
        if attached.dist is not None:
            self.sync = DistributedSync(
                attached.dist,
                n_params=len(attached.params),
                sharded=attached.layout is not None,
                gate=gate,
                clock=clock,
                reg=reg,
                cadence=cadence,
                hooks=hooks,
                hist=hist,
                nonfinite=nonfinite,
                events=events,
                apply_edits=lambda: self.apply_edits(torch_ok=True),
            )
            # checkpoints and rewinds: rank 0's requests ride in the exchange; every rank carries them out
            self.sync.branches = branches
            sync = self.sync
            branches.sync_failed = lambda err: sync._failed(err, clock.step)
        self._handles: list[Any] = []  # the step hooks (optimizer pre/post, root forward pre/post)
        # one step's scratch
        self._unmarked = 0  # backward passes before the first boundary, without an optimizer
        self._bw_queued = False  # a callback at the end of the backward under way is queued
        # the norms the last backward left, and the scale they are scaled by (sampled steps)
        self._bw: tuple[list[Tensor] | Tensor, Tensor | None] | None = None
        self._bw_index: list[int] = []  # the parameters whose norms _bw holds, in order
        self._single_from: int | None = None  # between_batches let a single step go from this step
        self._hist_chosen: list[int] | None = None  # the step under way's histograms, once chosen
        self._telemetry_seen: set[str] = set()  # statistics failures reported so far (each once)
        # the rules (inspector.rules), set by the Inspector; evaluated at the boundary from the
        # step's snapshot (sampled steps) and events, values already on the host
        self.rules: Any = None
        self._snap: Any = None  # this boundary's snapshot, for the rules

    @property
    def _distributed(self) -> bool:
        """Under torch.distributed with the control collective working."""
        return self.sync is not None and self.sync.active

    # ================================================================= the step hooks
    def register(self) -> None:
        """Register the step hooks (optimizer pre/post, root forward pre/post, a backward hook where
        needed); :meth:`detach` removes them."""
        at = self._at
        optimizer = at.optimizer
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(self.on_step_pre))
            self._handles.append(optimizer.register_step_post_hook(self.on_step_post))
        if at.root is None or optimizer is None:
            # a dict of tensors: its first backward of a step marks the step under way; without an
            # optimizer, backward passes with no mark_step() are counted (to say what is missing)
            first = next((t for t in at.tensors if t.requires_grad), None)
            if first is not None:
                self._handles.append(first.register_post_accumulate_grad_hook(OwnedHook(self.on_backward)))
            if at.root is None:
                # no forward of ours sees a backward start: any tensor's gradient does (the first
                # one may sit out a backward: a micro-batch that does not use it)
                for t in at.tensors:
                    if t.requires_grad and t is not first:
                        self._handles.append(t.register_hook(self._tensor_grad))
        if at.root is not None and getattr(at.root, "_compiled_call_impl", None) is None:
            # (a root compiled in place, model.compile(), would trace this hook into its graph: there the
            # step is marked under way by the optimizer's step pre-hook instead, as for a dict of tensors)
            self._handles.append(at.root.register_forward_pre_hook(OwnedHook(self.on_forward_pre)))
            # on sampled steps, a hook on the output's gradient (the backward's start) has the
            # gradients' norm taken at the backward's end: no hook is kept on any parameter
            self._handles.append(at.root.register_forward_hook(OwnedHook(self.on_forward_out)))
            hide_from_copies(at.root)  # torch.save(model) and deepcopy carry none of our hooks

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ================================================================= loops that need telling
    def begin_step(self) -> None:
        """Mark a step as under way, as the root module's forward pre-hook does."""
        self.on_forward_pre(self._at.root, ())  # type: ignore[arg-type]

    def finish(self) -> None:
        """Training is over: edits from other threads apply at once from now; the last steps'
        checks and records are sent. A last iteration that the scaler skipped is reported now."""
        self.check_scaler_skip()
        with self._gate.cond:
            ended = self._gate.finish()
            self.apply_edits(torch_ok=True)
        if ended:
            self._gate.publish()  # subscribers learn it at once (a ``training`` record: finished)
        self.send_last()

    def send_last(self) -> None:
        """Training is over: the last steps' records (late ones included) and NaN/Inf checks are
        sent now, waiting for their copies to the host."""
        self.flush_late()
        if self._flight is not None:
            self._flight.complete()
        self._records.flush_pending()
        self.drain_deferred(wait=True)

    def mark_step(self) -> None:
        """The step boundary for a loop without a torch optimizer (see ``Inspector.mark_step``)."""
        if self._at.optimizer is not None:
            raise InspectorError(
                "mark_step() is for loops without a torch optimizer: here optimizer.step() is the boundary"
            )
        self._gate.claim_thread()
        self.pre_step_work()
        self.boundary()

    # ================================================================= edits: where and when they apply
    def submit(self, change: Change) -> None:
        """A validated change was queued: apply it now where that is safe, else wake whoever
        applies it (lock held)."""
        gate = self._gate
        on_train = gate.on_training_thread()
        if self._distributed:
            # one config for the job: an edit from the training thread is made on every rank (the
            # script is the same everywhere), so it is a collective: rank 0's pending changes (its
            # dashboard's, then this one) go to every rank and apply now, in the same order
            # everywhere; rank 0's other edits travel at the next boundary
            if on_train:
                self.sync.sync_edits()  # type: ignore[union-attr]
            elif gate.held:
                gate.cond.notify_all()
            return
        if on_train or (gate.finished and not gate.closed):
            self.apply_edits(torch_ok=True)
        elif gate.held:
            gate.cond.notify_all()  # the paused training thread applies it
        elif (
            self._at.root is not None
            and not self._clock.under_way
            and not any(c.touches_torch() for c in self._reg.pending)
        ):
            self.apply_edits(torch_ok=False)  # pre_step only, between steps: safe from this thread

    def apply_edits(self, *, torch_ok: bool) -> None:
        """Apply the pending edits here (lock held): the one place they apply, in this order.

        1. A change from the dashboard first waits for its automatic checkpoint: while one is
           queued, nothing applies until it is taken, which needs the torch hooks in reach
           (``torch_ok``) and no step under way.
        2. The pending changes apply (``torch_ok``: those that register torch hooks too; else
           only ``pre_step`` ones).
        3. Where no step is under way and torch hooks are in reach, queued checkpoint and rewind
           requests are carried out (:meth:`Checkpoints.service`).
        """
        branches, under_way = self._branches, self._clock.under_way
        if branches.holds_changes:
            if not torch_ok or under_way:
                return
            branches.service()
        self._edits.drain(self._clock.step + 1, torch_ok=torch_ok)
        if torch_ok and branches.queued and not under_way:
            branches.service()

    def hook_failed(self, spec: HookSpec, param: str | None, err: BaseException) -> None:
        """A hook raised: disable it at once, report it, and let training go on."""
        with self._lock:
            self._edits.disable_failed(spec, param, describe_error(err), self._clock.step + 1)

    # ================================================================= the step hooks' callbacks
    def _mark_under_way(self) -> None:
        with self._lock:
            self._clock.begin()
        self.flush_late()

    def on_backward(self, param: Tensor) -> None:
        """A backward pass (a hook on one parameter). A dict of tensors has no forward of ours: its
        first backward of a step marks it under way. On a sampled step, the gradients' norm as the
        backward leaves them is taken at its end (``_at_backward_end``; for a dict of tensors also
        queued by the other tensors' hooks, :meth:`_tensor_grad`, for a backward without this
        one). Without an optimizer,
        backward passes that no step boundary ever follows are a loop that does not call
        ``mark_step()``: said once."""
        if not self._clock.under_way and self._at.root is None:
            self._mark_under_way()
        self._backward_started()
        if self._at.optimizer is None and self._clock.step == 0 and not self._gate.closed:
            self._unmarked += 1
            if self._unmarked == NO_BOUNDARY_AFTER:
                message = (
                    f"{NO_BOUNDARY_AFTER} backward passes and no step boundary: without a torch optimizer, "
                    "call insp.mark_step() after backward() and before your own update (help(insp.mark_step) "
                    "shows the loop); until then no statistics are taken and no pre_step hook runs"
                )
                self._events.emit("no_step_boundary", message=message, step=0)
                warnings.warn(f"gradient-inspector: {message}", RuntimeWarning, stacklevel=2)

    def _backward_norm_wanted(self) -> bool:
        """The norm at the backward's end: on sampled steps (under DDP and FSDP2 too)."""
        return self._clock.sampled

    def on_forward_out(self, module: nn.Module, args: Any, output: Any) -> None:
        """The root's forward returned: on a sampled step, its output's gradient hook tells when
        the backward starts (``_backward_started``). Nothing on other steps."""
        if not (self._backward_norm_wanted() and torch.is_grad_enabled()):
            return
        for t in _output_tensors(output):
            if t.requires_grad:
                t.register_hook(self._output_grad)
                return  # one is enough: the backward through it starts the callback

    def _output_grad(self, grad: Tensor) -> None:
        self._backward_started()

    def _tensor_grad(self, grad: Tensor) -> None:
        """A tensor hook of a dict of tensors: the backward under way is one to take the norms at
        the end of (sampled steps; nothing else on others)."""
        try:
            self._backward_started()
        except Exception as e:  # never take training down for telemetry
            self._telemetry_failed("the gradient norm at the end of backward", e)

    _tensor_grad.__torch_unserializable__ = True  # type: ignore[attr-defined]  (torch.save: no warning)

    def _backward_started(self) -> None:
        """A backward is running (the engine is): on a sampled step, queue ``_at_backward_end``
        once, to run when this backward has accumulated every gradient."""
        if self._backward_norm_wanted() and not self._bw_queued:
            self._bw_queued = True
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self._at_backward_end)
            except Exception as e:
                self._bw_queued = False
                self._telemetry_failed("the gradient norm at the end of backward", e)

    def _at_backward_end(self) -> None:
        """The gradients' norms as this backward left them, on the device (one fused norm, nothing
        read): the last backward of a step (micro-batches accumulated) is the one the snapshot shows,
        beside what ``step()`` saw, so a clip of the user's own between the two is seen. Unscaled on
        the host, by an attached scaler's scale taken here or, with no scaler attached, a fused
        optimizer's ``grad_scale`` taken at the step.

        The read itself is queued behind every callback this backward queued after this one (the
        engine runs the callbacks queued while it runs them, in order): under DDP and FSDP2 the
        gradients are reduced by such a callback (DDP's reducer queues one once its last bucket is
        ready, FSDP2's root at the backward's start), so ``_read_backward`` reads DDP's averaged
        gradients and FSDP2's reduced shards (their sums of squares are combined in the snapshot's
        one collective), before anything of the user's between ``backward()`` and ``step()``."""
        self._bw_queued = False
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._read_backward)
        except Exception as e:
            self._telemetry_failed("the gradient norm at the end of backward", e)

    def _read_backward(self) -> None:
        """:meth:`_at_backward_end`'s read: the norms of the gradients as they stand (this rank's
        shards under FSDP2)."""
        try:
            index = [
                i
                for i, t in enumerate(self._at.tensors)
                if t.grad is not None and t.grad.layout == torch.strided
            ]
            grads = [local(self._at.tensors[i].grad) for i in index]
            scale = getattr(self._at.scaler, "_scale", None)  # the scale this backward's loss was scaled by
            self._bw = (
                (self._stats.norms_now(grads), scale if isinstance(scale, Tensor) else None)
                if grads
                else None
            )
            self._bw_index = index
        except Exception as e:  # never take training down for telemetry
            self._telemetry_failed("the gradient norm at the end of backward", e)

    def on_forward_pre(self, module: nn.Module, args: Any) -> None:
        clock = self._clock
        if (
            clock.under_way
            and self._at.scaler is None
            and not self._scaler.skip_known
            and not (self._reg.pending or self._hooks.dirty)
        ):
            return  # a later forward of the step under way (accumulation): nothing to do
        t0 = time.perf_counter()
        self._gate.claim_thread()
        self.check_scaler_skip()
        # a forward with gradients off (validation under no_grad or inference_mode) is no step:
        # between two steps it leaves training between steps (a checkpoint is taken at once, a
        # record() still belongs to the step just completed)
        if not clock.under_way and torch.is_grad_enabled():
            self._mark_under_way()
            if self._hooks.watches_frozen:  # a parameter unfrozen since (gradual unfreezing)
                with self._lock:
                    self._hooks.unfrozen(self._reg.applied, self._reg.fns)
        if self._distributed:
            if self._hooks.dirty:  # pending edits wait for the boundary exchange
                with self._lock:
                    self._hooks.sync()
        elif self._reg.pending or self._hooks.dirty:
            with self._lock:
                self.apply_edits(torch_ok=True)
        clock.spend(time.perf_counter() - t0)

    def on_step_pre(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        t0 = time.perf_counter()
        clock = self._clock
        self._gate.claim_thread()
        fused = amp.fused_scaling(optimizer)
        if fused is not None:  # a fused optimizer under a GradScaler (see inspector.hooks.amp)
            grad_scale, skipped = fused
            if skipped:  # its kernel skips this update, as GradScaler skips an unfused step(): so do we
                self._scaler.fused_skip()
                clock.spend(time.perf_counter() - t0)
                return None  # (GradScaler refuses closures)
            if grad_scale is not None:
                amp.unscale_(optimizer, grad_scale)  # our stats and hooks see unscaled gradients
                if self._bw is not None and self._at.scaler is None:  # (an attached one's is taken already)
                    self._bw = (self._bw[0], grad_scale)
                if self._stats.noise is not None:  # the noise scale's increments: the same units
                    self._stats.noise.unscale(grad_scale)
        if not clock.under_way:
            # nothing marked this step (a loop that calls a submodule, Lightning's training_step, a
            # root compiled in place): records made since the last boundary were late ones
            self._mark_under_way()
        if clock.sampled:
            try:
                self._stats.keep_params()  # for the update-to-parameter ratio
            except Exception as e:  # never take training down for telemetry
                self._telemetry_failed("the parameters' sample for the update ratio", e)
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        clock.spend(time.perf_counter() - t0)
        if closure is None:
            self.pre_step_work()
            return None

        def wrapped_closure() -> Any:
            out = closure()
            self.pre_step_work()  # after the closure's backward, once per evaluation
            return out

        if len(args) > 1:
            return (args[0], wrapped_closure, *args[2:]), kwargs
        return args, {**kwargs, "closure": wrapped_closure}

    def on_step_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._scaler.take_fused_skip():  # no update ran: not a step boundary
            self._skip_iteration()
            return
        self.boundary()

    def check_scaler_skip(self) -> None:
        """At a forward, ``finish()`` and ``close()``: was the iteration under way skipped by the
        scaler (:class:`~inspector.hooks.amp.ScalerWatch`)? Then a rewind's scaler state waiting
        for this iteration's ``update()`` is loaded."""
        what = self._scaler.check(self._clock.under_way)
        if what == "reported":  # a fused optimizer's skip, reported at its boundary: what was
            self._records.forget_current()  # recorded after that boundary belongs to the skipped iteration
        elif what == "skipped":
            self._skip_iteration()
        if self._branches.scaler_pending and self._branches.settle_scaler():
            # a rewind's scaler state, loaded now that the abandoned iteration's update() ran: a
            # write of the scale that is no skipped step
            self._scaler.remark()

    def _skip_iteration(self) -> None:
        """The iteration under way made no update (the scaler found inf/NaN): it is no step. Report it,
        and forget what it recorded and what its backward collected, so the next step shows its own."""
        self._records.forget_current()
        self._hooks.end_step()
        self._stats.end_step()
        self._events.emit("step_skipped", step=self._clock.step + 1, reason="scaler")

    # ================================================================= the step's work
    def pre_step_work(self) -> None:
        """Raw statistics, every pre_step hook, final statistics and the step's deferred NaN/Inf
        check (once per step or per closure call); nothing is read on the host here, except by an
        enabled ``nan_guard`` ``skip`` (see :mod:`inspector.hooks.ops`)."""
        t0 = time.perf_counter()
        at, clock, hooks = self._at, self._clock, self._hooks
        plan, sampled = hooks.plan, clock.sampled
        if self._data is not None and self._data.step_dropped(clock.step + 1):
            # a trainer drew this step's batches, and every one fell in a skipped window (one
            # event a step, however often a closure is evaluated)
            self._no_update("batches_skipped", report=not self._dropped)
            self._dropped = True
        if not (
            sampled
            or plan.pre
            or hooks.mod_bad
            or hooks.post_found
            or hooks.per_rank
            or at.layout is not None
            or self.sync is not None
        ):
            # the usual unsampled step: nothing but the probe to check (the same check build_check
            # makes, without its segments)
            try:
                probe = self._stats.probe()
            except Exception as e:  # never take training down for telemetry
                self._telemetry_failed("the NaN/Inf probe", e)
                probe = None
            if probe is not None:
                check = _ProbeCheck(self._nonfinite, clock.step + 1, probe[0])
                self._deferred.submit_flat(clock.step + 1, probe[1], check)
                if self._flight is not None:
                    self._flight_norms(probe[0], probe[1], None)
                clock.spend(time.perf_counter() - t0)
                return
        touched: set[int] = set()  # sampled steps: the parameters a pre_step hook may edit in place
        if sampled:
            for state, targets in plan.pre:
                state.reset_effects()
                p = state.spec.params
                if state.spec.kind not in ("freeze", "nan_guard") or p.get("action") == "zero":
                    touched.update(t.index for t in targets)
        with self._lock:
            if not sampled:
                hist = []
            elif at.layout is not None and self._distributed:
                hist = self.sync.hist_next  # type: ignore[union-attr]  # every rank the same (FSDP2 collectives)
            elif self._hist_chosen is not None:  # a closure's second evaluation: the same
                hist = self._hist_chosen
            else:
                hist = self._hist.due(clock.sampled_count)
                if hist and touched and at.layout is None:  # (an edited one's raw histogram is of a copy)
                    hist = self._hist.within_budget(hist, touched, at.tensors)
                self._hist_chosen = hist
        try:
            raw = self._stats.raw(hooks, sampled, hist, touched)
        except Exception as e:  # never take training down for telemetry: the hooks still run
            self._telemetry_failed("the raw gradient statistics", e)
            raw, sampled = RawRead([], [], False), False
        raw.backward, self._bw = (self._bw if sampled else None), None
        self._bw_queued = False  # (a backward that raised never ran its callback: the next one queues)
        raw.backward_index = self._bw_index if raw.backward is not None else None
        skip = False
        guards: list[GuardResult] = []
        for state, targets in plan.pre:
            try:
                res = apply_pre_step(state, list(targets), sampled)
            except Exception as e:
                self.hook_failed(state.spec, ",".join(t.name for t in targets[:3]), e)
                continue
            if res is not None:
                guards.append(res)
                if res.skip:
                    skip = True
                    break
        if skip:
            self._no_update("nan_guard")
        self._submit_check(raw, guards, skip)
        if sampled:
            try:
                self._stats.final(raw, hooks_ran=bool(plan.pre) or skip, guards=guards, touched=touched)
            except Exception as e:  # the snapshot then shows what it has (nulls)
                self._telemetry_failed("the final gradient statistics", e)
        if self._flight is not None:
            try:
                self._flight_general(raw, sampled, bool(plan.pre) or skip)
            except Exception as e:  # never take training down for telemetry
                self._telemetry_failed("the flight recorder", e)
        clock.spend(time.perf_counter() - t0)

    def _no_update(self, reason: str, *, report: bool = True) -> None:
        """The step makes no update: every gradient set to None, the optimizer's parameters that
        are not watched here too (a scalar outside the model, the rest of a model of which a part
        was attached); a ``step_skipped`` event."""
        for p in self._at.tensors:
            p.grad = None
        if self._at.optimizer is not None:
            for group in self._at.optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None
        if report:
            self._events.emit("step_skipped", step=self._clock.step + 1, reason=reason)

    def _flight_norms(
        self, index: list[int], raw: Any, final: Any, final_index: list[int] | None = None
    ) -> None:
        """The step's norms into the flight recorder (:mod:`inspector.stats.flight`)."""
        try:
            self._flight.norms(self._clock.step + 1, index, raw, final, final_index)  # type: ignore[union-attr]
        except Exception as e:  # never take training down for telemetry
            self._telemetry_failed("the flight recorder", e)

    def _flight_general(self, raw: RawRead, sampled: bool, hooks_ran: bool) -> None:
        """The flight recorder's norms where the probe alone did not run: the raw norms the step
        took; the final ones from the sampled statistics, or one more norm where a hook ran."""
        if not raw.index:
            return
        final: Any = None
        final_index: list[int] | None = None
        if hooks_ran:
            taken = self._stats.final_norms() if sampled else None
            if taken is not None:  # (a hook may have dropped a gradient: its entry is absent)
                final, final_index = taken
            else:
                fin = [(i, g) for i, p in enumerate(self._at.tensors) if (g := p.grad) is not None]
                final_index = [i for i, _ in fin]
                final = self._stats.norms_now([g for _, g in fin]) if fin else []
        self._flight_norms(raw.index, raw.norm_tensors if sampled else raw.probe, final, final_index)

    def _telemetry_failed(self, what: str, err: BaseException) -> None:
        """Our statistics raised inside the user's ``optimizer.step()``: report it (once per part and
        error type: it would recur every step) and go on, the hooks applied as ever."""
        key = f"{what}: {type(err).__name__}"  # (a message may vary from step to step: an OOM's sizes)
        if key not in self._telemetry_seen:
            self._telemetry_seen.add(key)
            message = f"{what} could not be taken: {describe_error(err)}"
            self._events.emit("telemetry_error", message=message, step=self._clock.step + 1)

    def _submit_check(self, raw: RawRead, guards: list[GuardResult], skipped: bool) -> None:
        """Start this step's NaN/Inf check on its way to the host (read at a later boundary)."""
        check, pack = build_check(self._clock.step + 1, raw, guards, skipped, self._hooks, self._at.layout)

        def consume(values: dict[str, list[float]]) -> None:
            check.values = values
            if self._distributed:
                self.sync.add_check(check)  # type: ignore[union-attr]  # reported after the exchange
            elif check.plain and math.isfinite(sum(values.get("probe", ()))):
                self._nonfinite.step(NO_FINDINGS, check.step)  # the usual case: every gradient finite
            else:
                self._nonfinite.step(check.findings(), check.step)

        self._deferred.submit(check.step, pack if pack else None, consume)

    def drain_deferred(self, *, wait: bool = False, before: int | None = None) -> None:
        """Consume what reached the host: earlier steps' NaN/Inf checks and records (``wait``: all)."""
        try:
            self._deferred.drain(before=before, wait=wait)
        except Exception as e:  # never take training down for telemetry
            self._deferred.clear()
            self._events.emit(
                "telemetry_error", message=f"a deferred check could not be read: {describe_error(e)}"
            )

    def flush_late(self) -> None:
        """Send the records made after step N's boundary (before the next forward) as step N's."""
        if self._flight is not None:
            acc = self._records.late.get("loss")
            if acc is not None and not self._records.discard_late:
                try:
                    self._flight.late_loss(self._clock.step, acc[0] if acc[1] == 1 else acc[0] / acc[1])
                except Exception as e:  # never take training down for telemetry
                    self._telemetry_failed("the flight recorder", e)
        self._records.flush_late(self._clock.step)

    def between_batches(self) -> bool:
        """The training thread draws and drops a skipped window's batches (``insp.batches``,
        inspector/whatif/skip.py), lock held. A window is reached between two steps (a rewind
        leaves the run at a boundary), so there this is a safe point as a boundary is: pending
        edits and requests are carried out (a rewind included), and a pause holds here. False
        once the Inspector is closed: the dropping ends."""
        gate = self._gate
        if gate.closed:
            return False
        if self._distributed or self._clock.under_way or not gate.on_training_thread():
            return True
        if self._reg.pending or self._branches.queued:
            self.apply_edits(torch_ok=True)
        if gate.should_hold() and self._single_from != self._clock.step:
            gate.hold(lambda: self.apply_edits(torch_ok=True))
            if gate.should_hold():  # let go for a single step: it runs before the next hold
                self._single_from = self._clock.step
        return not gate.closed

    # ================================================================= the boundary
    def boundary(self) -> None:
        """Step N is complete: report earlier steps' deferred checks, publish its snapshot, apply
        pending edits, honour a pause."""
        t0 = time.perf_counter()
        clock, gate = self._clock, self._gate
        dist = self._distributed
        # steps before this one whose check reached the host (never a wait, except under
        # torch.distributed: every rank reads the previous step's, for the exchange); before an
        # automatic checkpoint, this step's own too, waited for (the copy to host memory waits
        # for the device anyway): a step with non-finite gradients is known before it is kept
        if self._deferred:
            if self._branches.due(clock.step + 1):
                self.drain_deferred(before=clock.step + 2, wait=True)
            else:
                self.drain_deferred(before=clock.step + 1, wait=dist)
        with self._lock:
            step, sampled = clock.complete()
            self._hist_chosen = None  # (the next step chooses its own, even under a rewound number)
            self._dropped = False
            self._single_from = None  # (a single step let go while dropping batches: this one)
            events = self._events.take_step()
            rec = self._records.take_current()
            if sampled:
                # the config this step ran with: once the lock is released, a pre_step-only edit
                # from another thread may apply (no step is under way) and must not reach this
                # step's snapshot
                version, states = self._reg.version, list(self._hooks.states.values())
        if self._flight is not None:
            try:
                acc = rec.get("loss")
                self._flight.end_step(
                    step, None if acc is None else acc[0] if acc[1] == 1 else acc[0] / acc[1]
                )
            except Exception as e:  # never take training down for telemetry
                self._telemetry_failed("the flight recorder", e)
        now = time.perf_counter()
        spent = clock.take_spent() + self._hooks.take_spent() + (now - t0)
        self._cadence.observe(step, sampled, spent, clock.wall(now))
        t1 = time.perf_counter()
        hold = False
        self._snap = None
        if sampled or dist:
            hold = self._publish_step(
                step, sampled, dist, events, rec, version if sampled else 0, states if sampled else []
            )
        else:  # an unsampled step: its records wait (scalars.Recorder), its check is on its way
            self._stats.end_step()
            self._hooks.end_step()
            if rec:
                self._records.defer(step, rec)
        self._cadence.observe_late(sampled, time.perf_counter() - t1)  # (the snapshot: this step's cost)
        rules = self.rules if self.rules is not None and self.rules.active else None
        if dist:
            if rules is not None or self._branches.every is not None:
                with gate.cond:  # (the rules' state is shared with the server's threads)
                    if rules is not None:  # what the exchange brought from rank 0: every rank acts here
                        rules.boundary(step, self._snap, events)
                    self._branches.scheduled(step)  # checkpoint_every: taken here, on every rank
            self.sync.hold(step, hold)  # type: ignore[union-attr]
        else:
            if gate.should_hold():
                # about to hold: what this step found and recorded is shown now (before the wait,
                # which holds the lock; the drain takes it itself, and waits for a copy without it)
                self._records.flush_pending()
                self.drain_deferred(wait=True)
            with gate.cond:
                # the next step's sampling is decided before edits and requests are carried out:
                # a checkpoint taken here holds it, as one taken between steps does, and a rewind
                # here restores it, nothing deciding again after it
                clock.decide_next(self._cadence.is_sampled(step + 1))
                if rules is not None:  # (a rewind it asks for is carried out here, as a held one is)
                    rules.boundary(step, self._snap, events)
                self._branches.scheduled(step)  # checkpoint_every: queued, taken just below
                self.apply_edits(torch_ok=True)
                gate.hold(lambda: self.apply_edits(torch_ok=True))
        clock.mark_boundary()

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
            sync = self.sync
            assert sync is not None
            exchanged.append(sync.exchange(step, sampled, first=True, local_norms=local_norms))
            events.extend(self._events.take_step())  # events the exchange produced belong to this step
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
                    lr=learning_rates(self._at.optimizer),
                    sampled_every=self._cadence.k,
                    overhead=self._cadence.overhead,
                )
            except Exception as e:  # never take training down for telemetry
                self._events.emit(
                    "telemetry_error",
                    message=f"the snapshot could not be built: {describe_error(e)}",
                    step=step,
                )
            self._snap = snap
            for what, err in self._stats.take_failures():  # an instrument turned off (stats.optim_state)
                self._telemetry_failed(what, err)
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


class _ProbeCheck:
    """Consumes an unsampled step's probe (see ``pre_step_work``): the step's NaN/Inf findings."""

    __slots__ = ("nonfinite", "step", "index")

    def __init__(self, nonfinite: NonfiniteReport, step: int, index: list[int]) -> None:
        self.nonfinite, self.step, self.index = nonfinite, step, index

    def __call__(self, probe: list[float]) -> None:
        if math.isfinite(sum(probe)):  # the usual case: every gradient finite
            self.nonfinite.step(NO_FINDINGS, self.step)
            return
        check = Check(step=self.step, index=self.index, exact=False)
        check.values = {"probe": probe}
        self.nonfinite.step(check.findings(), self.step)
