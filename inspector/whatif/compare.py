"""``inspector.compare()``: the same model trained twice from the same state on the same batches, with
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
in both; the batches are taken into a list first and replayed. An LR scheduler and a
``GradScaler`` that ``step_fn`` steps are passed as ``schedulers=`` and ``scaler=``: they too
start each branch as they were (else branch B would start where A's warm-up left the schedule,
and the scaler's scale). Afterwards the model, optimizer, schedulers, scaler and RNG are put back
as they were. On the same device with deterministic ops the two branches differ only by their
hooks.

Each branch keeps the learning rate of every parameter group at the start of each step
(``Branch.lrs``, read from ``optimizer.param_groups``). Where branch B's differs from A's at a step
before which both had the same losses (so no loss-driven schedule can explain it), something
``step_fn`` steps kept the state branch A left it in, most likely an LR scheduler not passed as
``schedulers=``: a :class:`CompareWarning` says so (``warnings.warn``), and the comparison's
``warnings`` (and the saved runs' events) carry it. A warning, not a refusal: it is known only
once the branches have trained, and what they trained is still there to look at.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..dashboard import save_comparison, serve_comparison
from ..wire.errors import HookError, InspectorError, shown
from .checkpoints import fresh, host_copy

__all__ = ["compare", "Comparison", "Branch", "CompareWarning"]


class CompareWarning(UserWarning):
    """:func:`compare`'s branches did not start alike: branch B's learning rate differs from A's
    where their losses do not explain it (an LR scheduler not passed as ``schedulers=``)."""


@dataclass
class Branch:
    """One branch of a comparison: its hooks (a preset), snapshots (wire dicts, loss merged in),
    the loss of every step, and ``lrs``: the learning rate of each parameter group at the start
    of every step (None where a group has no numeric ``lr``)."""

    name: str
    hooks: list[dict[str, Any]]
    snapshots: list[dict[str, Any]] = field(default_factory=list)
    losses: list[float | None] = field(default_factory=list)
    scalars: list[dict[str, Any]] = field(default_factory=list)
    lrs: list[list[float | None]] = field(default_factory=list)


@dataclass
class Comparison:
    """What :func:`compare` returns: ``a`` and ``b`` (:class:`Branch`), the parameter names and
    module names of the model (for :meth:`save` and :meth:`serve`), and ``warnings``: why the
    branches may differ by more than their hooks, ``{"step", "message"}`` each (each also a
    :class:`CompareWarning`; saved with both runs as a ``compare_warning`` event at its step)."""

    a: Branch
    b: Branch
    params: list[dict[str, Any]]
    modules: list[str]
    _server: Any = None
    warnings: list[dict[str, Any]] = field(default_factory=list)

    def save(self, db: str | os.PathLike[str]) -> tuple[int, int]:
        """Write both branches to a history database: run A, and run B as its branch from step 0.
        Returns ``(run_a, run_b)``; ``gradient-inspector replay DB`` shows them."""
        return save_comparison(self, db)

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
            self._server = serve_comparison(self, host=host, port=port, token=token, db=db)
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
    schedulers: Any = None,
    scaler: Any = None,
) -> Comparison:
    """Train ``model`` twice from its current state on the same ``batches``: with ``hooks_a``, then
    with ``hooks_b`` (presets, as ``insp.import_hooks`` takes them; None for no hooks).

    Args:
        model, optimizer: as for :func:`attach` (a single process: no torch.distributed).
        step_fn: ``step_fn(batch) -> loss``, one whole training step (zero_grad, forward,
            backward, ``optimizer.step()``) on ``model`` and ``optimizer``.
        batches: what ``step_fn`` is given, one item per step (taken into a list first).
        every: the snapshot cadence (1: every step).
        schedulers: an LR scheduler (or a list of them) that ``step_fn`` steps: each branch starts
            with the schedule as it was, and it is put back afterwards. One that is not passed
            goes on in branch B from where A left it: a :class:`CompareWarning` names it.
        scaler: the ``GradScaler`` ``step_fn`` uses: likewise (its scale and growth tracker),
            and given to each branch's Inspector, as ``attach(..., scaler=)`` takes it.

    Returns:
        A :class:`Comparison`: ``.a`` and ``.b`` hold each branch's snapshots, losses and learning
        rates; ``.warnings`` why they may differ by more than their hooks; ``.serve()`` shows both
        in the dashboard.

    On a model that is attached, that Inspector stands aside while the branches train (none of
    its hooks run, its step does not move) and is back afterwards as it was.

    Raises:
        HookError: an invalid preset, or a scheduler or scaler without ``state_dict()`` (nothing
            is trained). InspectorError: under torch.distributed, or while a step of the attached
            model is under way.
    """
    from .. import distributed

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
    scheds = (
        []
        if schedulers is None
        else list(schedulers)
        if isinstance(schedulers, list | tuple)
        else [schedulers]
    )
    for i, sch in enumerate([*scheds, *([scaler] if scaler is not None else [])]):
        if not (
            callable(getattr(sch, "state_dict", None)) and callable(getattr(sch, "load_state_dict", None))
        ):
            what = "scaler" if sch is scaler else f"schedulers[{i}]"
            raise HookError((what,), f"must have state_dict() and load_state_dict() (got {shown(sch)})")
    start_scheds = [host_copy(sch.state_dict()) for sch in scheds]
    start_scaler = host_copy(scaler.state_dict()) if scaler is not None else None
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
        for sch, state in zip(scheds, start_scheds, strict=True):
            sch.load_state_dict(fresh(state))
        if scaler is not None:
            scaler.load_state_dict(fresh(start_scaler))
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)

    from ..hooks.owned import attached

    # attached already (the README's own sequence): that Inspector stands aside while the
    # branches train, its state untouched, and is back afterwards
    outer = attached(model)
    aside = outer.stood_aside() if outer is not None else contextlib.nullcontext()
    with aside:
        cmp = _branches(model, optimizer, step_fn, data, presets, every, scaler, reset)
    drift = _lr_drift(cmp.a, cmp.b)
    if drift is not None:
        cmp.warnings.append({"step": drift[0], "message": drift[1]})
        warnings.warn(drift[1], CompareWarning, stacklevel=2)
    return cmp


def _lrs(optimizer: Any) -> list[float | None]:
    """The learning rate of each parameter group now (None: not a number)."""
    out: list[float | None] = []
    for g in optimizer.param_groups:
        try:
            out.append(float(g["lr"]))
        except (KeyError, TypeError, ValueError, RuntimeError):
            out.append(None)
    return out


def _same(x: Any, y: Any) -> bool:
    """Equal, NaN equal to NaN."""
    return x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))


def _lr_drift(a: Branch, b: Branch) -> tuple[int, str] | None:
    """``(step, why)`` branch B's learning rate is not A's, or None: the first step whose starting
    learning rate differs while every loss before it is the same in both (a loss-driven schedule,
    such as ReduceLROnPlateau, gives both the same rates as long as their losses are the same)."""
    for i, (la, lb) in enumerate(zip(a.lrs, b.lrs, strict=False)):
        if i > 0 and not _same(a.losses[i - 1], b.losses[i - 1]):
            return None  # the losses differ from here: the hooks may drive the rate
        if len(la) != len(lb):
            continue  # (a param group added in one branch only: no rate to compare at this step)
        if not all(_same(x, y) for x, y in zip(la, lb, strict=True)):
            group = next(k for k, (x, y) in enumerate(zip(la, lb, strict=True)) if not _same(x, y))
            return i + 1, (
                f"compare(): branch B started step {i + 1} with learning rate {lb[group]!r} "
                f"(parameter group {group}) where branch A had {la[group]!r}, with the same losses "
                "until then: something step_fn steps went on from where branch A left it, most "
                "likely an LR scheduler not passed as schedulers= (pass it, compare(..., "
                "schedulers=scheduler), so that each branch starts it as it was); the two branches "
                "differ by more than their hooks"
            )
    return None


def _branches(
    model: Any,
    optimizer: Any,
    step_fn: Callable[[Any], Any],
    data: list[Any],
    presets: tuple[Any, Any],
    every: int,
    scaler: Any,
    reset: Callable[[], None],
) -> Comparison:
    from ..inspector import attach

    branches = []
    info: list[dict[str, Any]] = []
    modules: list[str] = []
    try:
        for name, preset in zip(("a", "b"), presets, strict=True):
            reset()
            insp = attach(model, optimizer, scaler=scaler, every=every, checkpoints=0)
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
                    branch.lrs.append(_lrs(optimizer))
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
