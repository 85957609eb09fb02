"""The hook registry: the requested configuration, the pending changes, the applied one.

Edits are validated at once against the requested configuration (so an invalid edit
changes nothing) and become a :class:`Change` that carries the whole requested config
after it. The training thread applies pending changes in order (or the caller does, between
steps, when no pending change registers a torch hook: ``StepLifecycle.submit``); applying one
makes its config the applied config and bumps ``version`` (``config_version``).

The registry does no locking and registers no torch hooks: its callers hold the Inspector's
lock, and :class:`~inspector.hooks.edits.Edits` with :class:`~inspector.hooks.torch_hooks.TorchHooks`
do the torch side.

Hook ids: ``h1``, ``h2``, ... in the order hooks are added. Under ``torch.distributed`` every rank
runs the same script, so the hooks the script adds (on the training thread) get ``h`` ids from a
counter that advances alike on every rank, while rank 0's other edits (its dashboard, its HTTP
API) get ``r`` ids (``r1``, ``r2``, ...) from a counter of their own: a script hook has the same
id on every rank whatever dashboard edits came before it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..wire.errors import HookError, HookNotFound, shown
from ..wire.kinds import check_kind, check_point, modifies, validate_params
from ..wire.records import HookSpec
from .targets import check_target

__all__ = ["Registry", "Change", "PRESET_FORMAT", "MAX_HOOKS"]

PRESET_FORMAT = "gradient-inspector/hooks"
# At most this many hooks in a configuration, added one by one or imported: each one costs every
# step, every snapshot and every websocket hello, and a client must not grow those without bound.
MAX_HOOKS = 256
_PRESET_KEYS = {"kind", "target", "params", "point", "enabled"}


@dataclass(frozen=True, slots=True)
class Change:
    action: str  # add, update, remove, enable, disable, import
    hook_id: str | None
    before: Any  # HookSpec | list[HookSpec] | None
    after: Any
    config: tuple[HookSpec, ...]  # the whole requested config once this change is in force

    def touches_torch(self) -> bool:
        """Whether applying this change registers or removes torch hooks (not pre_step only)."""
        specs = [s for s in (self.before, self.after) if isinstance(s, HookSpec)]
        for group in (self.before, self.after):
            if isinstance(group, list):
                specs.extend(group)
        return any(s.point != "pre_step" for s in specs)


def _content(s: HookSpec) -> tuple[Any, ...]:
    """A hook's own configuration, but for its place in the order (:func:`in_order`): any
    difference gives it a new ``applied_step``."""
    return (s.kind, s.point, s.target, tuple(sorted(s.params.items())), s.enabled)


def in_order(prev: Any, new: Any) -> set[str]:
    """The ids of the hooks in both ``prev`` and ``new`` (specs, in order) that keep their order
    relative to every other hook in both: the same of them before it. Not its position: a hook
    added or removed before it shifts that and leaves what it acts after as it was; a move (its
    own, or another's past it) changes it."""
    common = {s.id for s in prev} & {s.id for s in new}
    a = [s.id for s in prev if s.id in common]
    b = [s.id for s in new if s.id in common]
    kept: set[str] = set()
    diff: set[str] = set()  # the symmetric difference of a[:k] and b[:k]
    for x, y in zip(a, b, strict=True):
        if x == y and not diff:
            kept.add(x)
        diff ^= {x}
        diff ^= {y}
    return kept


class Registry:
    def __init__(
        self,
        param_names: list[str],
        module_names: list[str],
        *,
        scaler: bool = False,
        distributed: bool = False,
        compiled: bool = False,
        is_script: Callable[[], bool] | None = None,
    ) -> None:
        self.param_names = param_names
        self.module_names = module_names
        self.scaler = scaler
        self.distributed = distributed
        self.compiled = compiled  # torch.compile'd: no module-point hooks
        self.requested: list[HookSpec] = []
        self.applied: tuple[HookSpec, ...] = ()
        self.pending: deque[Change] = deque()
        self.version = 0
        self.fns: dict[str, Callable[[str, Any], Any]] = {}
        self._next_id = 1
        self._next_remote = 1  # under torch.distributed: ids of rank 0's edits from other threads
        self._is_script = is_script  # whether the edit comes from the training thread (the script)

    # ---------------------------------------------------------------- validation
    def _names_for(self, point: str) -> tuple[list[str], str]:
        return (self.module_names, "module") if point == "module" else (self.param_names, "parameter")

    def validate(
        self,
        kind: Any,
        target: Any,
        point: Any,
        params: Any,
        enabled: Any,
        fn: Callable[..., Any] | None = None,
    ) -> tuple[str, str, str, dict[str, Any], bool]:
        kind = check_kind(kind)
        if kind == "python" and fn is None:
            raise HookError(("kind",), "python hooks are added from Python: insp.add_hook(fn, target=...)")
        point = check_point(kind, point)
        check_target(target, *self._names_for(point))
        params = validate_params(kind, point, params if params is not None else {})
        if not isinstance(enabled, bool):
            raise HookError(("enabled",), f"must be true or false (got {shown(enabled)})")
        if point == "post_accumulate" and self.scaler and modifies(kind, params):
            raise HookError(
                ("point",),
                "a GradScaler is attached: at post_accumulate the gradients are still "
                "scaled, so a modifying hook there would act on scaled values; use pre_step, "
                "which runs after unscaling",
            )
        if point == "module" and self.compiled:
            raise HookError(
                ("point",),
                "the model is compiled (torch.compile): a module hook adds tensor hooks inside the "
                "compiled forward, which fullgraph=True refuses and other modes break the graph for; "
                "watch its parameters instead (pre_step or post_accumulate)",
            )
        if point == "post_accumulate" and self.distributed and kind == "clip_norm":
            raise HookError(
                ("point",),
                "under DDP, post_accumulate runs on each rank's local gradient before "
                "the all-reduce, so a norm clip there differs per rank; use pre_step",
            )
        return kind, target, point, params, enabled

    # ---------------------------------------------------------------- edits
    def _new_id(self) -> str:
        """The next hook id: ``r<n>`` for rank 0's non-script edits under torch.distributed, else ``h<n>``."""
        if self.distributed and self._is_script is not None and not self._is_script():
            self._next_remote += 1
            return f"r{self._next_remote - 1}"
        self._next_id += 1
        return f"h{self._next_id - 1}"

    def _commit(
        self, action: str, hook_id: str | None, before: Any, after: Any, config: list[HookSpec]
    ) -> Change:
        config = [replace(s, position=i) if s.position != i else s for i, s in enumerate(config)]
        self.requested = config
        change = Change(action, hook_id, before, after, tuple(config))
        self.pending.append(change)
        return change

    def get(self, hook_id: str) -> HookSpec:
        for s in self.requested:
            if s.id == hook_id:
                return s
        raise HookNotFound(hook_id)

    def add(
        self,
        kind: Any,
        target: Any = "*",
        point: Any = None,
        params: Any = None,
        enabled: Any = True,
        fn: Callable[..., Any] | None = None,
    ) -> tuple[HookSpec, Change]:
        if len(self.requested) >= MAX_HOOKS:
            raise HookError((), f"too many hooks: at most {MAX_HOOKS} (MAX_HOOKS); remove some first")
        kind, target, point, params, enabled = self.validate(kind, target, point, params, enabled, fn)
        spec = HookSpec(self._new_id(), kind, point, target, params, enabled, len(self.requested))
        if fn is not None:
            self.fns[spec.id] = fn
        change = self._commit("add", spec.id, None, spec, [*self.requested, spec])
        return change.config[-1], change

    def update(
        self,
        hook_id: str,
        *,
        params: Mapping[str, Any] | None = None,
        enabled: Any = None,
        target: Any = None,
        position: Any = None,
    ) -> tuple[HookSpec, Change | None]:
        old = self.get(hook_id)
        if params is not None and not isinstance(params, Mapping):
            raise HookError(("params",), f"must be an object (got {shown(params)})")
        merged = {**old.params, **(params or {})}
        new_target = old.target if target is None else target
        new_enabled = old.enabled if enabled is None else enabled
        kind, new_target, point, merged, new_enabled = self.validate(
            old.kind, new_target, old.point, merged, new_enabled, self.fns.get(hook_id)
        )
        order = [s for s in self.requested if s.id != hook_id]
        index = old.position
        if position is not None:
            if isinstance(position, bool) or not isinstance(position, int):
                raise HookError(("position",), f"must be an integer (got {shown(position)})")
            if not 0 <= position < len(self.requested):
                raise HookError(
                    ("position",), f"must be between 0 and {len(self.requested) - 1} (got {position})"
                )
            index = position
        new = replace(old, target=new_target, params=merged, enabled=new_enabled, applied_step=None)
        if _content(new) == _content(old) and index == old.position:
            return old, None  # nothing changes: no change, no version bump
        order.insert(index, new)
        only_enabled = (
            replace(new, enabled=old.enabled) == replace(old, applied_step=None) and index == old.position
        )
        action = ("enable" if new_enabled else "disable") if only_enabled else "update"
        change = self._commit(action, hook_id, old, new, order)
        return self.get(hook_id), change

    def remove(self, hook_id: str) -> Change:
        old = self.get(hook_id)
        return self._commit("remove", hook_id, old, None, [s for s in self.requested if s.id != hook_id])

    def import_(self, preset: Any) -> Change:
        items = preset.get("hooks") if isinstance(preset, Mapping) else preset
        if isinstance(preset, Mapping):
            extra = set(preset) - {"hooks", "format", "version"}
            if extra:
                raise HookError(
                    (sorted(extra)[0],), "unknown key in preset (allowed: format, version, hooks)"
                )
        if not isinstance(items, list):
            raise HookError(("hooks",), 'a preset is a list of hooks or {"hooks": [...]}')
        if len(items) > MAX_HOOKS:
            raise HookError(("hooks",), f"too many hooks: at most {MAX_HOOKS} (MAX_HOOKS), got {len(items)}")
        new: list[HookSpec] = []
        for i, item in enumerate(items):
            try:
                if not isinstance(item, Mapping):
                    raise HookError((), f"must be an object (got {shown(item)})")
                extra = set(item) - _PRESET_KEYS
                if extra:
                    raise HookError(
                        (sorted(extra)[0],), f"unknown key (allowed: {', '.join(sorted(_PRESET_KEYS))})"
                    )
                if "kind" not in item:
                    raise HookError(("kind",), "required")
                if "target" not in item:
                    raise HookError(("target",), "required")
                if item["kind"] == "python":
                    raise HookError(("kind",), "python hooks cannot be imported from a preset")
                kind, target, point, params, enabled = self.validate(
                    item["kind"],
                    item["target"],
                    item.get("point"),
                    item.get("params", {}),
                    item.get("enabled", True),
                )
            except HookError as e:
                raise HookError(("hooks", i, *e.loc), e.msg) from None
            new.append(HookSpec("", kind, point, target, params, enabled, i))
        new = [replace(s, id=self._new_id()) for s in new]  # ids only once every item is valid
        return self._commit("import", None, list(self.requested), new, new)

    def restore(self, config: tuple[HookSpec, ...], fns: Mapping[str, Callable[[str, Any], Any]]) -> Change:
        """A change (action ``rewind``) back to a saved config: its specs, ids and callables. Hook
        ids keep counting up, so a hook added after a rewind never takes an id of the old branch."""
        self.fns.update(fns)
        config_list = list(config)
        return self._commit("rewind", None, list(self.requested), config_list, config_list)

    def adopt(self, changes: list[Change]) -> None:
        """Queue changes made on another rank (rank 0): the config they carry replaces ours."""
        for ch in changes:
            self.pending.append(ch)
        if changes:
            self.requested = list(changes[-1].config)
            ids = [s.id for ch in changes for s in ch.config if s.id[1:].isdigit()]
            self._next_id = max([self._next_id, *(int(i[1:]) + 1 for i in ids if i[0] == "h")])
            self._next_remote = max([self._next_remote, *(int(i[1:]) + 1 for i in ids if i[0] == "r")])

    def replace_pending(self, changes: list[Change]) -> None:
        """Under torch.distributed, on a rank other than 0: rank 0's pending changes (which include
        the script's own edit just made here, with the same id) replace this rank's."""
        self.pending.clear()
        self.adopt(changes)

    # ---------------------------------------------------------------- applying
    def apply_next(self, applied_step: int) -> Change | None:
        """Put the oldest pending change in force; ``applied_step`` is the first step it affects."""
        if not self.pending:
            return None
        change = self.pending.popleft()
        self.applied = self._stamp(change, applied_step)
        self.version += 1
        live = {s.id for s in self.applied} | {s.id for c in self.pending for s in c.config}
        live |= {s.id for s in self.requested}
        for hid in list(self.fns):
            if hid not in live:
                del self.fns[hid]
        return change

    def _stamp(self, change: Change, step: int) -> tuple[HookSpec, ...]:
        """``change``'s config, each hook with the first step its own configuration acts on:
        ``step`` for a hook whose configuration or order the change changes, else as it was."""
        prev = {s.id: s for s in self.applied}
        kept = in_order(self.applied, change.config)
        out = []
        for s in change.config:
            old = prev.get(s.id)
            if old is not None and s.id in kept and _content(old) == _content(s):
                out.append(replace(s, applied_step=old.applied_step))
            else:
                out.append(replace(s, applied_step=step))
        return tuple(out)

    def disable_now(self, hook_id: str, step: int) -> HookSpec | None:
        """Disable a failing hook everywhere at once (training thread, inside ``step``, which is the
        disable's ``applied_step``: the hook does not run again from there)."""

        def off(specs: Any) -> Any:
            return tuple(replace(s, enabled=False) if s.id == hook_id else s for s in specs)

        before = next((s for s in self.applied if s.id == hook_id), None)
        if before is None or not before.enabled:
            return None
        self.applied = tuple(
            replace(s, applied_step=step) if s.id == hook_id else s for s in off(self.applied)
        )
        self.requested = list(off(self.requested))
        self.pending = deque(replace(c, config=off(c.config)) for c in self.pending)
        self.version += 1
        return before

    def view(self) -> list[HookSpec]:
        """The requested config with ``applied_step`` of what is in force (None while a change of
        its configuration or order is pending)."""
        applied = {s.id: s for s in self.applied}
        kept = in_order(self.applied, self.requested)
        out = []
        for s in self.requested:
            a = applied.get(s.id)
            same = a is not None and s.id in kept and _content(a) == _content(s)
            step = a.applied_step if same else None
            out.append(replace(s, applied_step=step))
        return out
