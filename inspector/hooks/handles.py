"""The handle ``Inspector.add_hook`` returns.

It holds its Inspector weakly, as torch's ``RemovableHandle`` holds its hook table: a handle kept
around (in a list, a closure, a notebook's history) never keeps an Inspector, and through it the
model, the optimizer and the checkpoints, alive.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from ..wire.errors import InspectorError

if TYPE_CHECKING:
    from ..inspector import Inspector

__all__ = ["HookHandle"]


class HookHandle:
    """A live hook. Every method is a validated edit (see ``Inspector.update_hook``).

    ``remove()`` twice is harmless; so is using the handle after ``Inspector.close()``, or after
    the Inspector itself is gone (``remove()`` then does nothing; the other methods raise
    :class:`~inspector.wire.errors.InspectorError`).
    """

    __slots__ = ("_ref", "id", "accepted")

    def __init__(self, insp: Inspector, hook_id: str, accepted: dict[str, Any] | None = None) -> None:
        self._ref = weakref.ref(insp)
        self.id = hook_id
        # the spec as the edit that made it was accepted (``add_hook``'s reply; None for a handle
        # of an existing hook): unlike ``spec`` it never changes, and stays readable after a
        # rewind or a removal took the hook away
        self.accepted = accepted

    @property
    def _insp(self) -> Inspector:
        insp = self._ref()
        if insp is None:
            raise InspectorError(f"hook {self.id}: its Inspector is gone (closed and collected)")
        return insp

    @property
    def spec(self) -> dict[str, Any]:
        """The requested spec as a dict (``applied_step`` is None while the change is pending)."""
        return self._insp.hook_spec(self.id)

    def update(self, **params: Any) -> HookHandle:
        """Change some parameters (the others keep their values)."""
        self._insp.update_hook(self.id, params=params)
        return self

    def enable(self) -> HookHandle:
        self._insp.update_hook(self.id, enabled=True)
        return self

    def disable(self) -> HookHandle:
        self._insp.update_hook(self.id, enabled=False)
        return self

    def remove(self) -> None:
        insp = self._ref()
        if insp is not None:
            insp.remove_hook(self.id, missing_ok=True)

    def __enter__(self) -> HookHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"<HookHandle {self.id}>"
