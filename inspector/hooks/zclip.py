"""``zclip``: adaptive clipping of the gradient norm by its own running statistics (ZClip).

ZClip (Kumar et al., 2025, arXiv 2504.02507) keeps an exponential moving average of the gradient
norm and of its variance, and clips a norm whose z-score against them is too high. This module
is its arithmetic, on the device, for one ``pre_step`` application of a ``zclip`` hook: it gets
the targets' norms (``inspector.hooks.ops`` measures them, as ``clip_norm`` does, the full
tensors' under FSDP2) and returns each target's factor. Nothing is read on the host: the state is
device tensors and every decision is a ``torch.where``.

Per norm ``g`` (``mode`` ``global``: one, over every target; ``group``: one per group of
``insp.groups`` among the targets, each with its own statistics), with ``mean`` and ``var`` the
statistics before this step:

- **warm-up**: the first ``warmup`` finite norms are only collected (their mean and population
  variance, Welford's update); nothing is clipped. The statistics start from them.
- then ``threshold = max(mean + z * sqrt(var), min_threshold)``; a norm above it is clipped to
  ``to``: ZClip's reciprocal value ``max(mean + z**2 * var / (g - mean), min_threshold)``
  (``clip_to`` "reciprocal", the default as in ZClip: ``mean + (z / z_t) * z * std`` with
  ``z_t = (g - mean) / std`` the norm's z-score, lower the further the spike), or ``threshold``
  itself (``clip_to`` "threshold"). Under a long run of norms above the threshold the latter feeds
  ``mean + z * std`` back into the statistics every step and lets them climb (``std`` about 7%
  a step at the defaults); the reciprocal value feeds back close to ``mean`` and does not. The
  gradients are scaled as ``clip_grad_norm_`` scales them, ``min(1, to / (g + 1e-6))``;
- the statistics are updated with the norm **as clipped** (``g* = min(g, to)``), so a spike does
  not inflate them: ``mean' = alpha * mean + (1 - alpha) * g*``, then
  ``var' = alpha * var + (1 - alpha) * (g* - mean')**2``.

A norm that is not finite (NaN, Inf) is left alone and does not enter the statistics (that is
``nan_guard``'s business); a group without a gradient this step keeps its statistics.

The state (:class:`ZClipState`) belongs to the hook (``HookState.zclip``) and is saved and restored
with a checkpoint. An edit of ``z``, ``min_threshold``, ``warmup`` or ``clip_to`` keeps it (the next
step uses the new value; ``warmup`` counts the norms already collected); an edit of ``alpha``,
``mode``, ``norm_type`` or the target starts the statistics again (they would describe another norm).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["ZClipState", "zclip_coefs"]


@dataclass
class ZClipState:
    """One ``zclip`` hook's statistics: per slot (one in mode ``global``, one per group in mode
    ``group``) the finite norms collected during warm-up (``n``, it stops at ``warmup``), and the
    mean and variance (during warm-up: the collected norms' mean and population variance)."""

    key: tuple[Any, ...]  # what the statistics describe: (target, mode, alpha, norm_type, slots, device)
    n: Tensor
    mean: Tensor
    var: Tensor

    @classmethod
    def fresh(cls, key: tuple[Any, ...], slots: int, device: torch.device) -> ZClipState:
        z = torch.zeros(slots, device=device)
        return cls(key, z, z.clone(), z.clone())

    def state_dict(self) -> dict[str, Any]:
        return {"key": self.key, "n": self.n, "mean": self.mean, "var": self.var}

    @classmethod
    def from_state_dict(cls, d: dict[str, Any]) -> ZClipState:
        dev = d["key"][-1]
        return cls(d["key"], *(d[k].to(dev) for k in ("n", "mean", "var")))


def state_key(target: str, params: dict[str, Any], slots: int, device: torch.device) -> tuple[Any, ...]:
    return (target, params["mode"], float(params["alpha"]), float(params["norm_type"]), slots, device)


def zclip_coefs(
    state: ZClipState,
    norms: Tensor,
    slot_of: Tensor | None,
    slots: int,
    params: dict[str, Any],
) -> tuple[Tensor, dict[str, Tensor]]:
    """One application: ``norms`` are the targets' norms (float32, ``[T]``), ``slot_of`` each
    target's group slot (``[T]`` int64; None in mode ``global``). Updates ``state`` in place and
    returns each target's factor (``[T]`` float32) and this step's effect: ``threshold`` (the
    global mode's, NaN during warm-up), ``clipped`` (slots clipped), ``warmup`` (norms left to
    collect before clipping starts, the most over the slots)."""
    p = float(params["norm_type"])
    z, alpha = float(params["z"]), float(params["alpha"])
    floor, warmup = float(params["min_threshold"]), float(params["warmup"])
    if slot_of is None:  # one norm over every target, as clip_grad_norm_ takes it
        g = (norms.max() if math.isinf(p) else torch.linalg.vector_norm(norms, p)).reshape(1)
        present = torch.ones(1, dtype=torch.bool, device=norms.device)
    else:
        zeros = norms.new_zeros(slots)
        if math.isinf(p):
            g = zeros.scatter_reduce(0, slot_of, norms, "amax")
        else:
            g = zeros.index_add(0, slot_of, norms.pow(p)).pow(1.0 / p)
        present = zeros.index_add(0, slot_of, torch.ones_like(norms)) > 0
    n, mean, var = state.n, state.mean, state.var
    ok = torch.isfinite(g) & present
    active = n >= warmup
    std = var.sqrt()
    threshold = torch.clamp(mean + z * std, min=floor)
    clip = ok & active & (g > threshold)
    if params["clip_to"] == "reciprocal":
        # mean + z**2 * std / z_t with z_t = (g - mean) / std: (g > threshold >= mean + z * std here)
        to = torch.clamp(mean + (z * z) * var / (g - mean), min=floor)
        to = torch.minimum(to, threshold)
    else:
        to = threshold
    g_star = torch.where(clip, to, g)
    ema_mean = alpha * mean + (1.0 - alpha) * g_star
    ema_var = alpha * var + (1.0 - alpha) * (g_star - ema_mean).pow(2)
    warming = ok & ~active
    n1 = n + 1.0
    d = g - mean
    w_mean = mean + d / n1
    w_var = var + (d * (g - w_mean) - var) / n1
    update = ok & active
    state.mean = torch.where(update, ema_mean, torch.where(warming, w_mean, mean))
    state.var = torch.where(update, ema_var, torch.where(warming, w_var, var))
    state.n = torch.where(warming, n1, n)
    coef = torch.where(clip, torch.clamp(to / (g + 1e-6), max=1.0), torch.ones_like(g))
    per_target = coef.expand(norms.shape[0]) if slot_of is None else coef.index_select(0, slot_of)
    effect = {
        "threshold": torch.where(active[0], threshold[0], torch.full_like(threshold[0], math.nan))
        if slot_of is None
        else torch.full((), math.nan, device=norms.device),
        "clipped": clip.float().sum(),
        "warmup": torch.where(present, torch.clamp(warmup - state.n, min=0), 0.0).max(),
    }
    return per_target, effect
