"""One step's statistics, from the raw gradients to the published :class:`Snapshot`.

The ``pre_step`` work of a step runs in three parts, around the hooks, and reads nothing on
the host (see :mod:`inspector.stats.deferred` for the every-step NaN/Inf check):

1. :meth:`StepStats.raw`, before any ``pre_step`` hook, on every step: the finiteness probe of
   each gradient (its 2-norm: one fused ``torch._foreach_norm``, or many CPU tensors'
   :class:`~inspector.stats.tensor_stats.FlatPlan` passes); on sampled steps the raw
   2-norms, abs-max (the probe then) and, for large CPU tensors, moments, in one sweep of each
   (``stats.raw_stats``), and copies of the raw gradients that get histograms;
2. the hooks (the Inspector applies them);
3. :meth:`StepStats.final`, on sampled steps only: norms, abs-max, means and spreads of the
   gradients the optimizer will see (``stats.moments``: stable whatever the mean), and the
   histograms, all kept on device (the unbiased std is made on the host once transferred).

:meth:`StepStats.snapshot`, at the boundary of a sampled step, adds the parameter norms and
the update norms (:class:`~inspector.stats.update_ratio.UpdateProbe`: a bounded sample of the
parameters kept before the update), the hook effects, module norms and tensor records, and
moves everything to the host in the snapshot's **one** transfer (:class:`telemetry.Pack`). Only
where that transfer shows something rare does it read again: a non-finite raw gradient's NaN
and Inf counts, or the float64 norm of finite values whose float32 norm overflowed (both from
the gradient as it is at the boundary, where no ``pre_step`` hook changed it).

The gradient noise scale (:mod:`inspector.stats.noise_scale`, when on) adds its per-parameter
sums of squared backward increments to that transfer and its estimates to the snapshot.

The snapshot's group aggregates (:mod:`inspector.stats.groups`) are made on the device from the
same per-tensor vectors and ride in that one transfer; under FSDP2 they are made on the host from
the per-tensor values once these are combined across the ranks.

Many small CPU tensors (at least ``SEGMENT_COUNT`` of at most ``SEGMENT_MAX`` elements, one float
dtype: :class:`~inspector.stats.tensor_stats.FlatPlan`) take flat passes instead of one op per
tensor: the probe, the raw and final statistics when every parameter has a dense gradient, the
parameter norms, and the update norms when the whole model is within what
:class:`~inspector.stats.update_ratio.UpdateProbe` keeps whole (one flat copy before the update).

Under FSDP2 (a :class:`sharded.Layout`) every gradient here is this rank's shard: the snapshot
combines every rank's partial results (sums of squares, abs-max, moments, counts) into the full
tensors' statistics in one collective (:class:`~inspector.stats.sharded_stats.ShardedStats`) before its
transfer; a histogram of a sharded parameter takes its range from one collective of its own first.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..hooks.ops import GuardResult, HookState, count_nonfinite
from ..hooks.torch_hooks import TorchHooks
from ..wire.records import Snapshot
from .deferred import guard_counts, pack_guard_counts
from .groups import Groups
from .histsel import HIST_BINS
from .noise_scale import NoiseScale
from .optim_state import OptimProbe
from .sharded import Layout, local
from .sharded_stats import ShardedStats
from .telemetry import Pack
from .tensor_stats import (
    FlatPlan,
    dense,
    device_constant,
    foreach_norm,
    histograms,
    moments,
    raw_stats,
    wide_norm,
)
from .update_ratio import FLOOR, UpdateProbe

__all__ = ["RawRead", "StepStats"]

# from this many parameter tensors on, the group aggregates are made on the device (one segment of
# the snapshot's transfer); below it on the host, from the transferred per-tensor lists
DEVICE_GROUPS = 64


@dataclass
class RawRead:
    """What :meth:`StepStats.raw` measured before the ``pre_step`` hooks ran (device tensors only)."""

    index: list[int]  # parameter indices with a gradient
    probe: Tensor | list[Tensor]  # per gradient: abs-max (sampled step) or 2-norm; finite iff the gradient is
    exact: bool  # the probe is the abs-max
    norm_tensors: list[Tensor] = field(default_factory=list)  # sampled steps: the raw 2-norms
    absmax: Tensor | list[Tensor] = field(default_factory=list)  # sampled steps (the probe), 1-D
    local_index: list[int] = field(default_factory=list)  # DDP: parameters with a local norm
    local_norms: list[Tensor] = field(default_factory=list)  # this rank's pre-all-reduce norms
    hist_raw: dict[int, Tensor] = field(default_factory=dict)  # index -> copy of the raw gradient
    # many small CPU tensors (stats.FlatPlan): every gradient's (mean, population std), two vectors
    flat_moments: tuple[Tensor, Tensor] | None = None
    grads: list[Tensor] = field(default_factory=list)  # the gradients read, all strided (this rank's shards)
    # position in index -> (mean, population std), taken in the CPU sweep (stats.raw_stats)
    moments: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)
    # the gradients' norms as the last backward left them, and the scale they are scaled by
    backward: tuple[list[Tensor] | Tensor, Tensor | None] | None = None
    backward_index: list[int] | None = None  # the parameters those norms are of, in order


def _backward_taken(data: dict[str, list[float]], world: int) -> list[float] | None:
    """The norms as the last backward left the gradients, from the transfer (None: not taken; under
    FSDP2, not taken on every one of the ``world`` ranks whose shards they combine)."""
    norms = data.get("backward_norm")
    if not norms or ("backward_took" in data and data["backward_took"][0] != world):
        return None
    return norms


def _backward_total(data: dict[str, list[float]], world: int = 1) -> float | None:
    """The global norm as the last backward left the gradients, unscaled, from the transfer."""
    norms = _backward_taken(data, world)
    if not norms:
        return None
    total = math.sqrt(sum(v * v for v in norms))
    scale = (data.get("backward_scale") or [1.0])[0]
    return total / scale if scale else total


def _backward_norms(
    raw: RawRead | None, data: dict[str, list[float]], n: int, world: int = 1
) -> list[float | None] | None:
    """Each parameter's norm as the last backward left it, unscaled (None: not taken, or no
    gradient): before the user's own code between ``backward()`` and ``step()`` changed it."""
    norms = _backward_taken(data, world)
    if raw is None or raw.backward_index is None or not norms or len(norms) != len(raw.backward_index):
        return None
    scale = (data.get("backward_scale") or [1.0])[0] or 1.0
    out: list[float | None] = [None] * n
    for i, v in zip(raw.backward_index, norms, strict=True):
        out[i] = v / scale
    return out


def _vector(values: Tensor | list[Tensor]) -> Tensor | None:
    """Per-tensor 0-dim values as one 1-D float32 vector (as :meth:`Pack.add` stacks them; None if
    there are none), so that the group aggregates and the transfer share one stack."""
    if isinstance(values, Tensor):
        return values.reshape(-1).float()
    if not values:
        return None
    try:
        out = torch.stack(values)
    except RuntimeError:  # mixed devices or shapes of one element
        dev = values[0].device
        out = torch.stack([v.reshape(()).to(dev, torch.float32) for v in values])
    return out.reshape(-1).float()


def _add(pack: Pack, name: str, vec: Tensor | None) -> None:
    if vec is not None:
        pack.add(name, vec)


def _full(
    norms: Tensor | None, absmax: Tensor | None, index: list[int], n: int, dev: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    """Vectors over ``index`` (the parameters with a gradient) spread to all ``n`` parameters, with
    the mask of those present."""
    if norms is None or absmax is None or not index:
        z = torch.zeros(n, device=dev)
        return z, z, torch.zeros(n, dtype=torch.bool, device=dev)
    if len(index) == n:
        return norms.to(dev), absmax.to(dev), torch.ones(n, dtype=torch.bool, device=dev)
    idx = device_constant(tuple(index), torch.long, dev)
    ok = torch.zeros(n, dtype=torch.bool, device=dev).index_fill_(0, idx, True)
    return (
        torch.zeros(n, device=dev).index_copy_(0, idx, norms.to(dev)),
        torch.zeros(n, device=dev).index_copy_(0, idx, absmax.to(dev)),
        ok,
    )


class StepStats:
    """The statistics of the step under way; see the module docstring for the order."""

    def __init__(
        self,
        params: list[str],
        tensors: list[Tensor],
        layout: Layout | None = None,
        groups: Groups | None = None,
    ) -> None:
        self.noise: NoiseScale | None = None  # the noise-scale instrument (set by the Inspector), or None
        self.optim: OptimProbe | None = (
            None  # the optimizer's state and update geometry (set by the Inspector)
        )
        self.failures: list[tuple[str, BaseException]] = []  # an instrument's error, disabled (take_failures)
        self.params = params
        self.tensors = tensors
        self.layout = layout
        self.groups = groups if groups is not None else Groups(params)
        # FSDP2: statistics of sharded parameters combine across the mesh
        self._sharded = ShardedStats(layout, params, tensors) if layout is not None else None
        self._part: dict[str, Any] = {}  # under FSDP2: the final statistics' local partial results
        self.raw_read: RawRead | None = None
        self._all_index = list(range(len(tensors)))
        # many small CPU tensors: their statistics in flat passes (FlatPlan), not one op per tensor
        self._flat = FlatPlan.of(tensors) if layout is None else None
        self._numel = [t.numel() for t in tensors]
        self._complex = [t.is_complex() for t in tensors]
        self._unbias = [
            math.sqrt(c / (c - 1)) if c > 1 else None for c in self._numel
        ]  # population -> unbiased std
        self._kept: Tensor | None = None  # the parameters before the update, flat (FlatPlan, kept whole)
        self._no_probe = False  # probe() cannot take these gradients (sparse, on several devices)
        self._pack: Pack | None = None  # the sampled step's device-side statistics
        self._meta: dict[str, Any] = {}
        self.update = UpdateProbe()  # parameters before the update (sampled steps)
        self._fgrads: dict[int, Tensor] = {}  # index -> the final gradient (sampled steps; no copies)
        self._guards: list[GuardResult] = []  # this sampled step's nan_guards (their host findings)
        self._guard_entries: list[tuple[list[int], str]] = []  # their "guard:k" segments in the pack
        self._touched: set[int] = set()  # parameters a pre_step hook may have changed (sampled steps)
        self._vecs: dict[str, Tensor | None] = {}  # the sampled step's stacked per-tensor vectors (no FSDP2)

    @property
    def resident_bytes(self) -> int:
        """Device memory held from one step to the next (the update-ratio sample)."""
        return self.update.resident_bytes

    def _whole_flat(self) -> bool:
        """Whether the update ratio takes the parameters whole in one flat copy: every parameter
        small (FlatPlan) and all together within what UpdateProbe would keep whole."""
        f = self._flat
        return (
            f is not None
            and not f.large
            and f.small_numel * self.tensors[0].element_size() <= FLOOR
            and f.fits(self.tensors)  # (not where a parameter left the CPU or changed shape)
        )

    def keep_params(self) -> None:
        """Keep (a sample of) the parameters before the update, for the update-to-parameter ratio."""
        if self._whole_flat():
            if self._kept is None:
                with torch.no_grad():
                    self._kept = self._flat.flat(self.tensors)  # type: ignore[union-attr]  # (a copy)
            return
        self.update.keep(self._params_local())

    def _params_local(self) -> list[Tensor]:
        """The parameters, detached; under FSDP2 this rank's shards (a DTensor has no foreach kernels)."""
        if self.layout is None:
            return [p.detach() for p in self.tensors]
        return [local(p.detach()) for p in self.tensors]

    def norms_now(self, grads: list[Tensor]) -> list[Tensor] | Tensor:
        """The 2-norms of ``grads`` (every parameter's, dense: one vector by FlatPlan; else a list)."""
        if self._flat is not None and self._flat.fits(grads):
            return self._flat.norms(grads)
        return foreach_norm(grads)

    def probe(self) -> tuple[list[int], Tensor | list[Tensor]] | None:
        """The unsampled step's finiteness probe alone, for the usual case (no ``pre_step`` hook, no
        FSDP2): ``(indices, their gradients' 2-norms)``, one fused norm (and on a device one stack), or
        None where it does not apply (a sparse gradient, which :meth:`raw` densifies; gradients
        on several devices, which :class:`~inspector.stats.telemetry.Pack` gathers)."""
        if self._no_probe:
            return None
        grads = [g for p in self.tensors if (g := p.grad) is not None]
        if not grads:
            return None
        if self._flat is not None and self._flat.cheap_norms and self._flat.fits(grads):
            try:  # (one vector: read by one copy)
                return self._all_index, self._flat.norms(grads)
            except RuntimeError:  # (a gradient that is not what its parameter is: the usual way from now on)
                self._flat = None
        try:
            norms = foreach_norm(grads)
            # on the CPU the norms are read one by one at a later boundary (no copy to make: one
            # op fewer per step); elsewhere stacked, for one non_blocking copy
            cpu = grads[0].is_cpu and grads[-1].is_cpu and all(g.is_cpu for g in grads)
            flat = norms if cpu else torch.stack(norms)
        except RuntimeError:  # a sparse gradient has no norm kernel; gradients on several devices
            self._no_probe = True  # (the same parameters every step: raw() from now on)
            return None
        if len(grads) == len(self.tensors):
            return self._all_index, flat
        return [i for i, p in enumerate(self.tensors) if p.grad is not None], flat

    def raw(
        self,
        hooks: TorchHooks,
        sampled: bool,
        hist: Iterable[int],
        edited: set[int] | frozenset[int] = frozenset(),
    ) -> RawRead:
        """The raw gradients' probe (every step) and, on sampled steps, their norms, abs-max and
        the raw gradients that get histograms: device tensors only, nothing read. Only those a
        ``pre_step`` hook will edit in place (``edited``) are copied; the others are kept by
        reference (the final gradient is the same tensor, or None)."""
        idx: list[int] = []
        grads: list[Tensor] = []
        shard = self.layout is not None
        densified = False
        # every gradient there, dense, of its parameter's shape, on the CPU (FlatPlan.fits checks
        # each): the usual case, no loop of ours and flat passes; else (one missing, one sparse)
        # the per-tensor path, whose densified values of a sparse gradient the plan cannot take
        flat = False
        if self._flat is not None:
            got = [g for p in self.tensors if (g := p.grad) is not None]
            if self._flat.fits(got):
                idx, grads, flat = self._all_index, got, True
        for i, p in enumerate(self.tensors if not flat else ()):
            g = p.grad
            if g is not None:
                if shard:  # FSDP2: this rank's shards; the snapshot combines them
                    g = local(g)
                idx.append(i)
                if g.layout == torch.strided:
                    grads.append(g)
                else:
                    grads.append(dense(g))
                    densified = True
        if sampled and flat:
            am, norm_vec, mean, sdev = self._flat.stats(grads)  # type: ignore[union-attr]
            out = RawRead(idx, am, True, absmax=am, flat_moments=(mean, sdev))
            out.norm_tensors = norm_vec  # type: ignore[assignment]  # (a vector here)
        elif sampled:
            am, norms, known = raw_stats(grads)
            out = RawRead(idx, am, True, norm_tensors=norms, absmax=am, moments=known)
        elif flat and self._flat.cheap_norms:  # type: ignore[union-attr]
            out = RawRead(idx, self._flat.norms(grads), False)  # type: ignore[union-attr]
        else:
            out = RawRead(idx, foreach_norm(grads), False)
        if hooks.per_rank:
            out.local_index = [i for i, v in enumerate(hooks.local_sq) if v is not None]
            out.local_norms = [hooks.local_sq[i].sqrt() for i in out.local_index]  # type: ignore[union-attr]
        if sampled:
            for i in hist:
                g = self.tensors[i].grad
                if g is not None:
                    g = dense(local(g)).detach()
                    out.hist_raw[i] = g.clone() if i in edited else g
        out.grads = grads if not densified else []  # (final() tells a sparse gradient by its layout)
        self.raw_read = out
        return out

    def final(self, raw: RawRead, *, hooks_ran: bool, guards: list[GuardResult], touched: set[int]) -> None:
        """The sampled step's statistics of the final gradients (after every ``pre_step`` hook).
        ``guards``: what this step's nan_guards counted; ``touched``: the parameters a pre_step
        hook may have changed (their raw gradient is gone at the boundary)."""
        self._guards, self._touched = guards, touched
        pack = Pack()
        if self.layout is None:
            self._vecs["raw_norm"] = _vector(raw.norm_tensors)
            self._vecs["raw_absmax"] = _vector(raw.absmax)
            _add(pack, "raw_norm", self._vecs["raw_norm"])
            _add(pack, "raw_absmax", self._vecs["raw_absmax"])
        self._guard_entries = pack_guard_counts(pack, guards)
        if hooks_ran or not raw.grads:
            fin = [(i, g) for i, p in enumerate(self.tensors) if (g := p.grad) is not None]
            fgrads = [dense(g) for _, g in fin] if self.layout is None else [dense(local(g)) for _, g in fin]
        else:  # no pre_step hook ran: the gradients raw() read are the final ones
            fin = list(zip(raw.index, raw.grads, strict=True))
            fgrads = raw.grads
        flat_moms: tuple[Tensor, Tensor] | None = None
        if (
            hooks_ran
            and raw.flat_moments is not None
            and self._flat is not None
            and self._flat.fits([g for _, g in fin])  # (the gradients as they are, not densified)
        ):
            fabsmax, fnorms, *flat_pair = self._flat.stats(fgrads)  # (as raw() took the raw ones)
            flat_moms = (flat_pair[0], flat_pair[1])
            fknown: dict[int, tuple[Tensor, Tensor]] = {}
        elif hooks_ran:  # (the same arithmetic as raw(): an untouched gradient reads the same twice)
            fabsmax, fnorms, fknown = raw_stats(fgrads)
        else:  # no pre_step hook ran: the final gradients are the raw ones
            fnorms, fabsmax, fknown = raw.norm_tensors, raw.absmax, raw.moments
            flat_moms = raw.flat_moments
        if flat_moms is not None:  # every final gradient there and dense (FlatPlan.fits)
            strided = list(range(len(fin)))
            moms: list[tuple[Tensor, Tensor]] = []
        else:
            strided = [k for k, (_, g) in enumerate(fin) if g.layout == torch.strided]
            # the dense final gradients' means and population stds (the unbiased std is the host's)
            known = {j: fknown[k] for j, k in enumerate(strided) if k in fknown}
            moms = moments([fgrads[k] for k in strided], known)
        if self.layout is None:
            self._vecs["final_norm"] = _vector(fnorms)
            self._vecs["final_absmax"] = _vector(fabsmax)
            _add(pack, "final_norm", self._vecs["final_norm"])
            _add(pack, "final_absmax", self._vecs["final_absmax"])
            if flat_moms is not None:
                pack.add("mean", flat_moms[0])
                pack.add("sdev", flat_moms[1])
            else:
                pack.add("mean", [m.real if m.is_complex() else m for m, _ in moms])  # (a complex mean: null)
                pack.add("sdev", [sd for _, sd in moms])
        else:  # FSDP2: the shards' partial results, combined in the snapshot's one collective
            self._part = {
                "fnorms": fnorms,
                "fabsmax": fabsmax,
                "moments": moms,
                "counts": [fgrads[k].numel() for k in strided],
            }
            if raw.local_index or any(self.layout.sharded[i] for i in raw.index):
                shard_idx = [k for k, i in enumerate(raw.index) if self.layout.sharded[i]]
                pack.add("shard_norm", [raw.norm_tensors[k] for k in shard_idx])
        pack.add("local_norm", raw.local_norms)
        if raw.backward is not None:
            if self.layout is None:  # (under FSDP2 the shards' norms are combined in the snapshot)
                pack.add("backward_norm", raw.backward[0])
            if raw.backward[1] is not None:
                pack.add("backward_scale", raw.backward[1].reshape(1).float())
        hist_in = []
        for i, g_raw in raw.hist_raw.items():
            g = self.tensors[i].grad
            hist_in.append((i, g_raw, dense(local(g)) if g is not None else None))
        spans = self._sharded.hist_spans(hist_in) if self._sharded is not None else {}
        for i, g_raw, g_fin in hist_in:
            h = histograms(g_raw, g_fin, HIST_BINS, span=spans.get(i))
            if i in spans:  # a sharded parameter's counts: summed across the mesh in the snapshot
                self._part.setdefault("hist", {})[i] = h
            else:
                pack.add(f"hist:{i}", h)
        self._meta = {
            "fin_idx": [i for i, _ in fin],
            "dense_idx": [fin[k][0] for k in strided],
            "hist_idx": list(raw.hist_raw),
            "hist_final": [i for i in raw.hist_raw if self.tensors[i].grad is not None],
        }
        self._fgrads = dict(zip(self._meta["fin_idx"], fgrads, strict=True))
        self._pack = pack
        if self.optim is not None:
            try:  # the gradients' sample for the optimizer's geometry (inspector.stats.optim_state)
                plan = self._flat if self._kept is not None else None
                kept = self.update.differences()  # (before the update: the strides it sampled with)
                norms = (self._meta["fin_idx"], self._vecs.get("final_norm"))
                self.optim.before_update(
                    self._fgrads, self._params_local(), plan, kept[1] if kept else None, norms
                )
            except Exception as e:  # never take training down for telemetry: this instrument is off
                self._optim_failed(e)

    def _optim_failed(self, err: BaseException) -> None:
        """The optimizer-state instrument raised: it is turned off, and the error reported (the
        lifecycle takes it with :meth:`take_failures`, as a ``telemetry_error`` event)."""
        if self.optim is not None:
            self.optim.close()
        self.optim = None
        self.failures.append(("the optimizer state and update geometry", err))

    def take_failures(self) -> list[tuple[str, BaseException]]:
        """The instruments' errors since the last call (each instrument is off after its first)."""
        out, self.failures = self.failures, []
        return out

    def _exact_histograms(self, indices: list[int], raw: RawRead | None) -> dict[int, list[float]]:
        """The histograms of gradients that hold NaN or Inf (the transfer showed a non-finite
        abs-max), taken again without them (``stats.exact_histograms``). Rare: one more read, only
        then. Not for a sharded parameter under FSDP2, whose histogram is exact already (taken
        over its global range, ``ShardedStats.hist_spans``)."""
        if not indices or raw is None:
            return {}
        out = {}
        for i in indices:
            if i not in raw.hist_raw or (self.layout is not None and self.layout.sharded[i]):
                continue
            g = self.tensors[i].grad
            out[i] = histograms(raw.hist_raw[i], dense(g) if g is not None else None, HIST_BINS, exact=True)
        return {i: h.tolist() for i, h in out.items()}

    def _wide_final(self, norms: list[float | None], absmax: list[float | None]) -> None:
        """Where a hook made finite final values whose float32 norm overflows (an infinite norm, a
        finite abs-max), that norm again in float64, from the same gradient, in place (the std is
        made from it after). Rare: a host read each, only then."""
        for i, (n, a) in enumerate(zip(norms, absmax, strict=True)):
            g = self._fgrads.get(i)
            if g is None or n is None or a is None or math.isfinite(n) or not math.isfinite(a):
                continue
            norms[i] = float(wide_norm(g))

    def _mean_std(
        self,
        dense_idx: list[int],
        norms: list[float | None],
        absmax: list[float | None],
        data: dict[str, list[float]],
    ) -> tuple[list[float | None], list[float | None]]:
        """The dense final gradients' means and unbiased stds, from the transfer's means and
        population stds (``stats.moments``, stable whatever the mean): ``std = sdev * sqrt(n / (n -
        1))``, in float64. A complex mean is not one number: null, as is the std of a single value.
        Where finite values' mean or spread overflowed float32 (on the device, or in the
        transfer: values near 1e19 and up), they are taken again in float64 from the same gradient
        (rare: a host read, only then; not under FSDP2, where it is a shard's)."""
        n = len(self.params)
        means, sdevs = data.get("mean", []), data.get("sdev", [])
        if len(dense_idx) == n and self._flat is not None and math.isfinite(sum(means) + sum(sdevs)):
            # every gradient there, dense and real (FlatPlan), every moment finite: no per-tensor case
            return list(means), [sd * f if f else None for sd, f in zip(sdevs, self._unbias, strict=True)]
        mean: list[float | None] = [None] * n
        std: list[float | None] = [None] * n
        for k, i in enumerate(dense_idx):
            norm = norms[i]
            if norm is None:
                continue
            cplx, count = self._complex[i], self._numel[i]
            m, sd = means[k], sdevs[k]
            a, g = absmax[i], self._fgrads.get(i)
            if (
                self.layout is None
                and not (math.isfinite(m) and math.isfinite(sd))
                and a is not None
                and math.isfinite(a)
                and g is not None
            ):
                sd64, m64 = torch.std_mean(
                    g.detach().to(torch.complex128 if cplx else torch.float64), correction=0
                )
                m, sd = float(m64.real), float(sd64)
            mean[i] = None if cplx else m
            std[i] = sd * math.sqrt(count / (count - 1)) if count > 1 else None
        return mean, std

    def _raw_rare(
        self, raw_idx: list[int], norms: list[float], absmax: list[float], data: dict[str, list[float]]
    ) -> dict[int, tuple[int, int]]:
        """A sampled step's rare cases, once its transfer has shown them: the NaN/Inf counts of each
        non-finite raw gradient (from a guard's counts of this step, else counted now where no
        ``pre_step`` hook changed it: a host read each, -1 where neither can tell), and, in place,
        the float64 norm of finite raw values whose float32 norm overflowed (where still there)."""
        counts: dict[int, tuple[int, int]] = {}
        for i, nan, inf, _ in guard_counts(self._guard_entries, data):
            counts.setdefault(i, (nan, inf))
        for g in self._guards:
            for f in g.found or ():
                counts.setdefault(f.index, (f.nan, f.inf))
        out: dict[int, tuple[int, int]] = {}
        for k, i in enumerate(raw_idx):
            here = self.layout is None and i not in self._touched and self.tensors[i].grad is not None
            if not math.isfinite(absmax[k]):
                if i in counts:
                    out[i] = counts[i]
                elif here:
                    out[i] = count_nonfinite(dense(self.tensors[i].grad))  # type: ignore[arg-type]
                else:
                    out[i] = (-1, -1)
            elif not math.isfinite(norms[k]) and here:  # finite values whose float32 norm overflowed
                norms[k] = float(wide_norm(dense(self.tensors[i].grad)))  # type: ignore[arg-type]
        return out

    def _group_device(
        self, raw: RawRead | None, meta: dict[str, Any], pvec: Tensor | None, uvec: Tensor | None
    ) -> Tensor | None:
        """The group aggregates on the device, for the snapshot's one transfer, from the stacked
        per-tensor vectors of :meth:`final` and the parameter and update norms; None where they
        cannot be taken there (no vectors: nothing sampled, tensors on several devices) or need not
        be (fewer than ``DEVICE_GROUPS`` tensors: a few dozen floats on the host cost less than
        the dozen device ops), and then :meth:`_group_host` takes them from the lists."""
        n = len(self.params)
        if pvec is None or pvec.numel() != n or n < DEVICE_GROUPS:
            return None
        dev = pvec.device
        try:
            with torch.no_grad():
                if raw is not None and "raw_norm" in self._vecs:
                    rn, ra, rok = _full(self._vecs["raw_norm"], self._vecs["raw_absmax"], raw.index, n, dev)
                    fn, fa, fok = _full(
                        self._vecs["final_norm"], self._vecs["final_absmax"], meta.get("fin_idx", []), n, dev
                    )
                else:
                    rn = ra = fn = fa = torch.zeros(n, device=dev)
                    rok = fok = torch.zeros(n, dtype=torch.bool, device=dev)
                if uvec is not None and uvec.numel() == n:
                    u = uvec.to(dev)
                    ratio = u / pvec
                    ratio_ok = (fok | (u != 0)) & (pvec > 0)
                else:
                    ratio, ratio_ok = torch.zeros(n, device=dev), torch.zeros(n, dtype=torch.bool, device=dev)
                return self.groups.aggregate(rn, ra, rok, fn, fa, fok, ratio, ratio_ok)
        except RuntimeError:  # vectors on several devices
            return None

    def _group_host(
        self,
        data: dict[str, list[float]],
        counts: dict[int, tuple[int, int]],
        norm_raw: list[float | None],
        norm: list[float | None],
        absmax_raw: list[float | None],
        absmax: list[float | None],
        nan_count: list[int | None],
        inf_count: list[int | None],
        ratio: list[float | None],
    ) -> dict[str, list[Any]]:
        """The snapshot's group aggregates: from the transfer's ``groups`` segment, or, under FSDP2
        (whose per-tensor values are combined across ranks into these lists on the host), where the
        device could not take them, or where a group norm is infinite (a float32 norm that overflowed
        may have been taken again in float64 on the host, a rare case), from the lists."""
        host = data.get("groups")
        if host is not None:
            out = self.groups.unpack(host, nan_count, inf_count, counts)
            if not any(v == math.inf for k in ("norm_raw", "norm") for v in out[k]):
                return out
        return self.groups.aggregate_host(norm_raw, norm, absmax_raw, absmax, nan_count, inf_count, ratio)

    def _optim_read(self, data: dict[str, list[float]], step: int, grad_norm: list[float | None]) -> Any:
        """``Snapshot.optim`` from the transfer (None: the instrument is off or measured nothing)."""
        if self.optim is None:
            return None
        try:
            return self.optim.read(data, step, data.get("update_norm"), grad_norm)
        except Exception as e:  # never take training down for telemetry: this instrument is off
            self._optim_failed(e)
            return None

    def final_norms(self) -> tuple[Tensor, list[int]] | None:
        """The sampled step's final 2-norms as one vector and the parameters they are of (those
        with a gradient after the ``pre_step`` hooks), after :meth:`final`; None under FSDP2."""
        vec, index = self._vecs.get("final_norm"), self._meta.get("fin_idx")
        return None if vec is None or index is None else (vec, index)

    def end_step(self) -> None:
        """Forget the step's device-side statistics (at every boundary)."""
        if self.noise is not None:
            self.noise.end_step()
        if self.optim is not None:
            self.optim.end_step()
        if self.raw_read is None and self._pack is None and not self.update.kept and self._kept is None:
            return  # an unsampled step's probe (``probe()``) keeps nothing here
        self.raw_read = None
        self._pack = None
        self._meta = {}
        self._fgrads = {}
        self._vecs = {}
        self._kept = None
        self._part = {}
        self._guards = []
        self._guard_entries = []
        self._touched = set()
        self.update.end_step()

    def close(self) -> None:
        self.end_step()
        self.update.close()
        if self.optim is not None:
            self.optim.close()

    def snapshot(
        self,
        *,
        step: int,
        config_version: int,
        records: dict[str, list[Any]],
        events: list[dict[str, Any]],
        ranks: Callable[[list[float] | None], dict[str, Any] | None] | None,
        states: Iterable[HookState],
        hooks: TorchHooks,
        lr: list[float],
        sampled_every: int,
        overhead: float | None,
    ) -> Snapshot:
        """The sampled step's snapshot, with its one host transfer. ``ranks``, under
        torch.distributed: the boundary's exchange, called with this rank's local norms (from the
        transfer) and returning the per-rank spread."""
        pack = self._pack or Pack()
        meta = self._meta if self._pack is not None else {}
        raw = self.raw_read if self._pack is not None else None
        n = len(self.params)
        pnorms: list[Tensor] | Tensor
        unorms: list[Tensor] | Tensor | None
        with torch.no_grad():
            if self._flat is not None and self._flat.fits(self.tensors):
                pnorms = self._flat.norms(self.tensors)
                if self._kept is not None:  # (the update's sample is flat too where all are small)
                    after = self._flat.flat(self.tensors)
                    unorms = self._flat.norms_of_flat(self._kept.sub_(after), [])
                else:
                    unorms = self.update.update_norms(self._params_local())
            else:  # (also where a parameter has left the plan: moved off the CPU, reshaped)
                ps = self._params_local()
                pnorms = foreach_norm(ps)
                # (a flat copy kept before a parameter left the plan, this very step: no update norms)
                unorms = self.update.update_norms(ps) if self._kept is None else None
        dev = pnorms[0].device if len(pnorms) else torch.device("cpu")
        if self.layout is None:
            pvec = _vector(pnorms)
            uvec = _vector(unorms) if unorms is not None else None
            _add(pack, "param_norm", pvec)
            if uvec is not None:
                pack.add("update_norm", uvec)
            grouped = self._group_device(raw, meta, pvec, uvec)
            if grouped is not None:
                pack.add("groups", grouped)
        eff_ids, effs, eff_extra = [], [], {}
        for st in states:
            if st.measured:
                effs.append(
                    [
                        x.float() if isinstance(x, Tensor) else torch.full((), float(x), device=dev)
                        for x in st.effect()
                    ]
                    + [v.float().reshape(()) for v in st.extra.values()]  # a kind's own (zclip's)
                )
                eff_ids.append(st.spec.id)
                eff_extra[st.spec.id] = list(st.extra)
        if self.layout is None:
            for hid, e in zip(eff_ids, effs, strict=True):
                pack.add(f"eff:{hid}", e)
        mod_keys = sorted(hooks.mod_sq)
        pack.add("modules", [hooks.mod_sq[k] for k in mod_keys])
        rec_keys = [k for k, v in records.items() if isinstance(v[0], Tensor)]
        pack.add("rec", [records[k][0] for k in rec_keys])
        if self._sharded is not None:
            effs_by_id = list(zip(eff_ids, effs, strict=True))
            optim = None
            if self.optim is not None:
                try:  # the Adam state's sums over this rank's shards (inspector.stats.optim_state)
                    optim = self.optim.sharded_columns(dev, self.update.differences())
                except Exception as e:  # never take training down for telemetry: this instrument is off
                    self._optim_failed(e)
            self._sharded.combine(pack, raw, self._part, meta, pnorms, unorms, effs_by_id, optim)
        if self.noise is not None:
            self.noise.pack(pack)
        if self.optim is not None and self.layout is None:
            try:  # the update's geometry and the Adam state (inspector.stats.optim_state)
                flat_diff = self._kept if self._kept is not None and unorms is not None else None
                diffs = self.update.differences() if flat_diff is None else None
                self.optim.add(pack, diffs, flat_diff, self._flat)
            except Exception as e:  # never take training down for telemetry: this instrument is off
                self._optim_failed(e)
        data = pack.transfer()  # the one host transfer of this snapshot
        local_norms = None
        if raw is not None and (raw.local_index or "shard_norm" in data):
            local_norms = [math.nan] * n
            for i, v in zip(raw.local_index, data.get("local_norm", []), strict=True):
                local_norms[i] = v
            if self.layout is not None:  # a sharded parameter's local norm is that of this rank's shard
                shard_idx = [i for i in raw.index if self.layout.sharded[i]]
                for i, v in zip(shard_idx, data.get("shard_norm", []), strict=True):
                    local_norms[i] = v
        if self.noise is not None:
            self.noise.received(data)  # (under DDP its values join the exchange's rows)
        spread = ranks(local_norms) if ranks is not None else None

        def scatter(indices: list[int], values: list[float] | None) -> list[float | None]:
            out: list[float | None] = [None] * n
            for i, v in zip(indices, values or [], strict=False):
                out[i] = v
            return out

        raw_idx = raw.index if raw is not None else []
        fin_idx = meta.get("fin_idx", [])
        dense_idx = meta.get("dense_idx", [])
        raw_norm_vals = list(data.get("raw_norm", []))
        raw_absmax_vals = data.get("raw_absmax", [])
        counts = self._raw_rare(raw_idx, raw_norm_vals, raw_absmax_vals, data) if raw_idx else {}
        world = self.layout.world if self.layout is not None else 1  # (FSDP2: the ranks combined)
        grad_norm_raw = scatter(raw_idx, raw_norm_vals)
        noise_scale = (
            self.noise.observe(
                data,
                grad_norm_raw,
                backward=_backward_norms(raw, data, n, world),
                edited=hooks.post_edited(),
            )
            if self.noise is not None
            else None
        )
        grad_norm = scatter(fin_idx, data.get("final_norm"))
        absmax_final = scatter(fin_idx, data.get("final_absmax"))
        if self.layout is None:  # (under FSDP2 a shard's float64 norm is not the tensor's)
            self._wide_final(grad_norm, absmax_final)
        mean, std = self._mean_std(dense_idx, grad_norm, absmax_final, data)
        nan_count: list[int | None] = [None] * n
        inf_count: list[int | None] = [None] * n
        for i in raw_idx:
            nan_count[i], inf_count[i] = (None if c < 0 else c for c in counts.get(i, (0, 0)))
        update_ratio: list[float | None] = [None] * n
        if "update_norm" in data:
            # ||delta theta|| / ||theta|| with theta after the update (one pass fewer than before it;
            # the two differ by the update itself, a relative 1e-3 or so)
            with_grad = set(fin_idx)
            for i, (u, b) in enumerate(zip(data["update_norm"], data["param_norm"], strict=True)):
                if i in with_grad or u != 0:
                    update_ratio[i] = (u / b) if b > 0 else None
        scalars = {}
        loss = None
        rec_host = dict(zip(rec_keys, data.get("rec", []), strict=True))
        for k, (s, c) in records.items():
            v = rec_host.get(k, s) / c
            if k == "loss":
                loss = v
            else:
                scalars[k] = v
        effects = {}
        for hid in eff_ids:
            changed, bsq, asq, *extra = data[f"eff:{hid}"]
            effects[hid] = {
                "changed": int(changed) if math.isfinite(changed) else changed,
                "norm_ratio": math.sqrt(asq / bsq) if bsq > 0 and math.isfinite(bsq) else None,
            }
            for k, v in zip(eff_extra[hid], extra, strict=True):  # NaN: no value (zclip warming up)
                effects[hid][k] = (int(v) if v.is_integer() else v) if math.isfinite(v) else None
        hist = {}
        bad = {i for i, v in zip(raw_idx, raw_absmax_vals, strict=False) if not math.isfinite(v)}
        bad.update(
            i for i, v in zip(fin_idx, data.get("final_absmax", []), strict=False) if not math.isfinite(v)
        )
        exact = self._exact_histograms([i for i in meta.get("hist_idx", []) if i in bad], raw)
        for i in meta.get("hist_idx", []):
            h = exact.get(i) or data[f"hist:{i}"]
            lo, hi = h[0], h[1]
            edges = [lo + (hi - lo) * j / HIST_BINS for j in range(HIST_BINS + 1)]
            final = h[2 + HIST_BINS :] if i in meta.get("hist_final", ()) else None  # None: no final gradient
            hist[self.params[i]] = {"edges": edges, "raw": h[2 : 2 + HIST_BINS], "final": final}
        modules: dict[str, dict[str, float]] = {}
        for (name, which), v in zip(mod_keys, data.get("modules", []), strict=True):
            modules.setdefault(name, {})["grad_output_norm" if which == "out" else "grad_input_norm"] = (
                math.sqrt(v)
            )
        for name, which in sorted(hooks.mod_expected - set(mod_keys)):  # hooked, never seen: say why
            entry: dict[str, Any] = modules.setdefault(name, {})
            entry["grad_output_norm" if which == "out" else "grad_input_norm"] = None
            entry["note"] = (
                "a gradient asked for was not seen: the tensor is a view of part of another one, "
                "modified in place later (its autograd history was rebuilt), or it took no part in the backward"
            )

        groups = self._group_host(
            data,
            counts,
            grad_norm_raw,
            grad_norm,
            scatter(raw_idx, raw_absmax_vals),
            absmax_final,
            nan_count,
            inf_count,
            update_ratio,
        )

        def total(vals: list[float | None]) -> float | None:
            xs = [v for v in vals if v is not None]
            return math.sqrt(sum(v * v for v in xs)) if xs else None

        return Snapshot(
            step=step,
            time=time.time(),
            config_version=config_version,
            loss=loss,
            scalars=scalars,
            lr=lr,
            grad_norm_raw=grad_norm_raw,
            grad_norm=grad_norm,
            grad_mean=mean,
            grad_std=std,
            grad_absmax_raw=scatter(raw_idx, raw_absmax_vals),
            grad_absmax=absmax_final,
            nan_count=nan_count,
            inf_count=inf_count,
            param_norm=list(data["param_norm"]),
            update_ratio=update_ratio,
            total_norm_raw=total(grad_norm_raw),
            total_norm=total(grad_norm),
            hook_effects=effects,
            hist=hist,
            modules=modules,
            ranks=spread,
            sampled_every=sampled_every,
            overhead=overhead,
            total_norm_backward=_backward_total(data, world),
            groups=groups,
            noise_scale=noise_scale,
            optim=self._optim_read(data, step, grad_norm),
            events=events,
        )
