"""Inspect DDP training: run with ``torchrun --nproc_per_node 2 examples/ddp_train.py``.

Every rank attaches an inspector (one config for the whole job: a hook added on the
dashboard is applied by every rank at the same step); only rank 0 serves the dashboard,
on http://127.0.0.1:8000 (tunnel that port from the host that runs rank 0).
CPU + gloo here so it runs anywhere; on GPUs use backend "nccl" and move the model and
data to ``f"cuda:{local_rank}"``: the inspector's own control traffic stays on gloo.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import inspector


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--port", type=int, default=8000, help="dashboard port on rank 0")
    ap.add_argument("--no-per-rank-stats", action="store_true", help="skip the local (pre-all-reduce) norms")
    args = ap.parse_args()

    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank = dist.get_rank()
    torch.manual_seed(0)  # same initial weights on every rank (DDP also broadcasts them)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(1000 + rank)  # different data on every rank

    insp = inspector.attach(model, opt, per_rank_stats=not args.no_per_rank_stats)  # every rank
    url = insp.serve(port=args.port)  # rank 0 serves; None elsewhere
    if url:
        print(f"rank 0 dashboard: {url}", flush=True)
    for _ in range(args.steps):
        x = torch.randn(64, 32, generator=data)
        y = x[:, :1].sin()
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()  # DDP all-reduces the gradients here
        opt.step()  # our pre_step hooks see the averaged gradients
        insp.record(loss=loss)
    insp.close()
    dist.destroy_process_group()
    if os.environ.get("LOCAL_RANK", "0") == "0" and url:
        print("done", flush=True)


if __name__ == "__main__":
    main()
