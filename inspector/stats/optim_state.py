"""The optimizer's state and the geometry of its update, measured on sampled steps (``Snapshot.optim``).

Per parameter tensor, per group (:class:`~inspector.stats.groups.Groups`) and for the whole model:

- for the Adam family (every parameter whose optimizer state holds ``exp_avg`` and ``exp_avg_sq``,
  with ``eps`` and ``betas`` in its param group: Adam, AdamW, plain, foreach or fused), read
  **after** the optimizer's step, so for the state that step produced: ``exp_avg_norm``
  (``||m||``), ``exp_avg_sq_sqrt_norm`` (``||sqrt(v)||``, the square root of ``sum(v)``) and
  ``below_eps_frac``, the share of elements whose bias-corrected second moment is below ``eps**2``
  (``v / (1 - beta2**t) < eps**2``: where ``eps``, not the gradient, sets the step size; ``t`` the
  state's ``step``);
- for every optimizer: ``step_ratio``, the effective step ``||delta theta|| / ||g||``;
  ``cos_update_grad``, the cosine of the update and the descent direction, ``cos(delta theta,
  -g)`` (a plain SGD step gives +1); and ``cos_grad_prev``, the cosine of this step's gradient and
  the previous **sampled** step's (``cos_prev_gap`` steps apart), for a tensor that had a gradient
  on both (one whose gradient was missing on the previous sampled step has none; a group's and
  the model's come from the tensors that have both). ``g`` is the final gradient the step saw
  (after every ``pre_step`` hook); where a closure is evaluated several times a step (LBFGS), the
  first evaluation's, for the effective step and both cosines alike. A ``mark_step()`` loop
  updates after its boundary: it has ``cos_grad_prev`` only, as it has no update ratio.

Where it is measured. ``delta theta`` is what :class:`~inspector.stats.update_ratio.UpdateProbe`
already keeps for the update ratio (no second copy of the parameters): its buffers hold
``before - after`` of each parameter's sample (the whole parameter when the model fits its
budget, else every ``s``-th block). The gradient is sampled at the same positions, so the cosines
are taken on that sample (exact when kept whole), and the update norm is the probe's estimate.
For ``cos_grad_prev`` the gradient's sample is copied into a buffer of the same size at the sampled
step, before the update: at most as many bytes again as the update ratio's sample (docs/instruments.md,
Telemetry: memory). Many small CPU tensors (:class:`~inspector.stats.tensor_stats.FlatPlan`) take flat
passes instead: the gradients' samples and dot products where the update ratio keeps them whole,
and the Adam state wherever their float64 copies take at most ``FLAT_BYTES`` (larger tensors of
one shape in stacks along with them). Elsewhere on the CPU, the gradients' samples of parameters
of one shape, dtype and stride are taken a stack at a time
(:func:`~inspector.stats.update_ratio.stacked_samples`), their previous samples the rows of one
buffer: norms and dot products along the rows, not a few ops a tensor.

Every value is a device tensor stacked into the snapshot's one transfer (:class:`Pack`); nothing
is read on the host before it, and nothing runs on an unsampled step. The group values are made on
the host from the transferred per-tensor sums: a group's norm is the root of its members' sums of
squares, its share of elements below ``eps**2`` the summed counts over the summed sizes, and its
cosines come from the summed dot products and squared norms (each sampled tensor's weighted by its
sampling factor, so that the group's cosine is that of the concatenated tensors, estimated).

Under FSDP2 everything is measured on each rank's shards and combined in the snapshot's one
collective (:meth:`OptimProbe.sharded_columns`): ``exp_avg_norm``, ``exp_avg_sq_sqrt_norm`` and
``below_eps_frac`` of the full tensors, ``step_ratio`` from the combined update and gradient
norms, and the cosines from the shards' dot products and squared norms, summed (each rank's
sampled sums scaled to its whole shard first, so that a sum over ranks estimates the full
tensor's; exact where the shards are kept whole). The previous gradient's sample is of this
rank's shard.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .groups import Groups
from .sharded import local
from .telemetry import Pack
from .tensor_stats import FlatPlan, device_constant, foreach_norm, row_norms
from .update_ratio import BLOCK, sample_view, stack_groups, stacked_samples, strides

__all__ = ["ADAM_KEYS", "GEO_KEYS", "OptimProbe"]

ADAM_KEYS = ("exp_avg_norm", "exp_avg_sq_sqrt_norm", "below_eps_frac")
GEO_KEYS = ("step_ratio", "cos_update_grad", "cos_grad_prev")
_LOW = (torch.float16, torch.bfloat16)
CHUNK = 1 << 22  # elements compared at a time for the share below eps**2 (4 MiB of scratch)
FLAT_BYTES = 1 << 21  # the most the Adam state's flat copies of the small tensors may take (float64)


def _dot(a: Tensor, b: Tensor) -> Tensor:
    """The dot product of two tensors of one shape, summed in float32 at least (a device scalar).
    Complex tensors are taken as real vectors of twice the length: ``Re(sum(a * conj(b)))``."""
    if a.is_complex() or b.is_complex():
        return (a * b.conj()).real.sum()
    if a.dtype in _LOW or b.dtype in _LOW:
        a, b = a.float(), b.float()
    if a.dtype == b.dtype and a.is_contiguous() and b.is_contiguous():
        return torch.dot(a.view(-1), b.view(-1))  # (one op, no temporary)
    return (a * b).sum()


def _count_below(v: Tensor, threshold: Tensor | float) -> Tensor:
    """How many elements of ``v`` are below ``threshold`` (a device scalar), a chunk of at most
    ``CHUNK`` elements at a time: the comparison's boolean scratch stays within ``CHUNK`` bytes
    (a whole 7B-parameter model's ``v`` would need 7 GB of it at once). A float16/bfloat16 state
    is compared in float32: ``eps**2`` (1e-16 and below) rounds to 0 in float16, where nothing
    would ever be below it."""
    if v.numel() <= CHUNK:
        return torch.count_nonzero(_wide(v) < threshold)  # (a bool sum: 2.5x as long on a CPU)
    flat = v.reshape(-1)  # (a view: the state is contiguous)
    return torch.stack([torch.count_nonzero(_wide(c) < threshold) for c in flat.split(CHUNK)]).sum()


def _wide(v: Tensor) -> Tensor:
    return v.float() if v.dtype in _LOW else v


_BATCHED = (torch.float32, torch.float64)


def _batches(idx: list[int], numel: list[int]) -> list[list[int]]:
    """``idx`` cut into runs of at most ``CHUNK`` elements in all (the batched ops' scratch)."""
    out: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i in idx:
        if cur and size + numel[i] > CHUNK:
            out.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += numel[i]
    if cur:
        out.append(cur)
    return out


def dots(a: list[Tensor], b: list[Tensor]) -> list[Tensor]:
    """``_dot`` of each pair, as 0-dim device tensors; batched where it can be. Pairs of one shape,
    one real float32/float64 dtype and one device, each of at most ``CHUNK`` elements, are stacked
    into two ``[k, numel]`` tensors a batch of at most ``CHUNK`` elements and reduced with one
    ``torch.linalg.vecdot`` (three ops a batch, not a few a tensor: at a thousand tensors about
    1 ms against about 30 on a CPU, more on a GPU, where each op is a launch; the stacks are
    the batch's scratch). The rest (a low-precision or complex pair, a large tensor) take ``_dot``
    one at a time."""
    out: list[Tensor | None] = [None] * len(a)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if (
            x.dtype in _BATCHED
            and x.dtype == y.dtype
            and x.shape == y.shape
            and x.device == y.device
            and x.numel() <= CHUNK
        ):
            groups.setdefault((x.device, x.dtype, x.shape), []).append(i)
        else:
            out[i] = _dot(x, y)
    numel = [x.numel() for x in a]
    for idx in groups.values():
        for batch in _batches(idx, numel):
            if len(batch) == 1:
                out[batch[0]] = _dot(a[batch[0]], b[batch[0]])
                continue
            k = len(batch)
            xs = torch.stack([a[i] for i in batch]).view(k, -1)
            ys = torch.stack([b[i] for i in batch]).view(k, -1)
            for i, d in zip(batch, torch.linalg.vecdot(xs, ys).unbind(), strict=True):
                out[i] = d
    return out  # type: ignore[return-value]


def counts_below(vs: list[Tensor], thresholds: list[Tensor | float]) -> list[Tensor]:
    """``_count_below`` of each pair, as 0-dim device tensors; batched where the threshold is a
    Python number and the tensors share a shape, a device and a dtype: stacked, a batch of at most
    ``CHUNK`` elements, compared and counted per row (three ops a batch). The rest one at a time."""
    out: list[Tensor | None] = [None] * len(vs)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, (v, t) in enumerate(zip(vs, thresholds, strict=True)):
        if isinstance(t, float) and v.numel() <= CHUNK and not v.is_complex():
            groups.setdefault((v.device, v.dtype, v.shape, t), []).append(i)
        else:
            out[i] = _count_below(v, t)
    numel = [v.numel() for v in vs]
    for key, idx in groups.items():
        t = key[-1]
        for batch in _batches(idx, numel):
            if len(batch) == 1:
                out[batch[0]] = _count_below(vs[batch[0]], t)
                continue
            stacked = _wide(torch.stack([vs[i] for i in batch]).view(len(batch), -1))
            for i, c in zip(batch, torch.count_nonzero(stacked < t, dim=1).unbind(), strict=True):
                out[i] = c
    return out  # type: ignore[return-value]


def _cos(dot: float, a_sq: float, b_sq: float) -> float | None:
    if not (a_sq > 0 and b_sq > 0) or not all(map(math.isfinite, (dot, a_sq, b_sq))):
        return None
    return max(-1.0, min(1.0, dot / math.sqrt(a_sq * b_sq)))


def _thresholds(steps: list[Any], consts: list[tuple[Any, Any]]) -> Tensor | list[Tensor | float]:
    """Per tensor ``(1 - beta2**t) * eps**2`` (its state's step ``t``, its group's ``beta2`` and
    ``eps``): where the bias-corrected second moment is below ``eps**2``; nothing is read from a
    tensor, and no tensor is made from host data (on a GPU each would wait for the device). Where
    every tensor's group has the same ``beta2`` and ``eps`` (Python numbers) and every step is a
    0-dim tensor on one device (Adam's, the usual case): one tensor over all, from the stacked
    steps (one op, in float64). Else one value per tensor (a tensor where its step is one)."""
    first = consts[0]
    if (
        all(isinstance(x, (int, float)) for x in first)
        and all(c == first for c in consts)
        and all(isinstance(t, Tensor) and t.dim() == 0 for t in steps)
        and len({t.device for t in steps}) == 1
    ):
        beta2, eps = (float(x) for x in first)
        return (1 - beta2 ** torch.stack(steps).double()) * (eps * eps)
    out: list[Tensor | float] = []
    for t, (beta2, eps) in zip(steps, consts, strict=True):
        eps = float(eps) if not isinstance(eps, Tensor) else eps
        out.append((1 - beta2**t) * (eps * eps))
    return out


def _root(x: float, any_: bool) -> float | None:
    return math.sqrt(x) if any_ else None


class OptimProbe:
    """``Snapshot.optim``: :meth:`before_update` at the sampled step's final statistics,
    :meth:`add` just before the snapshot's transfer, :meth:`read` from it (module docstring)."""

    def __init__(self, tensors: list[Tensor], groups: Groups, optimizer: Any = None) -> None:
        self.tensors = tensors
        self.groups = groups
        self.optimizer = optimizer
        self.n = len(tensors)
        self._strides: list[int] = []
        self._shape_key: list[Any] = []
        self._geometry: list[tuple[int, int]] = []  # per parameter: (kept rows, block) of its sample
        # the previous sampled gradient's sample: per tensor (list path) or one flat buffer (FlatPlan)
        self._prev: list[Tensor | None] = [None] * self.n
        self._prev_flat: Tensor | None = None
        # the sampled step each buffer's gradient is of (its serial number: sampled steps read so far)
        self._prev_at: list[int | None] = [None] * self.n
        self._prev_sq: list[float | None] = [None] * self.n  # its sample's squared norm, from its transfer
        self._serial = 0  # the sampled steps whose gradients were sampled, read or not
        self._last_step: int | None = None  # the previous sampled step (None: none, or not read)
        # the list path's stacks: (their indices, the buffer whose rows are their previous samples)
        self._stacks: list[tuple[list[int], Tensor]] = []
        self._stacks_of: list[int] | None = None  # the strides they were made for
        self._scratch: dict[torch.dtype, Tensor] = {}  # (stacked_samples')
        self._clear()

    def _clear(self) -> None:
        self._taken = False  # before_update ran this step
        self._read = False  # read() took this step's values
        self._idx: list[int] = []  # tensors whose gradient was sampled this step
        self._gflat: Tensor | None = None  # the gradients, flat (FlatPlan path; all n)
        self._plan: FlatPlan | None = None
        self._gnorm: list[Tensor] | Tensor = []  # the samples' norms (over _idx, or all n when flat)
        self._pidx: list[int] = []  # tensors with a previous sample to compare with
        self._pdot: list[Tensor] | Tensor = []  # their dot products with it (or all n when flat)
        self._gap_of: dict[int, int | None] = {}  # tensor -> the step its previous sample was of
        self._scale: list[float] = [1.0] * self.n
        self._names: list[str] = []  # the pack's segments added this step
        self._adam: tuple[list[int], list[int]] | None = None  # (tensors, their numel) with Adam state
        self._didx: list[int] = []  # tensors with a dot product of update and gradient
        # the first evaluation's final gradient norms (tensor indices, a vector): a closure
        # evaluated again (LBFGS) replaces the snapshot's, and the step is measured against these
        self._gfirst: tuple[list[int], Tensor] | None = None
        self._again = False  # the closure was evaluated again this step

    @property
    def resident_bytes(self) -> int:
        """Device memory held from one sampled step to the next (the previous gradient's sample)."""
        bufs = [b for b in self._prev if b is not None]
        if self._prev_flat is not None:
            bufs.append(self._prev_flat)
        return sum(b.numel() * b.element_size() for b in bufs)

    def _strides_for(self, ps: list[Tensor], kept: list[int] | None) -> list[int]:
        """The update ratio's strides for these parameters (``kept``: the ones its probe took this
        step; else the same function of the same inputs), and each sampled one's ``(kept rows,
        block)``, so that a contiguous gradient's sample is one ``as_strided`` view
        (:func:`sample_view`'s positions: every ``s``-th block of ``block``)."""
        if kept is not None and len(kept) == len(ps):
            if kept is self._strides:  # (the probe's list: the same object while nothing changed)
                return kept
            self._shape_key, self._strides = [], kept
        else:
            key = [(p.shape, p.element_size()) for p in ps]
            if key == self._shape_key:
                return self._strides
            self._shape_key = key
            self._strides = strides([p.shape for p in ps], [p.element_size() for p in ps])
        self._geometry = []
        for p, st in zip(ps, self._strides, strict=True):
            n = p.numel()
            b = max(1, min(BLOCK, n))
            self._geometry.append((math.ceil((n // b) / st), b))
        return self._strides

    def _view(self, g: Tensor, i: int, s: int) -> Tensor:
        """The sample of gradient ``g`` of parameter ``i`` at stride ``s`` (as :func:`sample_view`)."""
        if not g.is_contiguous():
            return sample_view(g, s)
        if s == 1:
            return g.view(-1)
        rows, b = self._geometry[i]
        return g.as_strided((rows, b), (s * b, 1), g.storage_offset())

    # ------------------------------------------------------------------ before the update
    def before_update(
        self,
        fgrads: dict[int, Tensor],
        params: list[Tensor],
        plan: FlatPlan | None,
        kept: list[int] | None = None,
        norms: tuple[list[int], Tensor | None] | None = None,
    ) -> None:
        """At the sampled step's final statistics (after the ``pre_step`` hooks, before the update):
        sample the final gradients, take their dot products with the previous sampled step's sample,
        and keep this step's sample in its place. ``params``: the parameters, detached; ``plan``: the
        flat plan where the update ratio keeps the parameters whole in one flat copy (else None);
        ``kept``: the strides the update ratio's probe sampled the parameters with this step;
        ``norms``: the final gradients' norms (their tensor indices, one vector).

        A closure evaluated again (LBFGS) changes nothing here: the step is measured against the
        first evaluation's gradient, the one at the point it starts from (its norms are sent with
        the snapshot then, as the snapshot's own are the last evaluation's)."""
        if self._taken:
            self._again = True
            return
        self._taken = True
        if norms is not None and norms[1] is not None:
            self._gfirst = (norms[0], norms[1])
        with torch.no_grad():
            if plan is not None and self._flat_before(fgrads, params, plan):
                return
            self._list_before(fgrads, params, kept)

    def _flat_before(self, fgrads: dict[int, Tensor], params: list[Tensor], plan: FlatPlan) -> bool:
        gs = [
            g if (g := fgrads.get(i)) is not None and g.shape == p.shape else torch.zeros_like(p)
            for i, p in enumerate(params)
        ]
        if plan.large or not plan.fits(gs):
            return False
        self._plan = plan
        self._idx = [
            i for i, p in enumerate(params) if (g := fgrads.get(i)) is not None and g.shape == p.shape
        ]
        gflat = plan.flat(gs)  # (a new buffer: kept as the next step's previous sample)
        self._gflat = gflat
        self._gnorm = plan.norms_of_flat(gflat, [])
        prev = self._prev_flat
        if prev is not None and prev.shape == gflat.shape and prev.dtype == gflat.dtype:
            self._pidx = [i for i in self._idx if self._prev_at[i] is not None]
            self._pdot = plan.sums_of_flat(prev * gflat)
        self._prev_flat = gflat
        self._prev = [None] * self.n
        self._stacks, self._stacks_of = [], None
        return True

    def _groups_for(self, params: list[Tensor], st: list[int]) -> list[tuple[list[int], Tensor]]:
        """The stacks (:func:`stack_groups`) of these parameters at these strides, each with the
        buffer whose rows are its members' previous samples (``self._prev[i]``); made again when
        the strides were (a parameter replaced, a model cast), and then their members have no
        previous sample to compare with."""
        if self._stacks_of is not st:
            self._stacks = []
            for idx in stack_groups(params, st):
                shape = sample_view(params[idx[0]], st[idx[0]]).shape
                whole = torch.empty((len(idx), *shape), dtype=params[idx[0]].dtype)
                for row, i in enumerate(idx):
                    self._prev[i] = whole[row]
                    self._prev_at[i] = None
                self._stacks.append((idx, whole))
            self._stacks_of = st
        return self._stacks

    def _stacked_before(
        self, fgrads: dict[int, Tensor], params: list[Tensor], st: list[int]
    ) -> tuple[list[int], list[Tensor], list[Tensor]]:
        """The stacks whose every member has a dense CPU gradient of its parameter's shape and
        dtype: their samples' norms and dot products with the previous samples (``(indices,
        norms, dots)``, one 0-dim tensor each), taken a part at a time, each part's samples then
        copied over the previous ones (:func:`stacked_samples`)."""
        idx_all: list[int] = []
        norms: list[Tensor] = []
        pdots: list[Tensor] = []
        for idx, whole in self._groups_for(params, st):
            gs = [fgrads.get(i) for i in idx]
            if not all(
                g is not None
                and g.layout == torch.strided
                and g.is_cpu
                and g.dtype == whole.dtype
                and g.shape == params[i].shape
                for g, i in zip(gs, idx, strict=True)
            ):
                continue
            for a, x in stacked_samples([g.detach() for g in gs], st[idx[0]], self._scratch):  # type: ignore[union-attr]
                k = x.shape[0]
                rows = x.reshape(k, -1)  # (a copy where sampled: one part's)
                prev = whole[a : a + k].view(k, -1)
                norms.extend(row_norms(rows).unbind())
                if rows.dtype in _LOW:  # (multiplied in float32, as _dot does)
                    rows, prev = rows.float(), prev.float()
                pdots.extend(torch.linalg.vecdot(prev, rows).unbind())
                whole[a : a + k] = x  # (host to host: this step's samples are the next one's previous)
            idx_all.extend(idx)
        return idx_all, norms, pdots

    def _list_before(self, fgrads: dict[int, Tensor], params: list[Tensor], kept: list[int] | None) -> None:
        self._prev_flat = None
        st = self._strides_for(params, kept)
        sidx, snorms, sdots = self._stacked_before(fgrads, params, st)
        stacked = set(sidx)
        idx, views = [], []
        for i in sorted(fgrads):
            g, p = fgrads[i], params[i]
            if i in stacked or g.layout != torch.strided or g.shape != p.shape or g.device != p.device:
                continue
            idx.append(i)
            views.append(self._view(g.detach(), i, st[i]))
        self._idx = sidx + idx
        self._gnorm = snorms + foreach_norm(views)
        pidx, pa, pb = [], [], []
        for i, v in zip(idx, views, strict=True):
            b = self._prev[i]
            if b is not None and b.shape == v.shape and b.dtype == v.dtype and b.device == v.device:
                pidx.append(i)
                pa.append(b)
                pb.append(v)
        # (a stacked sample's previous one is a row of its stack's buffer: there from the start,
        # compared only where _prev_at says which step it is of)
        self._pidx, self._pdot = sidx + pidx, sdots + dots(pa, pb)
        for i, v in zip(idx, views, strict=True):
            b = self._prev[i]
            if b is None or b.shape != v.shape or b.dtype != v.dtype or b.device != v.device:
                self._prev[i] = torch.empty_like(v, memory_format=torch.contiguous_format)
        if idx:
            torch._foreach_copy_([self._prev[i] for i in idx], views)  # type: ignore[misc]

    # ------------------------------------------------------------------ after the update
    def add(
        self,
        pack: Pack,
        differences: tuple[list[Tensor], list[int], list[float]] | None,
        flat_difference: Tensor | None,
        plan: FlatPlan | None = None,
    ) -> None:
        """Before the snapshot's transfer: the update's dot products with the gradients (from the
        update ratio's ``before - after``: its per-tensor buffers, or the flat copy's) and the Adam
        state, as segments of ``pack``; ``plan``: the parameters' flat plan, for the Adam state's
        flat passes (None: one op a tensor)."""
        with torch.no_grad():
            if self._taken:
                if self._again and self._gfirst is not None:
                    self._add(pack, "optim:gfirst", self._gfirst[1])
                if self._plan is not None and self._gflat is not None:
                    if flat_difference is not None and flat_difference.shape == self._gflat.shape:
                        self._didx = list(self._idx)
                        self._add(pack, "optim:dot", self._plan.sums_of_flat(flat_difference * self._gflat))
                    self._add(pack, "optim:gnorm", self._gnorm)
                    if self._pidx:
                        self._add(pack, "optim:pdot", self._pdot)
                else:
                    if differences is not None:
                        self._add(pack, "optim:dot", self._update_dots(differences))
                    self._add(pack, "optim:gnorm", self._gnorm)
                    self._add(pack, "optim:pdot", self._pdot)
            self._add_adam(pack, plan)

    def _update_dots(self, differences: tuple[list[Tensor], list[int], list[float]]) -> list[Tensor]:
        """The list path: each sampled gradient's dot product with the update's sample (the update
        ratio's ``before - after`` buffers), for the tensors it sets in ``_didx``; notes the
        samples' scale factors."""
        bufs, _, scale = differences
        self._scale = list(scale) if len(scale) == self.n else [1.0] * self.n
        didx, da, db = [], [], []
        # this step's gradient sample, copied before the update (an optimizer may change the
        # gradient in place: SGD's foreach Nesterov does)
        for i in self._idx:
            v = self._prev[i]
            d = bufs[i] if i < len(bufs) else None
            if d is not None and v is not None and d.shape == v.shape and d.device == v.device:
                didx.append(i)
                da.append(d)
                db.append(v)
        self._didx = didx
        return dots(da, db)

    def _add(self, pack: Pack, name: str, values: Tensor | list[Tensor]) -> None:
        if isinstance(values, list) and not values:
            return
        pack.add(name, values)
        self._names.append(name)

    def _adam_state(self) -> tuple[list[int], list[int], list[Tensor], list[Tensor], Any] | None:
        """The tensors with Adam state, their sizes (a DTensor's: the whole tensor's), their
        moments ``m`` and ``v`` (this rank's shards under FSDP2) and the thresholds below which
        ``v`` counts as under ``eps**2`` (:func:`_thresholds`); None where no tensor has it."""
        opt = self.optimizer
        if opt is None:
            return None
        group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
        idx, numel, m, v, steps, consts = [], [], [], [], [], []
        for i, p in enumerate(self.tensors):
            s = opt.state.get(p)  # (a defaultdict: .get adds nothing)
            grp = group_of.get(id(p))
            if not s or grp is None:
                continue
            ea, es = s.get("exp_avg"), s.get("exp_avg_sq")
            betas, eps = grp.get("betas"), grp.get("eps")
            if not isinstance(ea, Tensor) or not isinstance(es, Tensor) or betas is None or eps is None:
                continue
            ea, n = local(ea.detach()), es.numel()
            es = local(es.detach())
            if ea.layout != torch.strided or es.is_complex():
                continue
            idx.append(i)
            numel.append(n)
            m.append(ea)
            v.append(es)
            steps.append(local(st) if isinstance(st := s.get("step", 1), Tensor) else st)
            consts.append((betas[1], eps))
        if not idx:
            return None
        return idx, numel, m, v, _thresholds(steps, consts)

    def _add_adam(self, pack: Pack, plan: FlatPlan | None) -> None:
        found = self._adam_state()
        if found is None:
            return
        idx, numel, m, v, thresholds = found
        self._adam = (idx, numel)
        if (
            isinstance(thresholds, Tensor)
            and plan is not None
            and len(idx) == self.n
            and plan.small_numel * 8 <= FLAT_BYTES  # (the small ones' float64 copies)
            and plan.fits(m)
            and plan.fits(v)
        ):  # many small CPU tensors, or stacks of larger ones: flat passes (FlatPlan.adam_state)
            norms, sums, below = plan.adam_state(m, v, thresholds)
            self._add(pack, "optim:m", norms)
            self._add(pack, "optim:v", sums)
            self._add(pack, "optim:below", below)
            return
        self._add(pack, "optim:m", foreach_norm(m))
        self._add(pack, "optim:v", foreach_norm(v, 1.0))  # sum(v): v >= 0
        listed = list(thresholds.unbind()) if isinstance(thresholds, Tensor) else thresholds  # (no read)
        self._add(pack, "optim:below", counts_below(v, listed))

    def sharded_columns(
        self,
        device: torch.device,
        differences: tuple[list[Tensor], list[int], list[float]] | None = None,
    ) -> list[tuple[str, Tensor]]:
        """FSDP2: this rank's sums over its shards, columns of one value per tensor (0 where a
        tensor has none), for :meth:`~inspector.stats.sharded_stats.ShardedStats.combine` to sum
        across the mesh (a tensor that is not sharded: its own). The Adam state: ``sum(m**2)``,
        ``sum(v)`` and the count of ``v`` below ``eps**2``. The geometry, where
        :meth:`before_update` sampled the shards' gradients: the gradient sample's squared norm,
        its dot product with the update's sample (``differences``: the update ratio's buffers) and
        with the previous sampled step's, each times its sample's scale factor squared (an
        estimate of the whole shard's sum, so that the ranks' sums add up to the full tensor's).
        Every rank builds the same columns; their combined values come back in the transfer under
        these names, and :meth:`read` takes them."""
        # (the same columns every step, zeros where there is nothing: the collective's layout, and
        # so its masks, device constants, stay the same)
        geo = self._taken and self._plan is None and bool(self._idx)
        w = [1.0] * self.n
        dvals: list[Tensor] = []
        with torch.no_grad():
            if geo and differences is not None:
                dvals = self._update_dots(differences)
                w = [s * s for s in self._scale]
            g_sq = [x.pow(2) for x in self._gnorm] if geo else []  # type: ignore[union-attr]
            cols = [
                ("optim:dot", self._column(device, self._didx if dvals else [], dvals, w)),
                ("optim:g_sq", self._column(device, self._idx if geo else [], g_sq, w)),
                ("optim:pdot", self._column(device, self._pidx if geo else [], self._pdot, w)),  # type: ignore[arg-type]
            ]
        names = ["optim:m_sq", "optim:v", "optim:below"]
        zeros = [torch.zeros(self.n, device=device) for _ in range(3)]
        found = self._adam_state()
        if found is None:
            self._adam = None
        else:
            idx, numel, m, v, thresholds = found
            self._adam = (idx, numel)
            listed = list(thresholds.unbind()) if isinstance(thresholds, Tensor) else thresholds  # (no read)
            at = device_constant(tuple(idx), torch.int64, device)
            parts = (
                [x.to(device).pow(2) for x in foreach_norm(m)],
                [x.to(device) for x in foreach_norm(v, 1.0)],
                [x.to(device) for x in counts_below(v, listed)],
            )
            for col, values in zip(zeros, parts, strict=True):
                col.index_copy_(0, at, torch.stack([x.reshape(()).float() for x in values]))
        cols += list(zip(names, zeros, strict=True))
        self._names = [name for name, _ in cols]
        return cols

    def _column(self, device: torch.device, idx: list[int], values: list[Tensor], w: list[float]) -> Tensor:
        """One value per tensor (0 where none): ``values`` at ``idx``, each times its weight."""
        col = torch.zeros(self.n, device=device)
        if idx:
            weights = device_constant(tuple(w[i] for i in idx), torch.float32, device)
            got = torch.stack([x.reshape(()).to(device, torch.float32) for x in values]) * weights
            col.index_copy_(0, device_constant(tuple(idx), torch.int64, device), got)
        return col

    # ------------------------------------------------------------------ from the transfer
    def read(
        self,
        data: dict[str, list[float]],
        step: int,
        update_norm: list[float] | None,
        final_norm: list[float | None],
    ) -> dict[str, Any] | None:
        """``Snapshot.optim`` from the transfer: per-tensor lists aligned to the parameters, the
        same keys per group under ``"groups"`` and for the whole model under ``"model"`` (one value
        each), ``"kind"`` and ``"cos_prev_gap"``; None where nothing was measured. Records this step's gradient sample as the one the next sampled step compares
        with."""
        if not self._names:
            self._advance(step)
            return None
        n = self.n
        out: dict[str, list[Any]] = {k: [None] * n for k in (*ADAM_KEYS, *GEO_KEYS)}
        # per tensor: one value (FlatPlan, and FSDP2's combined columns), or one per index listed
        whole = self._plan is not None or "optim:g_sq" in data
        # a sampled tensor's sums, scaled to the whole tensor (FSDP2's columns are already)
        scale = [1.0] * n if whole else self._scale
        w = [s * s for s in scale]
        gnorm_vals = data.get("optim:gnorm", [])
        gsq: list[float | None] = [None] * n
        if "optim:g_sq" in data:
            for i in self._idx:
                gsq[i] = data["optim:g_sq"][i]
        elif whole:
            for i in self._idx:
                gsq[i] = gnorm_vals[i] ** 2
        else:
            for i, x in zip(self._idx, gnorm_vals, strict=False):
                gsq[i] = x * x
        # the effective step and the update's cosine with the descent direction
        dot: list[float | None] = [None] * n
        dvals = data.get("optim:dot", [])
        if whole:
            for i in self._didx:
                dot[i] = dvals[i]
        else:
            for i, x in zip(self._didx, dvals, strict=False):
                dot[i] = x
        # the gradient's norm the step is measured against: the first closure evaluation's
        if "optim:gfirst" in data and self._gfirst is not None:
            final_norm = [None] * n
            for i, x in zip(self._gfirst[0], data["optim:gfirst"], strict=False):
                final_norm[i] = x
        elif self._again and "optim:g_sq" in data:  # (FSDP2: the combined sample's)
            final_norm = [math.sqrt(max(x, 0.0)) if x is not None else None for x in gsq]
        dsq: list[float | None] = [None] * n
        if update_norm is not None:
            for i in range(n):
                u, g = update_norm[i], final_norm[i]
                if g is not None and u is not None:
                    out["step_ratio"][i] = u / g if g > 0 else None
                    dsq[i] = (u / scale[i]) ** 2 if scale[i] else None
        for i in range(n):
            if dot[i] is not None and dsq[i] is not None and gsq[i] is not None:
                out["cos_update_grad"][i] = _cos(dot[i], dsq[i], gsq[i])  # type: ignore[arg-type]
        # consecutive sampled gradients: a tensor's gradient now and on the previous sampled step,
        # where it had one on both (one whose gradient was missing then has none)
        pvals = data.get("optim:pdot", [])
        pdot: list[float | None] = [None] * n
        last = self._last_step
        gap = step - last if last is not None and last < step else None
        for k, i in enumerate(self._pidx):
            if gap is None or self._prev_at[i] != self._serial:
                continue
            pdot[i] = pvals[i] if whole else pvals[k]
            if gsq[i] is not None and self._prev_sq[i] is not None:
                out["cos_grad_prev"][i] = _cos(pdot[i], gsq[i], self._prev_sq[i])  # type: ignore[arg-type]
        prev_sq = list(self._prev_sq)
        idx = self._idx
        self._advance(step)
        for i in idx:  # this step's samples are now the previous ones
            self._prev_at[i] = self._serial
            self._prev_sq[i] = gsq[i]
        # Adam's moments
        adam_sums: dict[int, tuple[float, float, float, int]] = {}
        if self._adam is not None:
            idx, numel = self._adam
            ms, vv, bb = data.get("optim:m", []), data.get("optim:v", []), data.get("optim:below", [])
            if "optim:m_sq" in data:  # FSDP2: one value per tensor, combined across the mesh
                ms = [math.sqrt(max(data["optim:m_sq"][i], 0.0)) for i in idx]
                vv, bb = [vv[i] for i in idx], [bb[i] for i in idx]
            for i, cnt, mn, vs, b in zip(idx, numel, ms, vv, bb, strict=False):
                out["exp_avg_norm"][i] = mn
                out["exp_avg_sq_sqrt_norm"][i] = math.sqrt(vs) if vs >= 0 else None
                out["below_eps_frac"][i] = b / cnt if cnt else None
                adam_sums[i] = (mn * mn, vs, b, cnt)

        def aggregate(members: list[int] | range) -> dict[str, float | None]:
            """The values of these tensors taken together (as if concatenated; sampled ones estimated)."""
            a = [adam_sums[i] for i in members if i in adam_sums]
            cnt = sum(x[3] for x in a)
            su = [(update_norm[i], final_norm[i]) for i in members if out["step_ratio"][i] is not None]  # type: ignore[index]
            gg = sum(g * g for _, g in su)  # type: ignore[operator]
            c = [i for i in members if out["cos_update_grad"][i] is not None]
            q = [i for i in members if out["cos_grad_prev"][i] is not None]
            return {
                "exp_avg_norm": _root(sum(x[0] for x in a), bool(a)),
                "exp_avg_sq_sqrt_norm": _root(sum(x[1] for x in a), bool(a)),
                "below_eps_frac": sum(x[2] for x in a) / cnt if cnt else None,
                "step_ratio": math.sqrt(sum(u * u for u, _ in su) / gg) if gg > 0 else None,  # type: ignore[operator]
                "cos_update_grad": _cos(
                    sum(dot[i] * w[i] for i in c),  # type: ignore[operator]
                    sum(dsq[i] * w[i] for i in c),  # type: ignore[operator]
                    sum(gsq[i] * w[i] for i in c),  # type: ignore[operator]
                )
                if c
                else None,
                "cos_grad_prev": _cos(
                    sum(pdot[i] * w[i] for i in q),  # type: ignore[operator]
                    sum(gsq[i] * w[i] for i in q),  # type: ignore[operator]
                    sum(prev_sq[i] * w[i] for i in q),  # type: ignore[operator]
                )
                if q
                else None,
            }

        per_group = [aggregate(m) for m in self.groups.members]
        groups = {k: [g[k] for g in per_group] for k in (*ADAM_KEYS, *GEO_KEYS)}
        kind = "adam" if self._adam is not None else "other"
        return {**out, "groups": groups, "model": aggregate(range(n)), "kind": kind, "cos_prev_gap": gap}

    def _advance(self, step: int) -> None:
        """This sampled step is now the previous one (``_serial`` its number)."""
        self._idx = []  # (consumed: end_step keeps the buffers)
        if self._taken:
            self._read = True
            self._serial += 1
            self._last_step = step

    def end_step(self) -> None:
        """At every boundary: forget the step's values. A sampled step whose snapshot was not read
        (an error, a skipped iteration) leaves no previous sample to compare with: its gradients'
        samples replaced the ones before, and nothing says which step they are of."""
        if self._taken and not self._read:
            self._serial += 1
            self._last_step = None
        self._clear()

    def close(self) -> None:
        self._clear()
        self._prev = [None] * self.n
        self._stacks, self._stacks_of, self._scratch = [], None, {}
        self._prev_flat = None
        self._prev_at = [None] * self.n
        self._prev_sq = [None] * self.n
        self._last_step = None
