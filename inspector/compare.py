"""``inspector.compare``: the same model trained twice from the same state on the same batches, with
two hook configs, for a notebook or a script.

The inspector cannot branch a user's loop by itself (it owns neither the data nor the loss), so
here the user hands over one training step::

    def step(batch):                      # your step: zero_grad, forward, loss, backward, step
        x, y = batch
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    cmp = inspector.compare(model, optimizer, step, batches,
                            hooks_a=[], hooks_b=[{"kind": "clip_norm", "target": "*",
                                                  "params": {"max_norm": 1.0}}])
    cmp.b.losses[-1], cmp.a.losses[-1]
    url = cmp.serve()                     # both runs in the dashboard: B overlaid on A, dashed

Each branch starts from the state the model and optimizer had when ``compare`` was called, with
the global RNG (CPU, and CUDA when available) as it was then, so dropout draws the same numbers
in both; the batches are taken into a list first and replayed. Afterwards the model, optimizer
and RNG are put back as they were. On the same device with deterministic ops the two branches
differ only by their hooks.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .checkpoints import fresh, host_copy
from .errors import HookError, InspectorError, shown
from .server_loader import load_server_module

__all__ = ["compare", "Comparison", "Branch"]


@dataclass
class Branch:
    """One branch of a comparison: its hooks (a preset), snapshots (wire dicts, loss merged in)
    and the loss of every step."""

    name: str
    hooks: list[dict[str, Any]]
    snapshots: list[dict[str, Any]] = field(default_factory=list)
    losses: list[float | None] = field(default_factory=list)
    scalars: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Comparison:
    """What :func:`compare` returns: ``a`` and ``b`` (:class:`Branch`), the parameter names and
    module names of the model (for :meth:`save` and :meth:`serve`)."""

    a: Branch
    b: Branch
    params: list[dict[str, Any]]
    modules: list[str]
    _server: Any = None

    def save(self, db: str | os.PathLike[str]) -> tuple[int, int]:
        """Write both branches to a history database: run A, and run B as its branch from step 0.
        Returns ``(run_a, run_b)``; ``gradient-inspector replay DB`` shows them."""
        return load_server_module("comparison").save(self, os.fspath(db))  # type: ignore[no-any-return]

    def serve(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        db: str | os.PathLike[str] | None = None,
    ) -> str:
        """Serve both branches read-only (run A with B overlaid, dashed); returns the URL.

        ``db``: where to write them (default: a temporary file). ``port`` 0 picks a free one.
        """
        if self._server is None:
            self._server = load_server_module("comparison").serve(
                self, host=host, port=port, token=token, db=db
            )
        return str(self._server.url)

    def close(self) -> None:
        """Stop serving (when served)."""
        server, self._server = self._server, None
        if server is not None:
            server.stop()


def _preset(hooks: Any, name: str) -> Any:
    if hooks is None:
        return []
    if isinstance(hooks, Mapping | list):
        return hooks
    raise HookError(
        (name,), f"must be a preset (a list of hook specs, or an export_hooks() dict), got {shown(hooks)}"
    )


def compare(
    model: nn.Module | Mapping[str, Tensor],
    optimizer: torch.optim.Optimizer,
    step_fn: Callable[[Any], Any],
    batches: Iterable[Any],
    hooks_a: Any = None,
    hooks_b: Any = None,
    *,
    every: int = 1,
) -> Comparison:
    """Train ``model`` twice from its current state on the same ``batches``: with ``hooks_a``, then
    with ``hooks_b`` (presets, as ``insp.import_hooks`` takes them; None for no hooks).

    Args:
        model, optimizer: as for :func:`attach` (a single process: no torch.distributed).
        step_fn: ``step_fn(batch) -> loss``, one whole training step (zero_grad, forward,
            backward, ``optimizer.step()``) on ``model`` and ``optimizer``.
        batches: what ``step_fn`` is given, one item per step (taken into a list first).
        every: the snapshot cadence (1: every step).

    Returns:
        A :class:`Comparison`: ``.a`` and ``.b`` hold each branch's snapshots and losses;
        ``.serve()`` shows both in the dashboard.

    Raises:
        HookError: an invalid preset (nothing is trained). InspectorError: under torch.distributed.
    """
    from . import distributed
    from .inspector import attach

    if distributed.active():
        raise InspectorError("compare() runs two branches in one process: not under torch.distributed")
    if not callable(step_fn):
        raise HookError(("step_fn",), f"must be callable: step_fn(batch) -> loss (got {shown(step_fn)})")
    presets = (_preset(hooks_a, "hooks_a"), _preset(hooks_b, "hooks_b"))
    data = list(batches)
    is_module = isinstance(model, nn.Module)
    tensors = None if is_module else list(model.values())  # type: ignore[union-attr]
    start_model = host_copy(model.state_dict() if is_module else tensors)  # type: ignore[union-attr]
    start_optim = host_copy(optimizer.state_dict())
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None

    def reset() -> None:
        with torch.no_grad():
            if is_module:
                model.load_state_dict(fresh(start_model))  # type: ignore[union-attr]
            else:
                for t, saved in zip(tensors, start_model, strict=True):  # type: ignore[arg-type]
                    t.copy_(saved)
            for p in model.parameters() if is_module else tensors:  # type: ignore[union-attr]
                p.grad = None
        optimizer.load_state_dict(fresh(start_optim))
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)

    branches = []
    info: list[dict[str, Any]] = []
    modules: list[str] = []
    try:
        for name, preset in zip(("a", "b"), presets, strict=True):
            reset()
            insp = attach(model, optimizer, every=every, checkpoints=0)
            try:
                insp.import_hooks(preset)
                branch = Branch(name, insp.export_hooks()["hooks"])
                losses: dict[int, Any] = {}

                def collect(kind: str, payload: Any, branch: Branch = branch, losses: dict = losses) -> None:
                    if kind == "snapshot":
                        branch.snapshots.append(dict(payload))  # (the wire dict is shared: a copy)
                    elif kind == "scalars":
                        losses[int(payload["step"])] = payload

                insp.subscribe(collect, lossless=True)
                info, modules = insp.param_info(), list(insp.modules)
                for batch in data:
                    loss = step_fn(batch)
                    if loss is not None:
                        insp.record(loss=loss)
            finally:
                insp.close()  # delivers every record first
            for s in branch.snapshots:
                late = losses.get(int(s["step"]))
                if late is not None and s.get("loss") is None:
                    s["loss"] = late.get("loss")
            branch.scalars = [losses[k] for k in sorted(losses)]
            branch.losses = [losses[k].get("loss") if k in losses else None for k in range(1, len(data) + 1)]
            branches.append(branch)
    finally:
        reset()
    return Comparison(branches[0], branches[1], info, modules)
