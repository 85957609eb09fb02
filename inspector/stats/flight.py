"""The flight recorder: every tensor's gradient norm (raw and final), the loss and the NaN/Inf flag
of the last ``size`` steps, in a ring on the gradients' device, written on every step, sampled or
not, and read only when something happened; and the spike detector (:mod:`inspector.stats.spikes`)
that it feeds.

Each step (:meth:`FlightRecorder.norms`, from the ``pre_step`` work) writes row ``step % size``
of a ``[size, tensors + 1]`` float32 tensor with one op: the raw norms the step took anyway (an
unsampled step's NaN/Inf probe, a sampled step's raw 2-norms). The final norms (after the
``pre_step`` hooks) go to a second ``[size, tensors]`` tensor only where they differ: a sampled
step's statistics after a hook, or, on an unsampled step where a hook ran, one more fused norm of
the final gradients; where no hook ran the row is marked (on the host) as final = raw and nothing
is written. A parameter without a gradient reads -1 (``None`` once dumped). At the boundary
(:meth:`FlightRecorder.end_step`) the step's recorded ``loss`` (``insp.record(loss=...)`` made
before the boundary, or after it and before the next forward) goes to the row's last column (one
op), and the row starts its copy to the host through the NaN/Inf checks' queue
(:class:`~inspector.stats.deferred.Deferred`; on a CPU it is read where it is): two or three
device ops a step in all, nothing read on the host during a step.

At a later boundary the host has the row: its global and per-group norms (float64, numpy) feed
the spike detector, whose z-scores over the threshold become ``spike`` events
(:class:`~inspector.stats.spikes.SpikeReport`); a spike, or a step with a non-finite raw gradient
norm or loss (one dump per ``cooldown`` steps), has the whole ring copied (one device copy, one
transfer, read at the boundary after) and published as a ``flight`` record: the rows of the
ring, oldest first. ``Inspector.flight_recorder()`` reads it at once (one transfer) when asked.

Memory: ``size x (2 x tensors + 1) x 4`` bytes on the device, in ``2 x size`` rows of their own,
each of which PyTorch's CUDA caching allocator rounds up to 512 bytes (256 steps x 1000 tensors:
2.0 MB; x 4 tensors: 9 KB on the CPU, 256 KB on a GPU): :attr:`FlightRecorder.bytes`. A dump
copies the ring once more until it is read (at the next boundary).

A rewind to step ``s`` makes the rows of steps after ``s`` stale: the next write under a step
number not above the last one drops them (they are never dumped); the detector's statistics go
on from where they were (a few steps of the abandoned branch in an EMA of about 50).

Under ``torch.distributed`` only rank 0 records: under DDP every rank's gradients are the
all-reduced ones, the same everywhere. Under FSDP2 rank 0's ring holds its own shards' norms (a
sharded parameter's shard norm, not the full tensor's): its spikes are those of rank 0's shards.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .deferred import Deferred
from .groups import Groups
from .spikes import SpikeReport, SpikeSettings, SpikeState, check_spike_settings

__all__ = ["DEFAULT_SIZE", "FlightRecorder"]

DEFAULT_SIZE = 256  # steps kept
_BLOCK = 512  # the CUDA caching allocator's smallest block: every allocation is a multiple of it


def _rounded(nbytes: int, block: int) -> int:
    return -(-nbytes // block) * block


def _vec(values: Tensor | list[Tensor]) -> Tensor:
    if isinstance(values, Tensor):
        return values.reshape(-1).float()
    return torch.stack([v.reshape(()).float() for v in values])


class FlightRecorder:
    """The ring of recent steps' norms and the spike detector (module docstring)."""

    def __init__(
        self,
        params: list[str],
        groups: Groups,
        *,
        deferred: Deferred,
        publish: Callable[[str, Any], None],
        emit: Callable[..., Any],
        lock: threading.RLock,
        size: int = DEFAULT_SIZE,
    ) -> None:
        self.params = params
        self.groups = groups
        self.size = size
        self._deferred = deferred
        self._publish = publish
        self._emit = emit
        self._lock = lock
        self.settings = SpikeSettings()
        self.report = SpikeReport(
            [("loss", None), ("grad_norm", None), *(("group", name) for name in groups.names)]
        )
        # the ring: ``size`` rows of ``tensors + 1`` (the raw norms, then the loss) and ``size`` rows
        # of ``tensors`` (the final norms, where they differ), each row a tensor of its own (the
        # row read at a boundary is never one a later step writes into)
        self._rows: list[Tensor] = []
        self._raw_rows: list[Tensor] = []
        self._loss_cells: list[Tensor] = []
        self._final_rows: list[Tensor] = []
        self._state = SpikeState(2 + len(groups), 1)
        self._of = np.asarray(groups.of, dtype=np.int64)  # parameter -> group
        self._index: dict[tuple[int, ...], Tensor] = {}
        self.row_step = [-1] * size  # the step each row holds (-1: none, or stale)
        self.row_final = [False] * size  # whether the row's final norms were written (else: = raw)
        self.row_loss = [False] * size  # whether the row's loss was written
        self._norm_step = -1  # the step whose norms the ring has
        self._pending: int | None = None  # a step ended whose spike values wait for its loss
        self.latest = 0  # the last step ended
        self._last_dump = -(10**9)  # the incident step of the last automatic dump
        self.dumps = 0

    @property
    def bytes(self) -> int:
        """Device memory the ring holds (allocated at the first step): its rows' bytes, each
        rounded up to the CUDA caching allocator's block on a GPU (module docstring)."""
        if not self._rows:
            return 0
        t, block = len(self.params), _BLOCK if self._rows[0].is_cuda else 1
        return self.size * (_rounded((t + 1) * 4, block) + _rounded(t * 4, block))

    # ------------------------------------------------------------------ settings
    def configure(self, **change: Any) -> dict[str, Any]:
        """Validate and apply (all or nothing; HookError names the bad field); returns the settings."""
        with self._lock:
            self.settings = check_spike_settings(self.settings, change)
            return self.settings.to_dict()

    # ------------------------------------------------------------------ every step
    def _alloc(self, dev: torch.device) -> None:
        n, t = self.size, len(self.params)
        self._rows = [torch.full((t + 1,), -1.0, device=dev) for _ in range(n)]
        self._final_rows = [torch.full((t,), -1.0, device=dev) for _ in range(n)]
        # each row's views, made once (a view costs as much as a small op)
        self._raw_rows = [r[:t] for r in self._rows]
        self._loss_cells = [r[t:] for r in self._rows]

    def _put(self, dest: Tensor, index: list[int], values: Tensor | list[Tensor]) -> None:
        """``dest[index] = values``, the others -1: one op where every parameter has a gradient."""
        if len(index) == dest.shape[0]:
            if isinstance(values, Tensor):
                dest.copy_(values.reshape(-1), non_blocking=True)  # (on one device: no host wait)
            else:
                torch.stack([v.reshape(()) for v in values], out=dest)
            return
        idx = self._index.get(tuple(index))
        if idx is None:
            idx = self._index[tuple(index)] = torch.tensor(index, dtype=torch.long).to(dest.device)
            if len(self._index) > 8:  # (the set of gradients present changes rarely)
                self._index.pop(next(iter(self._index)))
        dest.fill_(-1.0)
        dest.index_copy_(0, idx, _vec(values).to(dest.device, torch.float32))

    def norms(
        self,
        step: int,
        index: list[int],
        raw: Tensor | list[Tensor],
        final: Tensor | list[Tensor] | None,
        final_index: list[int] | None = None,
    ) -> None:
        """Step ``step``'s per-tensor norms over ``index`` (``final`` None: the same as ``raw``;
        ``final_index``: the final norms' parameters where they are not ``index``)."""
        if not index:
            return
        self._complete(step)  # the previous step's, if its loss never came
        if not self._rows:
            first = raw if isinstance(raw, Tensor) else raw[0]
            self._alloc(first.device)
        if step <= self.latest:  # a rewind: the rows after it belong to the abandoned branch
            self.rewound(step - 1)
        row = step % self.size
        self.row_step[row] = -1  # (until written whole: a write that fails leaves no stale row)
        self._put(self._raw_rows[row], index, raw)
        if final is None:
            self.row_final[row] = False
        elif final_index is not None and not final_index:  # (a skipped step: no gradient left)
            self._final_rows[row].fill_(-1.0)
            self.row_final[row] = True
        else:
            self._put(self._final_rows[row], index if final_index is None else final_index, final)
            self.row_final[row] = True
        self.row_loss[row] = False
        self.row_step[row] = step
        self._norm_step = step

    def rewound(self, to_step: int) -> None:
        """The run went back to ``to_step``: later rows are stale (never dumped)."""
        self.row_step = [s if s <= to_step else -1 for s in self.row_step]
        self.report.last_over = {k: s for k, s in self.report.last_over.items() if s <= to_step}
        self.latest = to_step

    def end_step(self, step: int, loss: Any) -> None:
        """Step ``step``'s boundary: its loss (a float, a 0-dim tensor, or None when none was
        recorded before the boundary: then a record made after it, :meth:`late_loss`, or the next
        step's start completes it), and the row on its way to the host."""
        self._complete(self.latest + 1)
        if not self._rows or self._norm_step != step:
            self.latest = step
            return  # no gradient this step (nothing to record)
        self.latest = step
        self._pending = step
        if loss is not None:
            self._write_loss(step, loss)
            self._complete(step)

    def late_loss(self, step: int, loss: Any) -> None:
        """A loss recorded after step ``step``'s boundary (before the next forward)."""
        if self._pending == step:
            self._write_loss(step, loss)
            self._complete(step + 1)

    def complete(self) -> None:
        """Training is over: the last step's values go now."""
        self._complete(self.latest + 1)

    def _write_loss(self, step: int, loss: Any) -> None:
        row = step % self.size
        cell = self._loss_cells[row]
        if isinstance(loss, Tensor):
            cell.copy_(loss.detach(), non_blocking=True)  # (a 0-dim tensor: broadcast)
        else:
            cell.fill_(float(loss))
        self.row_loss[row] = True

    def _complete(self, key: int) -> None:
        """The pending step's row, on its way to the host; ``key``: the step under way now, so
        that it is read at a boundary after it (never one of this step)."""
        step, self._pending = self._pending, None
        if step is None or not self._rows or self.row_step[step % self.size] != step:
            return
        row = step % self.size
        flat = self._rows[row]
        if self.size < 4 and flat.is_cpu:  # (read where it is: not a row written again before that)
            flat = flat.clone()
        has_loss = self.row_loss[row]
        self._deferred.submit_flat(key, flat, lambda values: self._consume(step, has_loss, values))

    # ------------------------------------------------------------------ at a later boundary
    def _signals(self, values: list[float], has_loss: bool) -> tuple[list[float], bool]:
        """The detector's values ``[loss, global norm, group norms...]`` of one row (float64), and
        whether a raw norm or the loss was non-finite."""
        loss = values[-1] if has_loss else math.nan
        t = len(values) - 1
        if t <= 64:  # (plain floats: cheaper than vector ops for a few)
            r = values[:t]
            bad_norm = not math.isfinite(sum(r))
            if not bad_norm:
                sq = [v * v if v > 0 else 0.0 for v in r]  # (absent ones, -1, count 0)
                groups = [math.sqrt(sum(sq[i] for i in m)) for m in self.groups.members]
                total = math.sqrt(sum(sq))
        else:
            ra = np.asarray(values[:t], dtype=np.float64)
            bad_norm = not bool(np.isfinite(ra).all())
            if not bad_norm:
                sqa = np.square(np.maximum(ra, 0.0))
                groups = np.sqrt(np.bincount(self._of, weights=sqa, minlength=len(self.groups))).tolist()
                total = math.sqrt(float(sqa.sum()))
        if bad_norm:  # (no value: the NaN/Inf report's business)
            x = [loss] + [math.nan] * (1 + len(self.groups))
        else:
            x = [loss, total, *groups]
        return x, bad_norm or (has_loss and not math.isfinite(loss))

    def _consume(self, step: int, has_loss: bool, values: list[float]) -> None:
        x, bad = self._signals(values, has_loss)
        s = self.settings
        found: list[dict[str, Any]] = []
        if s.enabled:
            z, mean = self._state.update(x, s)
            found = self.report.spikes(step, z, x, mean, s)
        for fields in found:
            self._emit("spike", **fields)
        if found:
            self._dump_later("spike", step)
        elif bad and step - self._last_dump > s.cooldown:
            self._dump_later("nonfinite", step)

    def _dump_later(self, reason: str, step: int) -> None:
        """Copy the ring now (one device copy) and read it at a later boundary."""
        if not self._rows:
            return
        self._last_dump = step
        meta = self._meta()
        flat = self._flat()  # (a new tensor: not the rows written meanwhile)
        # (read at the boundary after the one that is draining now: ``latest + 1`` is under way)
        self._deferred.submit_flat(self.latest + 1, flat, lambda v: self._dumped(reason, step, meta, v))

    def _meta(self) -> tuple[list[int], list[bool], list[bool]]:
        return list(self.row_step), list(self.row_final), list(self.row_loss)

    def _flat(self) -> Tensor:
        return torch.cat(self._rows + self._final_rows)

    def _dumped(
        self, reason: str, step: int, meta: tuple[list[int], list[bool], list[bool]], values: list[float]
    ) -> None:
        self.dumps += 1
        self._publish("flight", self.record(reason, step, meta, values))

    def record(
        self,
        reason: str,
        step: int | None,
        meta: tuple[list[int], list[bool], list[bool]],
        values: list[float],
    ) -> dict[str, Any]:
        """The ``flight`` record of a dump: ``{"reason", "step", "size", "bytes" (the ring's device
        memory), "params", "groups", "rows"}``; ``meta``: each row's step, whether its final norms
        were written and whether its loss was."""
        steps, finals, losses = meta
        n, t = self.size, len(self.params)
        ring, final = values[: n * (t + 1)], values[n * (t + 1) :]
        rows = []
        for row in sorted((r for r in range(n) if steps[r] >= 0), key=lambda r: steps[r]):
            rr = ring[row * (t + 1) : row * (t + 1) + t]
            ff = final[row * t : (row + 1) * t] if finals[row] else rr
            loss = ring[row * (t + 1) + t] if losses[row] else None
            bad = not all(math.isfinite(v) for v in rr) or not all(math.isfinite(v) for v in ff)
            rows.append(
                {
                    "step": steps[row],
                    "loss": None if loss is None else _num(loss),
                    "nonfinite": bad or (loss is not None and not math.isfinite(loss)),
                    "norm_raw": _total(rr),
                    "norm": _total(ff),
                    "groups_raw": [_total([rr[i] for i in m]) for m in self.groups.members],
                    "raw": [_num(v) if v >= 0 or math.isnan(v) else None for v in rr],
                    "final": [_num(v) if v >= 0 or math.isnan(v) else None for v in ff],
                }
            )
        return {
            "reason": reason,
            "step": step,
            "size": n,
            "bytes": self.bytes,
            "params": list(self.params),
            "groups": list(self.groups.names),
            "rows": rows,
        }

    def read_now(self) -> dict[str, Any]:
        """The ring, read now (one transfer): what ``Inspector.flight_recorder()`` returns; also
        published as a ``flight`` record (``reason`` "request")."""
        with self._lock:
            if not self._rows:
                rec = self.record("request", self.latest or None, ([-1] * self.size, [], []), [])
                rec["rows"] = []
                return rec
            meta = self._meta()
            values = self._flat().tolist()  # (asked for: one read of the ring, here)
            rec = self.record("request", self.latest, meta, values)
        self._publish("flight", rec)
        return rec


def _num(v: float) -> float | str | None:
    if math.isfinite(v):
        return v
    return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")


def _total(vals: list[float]) -> float | str | None:
    """The global 2-norm of the present (>= 0) values; "nan"/"inf" when one is; None if none."""
    present = [v for v in vals if v >= 0 or math.isnan(v)]
    if not present:
        return None
    if not all(math.isfinite(v) for v in present):
        return _num(math.nan if any(math.isnan(v) for v in present) else math.inf)
    top = max(present)
    if top == 0:
        return 0.0
    return top * math.sqrt(sum((v / top) ** 2 for v in present))
