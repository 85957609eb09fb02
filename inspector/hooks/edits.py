"""Applying validated hook changes, and announcing each one.

The :class:`~inspector.hooks.registry.Registry` validates an edit at once and queues a
:class:`~inspector.hooks.registry.Change`; *when* a queued change may be applied is decided by
:class:`~inspector.step.lifecycle.StepLifecycle` (``submit``, ``apply_edits``: at once on the training
thread, between steps for ``pre_step``-only changes, else at the next root forward or boundary). :class:`Edits` does the applying: it
drains the queue, rebuilds the plan, registers or removes torch hooks where the caller allows
it (``torch_ok``: only the training thread, or while it is held), and announces every applied
change with a ``hook_applied`` event and a ``hooks`` message, each with its own
``config_version``. The caller holds the Inspector's lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ..feed import Feed
from ..wire.records import HookSpec
from .registry import Change, Registry
from .torch_hooks import TorchHooks

__all__ = ["Edits"]


class Edits:
    def __init__(
        self,
        reg: Registry,
        hooks: TorchHooks,
        feed: Feed,
        emit: Callable[..., Any],
        cond: threading.Condition,
    ) -> None:
        self.reg = reg
        self.hooks = hooks
        self._feed = feed
        self._emit = emit
        self._cond = cond

    def drain(self, next_step: int, *, torch_ok: bool) -> None:
        """Apply every queued change that may be applied here (all of them when ``torch_ok``);
        ``next_step`` is the first step they act on (their ``applied_step``)."""
        changes = []
        while self.reg.pending:
            if not torch_ok and self.reg.pending[0].touches_torch():
                break
            ch = self.reg.apply_next(next_step)
            assert ch is not None
            changes.append(ch)
        if changes or (torch_ok and self.hooks.dirty):
            self.hooks.rebuild(self.reg.applied, self.reg.fns)
            if torch_ok:
                self.hooks.sync()
        if changes:
            version = self.reg.version - len(changes)
            for ch in changes:  # every applied change is announced, with its own config_version
                version += 1
                self._announce(ch, version, next_step)
                self.publish_hooks(version)
            self._cond.notify_all()  # for whoever waits for an edit to be applied

    def disable_failed(self, spec: HookSpec, param: str | None, message: str, next_step: int) -> None:
        """A hook raised: disable it at once and report it (torch hooks are synced at the next safe point)."""
        before = self.reg.disable_now(spec.id, next_step)
        if before is None:
            return
        self.hooks.rebuild(self.reg.applied, self.reg.fns)
        self._emit("hook_error", hook_id=spec.id, param=param, message=message, step=next_step)
        self._emit(
            "hook_applied",
            hook_id=spec.id,
            action="disable",
            before=before.to_dict(),
            after={**before.to_dict(), "enabled": False},
            applied_step=next_step,
            config_version=self.reg.version,
        )
        self.publish_hooks()

    def publish_hooks(self, version: int | None = None) -> None:
        self._feed.publish(
            "hooks",
            {
                "config_version": self.reg.version if version is None else version,
                "hooks": [s.to_dict() for s in self.reg.view()],
            },
        )

    def _announce(self, ch: Change, version: int, next_step: int) -> None:
        def d(x: Any) -> Any:
            if isinstance(x, HookSpec):
                return x.to_dict()
            if isinstance(x, list):
                return [s.to_dict() for s in x]
            return x

        after = ch.after
        if isinstance(after, HookSpec):  # with its applied_step, as it is now in force
            after = next((s for s in self.reg.applied if s.id == after.id), after)
        elif isinstance(after, list):
            ids = {s.id for s in after}
            after = [s for s in self.reg.applied if s.id in ids]
        self._emit(
            "hook_applied",
            hook_id=ch.hook_id,
            action=ch.action,
            before=d(ch.before),
            after=d(after),
            applied_step=next_step,
            config_version=version,
        )
