"""One rank of the distributed tests (spawned by tests/distributed/test_ddp.py; pytest does not collect it: no test_ prefix).

Trains DDP on CPU/gloo with different data per rank, an inspector attached on every rank,
and writes one JSON line per step to OUT/rank{R}.jsonl: the step, a bitwise checksum of the
parameters, the config version, and, while a clip_norm hook is in force, the largest
difference between the gradients the optimizer used and ``clip_grad_norm_`` applied to
the all-reduced gradients.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import inspector  # noqa: E402


def checksum(model: nn.Module) -> str:
    h = hashlib.sha1()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rate", type=float, default=40.0)
    ap.add_argument("--nan-step", type=int, default=-1, help="rank 1 feeds a NaN batch at this step")
    ap.add_argument(
        "--die-at", type=int, default=-1, help="rank 1 exits inside optimizer.step() of this step"
    )
    ap.add_argument("--dist-timeout", type=float, default=60.0)
    ap.add_argument(
        "--interleave",
        type=int,
        default=-1,
        help="before this step: rank 0 adds a hook from another thread, then the script adds one",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(100 + rank)

    captured: dict[str, list[torch.Tensor]] = {}

    def grab(key):
        def hook(o, a, k):
            captured[key] = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]

        return hook

    opt.register_step_pre_hook(grab("averaged"))  # before ours: the all-reduced, unedited gradients
    if rank == 1 and args.die_at > 0:

        def die(o, a, k):
            if len(captured.get("steps", [])) + 1 == args.die_at:
                os._exit(3)  # a rank that vanishes mid-step, after DDP's all-reduce
            captured.setdefault("steps", []).append(None)

        opt.register_step_pre_hook(die)
    insp = inspector.attach(model, opt, every=1, dist_timeout=args.dist_timeout)
    opt.register_step_pre_hook(grab("final"))  # after ours: what the optimizer uses
    insp.add_hook("nan_guard", target="*", action="skip")  # on every rank, from the training thread
    url = insp.serve(port=args.port, db=False)
    assert (url is None) == (rank != 0)
    if url:
        print("URL " + url, flush=True)
    tick = threading.Event()
    out = (args.out / f"rank{rank}.jsonl").open("w")
    script_id = None
    for _ in range(args.steps):
        x = torch.randn(8, 16, generator=data)
        if insp.step + 1 == args.interleave:
            if rank == 0:  # a dashboard edit, still pending when the script's edit comes
                t = threading.Thread(target=lambda: insp.add_hook("scale", target="*", factor=1.0))
                t.start()
                t.join()
            script_id = insp.add_hook("clip_value", target="*", threshold=1e6).id
        if rank == 1 and insp.step + 1 == args.nan_step:
            x[0, 0] = float("nan")
        opt.zero_grad()
        try:
            nn.functional.mse_loss(model(x), x[:, :1]).backward()
        except RuntimeError as e:  # DDP's own all-reduce fails once a peer is gone
            (args.out / f"events{rank}.json").write_text(
                json.dumps({"ddp_error": str(e)[:200], "events": insp.events()})
            )
            print("PEER LOST", flush=True)
            os._exit(0)
        opt.step()
        step = insp.step
        clip_err = None
        live = [
            h
            for h in insp.hooks()
            if h["kind"] == "clip_norm"
            and h["applied_step"] is not None
            and h["applied_step"] <= step
            and h["enabled"]
        ]
        if live and all(g is not None for key in ("averaged", "final") for g in captured.get(key, [None])):
            ref = [copy.deepcopy(g) for g in captured["averaged"]]
            params = [nn.Parameter(torch.zeros_like(g)) for g in ref]
            for p, g in zip(params, ref, strict=True):
                p.grad = g
            torch.nn.utils.clip_grad_norm_(params, live[0]["params"]["max_norm"])
            clip_err = max(
                float((p.grad - f).abs().max()) for p, f in zip(params, captured["final"], strict=True)
            )
        out.write(
            json.dumps(
                {
                    "step": step,
                    "sum": checksum(model),
                    "version": insp.config_version,
                    "applied": [[h["id"], h["applied_step"]] for h in insp.hooks() if h["applied_step"]],
                    "script_id": script_id,
                    "clip_err": clip_err,
                }
            )
            + "\n"
        )
        out.flush()
        tick.wait(1.0 / args.rate)  # a rate cap so the test can act mid-run, not a synchronisation
    insp.close()
    dist.destroy_process_group()
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
