"""Rules under DDP (two gloo ranks): rank 0 decides, the decision travels in the next boundary's
exchange, and every rank fires the rule and carries out its action at the same step."""

from __future__ import annotations

import pytest

from tests.distributed.test_fsdp import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow]

SCRIPT = r"""
import json, os, torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
import inspector

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
insp = inspector.attach(model, opt, every=1)
# the same rule on every rank (as a script makes it); only rank 0's evaluation counts
insp.add_rule(signal="step", op=">=", threshold=7, action="add_hook",
              args={"kind": "clip_norm", "target": "*", "params": {"max_norm": 0.5}}, cooldown=1000)
# rank 0 alone has this one (as the dashboard's are): rank 1 still fires it, from rank 0's decision
if rank == 0:
    insp.add_rule(signal="step", op="==", threshold=4, action="alert")
    # on rank 0's own loss, recorded after step(): step 1's value reaches its host at boundary 3
    insp.add_rule(signal="loss", op=">", threshold=0, action="alert", cooldown=1000)
g = torch.Generator().manual_seed(rank)
applied = {}
for step in range(1, 16):
    x = torch.randn(16, 4, generator=g)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    insp.record(loss=loss)
    for h in insp.hooks():
        if h["applied_step"] is not None:
            applied[h["id"]] = h["applied_step"]
fired = [(e["rule"], e["at"], e["action"], e["result"]) for e in insp.events() if e["kind"] == "rule_fired"]
steps = [(e["rule"], e["step"]) for e in insp.events() if e["kind"] == "rule_fired"]
print("RESULT " + json.dumps({"rank": rank, "fired": fired, "steps": steps, "applied": applied,
                              "hooks": [(h["id"], h["kind"], h["params"]) for h in insp.hooks()]}))
insp.close()
dist.destroy_process_group()
"""


def test_a_rule_fires_at_the_same_step_on_both_ranks_and_its_hook_applies_on_both():
    r0, r1 = run_ranks(SCRIPT)
    # rank 0 decided at the boundary of step 7 (and 4, and 3 for step 1's loss); the decision
    # rode in the next exchange: both ranks fire at step 8 (5, 4), the same step
    assert r0["fired"] and r0["fired"] == r1["fired"], (r0, r1)
    by_rule = {rule: (at, action) for rule, at, action, _ in r0["fired"]}
    assert by_rule == {"r1": (8, "add_hook"), "r2": (5, "alert"), "r3": (4, "alert")}, by_rule
    # the loss rule: step 1's loss, decided at boundary 3 (the late record's copy read there), as step 1
    assert r0["steps"] == r1["steps"] and ["r3", 1] in r0["steps"], r0["steps"]
    # the hook the rule added has the same id and parameters on both ranks, and both apply it from
    # the step after the boundary that added it
    assert r0["hooks"] == r1["hooks"] and [h[1] for h in r0["hooks"]] == ["clip_norm"], r0["hooks"]
    assert r0["applied"] == r1["applied"] and list(r0["applied"].values()) == [9], (r0, r1)
