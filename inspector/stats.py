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
        # a float32 sum (torch accumulates it pairwise), widened after: sum(dtype=float64) is ~10x slower on CPU
        total = t.sum().to(torch.float64) if n else torch.zeros((), dtype=torch.float64, device=t.device)
        mean = total / max(n, 1)
        if n > 1:
            var = (norm.to(torch.float64) ** 2 - n * mean * mean) / (n - 1)
            std = var.clamp_min(0).sqrt()
        else:
            std = torch.full((), math.nan, dtype=torch.float64, device=t.device)
        means.append(mean.float())
        stds.append(std.float())
    return means, stds


def histograms(
    raw: Tensor, final: Tensor | None, bins: int = 64, *, raw_finite: bool = False, final_finite: bool = False
) -> Tensor:
    """Histograms of ``raw`` and ``final`` over common edges, entirely on device.

    Returns a float32 tensor ``[lo, hi, raw_counts(bins), final_counts(bins)]``; the edges
    are ``linspace(lo, hi, bins + 1)``. No host value is needed (``histc`` would want its
    min and max as Python numbers): counts come from ``bincount`` on the CPU and from
    ``index_add_`` on accelerators (where ``bincount`` would sync to size its output).
    ``raw_finite`` / ``final_finite`` (the caller knows that tensor holds no NaN/Inf) skip
    masking non-finite values out, a costly gather on large tensors.
    """
    r = raw.detach().reshape(-1)
    f = final.detach().reshape(-1) if final is not None else r
    if r.dtype != torch.float32:
        r, f = r.float(), f.float()
    if not raw_finite:
        r = r[torch.isfinite(r)]
    if final is None:
        f = r
    elif not final_finite:
        f = f[torch.isfinite(f)]
    dev = r.device
    if r.numel() == 0 and f.numel() == 0:
        lo, hi = torch.zeros((), device=dev), torch.ones((), device=dev)
    else:
        ends = [torch.stack(torch.aminmax(x)) for x in (r, f) if x.numel()]
        both = torch.stack(ends)  # (1 or 2, 2): min and max of each
        lo, hi = both[:, 0].min(), both[:, 1].max()
        hi = torch.where(hi > lo, hi, lo + 1e-12 + lo.abs() * 1e-6)
    scale = bins / (hi - lo)

    def counts(x: Tensor) -> Tensor:
        if x.numel() == 0:
            return torch.zeros(bins, device=dev)
        idx = ((x - lo) * scale).long().clamp_(0, bins - 1)
        if dev.type == "cpu":
            return torch.bincount(idx, minlength=bins).float()
        c = torch.zeros(bins, device=dev)
        c.index_add_(0, idx, torch.ones((), device=dev).expand_as(x))
        return c

    return torch.cat([lo.reshape(1), hi.reshape(1), counts(r), counts(f)])


def dense(g: Tensor) -> Tensor:
    """The tensor statistics are taken of: the stored values of a sparse gradient, else ``g``."""
    if g.layout != torch.strided:
        return g.coalesce().values()
    return g
