"""The gradient noise scale, live: ``B_simple = tr(Sigma) / |G|^2`` (McCandlish et al., 2018,
"An Empirical Model of Large-Batch Training", appendix A), for the whole model and per group.

``G`` is the true gradient (of the loss over the whole data distribution) and ``Sigma`` the
covariance of the per-example gradients. A mini-batch of ``B`` examples has
``E|G_B|^2 = |G|^2 + tr(Sigma) / B``, so two batch sizes ``B_small < B_big`` measured at the same
parameters give unbiased estimates of both::

    |G|^2     ~= (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~= (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

Each step's two estimates are noisy (either may come out negative): each gets an exponential
moving average over the sampled steps (smoothing ``ema``, bias-corrected as Adam's moments are),
and ``B_simple`` is the ratio of the two averages, taken only then (the ratio of averages, not
the average of ratios, which would be biased). Where the averaged ``|G|^2`` or trace is not
positive yet, ``b_simple`` is null.

Where the two batch sizes come from:

- **DDP** (``per_rank_stats`` on): the small batch is one micro-batch on one rank, taken from the
  same backward increments as under accumulation below (before DDP's all-reduce, which runs after
  a gradient is accumulated), ``|G_small|^2 = K * sum_k |delta_k|^2`` on each rank, averaged over
  the ranks in the boundary's one collective (one more column per parameter in the rows it
  exchanges anyway, :mod:`inspector.distributed`); ``|G_big|^2`` is that of the averaged,
  accumulated gradient as the last backward left it (after DDP's all-reduce, before the user's
  own code between ``backward()`` and ``step()``: a ``clip_grad_norm_`` of the loop's own). ``B_small`` is the micro-batch, ``B_big`` the
  world size times ``K`` times it (``K = 1``: no accumulation needed). The per-rank norms of the
  snapshot's ``ranks`` are not used: under ``no_sync()`` accumulation they are not the local
  accumulated gradient's alone.
- **Gradient accumulation** (one process, ``K >= 2`` backward passes per step): a tensor hook
  (``param.register_hook``, which receives this backward's gradient before it is added to
  ``.grad``) takes the squared norm of each backward's increment ``delta_k``. With the usual
  ``loss / K`` scaling, ``delta_k = g_k / K`` where ``g_k`` is the mean gradient of micro-batch
  ``k`` (``b`` examples) and the accumulated gradient ``sum_k delta_k`` is the mean gradient of the
  step's ``K b`` examples. So ``|G_small|^2 = mean_k |g_k|^2 = K * sum_k |delta_k|^2`` (``B_small =
  b``) and ``|G_big|^2 = |.grad|^2`` (``B_big = K b``). A loss summed over the micro-batches (no
  ``/ K``) makes both ``K^2`` times larger: ``trace_sigma`` and ``g_sq`` are then in those units, and
  ``b_simple`` (a ratio) is the same. ``K`` is counted per step: a backward pass that reached any
  parameter's hook, counted where it ends (an autograd engine callback queued from inside it, once
  per graph task; the root's output hook sees the outer task of a reentrant checkpoint's nested
  ones), so a parameter unused, or used by some micro-batches only, does not change it (its
  increment is zero where unused). Under a GradScaler the increments are unscaled, in the units
  of the big batch: attached (``scaler=``), each is divided by the square of the scale it was
  scaled by; not attached, a fused optimizer's ``grad_scale`` (handed at its step, as the step
  pre-hook unscales its gradients) divides their sums on the device. An unfused optimizer under a
  scaler not attached leaves both batches scaled: ``b_simple`` is right, ``trace_sigma`` and
  ``g_sq`` are the scale's square times larger.
- **Uneven micro-batches** (sizes ``b_k``, each loss its mean over its examples, times ``1 / K``):
  ``E|g_k|^2 = |G|^2 + tr(Sigma) / b_k``, so ``K * sum_k |delta_k|^2`` has ``tr(Sigma) / H``, ``H``
  the harmonic mean of the sizes, and the accumulated gradient (each micro-batch weighed alike)
  ``tr(Sigma) / (K H)``: ``B_small = H``, ``B_big = K H``. The sizes are inferred (below), one per
  forward: with as many forwards as backward passes; else uneven sizes are unknown and the step is
  left out (``step_reason`` says so).
- **FSDP2** (``per_rank_stats`` on): as under DDP, each rank's gradient of one backward before the
  collective is the small batch. FSDP2 computes it on a parameter's unsharded copy (the full
  tensor its all-gather fills) and then reduce-scatters it into the shard's ``.grad``, so the
  tensor hooks go on those unsharded parameters (:func:`inspector.stats.sharded.backward_sources`),
  which FSDP2 keeps from a module's first all-gather on: a sampled step before every module has
  been gathered once is not measured. ``|G_big|^2`` is the reduced gradient's as the last backward
  left it, from the shards' sums of squares the snapshot's one collective combines; ``B_big`` is the world size times ``K`` times the
  micro-batch, with or without ``set_requires_gradient_sync(False)`` between micro-batches.
- **One process, one backward per step**: there is no second batch size; the estimate is null and
  ``reason`` says what it needs.

The batch size (examples per micro-batch on one rank) is ``attach(..., batch_size=N)`` (every
micro-batch that size), or else inferred from the leading dimension of the first tensor argument
of each forward of the model on the step (``batch_source`` says which; sequences count as
examples for a ``(B, T)`` token batch; ``sizes`` lists them where they differ).

Cost: everything here runs on sampled steps only. The tensor hooks are registered by the first
forward of a sampled step (the root module's forward pre-hook, which otherwise only looks at a
flag; its forward hook puts one on the output of a sampled step's forwards) and removed at its
boundary (in one process, after a sampled step with one backward pass, only the first
parameter's, which with the output's only counts the backward passes); the per-parameter sums
of the increments stay on the device and ride in the snapshot's one transfer (one vector). The
averages are kept on the host, from the values that transfer brought (a few floats per group).
Without a root module (a dict of tensors, a model compiled in place) the tensor hooks stay
registered, and return at once on unsampled steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..hooks.owned import OwnedHook, hide_from_copies
from ..wire.errors import AttachError, describe_error
from .groups import Groups
from .telemetry import Pack
from .tensor_stats import dense, sq_norm

__all__ = ["DEFAULT_EMA", "NoiseScale", "check_noise_options"]

# the smoothing per sampled step: a span of about 1 / (1 - 0.95) = 20 sampled steps. Each step's
# estimate is noisy, the more so the fewer independent directions the gradient has; 20 samples
# bring its relative spread down about 4.5x while the LR schedule (which B_simple depends on)
# changes little over them
DEFAULT_EMA = 0.95


def check_noise_options(noise_scale: Any, batch_size: Any, noise_ema: Any) -> None:
    """Validate ``attach``'s noise-scale options.

    Raises:
        AttachError (a ``TypeError``): a value of the wrong type.
        ValueError: a value out of range.
    """
    if not isinstance(noise_scale, bool):
        raise AttachError(f"noise_scale must be True or False (got {noise_scale!r})")
    if batch_size is not None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int):
            raise AttachError(
                f"batch_size must be a positive integer (examples per micro-batch on one rank) or None "
                f"(got {batch_size!r})"
            )
        if batch_size < 1:
            raise ValueError(
                f"batch_size must be a positive integer (examples per micro-batch on one rank), got {batch_size}"
            )
    if isinstance(noise_ema, bool) or not isinstance(noise_ema, int | float):
        raise AttachError(f"noise_ema must be a number in [0, 1) (got {noise_ema!r})")
    if not 0 <= noise_ema < 1:
        raise ValueError(f"noise_ema must be in [0, 1): the smoothing per sampled step (got {noise_ema})")


def _first_tensor(args: Any) -> Tensor | None:
    if isinstance(args, Tensor):
        return args
    if isinstance(args, list | tuple):
        for a in args:
            t = _first_tensor(a)
            if t is not None:
                return t
    if isinstance(args, dict):
        for a in args.values():
            t = _first_tensor(a)
            if t is not None:
                return t
    return None


def _grad_output(out: Any) -> Tensor | None:
    """The first tensor that requires grad in a forward's output (nested tuples, lists, dicts)."""
    if isinstance(out, Tensor):
        return out if out.requires_grad else None
    items = out.values() if isinstance(out, dict) else out if isinstance(out, list | tuple) else ()
    for o in items:
        t = _grad_output(o)
        if t is not None:
            return t
    return None


_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)


def _graph_task() -> int:
    """The autograd graph task (one backward pass, or a reentrant one nested in it) running now."""
    return int(_TASK_ID()) if _TASK_ID is not None else 0


class _Ema:
    """A bias-corrected exponential moving average (None until the first value)."""

    __slots__ = ("beta", "m", "n")

    def __init__(self, beta: float) -> None:
        self.beta, self.m, self.n = beta, 0.0, 0

    def add(self, x: float) -> None:
        self.m = self.beta * self.m + (1 - self.beta) * x
        self.n += 1

    @property
    def value(self) -> float | None:
        return self.m / (1 - self.beta**self.n) if self.n else None


def _ratio(trace: float | None, g_sq: float | None) -> float | None:
    if trace is None or g_sq is None or not (trace > 0 and g_sq > 0) or not math.isfinite(trace / g_sq):
        return None
    return trace / g_sq


class NoiseScale:
    """The noise-scale instrument of one Inspector (module docstring).

    Args:
        tensors: the parameters, in ``Inspector.params`` order.
        groups: the run's groups (the per-group estimates are aligned with their names).
        root: the model (its forward pre-hook infers the batch size and starts a sampled step's
            tensor hooks), or None.
        is_sampled: whether the step under way is sampled.
        batch_size: ``attach``'s, or None (inferred).
        ema: the smoothing per sampled step.
        mode: "ddp" or "fsdp" (averaged over the ranks), "accumulation", or None (unsupported:
            ``reason`` says why).
        world: the number of ranks (DDP, FSDP2).
        scaler: a GradScaler whose scale the increments are divided by, or None.
        sources: where parameter ``i``'s gradient of one backward is seen (the tensor to hook), or
            None where there is none yet; None: the parameters themselves (FSDP2:
            :func:`inspector.stats.sharded.backward_sources`).
        rank_sq: under DDP and FSDP2, a callable giving the last exchange's per-parameter small-batch squared
            norms (:meth:`columns`) averaged over the ranks (NaN where a rank had none), or None.
        on_failure: called once with a message when the instrument fails and turns itself off.
    """

    def __init__(
        self,
        tensors: Sequence[Tensor],
        groups: Groups,
        *,
        root: nn.Module | None,
        is_sampled: Callable[[], bool],
        batch_size: int | None,
        ema: float = DEFAULT_EMA,
        mode: str | None = "accumulation",
        reason: str | None = None,
        world: int = 1,
        scaler: Any = None,
        rank_sq: Callable[[], list[float] | None] | None = None,
        sources: Callable[[int], Tensor | None] | None = None,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        self.tensors = list(tensors)
        self.groups = groups
        self._root = root if root is not None and getattr(root, "_compiled_call_impl", None) is None else None
        self._is_sampled = is_sampled
        self.batch_size = batch_size
        self.beta = float(ema)
        self.mode = mode
        self.reason = reason
        self.world = world
        self._scaler = scaler
        self._rank_sq = rank_sq
        self._sources = sources if sources is not None else self.tensors.__getitem__
        self._tried = False  # this sampled step's hooks were registered, or could not be
        self._on_failure = on_failure  # called once with a message if the instrument fails
        self._trace = _Ema(self.beta)
        self._gsq = _Ema(self.beta)
        self._g_trace = [_Ema(self.beta) for _ in range(len(groups))]
        self._g_gsq = [_Ema(self.beta) for _ in range(len(groups))]
        # the step under way (sampled steps): backward passes, micro-batch sizes, increments' sums
        self._k = 0
        self._sizes: list[int] = []
        self._acc: dict[int, Tensor] = {}  # parameter index -> sum over backwards of |delta_k|^2 (device)
        self._pending: set[int] = set()  # graph tasks (backward passes) whose end is awaited
        self._reached = False  # a parameter's gradient was met since the last backward pass counted
        self._unscale: Tensor | None = None  # a fused optimizer's grad_scale the sums are still scaled by
        self._step_handles: list[Any] = []  # tensor hooks of the step under way
        self._root_handle: Any = None
        self._root_out_handle: Any = None
        self._packed: list[int] = []  # the indices whose sums are in this step's pack
        self._small: list[float] | None = None  # per parameter: this rank's |G_small|^2 (NaN: none)
        self._permanent = False  # tensor hooks kept registered (no root module to start them)
        self.failed: str | None = None  # why the instrument turned itself off, if it did
        self._full = False  # this step's hooks take the increments (else they only count backward passes)
        self._last_k = 2  # the backward passes of the last sampled step (2: assume accumulation at first)
        self._edited = 0  # parameters left out of this step's estimate (edited by post_accumulate hooks)

    # ------------------------------------------------------------ registration
    def register(self) -> None:
        """Register the root's forward pre-hook (or, without a usable root, the tensor hooks)."""
        if self.mode is None:
            return
        if self._root is not None:
            if self._root_handle is None:
                self._root_handle = self._root.register_forward_pre_hook(OwnedHook(self._on_forward))
                self._root_out_handle = self._root.register_forward_hook(OwnedHook(self._on_forward_out))
                hide_from_copies(self._root)
        elif not self._step_handles:
            self._permanent = True
            self._register_tensor_hooks()

    def close(self) -> None:
        """Remove every hook registered here (``close()``, ``stood_aside()``); the averages are kept."""
        if self._root_handle is not None:
            self._root_handle.remove()
            self._root_handle = None
        if self._root_out_handle is not None:
            self._root_out_handle.remove()
            self._root_out_handle = None
        self._remove_tensor_hooks()
        self._permanent = False
        self._clear_step()

    def _register_tensor_hooks(self) -> None:
        """On the training thread: a hook on each parameter that requires grad (the increments,
        and the backward passes counted: :meth:`_backward_seen`). In one process, after a sampled
        step with one backward pass, only the first one's, which with the root's output hook only
        counts the backward passes: the increments of a step without accumulation would be of no
        use, and the first sampled step with two or more starts measuring from the next one."""
        self._tried = True
        live = [i for i, t in enumerate(self.tensors) if t.requires_grad]
        if not live:
            return
        few = self.mode == "accumulation" and self._last_k < 2 and not self._permanent
        hooked = live[:1] if few else live
        sources = [self._sources(i) for i in hooked]
        if any(s is None for s in sources):
            # (FSDP2, before every module's first all-gather) measuring only some parameters, or
            # only some of the step's backward passes, would be a wrong estimate: none this step
            return
        self._full = not few
        for i, src in zip(hooked, sources, strict=True):
            assert src is not None
            self._step_handles.append(src.register_hook(self._increment_hook(i)))

    def _remove_tensor_hooks(self) -> None:
        for h in self._step_handles:
            h.remove()
        self._step_handles.clear()

    def _on_forward(self, module: nn.Module, args: Any) -> None:
        """The root's forward: on a sampled step with gradients on, note the micro-batch size and
        register the step's tensor hooks (the first forward). Nothing on other steps."""
        if not (self._is_sampled() and torch.is_grad_enabled()):
            return
        if self.batch_size is None:
            t = _first_tensor(args)
            if t is not None and t.dim() >= 1:
                self._sizes.append(int(t.shape[0]))  # (a shape: nothing read from the device)
        if not self._tried:
            self._register_tensor_hooks()

    def _on_forward_out(self, module: nn.Module, args: Any, output: Any) -> None:
        """The root's forward returned: on a sampled step whose hooks are on, a hook on its output's
        gradient, which a backward from the output meets in the backward's own graph task (a
        parameter inside a reentrant checkpoint meets its gradient in a nested one)."""
        if not (self._step_handles and self._is_sampled() and torch.is_grad_enabled()):
            return
        t = _grad_output(output)
        if t is not None:
            t.register_hook(self._output_grad)

    def _output_grad(self, grad: Tensor) -> None:
        """A backward from the output. Measuring, one that reaches no parameter (``torch.autograd.grad``
        of the output with respect to the input) counts nothing; only counting (one parameter's
        hook, which a backward may not reach), every one counts: at worst the next sampled step
        measures, and counts again."""
        if self.failed is None and self._is_sampled():
            if not self._full:
                self._reached = True
            # a backward from the output is an outer one: a pass still awaited from before ended
            # without its callback (it raised, and the engine drops what it had queued)
            self._pending.intersection_update({_graph_task()})
            try:
                self._backward_seen()
            except Exception as e:  # a bug of ours must not reach the user's backward
                self._fail(e)

    def _backward_seen(self) -> None:
        """Inside a hook of a backward pass: have :meth:`_backward_end` run when the backward (its
        graph task) ends, once per task. A backward pass that reached a parameter is counted when
        no task is left pending: the nested tasks of a reentrant checkpoint end inside their outer
        one (whose start the root's output hook saw) and count nothing. Counted there, an unused
        parameter, or one used by some micro-batches only, does not change ``K``."""
        task = _graph_task()
        if task in self._pending:
            return
        self._pending.add(task)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._backward_end(task))

    def _backward_end(self, task: int) -> None:
        self._pending.discard(task)
        if not self._pending and self._reached:
            self._reached = False
            if self.failed is None:
                self._k += 1

    def _increment_hook(self, i: int) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:  # this backward's gradient, before it is added to .grad
            if self.failed is not None or not self._is_sampled():
                return
            self._reached = True
            try:
                self._backward_seen()
            except Exception as e:  # a bug of ours must not reach the user's backward
                self._fail(e)
                return
            if not self._full:
                return
            try:
                with torch.no_grad():
                    sq = sq_norm(dense(grad).detach())
                    scale = getattr(self._scaler, "_scale", None) if self._scaler is not None else None
                    if isinstance(scale, Tensor):
                        sq = sq / scale.to(sq.device).float().pow(2)
                    prev = self._acc.get(i)
                    self._acc[i] = sq if prev is None else prev + sq
            except Exception as e:  # a bug of ours must not reach the user's backward
                self._fail(e)

        # a tensor hook is never pickled (torch.save warns of hooks it cannot save unless told)
        hook.__torch_unserializable__ = True  # type: ignore[attr-defined]
        return hook

    def _clear_step(self) -> None:
        self._tried = False
        self._k = 0
        self._sizes = []
        self._acc = {}
        self._pending = set()
        self._reached = False
        self._unscale = None
        self._packed = []
        self._small = None

    def end_step(self) -> None:
        """At every boundary (and a skipped iteration): forget the step, remove its tensor hooks."""
        if self._step_handles and not self._permanent:
            self._remove_tensor_hooks()
        if self._k or self._acc or self._sizes or self._packed or self._small is not None or self._tried:
            self._clear_step()

    def unscale(self, grad_scale: Tensor) -> None:
        """At the step pre-hook of a fused optimizer handed ``grad_scale`` by a GradScaler not
        attached (``scaler=``): the step's increments were scaled by it (one scale per iteration:
        ``update()`` runs after the step), so their sums are divided by its square in the
        snapshot's transfer, on the device (nothing read). With the scaler attached each increment
        is divided by its scale as it comes."""
        if self._scaler is None and self._acc:
            self._unscale = grad_scale

    # ------------------------------------------------------------ the snapshot
    def pack(self, pack: Pack) -> None:
        """Add the step's per-parameter sums of squared increments to the snapshot's transfer."""
        if not self._acc:
            return
        self._packed = sorted(self._acc)
        vals = [self._acc[i] for i in self._packed]
        try:
            vec = torch.stack(vals)
        except RuntimeError:  # several devices
            dev = vals[0].device
            vec = torch.stack([v.reshape(()).to(dev, torch.float32) for v in vals])
        vec = vec.float()
        if self._unscale is not None:
            vec = vec / self._unscale.to(vec.device).float().pow(2)
        pack.add("noise_small", vec)

    def received(self, data: dict[str, list[float]]) -> None:
        """The transfer's values: per parameter, ``|G_small|^2 = K * sum_k |delta_k|^2`` (module docstring)."""
        small = [math.nan] * len(self.tensors)
        if self.failed is None:
            k = self._k
            for i, v in zip(self._packed, data.get("noise_small", []), strict=False):
                small[i] = k * v
        self._small = small

    def columns(self) -> list[float]:
        """Under DDP: this rank's columns of the boundary's rows (one per parameter, NaN: none)."""
        return list(self._small) if self._small is not None else [math.nan] * len(self.tensors)

    def _batch(self, k: int) -> tuple[float | None, str | None, str | None]:
        """``(B_small, source, why none)``. Micro-batches of sizes ``b_k`` with the loss of each
        the mean over its examples (times one factor shared by all, ``1 / K``) give increments
        ``g_k / K`` with ``E|g_k|^2 = |G|^2 + tr(Sigma) / b_k``, so ``K sum_k |delta_k|^2`` has
        ``tr(Sigma) / H`` with ``H`` the harmonic mean of the sizes, and the accumulated gradient
        ``tr(Sigma) / (K H)``: ``B_small = H``, ``B_big = K H`` (equal sizes: ``b`` and ``K b``).
        Uneven sizes are known only as one forward per backward pass; else there is none."""
        if self.batch_size is not None:
            return float(self.batch_size), "attach", None
        sizes = self._sizes
        if not sizes:
            return None, None, None
        if min(sizes) == max(sizes) > 0:
            return float(sizes[0]), "inferred", None
        if len(sizes) != k or min(sizes) < 1:
            shown = ", ".join(map(str, sizes[:8])) + (", ..." if len(sizes) > 8 else "")
            why = (
                f"micro-batches of uneven sizes ({shown}) in {len(sizes)} forwards for {k} backward "
                "passes: which size each backward had is not known, so this step is left out"
            )
            return None, "inferred", why
        return len(sizes) / sum(1 / s for s in sizes), "inferred", None

    def observe(
        self,
        data: dict[str, list[float]],
        raw_norms: Sequence[float | None],
        *,
        backward: Sequence[float | None] | None = None,
        edited: Collection[int] = (),
    ) -> dict[str, Any] | None:
        """After the transfer: this step's estimates into the averages; the snapshot's ``noise_scale``
        (None, and the instrument off from then on, if it failed: the snapshot goes out without it).

        ``raw_norms``: each parameter's gradient norm at the step (unscaled, before the ``pre_step``
        hooks); ``backward``: the same as the last backward left it (before the user's own code
        between ``backward()`` and ``step()``, a ``clip_grad_norm_`` of its own; under DDP and FSDP2
        after their reduction), which is the big batch where it was taken; ``edited``: parameters whose gradients a
        ``post_accumulate`` hook changes between backward passes, left out of both batches (the
        accumulated gradient is then no sum of the increments)."""
        if self.mode is None and self.reason is None:
            return None
        if self.failed is None:
            try:
                big = backward if backward is not None else raw_norms
                if edited:
                    big = [None if i in edited else v for i, v in enumerate(big)]
                self._edited = len(edited)
                return self._observe(data, big)
            except Exception as e:  # never lose the snapshot for this
                self._fail(e)
        self.mode, self.reason = None, None
        self.close()
        return None

    def _fail(self, err: BaseException) -> None:
        """Something here raised: the instrument turns itself off (at the snapshot) and says so once."""
        if self.failed is None:
            self.failed = describe_error(err)
            if self._on_failure is not None:
                self._on_failure(f"the gradient noise scale could not be taken and is off: {self.failed}")

    def _observe(self, data: dict[str, list[float]], raw_norms: Sequence[float | None]) -> dict[str, Any]:
        k = self._last_k = self._k
        b, source, unknown = self._batch(k)
        if self._small is None:
            self.received(data)
        small = self.columns()  # per parameter: |G_small|^2 (NaN: none)
        b_small = b_big = None
        reason = self.reason
        if self.mode == "accumulation":
            if b is not None and k >= 2 and not self._full:
                reason = reason or "accumulation seen: measuring from the next sampled step"
            elif b is not None and k >= 2:
                b_small, b_big = b, k * b
            elif k < 2 and reason is None:
                reason = "needs gradient accumulation (2 or more backward passes per step) or DDP"
        elif self.mode in ("ddp", "fsdp"):
            got = self._rank_sq() if self._rank_sq is not None else None
            small = list(got) if got is not None else [math.nan] * len(small)
            if b is not None and k >= 1:
                b_small, b_big = b, self.world * k * b
            elif k == 0 and reason is None:
                reason = (
                    "no backward pass measured yet (under FSDP2: from the first sampled step after "
                    "every module has been gathered once)"
                )
        if b_small is not None and self._edited >= len(self.tensors) and reason is None:
            reason = "a post_accumulate hook edits every parameter's gradient between backward passes"
        if b is None and reason is None:
            reason = unknown or (
                "no batch size: pass attach(..., batch_size=N) (the forward's first argument has no batch dimension)"
            )
        added = False
        if b_small is not None and b_big is not None and b_big > b_small:
            added = self._estimate(small, raw_norms, b_small, b_big)
        uneven = source == "inferred" and len(set(self._sizes)) > 1
        trace, gsq = self._trace.value, self._gsq.value
        g_trace = [e.value for e in self._g_trace]
        g_gsq = [e.value for e in self._g_gsq]
        return {
            "b_simple": _ratio(trace, gsq),
            "trace_sigma": trace,
            "g_sq": gsq,
            "b_small": b_small,
            "b_big": b_big,
            "batch_source": source,
            "k": k,
            "mode": self.mode,
            "ema": self.beta,
            "samples": self._trace.n,
            "left_out": self._edited,
            "sizes": list(self._sizes) if uneven else None,
            "reason": reason if self._trace.n == 0 else None,
            "step_reason": None if added else reason,
            "groups": {
                "b_simple": [_ratio(t, g) for t, g in zip(g_trace, g_gsq, strict=True)],
                "trace_sigma": g_trace,
                "g_sq": g_gsq,
            },
        }

    def _estimate(
        self, small: list[float], raw_norms: Sequence[float | None], b_small: float, b_big: float
    ) -> bool:
        """One step's two estimates per group and for the whole model, into the averages: over the
        parameters that have both a small-batch and a big-batch value (the same set on both sides).
        False where no parameter has both."""
        n_groups = len(self.groups)
        s_g = [0.0] * n_groups
        b_g = [0.0] * n_groups
        seen = [False] * n_groups
        of = self.groups.of
        for i, (s, r) in enumerate(zip(small, raw_norms, strict=False)):
            if r is None or not math.isfinite(s) or not math.isfinite(r):
                continue
            g = of[i]
            s_g[g] += s
            b_g[g] += r * r
            seen[g] = True
        if not any(seen):
            return False

        def both(s: float, big: float) -> tuple[float, float]:
            g_sq = (b_big * big - b_small * s) / (b_big - b_small)
            trace = (s - big) / (1 / b_small - 1 / b_big)
            return trace, g_sq

        trace, g_sq = both(sum(s_g), sum(b_g))
        self._trace.add(trace)
        self._gsq.add(g_sq)
        for g in range(n_groups):
            if seen[g]:
                t, q = both(s_g[g], b_g[g])
                self._g_trace[g].add(t)
                self._g_gsq[g].add(q)
        return True
