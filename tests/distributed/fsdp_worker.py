"""One rank of the FSDP2 tests (spawned by tests/distributed/test_fsdp.py; pytest does not collect it).

Trains a model sharded with ``fully_shard`` on CPU/gloo, different data per rank, an inspector
attached on every rank, and writes one JSON line per step to OUT/rank{R}.jsonl: the step, the
config version, whether this rank's shards moved, the norm of the **full** gradient (from every
rank's shards, before our hooks), this rank's shards' norm, the snapshot's raw total norm, and,
while a clip_norm hook is in force, the largest difference between the gradients the optimizer
used and ``clip_grad_norm_`` applied to the same FSDP2 gradients. At the end OUT/close{R}.json
says whether ``close()`` left any hook behind.

``--mixed``: the last bias is left out of FSDP (``ignored_params``), a plain tensor whose gradient
the script all-reduces itself: a model mixing sharded and replicated parameters.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import inspector  # noqa: E402


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t  # a collective: every rank calls it


def hook_count(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    n = len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks)
    for m in model.modules():
        n += len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._backward_hooks)
    for p in model.parameters():
        n += len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rate", type=float, default=40.0)
    ap.add_argument("--every", type=int, default=None, help="attach(every=...); default: the budget")
    ap.add_argument(
        "--nan-step", type=int, default=-1, help="a NaN in rank 1's shard of 0.weight at this step"
    )
    ap.add_argument("--mixed", action="store_true")
    ap.add_argument(
        "--interleave",
        type=int,
        default=-1,
        help="before this step: rank 0 adds a hook from another thread, then the script adds one",
    )
    ap.add_argument("--hist", default="", help="rank 0 only: set_hist_params([this])")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    fully_shard(model[0])
    fully_shard(model, ignored_params={model[2].bias} if args.mixed else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(100 + rank)
    params = list(model.parameters())

    if args.mixed:

        def reduce_plain(o, a, k):  # the script reduces the parameter FSDP does not manage
            for p in params:
                if not isinstance(p, DTensor) and p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= dist.get_world_size()

        opt.register_step_pre_hook(reduce_plain)

    step_now = [0]

    def poison(o, a, k):  # after FSDP's reduce-scatter: a NaN in rank 1's shard only
        if rank == 1 and step_now[0] == args.nan_step:
            local(model[0].weight.grad)[0, 0] = float("nan")

    opt.register_step_pre_hook(poison)
    captured: dict[str, list] = {}

    def grab(key):
        def hook(o, a, k):
            captured[key] = [None if p.grad is None else p.grad.detach().clone() for p in params]

        return hook

    opt.register_step_pre_hook(grab("averaged"))  # before ours: the reduced, unedited gradients
    before = hook_count(model, opt)
    insp = inspector.attach(model, opt, every=args.every)
    opt.register_step_pre_hook(grab("final"))  # after ours: what the optimizer uses
    insp.add_hook("nan_guard", target="*", action="skip")  # on every rank, from the training thread
    if rank == 0 and args.hist:
        insp.set_hist_params([args.hist])  # rank 0 only, as the page's subscription is
    url = insp.serve(port=args.port, db=False)
    assert (url is None) == (rank != 0)
    tick = threading.Event()
    out = (args.out / f"rank{rank}.jsonl").open("w")
    script_id = None
    for _ in range(args.steps):
        step_now[0] = insp.step + 1
        if insp.step + 1 == args.interleave:
            if rank == 0:  # a dashboard edit, still pending when the script's edit comes
                t = threading.Thread(target=lambda: insp.add_hook("scale", target="*", factor=1.0))
                t.start()
                t.join()
            script_id = insp.add_hook("clip_value", target="*", threshold=1e6).id
        x = torch.randn(8, 16, generator=data)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), x[:, :1]).backward()
        shards_before = [local(p.detach()).clone() for p in params]
        opt.step()
        step = insp.step
        moved = any(not torch.equal(a, local(p.detach())) for a, p in zip(shards_before, params, strict=True))
        grads = captured["averaged"]
        full_norm = float(torch.linalg.vector_norm(torch.stack([full(g).norm() for g in grads])))
        local_norm = float(torch.linalg.vector_norm(torch.stack([local(g).norm() for g in grads])))
        live = [
            h
            for h in insp.hooks()
            if h["kind"] == "clip_norm" and h["applied_step"] is not None and h["applied_step"] <= step
        ]
        clip_err = None
        if live and all(g is not None for g in captured["final"]):
            ref = [nn.Parameter(torch.zeros_like(g)) for g in grads]
            for p, g in zip(ref, grads, strict=True):
                p.grad = g.clone()
            torch.nn.utils.clip_grad_norm_(ref, live[0]["params"]["max_norm"])
            clip_err = max(
                float((local(p.grad) - local(f)).abs().max()) if local(f).numel() else 0.0
                for p, f in zip(ref, captured["final"], strict=True)
            )
        snap = insp.latest()
        row = {
            "step": step,
            "version": insp.config_version,
            "applied": [[h["id"], h["applied_step"]] for h in insp.hooks() if h["applied_step"]],
            "script_id": script_id,
            "moved": moved,
            "full_norm": full_norm,
            "local_norm": local_norm,
            "snap_total_raw": snap["total_norm_raw"] if snap and snap["step"] == step else None,
            "snap_hist": sorted(snap["hist"]) if snap and snap["step"] == step else None,
            "clip_err": clip_err,
        }
        out.write(json.dumps(row) + "\n")
        out.flush()
        tick.wait(1.0 / args.rate)  # a rate cap so the test can act mid-run, not a synchronisation
    insp.close()
    (args.out / f"close{rank}.json").write_text(
        json.dumps({"before": before + 1, "after": hook_count(model, opt)})  # + 1: grab("final")
    )
    assert all(math.isfinite(float(local(p.detach()).sum())) for p in params)


if __name__ == "__main__":
    main()
    # the group goes after the FSDP2 model (main's locals): an FSDP2 model freed at exit, after
    # destroy_process_group(), aborts about one gloo process in five ("terminate called without
    # an active exception", torch 2.13, with or without the inspector)
    gc.collect()
    dist.destroy_process_group()
    print("DONE", flush=True)
