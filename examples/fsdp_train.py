"""Inspect FSDP2 training: run with ``torchrun --nproc_per_node 2 examples/fsdp_train.py``.

The model is sharded with ``torch.distributed.fsdp.fully_shard`` (every parameter and gradient
is a DTensor, each rank holding a shard). Every rank attaches an inspector (one config for the
whole job); only rank 0 serves the dashboard, on http://127.0.0.1:8000 (tunnel that port from
the host that runs rank 0). The statistics are of the full gradients, combined from every
rank's shards in one small collective per sampled step on the job's own process group.

CPU + gloo by default, so it runs anywhere; with CUDA available each rank uses its GPU
(``cuda:LOCAL_RANK``) and NCCL, which then carries that collective too.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import inspector


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--port", type=int, default=8000, help="dashboard port on rank 0")
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU even where CUDA is available")
    args = ap.parse_args()

    cuda = torch.cuda.is_available() and not args.cpu
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_*
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank, before sharding
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    model.to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)  # each layer its own unit: gathered for its forward, resharded after
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # built on the sharded parameters
    data = torch.Generator(device=device).manual_seed(1000 + rank)  # different data on every rank

    insp = inspector.attach(model, opt)  # every rank, at the same point
    insp.add_hook("nan_guard", target="*", action="skip")  # from the script: every rank adds it
    url = insp.serve(port=args.port)  # rank 0 serves; None elsewhere
    if url:
        print(f"rank 0 dashboard: {url}", flush=True)
    for _ in range(args.steps):
        x = torch.randn(64, 32, generator=data, device=device)
        y = x[:, :1].sin()
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()  # FSDP reduce-scatters the gradients: each rank keeps its shard
        opt.step()  # our pre_step hooks see the reduced shards
        insp.record(loss=loss)
    insp.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
