"""The hook catalog: every kind, its parameters, defaults, points and validation.

One table drives validation, the defaults and the JSON Schema the dashboard builds its
forms from (``hook_kinds()``), so the three cannot drift apart.

Points (where a hook runs; see docs/hooks.md "Where each hook runs, and what it sees"):

- ``pre_step``: an optimizer step pre-hook, once per optimizer step, on the final
  accumulated (all-reduced, unscaled) gradients, batched over every target.
- ``post_accumulate``: ``Tensor.register_post_accumulate_grad_hook`` on each target
  parameter, once per backward (per micro-batch), on that parameter's ``.grad`` in place. Under
  gradient accumulation ``scale``, ``l2`` and ``noise`` act once on the step's gradient, not once
  per backward (see :mod:`inspector.hooks.accumulation`), except between two of the other kinds.
- ``module``: tensor hooks on a module's forward output (and inputs), for logging and checks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import HookError, shown

__all__ = ["POINTS", "KINDS", "KindDef", "ParamDef", "hook_kinds", "validate_params", "check_point"]

POINTS = ("pre_step", "post_accumulate", "module")
# One line per point, sent with each kind's schema (`point_descriptions`) for the page's form.
POINT_DESCRIPTIONS = {
    "pre_step": "before optimizer.step(): the final gradients (accumulated, unscaled), once per step",
    "post_accumulate": "as each backward accumulates into .grad (every micro-batch; scale, l2 and noise "
    "count once per step); already inside 'raw'",
    "module": "on each target module's backward (grad_output / grad_input), every backward",
}


@dataclass(frozen=True, slots=True)
class ParamDef:
    name: str
    type: str  # "number" | "string" | "boolean" | "integer"
    description: str
    required: bool = False
    default: Any = None
    minimum: float | None = None  # inclusive
    exclusive_minimum: float | None = None
    maximum: float | None = None  # inclusive
    exclusive_maximum: float | None = None
    enum: tuple[str, ...] | None = None
    allow_inf: bool = False  # norm_type accepts inf (or the string "inf")


@dataclass(frozen=True, slots=True)
class KindDef:
    name: str
    points: tuple[str, ...]
    description: str
    params: tuple[ParamDef, ...] = ()
    modifies: bool = True  # edits gradients (as opposed to only observing them)
    # extra cross-field rule: (point, params) -> HookError or None
    rule: Callable[[str, Mapping[str, Any]], HookError | None] | None = field(default=None)


def _clip_norm_rule(point: str, params: Mapping[str, Any]) -> HookError | None:
    if point == "post_accumulate" and params.get("mode") != "per_tensor":
        return HookError(
            ("params", "mode"),
            "at point post_accumulate each parameter is clipped on its own: use mode 'per_tensor' "
            "(a global norm needs every gradient, which only exists at pre_step)",
        )
    return None


def _nan_guard_rule(point: str, params: Mapping[str, Any]) -> HookError | None:
    action = params.get("action")
    if point == "module" and action != "report":
        return HookError(("params", "action"), "at point module nan_guard can only 'report'")
    if point == "post_accumulate" and action == "skip":
        return HookError(("params", "action"), "'skip' skips a whole optimizer step: use point pre_step")
    return None


_PRE_POST = ("pre_step", "post_accumulate")

KINDS: dict[str, KindDef] = {
    k.name: k
    for k in (
        KindDef(
            "clip_value",
            _PRE_POST,
            "Clamp every gradient element to [-threshold, threshold] (torch.nn.utils.clip_grad_value_).",
            (
                ParamDef(
                    "threshold", "number", "largest allowed |element|", required=True, exclusive_minimum=0
                ),
            ),
        ),
        KindDef(
            "clip_norm",
            _PRE_POST,
            "Rescale gradients so their norm is at most max_norm (torch.nn.utils.clip_grad_norm_). "
            "mode 'global' takes one norm over all targets together; 'per_tensor' clips each on its own.",
            (
                ParamDef("max_norm", "number", "largest allowed norm", required=True, exclusive_minimum=0),
                ParamDef(
                    "mode",
                    "string",
                    "one norm over all targets, or one per tensor",
                    default="global",
                    enum=("global", "per_tensor"),
                ),
                ParamDef(
                    "norm_type",
                    "number",
                    "p of the p-norm; inf for the max-norm",
                    default=2.0,
                    exclusive_minimum=0,
                    allow_inf=True,
                ),
            ),
            rule=_clip_norm_rule,
        ),
        KindDef(
            "zclip",
            ("pre_step",),
            "Adaptive clipping (ZClip): clip the global norm (or each group's) when it is more than z "
            "standard deviations above its own running mean (EMAs of the norm and its variance, fed "
            "the clipped norm), after a warm-up of statistics only; no threshold to tune.",
            (
                ParamDef(
                    "z", "number", "clip above mean + z * std of the norm", default=2.5, exclusive_minimum=0
                ),
                ParamDef(
                    "alpha",
                    "number",
                    "EMA decay of the norm's mean and variance (an edit restarts them)",
                    default=0.97,
                    exclusive_minimum=0,
                    exclusive_maximum=1,
                ),
                ParamDef(
                    "warmup",
                    "integer",
                    "steps of statistics only, before any clipping",
                    default=25,
                    minimum=1,
                    maximum=2**31 - 1,
                ),
                ParamDef(
                    "min_threshold",
                    "number",
                    "never clip to below this norm (0: no floor)",
                    default=0.0,
                    minimum=0,
                ),
                ParamDef(
                    "clip_to",
                    "string",
                    "clip to ZClip's reciprocal value mean + z^2 * std^2 / (norm - mean) (lower the "
                    "larger the spike), or to the threshold itself",
                    default="reciprocal",
                    enum=("reciprocal", "threshold"),
                ),
                ParamDef(
                    "mode",
                    "string",
                    "one norm over all targets, or one per group (insp.groups) with its own statistics "
                    "(an edit restarts them)",
                    default="global",
                    enum=("global", "group"),
                ),
                ParamDef(
                    "norm_type",
                    "number",
                    "p of the p-norm; inf for the max-norm (an edit restarts the statistics)",
                    default=2.0,
                    exclusive_minimum=0,
                    allow_inf=True,
                ),
            ),
        ),
        KindDef(
            "scale",
            _PRE_POST,
            "Multiply gradients by factor. Not a per-layer learning rate under Adam-like optimizers, "
            "which normalise the gradient's scale away. At post_accumulate under gradient accumulation "
            "the step's gradient is multiplied once (each micro-batch's share scaled once).",
            (ParamDef("factor", "number", "multiplier (negative allowed)", required=True),),
        ),
        KindDef(
            "l2",
            _PRE_POST,
            "Add lam * param to the gradient (classic L2 penalty, coupled to the optimizer). At "
            "post_accumulate under gradient accumulation it is added once per step.",
            (ParamDef("lam", "number", "penalty weight", required=True, minimum=0),),
        ),
        KindDef(
            "freeze",
            ("pre_step",),
            "Set grad to None so the optimizer skips the parameter entirely (a zero scale would still "
            "let momentum, Adam and weight decay move it).",
        ),
        KindDef(
            "nan_guard",
            ("pre_step", "post_accumulate", "module"),
            "Find non-finite gradients and name them; 'report' only, 'zero' the whole gradient of each "
            "affected parameter, or 'skip' the optimizer step (every gradient of the optimizer set to "
            "None, its parameters the inspector does not watch included).",
            (
                ParamDef(
                    "action",
                    "string",
                    "what to do on a non-finite gradient",
                    default="report",
                    enum=("report", "zero", "skip"),
                ),
            ),
            rule=_nan_guard_rule,
        ),
        KindDef(
            "noise",
            _PRE_POST,
            "Add Gaussian noise N(0, std^2) from a dedicated generator seeded with seed (never the global "
            "RNG). At post_accumulate under gradient accumulation one draw per step.",
            (
                ParamDef("std", "number", "standard deviation", required=True, minimum=0),
                ParamDef("seed", "integer", "generator seed", default=0, minimum=0, maximum=2**63 - 1),
            ),
        ),
        KindDef(
            "module_log",
            ("module",),
            "Log the norm of each target module's grad_output (and grad_input if asked).",
            (
                ParamDef(
                    "grad_input", "boolean", "also log the gradient w.r.t. the module's inputs", default=False
                ),
            ),
            modifies=False,
        ),
        KindDef(
            "python",
            _PRE_POST,
            "Your own callable fn(name, param) -> None that edits param.grad in place; added from Python "
            "with insp.add_hook(fn, target=...).",
        ),
    )
}


def modifies(kind: str, params: Mapping[str, Any]) -> bool:
    """Whether a hook of this kind with these params can change gradients."""
    if kind == "nan_guard":
        return params.get("action") != "report"
    return KINDS[kind].modifies


def _check_value(p: ParamDef, value: Any) -> Any:
    loc = ("params", p.name)
    if p.type == "string":
        if not isinstance(value, str):
            raise HookError(loc, f"must be a string (got {shown(value)})")
        if p.enum and value not in p.enum:
            raise HookError(loc, f"must be one of {', '.join(map(repr, p.enum))} (got {shown(value)})")
        return value
    if p.type == "boolean":
        if not isinstance(value, bool):
            raise HookError(loc, f"must be true or false (got {shown(value)})")
        return value
    if isinstance(value, bool):
        raise HookError(loc, f"must be a number, not a boolean (got {shown(value)})")
    if p.allow_inf and isinstance(value, str) and value.strip().lower() in ("inf", "infinity"):
        value = math.inf
    if p.type == "integer":
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int):
            raise HookError(loc, f"must be an integer (got {shown(value)})")
    elif not isinstance(value, int | float):
        raise HookError(loc, f"must be a number (got {shown(value)})")
    else:
        try:
            value = float(value)
        except OverflowError:  # an integer past the float range (JSON allows 400 digits)
            raise HookError(loc, f"must be finite (got {shown(value)})") from None
        if math.isnan(value) or (math.isinf(value) and not (p.allow_inf and value > 0)):
            raise HookError(loc, f"must be finite (got {shown(value)})")
    if p.exclusive_minimum is not None and not value > p.exclusive_minimum:
        raise HookError(loc, f"must be > {p.exclusive_minimum:g} (got {shown(value)})")
    if p.minimum is not None and not value >= p.minimum:
        raise HookError(loc, f"must be >= {p.minimum:g} (got {shown(value)})")
    if p.exclusive_maximum is not None and not value < p.exclusive_maximum:
        raise HookError(loc, f"must be < {p.exclusive_maximum:g} (got {shown(value)})")
    if p.maximum is not None and not value <= p.maximum:
        raise HookError(loc, f"must be <= {p.maximum:.0f} (got {shown(value)})")
    return value


def check_point(kind: str, point: Any) -> str:
    """Validate ``point`` for ``kind`` (None means the kind's default point)."""
    kd = KINDS[kind]
    if point is None:
        return kd.points[0]
    if not isinstance(point, str) or point not in POINTS:
        raise HookError(("point",), f"must be one of {', '.join(POINTS)} (got {shown(point)})")
    if point not in kd.points:
        raise HookError(("point",), f"{kind} does not run at {point}; it runs at {', '.join(kd.points)}")
    return point


def check_kind(kind: Any) -> str:
    if not isinstance(kind, str) or kind not in KINDS:
        raise HookError(("kind",), f"unknown kind {shown(kind)}; known kinds: {', '.join(KINDS)}")
    return kind


def validate_params(kind: str, point: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """Return ``params`` checked, normalised (floats, inf) and completed with defaults.

    Raises:
        HookError: naming the first offending field; nothing is changed by the caller then.
    """
    if not isinstance(params, Mapping):
        raise HookError(("params",), f"must be an object (got {shown(params)})")
    kd = KINDS[kind]
    known = {p.name: p for p in kd.params}
    for name in params:
        if name not in known:
            allowed = ", ".join(known) or "none"
            raise HookError(("params", str(name)), f"unknown parameter for {kind} (allowed: {allowed})")
    out: dict[str, Any] = {}
    for p in kd.params:
        if p.name in params:
            out[p.name] = _check_value(p, params[p.name])
        elif p.required:
            raise HookError(("params", p.name), f"required for {kind}")
        else:
            out[p.name] = p.default
    if kd.rule is not None:
        err = kd.rule(point, out)
        if err is not None:
            raise err
    return out


def _schema(p: ParamDef) -> dict[str, Any]:
    s: dict[str, Any] = {"type": p.type, "description": p.description}
    if p.default is not None:
        s["default"] = p.default
    if p.enum:
        s["enum"] = list(p.enum)
    if p.minimum is not None:
        s["minimum"] = p.minimum
    if p.exclusive_minimum is not None:
        s["exclusiveMinimum"] = p.exclusive_minimum
    if p.exclusive_maximum is not None:
        s["exclusiveMaximum"] = p.exclusive_maximum
    if p.maximum is not None:
        s["maximum"] = p.maximum
    if p.allow_inf:
        s["type"] = ["number", "string"]
        s["description"] += ' (the string "inf" for the max-norm)'
    return s


def hook_kinds() -> dict[str, dict[str, Any]]:
    """Every kind as a JSON Schema of its params, with defaults, plus its points.

    ``{"clip_value": {"type": "object", "description": ..., "points": ["pre_step", ...],
    "default_point": "pre_step", "point_descriptions": {"pre_step": "before optimizer.step(): ...", ...},
    "properties": {"threshold": {...}}, "required": ["threshold"],
    "additionalProperties": false}, ...}``
    """
    return {
        k.name: {
            "type": "object",
            "description": k.description,
            "points": list(k.points),
            "default_point": k.points[0],
            "point_descriptions": {pt: POINT_DESCRIPTIONS[pt] for pt in k.points},
            "modifies": k.modifies,
            "python_only": k.name == "python",
            "properties": {p.name: _schema(p) for p in k.params},
            "required": [p.name for p in k.params if p.required],
            "additionalProperties": False,
        }
        for k in KINDS.values()
    }
