"""The gradient noise scale under DDP and FSDP2 (two gloo processes): each rank's micro-batch
gradient before the collective is the small batch, the averaged, accumulated one the big batch
(inspector/stats/noise_scale.py); under DDP with and without ``no_sync()`` accumulation, under
FSDP2 (the unsharded parameters' gradients) with and without accumulation, and with
``set_requires_gradient_sync(False)`` between micro-batches.
A frozen model (lr 0) on a fixed dataset: the estimate must be within 20 % of the truth from
per-example gradients (tests/unit/test_noise_scale.py's ``truth``), on both ranks alike."""

from __future__ import annotations

import pytest

from tests.distributed.test_fsdp import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def report(model: str) -> str:
    """The scripts' end: each rank prints its estimate, the truth and any error, then closes
    (``model``: the name the script trains, freed before the process group is destroyed)."""
    return """
ns = insp.latest()["noise_scale"]
errors = [e for e in insp.events() if e["kind"] in ("hook_error", "telemetry_error", "distributed_error")]
print("RESULT " + json.dumps({"rank": rank, "ns": ns, "want": want, "errors": errors}), flush=True)
insp.close()
del insp, MODEL, opt
import gc; gc.collect()
dist.destroy_process_group()
""".replace("MODEL", model)


SCRIPT = """
import json, sys, torch, torch.distributed as dist
from torch import nn
import inspector
from tests.unit.test_noise_scale import problem, truth
dist.init_process_group("gloo")
rank = dist.get_rank()
model, x, y = problem()
want = truth(model, x, y, [])["whole"]
ddp = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.0)
k = int(sys.argv[1])
insp = inspector.attach(ddp, opt, every=1, noise_ema=0.99)
gen = torch.Generator().manual_seed(100 + rank)
for _ in range(400):
    opt.zero_grad()
    for j in range(k):
        idx = torch.randint(0, len(x), (16,), generator=gen)
        loss = ((ddp(x[idx]) - y[idx]) ** 2).mean() / k
        if j < k - 1:
            with ddp.no_sync():
                loss.backward()
        else:
            loss.backward()
    opt.step()
"""


@pytest.mark.parametrize("k", [1, 2])
def test_ddp_estimate_matches_per_example_truth(k: int) -> None:
    results = run_ranks(SCRIPT + report("ddp"), str(k))
    for res in results:
        assert res["errors"] == [], res["errors"]
        ns, (b_true, tr_true, gsq_true) = res["ns"], res["want"]
        assert ns["mode"] == "ddp" and ns["k"] == k
        assert (ns["b_small"], ns["b_big"], ns["batch_source"]) == (16, 32 * k, "inferred")
        assert abs(ns["b_simple"] / b_true - 1) <= 0.2, (ns["b_simple"], b_true)
        assert abs(ns["trace_sigma"] / tr_true - 1) <= 0.2, (ns["trace_sigma"], tr_true)
        assert abs(ns["g_sq"] / gsq_true - 1) <= 0.2, (ns["g_sq"], gsq_true)
    assert results[0]["ns"] == results[1]["ns"]  # every rank computes it from the same rows


FSDP_SCRIPT = """
import json, sys, torch, torch.distributed as dist
from torch import nn
import inspector
from torch.distributed.fsdp import fully_shard
from tests.unit.test_noise_scale import problem, truth
dist.init_process_group("gloo")
rank = dist.get_rank()
model, x, y = problem()
want = truth(model, x, y, [[0, 1], [2, 3]])
fully_shard(model[0])
fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.0)
k, no_sync = int(sys.argv[1]), sys.argv[2] == "1"
insp = inspector.attach(model, opt, every=1, noise_ema=0.99, groups={"0.*": "first", "2.*": "last"})
assert insp.groups["members"] == [[0, 1], [2, 3]], insp.groups
gen = torch.Generator().manual_seed(100 + rank)
for _ in range(400):
    opt.zero_grad()
    for j in range(k):
        if no_sync:
            model.set_requires_gradient_sync(j == k - 1)
        idx = torch.randint(0, len(x), (16,), generator=gen)
        loss = ((model(x[idx]) - y[idx]) ** 2).mean() / k
        loss.backward()
    opt.step()
"""


@pytest.mark.parametrize(("k", "no_sync"), [(1, False), (2, False), (2, True)])
def test_fsdp2_estimate_matches_per_example_truth(k: int, no_sync: bool) -> None:
    results = run_ranks(FSDP_SCRIPT + report("model"), str(k), "1" if no_sync else "0")
    for res in results:
        assert res["errors"] == [], res["errors"]
        ns, want = res["ns"], res["want"]
        assert ns["mode"] == "fsdp" and ns["k"] == k
        assert (ns["b_small"], ns["b_big"], ns["batch_source"]) == (16, 32 * k, "inferred")
        b_true, tr_true, gsq_true = want["whole"]
        assert abs(ns["b_simple"] / b_true - 1) <= 0.2, (ns["b_simple"], b_true)
        assert abs(ns["trace_sigma"] / tr_true - 1) <= 0.2, (ns["trace_sigma"], tr_true)
        assert abs(ns["g_sq"] / gsq_true - 1) <= 0.2, (ns["g_sq"], gsq_true)
        for g, (bt, _, _) in enumerate(want["groups"]):  # (per group: as tests/unit's, within 30 %)
            assert abs(ns["groups"]["b_simple"][g] / bt - 1) <= 0.3, (g, ns["groups"]["b_simple"][g], bt)
    assert results[0]["ns"] == results[1]["ns"]  # every rank computes it from the same rows
