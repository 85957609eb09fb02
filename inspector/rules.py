"""Rules for unattended runs: "when SIGNAL OP THRESHOLD [for K steps] then ACTION".

A rule is evaluated at every step boundary, by the training thread, from values already on the
host: the sampled step's snapshot (its one transfer), the events filed at this boundary (the
NaN/Inf findings of earlier steps' deferred checks, the spike detector's ``spike`` events) and
the recorded values of earlier steps that reached the host since the last boundary. It reads no
tensor, so it adds no host synchronisation.

Signals (``Rule.signal``):

- recorded with ``insp.record(...)``: ``loss``, the mean of the step's records whichever side of
  ``optimizer.step()`` they were made on, every step that has one, sampled or not. A step's value
  is final once the next step got under way (a late record could come until then) and reaches
  the host through the deferred queue (inspector.step.scalars ``Recorder.watch``): evaluated at
  step N + 1's boundary for a record made before ``step()``, N + 2's for one made after it (on a
  GPU, the first boundary after its copy completed), as step N (the firing's ``step``; ``at``:
  the boundary). While such a rule exists, every step's records are copied at once (one
  ``non_blocking`` copy a step). The last step's (two steps', recorded after ``step()``) reach
  the host after training's last boundary: not evaluated; nor are those of steps a rewind
  abandons that were still on their way;
- from the snapshot (sampled steps only; an unsampled step is not evaluated for them):
  ``total_norm``, ``total_norm_raw``, ``norm:<param>``, ``norm_raw:<param>``,
  ``group_norm:<group>``, ``group_norm_raw:<group>``, ``update_ratio`` (the largest of the
  step's tensors), ``noise_scale`` (``b_simple``; not evaluated while it has no estimate);
- from the boundary's events (every step): ``nonfinite`` (the number of tensors found non-finite
  by the checks reported at this boundary; 0 when none), ``spike`` (the largest z-score of the
  ``spike`` events filed here, 0 when none), ``spike:loss``, ``spike:grad_norm``,
  ``spike:<group>``;
- ``step`` (every step).

OPs: ``>``, ``>=``, ``<``, ``<=``, ``==``, ``!=`` against ``threshold``, and ``is_nonfinite``
(NaN or Inf; no threshold). ``for_steps`` K: the condition held on K consecutive evaluated steps
(each step counted once). A rule's state holds the last step it evaluated and the value
(``last_step``, ``last_value``), or, until there is one, why not (``waiting``).
A fired rule waits ``cooldown`` boundaries (0: none, and it may fire for each of several steps'
values evaluated at one boundary); at most ``cap`` firings per ``window`` steps (then one
``rule_capped`` event per window); an action that fails files ``rule_failed`` and, after
``max_failures`` failures in a row, the rule disables itself.

Actions: ``alert`` (the ``rule_fired`` event only), ``pause``, ``checkpoint``, ``add_hook``
(``args``: ``kind``, ``target``, ``point``, ``params``), ``update_hook`` (``hook_id`` and the
fields), ``enable_hook``/``disable_hook`` (``hook_id``), ``rewind_skip`` (to the newest checkpoint
taken at least ``min_steps`` steps before, skipping the batches since it; ``fallback``: ``pause``
when there is none), ``clip_norm`` (adds a ``clip_norm`` hook, or updates the one this rule added,
at the ``quantile`` of the recent sampled global raw norms: a host-side window of the last
``WINDOW`` sampled steps' ``total_norm_raw``), and any action a caller registers with
:meth:`Rules.set_handler` (the dashboard's ``end_shadow``).

Under torch.distributed rank 0 decides (its loss and spike detector are the run's) and the
decision travels in the next boundary's exchange (inspector.step.dist_sync): every rank acts on it
at that same boundary, with the rule as rank 0 sent it: a ``checkpoint`` or ``rewind_skip`` is
then carried out on every rank at that boundary (inspector.whatif.checkpoints), and every rank's log
has the same ``rule_fired``, ``rewind`` and ``batches_skipped``.
"""

from __future__ import annotations

import json
import math
import os
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .wire.errors import HookError, shown
from .wire.kinds import check_kind, check_point, validate_params

__all__ = ["ACTIONS", "OPS", "PRESETS", "WINDOW", "Rule", "Rules"]

OPS = (">", ">=", "<", "<=", "==", "!=", "is_nonfinite")
ACTIONS = (
    "alert",
    "pause",
    "checkpoint",
    "add_hook",
    "update_hook",
    "enable_hook",
    "disable_hook",
    "rewind_skip",
    "clip_norm",
    "end_shadow",
)
RECORD_SIGNALS = ("loss",)  # a recorded value: evaluated when the step's value reaches the host
SNAPSHOT_SIGNALS = ("total_norm", "total_norm_raw", "update_ratio", "noise_scale")
EVENT_SIGNALS = ("nonfinite", "spike", "step")
PREFIXES = ("norm:", "norm_raw:", "group_norm:", "group_norm_raw:", "spike:")
WINDOW = 200  # sampled global raw norms kept on the host for clip_norm's quantile
MAX_RULES = 64

_FIELDS = {
    "name",
    "signal",
    "op",
    "threshold",
    "for_steps",
    "action",
    "args",
    "cooldown",
    "enabled",
    "max_failures",
    "cap",
    "window",
}

PRESETS: dict[str, list[dict[str, Any]]] = {
    "safe overnight": [
        {
            "name": "safe overnight",
            "signal": "nonfinite",
            "op": ">",
            "threshold": 0,
            "action": "rewind_skip",
            "args": {"min_steps": 0, "fallback": "pause"},
            "cooldown": 10,
        }
    ],
    "clip on spike": [
        {
            "name": "clip on spike",
            "signal": "spike:grad_norm",
            "op": ">",
            "threshold": 0,
            "action": "clip_norm",
            "args": {"quantile": 0.99, "target": "*"},
            "cooldown": 50,
        }
    ],
}


MAX_ARGS_DEPTH = 16  # an action's arguments: objects and lists nested at most this deep ...
MAX_ARGS_ITEMS = 1000  # ... holding at most this many values in all


def _number(loc: str, v: Any) -> float:
    """A finite number as a float, or HookError (an integer past the float range included)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise HookError((loc,), f"must be a finite number (got {shown(v)})")
    try:
        f = float(v)
    except OverflowError:  # an integer of hundreds of digits (JSON allows it)
        raise HookError(
            (loc,), f"must be a finite number (got an integer of {v.bit_length()} bits)"
        ) from None
    if not math.isfinite(f):
        raise HookError((loc,), f"must be a finite number (got {shown(v)})")
    return f


def _check_data(args: Any) -> None:
    """``args`` is plain JSON data: objects with string keys, lists, strings, finite numbers,
    booleans and null, at most ``MAX_ARGS_DEPTH`` deep and ``MAX_ARGS_ITEMS`` values in all
    (HookError naming the path of the first that is not). Walked without recursion."""
    todo: list[tuple[Any, tuple[Any, ...]]] = [(args, ("args",))]
    seen = 0
    while todo:
        v, loc = todo.pop()
        seen += 1
        if seen > MAX_ARGS_ITEMS:
            raise HookError(("args",), f"at most {MAX_ARGS_ITEMS} values in all")
        if len(loc) > MAX_ARGS_DEPTH + 1:
            raise HookError(loc[:2], f"nested more than {MAX_ARGS_DEPTH} deep")
        if v is None or isinstance(v, (str, bool)):
            continue
        if isinstance(v, (int, float)):
            try:
                _number("", v)
            except HookError as e:
                raise HookError(loc, e.msg) from None
        elif isinstance(v, Mapping):
            for k, x in v.items():
                if not isinstance(k, str):
                    raise HookError(loc, f"keys must be strings (got {shown(k)})")
                todo.append((x, (*loc, k)))
        elif isinstance(v, (list, tuple)):
            todo.extend((x, (*loc, i)) for i, x in enumerate(v))
        else:
            raise HookError(loc, f"must be JSON data (got {shown(v)})")


def _int(loc: str, v: Any, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise HookError((loc,), f"must be an integer in [{lo}, {hi}] (got {shown(v)})")
    return v


def _check_args(action: str, args: Any) -> dict[str, Any]:
    """The action's arguments, checked (HookError naming ``args.<field>``)."""
    if args is None:
        args = {}
    if not isinstance(args, Mapping):
        raise HookError(("args",), f"must be an object (got {shown(args)})")
    _check_data(args)
    args = dict(args)
    if action == "add_hook":
        kind = args.get("kind")
        try:
            check_kind(kind)
            point = check_point(kind, args.get("point"))
            validate_params(kind, point, args.get("params") or {})
        except HookError as e:
            raise HookError(("args", *e.loc), e.msg) from None
        if kind == "python":
            raise HookError(("args", "kind"), "python hooks cannot be added by a rule")
        if not isinstance(args.get("target", "*"), str):
            raise HookError(("args", "target"), "must be a glob string")
    elif action in ("update_hook", "enable_hook", "disable_hook"):
        if not isinstance(args.get("hook_id"), str):
            raise HookError(
                ("args", "hook_id"), f"required: the hook's id (got {shown(args.get('hook_id'))})"
            )
    elif action == "rewind_skip":
        args["min_steps"] = _int("args.min_steps", args.get("min_steps", 0), 0, 10**9)
        if args.get("fallback") not in (None, "pause"):
            raise HookError(
                ("args", "fallback"), f"must be null or 'pause' (got {shown(args.get('fallback'))})"
            )
    elif action == "clip_norm":
        q = args.get("quantile", 0.99)
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0.0 < q <= 1.0:
            raise HookError(("args", "quantile"), f"must be a number in (0, 1] (got {shown(q)})")
        args["quantile"] = float(q)
        if not isinstance(args.get("target", "*"), str):
            raise HookError(("args", "target"), "must be a glob string")
    elif action == "checkpoint":
        if args.get("label") is not None and not isinstance(args["label"], str):
            raise HookError(("args", "label"), "must be a string")
    return args


def _check_signal(signal: Any) -> str:
    if isinstance(signal, str) and (
        signal in RECORD_SIGNALS
        or signal in SNAPSHOT_SIGNALS
        or signal in EVENT_SIGNALS
        or any(signal.startswith(p) and len(signal) > len(p) for p in PREFIXES)
    ):
        return signal
    raise HookError(
        ("signal",),
        f"unknown signal {shown(signal)}; known: {', '.join(RECORD_SIGNALS + SNAPSHOT_SIGNALS + EVENT_SIGNALS)}, "
        f"or {', '.join(p + '<name>' for p in PREFIXES)}",
    )


@dataclass
class Rule:
    """One rule: its definition (``to_dict()``'s first keys) and its state (the rest)."""

    id: str
    signal: str
    op: str
    action: str
    threshold: float | None = None
    for_steps: int = 1
    args: dict[str, Any] = field(default_factory=dict)
    cooldown: int = 10
    enabled: bool = True
    max_failures: int = 3
    cap: int = 10  # at most this many firings ...
    window: int = 1000  # ... per this many steps
    name: str | None = None
    # state
    streak: int = 0
    fired: int = 0
    failures: int = 0
    last_fired: int | None = None
    last_firing: dict[str, Any] | None = None
    window_start: int = 0
    window_fired: int = 0
    capped: bool = False
    hook_id: str | None = None  # the clip_norm hook this rule added
    last_tick: int | None = None  # the boundary it last fired at (cooldown and window count boundaries)
    last_step: int | None = None  # the last step evaluated ...
    last_value: float | None = None  # ... and its value

    def definition(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "signal": self.signal,
            "op": self.op,
            "threshold": self.threshold,
            "for_steps": self.for_steps,
            "action": self.action,
            "args": dict(self.args),
            "cooldown": self.cooldown,
            "enabled": self.enabled,
            "max_failures": self.max_failures,
            "cap": self.cap,
            "window": self.window,
        }

    def to_dict(self, waiting: str | None = None) -> dict[str, Any]:
        """Definition and state; ``waiting``: why it has not been evaluated yet (shown until it is)."""
        return {
            **self.definition(),
            "state": {
                "streak": self.streak,
                "fired": self.fired,
                "failures": self.failures,
                "last_fired": self.last_fired,
                "last_firing": self.last_firing,
                "hook_id": self.hook_id,
                "last_step": self.last_step,
                "last_value": self.last_value,
                "waiting": None if self.last_step is not None else waiting,
            },
        }


def check_rule(spec: Mapping[str, Any], base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A rule's definition checked and completed (``base``: the current one, for an update).

    Raises:
        HookError: naming the first bad field; the caller changes nothing then.
    """
    if not isinstance(spec, Mapping):
        raise HookError((), f"a rule must be an object (got {shown(spec)})")
    for k in spec:
        if k not in _FIELDS and not (base is None and k in ("id", "state")):
            raise HookError((str(k),), f"unknown field (allowed: {', '.join(sorted(_FIELDS))})")
    d = {
        "name": None,
        "threshold": None,
        "for_steps": 1,
        "args": {},
        "cooldown": 10,
        "enabled": True,
        "max_failures": 3,
        "cap": 10,
        "window": 1000,
        **(base or {}),
        **{k: v for k, v in spec.items() if k in _FIELDS},
    }
    d["signal"] = _check_signal(d.get("signal"))
    if d.get("op") not in OPS:
        raise HookError(("op",), f"must be one of {', '.join(OPS)} (got {shown(d.get('op'))})")
    t = d["threshold"]
    if d["op"] != "is_nonfinite":
        d["threshold"] = _number("threshold", t)
    else:
        d["threshold"] = None
    if d.get("action") not in ACTIONS:
        raise HookError(("action",), f"must be one of {', '.join(ACTIONS)} (got {shown(d.get('action'))})")
    d["args"] = _check_args(d["action"], d["args"])
    d["for_steps"] = _int("for_steps", d["for_steps"], 1, 10**6)
    d["cooldown"] = _int("cooldown", d["cooldown"], 0, 10**9)
    d["max_failures"] = _int("max_failures", d["max_failures"], 1, 10**6)
    d["cap"] = _int("cap", d["cap"], 1, 10**6)
    d["window"] = _int("window", d["window"], 1, 10**9)
    if not isinstance(d["enabled"], bool):
        raise HookError(("enabled",), f"must be true or false (got {shown(d['enabled'])})")
    if d["name"] is not None and not isinstance(d["name"], str):
        raise HookError(("name",), f"must be a string or null (got {shown(d['name'])})")
    if isinstance(d["name"], str):
        d["name"] = d["name"][:100]
    return {k: d[k] for k in _FIELDS | {"signal", "op", "action"}}


def _host_float(v: Any) -> float | None:
    """A recorded mean as a float (the strict-JSON strings of NaN and the infinities included)."""
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return float(v)
    return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}.get(v) if isinstance(v, str) else None


def _compare(op: str, value: float, threshold: float | None) -> bool:
    if op == "is_nonfinite":
        return not math.isfinite(value)
    assert threshold is not None
    # (IEEE: NaN compares false but for "!="; Inf as the infinite number: "is_nonfinite" is their rule)
    return {
        ">": value > threshold,
        ">=": value >= threshold,
        "<": value < threshold,
        "<=": value <= threshold,
        "==": value == threshold,
        "!=": value != threshold,
    }[op]


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (linear interpolation between order statistics)."""
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


class Rules:
    """The rules of one Inspector: their definitions and state, evaluation at the boundary, actions.

    ``api``: the Inspector's public methods the actions call (``add_hook``, ``update_hook``,
    ``pause``, ``checkpoint``, ``rewind``, ``checkpoints``, ``step``, ``params``, ``group_names``); ``emit``:
    the event log's. ``rank``/``world``: under torch.distributed, rank 0 decides and ``outbox``
    holds its decisions until the next exchange carries them (``receive``) to every rank.
    """

    def __init__(
        self, api: Mapping[str, Any], emit: Callable[..., Any], *, rank: int = 0, distributed: bool = False
    ) -> None:
        self._api = api
        self._emit = emit
        self._rank = rank
        self._dist = distributed
        self._rules: dict[str, Rule] = {}
        self._next = 1
        self._handlers: dict[str, Callable[[dict[str, Any]], Any]] = {}
        self._norms: deque[float] = deque(maxlen=WINDOW)
        self.outbox: list[dict[str, Any]] = []  # rank 0's decisions, for the next exchange
        self._inbox: list[dict[str, Any]] = []  # decisions every rank acts on at its next boundary
        self._tick = 0  # boundaries seen (a rewind moves the step back, not this)
        # recorded values of closed steps that reached the host (Recorder.watch), for the next boundary
        self._arrived: deque[tuple[int, dict[str, Any]]] = deque(maxlen=1024)
        self._forgotten = 0  # rewinds that dropped them (one carried out at this boundary too)

    # ------------------------------------------------------------ definitions
    @property
    def active(self) -> bool:
        """Whether the boundary has anything to do (cheap: no rule, nothing to act on)."""
        return bool(self._rules) or bool(self._inbox)

    @property
    def wants_records(self) -> bool:
        """Whether a rule reads a recorded value (the deciding rank only): then every step's
        records are sent to the host at once and handed to :meth:`arrived`."""
        return not (self._dist and self._rank != 0) and any(
            r.enabled and r.signal in RECORD_SIGNALS
            for r in tuple(self._rules.values())  # (read without the lock, by the training thread)
        )

    def arrived(self, step: int, means: Mapping[str, Any]) -> None:
        """Step ``step``'s recorded means reached the host (every record of it: the step is
        closed); evaluated at the next boundary (the Inspector's lock held)."""
        if self.wants_records:
            self._arrived.append((step, dict(means)))

    def forget_arrived(self) -> None:
        """A rewind abandoned the steps whose values arrived and wait for the next boundary: the
        branch left behind's, not evaluated (the Inspector's lock held)."""
        self._arrived.clear()
        self._forgotten += 1

    def list(self) -> list[dict[str, Any]]:
        return [self._dict(r) for r in self._rules.values()]

    def get(self, rule_id: str) -> dict[str, Any]:
        return self._dict(self._find(rule_id))

    def _dict(self, rule: Rule) -> dict[str, Any]:
        return rule.to_dict(None if rule.last_step is not None else self._waiting(rule.signal))

    def _waiting(self, signal: str) -> str:
        """Why a rule on ``signal`` has not been evaluated yet: what it waits for."""
        if self._dist and self._rank != 0:
            return "rank 0 evaluates the rules (its firings reach this rank in the exchange)"
        if signal in RECORD_SIGNALS:
            return (
                f"no {signal} has reached the host yet: insp.record({signal}=...) each step; a "
                "step's value is evaluated at the boundary it arrives at (the next one; the one "
                "after when recorded after optimizer.step())"
            )
        if signal.startswith(("norm:", "norm_raw:")):
            name = signal.split(":", 1)[1]
            if name not in self._api["params"]:
                return f"no parameter named {name!r} here"
        if signal.startswith(("group_norm:", "group_norm_raw:")):
            name = signal.split(":", 1)[1]
            if name not in self._api["group_names"]():
                return f"no group named {name!r} here"
        if signal == "noise_scale":
            return "no noise-scale estimate yet (evaluated on the sampled steps that have one)"
        if signal in SNAPSHOT_SIGNALS or signal.startswith(("norm", "group_norm")):
            return "no sampled step since it was added (evaluated on sampled steps only)"
        return "no step boundary since it was added"

    def _find(self, rule_id: str) -> Rule:
        r = self._rules.get(rule_id)
        if r is None:
            raise HookError(("rule_id",), f"no rule with id {shown(rule_id)}")
        return r

    def add(self, spec: Mapping[str, Any]) -> dict[str, Any]:
        d = check_rule(spec)
        if len(self._rules) >= MAX_RULES:
            raise HookError((), f"at most {MAX_RULES} rules")
        rid = f"r{self._next}"
        self._next += 1
        rule = Rule(id=rid, **d)
        self._rules[rid] = rule
        self._emit("rule_added", rule=rule.definition())
        return self._dict(rule)

    def update(self, rule_id: str, change: Mapping[str, Any]) -> dict[str, Any]:
        rule = self._find(rule_id)
        d = check_rule(change, base=rule.definition())
        if d["signal"] != rule.signal:  # what it evaluated was another signal's
            rule.streak, rule.last_step, rule.last_value = 0, None, None
        for k, v in d.items():
            setattr(rule, k, v)
        if change.get("enabled") is True:
            rule.failures, rule.streak = 0, 0
        self._emit("rule_updated", rule=rule.definition())
        return self._dict(rule)

    def remove(self, rule_id: str) -> None:
        rule = self._find(rule_id)
        del self._rules[rule_id]
        self._emit("rule_removed", rule=rule.definition())

    def export(self) -> dict[str, Any]:
        """The rules as a preset (``{"rules": [definition, ...]}``), for :meth:`load` or a file."""
        return {
            "rules": [{k: v for k, v in r.definition().items() if k != "id"} for r in self._rules.values()]
        }

    def load(self, preset: Any) -> list[dict[str, Any]]:
        """Add the rules of ``preset``: a preset's name (:data:`PRESETS`), ``{"rules": [...]}``,
        a list of rules, or a path to a JSON file of one of those. All or nothing."""
        if isinstance(preset, str) and preset in PRESETS:
            preset = PRESETS[preset]
        elif isinstance(preset, (str, os.PathLike)):
            try:
                with open(preset, encoding="utf-8") as f:
                    preset = json.load(f)
            except (OSError, ValueError) as e:
                raise HookError(("rules",), f"cannot read the rules file {shown(str(preset))}: {e}") from None
        items = preset.get("rules") if isinstance(preset, Mapping) else preset
        if not isinstance(items, list):
            raise HookError(
                ("rules",), "must be a list of rules, {'rules': [...]}, a preset's name or a file"
            )
        for k, item in enumerate(items):
            try:
                check_rule(item)
            except HookError as e:
                raise HookError(("rules", k, *e.loc), e.msg) from None
        if len(self._rules) + len(items) > MAX_RULES:
            raise HookError(("rules",), f"at most {MAX_RULES} rules")
        return [self.add(item) for item in items]

    @staticmethod
    def write(path: str | os.PathLike[str], preset: dict[str, Any]) -> None:
        """Write a preset (:meth:`export`) to a JSON file (for ``attach(rules=...)``, ``demo --rules``)."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(preset, f, indent=2)

    def set_handler(self, action: str, fn: Callable[[dict[str, Any]], Any] | None) -> None:
        """Register (None: drop) what an action a caller provides does (the dashboard's
        ``end_shadow``); it is called on the training thread with the rule's firing."""
        if fn is None:
            self._handlers.pop(action, None)
        else:
            self._handlers[action] = fn

    # ------------------------------------------------------------ evaluation
    def _value(
        self,
        signal: str,
        step: int,
        snap: Any,
        events: list[dict[str, Any]],
        records: Mapping[str, Any] | None = None,
    ) -> float | None:
        if signal in RECORD_SIGNALS:  # from the step's records once they arrived, not the snapshot
            return None if records is None else _host_float(records.get(signal))
        if records is not None:
            return None  # (an arrival evaluates the rules on recorded values only)
        if signal == "step":
            return float(step)
        if signal == "nonfinite":
            return float(
                sum(
                    int(e.get("n_params") or 1)
                    for e in events
                    if e.get("kind") == "nonfinite" and e.get("param")
                )
            )
        if signal == "spike" or signal.startswith("spike:"):
            which = signal[6:] if signal.startswith("spike:") else None
            zs = [
                float(e.get("z") or 0.0)
                for e in events
                if e.get("kind") == "spike"
                and (
                    which is None
                    or e.get("signal") == which
                    or (e.get("signal") == "group" and e.get("group") == which)
                )
            ]
            return max(zs, default=0.0)
        if snap is None:
            return None
        if signal in ("total_norm", "total_norm_raw"):
            v = getattr(snap, signal)
            return None if v is None else float(v)
        if signal == "update_ratio":
            vals = [v for v in snap.update_ratio if v is not None]
            return max(vals) if vals else None
        if signal == "noise_scale":
            ns = snap.noise_scale
            v = ns.get("b_simple") if ns else None
            return None if v is None else float(v)
        name = signal.split(":", 1)[1]
        if signal.startswith("norm"):
            params = self._api["params"]
            if name not in params:
                return None
            v = (snap.grad_norm_raw if signal.startswith("norm_raw:") else snap.grad_norm)[params.index(name)]
            return None if v is None else float(v)
        groups = snap.groups
        if not groups:
            return None
        names = self._api["group_names"]()
        if name not in names:
            return None
        v = groups["norm_raw" if signal.startswith("group_norm_raw:") else "norm"][names.index(name)]
        return None if v is None else float(v)

    def boundary(self, step: int, snap: Any, events: list[dict[str, Any]]) -> None:
        """Step ``step``'s boundary (training thread): act on what the exchange brought (under
        torch.distributed), then evaluate every rule; never raises."""
        self._tick += 1
        try:
            if snap is not None and snap.total_norm_raw is not None and math.isfinite(snap.total_norm_raw):
                self._norms.append(float(snap.total_norm_raw))
            inbox, self._inbox = self._inbox, []
            for firing in inbox:
                self._act(firing, step)
            arrived = list(self._arrived)
            self._arrived.clear()
            if self._dist and self._rank != 0:
                return
            # the recorded values that reached the host since the last boundary, a step each in
            # order (a step of its own, firing for it), then this boundary's snapshot and events
            todo = [(s, None, [], means) for s, means in arrived] + [(step, snap, events, None)]
            forgotten = self._forgotten
            for at, at_snap, at_events, means in todo:
                if means is not None and self._forgotten != forgotten:
                    continue  # a firing here rewound: the values still to evaluate are the branch left's
                for rule in list(self._rules.values()):
                    firing = self._evaluate(rule, at, at_snap, at_events, means)
                    if firing is None:
                        continue
                    if self._dist:
                        self.outbox.append(firing)
                    else:
                        self._act(firing, step)
        except Exception as e:  # never take training down for our code
            self._emit(
                "telemetry_error",
                message=f"the rules could not be evaluated: {type(e).__name__}: {e}",
                step=step,
            )

    def _evaluate(
        self,
        rule: Rule,
        step: int,
        snap: Any,
        events: list[dict[str, Any]],
        records: Mapping[str, Any] | None = None,
    ) -> dict[str, Any] | None:
        if not rule.enabled:
            return None
        value = self._value(rule.signal, step, snap, events, records)
        if value is None:
            return None  # not evaluated at this step: the streak stands
        rule.last_step, rule.last_value = step, value
        if not _compare(rule.op, value, rule.threshold):
            rule.streak = 0
            return None
        rule.streak += 1
        if rule.streak < rule.for_steps:
            return None
        tick = self._tick
        # (cooldown 0: no wait, not even within a boundary that evaluates several steps' values)
        if rule.cooldown and rule.last_tick is not None and tick - rule.last_tick <= rule.cooldown:
            return None
        if tick - rule.window_start >= rule.window or rule.window_fired == 0:
            rule.window_start, rule.window_fired, rule.capped = tick, 0, False
        if rule.window_fired >= rule.cap:
            if not rule.capped:
                rule.capped = True
                self._emit(
                    "rule_capped",
                    rule=rule.id,
                    step=step,
                    message=f"{rule.cap} firings in {rule.window} steps: quiet for "
                    f"{rule.window_start + rule.window - tick} more steps",
                )
            return None
        rule.window_fired += 1
        rule.streak = 0
        rule.last_fired, rule.last_tick = step, tick
        args = dict(rule.args)
        if rule.action == "clip_norm":
            if not self._norms:
                args["max_norm"] = None
            else:
                args["max_norm"] = quantile(list(self._norms), args["quantile"])
                args["window"] = len(self._norms)
            args["hook_id"] = rule.hook_id
        return {
            "rule": rule.id,
            "name": rule.name,
            "signal": rule.signal,
            "op": rule.op,
            "threshold": rule.threshold,
            "value": value,
            "step": step,
            "action": rule.action,
            "args": args,
        }

    # ------------------------------------------------------------ actions
    def receive(self, firings: list[dict[str, Any]]) -> None:
        """Decisions the exchange brought from rank 0 (every rank, rank 0 included)."""
        self._inbox.extend(firings)

    def _act(self, firing: dict[str, Any], step: int) -> None:
        rule = self._rules.get(firing["rule"])
        try:
            result = self._do(firing["action"], firing["args"], rule)
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
            disabled = False
            if rule is not None:
                rule.failures += 1
                if rule.failures >= rule.max_failures:
                    rule.enabled, disabled = False, True
            self._emit("rule_failed", **firing, at=step, reason=reason, disabled=disabled)
            return
        if rule is not None:
            rule.failures = 0
            rule.fired += 1
            rule.last_firing = {**firing, "at": step, "result": result}
        self._emit("rule_fired", **firing, at=step, result=result)

    def _do(self, action: str, args: dict[str, Any], rule: Rule | None) -> Any:
        api = self._api
        if action == "alert":
            return None
        if action == "pause":
            return api["pause"]()
        if action == "checkpoint":
            return {"checkpoint": api["checkpoint"](args.get("label") or "rule")}
        if action == "add_hook":
            h = api["add_hook"](
                args["kind"],
                target=args.get("target", "*"),
                point=args.get("point"),
                params=args.get("params") or {},
                enabled=args.get("enabled", True),
            )
            return {"hook_id": h.id}
        if action == "update_hook":
            change = {k: v for k, v in args.items() if k in ("params", "enabled", "target")}
            return api["update_hook"](args["hook_id"], **change)
        if action in ("enable_hook", "disable_hook"):
            return api["update_hook"](args["hook_id"], enabled=action == "enable_hook")
        if action == "clip_norm":
            max_norm = args.get("max_norm")
            if max_norm is None or not max_norm > 0:
                raise RuntimeError("no sampled global norm yet to take the quantile of")
            hook_id = args.get("hook_id")
            if hook_id is not None:
                try:
                    api["update_hook"](hook_id, params={"max_norm": max_norm}, enabled=True)
                    return {"hook_id": hook_id, "max_norm": max_norm, "updated": True}
                except HookError:
                    pass  # removed meanwhile: add a new one
            h = api["add_hook"](
                "clip_norm",
                target=args.get("target", "*"),
                point=None,
                params={"max_norm": max_norm},
                enabled=True,
            )
            if rule is not None:
                rule.hook_id = h.id
            return {"hook_id": h.id, "max_norm": max_norm, "updated": False}
        if action == "rewind_skip":
            return self._rewind(args)
        fn = self._handlers.get(action)
        if fn is None:
            raise RuntimeError(f"no handler for {action} here (the dashboard registers it)")
        return fn(args)

    def _rewind(self, args: dict[str, Any]) -> Any:
        api = self._api
        now = api["step"]()
        m = int(args.get("min_steps", 0))
        try:
            kept = [c for c in api["checkpoints"]() if c["taken"] and now - c["step"] >= m]
        except Exception as e:
            kept, refused = [], str(e)
        else:
            refused = None
        if not kept:
            why = refused or f"no checkpoint taken at least {m} steps before step {now}"
            if args.get("fallback") == "pause":
                api["pause"]()
                return {"rewound": False, "paused": True, "reason": why}
            raise RuntimeError(why)
        cp = max(kept, key=lambda c: c["step"])
        out = api["rewind"](cp["id"], skip="since_checkpoint")
        return {"rewound": True, **out}
