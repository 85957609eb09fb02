"""The seam between the server and the core (server/core.py): the real `inspector.Inspector`, and
what its members return, have every member the protocols name, with compatible signatures; and the
server reaches the Inspector only through members the protocols name.

A member renamed (or a parameter renamed, reordered, made keyword-only or required) in the core
fails here, not in a running dashboard.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import inspector
from server.core import Core, CoreCheckpoint, CoreCheckpoints, CoreHookHandle

SERVER = Path(__file__).resolve().parents[2] / "server"
P = inspect.Parameter
POSITIONAL = (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)
VARIADIC = (P.VAR_POSITIONAL, P.VAR_KEYWORD)


def members(protocol: type) -> dict[str, Any]:
    """The public members a protocol declares: name -> its function, property, or None (an attribute)."""
    out: dict[str, Any] = {n: None for n in protocol.__dict__.get("__annotations__", {})}
    out.update({n: v for n, v in vars(protocol).items() if not n.startswith("_")})
    return {n: v for n, v in out.items() if not n.startswith("_")}


def signature_problems(want: inspect.Signature, have: inspect.Signature) -> list[str]:
    """Why a call the protocol allows might fail on the real method (both without `self`)."""
    problems = []
    by_name = {q.name: q for q in have.parameters.values()}
    for p in want.parameters.values():
        if p.kind in VARIADIC:
            if not any(q.kind == p.kind for q in have.parameters.values()):
                problems.append(f"no {p} parameter")
            continue
        q = by_name.get(p.name)
        if q is None:
            problems.append(f"no parameter {p.name!r}")
        elif q.kind != p.kind:
            problems.append(f"{p.name!r} is {q.kind.description}, the server expects {p.kind.description}")
        elif p.default is not P.empty and q.default is P.empty:
            problems.append(f"{p.name!r} has no default (the server may leave it out)")
    wanted = [p.name for p in want.parameters.values() if p.kind in POSITIONAL]
    had = [q.name for q in have.parameters.values() if q.kind in POSITIONAL]
    if had[: len(wanted)] != wanted:
        problems.append(f"positional parameters {had}, the server passes {wanted}")
    for q in have.parameters.values():
        if q.name not in want.parameters and q.kind not in VARIADIC and q.default is P.empty:
            problems.append(f"{q.name!r} is required, and the server does not pass it")
    return problems


@pytest.fixture(scope="module")
def real() -> Iterator[dict[type, Any]]:
    """A real object for each protocol: an Inspector, its checkpoints, one checkpoint, a hook handle."""
    model = nn.Linear(2, 1)
    insp = inspector.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        handle = insp.add_hook("clip_value", threshold=1.0)
        cp = insp.checkpoints.get(insp.checkpoints.checkpoint("seam"))
        yield {Core: insp, CoreCheckpoints: insp.checkpoints, CoreCheckpoint: cp, CoreHookHandle: handle}
    finally:
        insp.close()


@pytest.mark.parametrize("protocol", [Core, CoreCheckpoints, CoreCheckpoint, CoreHookHandle])
def test_the_core_satisfies_the_protocols(real, protocol):
    obj = real[protocol]
    declared = members(protocol)
    assert declared, f"{protocol.__name__} declares nothing"
    problems = []
    for name, member in declared.items():
        static = inspect.getattr_static(obj, name, None)
        if static is None and not hasattr(obj, name):
            problems.append(f"{name}: missing on {type(obj).__name__}")
        elif inspect.isfunction(member):
            if not inspect.isfunction(static):
                problems.append(f"{name}: not a method on {type(obj).__name__}")
                continue
            want = inspect.signature(member)
            want = want.replace(parameters=list(want.parameters.values())[1:])
            problems += [
                f"{name}: {why}" for why in signature_problems(want, inspect.signature(getattr(obj, name)))
            ]
        elif inspect.isfunction(static):
            problems.append(f"{name}: a method on {type(obj).__name__}, the server reads it as a value")
    assert not problems, (
        f"{type(obj).__name__} no longer fits server/core.py's {protocol.__name__}:\n" + "\n".join(problems)
    )


def test_signature_check_catches_a_renamed_or_required_parameter():
    def want(hook_id: str, *, enabled: bool | None = None) -> None: ...

    def renamed(hook: str, *, enabled: bool | None = None) -> None: ...

    def positional(hook_id: str, enabled: bool | None = None) -> None: ...

    def required(hook_id: str, mode: str, *, enabled: bool | None = None) -> None: ...

    def wider(hook_id: str, *, enabled: bool | None = None, missing_ok: bool = False, **kw: Any) -> None: ...

    sig = inspect.signature
    assert signature_problems(sig(want), sig(renamed))
    assert signature_problems(sig(want), sig(positional))
    assert signature_problems(sig(want), sig(required))
    assert signature_problems(sig(want), sig(wider)) == []


def _reaches(tree: ast.AST) -> set[tuple[str, str]]:
    """`("Core", name)` for each `<x>.insp.<name>` / `insp.<name>`, `("CoreCheckpoints", name)` for
    each `....checkpoints.<name>` read on one."""
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        if (isinstance(base, ast.Name) and base.id == "insp") or (
            isinstance(base, ast.Attribute) and base.attr == "insp"
        ):
            found.add(("Core", node.attr))
        elif isinstance(base, ast.Attribute) and base.attr == "checkpoints":
            inner = base.value
            if (isinstance(inner, ast.Name) and inner.id == "insp") or (
                isinstance(inner, ast.Attribute) and inner.attr == "insp"
            ):
                found.add(("CoreCheckpoints", node.attr))
    return found


def test_the_server_uses_only_what_the_protocols_name():
    declared = {"Core": members(Core), "CoreCheckpoints": members(CoreCheckpoints)}
    unnamed = []
    for path in sorted(SERVER.rglob("*.py")):
        for protocol, name in _reaches(ast.parse(path.read_text(encoding="utf-8"))):
            if name not in declared[protocol]:
                unnamed.append(f"{path.relative_to(SERVER.parent)}: {name} (not in {protocol})")
    assert not unnamed, "the server reaches the Inspector past server/core.py:\n" + "\n".join(sorted(unnamed))
