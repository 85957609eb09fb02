"""What each hook kind does to gradients, at ``pre_step`` (batched) and ``post_accumulate``.

``pre_step`` functions receive every target at once and use ``torch._foreach_*`` ops;
``post_accumulate`` functions receive one parameter (the hook's argument is the
**parameter**; its gradient is ``param.grad``) and edit ``param.grad`` in place.

When ``measure`` is set (sampled steps), each application adds to its hook's effect
accumulators: elements changed, and squared norms before and after, as device tensors. They
hold one step: a ``post_accumulate`` hook's effect over that step's backwards is as
:mod:`inspector.hooks.accumulation` says (which also decides which backward runs which hook), a
``pre_step`` hook's is its one application (the last closure evaluation for LBFGS);
:meth:`HookState.reset_effects` clears them.

Sparse gradients (``nn.Embedding(sparse=True)``) are left alone by every kind that edits values
(``clip_value``, ``clip_norm``, ``zclip``, ``scale``, ``l2``, ``noise``, and ``python``: its function
is called for dense gradients only), which go on acting on the dense gradients among their
targets (a ``global`` ``clip_norm`` or ``zclip`` takes its norm over those). Two kinds act on a sparse
gradient as a whole: ``freeze`` sets it to None like any other, and ``nan_guard`` checks its
stored values (``zero`` empties it, ``skip`` drops it with the others), so that a guard on
``*`` guards every parameter.

Under FSDP2 (:mod:`inspector.stats.sharded`) a target's gradient is a DTensor and every kind works on
``grad.to_local()``, this rank's shard: ``clip_value``, ``scale``, ``l2``, ``noise`` and ``freeze``
act on the shards; ``clip_norm`` takes each full tensor's norm from the shards' ``p``-th power sums
(a max for ``inf``) in one collective per application, so ``global`` equals ``clip_grad_norm_``
(``zclip`` takes its norms the same way, so every rank keeps the same statistics);
``nan_guard`` decides from the NaN/Inf counts summed across the mesh (one collective per
application), so every rank zeroes or skips alike. ``noise`` draws a replicated parameter's noise
from the hook's one stream (seeded ``seed``: the same on every rank) and a sharded parameter's from
a stream of this rank's own (seeded ``seed + (rank + 1) * 2**32``), so shards get independent
noise. A ``python`` hook receives the parameter as FSDP2 holds it, a DTensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..stats.sharded import Layout, local
from ..stats.tensor_stats import clamp_abs_, dense, device_constant, foreach_norm, real_dtype, sq_norm
from ..wire.records import HookSpec
from .zclip import ZClipState, state_key, zclip_coefs

__all__ = [
    "GuardResult",
    "HookState",
    "NanFinding",
    "ParamTarget",
    "PostFinding",
    "apply_post_accumulate",
    "apply_pre_step",
    "device_counts",
]


@dataclass(slots=True)
class ParamTarget:
    index: int  # position in Inspector.params
    name: str
    param: Tensor
    layout: Layout | None = None  # FSDP2: the model's layout (every target of such a model has it)
    sharded: bool = False  # FSDP2 shards this parameter: its gradient here is this rank's shard
    group: int = 0  # its group in Inspector.groups (zclip's mode "group")

    def grad(self) -> Tensor | None:
        """The gradient this rank edits: ``param.grad``, or its local shard (a view) under FSDP2."""
        g = self.param.grad
        return g if g is None or self.layout is None else local(g)


@dataclass(slots=True)
class NanFinding:
    index: int
    name: str
    nan: int
    inf: int


@dataclass(slots=True)
class PostFinding:
    """A ``post_accumulate`` ``nan_guard``'s NaN and Inf counts of one backward: a float32 ``[nan,
    inf]`` tensor on the gradient's device, read only by the step's deferred check."""

    index: int
    counts: Tensor


@dataclass(slots=True)
class GuardResult:
    """What a ``pre_step`` ``nan_guard`` found, for the step's deferred NaN/Inf check.

    On the usual path ``counts`` is an ``(len(indices), 2)`` float32 device tensor of NaN and Inf
    counts per target, never read during the step; on the host-read path (``skip``, or a sparse
    gradient among the targets) ``found`` holds the host findings instead."""

    indices: list[int]  # parameter indices of the targets, in ``counts``' row order
    action: str
    counts: Tensor | None = None
    found: list[NanFinding] | None = None
    skip: bool = False  # the step must be skipped (``skip`` found a non-finite gradient)


@dataclass
class HookState:
    """One applied hook's mutable state: its noise generators and this step's effect accumulators
    (reset at every boundary once the snapshot took them, so that a hook disabled or removed
    reports no effect on the steps after)."""

    spec: HookSpec
    fn: Callable[[str, Tensor], Any] | None = None  # the user's callable (kind "python")
    generators: dict[tuple[torch.device, int], torch.Generator] = field(default_factory=dict)
    changed: Tensor | float = 0.0
    before_sq: Tensor | float = 0.0
    after_sq: Tensor | float = 0.0
    measured: bool = False
    # post_accumulate: per target (parameter index), the effect of the application the step's gradient
    # keeps (its last), folded with the sums above by effect() (inspector.hooks.accumulation)
    last: dict[int, tuple[Tensor | float, Tensor | float, Tensor | float]] = field(default_factory=dict)
    # this step's effect values of a kind's own, beside the three above (zclip: threshold, clipped, warmup)
    extra: dict[str, Tensor] = field(default_factory=dict)
    zclip: ZClipState | None = None  # a zclip hook's running statistics (inspector.hooks.zclip)
    groups: int = 1  # how many groups the run has (zclip's mode "group": one slot each)

    def generator(self, device: torch.device, stream: int = 0) -> torch.Generator:
        """The hook's noise stream on ``device``: stream 0 (seeded ``seed``, the same on every rank),
        or under FSDP2 a sharded parameter's stream ``rank + 1`` (seeded ``seed + stream * 2**32``)."""
        key = (device, stream)
        gen = self.generators.get(key)  # type: ignore[call-overload]
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(int(self.spec.params.get("seed", 0)) + stream * 2**32)
            self.generators[key] = gen  # type: ignore[index]
        return gen

    def effect(self) -> tuple[Tensor | float, Tensor | float, Tensor | float]:
        """This step's effect: elements changed, squared norms before and after (sums over targets)."""
        changed, before, after = self.changed, self.before_sq, self.after_sq
        for c, b, a in self.last.values():
            changed, before, after = changed + c, before + b, after + a
        return changed, before, after

    def reset_effects(self) -> None:
        self.changed, self.before_sq, self.after_sq, self.measured = 0.0, 0.0, 0.0, False
        if self.last:
            self.last = {}
        if self.extra:
            self.extra = {}


def _sq(norms: list[Tensor]) -> Tensor:
    return torch.stack([n.to(norms[0].device) for n in norms]).pow(2).sum()


def _count(ts: list[Tensor], pred: Callable[[Tensor], Tensor]) -> Tensor:
    return torch.stack([pred(t).sum().to(ts[0].device).float() for t in ts]).sum()


def _numel(ts: list[Tensor]) -> float:
    return float(sum(t.numel() for t in ts))


def count_nonfinite(g: Tensor) -> tuple[int, int]:
    """NaN and Inf counts of one gradient as host values: two reads, for the rare paths only
    (``nan_guard`` ``skip``, a sparse gradient, a non-finite raw gradient on a sampled step)."""
    return int(torch.isnan(g).sum()), int(torch.isinf(g).sum())


def _clip_norm_coefs(
    grads: list[Tensor],
    max_norm: float,
    norm_type: float,
    mode: str,
    layout: Layout | None = None,
    sharded: list[bool] | None = None,
) -> list[Tensor]:
    """The factor for each gradient, exactly as ``torch.nn.utils.clip_grad_norm_`` computes it:
    the norms in the gradients' own dtype (``torch._foreach_norm`` per device and dtype), their
    norm, and the factor in that dtype, so a float64 (or fp16, bf16) model is clipped as
    ``clip_grad_norm_`` clips it, bit for bit.

    Under FSDP2 (``layout``, ``sharded`` per gradient) ``grads`` are the local shards: each full
    tensor's norm comes from the shards' ``p``-th power sums (a max for ``inf``), one collective,
    in float32."""
    if layout is None or sharded is None or not any(sharded):
        return _native_clip_coefs(grads, max_norm, norm_type, mode)
    norms = list(_full_norms(grads, norm_type, layout, sharded).unbind())
    if mode == "global":
        dev = grads[0].device
        stacked = torch.stack([n.to(dev) for n in norms])
        total = stacked.max() if math.isinf(norm_type) else torch.linalg.vector_norm(stacked, norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        return [coef.to(g.device, real_dtype(g)) for g in grads]
    return [
        torch.clamp(max_norm / (n + 1e-6), max=1.0).to(real_dtype(g))
        for n, g in zip(norms, grads, strict=True)
    ]


def _full_norms(
    grads: list[Tensor], norm_type: float, layout: Layout | None, sharded: list[bool] | None
) -> Tensor:
    """Each gradient's norm (float32, stacked on the first one's device). Under FSDP2 (``layout``,
    ``sharded`` per gradient) ``grads`` are the local shards, and each full tensor's norm comes
    from the shards' ``p``-th power sums (a max for ``inf``): one collective."""
    dev = grads[0].device
    stacked = torch.stack([n.to(dev) for n in foreach_norm(grads, norm_type)])
    if layout is None or sharded is None or not any(sharded):
        return stacked
    if math.isinf(norm_type):
        return layout.combine(stacked, (False,) * len(grads))
    return layout.combine(stacked.pow(norm_type), tuple(sharded)).pow(1.0 / norm_type)


def _zclip(state: HookState, tg: list[ParamTarget], grads: list[Tensor], measure: bool) -> list[Tensor]:
    """``zclip``'s factor for each gradient (:mod:`inspector.hooks.zclip`), its statistics updated
    on the device; when ``measure``, its threshold, clipped count and warm-up left join the effect."""
    p = state.spec.params
    norms = _full_norms(grads, float(p["norm_type"]), tg[0].layout, [t.sharded for t in tg])
    dev = norms.device
    group = p["mode"] == "group"
    slots = state.groups if group else 1
    key = state_key(state.spec.target, p, slots, dev)
    if state.zclip is None or state.zclip.key != key:
        state.zclip = ZClipState.fresh(key, slots, dev)
    slot_of = device_constant(tuple(t.group for t in tg), torch.int64, dev) if group else None
    coef, effect = zclip_coefs(state.zclip, norms, slot_of, slots, p)
    if measure:
        state.extra = effect
    return [c.to(g.device, real_dtype(g)) for c, g in zip(coef.unbind(), grads, strict=True)]


def _native_clip_coefs(grads: list[Tensor], max_norm: float, norm_type: float, mode: str) -> list[Tensor]:
    """``clip_grad_norm_``'s own arithmetic (``_get_total_norm``, ``_clip_grads_with_norm_``)."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, g in enumerate(grads):
        groups.setdefault((g.device, g.dtype), []).append(i)
    norms: list[Tensor] = [torch.empty(0)] * len(grads)
    order: list[int] = []  # clip_grad_norm_ stacks the norms group after group
    for idx in groups.values():
        for i, n in zip(idx, torch._foreach_norm([grads[i] for i in idx], norm_type), strict=True):
            norms[i] = n
        order.extend(idx)
    if mode == "global":
        first = grads[0].device
        total = torch.linalg.vector_norm(torch.stack([norms[i].to(first) for i in order]), norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        return [coef.to(g.device) for g in grads]
    return [torch.clamp(max_norm / (n + 1e-6), max=1.0) for n in norms]


def _strided(g: Tensor | None) -> bool:
    return g is not None and g.layout == torch.strided


def apply_pre_step(state: HookState, targets: list[ParamTarget], measure: bool) -> GuardResult | None:
    """Apply one enabled ``pre_step`` hook to all of its targets that have a gradient it acts on:
    a dense one, or any one for ``freeze`` and ``nan_guard`` (see the module docstring).

    Returns, for ``nan_guard``, what it found (:class:`GuardResult`); ``None`` otherwise.
    """
    spec, p = state.spec, state.spec.params
    kind = spec.kind
    if kind == "freeze":
        grads = [dense(g) for g in (t.grad() for t in targets) if g is not None]
        if measure and grads:
            _add_effect(state, _numel(grads), _sq(foreach_norm(grads)), 0.0)
        for t in targets:
            t.param.grad = None
        return None
    if kind == "nan_guard":
        return _nan_guard_pre_step(state, [t for t in targets if t.param.grad is not None], measure)
    tg = [t for t in targets if _strided(t.param.grad)]
    if not tg:
        return None
    grads: list[Tensor] = [t.grad() for t in tg]  # type: ignore[misc]
    before = foreach_norm(grads) if measure else None
    changed: Tensor | float = 0.0
    with torch.no_grad():
        if kind == "clip_value":
            thr = float(p["threshold"])
            if measure:
                changed = _count(grads, lambda g: g.abs() > thr)
            clamp_abs_(grads, thr)  # complex: each magnitude clamped, the phase kept
        elif kind == "clip_norm":
            coefs = _clip_norm_coefs(
                grads,
                float(p["max_norm"]),
                float(p["norm_type"]),
                p["mode"],
                tg[0].layout,
                [t.sharded for t in tg],
            )
            if measure:
                changed = torch.stack(
                    [
                        (c < 1).float().to(grads[0].device) * g.numel()
                        for c, g in zip(coefs, grads, strict=True)
                    ]
                ).sum()
            torch._foreach_mul_(grads, coefs)
        elif kind == "zclip":
            coefs = _zclip(state, tg, grads, measure)
            if measure:
                changed = torch.stack(
                    [
                        (c < 1).float().to(grads[0].device) * g.numel()
                        for c, g in zip(coefs, grads, strict=True)
                    ]
                ).sum()
            torch._foreach_mul_(grads, coefs)
        elif kind == "scale":
            factor = float(p["factor"])
            if measure and factor != 1.0:
                changed = _count(grads, lambda g: g != 0)
            torch._foreach_mul_(grads, factor)
        elif kind == "l2":
            lam = float(p["lam"])
            ps = [local(t.param.detach()) for t in tg]
            if measure and lam != 0.0:
                changed = _count(ps, lambda x: x != 0)
            torch._foreach_add_(grads, ps, alpha=lam)
        elif kind == "noise":
            std = float(p["std"])
            if std > 0:
                noise = [
                    torch.randn(
                        g.shape,
                        generator=state.generator(g.device, _stream(t)),
                        device=g.device,
                        dtype=g.dtype,
                    )
                    for g, t in zip(grads, tg, strict=True)
                ]
                torch._foreach_add_(grads, noise, alpha=std)
                changed = _numel(grads)
        elif kind == "python":
            assert state.fn is not None
            counts: list[Tensor] = []
            for t, g in zip(tg, grads, strict=True):
                # measured one target at a time: the copy held is at most the largest gradient
                snap = g.clone() if measure else None
                state.fn(t.name, t.param)
                if snap is not None:
                    now = t.grad()
                    counts.append(
                        (snap != now).sum().float()
                        if now is not None
                        else torch.full((), float(snap.numel()), device=snap.device)
                    )
            if counts:
                changed = torch.stack([c.to(counts[0].device) for c in counts]).sum()
    if measure:
        assert before is not None
        after = foreach_norm([dense(g) for g in (t.grad() for t in tg) if g is not None])
        _add_effect(state, changed, _sq(before), _sq(after) if after else 0.0)
    return None


def _stream(t: ParamTarget) -> int:
    """The noise stream of a target: 0, or under FSDP2 this rank's own for a sharded parameter."""
    return t.layout.rank + 1 if t.sharded and t.layout is not None else 0


def device_counts(values: list[Tensor]) -> Tensor:
    """NaN and Inf counts of each tensor, as an ``(len(values), 2)`` float32 tensor on the first
    one's device: two passes per tensor, no host read."""
    dev = values[0].device
    return torch.stack(
        [torch.stack([torch.isnan(v).sum(), torch.isinf(v).sum()]).to(dev) for v in values]
    ).float()


def _nan_guard_pre_step(state: HookState, tg: list[ParamTarget], measure: bool) -> GuardResult | None:
    """``nan_guard`` at ``pre_step`` over every target with a gradient (a sparse one: its stored values).

    ``report`` and ``zero`` work on the device with no host read: NaN/Inf counts per target
    (:func:`device_counts`), ``zero`` as ``masked_fill_`` by each gradient's own flag, the counts
    handed to the step's deferred check. ``skip`` must decide before the optimizer runs, so it
    reads its targets' norms once per step (a sync on CUDA, paid only while a ``skip`` guard is
    enabled); so does a guard with a sparse gradient among its targets (sparse ``zero`` empties it).
    Under FSDP2 the counts are of the full gradients (one collective), so every rank acts alike.
    """
    if not tg:
        return None
    action = state.spec.params["action"]
    grads = [t.grad() for t in tg]
    values = [dense(g) for g in grads]  # type: ignore[arg-type]
    indices = [t.index for t in tg]
    lay = tg[0].layout
    sharded = lay is not None and any(t.sharded for t in tg)
    if action == "skip" or any(g.layout != torch.strided for g in grads):  # type: ignore[union-attr]
        return _nan_guard_read(state, tg, grads, values, measure)
    before = foreach_norm(values) if measure else None
    counts = device_counts(values)
    if sharded:
        counts = _full_counts(tg, counts.reshape(-1)).reshape(-1, 2)
    bad = counts.sum(1) > 0
    changed: Tensor | float = 0.0
    if action == "zero":
        with torch.no_grad():
            for g, b in zip(values, bad.unbind(), strict=True):
                g.masked_fill_(b.to(g.device), 0)
        if measure:  # (no torch.tensor(list, device=...): a host-to-device copy syncs on CUDA)
            changed = torch.stack(
                [b.float() * v.numel() for b, v in zip(bad.unbind(), values, strict=True)]
            ).sum()
    if measure:
        assert before is not None
        after = foreach_norm(values)
        _add_effect(state, changed, _sq(before), _sq(after))
    return GuardResult(indices, action, counts=counts)


def _full_counts(tg: list[ParamTarget], flat: Tensor) -> Tensor:
    """FSDP2: ``[nan, inf]`` per target (flattened) summed across the mesh for sharded targets, so
    every rank decides alike (one collective)."""
    lay = tg[0].layout
    assert lay is not None
    return lay.combine(flat, tuple(t.sharded for t in tg for _ in (0, 1)))


def _nan_guard_read(
    state: HookState, tg: list[ParamTarget], grads: list[Any], values: list[Tensor], measure: bool
) -> GuardResult:
    """The host-read path of :func:`_nan_guard_pre_step`: one read of the targets' norms."""
    norms = foreach_norm(values)
    host = torch.stack([n.to(values[0].device) for n in norms]).tolist()  # the guard's one read per step
    found = [(i, count_nonfinite(values[i])) for i, v in enumerate(host) if not math.isfinite(v)]
    lay = tg[0].layout
    if lay is not None and any(t.sharded for t in tg):
        # FSDP2: the counts of the full gradients, so that every rank decides alike (one collective)
        mine = torch.zeros(2 * len(tg), device=values[0].device)
        for i, (nan, inf) in found:
            mine[2 * i], mine[2 * i + 1] = float(nan), float(inf)
        total = _full_counts(tg, mine).tolist()
        found = [(i, (int(total[2 * i]), int(total[2 * i + 1]))) for i in range(len(tg))]
    found = [(i, c) for i, c in found if c != (0, 0)]  # (0, 0): finite values, an overflowed norm
    action = state.spec.params["action"]
    changed: Tensor | float = 0.0
    if found and action == "zero":
        changed = float(sum(values[i].numel() for i, _ in found))
        with torch.no_grad():
            for i, _ in found:
                grads[i].zero_()  # a sparse gradient: emptied
    if measure:
        after = foreach_norm([dense(g) for g in (t.grad() for t in tg) if g is not None])
        _add_effect(state, changed, _sq(norms), _sq(after) if after else 0.0)
    return GuardResult(
        [t.index for t in tg],
        action,
        found=[NanFinding(tg[i].index, tg[i].name, *c) for i, c in found],
        skip=bool(found) and action == "skip",
    )


def apply_post_accumulate(
    state: HookState, t: ParamTarget, measure: bool, effect: str = "sum"
) -> PostFinding | None:
    """Apply one enabled ``post_accumulate`` hook to ``t.param.grad`` in place (one backward).

    A sparse gradient is left alone, except by ``nan_guard`` (see the module docstring), which
    returns its NaN/Inf counts of this backward (on device, unread: see :class:`PostFinding`).

    ``effect`` says how a measured application joins the step's effect
    (:mod:`inspector.hooks.accumulation` chooses): ``"sum"`` adds it to the sums; ``"last"``
    replaces this target's earlier one of the step; ``"last_norms"`` replaces its norms and adds
    its changed elements to the target's earlier ones.
    """
    g = t.grad()  # under FSDP2 this rank's shard, after FSDP's reduce-scatter
    spec, p = state.spec, state.spec.params
    if g is None or (g.layout != torch.strided and spec.kind != "nan_guard"):
        return None
    before = sq_norm(dense(g)) if measure else None
    changed: Tensor | float = 0.0
    finding = None
    with torch.no_grad():
        if spec.kind == "clip_value":
            thr = float(p["threshold"])
            if measure:
                changed = (g.abs() > thr).sum().float()
            clamp_abs_([g], thr)
        elif spec.kind == "clip_norm":  # per_tensor only (validated)
            (coef,) = _clip_norm_coefs([g], float(p["max_norm"]), float(p["norm_type"]), "per_tensor")
            if measure:
                changed = (coef < 1).float() * g.numel()
            g.mul_(coef)
        elif spec.kind == "scale":
            if measure:
                changed = (g != 0).sum().float()
            g.mul_(float(p["factor"]))
        elif spec.kind == "l2":
            w = local(t.param.detach())
            if measure:
                changed = (w != 0).sum().float()
            g.add_(w, alpha=float(p["lam"]))
        elif spec.kind == "noise":
            std = float(p["std"])
            if std > 0:
                g.add_(
                    torch.randn(
                        g.shape,
                        generator=state.generator(g.device, _stream(t)),
                        device=g.device,
                        dtype=g.dtype,
                    ),
                    alpha=std,
                )
                changed = float(g.numel())
        elif spec.kind == "nan_guard":
            values = dense(g)  # a sparse gradient: its stored values
            if g.layout != torch.strided:  # sparse: a host read (rare; ``zero`` empties it)
                nan, inf = count_nonfinite(values)
                if nan or inf:
                    finding = PostFinding(t.index, torch.tensor([float(nan), float(inf)]))
                    if p["action"] == "zero":
                        changed = float(values.numel())
                        g.zero_()
            else:  # on the device, no host read: the counts join the step's deferred check
                counts = device_counts([values])[0]
                finding = PostFinding(t.index, counts)
                if p["action"] == "zero":
                    bad = counts.sum() > 0
                    g.masked_fill_(bad, 0)
                    if measure:
                        changed = bad.float() * values.numel()
        elif spec.kind == "python":
            assert state.fn is not None
            snap = g.clone() if measure else None
            state.fn(t.name, t.param)
            now = t.grad()
            g = now if now is not None else g
            if snap is not None:
                changed = (snap != g).sum().float()
    if measure:
        assert before is not None
        after = sq_norm(dense(g))
        if effect == "sum":
            _add_effect(state, changed, before, after)
        else:
            prev = state.last.get(t.index)
            if effect == "last_norms" and prev is not None:
                changed = prev[0] + changed
            state.last[t.index] = (changed, before, after)
            state.measured = True
    return finding


def _add_effect(
    state: HookState, changed: Tensor | float, before_sq: Tensor | float, after_sq: Tensor | float
) -> None:
    state.changed = state.changed + changed
    state.before_sq = state.before_sq + before_sq
    state.after_sq = state.after_sq + after_sq
    state.measured = True
