"""One rank of tests/distributed/test_checkpoint_dir_dist.py: DDP on gloo; the loop's own
``dcp.save`` at a boundary every rank reaches, then the inspector's reading of DCP directories
(inspector/whatif/dcp_store.py) on every rank: a whole directory read back in place, a partial
one refused before anything is loaded. Writes ``rank<r>.json``."""

from __future__ import annotations

import argparse
import copy
import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from inspector.whatif.dcp_store import check_dir, load_dir
from inspector.wire.errors import CheckpointError


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(10 + rank)

    def train(n: int) -> None:
        for _ in range(n):
            x = torch.randn(4, 8, generator=gen)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), x[:, :1]).backward()
            opt.step()

    def state() -> dict:
        return {"model": model.module.state_dict(), "optimizer": opt.state_dict()}

    train(5)
    dcp.save(state(), checkpoint_id=args.out / "own")  # a collective: every rank, this boundary
    ref = copy.deepcopy(state())
    dcp.save(state(), checkpoint_id=args.out / "partial")
    train(5)
    at = SimpleNamespace(root=model.module, tensors=list(model.module.parameters()), optimizer=opt)
    out: dict = {"rank": rank}
    # a rank that did not finish writing: its data file missing (every rank sees the same files)
    dist.barrier()
    files = sorted(p.name for p in (args.out / "partial").glob("*.distcp"))
    out["files"] = files
    if rank == 0:
        (args.out / "partial" / files[-1]).unlink()
    dist.barrier()
    before = copy.deepcopy(state())
    try:
        check_dir(at, args.out / "partial")
        out["partial"] = None
    except CheckpointError as e:
        out["partial"] = str(e)
    out["unchanged"] = same(state(), before)
    # a whole directory: read back in place on every rank (dcp.load is a collective)
    load_dir(at, args.out / "own")
    out["restored"] = same(state(), ref)
    train(3)  # training goes on from there, ranks in lockstep
    out["sum"] = [float(p.detach().double().sum()) for p in model.parameters()]
    (args.out / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
