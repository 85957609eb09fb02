"""The torch hooks an Inspector registers on parameters and modules, and what they collect.

The applied hook config is resolved to targets in a :class:`Plan` (replaced whole on every
change: an atomic swap that the hooks below read without a lock). :class:`TorchHooks` then
keeps torch's registrations in line with the plan:

- ``param.register_post_accumulate_grad_hook`` on each parameter that an enabled
  ``post_accumulate`` hook targets (the torch hook receives the **parameter**; its gradient
  is ``param.grad``), running those hooks in ``position`` order once per backward, and
  ``param.register_hook`` where gradient accumulation needs it, so that ``scale``, ``l2`` and
  ``noise`` act once per step (:mod:`inspector.hooks.accumulation`); what a
  ``nan_guard`` among them counts (on the device, unread) joins the step's deferred NaN/Inf
  check (:mod:`inspector.stats.deferred`: one report per step, with the streak rule of
  :mod:`inspector.stats.nonfinite`, as at ``pre_step``);
- ``module.register_forward_hook`` on each module that an enabled ``module`` hook targets:
  it registers a tensor hook on the forward's output that adds the squared norm of
  ``grad_output`` to this step's accumulators. This works with in-place ops, where
  ``register_full_backward_hook`` raises in the user's forward;
- for ``module_log(grad_input=True)``, ``module.register_forward_pre_hook``: it registers the
  tensor hooks for ``grad_input`` on the forward's inputs **before** the forward runs, so that
  an in-place module (``ReLU(inplace=True)``, whose output is its input tensor) reports the
  gradient of its real input, not of its output;
- under DDP (``per_rank``), a post-accumulate hook on every parameter that keeps this rank's
  local, pre-all-reduce squared gradient norm. Under FSDP2 a sharded parameter gets none: its
  per-rank norm is that of this rank's shard of the reduced gradient (:mod:`inspector.stats.step_stats`).

Only the training thread calls :meth:`TorchHooks.sync` and :meth:`TorchHooks.remove_all`
(torch hooks are registered and removed there, never from the server's threads). The step
hooks (optimizer step pre/post, root forward pre/post) are
:class:`~inspector.step.lifecycle.StepLifecycle`'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..stats.sharded import Layout, is_dtensor
from ..stats.tensor_stats import dense, sq_norm
from ..wire.records import HookSpec
from .accumulation import Accumulation, Chain, split, supported
from .ops import HookState, ParamTarget, PostFinding
from .owned import OwnedHook, hide_from_copies
from .targets import match

__all__ = ["Plan", "TorchHooks"]

FailCallback = Callable[[HookSpec, "str | None", BaseException], None]


@dataclass(frozen=True)
class Plan:
    """The applied config, resolved to targets. Replaced whole on every change (atomic swap)."""

    pre: tuple[tuple[HookState, tuple[ParamTarget, ...]], ...] = ()
    post: dict[int, tuple[tuple[HookState, ParamTarget], ...]] = field(default_factory=dict)
    module: dict[str, tuple[HookState, ...]] = field(default_factory=dict)
    chains: dict[int, Chain] = field(default_factory=dict)  # post, split for accumulation


def _tensors_in(x: Any) -> Iterator[Tensor]:
    if isinstance(x, Tensor):
        yield x
    elif isinstance(x, list | tuple):
        for v in x:
            yield from _tensors_in(v)
    elif isinstance(x, Mapping):
        for v in x.values():
            yield from _tensors_in(v)


def _wants_input(states: tuple[HookState, ...]) -> bool:
    """Whether a ``module_log`` with ``grad_input`` is among a module's enabled hooks."""
    return any(st.spec.kind == "module_log" and st.spec.params["grad_input"] for st in states)


class TorchHooks:
    """The plan, the per-hook states, and our torch hooks on parameters and modules.

    Args:
        params, tensors: parameter names and tensors, in ``Inspector.params`` order.
        modules: module name -> module (empty for a dict of tensors).
        is_sampled: whether the step under way is sampled (effects are measured then).
        on_failure: ``on_failure(spec, name, err)``, called when a hook raised (it disables it).
        scaler: the GradScaler whose scale module norms are divided by, or None.
        per_rank: keep each parameter's local gradient norm (DDP's per-rank spread).
        layout: the FSDP2 layout of the parameters, or None.
        group_of: each parameter's group index (``Groups.of``), or None (one group): ``zclip``'s
            mode ``group`` keeps statistics per group.
    """

    def __init__(
        self,
        params: list[str],
        tensors: list[Tensor],
        modules: Mapping[str, nn.Module],
        *,
        is_sampled: Callable[[], bool],
        on_failure: FailCallback,
        scaler: Any = None,
        per_rank: bool = False,
        layout: Layout | None = None,
        group_of: Sequence[int] | None = None,
    ) -> None:
        self.params = params
        self.tensors = tensors
        self.modules = modules
        self._is_sampled = is_sampled
        self._on_failure = on_failure
        self._scaler = scaler
        self.layout = layout
        self._per_rank = per_rank
        self._group_of = list(group_of) if group_of is not None else [0] * len(params)
        self.plan = Plan()
        self.states: dict[str, HookState] = {}
        self.dirty = False  # the plan changed since torch's registrations were last synced
        self.spent = 0.0  # seconds inside these hooks since the last take_spent()
        self._post_handles: dict[int, Any] = {}
        self._pre_handles: dict[int, Any] = {}  # pre-accumulation hooks (inspector.hooks.accumulation)
        self.accum = Accumulation()
        self._module_handles: dict[str, Any] = {}
        self._module_in_handles: dict[str, Any] = {}  # forward pre-hooks, for grad_input
        self._local_handles: list[Any] = []
        # collected during the step's backward, cleared by end_step()
        self.mod_sq: dict[tuple[str, str], Tensor] = {}  # (module, "out" | "in") -> squared norm
        self.mod_expected: set[tuple[str, str]] = set()  # the gradients hooked this step (module, which)
        self.mod_bad: dict[str, Tensor] = {}  # module -> its grad_output was not finite (bool tensor)
        self.local_sq: list[Tensor | None] = [None] * len(tensors)  # this rank's pre-all-reduce squared norms
        # param index -> [nan, inf] of the last backward in which a post_accumulate nan_guard found
        # any (device, unread), and "zero" if a zeroing guard watches it (else "report"), until taken
        self.post_found: dict[int, tuple[Tensor, str]] = {}
        # parameters frozen (requires_grad False) where a hook of ours would be registered on them:
        # watched at each step, so one unfrozen later (gradual unfreezing) gets its hooks then
        self._frozen: list[int] = []
        self._local_frozen: list[int] = []
        if per_rank:
            for i, t in enumerate(tensors):
                if is_dtensor(t):
                    continue
                if t.requires_grad:
                    self._local_handles.append(t.register_post_accumulate_grad_hook(self._local_hook(i)))
                else:
                    self._local_frozen.append(i)

    @property
    def per_rank(self) -> bool:
        return self._per_rank

    # ------------------------------------------------------------ plan
    def rebuild(self, applied: list[HookSpec], fns: Mapping[str, Callable[[str, Tensor], Any]]) -> None:
        """Resolve the applied specs to targets; a hook's state survives when its kind and params do."""
        states: dict[str, HookState] = {}
        pre: list[tuple[HookState, tuple[ParamTarget, ...]]] = []
        post: dict[int, list[tuple[HookState, ParamTarget]]] = {}
        module: dict[str, list[HookState]] = {}
        frozen: set[int] = set()
        index = {n: i for i, n in enumerate(self.params)}
        for s in applied:
            st = self.states.get(s.id)
            if st is None or st.spec.kind != s.kind or st.spec.params != s.params:
                old, st = st, HookState(s, fn=fns.get(s.id), groups=max(self._group_of, default=0) + 1)
                if old is not None and old.spec.kind == s.kind:
                    st.zclip = old.zclip  # zclip's statistics survive an edit (kept if they still fit)
            st.spec = s
            states[s.id] = st
            if not s.enabled:
                continue
            if s.point == "module":
                for name in match(list(self.modules), s.target):
                    module.setdefault(name, []).append(st)
                continue
            lay = self.layout
            targets = tuple(
                ParamTarget(
                    index[n],
                    n,
                    self.tensors[index[n]],
                    lay,
                    lay is not None and lay.sharded[index[n]],
                    self._group_of[index[n]],
                )
                for n in match(self.params, s.target)
            )
            if s.point == "pre_step":
                pre.append((st, targets))
            else:
                for t in targets:
                    if t.param.requires_grad:
                        post.setdefault(t.index, []).append((st, t))
                    else:
                        frozen.add(t.index)
        self._frozen = sorted(frozen)
        self.states = states
        exact = self.layout is None and supported()
        self.plan = Plan(
            tuple(pre),
            {i: tuple(v) for i, v in post.items()},
            {n: tuple(v) for n, v in module.items()},
            {i: split(tuple(v), exact) for i, v in post.items()},
        )
        self.dirty = True

    def sync(self) -> None:
        """Register/remove our post-accumulate and module hooks to match the plan (training thread)."""
        plan = self.plan
        for i in set(self._post_handles) - set(plan.post):
            self._post_handles.pop(i).remove()
        for i in set(plan.post) - set(self._post_handles):
            self._post_handles[i] = self.tensors[i].register_post_accumulate_grad_hook(self._post_hook(i))
        want_pre = {i for i, c in plan.chains.items() if c.needs_pre}
        for i in set(self._pre_handles) - want_pre:
            self._pre_handles.pop(i).remove()
        for i in want_pre - set(self._pre_handles):
            self._pre_handles[i] = self.tensors[i].register_hook(self._pre_hook(i))
        for n in set(self._module_handles) - set(plan.module):
            self._module_handles.pop(n).remove()
        for n in set(plan.module) - set(self._module_handles):
            self._module_handles[n] = self.modules[n].register_forward_hook(OwnedHook(self._module_hook(n)))
            hide_from_copies(self.modules[n])
        want_in = {n for n, sts in plan.module.items() if _wants_input(sts)}
        for n in set(self._module_in_handles) - want_in:
            self._module_in_handles.pop(n).remove()
        for n in want_in - set(self._module_in_handles):
            self._module_in_handles[n] = self.modules[n].register_forward_pre_hook(
                OwnedHook(self._module_input_hook(n)), with_kwargs=True
            )
        self.dirty = False

    @property
    def watches_frozen(self) -> bool:
        """Some parameter a hook of ours would be registered on is frozen now."""
        return bool(self._frozen or self._local_frozen)

    def unfrozen(self, applied: list[HookSpec], fns: Mapping[str, Callable[[str, Tensor], Any]]) -> bool:
        """Called at each step's start: when a frozen parameter that a ``post_accumulate`` hook
        targets (or, under DDP, that the per-rank norms watch) requires grad now, its hooks are
        planned and registered (``sync()`` follows; the training thread). True when one was."""
        t = self.tensors
        if not any(t[i].requires_grad for i in self._frozen) and not any(
            t[i].requires_grad for i in self._local_frozen
        ):
            return False
        for i in [i for i in self._local_frozen if t[i].requires_grad]:
            self._local_handles.append(t[i].register_post_accumulate_grad_hook(self._local_hook(i)))
            self._local_frozen.remove(i)
        self.rebuild(applied, fns)
        return True

    def detach(self) -> None:
        """Remove the post-accumulate and module hooks registered here, keeping the plan and the
        hooks' states (their noise streams, their effects): ``sync()`` registers them again."""
        for h in [
            *self._post_handles.values(),
            *self._pre_handles.values(),
            *self._module_handles.values(),
            *self._module_in_handles.values(),
        ]:
            h.remove()
        self._post_handles.clear()
        self._pre_handles.clear()
        self._module_handles.clear()
        self._module_in_handles.clear()
        self.dirty = True

    def remove_all(self) -> None:
        """Remove every torch hook registered here and forget the plan (``close()``)."""
        handles = [*self._post_handles.values(), *self._pre_handles.values(), *self._module_handles.values()]
        for h in [*handles, *self._module_in_handles.values(), *self._local_handles]:
            h.remove()
        self._post_handles.clear()
        self._pre_handles.clear()
        self._module_handles.clear()
        self._module_in_handles.clear()
        self._local_handles.clear()
        self.plan = Plan()
        self.states.clear()
        self.end_step()

    def end_step(self) -> None:
        """Forget what this step's backward collected, hook effects included (at the boundary,
        after the snapshot took them: a hook's effect is that of one step)."""
        if self.mod_sq:
            self.mod_sq.clear()
        if self.mod_expected:
            self.mod_expected.clear()
        if self.mod_bad:
            self.mod_bad.clear()
        if self._per_rank:
            self.local_sq = [None] * len(self.tensors)
        if self.post_found:
            self.post_found.clear()
        self.accum.end_step()
        for st in self.states.values():
            if st.measured:
                st.reset_effects()

    def take_post_findings(self) -> list[tuple[int, Tensor, str]]:
        """What the ``post_accumulate`` ``nan_guard`` hooks counted since the last call, in params
        order: ``(index, [nan, inf] on device, action)`` per guarded parameter, the counts those of
        its last backward with any (zeros: none), the action ``zero`` if a zeroing guard watches it."""
        found, self.post_found = self.post_found, {}
        return [(i, *found[i]) for i in sorted(found)]

    def post_edited(self) -> frozenset[int]:
        """The parameters whose gradient an enabled ``post_accumulate`` hook may change between
        backward passes (every kind but a ``nan_guard`` that only reports)."""
        return frozenset(
            i
            for i, entries in self.plan.post.items()
            if any(
                not (st.spec.kind == "nan_guard" and st.spec.params.get("action") == "report")
                for st, _ in entries
            )
        )

    def take_spent(self) -> float:
        spent, self.spent = self.spent, 0.0
        return spent

    def guarded_modules(self) -> list[str]:
        """Modules whose ``grad_output`` was seen this step and that a ``module`` ``nan_guard`` watches."""
        if not self.mod_bad:
            return []
        return [
            n for n in self.mod_bad if any(st.spec.kind == "nan_guard" for st in self.plan.module.get(n, ()))
        ]

    # ------------------------------------------------------------ the hooks themselves
    def _post_hook(self, i: int) -> Callable[[Tensor], None]:
        def hook(param: Tensor) -> None:  # receives the PARAMETER; its gradient is param.grad
            t0 = time.perf_counter()
            chain = self.plan.chains.get(i)
            if chain is not None:  # the chain in position order, once per step where it must be
                self.accum.run(i, chain, param, self._is_sampled(), self._post_finding, self._post_failed)
            self.spent += time.perf_counter() - t0

        return hook

    def _pre_hook(self, i: int) -> Callable[[Tensor], Tensor | None]:
        """``param.register_hook``: a later backward of the step, before it accumulates (accumulation)."""
        fn = self.accum.pre_hook(i, self.tensors[i], lambda: self.plan.chains.get(i), self._is_sampled)

        def hook(grad: Tensor) -> Tensor | None:
            t0 = time.perf_counter()
            try:
                return fn(grad)
            except Exception as e:  # never take the backward down: the parameter's hooks are disabled
                chain = self.plan.chains.get(i)
                for st, target in chain.entries if chain is not None else ():
                    self._on_failure(st.spec, target.name, e)
                return None
            finally:
                self.spent += time.perf_counter() - t0

        return hook

    def _post_failed(self, st: HookState, target: ParamTarget, err: BaseException) -> None:
        self._on_failure(st.spec, target.name, err)

    def _post_finding(self, i: int, st: HookState, finding: PostFinding) -> None:
        # one report per step, not per backward: the step's deferred check takes these
        prev = self.post_found.get(i)
        action = st.spec.params["action"]
        if prev is None:
            self.post_found[i] = (finding.counts, action)
        else:  # on device: the last backward that found any, else the earlier one
            counts = torch.where(finding.counts.sum() > 0, finding.counts, prev[0])
            self.post_found[i] = (counts, "zero" if "zero" in (prev[1], action) else action)

    def _module_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            t0 = time.perf_counter()
            try:
                sts = self.plan.module.get(name, ())
                guard = any(st.spec.kind == "nan_guard" for st in sts)
                log = self._is_sampled() and any(st.spec.kind == "module_log" for st in sts)
                if torch.is_grad_enabled() and (guard or log):
                    for t in _tensors_in(output):
                        if t.requires_grad:
                            self._hook_gradient(t, name, "out")
            except Exception as e:
                for st in self.plan.module.get(name, ()):
                    self._on_failure(st.spec, name, e)
            self.spent += time.perf_counter() - t0

        return hook

    def _module_input_hook(self, name: str) -> Callable[..., None]:
        # kwargs may be missing: a hook removed during the forward that runs it (the root's own
        # forward pre-hook applies edits, and may remove this one) is still called by torch, from
        # its snapshot of the hooks, but no longer as a with_kwargs hook
        def hook(module: nn.Module, args: Any, kwargs: Any = None) -> None:
            # before the forward: a tensor hook registered now receives the gradient of the input's
            # value as the module read it, even when the module then overwrites it in place
            t0 = time.perf_counter()
            try:
                sts = self.plan.module.get(name, ())
                if torch.is_grad_enabled() and self._is_sampled() and _wants_input(sts):
                    for t in _tensors_in((args, kwargs)):
                        if t.requires_grad:
                            self._hook_gradient(t, name, "in")
            except Exception as e:
                for st in self.plan.module.get(name, ()):
                    self._on_failure(st.spec, name, e)
            self.spent += time.perf_counter() - t0

        return hook

    def _hook_gradient(self, t: Tensor, name: str, which: str) -> None:
        """Hook ``t``'s gradient for module ``name`` (its output, or ``which == "in"`` its input).

        A view (``Flatten``, ``.view()``) modified in place by a later module (``ReLU(inplace=True)``)
        loses the hooks registered on it: autograd rebuilds its history. When the view covers its
        whole base (same number of elements: the gradient's norm is the same), the base is hooked
        too, as a fallback that counts only when the view's own hook did not fire in that backward
        (the base's gradient also holds what other uses of it received). A view of part of its base
        has no such fallback: lost, its norm reads null (the step's ``mod_expected`` says it was
        asked for)."""
        self.mod_expected.add((name, which))
        seen = [False]  # this forward's view hook fired (per backward through it)
        t.register_hook(self._module_grad_hook(name, which, seen, primary=True))
        base = t._base
        if base is not None and base.requires_grad and base.numel() == t.numel():
            base.register_hook(self._module_grad_hook(name, which, seen, primary=False))

    def _module_grad_hook(
        self, name: str, which: str, seen: list[bool], *, primary: bool
    ) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            if primary:
                seen[0] = True
            elif seen[0]:  # the view's own hook fired: the base's gradient is not the module's
                seen[0] = False  # (ready for the next backward through this forward's graph)
                return
            t0 = time.perf_counter()
            try:
                with torch.no_grad():
                    sq = sq_norm(grad.detach())
                    if self._scaler is not None and getattr(self._scaler, "_scale", None) is not None:
                        sq = sq / self._scaler._scale.to(sq.device).float().pow(2)  # report unscaled norms
                    key = (name, which)
                    prev = self.mod_sq.get(key)
                    self.mod_sq[key] = sq if prev is None else prev + sq
                    if which == "out":
                        bad = ~torch.isfinite(sq)
                        prevb = self.mod_bad.get(name)
                        self.mod_bad[name] = bad if prevb is None else prevb | bad
            except Exception as e:
                for st in self.plan.module.get(name, ()):
                    self._on_failure(st.spec, name, e)
            self.spent += time.perf_counter() - t0

        return hook

    def _local_hook(self, i: int) -> Callable[[Tensor], None]:
        def hook(param: Tensor) -> None:  # runs on this rank's local gradient, before DDP's all-reduce
            g = param.grad
            if g is not None:
                with torch.no_grad():
                    self.local_sq[i] = sq_norm(dense(g).detach())  # accumulated in place: last wins

        return hook
