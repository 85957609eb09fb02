"""FSDP2's half of a sampled step's statistics (a part of :class:`~inspector.stats.step_stats.StepStats`,
present under FSDP2 only): every gradient there is this rank's shard, so the snapshot combines
every rank's partial results into the full tensors' statistics in **one** collective
(:meth:`ShardedStats.combine`, by :meth:`sharded.Layout.combine`) before its one transfer, and a
sharded parameter's histogram takes its range across the ranks from one collective of its own
first (:meth:`ShardedStats.hist_spans`).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import Tensor

from .sharded import Layout
from .telemetry import Pack
from .tensor_stats import combine_moments, device_constant, value_range

__all__ = ["ShardedStats"]


class ShardedStats:
    """The FSDP2 combination of a sampled step's statistics, over the model's ``layout``."""

    def __init__(self, layout: Layout, params: list[str], tensors: list[Tensor]) -> None:
        self.layout = layout
        self.params = params
        self.tensors = tensors

    def hist_spans(self, hist_in: list[tuple[int, Tensor, Tensor | None]]) -> dict[int, Tensor]:
        """FSDP2: the global ``[-min, max]`` of each sharded parameter's histogram, in one collective
        (every rank takes the same histograms: the exchange carries rank 0's choice)."""
        lay = self.layout
        mine = [h for h in hist_in if lay.sharded[h[0]]]
        if not mine:
            return {}
        ranges = torch.cat([value_range(g, f) for _, g, f in mine])
        ranges = lay.combine(ranges, (False,) * ranges.numel())
        return {h[0]: ranges[2 * k : 2 * k + 2] for k, h in enumerate(mine)}

    def combine(
        self,
        pack: Pack,
        raw: Any,
        part: dict[str, Any],
        meta: dict[str, Any],
        pnorms: list[Tensor],
        unorms: list[Tensor] | None,
        effs: list[tuple[str, list[Tensor]]],
        optim: list[tuple[str, Tensor]] | None = None,
    ) -> None:
        """``raw``: the step's raw read (``step_stats.RawRead``, or None); ``part``: this rank's
        partial final statistics (``fnorms``, ``fabsmax``, ``moments`` with their ``counts``, ``hist``);
        ``optim``: the optimizer state's columns (``OptimProbe.sharded_columns``: one value per
        tensor, summed for a sharded one), added to ``pack`` under their own names.

        FSDP2: this sampled step's statistics of the full tensors, from every rank's partial
        results in **one** collective (:meth:`Layout.combine`), added to ``pack`` under the names the
        unsharded path uses. Every rank builds the same columns (the same config and sampling, the
        same histograms): a sharded parameter's sums of squares and histogram counts are summed,
        abs-max and a histogram's range maxed, and the shards' means and spreads combined as Chan
        et al. do (``stats.combine_moments``, from every rank's row of the same collective); a
        parameter that is not sharded keeps its own values (the max of equal ones; its equal
        moments combine to themselves). The norms as the last backward left the gradients
        (``raw.backward``: the reduced shards, before the user's own code between ``backward()``
        and ``step()``) are combined as the raw ones are, with the count of ranks that took them
        (``backward_took``: the host keeps them where every rank did)."""
        lay = self.layout
        n = len(self.params)
        dev = pnorms[0].device if pnorms else torch.device("cpu")
        # (masks and indices are host data: on the device once, stats.device_constant; a tensor
        # made from a list and moved to a GPU is a copy that synchronises)
        sharded, unsummed = tuple(lay.sharded), (False,) * n
        cols: list[tuple[str, Tensor, tuple[bool, ...]]] = []

        def pick(t: Tensor, indices: list[int]) -> Tensor:
            return t.index_select(0, device_constant(tuple(indices), torch.int64, t.device))

        def column(name: str, indices: list[int], values: Any, *, summed: bool) -> None:
            v = torch.zeros(n, device=dev)
            if indices:
                got = torch.stack([x.reshape(()).to(dev, torch.float32) for x in values])
                v.index_copy_(0, device_constant(tuple(indices), torch.int64, dev), got)
            cols.append((name, v, sharded if summed else unsummed))

        raw_idx = raw.index if raw is not None else []
        fin_idx, dense_idx = meta.get("fin_idx", []), meta.get("dense_idx", [])
        moms, counts = part.get("moments", []), part.get("counts", [])
        column("raw_sq", raw_idx, [x.pow(2) for x in raw.norm_tensors] if raw else [], summed=True)
        column("raw_am", raw_idx, raw.absmax if raw else [], summed=False)
        column("fin_sq", fin_idx, [x.pow(2) for x in part.get("fnorms", [])], summed=True)
        column("fin_am", fin_idx, part.get("fabsmax", []), summed=False)
        column("m_re", dense_idx, [m.real if m.is_complex() else m for m, _ in moms], summed=False)
        column(
            "m_im", dense_idx, [m.imag if m.is_complex() else m.new_zeros(()) for m, _ in moms], summed=False
        )
        column("sdev", dense_idx, [sd for _, sd in moms], summed=False)
        full_counts = [0.0] * n  # (host data: on the device once, stats.device_constant)
        for i, c in zip(dense_idx, counts, strict=True):
            full_counts[i] = float(c)
        cols.append(("count", device_constant(tuple(full_counts), torch.float32, dev), sharded))
        # the gradients as the last backward left them (the reduced shards, before the user's own
        # code between backward() and step()): their sums of squares, and how many ranks took them
        # (a column every rank sends, taken or not: the same rows on every rank)
        bw = raw.backward if raw is not None else None
        bw_idx = (raw.backward_index or []) if bw is not None else []
        bw_norms = list(bw[0]) if bw is not None and bw_idx else []
        column("bw_sq", bw_idx, [x.pow(2) for x in bw_norms], summed=True)
        cols.append(("bw_took", torch.full((1,), float(bool(bw_idx)), device=dev), (True,)))
        column("p_sq", list(range(n)), [x.pow(2) for x in pnorms], summed=True)
        column("u_sq", list(range(n)) if unorms else [], [x.pow(2) for x in unorms or []], summed=True)
        for hid, e in effs:  # a hook's effect: its shards' sums (see docs/distributed.md, FSDP2)
            v = torch.stack([x.to(dev) for x in e])
            # (a kind's own values after the three, zclip's, are the same on every rank: not summed)
            cols.append((f"eff:{hid}", v, (True, True, True) + (False,) * (len(e) - 3)))
        for name, v in optim or []:
            cols.append((name, v.to(dev), sharded))
        for i, h in sorted(part.get("hist", {}).items()):  # range maxed, counts summed
            cols.append((f"hist:{i}", h.to(dev), (False, False) + (True,) * (h.numel() - 2)))
        flat, rows = lay.combine_rows(
            torch.cat([c[1] for c in cols]), tuple(itertools.chain.from_iterable(c[2] for c in cols))
        )
        got, each, at = {}, {}, 0
        for name, v, _ in cols:
            got[name], each[name] = flat[at : at + v.numel()], rows[:, at : at + v.numel()]
            at += v.numel()
        if raw_idx:
            pack.add("raw_norm", pick(got["raw_sq"].sqrt(), raw_idx))
            pack.add("raw_absmax", pick(got["raw_am"], raw_idx))
        if fin_idx:
            pack.add("final_norm", pick(got["fin_sq"], fin_idx).sqrt())
            pack.add("final_absmax", pick(got["fin_am"], fin_idx))
        if dense_idx:  # the full tensors' means and population stds (the unbiased std: the host's)
            cplx = any(self.tensors[i].is_complex() for i in dense_idx)
            m_re, m_im, sdev, count = (
                pick(each[c].t(), dense_idx) for c in ("m_re", "m_im", "sdev", "count")
            )
            m = torch.complex(m_re.double(), m_im.double()) if cplx else m_re
            mean, sdevs = combine_moments(m, sdev, count)  # (one row a tensor, one column a rank)
            means = mean.real if mean.is_complex() else mean
            pack.add("mean", means)
            pack.add("sdev", sdevs)
        if bw_idx:  # (some ranks' shards alone are no norm: the host keeps it where every rank took it)
            pack.add("backward_norm", pick(got["bw_sq"], bw_idx).sqrt())
            pack.add("backward_took", got["bw_took"])
        pack.add("param_norm", got["p_sq"].sqrt())
        if unorms:
            pack.add("update_norm", got["u_sq"].sqrt())
        for hid, _ in effs:
            pack.add(f"eff:{hid}", got[f"eff:{hid}"])
        for name, _ in optim or []:
            pack.add(name, got[name])
        for i in part.get("hist", {}):
            pack.add(f"hist:{i}", got[f"hist:{i}"])
