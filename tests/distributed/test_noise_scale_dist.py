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


CLIP_SCRIPT = """
import json, sys, torch, torch.distributed as dist
from torch import nn
from torch.func import functional_call, grad
import inspector
from tests.unit.test_noise_scale import problem
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model, x, y = problem()
ref = {k: v.detach().double() for k, v in model.named_parameters()}  # (float64: the reference's copy)
mode, k = sys.argv[1], int(sys.argv[2])
if mode == "ddp":
    net = nn.parallel.DistributedDataParallel(model)
else:
    from torch.distributed.fsdp import fully_shard
    fully_shard(model[0])
    net = fully_shard(model)
opt = torch.optim.SGD(net.parameters(), lr=0.05)
insp = inspector.attach(net, opt, every=1, noise_ema=0.0)  # (ema 0: the last step's estimates alone)
# every rank's micro-batches, drawn alike on every rank (the reference needs the other ranks' too)
gens = [torch.Generator().manual_seed(100 + r) for r in range(world)]
STEPS = 6
draws = [[[torch.randint(0, len(x), (16,), generator=gens[r]) for _ in range(k)] for _ in range(STEPS)]
         for r in range(world)]


def loss_of(out, yi):
    return ((out - yi) ** 2).mean() * 10 / k  # (x10: a norm the clip to 1.0 always cuts)


for step in range(STEPS):
    if step == STEPS - 1:  # the parameters the last step's gradients are taken at
        full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p) for n, p in net.named_parameters()}
        ref = {n.removeprefix("module."): p.detach().double() for n, p in full.items()}
    opt.zero_grad()
    for j in range(k):
        idx = draws[rank][step][j]
        if mode == "ddp" and j < k - 1:
            with net.no_sync():
                loss_of(net(x[idx]), y[idx]).backward()
        else:
            loss_of(net(x[idx]), y[idx]).backward()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)  # the loop's own clip (nanoGPT's)
    opt.step()

# the float64 reference: each rank's micro-batch gradients of the last step, before any clip
m64 = model.double() if mode == "ddp" else problem()[0].double()
xs, ys = x.double(), y.double()
incs = [[torch.cat([g.reshape(-1) for g in grad(lambda p, i=idx: loss_of(functional_call(m64, p, (xs[i],)), ys[i]))(ref).values()])
         for idx in draws[r][STEPS - 1]] for r in range(world)]
small = sum(k * sum(float(d.square().sum()) for d in incs[r]) for r in range(world)) / world
big_g = sum(sum(incs[r]) for r in range(world)) / world
big = float(big_g.square().sum())
b_small, b_big = 16, world * k * 16
want = {"g_sq": (b_big * big - b_small * small) / (b_big - b_small),
        "trace_sigma": (small - big) / (1 / b_small - 1 / b_big), "backward": big ** 0.5}
snap = insp.latest()
from server.hub import wire_snapshot
wire = wire_snapshot(snap)  # what the page gets: the two norms its note compares
got = {"ns": snap["noise_scale"], "backward": snap["total_norm_backward"], "raw": snap["total_norm_raw"],
       "wire": [wire["total_norm_backward"], wire["total_norm_raw"]]}
errors = [e for e in insp.events() if e["kind"] in ("hook_error", "telemetry_error", "distributed_error")]
print("RESULT " + json.dumps({"rank": rank, "got": got, "want": want, "errors": errors}), flush=True)
insp.close()
del insp, net, model, opt
import gc; gc.collect()
dist.destroy_process_group()
"""


@pytest.mark.parametrize(("mode", "k"), [("ddp", 1), ("ddp", 2), ("fsdp", 2)])
def test_the_big_batch_is_taken_before_the_loops_own_clip(mode: str, k: int) -> None:
    """A loop that clips its gradients to 1.0 between backward() and step() (nanoGPT's): the big
    batch and the snapshot's backward norm are the reduced gradient's before that clip, equal to a
    float64 reference from every rank's micro-batch gradients of the last step; the norm at the
    step is the clipped one (the page says the loop changed the gradients)."""
    results = run_ranks(CLIP_SCRIPT, mode, str(k))
    for res in results:
        assert res["errors"] == [], res["errors"]
        got, want, ns = res["got"], res["want"], res["got"]["ns"]
        assert got["raw"] == pytest.approx(1.0, rel=1e-4), "the step sees the loop's clip"
        assert want["backward"] > 2, want  # (the clip cut the gradients)
        assert got["backward"] == pytest.approx(want["backward"], rel=1e-5), "as backward left them"
        assert got["wire"] == [got["backward"], got["raw"]], (
            "the page's note: your loop changed the gradients"
        )
        # (FSDP2: from the first sampled step after every module has been gathered once)
        assert ns["mode"] == mode and ns["k"] == k and ns["samples"] == (6 if mode == "ddp" else 5)
        assert (ns["b_small"], ns["b_big"]) == (16, 32 * k)
        assert ns["g_sq"] == pytest.approx(want["g_sq"], rel=1e-4), (ns["g_sq"], want["g_sq"])
        assert ns["trace_sigma"] == pytest.approx(want["trace_sigma"], rel=1e-4)
        assert ns["b_simple"] == pytest.approx(want["trace_sigma"] / want["g_sq"], rel=2e-4)
    assert results[0]["got"] == results[1]["got"]
