"""Names and target globs.

Targets are ``fnmatch.fnmatchcase`` globs over full dotted names: case-sensitive, and ``*``
crosses dots (``"0.*"`` matches ``"0.weight"`` and ``"0.sub.bias"``). Parameter points match
parameter names; the ``module`` point matches module names (the root module is ``""``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from typing import Any

from .errors import HookError

__all__ = ["MAX_TARGET_LEN", "strip_prefixes", "match", "check_target"]

MAX_TARGET_LEN = 256
# Wrapper prefixes: DDP's and DataParallel's ``module.``, torch.compile's ``_orig_mod.``.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def strip_prefixes(name: str, prefixes: Iterable[str]) -> str:
    """Remove wrapper prefixes that the model had at attach time (``module.`` for DDP, ...)."""
    for p in prefixes:
        if name.startswith(p):
            name = name[len(p):]
        elif name + "." == p:  # the wrapper module itself
            return ""
    return name


def wrapper_prefixes(model: Any) -> tuple[str, ...]:
    """The chain of wrapper prefixes of ``model``: ``("_orig_mod.", "module.")`` for compiled DDP."""
    out = []
    m = model
    while True:
        inner = None
        if hasattr(m, "_orig_mod") and m.__class__.__name__ == "OptimizedModule":
            inner, prefix = m._orig_mod, "_orig_mod."
        elif m.__class__.__name__ in ("DistributedDataParallel", "DataParallel") and hasattr(m, "module"):
            inner, prefix = m.module, "module."
        if inner is None:
            return tuple(out)
        out.append(prefix)
        m = inner


def match(names: Iterable[str], glob: str) -> list[str]:
    """The names that ``glob`` matches, in the given order."""
    return [n for n in names if fnmatch.fnmatchcase(n, glob)]


def check_target(target: Any, names: list[str], what: str) -> list[str]:
    """Validate a target glob and return its matches (at least one)."""
    if not isinstance(target, str):
        raise HookError(("target",), f"must be a string glob (got {target!r})")
    if len(target) > MAX_TARGET_LEN:
        raise HookError(("target",), f"at most {MAX_TARGET_LEN} characters (got {len(target)})")
    found = match(names, target)
    if not found:
        raise HookError(("target",), f"{target!r} matches no {what} name")
    return found
