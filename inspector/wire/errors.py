"""Exceptions raised by :mod:`inspector`.

The hierarchy::

    InspectorError            base of everything the inspector raises on purpose
    ├── HookError             invalid input (a ValueError): kind, point, target or a parameter;
    │                         ``.loc`` names the field, ``.msg`` says what is wrong
    ├── HookNotFound          no hook with that id (a KeyError)
    ├── AttachError           attach() was given something it cannot inspect (a TypeError)
    ├── CheckpointError       a checkpoint or rewind that cannot be right here (the reason says why)
    │   ├── CheckpointNotFound  no checkpoint with that id (a KeyError): never taken, or no longer kept
    │   └── CheckpointBusy      as many requests wait for the next step boundary as can be kept
    └── RewindPending         a hook change refused: a rewind waits for the next step boundary and
                              would put the checkpoint's hooks back over it

Invalid input never changes anything: the registry validates a whole edit before it
queues or applies it.

User objects end up in messages (a bad value, a failing hook's exception): :func:`shown` and
:func:`describe_error` format them without ever raising, since a ``__repr__`` or ``__str__``
that fails must not turn a clear error into another one, or reach the user's training step.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "InspectorError",
    "HookError",
    "HookNotFound",
    "AttachError",
    "CheckpointError",
    "CheckpointNotFound",
    "CheckpointBusy",
    "RewindPending",
    "cut",
    "describe_error",
    "shown",
]

SHOWN_LIMIT = 300  # characters of a user value quoted in a message


def cut(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, with a note of its full length (messages, events)."""
    return text if len(text) <= limit else f"{text[:limit]}… [truncated: {len(text)} characters in all]"


def _type_name(x: Any) -> str:
    try:
        return str(type(x).__name__)
    except Exception:
        return "object"


def shown(x: Any, limit: int = SHOWN_LIMIT) -> str:
    """``repr(x)`` for a message: never raises (a failing ``__repr__`` names the type instead), cut
    at ``limit`` characters."""
    try:
        text = repr(x)
        if not isinstance(text, str):
            raise TypeError("__repr__ returned a non-string")
    except Exception:
        return f"<{_type_name(x)} object: its repr() failed>"
    return cut(text, limit)


def describe_error(err: BaseException, limit: int = 2000) -> str:
    """``"Type: message"`` of an exception, never raising (a failing ``__str__`` is said so)."""
    try:
        text = str(err)
        if not isinstance(text, str):
            raise TypeError("__str__ returned a non-string")
    except Exception:
        text = "<its message could not be formatted: str() of the exception failed>"
    return f"{_type_name(err)}: {cut(text, limit)}"


class InspectorError(Exception):
    """Base class of the exceptions the inspector raises on purpose."""


class HookError(InspectorError, ValueError):
    """Invalid hook input. ``loc`` is the path of the offending field, e.g. ``("params", "threshold")``.

    ``str(err)`` reads ``"params.threshold: must be > 0 (got -1)"``; ``err.detail()`` is the
    list the server sends as a 422 ``detail``.
    """

    def __init__(self, loc: tuple[Any, ...] | str, msg: str) -> None:
        self.loc: tuple[Any, ...] = (loc,) if isinstance(loc, str) else tuple(loc)
        self.msg = msg
        where = ".".join(str(p) for p in self.loc)
        super().__init__(f"{where}: {msg}" if where else msg)

    def detail(self) -> list[dict[str, Any]]:
        return [{"loc": list(self.loc), "msg": self.msg}]


class HookNotFound(InspectorError, KeyError):
    """No hook with this id."""

    def __init__(self, hook_id: str) -> None:
        self.hook_id = hook_id
        super().__init__(f"no hook with id {hook_id!r}")

    def __str__(self) -> str:  # KeyError would quote the whole message
        return self.args[0]


class AttachError(InspectorError, TypeError):
    """``attach()`` was given a model or optimizer it cannot inspect."""


class CheckpointError(InspectorError):
    """A checkpoint or rewind refused: ``str(err)`` says why (checkpoints off, a rank that refused a rewind ...)."""


class CheckpointNotFound(CheckpointError, KeyError):
    """No checkpoint with this id: never requested, or dropped (only the newest ``keep`` are kept)."""

    def __init__(self, cp_id: Any, keep: int) -> None:
        self.cp_id = cp_id
        super().__init__(f"no checkpoint {shown(cp_id)} (only the newest {keep} are kept)")

    def __str__(self) -> str:
        return self.args[0]


class CheckpointBusy(CheckpointError):
    """A checkpoint or rewind request refused because as many requests of its kind already wait
    for the next step boundary as checkpoints are kept (``keep``): more would only cost the
    training thread full copies it then drops. Ask again after the boundary."""


class RewindPending(InspectorError):
    """A hook change refused because a rewind was requested and waits for the next step boundary:
    the rewind puts the checkpoint's hooks back, so the change would be undone unseen. Make it
    after the rewind (``checkpoint`` names the checkpoint)."""

    def __init__(self, checkpoint: str, step: int | None) -> None:
        self.checkpoint = checkpoint
        super().__init__(
            f"a rewind to checkpoint {checkpoint} (step {step}) waits for the next step boundary and "
            "will put that checkpoint's hooks back: change the hooks after it"
        )
