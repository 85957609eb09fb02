"""Our hooks in a model's own hook tables, what a copy of the model gets in their place, and
which parameters an open Inspector watches (one at a time: :func:`claim`).

torch keeps a module's forward (pre-)hooks in dicts on the module, so ``torch.save(model)``,
``copy.deepcopy(model)`` and ``torch.optim.swa_utils.AveragedModel(model)`` copy them along with
the weights: a bound method of the Inspector would drag the Inspector (locks, threads) into
the copy and fail (``cannot pickle '_thread.RLock' object``). Every module hook we register is
therefore an :class:`OwnedHook`, which pickles and deep-copies as an **inert stand-in**: the
``debug`` method of the logger ``gradient_inspector.detached_hook``, which takes any arguments
and returns None without formatting them while that logger is below DEBUG (it is silenced in
this process). A pickle cannot drop an entry of the dict it is in, so the copy has that inert
entry where our hook was; it needs nothing of ours to load (the logger is found by name), it
never changes the copy's forward, and it does nothing to the original, which stays inspected.
(Tensor hooks, such as post-accumulate ones, are not copied with a tensor at all.)
"""

from __future__ import annotations

import logging
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from .errors import AttachError, describe_error

__all__ = ["DETACHED_LOGGER", "OwnedHook", "attached", "claim", "release"]

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


# ---------------------------------------------------------------- one open Inspector per parameter
_claims: dict[int, tuple[weakref.ref[Any], weakref.ref[Any]]] = {}  # id(obj) -> (obj, its Inspector)
_claims_lock = threading.Lock()


def _holder(obj: Any) -> Any:
    entry = _claims.get(id(obj))
    if entry is None or entry[0]() is not obj:  # a dead object whose id was reused
        return None
    insp = entry[1]()
    return insp if insp is not None and not getattr(insp, "_closed", True) else None


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
