"""Checkpoints on disk: ``attach(..., checkpoint_dir=PATH)``, and ``insp.rewind(path)``.

With ``checkpoint_dir`` each checkpoint's model and optimizer state is written with
``torch.distributed.checkpoint`` (DCP) as one directory under it, ``step-<step>-<id>``, as
``{"model": model.state_dict(), "optimizer": optimizer.state_dict()}`` (a dict of tensors:
``{"model": {"0": t0, "1": t1, ...}}``), beside a small ``inspector.json`` (the step, the id, the
label, the time). The inspector's own state (hook config, noise streams, cadence ...) and the
scaler's few numbers stay in host memory with the checkpoint (:mod:`inspector.whatif.checkpoints`).

Writing (one process): ``dcp.async_save``: the step waits only for the state's copy to host memory (DCP's
staging), which is held until the write ends; the write runs on DCP's thread. A write that fails
(a full disk) is a ``checkpoint_error`` event naming why; the directory is removed and the
checkpoint is no longer kept; training goes on. A rewind to a checkpoint whose write is still
under way waits for it. Only the newest ``keep`` directories are kept: older ones that this
:class:`DiskStore` wrote are deleted (nothing else under ``checkpoint_dir`` is touched).

Reading (a rewind, :func:`load_dir`): DCP's ``.metadata`` is read and checked against the live
model and optimizer **before anything is loaded**; refused with :class:`CheckpointError`, nothing
changed, when the directory is missing, partial (no ``.metadata``: a save that did not finish; a
data file that a rank did not write, or that is shorter than the metadata says) or of another
model (keys, shapes or dtypes that differ, another number of parameter groups or parameters).
Then ``dcp.load`` reads the tensors in place into the live model's ``state_dict()`` (the
parameters' own storage) and the optimizer's state, and the optimizer gets it through
``load_state_dict``.

Layouts read: the top-level ``{"model": ..., "optimizer": ...}`` (this module's, and
``dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, ...)``), the same under
one key (DCP's tutorial: ``{"app": AppState}`` whose ``state_dict()`` is ``{"model": ...,
"optim": ...}``; ``"optim"`` or ``"optimizer"``), with the optimizer's state keyed by parameter
index (``optimizer.state_dict()``) or by parameter name
(``torch.distributed.checkpoint.state_dict.get_state_dict``'s layout).

Under torch.distributed (DDP, FSDP2; :class:`DiskStore` with ``group``): one directory per
checkpoint, made by rank 0, every rank writing its part with ``dcp.save`` over the control plane's
gloo group (DDP: the full ``state_dict()``, replicated entries written once; FSDP2:
``get_state_dict``'s shards), synchronously: DCP's collectives on a writer thread would interleave
with the control plane's. :func:`check_dir` reads on this process alone (never a collective that a
rank could skip by refusing first); the verdicts are exchanged by the caller
(:mod:`inspector.whatif.checkpoints`), then :func:`load_dir` is a collective over ``group``.

Non-tensor values in a DCP directory (the optimizer's param groups) are unpickled by
``torch.load``: read only directories you trust. That is why a rewind to a path is Python-only
(``insp.rewind(path)``): the server's rewind takes a checkpoint id, never a path.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..wire.errors import CheckpointError

if TYPE_CHECKING:
    from ..wrappers import Attached

__all__ = ["DiskStore", "SIDECAR", "check_dir", "dir_step", "load_dir", "live_state"]

SIDECAR = "inspector.json"  # the step, id, label and time of a checkpoint this module wrote


def _dcp() -> Any:
    import torch.distributed.checkpoint as dcp

    return dcp


# DCP's warning when no process group is initialised: single-process is this module's intent there
_SINGLE = r"torch\.distributed is .*assuming the intent is to (save|load) in a single process"


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Without DCP's single-process warning (the calls made here; a write on DCP's own thread
    may still warn once)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE, category=UserWarning)
        yield


def live_state(at: Attached) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}`` of the live objects (their tensors, not copies). FSDP2:
    ``get_state_dict``'s (this rank's shards as DTensors, the optimizer's state keyed by name)."""
    if getattr(at, "layout", None) is not None:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(at.root, at.optimizer)
        return {"model": model, "optimizer": optim}
    if at.root is not None:
        model = at.root.state_dict()
    else:
        model = {str(i): t for i, t in enumerate(at.tensors)}
    return {"model": model, "optimizer": at.optimizer.state_dict()}  # type: ignore[union-attr]


class DiskStore:
    """Where checkpoints live with ``checkpoint_dir``: one DCP directory each, the newest kept.

    ``save(cp_id, step, label, state) -> (path, pending)`` starts the write (``pending``: DCP's
    future, or None when written already); ``forget(path)`` deletes a directory this store wrote
    (after its write ends). ``on_failure(path, why)`` is called (on the writer's thread) when an
    asynchronous write fails, after the directory is removed.

    Under torch.distributed (``group``: the control plane's gloo group, ``rank``): every rank calls
    ``save`` at the same boundary with the directory that rank 0 made (:meth:`prepare`), and the
    write is ``dcp.save`` over ``group``, synchronous: DCP's collectives on a writer thread would
    interleave with the control plane's on the same group. Each rank writes its own data file."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        asynchronous: bool = True,
        group: Any = None,
        rank: int = 0,
    ) -> None:
        self.root = Path(root)
        self.group, self.rank = group, rank
        self.asynchronous = asynchronous and group is None
        self.written: set[str] = set()  # the directories this store wrote and has not deleted
        self._lock = threading.Lock()
        self.on_failure: Callable[[str, str], None] | None = None

    def _new_dir(self, cp_id: str, step: int) -> Path:
        name = f"step-{step:08d}-{cp_id}"
        path, n = self.root / name, 1
        while path.exists():  # another run's, under the same directory: never overwritten
            n += 1
            path = self.root / f"{name}-{n}"
        return path

    def prepare(self, cp_id: str, step: int, label: str | None) -> str:
        """Make the directory of a new checkpoint, with its ``inspector.json``; its path."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self._new_dir(cp_id, step)
        path.mkdir()
        try:
            with open(path / SIDECAR, "w") as f:
                json.dump({"step": step, "id": cp_id, "label": label, "time": time.time()}, f)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        return str(path)

    def save(
        self, cp_id: str, step: int, label: str | None, state: dict[str, Any], path: str | None = None
    ) -> tuple[str, Any]:
        """Write ``state`` as a new DCP directory (``path``: one :meth:`prepare` made, under
        torch.distributed rank 0's); raises (the directory removed) when the write cannot start
        or, synchronously, fails."""
        dcp = _dcp()
        key = path if path is not None else self.prepare(cp_id, step, label)
        try:
            writer = dcp.FileSystemWriter(key)
            with _quiet():
                if self.asynchronous:
                    fut = dcp.async_save(state, storage_writer=writer)
                    fut = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse or a Future
                else:
                    dcp.save(state, storage_writer=writer, process_group=self.group)
                    fut = None
        except BaseException:
            if self.rank == 0:
                shutil.rmtree(key, ignore_errors=True)
            raise
        with self._lock:
            self.written.add(key)
        if fut is not None:
            fut.add_done_callback(lambda f: self._done(key, f))
        return key, fut

    def _done(self, key: str, fut: Any) -> None:
        exc = fut.exception()
        if exc is None:
            return
        self.forget(key)
        if self.on_failure is not None:
            self.on_failure(key, describe_write_error(exc))

    def forget(self, path: str, pending: Any = None) -> None:
        """Delete a directory this store wrote (once its write ``pending`` ends)."""
        if pending is not None and not pending.done():
            pending.add_done_callback(lambda _f: self.forget(path))
            return
        with self._lock:
            if path not in self.written:
                return
            self.written.discard(path)
        if self.rank == 0:  # (under torch.distributed every rank forgets it at the same boundary)
            shutil.rmtree(path, ignore_errors=True)


def describe_write_error(exc: BaseException) -> str:
    """The cause of a failed DCP write (DCP wraps each rank's error in a CheckpointException)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))  # (the exception, its traceback) of a rank
        first = first[0] if isinstance(first, tuple) and first else first
        if isinstance(first, BaseException):
            exc = first
    for _ in range(5):  # the innermost cause: the OSError of a full disk
        inner = exc.__cause__ or exc.__context__
        if inner is None or isinstance(exc, OSError):
            break
        exc = inner
    return f"writing the checkpoint failed: {type(exc).__name__}: {exc}"


def wait_written(path: str, pending: Any) -> None:
    """Wait for ``pending`` (the write of ``path``); CheckpointError when it failed."""
    if pending is None:
        return
    try:
        pending.result()
    except Exception as e:
        raise CheckpointError(f"the checkpoint at {path} was not written: {describe_write_error(e)}") from e


def dir_step(path: str | os.PathLike[str]) -> int | None:
    """The step recorded beside a DCP directory (``inspector.json``), or None."""
    try:
        with open(Path(path) / SIDECAR) as f:
            step = json.load(f).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


# ------------------------------------------------------------------ reading
class _Plan:
    """A checked directory: what goes where (see :func:`check_dir`)."""

    def __init__(self) -> None:
        self.metadata: Any = None
        self.paths: dict[str, tuple[Any, ...]] = {}  # fqn -> object path
        self.model: dict[str, str] = {}  # live key -> fqn
        self.groups: list[list[int]] = []  # live parameter indices of each saved group
        self.state_key: dict[Any, int] = {}  # saved state key -> live parameter index
        self.opt_root: tuple[Any, ...] = ()


def _path_of(fqn: str, planner_data: Any) -> tuple[Any, ...]:
    if isinstance(planner_data, dict) and fqn in planner_data:
        return tuple(planner_data[fqn])
    return tuple(fqn.split("."))


def check_dir(at: Attached, path: str | os.PathLike[str]) -> _Plan:
    """Check a DCP directory against the live model and optimizer; changes nothing. Raises
    CheckpointError with the reason (missing, partial, another model)."""
    dcp = _dcp()
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"no checkpoint directory at {path}")
    if not (p / ".metadata").is_file():
        raise CheckpointError(
            f"{path} is not a complete checkpoint: it has no .metadata (a save that did not finish)"
        )
    try:
        md = dcp.FileSystemReader(str(p)).read_metadata()
    except Exception as e:
        raise CheckpointError(f"{path}: its .metadata cannot be read ({type(e).__name__}: {e})") from e
    ends: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if isinstance(rel, str):
            ends[rel] = max(ends.get(rel, 0), int(info.offset) + int(info.length))
    for rel, end in sorted(ends.items()):
        f = p / rel
        if not f.is_file():
            raise CheckpointError(
                f"{path} is a partial checkpoint: its data file {rel} is missing (a rank that did not "
                "finish writing)"
            )
        if f.stat().st_size < end:
            raise CheckpointError(
                f"{path} is a partial checkpoint: its data file {rel} holds {f.stat().st_size} bytes, "
                f"the metadata says {end}"
            )
    plan = _Plan()
    plan.metadata = md
    plan.paths = {fqn: _path_of(fqn, md.planner_data) for fqn in md.state_dict_metadata}
    # the layout: {"model", "optimizer"} at the top, or under one key ({"app": {"model", "optim"}})
    roots = sorted(
        {path_[: path_.index("model")] for path_ in plan.paths.values() if "model" in path_}, key=len
    )
    if not roots:
        raise CheckpointError(f'{path} holds no model state (no "model" entry): not a model checkpoint')
    root = roots[0]
    mroot = (*root, "model")
    oroot = next(
        (
            (*root, name)
            for name in ("optimizer", "optim")
            if any(q[: len(root) + 1] == (*root, name) for q in plan.paths.values())
        ),
        None,
    )
    if oroot is None:
        raise CheckpointError(f'{path} holds no optimizer state (no "optimizer" or "optim" entry)')
    plan.opt_root = oroot
    # the model's own state_dict() (FSDP2: DTensors of their global shapes): no collective here
    live = at.root.state_dict() if at.root is not None else {str(i): t for i, t in enumerate(at.tensors)}
    saved: dict[str, str] = {}
    for fqn, q in plan.paths.items():
        if q[: len(mroot)] == mroot:
            saved[".".join(str(x) for x in q[len(mroot) :])] = fqn
    missing, extra = sorted(set(live) - set(saved)), sorted(set(saved) - set(live))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"{len(missing)} of the model's entries are not in it ({', '.join(missing[:3])})")
        if extra:
            parts.append(f"{len(extra)} of its entries are not the model's ({', '.join(extra[:3])})")
        raise CheckpointError(f"{path} is another model's checkpoint: " + "; ".join(parts))
    for key, fqn in saved.items():
        t, m = live[key], md.state_dict_metadata[fqn]
        size, dtype = getattr(m, "size", None), getattr(getattr(m, "properties", None), "dtype", None)
        if isinstance(t, Tensor) and (size is None or tuple(size) != tuple(t.shape) or dtype != t.dtype):
            raise CheckpointError(
                f"{path} is another model's checkpoint: {key} is {tuple(t.shape)} {t.dtype} here, "
                f"{tuple(size) if size is not None else 'not a tensor'} {dtype or ''} in it".rstrip()
            )
    plan.model = {key: fqn for key, fqn in saved.items()}
    _check_optimizer(at, plan, str(path))
    return plan


def _check_optimizer(at: Attached, plan: _Plan, path: str) -> None:
    """The optimizer's part of :func:`check_dir`: the param groups (their ``params`` read, a few
    bytes), and which live parameter each saved state belongs to."""
    opt = at.optimizer
    oroot = plan.opt_root
    n = len(oroot)
    params_fqns = {
        fqn: q[n + 1]
        for fqn, q in plan.paths.items()
        if q[:n] == oroot and len(q) == n + 3 and q[n] == "param_groups" and q[n + 2] == "params"
    }
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    try:
        read: dict[str, Any] = {}
        if params_fqns:  # this process alone (no_dist): never a collective that one rank could skip
            _load_state_dict(
                state_dict=read,
                storage_reader=_dcp().FileSystemReader(path),
                no_dist=True,
                planner=_EmptyStateDictLoadPlanner(keys=set(params_fqns)),
            )
    except Exception as e:
        raise CheckpointError(f"{path}: its optimizer's parameter groups cannot be read ({e})") from e
    from torch.distributed.checkpoint._traverse import get_element

    saved_groups: dict[int, Any] = {}
    for fqn, g in params_fqns.items():
        value = read.get(fqn, get_element(read, plan.paths[fqn]))
        saved_groups[int(g)] = value
    groups = opt.param_groups  # type: ignore[union-attr]
    if sorted(saved_groups) != list(range(len(groups))):
        raise CheckpointError(
            f"{path} is another model's checkpoint: its optimizer has {len(saved_groups)} parameter "
            f"groups, this one {len(groups)}"
        )
    # live parameter index (optimizer.state_dict()'s numbering) by name and by index
    index: dict[Any, int] = {}
    names = {}
    if at.root is not None:
        names = {id(p): name for name, p in at.root.named_parameters()}
    i = 0
    for g in groups:
        for prm in g["params"]:
            index[i] = i
            index[str(i)] = i
            if id(prm) in names:
                index[names[id(prm)]] = i
            i += 1
    plan.groups = []
    for gi, g in enumerate(groups):
        saved = saved_groups[gi]
        if not isinstance(saved, list | tuple) or len(saved) != len(g["params"]):
            raise CheckpointError(
                f"{path} is another model's checkpoint: its optimizer's parameter group {gi} holds "
                f"{len(saved) if isinstance(saved, list | tuple) else '?'} parameters, this one "
                f"{len(g['params'])}"
            )
        try:
            plan.groups.append([index[k] for k in saved])
        except KeyError as e:
            raise CheckpointError(
                f"{path} is another model's checkpoint: its optimizer names a parameter {e} this model lacks"
            ) from None
    for q in plan.paths.values():
        if q[:n] == oroot and len(q) > n + 1 and q[n] == "state":
            k = q[n + 1]
            if k not in index:
                raise CheckpointError(
                    f"{path} is another model's checkpoint: its optimizer holds state for a parameter "
                    f"{k!r} this model lacks"
                )
            plan.state_key[k] = index[k]


def load_dir(
    at: Attached, path: str | os.PathLike[str], plan: _Plan | None = None, group: Any = None
) -> None:
    """Load a checked DCP directory into the live model and optimizer, in place (gradients
    None). Checked first (:func:`check_dir`) unless ``plan`` is given: refused, nothing changed.

    Under torch.distributed every rank calls it at the same boundary, after every rank checked
    the directory (``dcp.load`` over ``group`` is a collective); FSDP2: into ``get_state_dict``'s
    DTensors (each rank reads its shards), then ``set_state_dict``."""
    dcp = _dcp()
    plan = plan or check_dir(at, path)
    if getattr(at, "layout", None) is not None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = live_state(at)
        target: dict[str, Any] = {}
        cur = target
        for k in plan.opt_root[:-1]:  # the layout checked: {"model", "optimizer"} here, or under a key
            cur = cur.setdefault(k, {})
        cur["model"], cur[plan.opt_root[-1]] = state["model"], state["optimizer"]
        with _quiet():
            dcp.load(target, storage_reader=dcp.FileSystemReader(str(path)), process_group=group)
        set_state_dict(
            at.root, at.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        for t in at.tensors:
            t.grad = None
        return
    md = plan.metadata
    from torch.distributed.checkpoint._traverse import set_element

    live_model = live_state(at)["model"]
    opt = at.optimizer
    live_opt_state = opt.state  # type: ignore[union-attr]
    flat_params = [p for g in opt.param_groups for p in g["params"]]  # type: ignore[union-attr]
    target: dict[str, Any] = {}
    model_fqns = {fqn: key for key, fqn in plan.model.items()}
    n = len(plan.opt_root)
    for fqn, q in plan.paths.items():
        m = md.state_dict_metadata[fqn]
        if fqn in model_fqns:
            value: Any = live_model[model_fqns[fqn]]
        elif q[:n] == plan.opt_root and len(q) == n + 3 and q[n] == "state" and hasattr(m, "size"):
            now = live_opt_state.get(flat_params[plan.state_key[q[n + 1]]], {}).get(q[n + 2])
            dtype = m.properties.dtype
            if isinstance(now, Tensor) and tuple(now.shape) == tuple(m.size) and now.dtype == dtype:
                value = now  # in place
            else:
                value = torch.empty(tuple(m.size), dtype=dtype)
        elif hasattr(m, "size"):
            value = torch.empty(tuple(m.size), dtype=m.properties.dtype)
        else:
            value = None  # a non-tensor value: DCP puts it here
        set_element(target, q, value)
    with _quiet():
        dcp.load(target, storage_reader=dcp.FileSystemReader(str(path)), process_group=group)
    # the optimizer's own layout: state keyed by parameter index, groups naming indices
    from torch.distributed.checkpoint._traverse import get_element

    saved_opt = get_element(target, plan.opt_root)
    state = {plan.state_key[k]: v for k, v in saved_opt.get("state", {}).items()}
    groups = []
    for gi, g in enumerate(saved_opt["param_groups"]):
        groups.append({**g, "params": plan.groups[gi]})
    opt.load_state_dict({"state": state, "param_groups": groups})  # type: ignore[union-attr]
    with torch.no_grad():
        for t in at.tensors:
            t.grad = None
