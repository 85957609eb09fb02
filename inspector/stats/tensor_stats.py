"""Pure tensor -> statistics functions used by the telemetry.

The tensor functions keep everything on the gradients' device (0-dim or 1-D tensors: norms,
abs-max and histograms in float32, means and spreads in float64); the caller stacks the results
and moves them to the host once per snapshot, as float32. No ``.item()`` here.

Mean and std (:func:`moments`) are numerically stable whatever the mean: each tensor by
``torch.std_mean`` (Welford's update) on a GPU or when it is small, or each chunk of one by its
deviations from one of its own values, the chunks combined as Chan et al. do, in float64: a gradient of mean 1 and std
1e-4 reads 1e-4, a constant one 0 (a sum and a norm, ``var = (||g||^2 - n mean^2) / (n - 1)``,
lose every digit there).

Many small CPU tensors: there every ``torch._foreach_*`` op is a loop of a few microseconds a tensor,
so :class:`FlatPlan` reduces tensors of up to ``SEGMENT_MAX`` elements in flat passes over one
buffer (``torch.segment_reduce``, float64): norms, abs-max and moments of thousands of tensors in
a few ops; and larger ones of the same shape (up to ``STACK_MAX`` elements: a deep model's
repeated blocks) row by row of a stack of them.

Dtypes: float32 gradients take the fast path (one ``torch._foreach_norm`` in float32);
float16 and bfloat16 are reduced in float32 (norms, moments: never in their own precision);
float64 and complex gradients are reduced in their own precision and the result rounded
to float32. For a complex gradient the norm is of the complex values (a real number),
abs-max is the largest magnitude ``|z|``, std is torch's complex std
(``sqrt(sum |z - mean|^2 / (n - 1))``), the mean (a complex number) is reported null, and
histograms are of the magnitudes.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "foreach_norm",
    "FlatPlan",
    "absmax",
    "moments",
    "combine_moments",
    "raw_stats",
    "histograms",
    "exact_histograms",
    "dense",
    "device_constant",
    "wide_norm",
    "sq_norm",
    "clamp_abs_",
    "real_dtype",
    "value_range",
]

_HAS_NORM_DTYPE: bool | None = None
_FLOAT32_SUMS = (torch.float32, torch.float16, torch.bfloat16)  # reduced in float32 (dtype=float32)


def _norm_float32(tensors: list[Tensor], ord: float) -> list[Tensor]:
    """Norms of float32 / float16 / bfloat16 tensors, reduced in float32."""
    global _HAS_NORM_DTYPE
    if _HAS_NORM_DTYPE is not False:
        try:
            out = torch._foreach_norm(tensors, ord, dtype=torch.float32)
            _HAS_NORM_DTYPE = True
            return list(out)
        except TypeError:  # torch < 2.3 has no dtype argument
            _HAS_NORM_DTYPE = False
    up = [t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for t in tensors]
    return [n.float() for n in torch._foreach_norm(up, ord)]


# FlatPlan: on the CPU, tensors of at most SEGMENT_MAX elements are reduced in flat passes, when
# there are at least SEGMENT_COUNT of them
SEGMENT_MAX = 1024  # (above it, torch._foreach_* costs less than the copy into the flat buffer)
SEGMENT_COUNT = 32
# larger ones of up to STACK_MAX elements that share their shape with another are stacked: one copy
# and one reduction along the rows per stack of at most STACK_BYTES, instead of a few microseconds
# of dispatch a tensor (993 gradients of 2,304-4,608 float32 elements: their norms in 1.2 ms, not 4.3)
STACK_MAX = 1 << 16
STACK_BYTES = 1 << 20
LOOSE_PART = 1 << 20  # elements of a large tensor outside a stack taken at a time (8 MiB in float64)


def stack_parts(ts: list[Tensor], scratch: dict[torch.dtype, Tensor]) -> Iterator[tuple[int, Tensor]]:
    """``ts`` (CPU tensors of one shape and dtype, of at most ``STACK_BYTES`` each) copied a part at
    a time by one ``torch.stack`` into a scratch buffer of ``STACK_BYTES``: ``(first row, [rows,
    numel])``, a view of it. ``scratch`` holds one buffer per dtype, made at the first call and
    reused (a fresh buffer each time would cost its pages' faults)."""
    first = ts[0]
    numel = first.numel()
    per = max(1, STACK_BYTES // max(1, numel * first.element_size()))
    buf = scratch.get(first.dtype)
    if buf is None:
        buf = scratch[first.dtype] = torch.empty(STACK_BYTES // first.element_size(), dtype=first.dtype)
    for a in range(0, len(ts), per):
        part = ts[a : a + per]
        x = buf[: len(part) * numel].view(len(part), *first.shape)
        torch.stack(part, out=x)
        yield a, x.view(len(part), numel)


def row_norms(rows: Tensor) -> Tensor:
    """The 2-norm of each row of a 2-D tensor, as one 1-D float32 tensor, reduced as
    :func:`foreach_norm` reduces: in float32 (low precision too), float64 in its own."""
    wide = rows.dtype == torch.float64
    return torch.linalg.vector_norm(rows, dim=1, dtype=None if wide else torch.float32).float()


def foreach_norm(tensors: list[Tensor], ord: float = 2.0) -> list[Tensor]:
    """Per-tensor norms as float32 0-dim tensors, batched with ``torch._foreach_norm``.

    Low-precision tensors (fp16, bf16) are reduced in float32 (``dtype=`` where this torch
    supports it, an upcast copy otherwise); float64 and complex tensors in their own
    precision (a complex tensor's norm is real), one batch per dtype, then rounded to float32.
    """
    if not tensors:
        return []
    try:
        return _norm_float32(tensors, ord)  # the fast path: every float32 / fp16 / bf16 model
    except RuntimeError:  # float64 or complex among them: torch refuses dtype=float32 for those
        pass
    out: list[Tensor] = [torch.empty(0)] * len(tensors)
    for dt in {t.dtype for t in tensors}:
        idx = [i for i, t in enumerate(tensors) if t.dtype == dt]
        group = [tensors[i] for i in idx]
        norms = _norm_float32(group, ord) if dt in _FLOAT32_SUMS else torch._foreach_norm(group, ord)
        for i, n in zip(idx, norms, strict=True):
            out[i] = n.float()
    return out


def wide_norm(t: Tensor) -> Tensor:
    """The 2-norm of ``t`` reduced in float64 (complex128 for complex), as a float32 0-dim tensor:
    the norm of finite values whose float32 sum of squares overflows (values near 1e20 and up).
    Reads inf only where the norm itself is beyond float32's range (about 3.4e38)."""
    wide = t.to(torch.complex128) if t.is_complex() else t.double()
    return torch.linalg.vector_norm(wide).float()


def sq_norm(t: Tensor) -> Tensor:
    """The squared 2-norm of one tensor of any dtype (complex: of its values), float32 0-dim."""
    return foreach_norm([t])[0].pow(2)


def real_dtype(t: Tensor) -> torch.dtype:
    """The dtype of ``t``'s magnitudes: ``t.dtype``, or float32 / float64 for complex64 / complex128."""
    return t.real.dtype if t.is_complex() else t.dtype


def clamp_abs_(tensors: list[Tensor], threshold: float) -> None:
    """In place, each element's magnitude clamped to ``threshold``: real tensors to
    ``[-threshold, threshold]`` (batched), complex ones scaled to magnitude ``threshold``
    where larger, their phase kept (complex numbers have no order to clamp in)."""
    real = [t for t in tensors if not t.is_complex()]
    if real:
        torch._foreach_clamp_min_(real, -threshold)
        torch._foreach_clamp_max_(real, threshold)
    for t in tensors:
        if t.is_complex():
            t.mul_((threshold / t.abs()).clamp_(max=1.0))  # |z| = 0: inf, clamped to 1


SMALL_CPU = 1 << 14  # elements up to which the CPU's inf-norm kernel costs less than its calls


def absmax(tensors: list[Tensor]) -> Tensor:
    """Per-tensor largest absolute value (magnitude, for complex), as one 1-D float32 tensor.

    On CUDA one fused ``torch._foreach_norm(..., inf)``; on the CPU that kernel is several
    times slower than a min/max pass, so there (unless every tensor is small, up to
    ``SMALL_CPU`` elements) it is ``torch.aminmax`` per tensor, combined in two stacks (a
    complex tensor has no order: the max of its magnitudes). The fused kernel refuses an empty
    tensor: with one among them, every tensor takes the per-tensor path.
    """
    if not tensors:
        return torch.zeros(0)
    cuda = tensors[0].device.type == "cuda"
    if all(0 < t.numel() and (cuda or t.numel() <= SMALL_CPU) for t in tensors):
        # (small tensors: one op beats 2 per tensor; an empty one has no inf-norm in that kernel)
        return _stack(foreach_norm(tensors, math.inf))
    los, his = [], []
    for t in tensors:
        if t.numel() == 0:
            lo = hi = torch.zeros((), device=t.device)
        elif t.is_complex():
            lo, hi = torch.zeros((), device=t.device), t.abs().max()
        else:
            lo, hi = torch.aminmax(t)
        los.append(lo)
        his.append(hi)
    return torch.maximum(_stack(his), _stack(los).neg()).float()


SWEEP_MIN = 1 << 18  # CPU float32 tensors from this size get one fused sweep on sampled steps
SWEEP_CHUNK = 1 << 16  # elements per chunk of the sweep: stays in the CPU's cache between its ops


def raw_stats(tensors: list[Tensor]) -> tuple[Tensor, list[Tensor], dict[int, tuple[Tensor, Tensor]]]:
    """A sampled step's raw statistics: ``(abs-max 1-D, 2-norms, moments by position)``.

    ``absmax`` and ``foreach_norm`` of the tensors, except that a large contiguous float32 tensor
    on the CPU (``SWEEP_MIN`` elements and up) is swept once, ``SWEEP_CHUNK`` elements at a time:
    its norm, min, max, mean and spread are taken of each chunk while it is in the cache, so the
    memory is read once instead of four times (the moments are returned for :func:`moments`).
    Elsewhere (CUDA, small tensors) the batched kernels are cheaper, and the moments are left to
    ``moments``.
    """
    big = [
        k
        for k, t in enumerate(tensors)
        if t.numel() >= SWEEP_MIN and t.is_cpu and t.dtype == torch.float32 and t.is_contiguous()
    ]
    if not big:
        return absmax(tensors), foreach_norm(tensors), {}
    small = [k for k in range(len(tensors)) if k not in set(big)]
    norms: list[Tensor] = [torch.empty(0)] * len(tensors)
    ams: list[Tensor] = [torch.empty(0)] * len(tensors)
    if small:
        got = [tensors[k] for k in small]
        for k, n, a in zip(small, foreach_norm(got), absmax(got).unbind(), strict=True):
            norms[k], ams[k] = n, a
    known: dict[int, tuple[Tensor, Tensor]] = {}
    scratch = torch.empty(SWEEP_CHUNK)  # (the chunk's deviations: in the cache beside it)
    for k in big:
        ns, los, his, parts, counts = [], [], [], [], []
        for chunk in _chunks(tensors[k], SWEEP_CHUNK):
            ns.append(torch.linalg.vector_norm(chunk))
            lo, hi = torch.aminmax(chunk)
            los.append(lo)
            his.append(hi)
            parts.append(_shifted_sums(chunk, scratch))
            counts.append(chunk.numel())
        norms[k] = torch.linalg.vector_norm(torch.stack(ns))
        ams[k] = torch.maximum(torch.stack(his).amax(), torch.stack(los).amin().neg())
        known[k] = _shifted_moments(parts, counts)
    return torch.stack(ams), norms, known


def _stack(xs: list[Tensor]) -> Tensor:
    """``torch.stack(xs)`` of 0-dim tensors, on the first one's device when they are on several
    (a model split across devices: device-to-device copies, no host read)."""
    try:
        return torch.stack(xs)
    except RuntimeError:
        dev = xs[0].device
        return torch.stack([x.to(dev) for x in xs])


_CONSTANTS: dict[tuple[Any, ...], Tensor] = {}


def device_constant(values: tuple[Any, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device``, built once per (values, dtype, device):
    the first time by a pinned ``non_blocking`` copy, never again. A tensor made from host data and
    moved to a GPU from pageable memory is a copy that synchronises (torch waits for it), so the
    masks, indices and counts our statistics use on every sampled step come from here."""
    key = (device, dtype, values)
    got = _CONSTANTS.get(key)
    if got is None:
        got = torch.tensor(values, dtype=dtype)
        if device.type == "cuda":
            got = got.pin_memory().to(device, non_blocking=True)
        elif device.type != "cpu":
            got = got.to(device)
        if len(_CONSTANTS) > 256:  # models come and go in a long-lived process (a notebook)
            _CONSTANTS.clear()
        _CONSTANTS[key] = got
    return got


def combine_moments(means: Tensor, sdevs: Tensor, counts: Tensor | list[int]) -> tuple[Tensor, Tensor]:
    """Parts' ``(means, population stds, counts)``, one part an entry of the last dimension,
    combined as Chan et al. do, in float64 on their device: ``(mean, population std)`` of each
    whole (the last dimension reduced). The spread of the parts about the whole's mean is added as
    ``n_k |mean_k - mean|^2``, never as a difference of two large sums, so no digit is lost to
    cancellation. A complex mean stays complex."""
    wide = torch.complex128 if means.is_complex() else torch.float64
    m = means.to(wide)
    sd = sdevs.to(torch.float64)
    if isinstance(counts, Tensor):
        n = counts.to(sd.device, torch.float64)
    else:  # host data: on the device once (a list moved to a GPU is a copy that synchronises)
        n = device_constant(tuple(counts), torch.float64, sd.device)
    total = n.sum(-1)
    ref = m[..., :1]  # (about the first part's mean: equal parts' mean is that mean, exactly)
    mean = ref.squeeze(-1) + (n * (m - ref)).sum(-1) / total
    m2 = (n * sd * sd).sum(-1) + (n * (m - mean.unsqueeze(-1)).abs().square()).sum(-1)
    return mean, (m2 / total).sqrt()


MOMENT_CHUNK = 1 << 16  # elements a chunk of the moments: it and its deviations stay in a CPU's cache
# up to this many elements torch.std_mean is the cheaper on a CPU (not vectorised there, about 5 ns an
# element, against the shifted sums' few ops of a few us each: a small model's tensors, a bias)
WELFORD_MAX = 1 << 13


def _shifted_sums(chunk: Tensor, scratch: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A chunk's ``(x0, sum, norm)`` of its deviations ``d = x - x0`` from its own first value
    ``x0`` (into ``scratch``, a 1-D buffer of at least its size and its dtype): three reads of a
    chunk still in the cache. :func:`_shifted_moments` makes its mean and spread of them."""
    dev = torch.sub(chunk, chunk[0], out=scratch[: chunk.numel()])
    return chunk[0], dev.sum(), torch.linalg.vector_norm(dev)


def _shifted_moments(parts: list[tuple[Tensor, Tensor, Tensor]], counts: list[int]) -> tuple[Tensor, Tensor]:
    """The whole's ``(mean, population std)`` in float64 from its chunks' :func:`_shifted_sums`.
    Each chunk's ``M2 = ||d||^2 - |sum d|^2 / n``: shifted by a value of the chunk, that difference
    loses only what the spread about that value loses (a constant chunk reads exactly 0), where
    unshifted it loses ``mean^2 / std^2`` of its precision; the chunks then combine by
    :func:`combine_moments`. One stack and a few ops per tensor, whatever its chunks."""
    x0, s1, nrm = (torch.stack(v) for v in zip(*parts, strict=True))
    wide = torch.complex128 if s1.is_complex() else torch.float64
    s1, nrm = s1.to(wide), nrm.to(torch.float64)
    n = device_constant(tuple(counts), torch.float64, nrm.device)
    means = x0.to(wide) + s1 / n
    sdevs = ((nrm * nrm - s1.abs().square() / n).clamp_min(0.0) / n).sqrt()
    if len(counts) == 1:
        return means[0], sdevs[0]
    return combine_moments(means, sdevs, n)


def moments(
    tensors: list[Tensor], known: dict[int, tuple[Tensor, Tensor]] | None = None
) -> list[tuple[Tensor, Tensor]]:
    """Per tensor ``(mean, population std)``, 0-dim on its device, numerically stable whatever the
    mean (the module docstring). On a GPU, and for a tensor of at most ``WELFORD_MAX`` elements
    anywhere, ``torch.std_mean`` of the tensor (Welford's update, one pass; a small float16/bfloat16
    one converted to float32 first); else ``MOMENT_CHUNK`` elements at a time
    (converted to float32 where they are not), each chunk's moments shifted by one of its values
    (:func:`_shifted_moments`: on a CPU far cheaper than ``std_mean``, which is not vectorised
    there), the chunks combined by :func:`combine_moments`. The scratch is one chunk, never a copy
    of the tensor. The host makes the unbiased std, ``sqrt(n / (n - 1))`` times this one.
    ``known``: moments already taken, by position (:func:`raw_stats`). NaN and Inf pass through
    (as NaN or Inf)."""
    known = known or {}
    out = []
    scratch: dict[tuple[torch.device, torch.dtype], Tensor] = {}
    for k, t in enumerate(tensors):
        if k in known:
            out.append(known[k])
            continue
        t = t.detach()
        half = t.dtype in (torch.float16, torch.bfloat16)
        if t.numel() == 0:
            zero = torch.zeros((), dtype=torch.float64, device=t.device)
            out.append((zero, zero))
        elif (t.is_cuda and not half) or t.numel() <= WELFORD_MAX:
            sd, m = torch.std_mean(t.float() if half else t, correction=0)
            out.append((m, sd))
        else:
            dtype = torch.float32 if half else t.dtype
            buf = scratch.get((t.device, dtype))
            if buf is None:
                buf = scratch[(t.device, dtype)] = torch.empty(MOMENT_CHUNK, dtype=dtype, device=t.device)
            parts, counts = [], []
            for chunk in _chunks(t, MOMENT_CHUNK):
                parts.append(_shifted_sums(chunk.float() if half else chunk, buf))
                counts.append(chunk.numel())
            out.append(_shifted_moments(parts, counts))
    return out


def _hist_values(x: Tensor) -> Tensor:
    """The float32 values a histogram counts, flattened: magnitudes for complex."""
    x = x.detach().reshape(-1)
    if x.is_complex():
        x = x.abs()
    return x if x.dtype == torch.float32 else x.float()


def _finite_range(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(finite mask, min, max)`` of ``x``'s finite values, on device with no host read: the min
    is ``+inf`` and the max ``-inf`` when there is none. Non-finite values are masked by
    ``torch.where``, never by boolean indexing (a gather whose size the host must read on CUDA)."""
    fin = torch.isfinite(x)
    lo = torch.where(fin, x, math.inf).amin() if x.numel() else torch.full((), math.inf, device=x.device)
    hi = torch.where(fin, x, -math.inf).amax() if x.numel() else torch.full((), -math.inf, device=x.device)
    return fin, lo, hi


def value_range(raw: Tensor, final: Tensor | None) -> Tensor:
    """``[-min, max]`` of the finite values :func:`histograms` would count (float32, on device;
    ``-inf`` for no values): a max across ranks of these is the range of a sharded tensor's histogram."""
    out = torch.full((2,), -math.inf, device=raw.device)
    for x in (raw, final):
        if x is not None:
            _, lo, hi = _finite_range(_hist_values(x))
            out = torch.maximum(out, torch.stack([-lo, hi]))
    return out


# elements binned at a time: a histogram's scratch is bounded by it, whatever the gradient's dtype
# (a chunk of a gradient that is not float32 is converted into the scratch, never the whole of it)
HIST_CHUNK = 1 << 18


def _flat_values(x: Tensor) -> Tensor:
    """``x``'s values as a 1-D view, in memory order where it is not contiguous but dense (a
    transposed or channels_last gradient): what a histogram or a range counts does not depend on
    the order, and ``reshape(-1)`` would copy the whole of it."""
    x = x.detach()
    if not x.is_contiguous() and _dense_in_memory(x):
        return x.as_strided((x.numel(),), (1,))
    return x.reshape(-1)


def _dense_in_memory(x: Tensor) -> bool:
    """Whether ``x``'s elements fill one block of memory, each once (some order of its dimensions
    is contiguous): torch's "non-overlapping and dense"."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(x.shape, x.stride(), strict=True) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _chunks(x: Tensor, size: int = HIST_CHUNK) -> Iterator[Tensor]:
    """``x``'s values (:func:`_flat_values`) as 1-D views of ``size`` elements (the last shorter)."""
    flat = _flat_values(x)
    for at in range(0, flat.numel(), size):
        yield flat[at : at + size]


def _chunk_range(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(min, max)`` of the values a histogram counts (magnitudes for complex), float32 0-dim;
    ``(inf, -inf)`` for none. One ``aminmax`` of a real tensor (in its own dtype: its min and max
    are its own values, exactly); a complex one's magnitudes a chunk at a time."""
    dev = x.device
    if x.numel() == 0:
        return torch.full((), math.inf, device=dev), torch.full((), -math.inf, device=dev)
    if not x.is_complex():
        lo, hi = torch.aminmax(_flat_values(x))
        return lo.float(), hi.float()
    ranges = [torch.aminmax(c.abs()) for c in _chunks(x)]
    return (
        torch.stack([r[0] for r in ranges]).amin().float(),
        torch.stack([r[1] for r in ranges]).amax().float(),
    )


def histograms(
    raw: Tensor, final: Tensor | None, bins: int = 64, *, span: Tensor | None = None, exact: bool = False
) -> Tensor:
    """Histograms of ``raw`` and ``final`` over common edges, on device with no host read: the
    layout of :func:`exact_histograms`, which gives the result for tensors with NaN or Inf values.

    For finite values (the usual case) this is the same arithmetic as :func:`exact_histograms` in
    fewer passes and bounded memory: the range from one ``torch.aminmax`` per tensor, then bins
    taken :data:`HIST_CHUNK` elements at a time in a float32 scratch (a chunk of another dtype is
    converted into it; a complex one's magnitudes; a dense tensor is read in memory order, whatever
    its strides), so nothing full-size is made (:func:`exact_histograms`, the rare path and a
    sharded tensor's, makes full-size temporaries). A tensor holding NaN or Inf gets counts that
    are meaningless but safe (every index in range): the caller, who learns from the same transfer
    that its abs-max is not finite, takes :func:`exact_histograms` then (``exact=True``). With a
    ``span`` (a sharded tensor's range across ranks) it is :func:`exact_histograms`.
    """
    if span is not None or exact:
        return exact_histograms(raw, final, bins, span=span)
    same = final is not None and _same_values(raw, final)  # no hook edited it: count it once
    xs = [raw] + ([final] if final is not None and not same else [])
    dev = xs[0].device
    ranges = [_chunk_range(x) for x in xs]
    if len(xs) > 1:
        lo, hi = torch.stack([r[0] for r in ranges]).amin(), torch.stack([r[1] for r in ranges]).amax()
    else:
        lo, hi = ranges[0]
    lo, hi, scale = _edges(lo, hi, bins, dev)
    parts = [lo.reshape(1), hi.reshape(1)]
    cpu = dev.type == "cpu"
    size = min(max(x.numel() for x in xs), HIST_CHUNK)
    # scratch for one chunk, filled in place (a fresh tensor per op would fault its pages in)
    buf = torch.empty(size, device=dev)
    ibuf = torch.empty(size, dtype=torch.uint8 if cpu and bins <= 256 else torch.int32, device=dev)
    for x in xs:
        c = torch.zeros(bins, device=dev)
        for chunk in _chunks(x):
            t, idx = buf[: chunk.numel()], ibuf[: chunk.numel()]
            if chunk.dtype == torch.float32:
                torch.sub(chunk, lo, out=t)
            else:  # (float16, bfloat16, float64: converted a chunk at a time; complex: magnitudes)
                t.copy_(chunk.abs() if chunk.is_complex() else chunk).sub_(lo)
            t.mul_(scale).nan_to_num_(0.0, bins - 1, 0.0).clamp_(0, bins - 1)
            idx.copy_(t)  # truncated, as .to() does: the bin
            if cpu:
                c += torch.bincount(idx, minlength=bins)
            else:  # (bincount would read its input's max on the host to size its output)
                c.index_add_(0, idx, torch.ones((), device=dev).expand_as(chunk))
        parts.append(c)
    if same:
        parts.append(parts[-1])
    return torch.cat(parts)


def _edges(lo: Tensor, hi: Tensor, bins: int, dev: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """``(lo, hi, bins / (hi - lo))`` of a histogram: ``[0, 1]`` where no value is finite, and a
    width for a single value."""
    some = torch.isfinite(lo) & torch.isfinite(hi)
    lo = torch.where(some, lo, torch.zeros((), device=dev))
    hi = torch.where(some, hi, torch.ones((), device=dev))
    hi = torch.where(hi > lo, hi, lo + 1e-12 + lo.abs() * 1e-6)
    return lo, hi, bins / (hi - lo)


def exact_histograms(
    raw: Tensor, final: Tensor | None, bins: int = 64, *, span: Tensor | None = None
) -> Tensor:
    """Histograms of the finite values of ``raw`` and ``final`` over common edges, entirely on
    device and with no host read.

    Returns a float32 tensor ``[lo, hi, raw_counts(bins), final_counts(bins)]``, or
    ``[lo, hi, raw_counts(bins)]`` when ``final`` is None (the optimizer sees no gradient: a
    frozen parameter has no final histogram, not a copy of the raw one); the edges are
    ``linspace(lo, hi, bins + 1)``. A complex tensor's histogram is of its magnitudes. NaN and
    Inf values are left out: they go to an extra bin that is dropped (``torch.where``, not
    boolean indexing, which would make the host wait to size its result). ``histc`` would want its
    min and max as Python numbers: counts come from ``bincount`` on the CPU and from ``index_add_``
    on accelerators (where ``bincount`` would sync to size its output). ``span`` (``[-min, max]``
    from :func:`value_range`, maxed across the ranks of a sharded tensor) gives the range instead
    of these values' own.
    """
    same = final is not None and _same_values(raw, final)  # no hook edited it: count it once
    xs = [_hist_values(raw)] + ([_hist_values(final)] if final is not None and not same else [])
    dev = xs[0].device
    ranged = [_finite_range(x) for x in xs]
    if span is None:
        lo = torch.stack([r[1] for r in ranged]).amin()
        hi = torch.stack([r[2] for r in ranged]).amax()
    else:
        lo, hi = -span[0], span[1]
    lo, hi, scale = _edges(lo, hi, bins, dev)  # no finite value anywhere: the range [0, 1]

    def counts(x: Tensor, fin: Tensor) -> Tensor:
        if x.numel() == 0:
            return torch.zeros(bins, device=dev)
        pos = torch.where(fin, ((x - lo) * scale).clamp(0, bins - 1), bins)  # non-finite: bin `bins`
        idx = pos.long()
        if dev.type == "cpu":
            return torch.bincount(idx, minlength=bins + 1)[:bins].float()
        c = torch.zeros(bins + 1, device=dev)
        c.index_add_(0, idx, torch.ones((), device=dev).expand_as(x))
        return c[:bins]

    parts = [lo.reshape(1), hi.reshape(1)] + [counts(x, r[0]) for x, r in zip(xs, ranged, strict=True)]
    if same:
        parts.append(parts[-1])
    return torch.cat(parts)


def _same_values(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors are views of the same values (the raw gradient kept by reference)."""
    return (
        a.layout == b.layout == torch.strided
        and a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def dense(g: Tensor) -> Tensor:
    """The tensor statistics are taken of: the stored values of a sparse gradient, else ``g``."""
    if g.layout != torch.strided:
        return g.coalesce().values()
    return g


_SHAPE = operator.attrgetter("shape")
_KIND = operator.attrgetter("layout", "dtype", "is_cpu")


class FlatPlan:
    """Many small CPU tensors (the parameters, or their gradients) reduced together in flat passes.

    On the CPU every ``torch._foreach_*`` op and every per-tensor op costs a few microseconds a
    tensor whatever its size, so at thousands of tiny tensors the statistics would take a large
    share of the training step. Tensors of at most ``SEGMENT_MAX`` elements are instead copied into
    one flat buffer and reduced per tensor with ``torch.segment_reduce`` in float64: 2-norms,
    abs-max, and the moments (mean, then the deviations from it: two passes, stable whatever the
    mean, as :func:`moments`). The copy is one ``torch.cat`` along the first dimension per kind of
    tensor (same trailing shape: all the ``[4, 4]`` weights, then all the ``[4]`` biases), which
    costs less a tensor than flattening each; the values are put back in parameter order at the
    end. The larger tensors of up to ``STACK_MAX`` elements that share their shape with another
    are stacked, at most ``STACK_BYTES`` a stack, and reduced along its rows with the same float64
    arithmetic (the 2-norms alone in float32, as ``foreach_norm``); the others take the usual
    functions. Made once from the parameters (:meth:`of`);
    it applies to a list aligned with them that :meth:`fits` (every parameter's gradient present,
    dense, of the planned shape, on the CPU, one real float dtype).
    """

    def __init__(self, tensors: list[Tensor]) -> None:
        self.n = len(tensors)
        self.shapes = list(map(_SHAPE, tensors))  # (what fits() checks every list against)
        self.small = [k for k, t in enumerate(tensors) if t.numel() <= SEGMENT_MAX]
        self.large = [k for k, t in enumerate(tensors) if t.numel() > SEGMENT_MAX]
        # the small ones by kind (ndim >= 1 and the trailing shape; 0-dim ones flattened one by one)
        kinds: dict[Any, list[int]] = {}
        for j, k in enumerate(self.small):
            t = tensors[k]
            kinds.setdefault(tuple(t.shape[1:]) if t.dim() else None, []).append(j)
        self._kinds = list(kinds.items())
        order = [j for _, js in self._kinds for j in js]  # positions in self.small, in buffer order
        numels = [tensors[self.small[j]].numel() for j in order]
        self.small_numel = sum(numels)
        self.lengths = torch.tensor(numels, dtype=torch.long)
        self.empty = self.lengths == 0
        self._order = None if order == list(range(len(order))) else torch.tensor(order, dtype=torch.long)
        self.small_idx = torch.tensor(self.small, dtype=torch.long)
        self.large_idx = torch.tensor(self.large, dtype=torch.long)
        # the large ones by shape (positions in self.large): stacks of two and more, and the rest
        shapes: dict[Any, list[int]] = {}
        for j, k in enumerate(self.large):
            if tensors[k].numel() <= STACK_MAX:
                shapes.setdefault(tuple(tensors[k].shape), []).append(j)
        self._stacks = [js for js in shapes.values() if len(js) > 1]
        stacked = {j for js in self._stacks for j in js}
        self._loose = [j for j in range(len(self.large)) if j not in stacked]
        self._stack_idx = [torch.tensor(js, dtype=torch.long) for js in self._stacks]
        self._loose_idx = torch.tensor(self._loose, dtype=torch.long)
        self._scratch: dict[torch.dtype, Tensor] = {}  # one stack's buffer per dtype, reused

    @staticmethod
    def of(tensors: list[Tensor]) -> FlatPlan | None:
        """A plan for these parameters, or None where it does not apply (not all on the CPU, not
        one real float dtype, fewer than ``SEGMENT_COUNT`` small ones)."""
        if len(tensors) < SEGMENT_COUNT:
            return None
        dt = tensors[0].dtype
        if dt not in _FLOAT32_SUMS and dt != torch.float64:
            return None
        if any(t.dtype != dt or not t.is_cpu or t.layout != torch.strided for t in tensors):
            return None
        plan = FlatPlan(tensors)
        return plan if len(plan.small) >= SEGMENT_COUNT else None

    def fits(self, xs: list[Tensor]) -> bool:
        """Whether ``xs`` (a list aligned with the parameters) can take the plan: every one there,
        of its parameter's planned shape, dense (strided), on the CPU, all of one real float dtype
        (the plan's or another: a model turned to float64 still fits). Each tensor is checked (its
        shape, and one set of (layout, dtype, on the CPU) over all: well under a microsecond a
        tensor), not only the first and last: a sparse gradient anywhere (its stored values are
        not its parameter's shape), a parameter moved off the CPU or to a complex dtype, takes the
        per-tensor path."""
        # (compared one by one as they are made: a list of 10,000 new torch.Size objects cost a
        # garbage collection pass or two, 18 ms, where this costs 1.5)
        if len(xs) != self.n or not all(map(operator.eq, map(_SHAPE, xs), self.shapes)):
            return False
        kinds = set(map(_KIND, xs))
        if len(kinds) != 1:
            return False
        layout, dtype, cpu = kinds.pop()
        return layout == torch.strided and cpu and (dtype in _FLOAT32_SUMS or dtype == torch.float64)

    def flat(self, xs: list[Tensor]) -> Tensor:
        """The small ones copied into one new 1-D buffer (their dtype), kind by kind."""
        small = xs if not self.large else [xs[k] for k in self.small]
        parts = []
        for key, js in self._kinds:
            group = [small[j] for j in js]
            if key is None:  # 0-dim tensors
                parts.append(torch.stack(group))
            else:
                parts.append(torch.cat(group).reshape(-1))
        return torch.cat(parts) if len(parts) > 1 else parts[0]  # (cat and stack copy: never a view)

    def _seg(self, flat: Tensor, how: str) -> Tensor:
        """Per small tensor, in buffer order."""
        return torch.segment_reduce(flat, how, lengths=self.lengths, unsafe=True)

    def _unorder(self, v: Tensor) -> Tensor:
        """Per small tensor from buffer order to the order of ``self.small``."""
        return v if self._order is None else torch.empty_like(v).index_copy_(0, self._order, v)

    def _merge(self, small: Tensor, large: list[Tensor] | Tensor, dtype: torch.dtype) -> Tensor:
        small = self._unorder(small)
        if not self.large:
            return small.to(dtype)
        out = torch.empty(self.n, dtype=dtype)
        out.index_copy_(0, self.small_idx, small.to(dtype))
        out.index_copy_(0, self.large_idx, (large if isinstance(large, Tensor) else _stack(large)).to(dtype))
        return out

    @property
    def cheap_norms(self) -> bool:
        """Whether :meth:`norms` costs less than ``foreach_norm`` of the same tensors: every
        large one stacked (with large ones outside a stack the fused norm alone is cheaper)."""
        return not self._loose

    def _rows(self, js: list[int], large: list[Tensor]) -> Iterator[Tensor]:
        """The stack of ``large[j]`` for ``j`` in ``js`` (all of one shape), as 2-D ``[rows,
        numel]`` copies of at most ``STACK_BYTES`` each, in order (:func:`stack_parts`)."""
        for _, rows in stack_parts([large[j] for j in js], self._scratch):
            yield rows

    def _large_norms(self, large: list[Tensor]) -> Tensor:
        """2-norms (1-D float32, aligned with ``large``) of the large tensors: by stacks, the
        rest by ``foreach_norm``."""
        if not self._stacks:
            return _stack(foreach_norm(large))
        out = torch.empty(len(large), dtype=torch.float32)
        for js, at in zip(self._stacks, self._stack_idx, strict=True):
            out.index_copy_(0, at, torch.cat([row_norms(rows) for rows in self._rows(js, large)]))
        if self._loose:
            out.index_copy_(0, self._loose_idx, _stack(foreach_norm([large[j] for j in self._loose])))
        return out

    def _large_stats(self, large: list[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(abs-max, 2-norms)`` in float32 and ``(means, population stds)`` in float64 of the
        large tensors, each 1-D and aligned with ``large``: the stacks' rows in float64 (the mean,
        then the deviations from it, as the flat buffer's), the rest by :func:`raw_stats` and
        :func:`moments`."""
        n = len(large)
        am, norms = torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.float32)
        mean, sd = torch.empty(n, dtype=torch.float64), torch.empty(n, dtype=torch.float64)
        for js, at in zip(self._stacks, self._stack_idx, strict=True):
            got: list[list[Tensor]] = [[], [], [], []]
            for rows in self._rows(js, large):
                f = rows.double()
                m = f.mean(1)
                got[2].append(m)
                got[1].append(f.square().sum(1).sqrt_())
                got[3].append((f - m.unsqueeze(1)).square_().mean(1).sqrt_())
                got[0].append(f.abs_().amax(1))
            for out, vals in zip((am, norms, mean, sd), got, strict=True):
                out.index_copy_(0, at, torch.cat(vals).to(out.dtype))
        if self._loose:
            loose = [large[j] for j in self._loose]
            lam, lnorms, known = raw_stats(loose)
            moms = moments(loose, known)
            at = self._loose_idx
            am.index_copy_(0, at, lam.float())
            norms.index_copy_(0, at, _stack(lnorms).float())
            mean.index_copy_(0, at, _stack([m.real.double() for m, _ in moms]))
            sd.index_copy_(0, at, _stack([s.double() for _, s in moms]))
        return am, norms, mean, sd

    def norms_of_flat(self, flat: Tensor, large: list[Tensor]) -> Tensor:
        """2-norms (float32, all ``n``) from :meth:`flat`'s buffer and the large tensors."""
        small = self._seg(flat.double().square_(), "sum").sqrt_()
        return self._merge(small, self._large_norms(large) if large else [], torch.float32)

    def adam_state(
        self, m: list[Tensor], v: list[Tensor], thresholds: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """For an Adam state aligned with the parameters (``m`` and ``v`` fit the plan): per tensor
        ``||m||``, ``sum(v)`` and how many elements of ``v`` are below the tensor's threshold
        (``thresholds``: float64, one per tensor, in parameter order), each as one 1-D float32
        tensor over all ``n``. The small ones from two flat copies in float64; the stacked large
        ones along their stacks' rows (``v`` in float64 too); the rest one op a tensor."""
        fv = self.flat(v).double()
        sums = self._seg(fv, "sum")
        thr = thresholds.index_select(0, self.small_idx) if self.large else thresholds
        if self._order is not None:
            thr = thr.index_select(0, self._order)
        per_element = torch.repeat_interleave(thr, self.lengths, output_size=fv.numel())
        below = self._seg(fv.lt_(per_element), "sum")  # (fv is a copy: compared in place)
        mnorm = self._seg(self.flat(m).double().square_(), "sum").sqrt_()
        if not self.large:
            return tuple(self._merge(x, [], torch.float32) for x in (mnorm, sums, below))  # type: ignore[return-value]
        lm, lv = [m[k] for k in self.large], [v[k] for k in self.large]
        lsums, lbelow = self._large_sums_below(lv, thresholds.index_select(0, self.large_idx))
        return (
            self._merge(mnorm, self._large_norms(lm), torch.float32),
            self._merge(sums, lsums, torch.float32),
            self._merge(below, lbelow, torch.float32),
        )

    def _large_sums_below(self, large: list[Tensor], thresholds: Tensor) -> tuple[Tensor, Tensor]:
        """Per large tensor (aligned with ``large`` and ``thresholds``): its sum and how many of its
        elements are below its threshold, both float64; the stacks' rows compared in float64 (as
        the flat buffer's), the rest one op a tensor."""
        n = len(large)
        sums, below = torch.empty(n, dtype=torch.float64), torch.empty(n, dtype=torch.float64)
        for js, at in zip(self._stacks, self._stack_idx, strict=True):
            got: list[list[Tensor]] = [[], []]
            a = 0
            for rows in self._rows(js, large):
                f = rows.double()
                t = thresholds.index_select(0, at[a : a + f.shape[0]]).unsqueeze(1)
                a += f.shape[0]
                got[0].append(f.sum(1))
                got[1].append(torch.count_nonzero(f < t, dim=1))
            sums.index_copy_(0, at, torch.cat(got[0]))
            below.index_copy_(0, at, torch.cat(got[1]).double())
        for j in self._loose:  # (in parts of LOOSE_PART elements: bounded scratch at any size)
            parts = large[j].reshape(-1).split(LOOSE_PART)
            sums[j] = torch.stack([x.double().sum() for x in parts]).sum()
            below[j] = torch.stack([torch.count_nonzero(x.double() < thresholds[j]) for x in parts]).sum()
        return sums, below

    def sums_of_flat(self, flat: Tensor) -> Tensor:
        """Per-tensor sums (float32, all ``n``; summed in float64) of a buffer laid out as :meth:`flat`'s,
        for a plan with no large tensor (the dot products of two such buffers, multiplied)."""
        return self._merge(self._seg(flat.double(), "sum"), [], torch.float32)

    def norms(self, xs: list[Tensor]) -> Tensor:
        """Per-tensor 2-norms as one 1-D float32 tensor."""
        return self.norms_of_flat(self.flat(xs), [xs[k] for k in self.large])

    def stats(self, xs: list[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(abs-max, 2-norms)`` in float32 and ``(means, population stds)`` in float64, each one
        1-D tensor over all ``n`` (as :func:`raw_stats` and :func:`moments` take them)."""
        f = self.flat(xs).double()
        sums = self._seg(f, "sum")
        count = self.lengths.clamp(min=1).double()
        mean = sums / count
        dev = f - torch.repeat_interleave(mean, self.lengths, output_size=f.numel())
        var = self._seg(dev.square_(), "sum") / count
        sq = self._seg(f.square(), "sum")
        am = self._seg(f.abs_(), "max")
        am = torch.where(self.empty, torch.zeros((), dtype=am.dtype), am)
        mean = torch.where(self.empty, torch.zeros((), dtype=mean.dtype), mean)
        small = (am, sq.sqrt_(), mean, var.sqrt_())
        if not self.large:
            return (
                self._unorder(small[0]).float(),
                self._unorder(small[1]).float(),
                self._unorder(small[2]),
                self._unorder(small[3]),
            )
        lam, lnorms, lmean, lsd = self._large_stats([xs[k] for k in self.large])
        return (
            self._merge(small[0], lam, torch.float32),
            self._merge(small[1], lnorms, torch.float32),
            self._merge(small[2], lmean, torch.float64),
            self._merge(small[3], lsd, torch.float64),
        )
