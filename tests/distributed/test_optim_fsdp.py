"""The optimizer's state under FSDP2: two gloo processes, AdamW on a model sharded with
``fully_shard`` (one parameter left unsharded beside the sharded ones). Each rank's snapshot holds
the full tensors' ``exp_avg_norm``, ``exp_avg_sq_sqrt_norm``, ``below_eps_frac`` and
``step_ratio``, equal on both ranks and to a float64 reference made from the gathered full state
(``full_tensor()``), per tensor and for the whole model; so are the cosines of the update and the
gradient and of consecutive gradients, from the shards' dot products summed."""

from __future__ import annotations

import math

import pytest

from tests.distributed.test_fsdp import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow]

SCRIPT = """
import json, math, torch, torch.distributed as dist
from torch import nn
import inspector
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 7), nn.Tanh(), nn.Linear(7, 2))
fully_shard(model[0])
fully_shard(model[2])
fully_shard(model, ignored_params=set(model[4].parameters()))  # 4.*: plain tensors on every rank
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)
insp = inspector.attach(model, opt, every=1)
full = lambda t: (t.full_tensor() if isinstance(t, DTensor) else t).detach().double()
data = torch.Generator().manual_seed(rank)
out = []
prev = None
for i in range(4):
    opt.zero_grad()
    model(torch.randn(8, 6, generator=data)).square().mean().backward()
    for p in model[4].parameters():  # the unsharded ones: reduced by hand, as their owner must
        dist.all_reduce(p.grad)
        p.grad /= 2
    ps = list(model.parameters())
    before = [full(p).clone() for p in ps]
    grads = [full(p.grad) for p in ps]
    opt.step()
    after = [full(p) for p in ps]
    ref = []
    for p, b, a, g in zip(ps, before, after, grads):
        st = opt.state[p]
        m, v = full(st["exp_avg"]), full(st["exp_avg_sq"])
        t = float(st["step"])
        below = int((v / (1 - 0.999 ** t) < 1e-6).sum())
        ref.append({"m_sq": float(m.square().sum()), "v": float(v.sum()), "below": below, "n": v.numel(),
                    "u": float((b - a).norm()), "g": float(g.norm()),
                    "cos_ug": float(torch.dot((b - a).flatten(), g.flatten()) / ((b - a).norm() * g.norm()))})
    if prev is not None:
        for r, g, q in zip(ref, grads, prev):
            r["cos_gg"] = float(torch.dot(g.flatten(), q.flatten()) / (g.norm() * q.norm()))
    flat = lambda ts: torch.cat([t.flatten() for t in ts])
    model_ref = {"cos_ug": float(torch.nn.functional.cosine_similarity(
        flat([b - a for b, a in zip(before, after)]), flat(grads), dim=0))}
    if prev is not None:
        model_ref["cos_gg"] = float(torch.nn.functional.cosine_similarity(flat(grads), flat(prev), dim=0))
    prev = grads
    out.append({"snap": insp.latest(), "ref": ref, "model": model_ref})
errors = [e for e in insp.events() if e["kind"] in ("hook_error", "telemetry_error", "distributed_error")]
print("RESULT " + json.dumps({"rank": rank, "out": out, "errors": errors}), flush=True)
insp.close()
del insp, model, opt
import gc; gc.collect()
dist.destroy_process_group()
"""


def close(a: float | None, b: float, rel: float = 1e-5) -> bool:
    return a is not None and math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


def test_the_adam_state_of_sharded_parameters_is_that_of_the_full_tensors() -> None:
    results = run_ranks(SCRIPT)
    assert [r["errors"] for r in results] == [[], []]
    assert [s["snap"]["optim"] for s in results[0]["out"]] == [s["snap"]["optim"] for s in results[1]["out"]]
    for item in results[0]["out"]:
        o, ref = item["snap"]["optim"], item["ref"]
        assert o is not None and o["kind"] == "adam"
        for i, r in enumerate(ref):
            assert close(o["exp_avg_norm"][i], math.sqrt(r["m_sq"])), (i, o["exp_avg_norm"][i], r)
            assert close(o["exp_avg_sq_sqrt_norm"][i], math.sqrt(r["v"])), (i, r)
            assert o["below_eps_frac"][i] == r["below"] / r["n"], (i, o["below_eps_frac"][i], r)
            assert close(o["step_ratio"][i], r["u"] / r["g"], 1e-4), (i, o["step_ratio"][i], r)
            assert close(o["cos_update_grad"][i], r["cos_ug"], 1e-4), (i, o["cos_update_grad"][i], r)
            if "cos_gg" in r:
                assert close(o["cos_grad_prev"][i], r["cos_gg"], 1e-4), (i, o["cos_grad_prev"][i], r)
            else:
                assert o["cos_grad_prev"][i] is None
        want = item["model"]
        assert close(o["model"]["cos_update_grad"], want["cos_ug"], 1e-4), (o["model"], want)
        if "cos_gg" in want:
            assert close(o["model"]["cos_grad_prev"], want["cos_gg"], 1e-4), (o["model"], want)
            assert o["cos_prev_gap"] == 1
        model = o["model"]
        assert close(model["exp_avg_norm"], math.sqrt(sum(r["m_sq"] for r in ref)))
        assert model["below_eps_frac"] == sum(r["below"] for r in ref) / sum(r["n"] for r in ref)
        assert close(
            model["step_ratio"],
            math.sqrt(sum(r["u"] ** 2 for r in ref) / sum(r["g"] ** 2 for r in ref)),
            1e-4,
        )
    fracs = [f for item in results[0]["out"] for f in item["snap"]["optim"]["below_eps_frac"]]
    assert 0 < max(fracs), "some of v below eps**2: the count is tried"
