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


def test_each_groups_spread_is_that_of_each_ranks_norm_over_the_groups_parameters():
    n, world = 5, 3
    local = torch.tensor(
        [
            [1.0, 2.0, 2.0, 0.1, math.nan],
            [0.5, math.nan, 1.0, 0.3, math.nan],
            [3.0, 4.0, math.nan, math.nan, math.nan],
        ],
        dtype=torch.float64,
    )
    rows = torch.full((world, Rows.NORMS + n), -1.0, dtype=torch.float64)
    rows[:, Rows.NORMS :] = local
    members = [[0, 1], [2, 3], [4]]
    got = Rows(rows).spread(n, members)
    for g, m in enumerate(members):
        per = {}
        for r in range(world):
            have = [float(local[r, i]) for i in m if not math.isnan(local[r, i])]
            if have:
                per[r] = math.sqrt(sum(v * v for v in have))
        if not per:  # no rank had a gradient there
            assert got["group_norm_min"][g] is None and got["group_argmax"][g] is None
            continue
        lo, hi = min(per, key=per.get), max(per, key=per.get)
        assert got["group_norm_min"][g] == per[lo] and got["group_argmin"][g] == lo, g
        assert got["group_norm_max"][g] == per[hi] and got["group_argmax"][g] == hi, g
    assert got["group_norm_max"][0] == 5.0 and got["group_argmax"][0] == 2
    assert "group_norm_min" not in Rows(rows).spread(n), "no groups: no group keys"
