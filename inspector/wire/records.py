"""Plain records: hook specs, snapshots and events, and strict-JSON conversion.

Everything here is plain Python data (no tensors): the training thread builds these after
its one host transfer per snapshot, and consumers (the server, tests) read them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .errors import cut

__all__ = ["HookSpec", "Snapshot", "jsonsafe", "event_fields", "MAX_EVENT_STRING", "SPEC_FIELDS"]

# The longest string an event keeps (characters). An event goes to every dashboard, into every
# later hello and into the history: a hook raising with a 35 MB message must not ride along whole.
MAX_EVENT_STRING = 2048


def jsonsafe(x: Any) -> Any:
    """``x`` with every non-finite float replaced by ``"nan"``, ``"inf"`` or ``"-inf"``.

    The result serialises with ``json.dumps(..., allow_nan=False)``: strict JSON.
    """
    if isinstance(x, float):
        if math.isfinite(x):
            return x
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {str(k): jsonsafe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonsafe(v) for v in x]
    return x


def _cut(x: Any) -> Any:
    if isinstance(x, str):
        return cut(x, MAX_EVENT_STRING)
    if isinstance(x, dict):
        return {_cut(k): _cut(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_cut(v) for v in x]
    return x


def event_fields(fields: Any) -> Any:
    """``jsonsafe(fields)`` with every string (keys too, at any depth) longer than
    ``MAX_EVENT_STRING`` characters cut to that length, followed by a note of its full length."""
    return _cut(jsonsafe(fields))


@dataclass(frozen=True, slots=True)
class HookSpec:
    """One hook as requested or applied. ``params`` is complete (defaults filled in)."""

    id: str
    kind: str
    point: str
    target: str
    params: dict[str, Any]
    enabled: bool = True
    position: int = 0
    applied_step: int | None = None  # first step whose gradients were processed with this spec

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["params"] = jsonsafe(dict(self.params))
        return d

    def preset(self) -> dict[str, Any]:
        """The spec without id, position and applied_step: what presets store."""
        return {
            "kind": self.kind,
            "target": self.target,
            "point": self.point,
            "params": jsonsafe(dict(self.params)),
            "enabled": self.enabled,
        }


SPEC_FIELDS = tuple(f.name for f in fields(HookSpec))


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Telemetry of one sampled step, published at that step's boundary.

    Per-parameter lists are aligned to ``Inspector.params``; ``None`` means no value (no
    gradient, or the std of one element). server/PROTOCOL.md ("A snapshot") shows every key.
    """

    step: int
    time: float
    config_version: int
    loss: float | None
    scalars: dict[str, float]
    lr: list[float]
    grad_norm_raw: list[float | None]
    grad_norm: list[float | None]
    grad_mean: list[float | None]
    grad_std: list[float | None]
    grad_absmax_raw: list[float | None]
    grad_absmax: list[float | None]
    nan_count: list[int | None]
    inf_count: list[int | None]
    param_norm: list[float | None]
    update_ratio: list[float | None]
    total_norm_raw: float | None
    total_norm: float | None
    hook_effects: dict[str, dict[str, float]]
    hist: dict[str, dict[str, list[float] | None]]  # "final" None: no final gradient (frozen)
    modules: dict[str, dict[str, float]]
    ranks: dict[str, list[Any]] | None
    sampled_every: int
    overhead: float | None
    # the global norm of the gradients as the step's last backward left them (unscaled; under DDP
    # and FSDP2 reduced), before the user's own code between backward() and step() (a
    # clip_grad_norm_ of its own) changed them
    total_norm_backward: float | None = None
    # the group aggregates, lists aligned with Inspector.groups["names"] (inspector.stats.groups):
    # norm_raw, norm, absmax_raw, absmax, nan_count, inf_count, norm_min, norm_median, norm_max,
    # ratio_min, ratio_median, ratio_max; None: the run has no groups (never from an Inspector)
    groups: dict[str, list[Any]] | None = None
    # the gradient noise scale (inspector.stats.noise_scale): b_simple, trace_sigma, g_sq, b_small,
    # b_big, batch_source, k, mode, ema, samples, left_out, sizes, reason, step_reason, and groups
    # (b_simple, trace_sigma, g_sq aligned with Inspector.groups["names"]); nulls until there is an
    # estimate; None: instrument off
    noise_scale: dict[str, Any] | None = None
    # the optimizer's state and update geometry (inspector.stats.optim_state): per-tensor lists
    # exp_avg_norm, exp_avg_sq_sqrt_norm, below_eps_frac, step_ratio, cos_update_grad, cos_grad_prev,
    # the same keys per group under "groups", "kind" ("adam" or "other") and "cos_prev_gap";
    # None: not measured (off, FSDP2, nothing measured this step)
    optim: dict[str, Any] | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    _wire: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """Strict-JSON-safe dict (non-finite numbers as strings), the wire format's snapshot.

        Converted once and cached: every consumer (subscribers, ``Inspector.snapshots()``, the
        server) gets the same dict, so treat it as read-only. ``dataclasses.replace`` makes a
        snapshot with a fresh cache (late scalars merged into a copy are converted again, once).
        """
        wire = self._wire
        if wire is None:
            wire = jsonsafe({name: getattr(self, name) for name in _SNAPSHOT_KEYS})
            object.__setattr__(self, "_wire", wire)  # a benign race: two threads would build equal dicts
        return wire


_SNAPSHOT_KEYS = tuple(f.name for f in fields(Snapshot) if f.init)  # the wire keys, in field order
