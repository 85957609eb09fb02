"""``GradScaler`` (mixed precision): when an iteration is skipped, and fused optimizers.

A skipped iteration. ``GradScaler.step`` skips ``optimizer.step()`` when the scaled gradients
hold inf/NaN, and ``update()`` then writes the scale (lowered). Our step hooks never fire for such
an iteration, so the inspector sees it by the scale having been **written** since the previous
forward (or, at ``finish()``/``close()``, since the last one) with no step boundary between:
``update()`` runs once per iteration, after ``step()``, so a write with no boundary since means a
step that did not run. :func:`scale_mark` tells a write by the scale tensor's version counter
(``Tensor._version``, bumped by every in-place write: host metadata, nothing read from the device,
so no sync on CUDA).

A fused optimizer (``Adam``/``AdamW``/``SGD``/``Adagrad`` with ``fused=True``, which set
``_step_supports_amp_scaling``). ``GradScaler.step`` does not unscale its gradients and always
calls its ``step()``, having set two attributes on it for the fused kernel: ``grad_scale`` (the
scale to divide by, None when ``unscale_`` already ran) and ``found_inf`` (nonzero when the
kernel must skip the update). Our step pre-hook reads them (:func:`fused_scaling`): on
``found_inf`` the iteration is a skipped one (no hooks, no statistics, no step counted); else
:func:`unscale_` divides the gradients by ``grad_scale`` in place, as the fused kernel itself
would, and clears ``grad_scale``, so that our statistics and ``pre_step``
hooks see unscaled values and the kernel does not divide again. An optimizer on the older
contract, ``step(grad_scaler=...)``, unscales inside its own step, out of our reach: attaching
it with a scaler is refused (:func:`check_optimizer`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor

from ..wire.errors import AttachError

__all__ = ["ScalerWatch", "check_optimizer", "fused_scaling", "scale_mark", "scale_written", "unscale_"]


def scale_mark(scaler: Any) -> tuple[int, int] | None:
    """Which write of the scaler's scale tensor this is: ``(id, version)``, None before the scaler
    made one (its first ``scale()`` call). No device read."""
    scale = getattr(scaler, "_scale", None)
    return (id(scale), scale._version) if isinstance(scale, Tensor) else None


def scale_written(before: tuple[int, int] | None, now: tuple[int, int] | None) -> bool:
    """Whether the scale was written (by ``update()``) between two marks. A scale created since the
    first mark counts once it has been written (a version past its creation's)."""
    if now is None or now == before:
        return False
    return before is not None or now[1] > 0


def check_optimizer(optimizer: torch.optim.Optimizer | None, scaler: Any) -> None:
    """Refuse an optimizer that unscales inside its own ``step(grad_scaler=...)`` under a scaler."""
    if scaler is None or optimizer is None or not getattr(optimizer, "_step_supports_amp_scaling", False):
        return
    try:
        takes_scaler = "grad_scaler" in inspect.signature(optimizer.step).parameters
    except (TypeError, ValueError):
        return
    if takes_scaler:
        raise AttachError(
            f"{type(optimizer).__name__}.step takes grad_scaler=...: under a GradScaler it unscales its "
            "gradients inside its own step, after our pre_step hooks, which would then see scaled "
            "gradients and count skipped steps; use a torch optimizer (fused=True is fine)"
        )


def fused_scaling(optimizer: Any) -> tuple[Tensor | None, bool] | None:
    """``(grad_scale, skipped)`` that a GradScaler handed this fused optimizer for the step under
    way, or None when it handed nothing (no scaler, or an optimizer the scaler unscales itself).

    ``skipped`` reads ``found_inf``: one host read per step, the same read ``GradScaler.step``
    makes for an unfused optimizer (a sync on CUDA; only a fused optimizer under a GradScaler pays
    it: we must know before the update whether this is a step).
    """
    found_inf = getattr(optimizer, "found_inf", None)
    if not isinstance(found_inf, Tensor):
        return None
    grad_scale = getattr(optimizer, "grad_scale", None)
    return (grad_scale if isinstance(grad_scale, Tensor) else None), bool(found_inf.item() != 0)


def unscale_(optimizer: Any, grad_scale: Tensor) -> None:
    """Divide every gradient the optimizer will step by ``grad_scale``, in place, and clear its
    ``grad_scale`` so its fused kernel does not divide again (the gradients are finite).

    The fused kernel's own arithmetic, a division by the scale (``grad / grad_scale``), not
    ``GradScaler.unscale_``'s multiplication by a float32 reciprocal: for a scale that is not a
    power of two (``GradScaler(init_scale=1000)``) the two differ in the last bit, and a run
    attached with no hooks must update the weights bit for bit as it would unattached (float32
    and float64 gradients; a bf16 or fp16 one is rounded to its dtype here, where the kernel
    keeps the quotient in float32).
    """
    groups: dict[torch.device, list[Tensor]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:  # fused optimizers refuse sparse gradients; unscaled all the same
                p.grad = g / grad_scale.to(g.device)
                continue
            groups.setdefault(g.device, []).append(g)
    for device, grads in groups.items():
        torch._foreach_div_(grads, grad_scale.to(device))
    optimizer.grad_scale = None  # GradScaler.step deletes the attribute after the step


class ScalerWatch:
    """What the attached scaler did to the iteration under way, told without a device read: a
    fused optimizer's skip (its ``found_inf``, read at the step), and an unfused skip (the scale
    written by ``update()`` with no boundary since: :func:`scale_mark`)."""

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler
        self._mark: tuple[int, int] | None = None  # which write of the scale the last check saw
        self._fused_skip = False  # the scaler told the fused optimizer stepping now to skip its update
        self._skip_known = False  # the iteration under way was skipped, and reported at its boundary

    def fused_skip(self) -> None:
        """The fused optimizer stepping now skips its update (told at its step pre-hook)."""
        self._fused_skip = True

    def take_fused_skip(self) -> bool:
        """At the step post-hook: whether no update ran (then it is no boundary, and the skip is
        reported there: :meth:`check` does not report it again)."""
        skipped, self._fused_skip = self._fused_skip, False
        if skipped:
            self._skip_known = True
        return skipped

    @property
    def skip_known(self) -> bool:
        return self._skip_known

    def check(self, under_way: bool) -> str | None:
        """At a forward, ``finish()`` and ``close()``: ``"reported"`` when the iteration that ended
        was a fused skip reported at its boundary, ``"skipped"`` when the scaler's ``update()``
        wrote its scale with no boundary since (an unfused skip), else None."""
        written = False
        if self.scaler is not None:
            mark = scale_mark(self.scaler)
            last, self._mark = self._mark, mark
            written = under_way and scale_written(last, mark)
        if self._skip_known:
            self._skip_known = False
            return "reported"
        return "skipped" if written else None

    def remark(self) -> None:
        """The scale was written by us (a rewind's scaler state): no skipped step."""
        self._mark = scale_mark(self.scaler)
