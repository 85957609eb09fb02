"""Per-step cost of the inspector in a 2-process DDP job (gloo, CPU), against the same job without it.

    .venv/bin/python bench/ddp_overhead.py [--quick]

Spawns 2 ranks on 127.0.0.1. In one run, both ranks interleave blocks of steps of each
variant (plain DDP; attached with defaults and per-rank statistics on; the same with them
off; attached with every=1), so the machine's noise hits all variants alike. Rank 0 prints
the median step time of each variant and the median of paired ratios (a variant's block
against the plain block next to it).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _dist_overhead import main  # noqa: E402  (the harness this and the other distributed bench share)

VARIANTS = {
    "plain DDP": None,
    "inspector (defaults, per-rank on)": {"per_rank_stats": True},
    "inspector (defaults, per-rank off)": {"per_rank_stats": False},
    "inspector every=1, per-rank on": {"per_rank_stats": True, "every": 1},
}


def wrap(model: Any) -> Any:
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model)


if __name__ == "__main__":
    main(__file__, __doc__, VARIANTS, "MLP 256-512-512-10 (0.4M params), Adam, batch 64", wrap)
