"""Our hooks in a model's own hook tables, what a copy of the model gets in their place, and
which parameters an open Inspector watches (one at a time: :func:`claim`).

torch keeps a module's forward (pre-)hooks in dicts on the module, so ``torch.save(model)``,
``copy.deepcopy(model)`` and ``torch.optim.swa_utils.AveragedModel(model)`` copy them along with
the weights: a bound method of the Inspector would drag the Inspector (locks, threads) into
the copy and fail (``cannot pickle '_thread.RLock' object``). So a copy gets **nothing of ours**:
every module that holds a hook of ours gets, for as long as it does, a ``__getstate__`` of its
own (:func:`hide_from_copies`, an instance attribute, which pickle and ``copy`` use before the
class's) that returns the module's state without our hooks and without itself. The copy is then
exactly what it would be unattached: ``torch.load(..., weights_only=True)`` loads it with the
user's own ``safe_globals``, and its forward runs none of our code. ``close()`` takes the
``__getstate__`` away again (:func:`unhide`).

Every module hook we register is an :class:`OwnedHook`. Pickled on its own (a hook table copied
by hand), it becomes an **inert stand-in**: the ``debug`` method of the logger
``gradient_inspector.detached_hook``, which takes any arguments and returns None without
formatting them while that logger is below DEBUG (it is silenced in this process).
(Tensor hooks, such as post-accumulate ones, are not copied with a tensor at all.)
"""

from __future__ import annotations

import logging
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ..wire.errors import AttachError, describe_error

__all__ = ["DETACHED_LOGGER", "OwnedHook", "attached", "claim", "hide_from_copies", "release", "unhide"]

DETACHED_LOGGER = "gradient_inspector.detached_hook"
_detached = logging.getLogger(DETACHED_LOGGER)
_detached.setLevel(logging.CRITICAL + 1)  # here, at least, the stand-in can never log
_detached.propagate = False


_warned: list[bool] = []  # the first failing hook of ours is reported once per process


class OwnedHook:
    """``fn`` as a hook in a torch hook table; a copy gets the inert stand-in (module docstring)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        try:
            return self.fn(*args)
        except Exception as e:  # a bug of ours must not reach the user's forward or backward
            if not _warned:
                _warned.append(True)
                warnings.warn(
                    f"gradient-inspector: one of its hooks failed and was skipped ({describe_error(e)}); "
                    "training goes on (further failures are not reported)",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return None  # our module hooks never change the forward's arguments or result

    def __reduce__(self) -> tuple[Any, ...]:
        return (getattr, (_detached, "debug"))

    def __repr__(self) -> str:
        return f"<gradient-inspector hook {self.fn!r}>"


# ---------------------------------------------------------------- copies of a module carry none of ours
_HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_HOOK_FLAGS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _ours(table: Any) -> list[Any]:
    """The keys of a module's hook table whose hooks are ours."""
    return [k for k, v in table.items() if isinstance(v, OwnedHook)] if isinstance(table, dict) else []


class _StateWithoutOurs:
    """A module's ``__getstate__`` while it holds hooks of ours: its class's state, less them."""

    __slots__ = ("_module",)

    def __init__(self, module: Any) -> None:
        self._module = weakref.ref(module)  # the module's own __dict__ holds this: no cycle kept alive

    def __call__(self) -> dict[str, Any]:
        module = self._module()
        state = dict(type(module).__getstate__(module))
        state.pop("__getstate__", None)
        ours: set[Any] = set()
        for name in _HOOK_TABLES:
            keys = _ours(state.get(name))
            if keys:
                ours.update(keys)
                state[name] = OrderedDict((k, v) for k, v in state[name].items() if k not in ours)
        for name in _HOOK_FLAGS:
            flags = state.get(name)
            if isinstance(flags, dict) and ours & flags.keys():
                state[name] = OrderedDict((k, v) for k, v in flags.items() if k not in ours)
        return state


def hide_from_copies(module: Any) -> None:
    """Give ``module`` the ``__getstate__`` that leaves our hooks out of its copies (idempotent)."""
    if not isinstance(module.__dict__.get("__getstate__"), _StateWithoutOurs):
        object.__setattr__(module, "__getstate__", _StateWithoutOurs(module))


def unhide(module: Any) -> None:
    """Take that ``__getstate__`` away again once ``module`` holds no hook of ours."""
    if not isinstance(module.__dict__.get("__getstate__"), _StateWithoutOurs):
        return
    if not any(_ours(module.__dict__.get(name)) for name in _HOOK_TABLES):
        del module.__dict__["__getstate__"]


# ---------------------------------------------------------------- one open Inspector per parameter
_claims: dict[int, tuple[weakref.ref[Any], weakref.ref[Any]]] = {}  # id(obj) -> (obj, its Inspector)
_claims_lock = threading.Lock()


def _holder(obj: Any) -> Any:
    entry = _claims.get(id(obj))
    if entry is None or entry[0]() is not obj:  # a dead object whose id was reused
        return None
    insp = entry[1]()
    return insp if insp is not None and not insp.closed else None


def claim(insp: Any, tensors: list[Any], optimizer: Any) -> None:
    """Mark ``tensors`` and ``optimizer`` as watched by ``insp``; raise AttachError if an open Inspector
    already watches one of them (a second attach would run every hook and statistic twice)."""
    objs = [*tensors, *([optimizer] if optimizer is not None else [])]
    with _claims_lock:
        for obj in objs:
            other = _holder(obj)
            if other is not None:
                what = "this optimizer" if obj is optimizer else "a parameter of this model"
                raise AttachError(
                    f"{what} is already watched by {other!r}: keep using that one, or close it first "
                    "(inspector.attached(model).close() finds it, e.g. after re-running a notebook cell); "
                    "attaching twice would apply every hook and statistic twice"
                )
        for obj in objs:
            _claims[id(obj)] = (weakref.ref(obj), weakref.ref(insp))


def release(insp: Any) -> None:
    """Forget what ``insp`` watched (``close()``)."""
    with _claims_lock:
        for key in [k for k, (_, i) in _claims.items() if i() is insp or i() is None]:
            del _claims[key]


def attached(obj: Any) -> Any:
    """The open Inspector watching ``obj`` (a model, a dict of tensors, a tensor or an optimizer), or None."""
    import torch  # here only: this module is imported by the core, which imports torch anyway

    if isinstance(obj, torch.nn.Module):
        candidates: list[Any] = list(obj.parameters())
    elif isinstance(obj, dict):
        candidates = list(obj.values())
    else:
        candidates = [obj]
    with _claims_lock:
        for c in candidates:
            insp = _holder(c)
            if insp is not None:
                return insp
    return None
