"""Group aggregates under torch.distributed: two gloo processes, FSDP2 (``fully_shard``, whose
per-tensor statistics are combined across the ranks on the host, and the aggregates with them) and
DDP (the device path). Both ranks' snapshots carry the same aggregates, and they equal a float64
reference made from the snapshot's own per-tensor lists (full tensors, not shards)."""

from __future__ import annotations

import pytest

from tests.distributed.test_fsdp import run_ranks
from tests.unit.test_groups import assert_close, reference

pytestmark = [pytest.mark.dist, pytest.mark.slow]

SCRIPT = """
import json, math, sys, torch, torch.distributed as dist
from torch import nn
import inspector
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(*(nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6)) for _ in range(4)), nn.Linear(6, 2))
for p in model[2].parameters():
    p.requires_grad_(False)  # a frozen block: its group has no gradient
if sys.argv[1] == "fsdp":
    from torch.distributed.fsdp import fully_shard
    for b in list(model)[:2]:
        fully_shard(b)
    fully_shard(model)
else:
    model = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
insp = inspector.attach(model, opt, every=1)
insp.add_hook("clip_norm", target="3.*", max_norm=1e-3, mode="per_tensor")
data = torch.Generator().manual_seed(rank)
snaps = []
for i in range(4):
    opt.zero_grad()
    x = torch.randn(4, 6, generator=data)
    if i == 2 and rank == 1:
        x[0, 0] = math.nan  # a NaN in one rank's batch
    model(x).square().mean().backward()
    opt.step()
    snaps.append(insp.latest())
errors = [e for e in insp.events() if e["kind"] in ("hook_error", "telemetry_error", "distributed_error")]
print("RESULT " + json.dumps({"rank": rank, "groups": insp.groups, "snaps": snaps, "errors": errors}), flush=True)
insp.close()
del insp, model, opt
import gc; gc.collect()
dist.destroy_process_group()
"""


@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_group_aggregates_under_two_ranks_equal_the_reference(kind: str) -> None:
    results = run_ranks(SCRIPT, kind)
    for res in results:
        assert res["errors"] == [], res["errors"]
        members = res["groups"]["members"]
        frozen = next(g for g, name in enumerate(res["groups"]["names"]) if name.startswith("2"))
        for snap in res["snaps"]:
            assert_close(snap["groups"], reference(snap, members))
            assert snap["groups"]["norm_raw"][frozen] is None
        nan_step = res["snaps"][2]["groups"]
        assert "nan" in nan_step["norm_raw"], nan_step["norm_raw"]
        if kind == "ddp":  # (under FSDP2 a shard's counts are not the tensor's: unknown, None)
            assert any(c for c in nan_step["nan_count"] if c), nan_step["nan_count"]
    for a, b in zip(results[0]["snaps"], results[1]["snaps"], strict=True):
        assert a["groups"] == b["groups"]
