"""Pure tensor -> statistics functions used by the telemetry.

Everything stays on the gradients' device as float32 tensors; the caller stacks the
results and moves them to the host once per snapshot. No ``.item()`` here.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["foreach_norm", "absmax", "mean_std", "histograms", "dense"]

_HAS_NORM_DTYPE: bool | None = None


def foreach_norm(tensors: list[Tensor], ord: float = 2.0) -> list[Tensor]:
    """Per-tensor norms as float32 0-dim tensors, batched with ``torch._foreach_norm``.

    Low-precision tensors (fp16, bf16) are reduced in float32 (``dtype=`` where this torch
    supports it, an upcast copy otherwise).
    """
    global _HAS_NORM_DTYPE
    if not tensors:
        return []
    if _HAS_NORM_DTYPE is not False:
        try:
            out = torch._foreach_norm(tensors, ord, dtype=torch.float32)
            _HAS_NORM_DTYPE = True
            return list(out)
        except TypeError:  # torch < 2.3 has no dtype argument
            _HAS_NORM_DTYPE = False
    up = [t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for t in tensors]
    return [n.float() for n in torch._foreach_norm(up, ord)]


def stack_on(tensors: list[Tensor], device: torch.device) -> Tensor:
    """Stack 0-dim tensors that may live on several devices into one 1-D tensor on ``device``."""
    if not tensors:
        return torch.zeros(0, device=device)
    return torch.stack([t.to(device, non_blocking=True) for t in tensors])


def absmax(tensors: list[Tensor]) -> list[Tensor]:
    """Per-tensor largest absolute value as float32 0-dim tensors.

    On CUDA one fused ``torch._foreach_norm(..., inf)``; on the CPU that kernel is several
    times slower than a min/max pass, so there it is ``torch.aminmax`` per tensor.
    """
    if not tensors:
        return []
    if tensors[0].device.type == "cuda":
        return foreach_norm(tensors, math.inf)
    out = []
    for t in tensors:
        if t.numel() == 0:
            out.append(torch.zeros((), device=t.device))
            continue
        lo, hi = torch.aminmax(t)
        out.append(torch.maximum(hi.float(), -lo.float()))
    return out


def mean_std(tensors: list[Tensor], norms: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    """Per-tensor mean and unbiased std (float32 0-dim tensors), from one sum per tensor and the
    2-norms already computed: ``var = (||g||^2 - n * mean^2) / (n - 1)``, combined in float64.

    One pass instead of ``torch.std_mean``'s two (and several times faster on the CPU). The
    identity loses precision only when ``|mean| >> std``, which gradients rarely are; std is
    NaN for one element (the caller reports null).
    """
    means, stds = [], []
    for t, norm in zip(tensors, norms, strict=True):
        n = t.numel()
        total = t.sum(dtype=torch.float64) if n else torch.zeros((), dtype=torch.float64, device=t.device)
        mean = total / max(n, 1)
        if n > 1:
            var = (norm.to(torch.float64) ** 2 - n * mean * mean) / (n - 1)
            std = var.clamp_min(0).sqrt()
        else:
            std = torch.full((), math.nan, dtype=torch.float64, device=t.device)
        means.append(mean.float())
        stds.append(std.float())
    return means, stds


def histograms(raw: Tensor, final: Tensor | None, bins: int = 64) -> Tensor:
    """Histograms of ``raw`` and ``final`` over common edges, entirely on device.

    Returns a float32 tensor ``[lo, hi, raw_counts(bins), final_counts(bins)]``; the edges
    are ``linspace(lo, hi, bins + 1)``. Counts are built with ``index_add_`` so that no host
    value (histc's min/max) is needed.
    """
    r = raw.detach().reshape(-1).float()
    f = final.detach().reshape(-1).float() if final is not None else r
    finite_r = r[torch.isfinite(r)] if r.numel() else r
    finite_f = f[torch.isfinite(f)] if f.numel() else f
    both = torch.cat([finite_r, finite_f])
    if both.numel() == 0:
        lo = torch.zeros((), device=r.device)
        hi = torch.ones((), device=r.device)
    else:
        lo, hi = both.min(), both.max()
        hi = torch.where(hi > lo, hi, lo + 1e-12 + lo.abs() * 1e-6)
    width = (hi - lo) / bins

    def counts(x: Tensor) -> Tensor:
        idx = ((x - lo) / width).floor().clamp_(0, bins - 1).long()
        c = torch.zeros(bins, device=x.device)
        if x.numel():
            c.index_add_(0, idx, torch.ones_like(x))
        return c

    return torch.cat([lo.reshape(1), hi.reshape(1), counts(finite_r), counts(finite_f)])


def dense(g: Tensor) -> Tensor:
    """The tensor statistics are taken of: the stored values of a sparse gradient, else ``g``."""
    if g.layout != torch.strided:
        return g.coalesce().values()
    return g
