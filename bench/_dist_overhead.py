"""The harness bench/ddp_overhead.py and bench/fsdp_overhead.py share: two gloo ranks on this machine,
the same small MLP and data, blocks of plain training interleaved with each attached variant.

A script calls :func:`main` with its docstring, its variants (``{name: attach kwargs}``, the plain
run first as ``None``), a description of the job for the report, and ``wrap(model) -> model`` (DDP,
fully_shard, ...), which runs in each rank after the process group is up.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

Variants = dict[str, dict[str, Any] | None]


def rank_main(args: argparse.Namespace, variants: Variants, job: str, wrap: Callable[[Any], Any]) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import inspector

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = wrap(
        nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    )
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
    plain_name = next(name for name, kw in variants.items() if kw is None)
    times: dict[str, list[float]] = {k: [] for k in variants}
    ratios: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.blocks):
        plain = steps(args.steps)
        times[plain_name].append(plain)
        for name, kw in variants.items():
            if kw is None:
                continue
            insp = inspector.attach(model, opt, **kw)
            steps(5)  # let the budget settle its cadence
            t = steps(args.steps)
            insp.close()
            times[name].append(t)
            ratios[name].append(t / plain)
    if rank == 0:
        print(f"2 ranks, gloo, CPU, 1 thread each; {job}; {args.blocks} blocks x {args.steps} steps")
        print(f"{'variant':38s} {'median step':>12s} {'median ratio':>13s}")
        for name in variants:
            r = f"{statistics.median(ratios[name]):.3f}" if ratios[name] else "1 (base)"
            print(f"{name:38s} {statistics.median(times[name]) * 1e3:9.2f} ms {r:>13s}")


def main(script: str, doc: str, variants: Variants, job: str, wrap: Callable[[Any], Any]) -> None:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a short run (about 30 s)")
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--blocks", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=30)
    args = ap.parse_args()
    args.blocks = args.blocks or (4 if args.quick else 15)
    args.steps = args.steps or (20 if args.quick else 60)
    if args.rank_main:
        rank_main(args, variants, job, wrap)
        # the group goes after the model (rank_main's locals): an FSDP2 model freed after
        # destroy_process_group() can abort the process (gloo, torch 2.13)
        import torch.distributed as dist

        gc.collect()
        dist.destroy_process_group()
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    cmd = [sys.executable, script, "--rank-main", "--blocks", str(args.blocks), "--steps", str(args.steps)]
    cmd += ["--warmup", str(args.warmup)]
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r)}) for r in (0, 1)]
    sys.exit(max(p.wait() for p in procs))
