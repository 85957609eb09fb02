"""Seeing through what frameworks wrap around the model, the optimizer and the scaler.

- Model: DDP's and DataParallel's ``module.`` and ``torch.compile``'s ``_orig_mod.`` are
  stripped from every name, so targets and charts use the names of the user's own model.
- Optimizer: Lightning's ``LightningOptimizer`` and Accelerate's ``AcceleratedOptimizer``
  keep the real ``torch.optim.Optimizer`` on ``.optimizer``; our step hooks go on the real one,
  whose ``step()`` runs. (``AcceleratedOptimizer`` subclasses ``torch.optim.Optimizer`` without
  being one: it has no hook tables of its own, so a wrapped optimizer is always unwrapped.)
- Scaler: a disabled ``GradScaler`` is no scaler.

One rule for every way in: ``inspector.attach`` and the framework callbacks both use these.
:class:`Attached` is what an Inspector holds of them: the model, its names and tensors, the
optimizer, the scaler, the FSDP2 layout and the distributed control plane.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .wire.errors import AttachError, shown

__all__ = [
    "Attached",
    "enabled_scaler",
    "named_tensors",
    "param_info",
    "real_optimizer",
    "strip_prefixes",
    "wrapper_prefixes",
]

_MAX_WRAPPERS = 8  # wrappers of wrappers, but never a cycle


def strip_prefixes(name: str, prefixes: Iterable[str]) -> str:
    """Remove wrapper prefixes that the model had at attach time (``module.`` for DDP, ...)."""
    for p in prefixes:
        if name.startswith(p):
            name = name[len(p) :]
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


def is_compiled(model: Any) -> bool:
    """Whether ``model``, or a module inside it, runs compiled (``torch.compile(m)`` or ``m.compile()``)."""
    if not isinstance(model, nn.Module):
        return False
    return any(
        m.__class__.__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None) is not None
        for m in model.modules()
    )


def named_tensors(model: Any) -> tuple[list[tuple[str, Tensor]], dict[str, nn.Module]]:
    """``(parameters, modules)`` by name, prefixes stripped: ``model`` is an ``nn.Module`` or a dict
    of named leaf tensors (which has no modules)."""
    if isinstance(model, nn.Module):
        prefixes = wrapper_prefixes(model)
        named = [(strip_prefixes(n, prefixes), p) for n, p in model.named_parameters()]
        modules = {strip_prefixes(n, prefixes): m for n, m in model.named_modules()}
    elif isinstance(model, Mapping):
        named, modules = [], {}
        for name, t in model.items():
            if not isinstance(name, str) or not isinstance(t, Tensor):
                raise AttachError(
                    f"a dict model maps names to tensors; got {shown(name)}: {type(t).__name__}"
                )
            if not t.is_leaf:
                raise AttachError(f"{shown(name)} is not a leaf tensor: only leaves accumulate .grad")
            named.append((name, t))
    else:
        raise AttachError(
            f"model must be an nn.Module or a dict of named leaf tensors, got {type(model).__name__}"
        )
    if not named:
        raise AttachError("the model has no parameters to inspect")
    return named, modules


def param_info(params: list[str], tensors: list[Tensor], *, modules: bool) -> list[dict[str, Any]]:
    """Each parameter's name, shape, numel, module (its name's prefix; None for a dict of tensors),
    requires_grad and dtype."""
    return [
        {
            "name": name,
            "shape": list(t.shape),
            "numel": t.numel(),
            "module": name.rpartition(".")[0] if modules else None,
            "requires_grad": t.requires_grad,
            "dtype": str(t.dtype).removeprefix("torch."),
        }
        for name, t in zip(params, tensors, strict=True)
    ]


def real_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` inside a framework's wrapper (or ``optimizer`` itself)."""
    found = optimizer
    for _ in range(_MAX_WRAPPERS):
        inner = getattr(found, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is found:
            break
        found = inner
    if not isinstance(found, torch.optim.Optimizer):
        raise AttachError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__} "
            "(wrappers are looked through via .optimizer)"
        )
    return found


def enabled_scaler(scaler: Any) -> Any:
    """A GradScaler that is in use, or None (a disabled one, or none at all). An object without
    ``is_enabled`` is taken as an enabled scaler."""
    if scaler is None:
        return None
    is_enabled = getattr(scaler, "is_enabled", None)
    return scaler if not callable(is_enabled) or is_enabled() else None


@dataclass(frozen=True, eq=False)
class Attached:
    """What an Inspector is attached to, seen through its wrappers; fixed at ``attach()``."""

    root: nn.Module | None  # the model (None for a dict of tensors)
    params: list[str]  # parameter names, wrapper prefixes stripped, in named_parameters() order
    tensors: list[Tensor]  # the parameters (or the dict's tensors), in that order
    modules: dict[str, nn.Module]  # the root's submodules by name (empty for a dict of tensors)
    optimizer: torch.optim.Optimizer | None  # its step() is the step boundary (None: mark_step())
    scaler: Any  # an enabled GradScaler, or None
    layout: Any  # stats.sharded.Layout under FSDP2, else None
    dist: Any  # the job's distributed.ControlPlane under torch.distributed, else None

    @property
    def rank(self) -> int:
        return self.dist.rank if self.dist is not None else 0
