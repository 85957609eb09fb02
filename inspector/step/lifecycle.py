"""The step lifecycle of an :class:`~inspector.Inspector`: when edits apply, the step hooks, the
``pre_step`` work and the boundary (with its pause hold, and its exchange under ``torch.distributed``).

:class:`StepLifecycle` is the Inspector's base class: the Inspector (``inspector.py``) holds
most of the public API and builds its parts; this class declares and initialises the step and
control state, holds what runs inside the user's ``optimizer.step()`` and root forward, and the
public calls for loops that must tell us where a step starts or ends (``begin_step``,
``mark_step``, ``finish``). In order, one step:

1. ``_on_forward_pre`` (the root module's forward pre-hook): the step is under way; late
   records of the previous step are flushed; pending edits that register torch hooks apply.
2. the backward: our ``post_accumulate`` and ``module`` hooks (:mod:`inspector.hooks.torch_hooks`).
3. ``_on_step_pre`` (the optimizer's step pre-hook): ``_pre_step_work``, after the closure's
   backward when there is one: raw statistics and NaN/Inf findings, every ``pre_step`` hook,
   final statistics (:mod:`inspector.stats.step_stats`).
4. the optimizer's update.
5. ``_boundary`` (its step post-hook, :mod:`inspector.step.boundary`): the cadence accounts the step,
   the snapshot is built and published, pending edits apply, a pause holds the thread.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from typing import Any

import torch
from torch import Tensor, nn

from .. import distributed
from ..feed import Feed
from ..hooks import amp
from ..hooks.edits import Edits
from ..hooks.ops import GuardResult, apply_pre_step
from ..hooks.registry import Change, Registry
from ..hooks.torch_hooks import TorchHooks
from ..stats.deferred import Check, Deferred, build_check
from ..stats.histsel import HistSelection
from ..stats.nonfinite import NO_FINDINGS, NonfiniteReport
from ..stats.step_stats import RawRead, StepStats
from ..stats.telemetry import Cadence
from ..stats.tensor_stats import foreach_norm
from ..whatif.checkpoints import Checkpoints
from ..wire.errors import HookError, InspectorError, describe_error, shown
from ..wire.records import HookSpec, event_fields
from .boundary import StepBoundary
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


class StepLifecycle(StepBoundary):
    """The step-time half of an Inspector (see the module docstring); state set by ``Inspector.__init__``."""

    params: list[str]
    rank: int
    _root: nn.Module | None
    _tensors: list[Tensor]
    _optimizer: torch.optim.Optimizer | None
    _scaler: Any
    _lock: threading.RLock
    _cond: threading.Condition
    _dist: distributed.ControlPlane | None
    _reg: Registry
    _feed: Feed
    _cadence: Cadence
    _hooks: TorchHooks
    _edits: Edits
    _stats: StepStats
    _nonfinite: NonfiniteReport
    _hist: HistSelection
    _layout: Any  # sharded.Layout under FSDP2, else None
    # step state
    _step: int  # completed optimizer steps
    _under_way: bool  # between the first root forward with gradients on of a step and its boundary
    _sampled: bool  # the step under way takes the full statistics
    _sampled_count: int  # sampled steps so far, the one under way included
    _train_tid: int  # the training thread: the one that runs optimizer.step()
    _t_ours: float  # seconds inside the inspector during the step under way
    _last_boundary: float | None  # perf_counter() at the last boundary (None after a pause)
    _seq: int  # the last event's seq
    _step_events: list[dict[str, Any]]  # events of the step under way
    _scale_mark: tuple[int, int] | None  # which write of the scaler's scale the last check saw
    _branches: Checkpoints  # the Inspector's checkpoints (scaler state they read or load late)
    _fused_skip: bool  # the scaler told the fused optimizer stepping now to skip this update
    _skip_known: bool  # the iteration under way was skipped, and reported at its boundary
    _deferred: Deferred  # device values on their way to the host (NaN/Inf checks, records)
    _dist_checks: list[Check]  # under torch.distributed: checks read at this boundary, for the exchange
    _hist_next: list[int]  # under FSDP2: the histograms of the next step, rank 0's choice (exchanged)
    _hist_chosen: list[int] | None  # the step under way's histograms, once chosen (closures or not)
    _records: Recorder  # recorded scalars: the step under way's, late ones, unsampled steps' waiting
    _telemetry_seen: set[str]  # statistics failures reported so far (each part and error type once)
    # control
    _paused: bool
    _credit: int  # single steps still allowed while paused
    _waiting: bool  # the training thread is held at a boundary
    _finished: bool
    _closed: bool

    def _init_step_state(self) -> None:
        """The state declared above, as it is before the first step."""
        self._step = 0
        self._under_way = False
        self._sampled = True  # step 1 is always sampled
        self._sampled_count = 1
        self._train_tid = threading.get_ident()
        self._t_ours = 0.0
        self._last_boundary = None
        self._seq = 0
        self._step_events = []
        self._scale_mark = None
        self._unmarked = 0  # backward passes before the first boundary, without an optimizer
        self._bw_queued = False  # a callback at the end of the backward under way is queued
        # the norms the last backward left, and the scale they are scaled by (sampled steps)
        self._bw: tuple[list[Tensor], Tensor | None] | None = None
        self._fused_skip = False
        self._skip_known = False
        self._dist_checks = []
        self._hist_next = []
        self._hist_chosen = None
        self._telemetry_seen = set()
        self._paused = False
        self._credit = 0
        self._waiting = False
        self._finished = False
        self._closed = False

    # ================================================================= loops that need telling
    def begin_step(self) -> None:
        """Mark a step as under way, as the root module's forward pre-hook does.

        Only needed in loops that never call the attached root module itself (they call a
        submodule): records made after this attach to the coming step, and edits that register
        torch hooks are applied now, before the backward.
        """
        self._on_forward_pre(self._root, ())  # type: ignore[arg-type]

    def finish(self) -> None:
        """Training is over (state ``finished``); edits from other threads apply at once from now.

        ``wait()`` does this and then blocks; call ``finish()`` to keep serving without blocking.
        A last iteration that the scaler skipped is reported now (no forward comes after it).
        """
        self._check_scaler_skip()
        with self._cond:
            self._finished = True
            self._train_tid = threading.get_ident()
            self._drain_locked(torch_ok=True)
        self._flush_late()
        self._records.flush_pending()
        self._drain_deferred(wait=True)  # the last steps' NaN/Inf checks and records

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
        if self._optimizer is not None:
            raise InspectorError(
                "mark_step() is for loops without a torch optimizer: here optimizer.step() is the boundary"
            )
        self._train_tid = threading.get_ident()
        self._pre_step_work()
        self._boundary()

    def _training_state(self) -> dict[str, Any]:
        with self._lock:
            s = "finished" if (self._finished or self._closed) else ("paused" if self._paused else "running")
            return {"state": s, "step": self._step, "held": self._waiting}

    def _publish_training(self) -> dict[str, Any]:
        """Tell subscribers the training state changed (a ``training`` record: ``state``, ``step``, ``held``)."""
        state = self._training_state()
        self._feed.publish("training", state)
        return state

    # ================================================================= edits: where and when they apply
    def _submit(self, change: Change) -> None:
        """A validated change was queued: apply it now where DESIGN.md allows (lock held)."""
        on_train = threading.get_ident() == self._train_tid
        if self._dist is not None and not self._dist.broken:
            # one config for the job: an edit from the training thread is made on every rank (the
            # script is the same everywhere), so it is a collective: rank 0's pending changes (its
            # dashboard's, then this one) go to every rank and apply now, in the same order
            # everywhere; rank 0's other edits travel at the next boundary
            if on_train:
                self._dist_sync_edits()
            elif self._waiting:
                self._cond.notify_all()
            return
        if on_train or (self._finished and not self._closed):
            self._drain_locked(torch_ok=True)
        elif self._waiting:
            self._cond.notify_all()  # the paused training thread applies it
        elif (
            self._root is not None
            and not self._under_way
            and not any(c.touches_torch() for c in self._reg.pending)
        ):
            self._drain_locked(torch_ok=False)  # pre_step only, between steps: safe from this thread

    def _drain_locked(self, *, torch_ok: bool) -> None:
        self._edits.drain(self._step + 1, torch_ok=torch_ok)

    def _hook_failed(self, spec: HookSpec, param: str | None, err: BaseException) -> None:
        """A hook raised: disable it at once, report it, and let training go on."""
        with self._lock:
            self._edits.disable_failed(spec, param, describe_error(err), self._step + 1)

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        with self._lock:
            self._seq += 1
            ev = {"seq": self._seq, "kind": kind, "time": time.time(), **event_fields(fields)}
            self._step_events.append(ev)
        self._feed.publish("event", ev)
        return ev

    # ================================================================= the step hooks
    def _mark_under_way(self) -> None:
        with self._lock:
            self._under_way = True
        self._flush_late()

    def _on_backward(self, param: Tensor) -> None:
        """A backward pass (a hook on one parameter). A dict of tensors has no forward of ours: its
        first backward of a step marks it under way. On a sampled step, the gradients' norm as the
        backward leaves them is taken at its end (``_at_backward_end``). Without an optimizer,
        backward passes that no step boundary ever follows are a loop that does not call
        ``mark_step()``: said once."""
        if not self._under_way and self._root is None:
            self._mark_under_way()
        self._backward_started()
        if self._optimizer is None and self._step == 0 and not self._closed:
            self._unmarked += 1
            if self._unmarked == NO_BOUNDARY_AFTER:
                message = (
                    f"{NO_BOUNDARY_AFTER} backward passes and no step boundary: without a torch optimizer, "
                    "call insp.mark_step() after backward() and before your own update (help(insp.mark_step) "
                    "shows the loop); until then no statistics are taken and no pre_step hook runs"
                )
                self._event("no_step_boundary", message=message, step=0)
                warnings.warn(f"gradient-inspector: {message}", RuntimeWarning, stacklevel=2)

    def _on_forward_out(self, module: nn.Module, args: Any, output: Any) -> None:
        """The root's forward returned: on a sampled step, its output's gradient hook tells when
        the backward starts (``_backward_started``). Nothing on other steps."""
        if not (self._sampled and self._dist is None and self._layout is None and torch.is_grad_enabled()):
            return
        for t in _output_tensors(output):
            if t.requires_grad:
                t.register_hook(self._output_grad)
                return  # one is enough: the backward through it starts the callback

    def _output_grad(self, grad: Tensor) -> None:
        self._backward_started()

    def _backward_started(self) -> None:
        """A backward is running (the engine is): on a sampled step, queue ``_at_backward_end``
        once, to run when this backward has accumulated every gradient."""
        if self._sampled and not self._bw_queued and self._dist is None and self._layout is None:
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
        optimizer's ``grad_scale`` taken at the step."""
        self._bw_queued = False
        try:
            grads = [
                g for g in (t.grad for t in self._tensors) if g is not None and g.layout == torch.strided
            ]
            scale = getattr(self._scaler, "_scale", None)  # the scale this backward's loss was scaled by
            self._bw = (foreach_norm(grads), scale if isinstance(scale, Tensor) else None) if grads else None
        except Exception as e:  # never take training down for telemetry
            self._telemetry_failed("the gradient norm at the end of backward", e)

    def _claim_training_thread(self) -> None:
        """This thread trains. Set under the lock: an edit from another thread holds the lock while it
        decides whether it is on the training thread (and then registers torch hooks), so it can never
        register one while this thread's forward runs (the model may have been attached elsewhere)."""
        tid = threading.get_ident()
        if self._train_tid != tid:
            with self._lock:
                self._train_tid = tid

    def _on_forward_pre(self, module: nn.Module, args: Any) -> None:
        if (
            self._under_way
            and self._scaler is None
            and not self._skip_known
            and not (self._reg.pending or self._hooks.dirty)
        ):
            return  # a later forward of the step under way (accumulation): nothing to do
        t0 = time.perf_counter()
        self._claim_training_thread()
        self._check_scaler_skip()
        # a forward with gradients off (validation under no_grad or inference_mode) is no step:
        # between two steps it leaves training between steps (a checkpoint is taken at once, a
        # record() still belongs to the step just completed)
        if not self._under_way and torch.is_grad_enabled():
            self._mark_under_way()
            if self._hooks.watches_frozen:  # a parameter unfrozen since (gradual unfreezing)
                with self._lock:
                    self._hooks.unfrozen(self._reg.applied, self._reg.fns)
        if self._dist is not None and not self._dist.broken:
            if self._hooks.dirty:  # pending edits wait for the boundary exchange
                with self._lock:
                    self._hooks.sync()
        elif self._reg.pending or self._hooks.dirty:
            with self._lock:
                self._drain_locked(torch_ok=True)
        self._t_ours += time.perf_counter() - t0

    def _on_step_pre(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        t0 = time.perf_counter()
        self._claim_training_thread()
        fused = amp.fused_scaling(optimizer)
        if fused is not None:  # a fused optimizer under a GradScaler (see inspector.hooks.amp)
            grad_scale, skipped = fused
            if skipped:  # its kernel skips this update, as GradScaler skips an unfused step(): so do we
                self._fused_skip = True
                self._t_ours += time.perf_counter() - t0
                return None  # (GradScaler refuses closures)
            if grad_scale is not None:
                amp.unscale_(optimizer, grad_scale)  # our stats and hooks see unscaled gradients
                if self._bw is not None and self._scaler is None:  # (an attached one's is taken already)
                    self._bw = (self._bw[0], grad_scale)
        if not self._under_way:
            # nothing marked this step (a loop that calls a submodule, Lightning's training_step, a
            # root compiled in place): records made since the last boundary were late ones
            self._mark_under_way()
        if self._sampled:
            try:
                self._stats.keep_params()  # for the update-to-parameter ratio
            except Exception as e:  # never take training down for telemetry
                self._telemetry_failed("the parameters' sample for the update ratio", e)
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        self._t_ours += time.perf_counter() - t0
        if closure is None:
            self._pre_step_work()
            return None

        def wrapped_closure() -> Any:
            out = closure()
            self._pre_step_work()  # after the closure's backward, once per evaluation
            return out

        if len(args) > 1:
            return (args[0], wrapped_closure, *args[2:]), kwargs
        return args, {**kwargs, "closure": wrapped_closure}

    def _on_step_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._fused_skip:  # no update ran: not a step boundary
            self._fused_skip = False
            self._skip_iteration()
            self._skip_known = True
            return
        self._boundary()

    def _check_scaler_skip(self) -> None:
        """At a forward, ``finish()`` and ``close()``: was the iteration under way skipped by the scaler?

        It was when no boundary came since the last check and the scaler's ``update()`` wrote its
        scale meanwhile (see :mod:`inspector.hooks.amp`): told by the scale tensor's version counter, with
        no read of the device.
        """
        written = False
        if self._scaler is not None:
            mark = amp.scale_mark(self._scaler)
            last, self._scale_mark = self._scale_mark, mark
            written = self._under_way and amp.scale_written(last, mark)
        if self._skip_known:  # a fused optimizer's skip, reported at its boundary
            self._skip_known = False
            with self._lock:
                self._records.current = {}  # what was recorded after that boundary belongs to the skipped iteration
        elif written:
            self._skip_iteration()
        if self._branches.scaler_pending and self._branches.settle_scaler():
            # a rewind's scaler state, loaded now that the abandoned iteration's update() ran: a
            # write of the scale that is no skipped step
            self._scale_mark = amp.scale_mark(self._scaler)

    def _skip_iteration(self) -> None:
        """The iteration under way made no update (the scaler found inf/NaN): it is no step. Report it,
        and forget what it recorded and what its backward collected, so the next step shows its own."""
        with self._lock:
            self._records.current = {}
        self._hooks.end_step()
        self._stats.end_step()
        self._event("step_skipped", step=self._step + 1, reason="scaler")

    # ================================================================= the step's work
    def _pre_step_work(self) -> None:
        """Raw statistics, every pre_step hook, final statistics and the step's deferred NaN/Inf
        check (once per step or per closure call); nothing is read on the host here, except by an
        enabled ``nan_guard`` ``skip`` (see :mod:`inspector.hooks.ops`)."""
        t0 = time.perf_counter()
        hooks = self._hooks
        plan, sampled = hooks.plan, self._sampled
        if not (
            sampled
            or plan.pre
            or hooks.mod_bad
            or hooks.post_found
            or hooks.per_rank
            or self._layout is not None
            or self._dist is not None
        ):
            # the usual unsampled step: nothing but the probe to check (the same check build_check
            # makes, without its segments)
            try:
                probe = self._stats.probe()
            except Exception as e:  # never take training down for telemetry
                self._telemetry_failed("the NaN/Inf probe", e)
                probe = None
            if probe is not None:
                self._deferred.submit_flat(self._step + 1, probe[1], _ProbeCheck(self, probe[0]))
                self._t_ours += time.perf_counter() - t0
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
            elif self._layout is not None and self._dist is not None and not self._dist.broken:
                hist = self._hist_next  # every rank takes the same histograms (collectives under FSDP2)
            elif self._hist_chosen is not None:  # a closure's second evaluation: the same
                hist = self._hist_chosen
            else:
                hist = self._hist.due(self._sampled_count)
                if hist and touched and self._layout is None:  # (an edited one's raw histogram is of a copy)
                    hist = self._hist.within_budget(hist, touched, self._tensors)
                self._hist_chosen = hist
        try:
            raw = self._stats.raw(self._hooks, sampled, hist, touched)
        except Exception as e:  # never take training down for telemetry: the hooks still run
            self._telemetry_failed("the raw gradient statistics", e)
            raw, sampled = RawRead([], [], False), False
        raw.backward, self._bw = (self._bw if sampled else None), None
        skip = False
        guards: list[GuardResult] = []
        for state, targets in plan.pre:
            try:
                res = apply_pre_step(state, list(targets), sampled)
            except Exception as e:
                self._hook_failed(state.spec, ",".join(t.name for t in targets[:3]), e)
                continue
            if res is not None:
                guards.append(res)
                if res.skip:
                    skip = True
                    break
        if skip:
            # the whole step: the optimizer's parameters that are not watched here too (a scalar
            # outside the model, the rest of a model of which a part was attached)
            for p in self._tensors:
                p.grad = None
            if self._optimizer is not None:
                for group in self._optimizer.param_groups:
                    for p in group["params"]:
                        p.grad = None
            self._event("step_skipped", step=self._step + 1, reason="nan_guard")
        self._submit_check(raw, guards, skip)
        if sampled:
            try:
                self._stats.final(raw, hooks_ran=bool(plan.pre) or skip, guards=guards, touched=touched)
            except Exception as e:  # the snapshot then shows what it has (nulls)
                self._telemetry_failed("the final gradient statistics", e)
        self._t_ours += time.perf_counter() - t0

    def _telemetry_failed(self, what: str, err: BaseException) -> None:
        """Our statistics raised inside the user's ``optimizer.step()``: report it (once per part and
        error type: it would recur every step) and go on, the hooks applied as ever."""
        key = f"{what}: {type(err).__name__}"  # (a message may vary from step to step: an OOM's sizes)
        if key not in self._telemetry_seen:
            self._telemetry_seen.add(key)
            message = f"{what} could not be taken: {describe_error(err)}"
            self._event("telemetry_error", message=message, step=self._step + 1)

    def _submit_check(self, raw: RawRead, guards: list[GuardResult], skipped: bool) -> None:
        """Start this step's NaN/Inf check on its way to the host (read at a later boundary)."""
        check, pack = build_check(self._step + 1, raw, guards, skipped, self._hooks, self._layout)

        def consume(values: dict[str, list[float]]) -> None:
            check.values = values
            if self._dist is not None and not self._dist.broken:
                self._dist_checks.append(check)  # reported after the exchange, with the ranks
            elif check.plain and math.isfinite(sum(values.get("probe", ()))):
                self._nonfinite.step(NO_FINDINGS, check.step)  # the usual case: every gradient finite
            else:
                self._nonfinite.step(check.findings(), check.step)

        self._deferred.submit(check.step, pack if pack else None, consume)

    def _drain_deferred(self, *, wait: bool = False, before: int | None = None) -> None:
        """Consume what reached the host: earlier steps' NaN/Inf checks and records (``wait``: all)."""
        try:
            self._deferred.drain(before=before, wait=wait)
        except Exception as e:  # never take training down for telemetry
            self._deferred.clear()
            self._event("telemetry_error", message=f"a deferred check could not be read: {describe_error(e)}")

    def _flush_late(self) -> None:
        """Send the records made after step N's boundary (before the next forward) as step N's."""
        self._records.flush_late(self._step)


class _ProbeCheck:
    """Consumes an unsampled step's probe (see ``_pre_step_work``): the step's NaN/Inf findings."""

    __slots__ = ("insp", "step", "index")

    def __init__(self, insp: StepLifecycle, index: list[int]) -> None:
        self.insp, self.step, self.index = insp, insp._step + 1, index

    def __call__(self, probe: list[float]) -> None:
        if math.isfinite(sum(probe)):  # the usual case: every gradient finite
            self.insp._nonfinite.step(NO_FINDINGS, self.step)
            return
        check = Check(step=self.step, index=self.index, exact=False)
        check.values = {"probe": probe}
        self.insp._nonfinite.step(check.findings(), self.step)
