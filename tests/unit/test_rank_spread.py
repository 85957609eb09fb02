"""The per-rank values of the boundary's exchange (``Rows.spread``): each rank's whole-model local
norm against plain torch, and the rank that found a non-finite gradient."""

from __future__ import annotations

import math

import torch

from inspector.distributed import Rows


def test_rank_norms_and_nonfinite_ranks_come_from_the_exchanged_rows():
    n, world = 3, 4
    local = torch.tensor(
        [[1.0, 2.0, 2.0], [0.5, math.nan, 1.0], [math.nan] * 3, [3.0, 4.0, 12.0]], dtype=torch.float64
    )
    rows = torch.zeros(world, Rows.NORMS + n, dtype=torch.float64)
    rows[:, Rows.LOCAL_BAD] = torch.tensor([-1.0, 2.0, -1.0, -1.0])
    rows[:, Rows.NORMS :] = local
    got = Rows(rows).spread(n)
    assert len(got["rank_norm"]) == world
    for r in range(world):
        have = local[r][~torch.isnan(local[r])]
        want = float(torch.linalg.vector_norm(have)) if have.numel() else None
        assert got["rank_norm"][r] == want  # (a rank with no gradient at all: None)
    assert got["rank_norm"][3] == 13.0
    assert got["rank_nonfinite"] == [None, 2, None, None]
    assert got["norm_max"] == [3.0, 4.0, 12.0] and got["argmax"] == [3, 3, 3]
