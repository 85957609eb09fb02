"""Per-step cost of the inspector in a 2-process FSDP2 job (``fully_shard``, gloo, CPU), against
the same job without it.

    .venv/bin/python bench/fsdp_overhead.py [--quick]

Spawns 2 ranks on 127.0.0.1. In one run, both ranks interleave blocks of steps of each
variant (plain FSDP2; attached with defaults; attached with every=1), so the machine's noise
hits all variants alike. Rank 0 prints the median step time of each variant and the median of
paired ratios (a variant's block against the plain block next to it).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {
    "plain FSDP2": None,
    "inspector (defaults)": {},
    "inspector every=1": {"every": 1},
}


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import inspector

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    batches = [
        (torch.randn(64, 256, generator=gen), torch.randint(0, 10, (64,), generator=gen)) for _ in range(8)
    ]

    def steps(n: int) -> float:
        t0 = time.perf_counter()
        for i in range(n):
            x, y = batches[i % len(batches)]
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return (time.perf_counter() - t0) / n

    steps(args.warmup)
    times: dict[str, list[float]] = {k: [] for k in VARIANTS}
    ratios: dict[str, list[float]] = {k: [] for k in VARIANTS}
    for _ in range(args.blocks):
        plain = steps(args.steps)
        times["plain FSDP2"].append(plain)
        for name, kw in VARIANTS.items():
            if kw is None:
                continue
            insp = inspector.attach(model, opt, **kw)
            steps(5)  # let the budget settle its cadence
            t = steps(args.steps)
            insp.close()
            times[name].append(t)
            ratios[name].append(t / plain)
    if rank == 0:
        print(
            f"2 ranks, gloo, CPU, 1 thread each; FSDP2 MLP 256-512-512-10 (0.4M params), Adam, batch 64;"
            f" {args.blocks} blocks x {args.steps} steps"
        )
        print(f"{'variant':38s} {'median step':>12s} {'median ratio':>13s}")
        for name in VARIANTS:
            r = f"{statistics.median(ratios[name]):.3f}" if ratios[name] else "1 (base)"
            print(f"{name:38s} {statistics.median(times[name]) * 1e3:9.2f} ms {r:>13s}")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a short run (about 30 s)")
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--blocks", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=30)
    args = ap.parse_args()
    args.blocks = args.blocks or (4 if args.quick else 15)
    args.steps = args.steps or (20 if args.quick else 60)
    if args.rank_main:
        rank_main(args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    cmd = [
        sys.executable,
        __file__,
        "--rank-main",
        "--blocks",
        str(args.blocks),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
    ]
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r)}) for r in (0, 1)]
    sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
    main()
