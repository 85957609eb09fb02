"""Names and target globs.

Targets are ``fnmatch.fnmatchcase`` globs over full dotted names: case-sensitive, and ``*``
crosses dots (``"0.*"`` matches ``"0.weight"`` and ``"0.sub.bias"``). Parameter points match
parameter names; the ``module`` point matches module names (the root module is ``""``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from typing import Any

from ..wire.errors import HookError, shown

__all__ = ["MAX_TARGET_LEN", "match", "check_target"]

MAX_TARGET_LEN = 256


def match(names: Iterable[str], glob: str) -> list[str]:
    """The names that ``glob`` matches, in the given order."""
    return [n for n in names if fnmatch.fnmatchcase(n, glob)]


def check_target(target: Any, names: list[str], what: str) -> list[str]:
    """Validate a target glob and return its matches (at least one)."""
    if not isinstance(target, str):
        raise HookError(("target",), f"must be a string glob (got {shown(target)})")
    if len(target) > MAX_TARGET_LEN:
        raise HookError(("target",), f"at most {MAX_TARGET_LEN} characters (got {len(target)})")
    found = match(names, target)
    if not found:
        raise HookError(("target",), f"{shown(target)} matches no {what} name")
    return found
