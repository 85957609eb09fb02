"""The Inspector: where every torch hook of ours is registered, and the step lifecycle.

Torch hooks registered (and nothing else; ``close()`` removes every one):

- ``optimizer.register_step_pre_hook``: the ``pre_step`` point. Runs once per optimizer
  step on the final gradients (accumulated, all-reduced under DDP, unscaled under a
  GradScaler): raw statistics, every enabled ``pre_step`` hook in ``position`` order,
  final statistics. With a closure (LBFGS, Lightning) it wraps the closure so that this
  work runs after the closure's backward, once per evaluation.
- ``optimizer.register_step_post_hook``: the step boundary. Snapshot N is published here,
  right after the N-th update; pending edits are applied; a pause holds the thread here.
- ``root.register_forward_pre_hook``: marks a step as under way (edits that register
  torch hooks are applied here, before the backward).
- ``param.register_post_accumulate_grad_hook``: only on parameters that an enabled
  ``post_accumulate`` hook targets. The hook receives the parameter; its gradient is
  ``param.grad``.
- ``module.register_forward_hook``: only on modules that an enabled ``module`` hook
  targets; it registers a tensor hook on the forward's output (and inputs) to see
  ``grad_output`` (``grad_input``), which works with in-place ops where
  ``register_full_backward_hook`` raises.

Threads: only the training thread (the one that runs ``optimizer.step()``, or the root
forward) registers or removes torch hooks. Edits from other threads are validated at once
and applied by the training thread at the next safe point (DESIGN.md "Steps").
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from . import distributed
from .errors import AttachError, HookError, InspectorError
from .handles import HookHandle
from .hub import Hub
from .ops import NanFinding, Runtime, Target, apply_post_accumulate, apply_pre_step, count_nonfinite
from .records import HookSpec, Snapshot, jsonsafe
from .registry import PRESET_FORMAT, Change, Registry
from .stats import absmax, dense, foreach_norm, histograms, mean_std
from .targets import match, strip_prefixes, wrapper_prefixes
from .telemetry import Cadence, Pack

__all__ = ["Inspector", "attach", "HIST_CAP", "HIST_BINS"]

HIST_CAP = 8  # at most this many parameters get histograms
HIST_BINS = 64
NONFINITE_REPEAT = 100  # a non-finite streak is reported on its first step, then every this many steps


@dataclass(frozen=True)
class _Plan:
    """The applied config, resolved to targets. Replaced whole on every change (atomic swap)."""

    pre: tuple[tuple[Runtime, tuple[Target, ...]], ...] = ()
    post: dict[int, tuple[tuple[Runtime, Target], ...]] = field(default_factory=dict)
    module: dict[str, tuple[Runtime, ...]] = field(default_factory=dict)


def _tensors_in(x: Any) -> Iterator[Tensor]:
    if isinstance(x, Tensor):
        yield x
    elif isinstance(x, list | tuple):
        for v in x:
            yield from _tensors_in(v)
    elif isinstance(x, Mapping):
        for v in x.values():
            yield from _tensors_in(v)


class Inspector:
    """Watches and edits the gradients of one model and optimizer. Create with :func:`attach`."""

    def __init__(self, model: nn.Module | Mapping[str, Tensor], optimizer: torch.optim.Optimizer | None = None,
                 *, scaler: Any = None, budget: float = 0.03, every: int | None = None, hist_every: int = 10,
                 per_rank_stats: bool = True, dist_timeout: float = 60.0) -> None:
        if isinstance(optimizer, list | tuple):
            raise AttachError(
                "attach() takes one optimizer: its step is the step boundary. For several optimizers (a GAN, "
                "say) attach one Inspector per optimizer, each with the model part that optimizer steps")
        inner = getattr(optimizer, "optimizer", None)
        if optimizer is not None and isinstance(inner, torch.optim.Optimizer):
            # a framework's wrapper (HF Accelerate's AcceleratedOptimizer, Lightning's
            # LightningOptimizer) steps the real optimizer: our step hooks go on that one
            optimizer = inner
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise AttachError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(budget, bool) or not isinstance(budget, int | float) or not 0 < budget < 1:
            raise HookError(("budget",), f"must be a fraction in (0, 1) (got {budget!r})")
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise HookError(("every",), f"must be a positive integer or None (got {every!r})")
        if isinstance(hist_every, bool) or not isinstance(hist_every, int) or hist_every < 1:
            raise HookError(("hist_every",), f"must be a positive integer (got {hist_every!r})")

        self._root: nn.Module | None
        if isinstance(model, nn.Module):
            self._root = model
            prefixes = wrapper_prefixes(model)
            named = [(strip_prefixes(n, prefixes), p) for n, p in model.named_parameters()]
            self._module_objs = {strip_prefixes(n, prefixes): m for n, m in model.named_modules()}
        elif isinstance(model, Mapping):
            self._root = None
            named = []
            for name, t in model.items():
                if not isinstance(name, str) or not isinstance(t, Tensor):
                    raise AttachError(f"a dict model maps names to tensors; got {name!r}: {type(t).__name__}")
                if not t.is_leaf:
                    raise AttachError(f"{name!r} is not a leaf tensor: only leaves accumulate .grad")
                named.append((name, t))
            self._module_objs = {}
        else:
            raise AttachError(f"model must be an nn.Module or a dict of named leaf tensors, got {type(model).__name__}")
        if not named:
            raise AttachError("the model has no parameters to inspect")

        self.params: list[str] = [n for n, _ in named]
        self.modules: list[str] = list(self._module_objs)
        self._tensors: list[Tensor] = [p for _, p in named]
        self._optimizer = optimizer
        self._scaler = scaler if scaler is not None and getattr(scaler, "is_enabled", lambda: True)() else None
        self._hist_every = hist_every

        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        # under torch.distributed: a control plane shared by every rank (a collective call)
        self._dist = distributed.ControlPlane(timeout=dist_timeout) if distributed.active() else None
        self.rank = self._dist.rank if self._dist is not None else 0
        self._reg = Registry(self.params, self.modules, scaler=self._scaler is not None,
                             distributed=self._dist is not None)
        self._hub = Hub()
        self._cadence = Cadence(float(budget), every)
        self._plan = _Plan()
        self._runtimes: dict[str, Runtime] = {}
        self._handles: list[Any] = []
        self._post_handles: dict[int, Any] = {}
        self._module_handles: dict[str, Any] = {}
        self._torch_dirty = False

        # step state
        self._step = 0
        self._under_way = False
        self._sampled = True  # step 1 is always sampled
        self._sampled_count = 1
        self._train_tid = threading.get_ident()
        self._t_ours = 0.0
        self._last_boundary: float | None = None
        self._seq = 0
        self._step_events: list[dict[str, Any]] = []
        self._nf_last: str | None = None
        self._nf_streak = 0
        self._last_scale: float | None = None
        # per-step device-side collections
        self._pack: Pack | None = None
        self._raw_host: dict[int, float] = {}
        self._pre_meta: dict[str, Any] = {}
        self._param_buf: list[Tensor] | None = None  # parameters before the update (sampled steps)
        self._before_ready = False
        self._mod_sq: dict[tuple[str, str], Tensor] = {}
        self._mod_bad: dict[str, Tensor] = {}
        # records: key -> [sum, count]
        self._rec_cur: dict[str, list[Any]] = {}
        self._rec_late: dict[str, list[Any]] = {}
        # histogram subscriptions
        self._hist_user: list[str] = []
        self._hist_subs: dict[str, list[str]] = {}
        self._hist_force = False
        # control
        self._paused = False
        self._credit = 0
        self._waiting = False
        self._finished = False
        self._closed = False
        self._server: Any = None
        # per-rank (local, pre-all-reduce) gradient norms under DDP
        self._local_sq: list[Tensor | None] = [None] * len(self._tensors)
        self._local_handles: list[Any] = []
        self._local_bad = -1
        self._local_host: list[float] | None = None
        self._nf_pending: tuple[Any, ...] | None = None

        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(self._on_step_pre))
            self._handles.append(optimizer.register_step_post_hook(self._on_step_post))
        if self._root is not None:
            self._handles.append(self._root.register_forward_pre_hook(self._on_forward_pre))
        if self._dist is not None and per_rank_stats:
            for i, t in enumerate(self._tensors):
                if t.requires_grad:
                    self._local_handles.append(t.register_post_accumulate_grad_hook(self._local_hook(i)))

    # ================================================================= public API
    @property
    def step(self) -> int:
        """Completed optimizer steps (the number of the last step boundary)."""
        return self._step

    @property
    def config_version(self) -> int:
        """How many hook changes have been applied."""
        return self._reg.version

    @property
    def state(self) -> dict[str, Any]:
        """``{"state": "running" | "paused" | "finished", "step": N, "held": bool}``.

        ``held`` is true once a pause has taken hold: the training thread waits at the boundary
        of step N (``state`` says "paused" as soon as it is asked for, while a step may still run).
        """
        with self._lock:
            s = "finished" if (self._finished or self._closed) else ("paused" if self._paused else "running")
            return {"state": s, "step": self._step, "held": self._waiting}

    @property
    def cost(self) -> dict[str, Any]:
        """The inspector's own measured cost: ``{"overhead": fraction of the wall-clock step,
        "sampled_every": k, "step_s", "sampled_s", "unsampled_s"}`` (recent averages, seconds)."""
        return {"overhead": self._cadence.overhead, "sampled_every": self._cadence.k, **self._cadence.costs}

    def param_info(self) -> list[dict[str, Any]]:
        """``[{"name", "shape", "numel", "module"}]`` in ``params`` order."""
        out = []
        for name, t in zip(self.params, self._tensors, strict=True):
            module = name.rpartition(".")[0] if self._root is not None else None
            out.append({"name": name, "shape": list(t.shape), "numel": t.numel(), "module": module,
                        "requires_grad": t.requires_grad, "dtype": str(t.dtype).removeprefix("torch.")})
        return out

    def match_targets(self, glob: str, point: str = "pre_step") -> list[str]:
        """The names ``glob`` matches at ``point`` (module names for "module", else parameter names)."""
        if point not in ("pre_step", "post_accumulate", "module"):
            raise HookError(("point",), f"must be pre_step, post_accumulate or module (got {point!r})")
        if not isinstance(glob, str):
            raise HookError(("glob",), f"must be a string (got {glob!r})")
        return match(self.modules if point == "module" else self.params, glob)

    # ----------------------------------------------------------------- hooks
    def add_hook(self, kind: str | Callable[[str, Tensor], Any], target: str = "*", point: str | None = None,
                 *, enabled: bool = True, **params: Any) -> HookHandle:
        """Add a hook; returns its handle. ``kind`` is a kind name or your own callable.

        A callable becomes kind ``python``: it is called as ``fn(name, param) -> None`` for
        each target, and edits ``param.grad`` in place (at ``pre_step`` by default, or at
        ``post_accumulate`` once per backward).

        Raises:
            HookError: invalid kind, target, point or parameter; nothing changes.
        """
        fn = None
        if callable(kind):
            fn, kind = kind, "python"
        with self._lock:
            self._check_open()
            spec, change = self._reg.add(kind, target, point, params, enabled, fn=fn)
            self._submit(change)
            return HookHandle(self, spec.id)

    def update_hook(self, hook_id: str, *, params: Mapping[str, Any] | None = None, enabled: bool | None = None,
                    target: str | None = None, position: int | None = None) -> dict[str, Any]:
        """Change a hook as one edit: ``params`` are merged (only the given keys change)."""
        with self._lock:
            self._check_open()
            _, change = self._reg.update(hook_id, params=params, enabled=enabled, target=target, position=position)
            if change is not None:
                self._submit(change)
            return self.hook_spec(hook_id)

    def remove_hook(self, hook_id: str, *, missing_ok: bool = False) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                change = self._reg.remove(hook_id)
            except KeyError:
                if missing_ok:
                    return
                raise
            self._submit(change)

    def hook(self, hook_id: str) -> HookHandle:
        """The handle of an existing hook (raises HookNotFound)."""
        with self._lock:
            self._reg.get(hook_id)
            return HookHandle(self, hook_id)

    def hook_spec(self, hook_id: str) -> dict[str, Any]:
        with self._lock:
            for s in self._reg.view():
                if s.id == hook_id:
                    return s.to_dict()
            self._reg.get(hook_id)  # raises HookNotFound
            raise AssertionError("unreachable")

    def hooks(self) -> list[dict[str, Any]]:
        """The requested config as dicts, in position order (``applied_step`` None while pending)."""
        with self._lock:
            return [s.to_dict() for s in self._reg.view()]

    def export_hooks(self) -> dict[str, Any]:
        """A preset of the current hooks (no ids), for ``import_hooks``. Python hooks are left out."""
        with self._lock:
            hooks = [s.preset() for s in self._reg.requested if s.kind != "python"]
        return {"format": PRESET_FORMAT, "version": 1, "hooks": hooks}

    def import_hooks(self, preset: Mapping[str, Any] | list[Any]) -> list[dict[str, Any]]:
        """Replace every hook with the preset's, as one change. Validated whole first."""
        with self._lock:
            self._check_open()
            change = self._reg.import_(preset)
            self._submit(change)
            return self.hooks()

    # ----------------------------------------------------------------- data
    def record(self, **scalars: Any) -> None:
        """Record scalars (floats or one-element tensors; tensors are moved once per step).

        Before ``optimizer.step()`` they attach to the step under way; after it and before
        the next forward, to the step just completed (sent as a late ``scalars`` message).
        Several records of one key in one step are averaged.
        """
        vals: dict[str, Any] = {}
        for k, v in scalars.items():
            if isinstance(v, Tensor):
                if v.numel() != 1:
                    raise HookError(("scalars", k), f"must be a number or a one-element tensor (got shape {tuple(v.shape)})")
                vals[k] = v.detach().reshape(()).float()
            elif isinstance(v, int | float) and not isinstance(v, bool):
                vals[k] = float(v)
            else:
                raise HookError(("scalars", k), f"must be a number or a one-element tensor (got {v!r})")
        with self._lock:
            late = self._root is not None and not self._under_way and self._step > 0
            dest = self._rec_late if late else self._rec_cur
            for k, v in vals.items():
                acc = dest.get(k)
                if acc is None:
                    dest[k] = [v, 1]
                else:
                    acc[0] = acc[0] + v
                    acc[1] += 1

    def snapshots(self, since: int | None = None) -> list[dict[str, Any]]:
        """Snapshots still in the ring buffer with ``step > since``, as wire dicts."""
        with self._hub._lock:
            snaps = list(self._hub.snapshots)
        return [s.to_dict() for s in snaps if since is None or s.step > since]

    def latest(self) -> dict[str, Any] | None:
        with self._hub._lock:
            return self._hub.snapshots[-1].to_dict() if self._hub.snapshots else None

    def events(self, since: int | None = None) -> list[dict[str, Any]]:
        """Events with ``seq > since``."""
        with self._hub._lock:
            return [e for e in self._hub.events if since is None or e["seq"] > since]

    def subscribe(self, callback: Callable[[str, Any], None]) -> Callable[[], None]:
        """Call ``callback(kind, payload)`` for every record, off the training thread.

        ``kind`` is ``"snapshot"`` (payload: the snapshot's wire dict), ``"scalars"``
        (``{"step", "loss", "scalars"}``), ``"hooks"`` (``{"config_version", "hooks"}``),
        ``"event"`` (an event dict) or ``"training"`` (``{"state", "step", "held"}``: after a
        pause, resume or single step, and when a pause takes hold). Errors in the callback are caught and counted. Returns
        a function that unsubscribes.
        """
        return self._hub.subscribe(callback)

    def add_event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Record and broadcast an event (used by the server: ``server_error``, ``history_paused``...)."""
        return self._event(kind, **fields)

    def set_hist_params(self, names: list[str]) -> None:
        """Parameters that get histograms (with the clients' subscriptions; capped at 8)."""
        self.set_hist_subscription("", names)

    def set_hist_subscription(self, key: str, names: list[str]) -> None:
        """Histogram parameters wanted by one consumer (``key``); ``[]`` drops it."""
        unknown = [n for n in names if n not in self.params]
        if unknown:
            raise HookError(("hist",), f"unknown parameter {unknown[0]!r}")
        with self._lock:
            if key == "":
                self._hist_user = list(names)
            elif names:
                self._hist_subs[key] = list(names)
            else:
                self._hist_subs.pop(key, None)
            self._hist_force = True

    @property
    def hist_params(self) -> list[str]:
        """The capped union of histogram parameters, in the order they were asked for."""
        with self._lock:
            out: list[str] = []
            for n in [*self._hist_user, *(n for v in self._hist_subs.values() for n in v)]:
                if n not in out:
                    out.append(n)
            return out[:HIST_CAP]

    # ----------------------------------------------------------------- control
    def pause(self) -> dict[str, Any]:
        """Hold the training thread at the next step boundary."""
        with self._cond:
            self._paused, self._credit = True, 0
            self._cond.notify_all()
        return self._publish_training()

    def resume(self) -> dict[str, Any]:
        with self._cond:
            self._paused, self._credit = False, 0
            self._cond.notify_all()
        return self._publish_training()

    def step_once(self) -> dict[str, Any]:
        """Let exactly one more step run, then hold at its boundary."""
        with self._cond:
            self._paused = True
            self._credit += 1
            self._cond.notify_all()
        return self._publish_training()

    def _publish_training(self) -> dict[str, Any]:
        """Tell subscribers the training state changed (a ``training`` record: ``state``, ``step``, ``held``)."""
        state = self.state
        self._hub.publish("training", state)
        return state

    def begin_step(self) -> None:
        """Mark a step as under way, as the root module's forward pre-hook does.

        Only needed in loops that never call the attached root module itself (they call a
        submodule): records made after this attach to the coming step, and edits that register
        torch hooks are applied now, before the backward.
        """
        self._on_forward_pre(self._root, ())  # type: ignore[arg-type]

    def finish(self) -> None:
        """Training is over (state ``finished``); edits from other threads apply at once from now.

        ``wait()`` does this and then blocks; call ``finish()`` to keep serving without blocking.
        """
        with self._cond:
            self._finished = True
            self._train_tid = threading.get_ident()
            self._drain_locked(torch_ok=True)
        self._flush_late()

    def mark_step(self) -> None:
        """The step boundary for loops without a torch optimizer.

        Call it after ``backward()`` (and your own update): it runs the ``pre_step`` hooks on
        the gradients, takes the statistics and publishes the snapshot.
        """
        if self._optimizer is not None:
            raise InspectorError("mark_step() is for loops without a torch optimizer: here optimizer.step() "
                                 "is the boundary")
        self._train_tid = threading.get_ident()
        self._pre_step_work()
        self._boundary()

    # ----------------------------------------------------------------- serving
    def serve(self, host: str = "127.0.0.1", port: int = 8000, token: str | None = None,
              read_only: bool = False, db: str | os.PathLike[str] | bool | None = None) -> str | None:
        """Serve the dashboard from a background thread of this process; returns its URL.

        Loads the ``server`` package shipped with ``inspector`` (even when the working
        directory has a ``server.py`` of its own). Under ``torch.distributed`` only rank 0
        serves; on the other ranks this returns None.

        Args:
            host: bind address; anything but loopback requires a token (generated when None and
                printed once in the returned URL).
            port: TCP port; 0 picks a free one.
            token: the access token.
            read_only: serve the dashboard and the stream, refuse every command (403).
            db: the history file: None for ``./gradient-inspector.sqlite``, a path for that
                file, False for no history on disk.
        """
        self._check_open()
        if self.rank != 0:
            return None  # under torch.distributed only rank 0 serves
        if self._server is not None:
            return str(self._server.url)
        embed = importlib.import_module(_load_server_package().__name__ + ".embed")
        self._server = embed.start(self, host=host, port=port, token=token, read_only=read_only, db=db)
        return str(self._server.url)

    def wait(self) -> None:
        """Keep serving after training ended, until Ctrl-C; edits apply at once meanwhile."""
        with self._cond:
            self._finished = True
            self._train_tid = threading.get_ident()
            self._drain_locked(torch_ok=True)
        try:
            while True:
                with self._cond:
                    if self._closed:
                        return
                    self._drain_locked(torch_ok=True)
                    self._cond.wait(timeout=0.5)  # wake for edits; the timeout lets Ctrl-C through
        except KeyboardInterrupt:
            pass
        finally:
            self.close()

    def close(self) -> None:
        """Remove every hook of ours and stop the server; idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._finished = True
            self._cond.notify_all()
        try:
            self._flush_late()
        except Exception:
            pass
        for h in [*self._handles, *self._post_handles.values(), *self._module_handles.values(),
                  *self._local_handles]:
            h.remove()
        self._handles.clear()
        self._local_handles.clear()
        self._post_handles.clear()
        self._module_handles.clear()
        self._hub.flush()  # deliver the last records to the server (and its history) before it stops
        server, self._server = self._server, None
        if server is not None:
            server.stop()
        self._hub.close()
        self._plan = _Plan()
        self._runtimes.clear()
        self._reg.fns.clear()
        self._param_buf = None
        self._mod_sq.clear()
        self._mod_bad.clear()

    def __enter__(self) -> Inspector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Inspector {len(self.params)} params, step {self._step}, {len(self._reg.requested)} hooks>"

    # ================================================================= control plane
    def _check_open(self) -> None:
        if self._closed:
            raise InspectorError("this Inspector is closed")
        if self._dist is not None and self.rank != 0 and threading.get_ident() != self._train_tid:
            raise InspectorError("under torch.distributed, edits from another thread go to rank 0 (which serves "
                                 f"the dashboard); this is rank {self.rank}")

    def _submit(self, change: Change) -> None:
        """A validated change was queued: apply it now where DESIGN.md allows (lock held)."""
        on_train = threading.get_ident() == self._train_tid
        if self._dist is not None and not self._dist.broken:
            # one config for the job: edits from the training thread run on every rank (the
            # script is the same everywhere); rank 0's other edits travel at the next boundary
            if on_train and len(self._reg.pending) == 1:
                self._drain_locked(torch_ok=True)
            elif self._waiting:
                self._cond.notify_all()
            return
        if on_train or (self._finished and not self._closed):
            self._drain_locked(torch_ok=True)
        elif self._waiting:
            self._cond.notify_all()  # the paused training thread applies it
        elif self._root is not None and not self._under_way and not any(c.touches_torch() for c in self._reg.pending):
            self._drain_locked(torch_ok=False)  # pre_step only, between steps: safe from this thread

    def _drain_locked(self, *, torch_ok: bool) -> None:
        changes = []
        while self._reg.pending:
            if not torch_ok and self._reg.pending[0].touches_torch():
                break
            ch = self._reg.apply_next(self._step + 1)
            assert ch is not None
            changes.append(ch)
        if changes or (torch_ok and self._torch_dirty):
            self._rebuild_plan()
            if torch_ok:
                self._sync_torch_hooks()
        if changes:
            version = self._reg.version - len(changes)
            for ch in changes:  # every applied change is announced, with its own config_version
                version += 1
                self._announce(ch, version)
                self._publish_hooks(version)
            self._cond.notify_all()  # for whoever waits for an edit to be applied

    def _announce(self, ch: Change, version: int) -> None:
        def d(x: Any) -> Any:
            if isinstance(x, HookSpec):
                return x.to_dict()
            if isinstance(x, list):
                return [s.to_dict() for s in x]
            return x
        after = ch.after
        if isinstance(after, HookSpec):  # with its applied_step, as it is now in force
            after = next((s for s in self._reg.applied if s.id == after.id), after)
        elif isinstance(after, list):
            ids = {s.id for s in after}
            after = [s for s in self._reg.applied if s.id in ids]
        self._event("hook_applied", hook_id=ch.hook_id, action=ch.action, before=d(ch.before), after=d(after),
                    applied_step=self._step + 1, config_version=version)

    def _publish_hooks(self, version: int | None = None) -> None:
        self._hub.publish("hooks", {"config_version": self._reg.version if version is None else version,
                                    "hooks": self.hooks()})

    def _rebuild_plan(self) -> None:
        runtimes: dict[str, Runtime] = {}
        pre: list[tuple[Runtime, tuple[Target, ...]]] = []
        post: dict[int, list[tuple[Runtime, Target]]] = {}
        module: dict[str, list[Runtime]] = {}
        index = {n: i for i, n in enumerate(self.params)}
        for s in self._reg.applied:
            rt = self._runtimes.get(s.id)
            if rt is None or rt.spec.kind != s.kind or rt.spec.params != s.params:
                rt = Runtime(s, fn=self._reg.fns.get(s.id))
            rt.spec = s
            runtimes[s.id] = rt
            if not s.enabled:
                continue
            if s.point == "module":
                for name in match(self.modules, s.target):
                    module.setdefault(name, []).append(rt)
                continue
            targets = tuple(Target(index[n], n, self._tensors[index[n]]) for n in match(self.params, s.target))
            if s.point == "pre_step":
                pre.append((rt, targets))
            else:
                for t in targets:
                    if t.param.requires_grad:
                        post.setdefault(t.index, []).append((rt, t))
        self._runtimes = runtimes
        self._plan = _Plan(tuple(pre), {i: tuple(v) for i, v in post.items()},
                           {n: tuple(v) for n, v in module.items()})
        self._torch_dirty = True

    def _sync_torch_hooks(self) -> None:
        """Register/remove our post-accumulate and module hooks to match the plan (training thread)."""
        plan = self._plan
        for i in set(self._post_handles) - set(plan.post):
            self._post_handles.pop(i).remove()
        for i in set(plan.post) - set(self._post_handles):
            self._post_handles[i] = self._tensors[i].register_post_accumulate_grad_hook(self._post_hook(i))
        for n in set(self._module_handles) - set(plan.module):
            self._module_handles.pop(n).remove()
        for n in set(plan.module) - set(self._module_handles):
            self._module_handles[n] = self._module_objs[n].register_forward_hook(self._module_hook(n))
        self._torch_dirty = False

    def _hook_failed(self, spec: HookSpec, param: str | None, err: BaseException) -> None:
        """A hook raised: disable it at once, report it, and let training go on."""
        with self._lock:
            before = self._reg.disable_now(spec.id)
            if before is None:
                return
            self._rebuild_plan()  # torch hooks are synced at the next safe point
            self._event("hook_error", hook_id=spec.id, param=param, message=f"{type(err).__name__}: {err}",
                        step=self._step + 1)
            self._event("hook_applied", hook_id=spec.id, action="disable", before=before.to_dict(),
                        after={**before.to_dict(), "enabled": False}, applied_step=self._step + 1,
                        config_version=self._reg.version)
            self._publish_hooks()

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        with self._lock:
            self._seq += 1
            ev = {"seq": self._seq, "kind": kind, "time": time.time(), **jsonsafe(fields)}
            self._step_events.append(ev)
        self._hub.publish("event", ev)
        return ev

    # ================================================================= torch hooks
    def _on_forward_pre(self, module: nn.Module, args: Any) -> None:
        t0 = time.perf_counter()
        self._train_tid = threading.get_ident()
        if self._scaler is not None:
            self._check_scaler_skip()
        if not self._under_way:
            with self._lock:
                self._under_way = True
            self._flush_late()
        if self._dist is not None and not self._dist.broken:
            if self._torch_dirty:  # pending edits wait for the boundary exchange
                with self._lock:
                    self._sync_torch_hooks()
        elif self._reg.pending or self._torch_dirty:
            with self._lock:
                self._drain_locked(torch_ok=True)
        self._t_ours += time.perf_counter() - t0

    def _on_step_pre(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        t0 = time.perf_counter()
        self._train_tid = threading.get_ident()
        if not self._under_way and self._root is not None:
            # no forward of the root module marked this step (a loop that calls a submodule, or
            # Lightning's training_step): records made since the last boundary were late ones
            with self._lock:
                self._under_way = True
            self._flush_late()
        if self._sampled and not self._before_ready:  # for the update-to-parameter ratio
            with torch.no_grad():
                if self._param_buf is None:  # allocated once: a fresh copy each time costs page faults
                    self._param_buf = [torch.empty_like(p) for p in self._tensors]
                torch._foreach_copy_(self._param_buf, [p.detach() for p in self._tensors])
            self._before_ready = True
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        self._t_ours += time.perf_counter() - t0
        if closure is None:
            self._pre_step_work()
            return None

        def wrapped_closure() -> Any:
            out = closure()
            self._pre_step_work()  # after the closure's backward, once per evaluation
            return out

        if len(args) > 1:
            return (args[0], wrapped_closure, *args[2:]), kwargs
        return args, {**kwargs, "closure": wrapped_closure}

    def _on_step_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._boundary()

    def _post_hook(self, i: int) -> Callable[[Tensor], None]:
        def hook(param: Tensor) -> None:  # receives the PARAMETER; its gradient is param.grad
            t0 = time.perf_counter()
            for rt, target in self._plan.post.get(i, ()):
                try:
                    finding = apply_post_accumulate(rt, target, self._sampled)
                except Exception as e:
                    self._hook_failed(rt.spec, target.name, e)
                    continue
                if finding is not None:
                    self._nonfinite(finding, rt.spec.params["action"], point="post_accumulate")
            self._t_ours += time.perf_counter() - t0
        return hook

    def _module_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            t0 = time.perf_counter()
            try:
                rts = self._plan.module.get(name, ())
                guard = any(rt.spec.kind == "nan_guard" for rt in rts)
                log = self._sampled and any(rt.spec.kind == "module_log" for rt in rts)
                want_in = log and any(rt.spec.kind == "module_log" and rt.spec.params["grad_input"] for rt in rts)
                if torch.is_grad_enabled() and (guard or log):
                    for t in _tensors_in(output):
                        if t.requires_grad:
                            t.register_hook(self._module_grad_hook(name, "out"))
                    if want_in:
                        for t in _tensors_in(args):
                            if t.requires_grad:
                                t.register_hook(self._module_grad_hook(name, "in"))
            except Exception as e:
                for rt in self._plan.module.get(name, ()):
                    self._hook_failed(rt.spec, name, e)
            self._t_ours += time.perf_counter() - t0
        return hook

    def _module_grad_hook(self, name: str, which: str) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            t0 = time.perf_counter()
            try:
                with torch.no_grad():
                    sq = grad.detach().float().pow(2).sum()
                    if self._scaler is not None and getattr(self._scaler, "_scale", None) is not None:
                        sq = sq / self._scaler._scale.to(sq.device).float().pow(2)  # report unscaled norms
                    key = (name, which)
                    prev = self._mod_sq.get(key)
                    self._mod_sq[key] = sq if prev is None else prev + sq
                    if which == "out":
                        bad = ~torch.isfinite(sq)
                        prevb = self._mod_bad.get(name)
                        self._mod_bad[name] = bad if prevb is None else prevb | bad
            except Exception as e:
                for rt in self._plan.module.get(name, ()):
                    self._hook_failed(rt.spec, name, e)
            self._t_ours += time.perf_counter() - t0
        return hook

    def _check_scaler_skip(self) -> None:
        scale_t = getattr(self._scaler, "_scale", None)
        if scale_t is None:
            return
        scale = float(scale_t)  # one read per forward, only with a scaler (a sync on CUDA)
        if self._last_scale is not None and scale < self._last_scale:
            self._event("step_skipped", step=self._step + 1, reason="scaler")
        self._last_scale = scale

    # ================================================================= the step's work
    def _pre_step_work(self) -> None:
        """Raw statistics, every pre_step hook, final statistics (once per step or per closure call)."""
        t0 = time.perf_counter()
        plan = self._plan
        sampled = self._sampled
        pack = Pack()
        present = [(i, p.grad) for i, p in enumerate(self._tensors) if p.grad is not None]
        idx = [i for i, _ in present]
        grads = [dense(g) for _, g in present]
        norms = foreach_norm(grads)
        dev = grads[0].device if grads else torch.device("cpu")
        parts = [torch.stack([n.to(dev) for n in norms])] if norms else []
        mod_names = ([n for n in self._mod_bad if any(rt.spec.kind == "nan_guard" for rt in plan.module.get(n, ()))]
                     if self._mod_bad else [])
        if mod_names:
            parts.append(torch.stack([self._mod_bad[n].to(dev).float() for n in mod_names]))
        local_idx = [i for i, v in enumerate(self._local_sq) if v is not None] if self._local_handles else []
        if local_idx:
            parts.append(torch.stack([self._local_sq[i].to(dev) for i in local_idx]).sqrt())  # type: ignore[union-attr]
        # NaN/Inf detection on every step: the raw norms (and module flags) in one host read
        host = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist() if parts else []
        self._raw_host = dict(zip(idx, host[:len(idx)], strict=True))
        bad_modules = [n for n, v in zip(mod_names, host[len(idx):len(idx) + len(mod_names)], strict=True) if v]
        if local_idx:
            local = [math.nan] * len(self.params)
            for i, v in zip(local_idx, host[len(idx) + len(mod_names):], strict=True):
                local[i] = v
            self._local_host = local
            self._local_bad = next((i for i in local_idx if not math.isfinite(local[i])), -1)
        total = sum(host[:len(idx)])  # finite exactly when every norm is
        bad = [i for i in idx if not math.isfinite(self._raw_host[i])] if not math.isfinite(total) else []
        counts = {i: count_nonfinite(dense(self._tensors[i].grad)) for i in bad}  # type: ignore[arg-type]
        for i in [i for i in bad if counts[i] == (0, 0)]:  # finite values whose float32 norm overflowed
            self._raw_host[i] = float(torch.linalg.vector_norm(dense(self._tensors[i].grad).double()))  # type: ignore[arg-type]
            bad.remove(i)
            del counts[i]

        raw_keep: dict[int, Tensor] = {}
        if sampled:
            raw_absmax = absmax(grads)
            pack.add("raw_absmax", raw_absmax)
            if self._hist_due():
                for n in self.hist_params:
                    i = self.params.index(n)
                    g = self._tensors[i].grad
                    if g is not None:
                        raw_keep[i] = dense(g).detach().clone()
            for rt, _ in plan.pre:
                rt.reset_effects()

        actions: dict[int, str] = {}
        skip = False
        for rt, targets in plan.pre:
            try:
                res = apply_pre_step(rt, list(targets), sampled)
            except Exception as e:
                self._hook_failed(rt.spec, ",".join(t.name for t in targets[:3]), e)
                continue
            if res is True:
                skip = True
                for t in targets:
                    actions.setdefault(t.index, "skip")
                break
            if isinstance(res, list):
                for f in res:
                    actions.setdefault(f.index, rt.spec.params["action"])
                    counts.setdefault(f.index, (f.nan, f.inf))
        if skip:
            for p in self._tensors:
                p.grad = None
            self._event("step_skipped", step=self._step + 1, reason="nan_guard")
        if self._dist is not None and not self._dist.broken:
            self._nf_pending = (bad, counts, actions, bad_modules)  # reported at the boundary, with the rank
        else:
            self._report_nonfinite(bad, counts, actions, bad_modules)

        if sampled:
            fin = [(i, p.grad) for i, p in enumerate(self._tensors) if p.grad is not None]
            fgrads = [dense(g) for _, g in fin]
            if plan.pre or skip:
                fnorms, fabsmax = foreach_norm(fgrads), absmax(fgrads)
            else:  # no pre_step hook ran: the final gradients are the raw ones
                fnorms, fabsmax = norms, raw_absmax
            pack.add("final_norm", fnorms)
            pack.add("final_absmax", fabsmax)
            strided = [k for k, (_, g) in enumerate(fin) if g.layout == torch.strided]
            dense_fin = [fin[k] for k in strided]
            means, stds = mean_std([fgrads[k] for k in strided], [fnorms[k] for k in strided])
            pack.add("std", stds)
            pack.add("mean", means)
            hist_idx = []
            for i, raw in raw_keep.items():
                g = self._tensors[i].grad
                raw_finite = math.isfinite(self._raw_host.get(i, math.nan))
                # with no pre_step hook the final gradient is the raw one; otherwise a hook may have made it
                # non-finite, and only a host read could tell
                pack.add(f"hist:{i}", histograms(raw, dense(g) if g is not None else None, HIST_BINS,
                                                 raw_finite=raw_finite, final_finite=raw_finite and not plan.pre))
                hist_idx.append(i)
            self._pre_meta = {"raw_idx": idx, "fin_idx": [i for i, _ in fin], "dense_idx": [i for i, _ in dense_fin],
                              "hist_idx": hist_idx, "counts": counts}
        self._pack = pack if sampled else None
        self._t_ours += time.perf_counter() - t0

    def _nonfinite(self, f: NanFinding, action: str, point: str) -> None:
        self._event("nonfinite", step=self._step + 1, param=f.name, rank=0, nan=f.nan, inf=f.inf,
                    action_taken=action, point=point)

    def _report_nonfinite(self, bad: list[int], counts: dict[int, tuple[int, int]], actions: dict[int, str],
                          bad_modules: list[str], rank: int | None = 0, all_ranks: list[int] | None = None,
                          step: int | None = None) -> None:
        """One event per step naming the first non-finite parameter; a streak is repeated sparsely."""
        step = self._step + 1 if step is None else step
        for m in bad_modules:
            self._event("nonfinite", step=step, param=None, module=m, rank=rank, nan=None, inf=None,
                        action_taken="report", point="module")
        if not bad:
            self._nf_last, self._nf_streak = None, 0
            return
        first = bad[0]
        name = self.params[first]
        if name != self._nf_last or self._nf_streak % NONFINITE_REPEAT == 0:
            nan, inf = counts.get(first, (None, None))
            extra = {"ranks": all_ranks} if all_ranks is not None else {}
            self._event("nonfinite", step=step, param=name, rank=rank, nan=nan, inf=inf,
                        action_taken=actions.get(first, "none"), point="pre_step", **extra,
                        params=[self.params[i] for i in bad[:16]], n_params=len(bad),
                        streak=self._nf_streak + 1)
        self._nf_last = name
        self._nf_streak += 1

    def _boundary(self) -> None:
        """Step N is complete: publish its snapshot, apply pending edits, honour a pause."""
        t0 = time.perf_counter()
        with self._lock:
            self._step += 1
            self._under_way = False
            step, sampled = self._step, self._sampled
            events, self._step_events = self._step_events, []
            rec, self._rec_cur = self._rec_cur, {}
        now = time.perf_counter()
        wall = None if self._last_boundary is None else now - self._last_boundary
        self._cadence.observe(step, sampled, self._t_ours + (now - t0), wall)
        t1 = time.perf_counter()
        self._t_ours = 0.0
        ranks, hold = None, False
        if self._dist is not None and not self._dist.broken:
            ranks, hold = self._dist_exchange(step, sampled, first=True)
            with self._lock:  # events the exchange produced belong to this step
                events, self._step_events = events + self._step_events, []
        snap = None
        if sampled:
            try:
                snap = self._build_snapshot(step, rec, events, ranks)
            except Exception as e:  # never take training down for telemetry
                self._event("hook_error", hook_id=None, param=None, message=f"telemetry failed: {e!r}", step=step)
        self._before_ready = False
        self._pack = None
        self._mod_sq.clear()
        self._mod_bad.clear()
        self._local_sq = [None] * len(self._tensors)
        if snap is not None:
            self._hub.publish("snapshot", snap)
        self._t_ours += time.perf_counter() - t1  # counted with the next step
        if self._dist is not None and not self._dist.broken:
            self._dist_hold(step, hold)
        else:
            with self._cond:
                self._drain_locked(torch_ok=True)
                self._decide_next(step)
                while self._paused and self._credit == 0 and not self._closed:
                    if not self._waiting:
                        self._waiting = True
                        self._cond.notify_all()  # for whoever waits for the pause to take hold
                        self._publish_training()
                    self._drain_locked(torch_ok=True)
                    self._cond.wait()
                if self._credit > 0:
                    self._credit -= 1
                self._waiting = False
        self._last_boundary = time.perf_counter()

    # ----------------------------------------------------------------- torch.distributed
    def _local_hook(self, i: int) -> Callable[[Tensor], None]:
        def hook(param: Tensor) -> None:  # runs on this rank's local gradient, before DDP's all-reduce
            g = param.grad
            if g is not None:
                with torch.no_grad():
                    self._local_sq[i] = dense(g).detach().float().pow(2).sum()  # accumulated in place: last wins
        return hook

    def _dist_exchange(self, step: int, sampled: bool, *, first: bool) -> tuple[dict[str, Any] | None, bool]:
        """The one collective of this boundary (see inspector.distributed). Returns (ranks, hold)."""
        plane = self._dist
        assert plane is not None
        rank0 = plane.rank == 0
        with self._cond:
            hold = rank0 and self._paused and self._credit == 0 and not self._closed
            if rank0 and self._paused and self._credit > 0:
                self._credit -= 1  # a single step: run one more, hold at its boundary
            payload = rank0 and bool(self._reg.pending)
            next_sampled = self._cadence.is_sampled(step + 1)
        with_norms = first and sampled and bool(self._local_handles)
        norms = None
        if with_norms:
            norms = self._local_host if self._local_host is not None else [math.nan] * len(self.params)
        try:
            rows = plane.exchange(hold, payload, next_sampled, self._local_bad if first else -1, norms)
            changes = None
            if bool(rows[0, 1]):
                with self._lock:
                    mine = list(self._reg.pending) if rank0 else None
                changes = plane.broadcast(mine)
        except Exception as e:
            plane.broken = f"{type(e).__name__}: {e}"
            self._event("distributed_error", step=step, rank=plane.rank,
                        message=f"the control collective failed ({plane.broken}); this rank stops coordinating "
                                "hook edits and pauses with the others")
            return None, False
        with self._cond:
            if changes is not None:
                if not rank0:
                    self._reg.adopt(changes)
                self._drain_locked(torch_ok=True)
            self._sampled = bool(rows[0, 2])
            if self._sampled:
                self._sampled_count += 1
        if first:
            bad_ranks = [r for r in range(plane.world) if rows[r, 3] >= 0]
            if self._nf_pending is not None or bad_ranks:
                bad, counts, actions, bad_modules = self._nf_pending or ([], {}, {}, [])
                if not bad and bad_ranks:  # non-finite locally, finite after the all-reduce: still worth a word
                    bad = [int(rows[bad_ranks[0], 3])]
                self._report_nonfinite(bad, counts, actions, bad_modules, rank=bad_ranks[0] if bad_ranks else None,
                                       all_ranks=bad_ranks, step=step)
            self._nf_pending = None
            self._local_bad, self._local_host = -1, None
        ranks = distributed.ControlPlane.spread(rows, 4, len(self.params)) if with_norms else None
        return ranks, bool(rows[0, 0])

    def _dist_hold(self, step: int, hold: bool) -> None:
        """Every rank waits here together while rank 0 is paused (heartbeat exchanges)."""
        plane = self._dist
        assert plane is not None
        while hold and not plane.broken and not self._closed:
            if plane.rank == 0:
                with self._cond:
                    if not self._waiting:
                        self._waiting = True
                        self._cond.notify_all()
                        self._publish_training()
                    self._cond.wait_for(lambda: bool(self._reg.pending) or not self._paused or self._credit > 0
                                        or self._closed, timeout=distributed.HEARTBEAT)
            _, hold = self._dist_exchange(step, False, first=False)
        self._waiting = False

    def _decide_next(self, step: int) -> None:
        self._sampled = self._cadence.is_sampled(step + 1)
        if self._sampled:
            self._sampled_count += 1

    def _hist_due(self) -> bool:
        """Histograms on this sampled step: every ``hist_every`` sampled steps, or soon after a change."""
        if not self.hist_params:
            return False
        due = self._hist_force or (self._sampled_count - 1) % self._hist_every == 0
        self._hist_force = False
        return due

    def _build_snapshot(self, step: int, rec: dict[str, list[Any]], events: list[dict[str, Any]],
                        ranks: dict[str, Any] | None = None) -> Snapshot:
        pack = self._pack or Pack()
        meta = self._pre_meta if self._pack is not None else {}
        n = len(self.params)
        with torch.no_grad():
            pnorm = foreach_norm([p.detach() for p in self._tensors])
            pack.add("param_norm", pnorm)
            if self._before_ready and self._param_buf is not None:
                buf = self._param_buf
                torch._foreach_sub_(buf, [p.detach() for p in self._tensors])  # now before - after, in place
                pack.add("update_norm", foreach_norm(buf))
        eff_ids = []
        for rt in self._runtimes.values():
            if rt.measured:
                pack.add(f"eff:{rt.spec.id}", [torch.as_tensor(x, dtype=torch.float32)
                                                for x in (rt.changed, rt.before_sq, rt.after_sq)])
                eff_ids.append(rt.spec.id)
        mod_keys = sorted(self._mod_sq)
        if mod_keys:
            pack.add("modules", [self._mod_sq[k] for k in mod_keys])
        rec_keys = [k for k, v in rec.items() if isinstance(v[0], Tensor)]
        if rec_keys:
            pack.add("rec", [rec[k][0] for k in rec_keys])
        data = pack.transfer()  # the one host transfer of this snapshot

        def scatter(indices: list[int], values: list[float] | None) -> list[float | None]:
            out: list[float | None] = [None] * n
            for i, v in zip(indices, values or [], strict=False):
                out[i] = v
            return out

        raw_idx = meta.get("raw_idx", [])
        fin_idx = meta.get("fin_idx", [])
        dense_idx = meta.get("dense_idx", [])
        counts = meta.get("counts", {})
        grad_norm_raw = scatter(raw_idx, [self._raw_host[i] for i in raw_idx])
        grad_norm = scatter(fin_idx, data.get("final_norm"))
        std = scatter(dense_idx, data.get("std"))
        std = [None if (v is not None and math.isnan(v) and self._tensors[i].numel() == 1) else v
               for i, v in enumerate(std)]
        nan_count: list[int | None] = [None] * n
        inf_count: list[int | None] = [None] * n
        for i in raw_idx:
            nan_count[i], inf_count[i] = counts.get(i, (0, 0))
        update_ratio: list[float | None] = [None] * n
        if "update_norm" in data:
            # ||delta theta|| / ||theta|| with theta after the update (one pass fewer than before it;
            # the two differ by the update itself, a relative 1e-3 or so)
            for i, (u, b) in enumerate(zip(data["update_norm"], data["param_norm"], strict=True)):
                if i in set(fin_idx) or u != 0:
                    update_ratio[i] = (u / b) if b > 0 else None
        scalars = {}
        loss = None
        for k, (s, c) in rec.items():
            v = data["rec"][rec_keys.index(k)] if k in rec_keys else s
            v = v / c
            if k == "loss":
                loss = v
            else:
                scalars[k] = v
        effects = {}
        for hid in eff_ids:
            changed, bsq, asq = data[f"eff:{hid}"]
            effects[hid] = {"changed": int(changed) if math.isfinite(changed) else changed,
                            "norm_ratio": math.sqrt(asq / bsq) if bsq > 0 and math.isfinite(bsq) else None}
        hist = {}
        for i in meta.get("hist_idx", []):
            h = data[f"hist:{i}"]
            lo, hi = h[0], h[1]
            edges = [lo + (hi - lo) * j / HIST_BINS for j in range(HIST_BINS + 1)]
            hist[self.params[i]] = {"edges": edges, "raw": h[2:2 + HIST_BINS], "final": h[2 + HIST_BINS:]}
        modules: dict[str, dict[str, float]] = {}
        for (name, which), v in zip(mod_keys, data.get("modules", []), strict=False):
            modules.setdefault(name, {})["grad_output_norm" if which == "out" else "grad_input_norm"] = math.sqrt(v)
        lr = []
        if self._optimizer is not None:
            for g in self._optimizer.param_groups:
                try:
                    lr.append(float(g.get("lr", math.nan)))
                except (TypeError, ValueError):
                    lr.append(math.nan)

        def total(vals: list[float | None]) -> float | None:
            xs = [v for v in vals if v is not None]
            return math.sqrt(sum(v * v for v in xs)) if xs else None

        return Snapshot(
            step=step, time=time.time(), config_version=self._reg.version, loss=loss, scalars=scalars, lr=lr,
            grad_norm_raw=grad_norm_raw, grad_norm=grad_norm,
            grad_mean=scatter(dense_idx, data.get("mean")), grad_std=std,
            grad_absmax_raw=scatter(raw_idx, data.get("raw_absmax")),
            grad_absmax=scatter(fin_idx, data.get("final_absmax")),
            nan_count=nan_count, inf_count=inf_count, param_norm=list(data["param_norm"]),
            update_ratio=update_ratio, total_norm_raw=total(grad_norm_raw), total_norm=total(grad_norm),
            hook_effects=effects, hist=hist, modules=modules, ranks=ranks, sampled_every=self._cadence.k,
            overhead=self._cadence.overhead, events=events)

    def _flush_late(self) -> None:
        """Send the records made after step N's boundary (before the next forward) as step N's."""
        with self._lock:
            late, self._rec_late = self._rec_late, {}
            step = self._step
        if not late:
            return
        keys = list(late)
        tens = [late[k][0] for k in keys if isinstance(late[k][0], Tensor)]
        host = torch.stack([t.to(tens[0].device) for t in tens]).tolist() if tens else []
        it = iter(host)
        vals = {k: (next(it) if isinstance(late[k][0], Tensor) else late[k][0]) / late[k][1] for k in keys}
        loss = vals.pop("loss", None)
        with self._hub._lock:
            snap = next((s for s in reversed(self._hub.snapshots) if s.step == step), None)
        if snap is not None:
            from dataclasses import replace
            new = replace(snap, loss=loss if loss is not None else snap.loss, scalars={**snap.scalars, **vals})
            self._hub.replace_snapshot(new)
        self._hub.publish("scalars", jsonsafe({"step": step, "loss": loss, "scalars": vals}))


def attach(model: nn.Module | Mapping[str, Tensor], optimizer: torch.optim.Optimizer | None = None, *,
           scaler: Any = None, budget: float = 0.03, every: int | None = None, hist_every: int = 10,
           per_rank_stats: bool = True, dist_timeout: float = 60.0) -> Inspector:
    """Attach an inspector to ``model`` (an ``nn.Module`` or ``{name: leaf tensor}``).

    Args:
        model: what to watch; wrapper prefixes (DDP's ``module.``, ``torch.compile``'s
            ``_orig_mod.``) are stripped from names.
        optimizer: its ``step()`` is the step boundary. Without one, call ``insp.mark_step()``.
        scaler: a ``torch.amp.GradScaler``: statistics are then of unscaled gradients, skipped
            steps are reported, and modifying ``post_accumulate`` hooks are refused.
        budget: the inspector's own cost as a fraction of the step; the full statistics are
            sampled every k-th step to stay under it (hooks and NaN/Inf checks run every step).
        every: sample every N-th step instead of budgeting (``every=1``: every step).
        hist_every: histograms every this many sampled steps.
        per_rank_stats: under DDP, measure each rank's local (pre-all-reduce) gradient norms with
            a post-accumulate hook on every parameter: the snapshot's ``ranks`` spread, and the
            rank named in NaN/Inf events. Off saves that hook's cost (see bench/ddp_overhead.py).
        dist_timeout: under ``torch.distributed``, seconds a rank waits in the inspector's
            control collective before it gives up coordinating (a peer raised or exited).

    Under ``torch.distributed`` (an initialised process group of 2 or more) call ``attach`` on
    every rank, at the same point: it creates a gloo control group (a collective call).

    Returns:
        The :class:`Inspector`; also a context manager that closes it.
    """
    return Inspector(model, optimizer, scaler=scaler, budget=budget, every=every, hist_every=hist_every,
                     per_rank_stats=per_rank_stats, dist_timeout=dist_timeout)


def _load_server_package() -> Any:
    """The ``server`` package shipped beside ``inspector``, even if ``server`` names another module."""
    here = Path(__file__).resolve().parent.parent / "server"
    existing = sys.modules.get("server")
    if existing is not None and Path(getattr(existing, "__file__", "") or "").resolve().parent == here:
        return existing
    if existing is None:
        spec = importlib.util.find_spec("server")
        if spec is not None and spec.origin and Path(spec.origin).resolve().parent == here:
            return importlib.import_module("server")
    alias = "_gradient_inspector_server"
    if alias in sys.modules:
        return sys.modules[alias]
    spec = importlib.util.spec_from_file_location(alias, here / "__init__.py", submodule_search_locations=[str(here)])
    if spec is None or spec.loader is None:
        raise InspectorError(f"the server package is missing from {here}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[alias] = mod
    spec.loader.exec_module(mod)
    return mod
