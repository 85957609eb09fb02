"""The update-to-parameter ratio ``||delta theta|| / ||theta||`` within a memory bound.

The update norm needs the parameters from before ``optimizer.step()``. A full copy would cost as
much device memory as the model itself, so :class:`UpdateProbe` keeps at most ``BUDGET`` (10 %)
of the parameters' bytes, or ``FLOOR`` bytes when that is more (a small model is kept whole):

- while everything fits, every parameter is kept whole, and the ratio is exact;
- otherwise the small parameters (up to ``SMALL`` elements: biases, norms) are kept whole, and
  each larger one as every ``s``-th block of ``BLOCK`` consecutive elements of its flattened
  values, ``s`` the smallest stride that keeps the total within the budget (at least 2), moved up
  to be coprime with the number of block positions in a row, so that the blocks fall on every
  column of every row in turn (an update that lives in some columns is neither missed nor
  overweighted). Its
  update norm is then estimated as ``||delta_S|| * sqrt(numel / |S|)``: for the large tensors of
  a real model (``|S|`` in the thousands and up) within a few percent.

Blocks of a cache line, not every ``s``-th element: a copy of every ``s``-th element with ``s``
under 16 touches every cache line of the parameter (a full pass over its memory, twice per
sampled step), while blocks are read only where they are kept.

The buffers are allocated once, at the first sampled step, in each parameter's dtype and on its
device (this rank's shard under FSDP2), and filled on sampled steps only; taking the ratio costs
one block-strided copy before the update, an in-place subtraction and one batched norm after it.
On the CPU, where each op costs a few microseconds a tensor whatever its size, the parameters of
one shape, dtype and stride (a deep model's repeated blocks) share one buffer, a row each (each
parameter's buffer is its row): they are copied whole into a reused scratch of ``STACK_BYTES``,
a part at a time with one ``torch.stack``, sampled there (one view a part, not one a tensor),
kept or subtracted, and the differences reduced along the rows.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from .tensor_stats import STACK_MAX, foreach_norm, row_norms, stack_parts

__all__ = [
    "BLOCK",
    "BUDGET",
    "FLOOR",
    "SMALL",
    "UpdateProbe",
    "sample_numel",
    "sample_view",
    "stack_groups",
    "stacked_samples",
    "strides",
]

BUDGET = 0.10  # the largest share of the parameters' bytes kept
FLOOR = 1 << 20  # bytes always allowed (a model under 10 MiB may keep more than 10 %)
SMALL = 4096  # parameters up to this many elements are kept whole when strides are needed
BLOCK = 16  # elements per block kept or left (64 bytes in float32: a cache line)


def _block(shape: torch.Size) -> int:
    """The length of a block that is kept or left whole: ``BLOCK``, or all of a smaller tensor."""
    return max(1, min(BLOCK, math.prod(shape)))


def sample_numel(shape: torch.Size, s: int) -> int:
    """How many elements a parameter of ``shape`` sampled at stride ``s`` keeps."""
    n = math.prod(shape)
    if s == 1:
        return n
    b = _block(shape)
    return math.ceil((n // b) / s) * b


def _coprime(s: int, shape: torch.Size) -> int:
    """``s`` moved up until the blocks it keeps fall on every column of the last dimension: a block
    starts ``s * BLOCK`` elements after the previous one, so ``s`` must be coprime with the number
    of block positions in a row (``last // gcd(BLOCK, last)``). Else every row keeps the same
    columns (s = 8 on a 1024-wide weight: 8 of its 64 block columns), and an update that lives in
    some columns (SGD's, which follows the input features) is missed or overweighted."""
    last = int(shape[-1]) if len(shape) >= 2 else 1
    period = last // math.gcd(BLOCK, last) if last > 1 else 1
    while period > 1 and math.gcd(s, period) != 1:
        s += 1
    return s


def strides(shapes: list[torch.Size], itemsizes: list[int]) -> list[int]:
    """The block stride each parameter is sampled with (1: kept whole), within the budget above."""
    sizes = [math.prod(s) * b for s, b in zip(shapes, itemsizes, strict=True)]
    total = sum(sizes)
    budget = max(BUDGET * total, FLOOR)
    if total <= budget:
        return [1] * len(shapes)
    small = [math.prod(s) <= SMALL for s in shapes]
    whole = sum(b for b, sm in zip(sizes, small, strict=True) if sm)
    rest = total - whole
    room = budget - whole
    if room <= 0:  # many small parameters: sample them too
        small, room, rest = [False] * len(shapes), budget, total
    base = max(2, math.ceil(rest / room))
    # whole blocks round the sample up: widen the stride until it fits, at most until every sampled
    # parameter keeps one block (then, if the small ones kept whole still do not fit, they are
    # sampled too; past that, the smallest sample there is)
    widest = max([math.prod(x) // _block(x) for x in shapes] + [base]) + 1
    for s in range(base, widest + 1):
        out = [1 if sm else _coprime(s, x) for x, sm in zip(shapes, small, strict=True)]
        kept = sum(sample_numel(x, k) * b for x, k, b in zip(shapes, out, itemsizes, strict=True))
        if kept <= budget:
            return out
    if any(small):
        return _strides_all(shapes, itemsizes, budget, widest)
    return out


def _strides_all(shapes: list[torch.Size], itemsizes: list[int], budget: float, widest: int) -> list[int]:
    """``strides`` with every parameter sampled (the small ones kept whole did not fit)."""
    base = max(2, math.ceil(sum(math.prod(x) * b for x, b in zip(shapes, itemsizes, strict=True)) / budget))
    for s in range(base, widest + 1):
        out = [_coprime(s, x) for x in shapes]
        if sum(sample_numel(x, k) * b for x, k, b in zip(shapes, out, itemsizes, strict=True)) <= budget:
            return out
    return [_coprime(widest, x) for x in shapes]


def _flat(p: Tensor) -> Tensor:
    return p.reshape(-1)  # a view of a contiguous parameter (a copy otherwise, transient)


def _sample(p: Tensor, s: int) -> Tensor:
    """Every ``s``-th block of ``p`` (a view), or ``p`` flattened for ``s == 1``."""
    f = _flat(p)
    if s == 1:
        return f
    b = _block(p.shape)
    rows = f.numel() // b
    return f[: rows * b].view(rows, b)[::s]


def sample_view(t: Tensor, s: int) -> Tensor:
    """The elements of ``t`` (a parameter, or a tensor of its shape: its gradient) that a parameter
    sampled at stride ``s`` keeps, as a view where ``t`` is contiguous (see the module docstring)."""
    return _sample(t, s)


_STACKED = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def stack_groups(ps: list[Tensor], strides_: list[int]) -> list[list[int]]:
    """The CPU tensors of ``ps`` (parameters, or tensors of their shapes) that share a shape, a
    float dtype and a stride, at most ``STACK_MAX`` elements each, two or more: their indices,
    group by group (what :func:`stacked_samples` takes)."""
    kinds: dict[Any, list[int]] = {}
    for i, p in enumerate(ps):
        if p.is_cpu and p.dtype in _STACKED and p.layout == torch.strided and 0 < p.numel() <= STACK_MAX:
            kinds.setdefault((tuple(p.shape), p.dtype, strides_[i]), []).append(i)
    return [idx for idx in kinds.values() if len(idx) > 1]


def stacked_samples(
    ts: list[Tensor], s: int, scratch: dict[torch.dtype, Tensor]
) -> Iterator[tuple[int, Tensor]]:
    """The samples at stride ``s`` of ``ts`` (CPU tensors of one shape and dtype) a part at a
    time: ``(first row, [rows, *sample shape])``, a view into the scratch buffer the part was
    copied whole into (:func:`~inspector.stats.tensor_stats.stack_parts`) and sampled in: one op a
    part, where a view of each tensor costs a few microseconds."""
    b = _block(ts[0].shape)
    for a, x in stack_parts(ts, scratch):
        if s != 1:
            rows = x.shape[1] // b
            x = x[:, : rows * b].view(x.shape[0], rows, b)[:, ::s]
        yield a, x


class UpdateProbe:
    """Keeps (a sample of) the parameters before the update; see the module docstring."""

    def __init__(self) -> None:
        self._bufs: list[Tensor] | None = None
        self._strides: list[int] = []
        self._scale: list[float] = []
        self._shapes: list[Any] = []  # (shape, dtype, device) per parameter the buffers were made for
        # CPU samples of one shape and dtype: (their indices, the buffer whose rows they are)
        self._stacks: list[tuple[list[int], Tensor]] = []
        self._loose: list[int] = []  # the others' indices (a buffer each)
        self._scratch: dict[torch.dtype, Tensor] = {}  # the stacks' "after", per dtype (reused)
        self.kept = False  # filled for the step under way

    @property
    def resident_bytes(self) -> int:
        """The device memory this probe holds (allocated once, kept for the run)."""
        return sum(b.numel() * b.element_size() for b in self._bufs or [])

    def _views(self, ps: list[Tensor], which: list[int] | None = None) -> list[Tensor]:
        """The samples (views) of ``ps``, or of ``ps[i]`` for ``i`` in ``which``."""
        if which is None:
            return [_sample(p, s) for p, s in zip(ps, self._strides, strict=True)]
        return [_sample(ps[i], self._strides[i]) for i in which]

    def _allocate(self, ps: list[Tensor], views: list[Tensor]) -> None:
        """The buffers: for CPU parameters of one shape, dtype and stride (:func:`stack_groups`),
        the rows of a shared one; for each other parameter, one of its own."""
        bufs: list[Tensor | None] = [None] * len(views)
        self._stacks = []
        for idx in stack_groups(ps, self._strides):
            whole = torch.empty((len(idx), *views[idx[0]].shape), dtype=views[idx[0]].dtype)
            for row, i in enumerate(idx):
                bufs[i] = whole[row]
            self._stacks.append((idx, whole))
        self._loose = [i for i, b in enumerate(bufs) if b is None]
        for i in self._loose:
            bufs[i] = torch.empty_like(views[i], memory_format=torch.contiguous_format)
        self._bufs = bufs  # type: ignore[assignment]

    def _samples(self, ps: list[Tensor], idx: list[int]) -> Iterator[tuple[int, Tensor]]:
        return stacked_samples([ps[i] for i in idx], self._strides[idx[0]], self._scratch)

    def keep(self, ps: list[Tensor]) -> None:
        """Before the update: copy the parameters' sample (``ps`` detached; local shards under FSDP2)."""
        if self.kept:
            return
        with torch.no_grad():
            shapes = [(p.shape, p.dtype, p.device) for p in ps]
            if self._bufs is None or shapes != self._shapes:  # (a parameter replaced: p.data = ...)
                self._shapes = shapes
                self._strides = strides([p.shape for p in ps], [p.element_size() for p in ps])
                views = self._views(ps)
                self._allocate(ps, views)
                self._scale = [
                    math.sqrt(p.numel() / v.numel()) if v.numel() else 1.0
                    for p, v in zip(ps, views, strict=True)
                ]
            bufs = self._bufs
            assert bufs is not None
            for idx, whole in self._stacks:
                for a, x in self._samples(ps, idx):
                    whole[a : a + x.shape[0]] = x  # (host to host: the stacks are on the CPU)
            if self._loose:
                torch._foreach_copy_([bufs[i] for i in self._loose], self._views(ps, self._loose))
        self.kept = True

    def update_norms(self, ps: list[Tensor]) -> list[Tensor] | None:
        """After the update: each parameter's update norm (estimated where sampled), or None when
        nothing was kept this step. Leaves the buffers holding the differences."""
        if not self.kept or self._bufs is None:
            return None
        bufs = self._bufs
        norms: list[Tensor | None] = [None] * len(bufs)
        with torch.no_grad():
            for idx, whole in self._stacks:  # before - after, in place, a part at a time
                for a, x in self._samples(ps, idx):
                    whole[a : a + x.shape[0]].sub_(x)
                for i, n in zip(idx, row_norms(whole.view(len(idx), -1)).unbind(), strict=True):
                    norms[i] = n
            if self._loose:
                loose = [bufs[i] for i in self._loose]
                torch._foreach_sub_(loose, self._views(ps, self._loose))
                for i, n in zip(self._loose, foreach_norm(loose), strict=True):
                    norms[i] = n
        return [n * s if s != 1.0 else n for n, s in zip(norms, self._scale, strict=True)]  # type: ignore[misc]

    def differences(self) -> tuple[list[Tensor], list[int], list[float]] | None:
        """After :meth:`update_norms`: the buffers (``before - after``, each parameter's sample),
        each parameter's stride and the factor its sampled norm is scaled by; None when nothing was
        kept this step. Read-only for the caller (:mod:`inspector.stats.optim_state`)."""
        if not self.kept or self._bufs is None:
            return None
        return self._bufs, self._strides, self._scale

    def end_step(self) -> None:
        self.kept = False

    def close(self) -> None:
        self._bufs = None
        self._stacks, self._loose, self._scratch = [], [], {}
        self.kept = False
