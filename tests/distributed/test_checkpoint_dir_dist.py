"""DCP directories under DDP: two gloo ranks (tests/distributed/dcp_worker.py). The loop writes
its own checkpoint with ``dcp.save`` at a boundary every rank reaches; the inspector's reading
(inspector/whatif/dcp_store.py) refuses a partial directory on every rank before anything is
loaded, and reads a whole one back in place on every rank, bitwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.test_fsdp import run_ranks
from tests.support import free_port

WORKER = Path(__file__).with_name("dcp_worker.py")
pytestmark = [pytest.mark.dist, pytest.mark.slow]


def test_two_ranks_read_a_dcp_directory_back_and_refuse_a_partial_one(tmp_path):
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
        "PYTHONUNBUFFERED": "1",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "--out", str(tmp_path)],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert len(r0["files"]) == 2  # each rank wrote its own data file
    for r in (r0, r1):
        assert (
            r["partial"] is not None and "partial checkpoint" in r["partial"] and "is missing" in r["partial"]
        )
        assert r["unchanged"] and r["restored"]
    assert r0["sum"] == r1["sum"]  # ranks in lockstep after the rewind


# attach(..., checkpoint_dir=PATH) and insp.rewind(path) under DDP and FSDP2: every rank writes
# its part of one DCP directory per checkpoint (DDP: its full state_dict, replicated entries written
# once; FSDP2: its shards) and reads it back at the same boundary, or every rank refuses it.
SCRIPT = r"""
import hashlib, json, math, shutil, sys, torch, torch.distributed as dist
from pathlib import Path
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
import inspector
from inspector.wire.errors import CheckpointError

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
layout, mode, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
if layout == "fsdp":
    from torch.distributed.fsdp import fully_shard
    fully_shard(model[0])
    fully_shard(model)
    full = lambda t: t.full_tensor()  # a collective: the test's comparison only
else:
    model = DDP(model)
    full = lambda t: t
opt = torch.optim.Adam(model.parameters(), lr=0.01)
rules = "safe overnight" if mode == "overnight" else None
insp = inspector.attach(model, opt, every=1, rules=rules, checkpoint_every=5, checkpoint_dir=out / "ckpt")
data = [torch.randn(8, 4, generator=torch.Generator().manual_seed(1000 * rank + i)) for i in range(15)]

def step(x):
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()

def digest():
    h = hashlib.sha1()
    params = [full(p.detach()) for p in model.parameters()]
    for p in params:
        h.update(p.contiguous().numpy().tobytes())
    return h.hexdigest(), all(bool(torch.isfinite(p).all()) for p in params)

def local():  # this rank's own state (FSDP2: its shards), bitwise
    sd = {k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in model.state_dict().items()}
    return sd, [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()} for s in opt.state.values()]

def same(a, b):
    if torch.is_tensor(a):
        return torch.equal(a.to_local() if hasattr(a, "to_local") else a, b.to_local() if hasattr(b, "to_local") else b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b

res = {"rank": rank}
keep = ("kind", "step", "from_step", "checkpoint", "first", "last", "count", "result", "action", "path")
if mode == "overnight":
    bad = int(sys.argv[4])
    if rank == 1:
        data[bad] = torch.full((8, 4), math.inf)
    for x in insp.batches(data):
        step(x)
    res["checksum"], res["finite"] = digest()
    res["step"] = insp.step
    res["events"] = [
        {k: e[k] for k in keep if k in e} for e in insp.events()
        if e["kind"] in ("rule_fired", "rewind", "rewind_error", "batches_skipped", "checkpoint_error")
    ]
    res["kept"] = [(c["step"], c["path"]) for c in insp.checkpoints.list()]
else:
    while insp.step < 8:
        step(data[insp.step])
    first, _ = digest()
    cp = next(c for c in insp.checkpoints.list() if c["step"] == 5)
    res["path"] = cp["path"]
    res["files"] = sorted(p.name for p in Path(cp["path"]).iterdir())
    # back to step 5 from the directory (the loop's own), then from the checkpoint's id: the same
    # batches replayed give the first pass's parameters, bitwise
    res["by_path"] = insp.rewind(Path(cp["path"]), step=5)["done"]
    res["step_after_path"] = insp.step
    while insp.step < 8:
        step(data[insp.step])
    res["replay_path"] = digest()[0] == first
    res["by_id"] = insp.rewind(cp["id"])["done"]
    while insp.step < 8:
        step(data[insp.step])
    res["replay_id"] = digest()[0] == first
    # one rank's data file gone: refused on every rank, nothing changed
    dist.barrier()
    if rank == 0:
        next(p for p in sorted(Path(cp["path"]).glob("*.distcp")) if p.name.startswith("__1_")).unlink()
    dist.barrier()
    before, at = local(), insp.step
    try:
        insp.rewind(Path(cp["path"]), step=5)
        res["partial"] = None
    except CheckpointError as e:
        res["partial"] = str(e)
    res["unchanged"] = same(local(), before) and insp.step == at
    step(data[insp.step])  # and training goes on, ranks in lockstep
    res["checksum"] = digest()[0]
    res["errors"] = [e["message"] for e in insp.events() if e["kind"] == "rewind_error"]
print("RESULT " + json.dumps(res))
insp.close()
dist.destroy_process_group()
"""


@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_safe_overnight_with_checkpoint_dir_rewinds_every_rank_from_disk_and_reaches_the_end(
    layout, tmp_path
):
    # rank 1's batch 9 (step 10's) is all inf: step 10's state is not kept, so back to step 5's
    r0, r1 = run_ranks(SCRIPT, layout, "overnight", str(tmp_path), "9")
    for r in (r0, r1):
        assert r["finite"], r
        kinds = [e["kind"] for e in r["events"]]
        assert kinds == ["rewind", "batches_skipped", "rule_fired"], r["events"]
        rewind, skipped, fired = r["events"]
        assert fired["action"] == "rewind_skip" and fired["result"]["rewound"] is True, fired
        assert rewind["step"] == 5, rewind
        assert skipped["first"] == 5 and skipped["first"] <= 9 <= skipped["last"], skipped
        assert r["step"] == 15 - skipped["count"], (r["step"], skipped)
        # the checkpoints kept are directories on disk, the same on every rank
        assert r["kept"] and all(p and Path(p).parent == tmp_path / "ckpt" for _, p in r["kept"]), r["kept"]
    assert r0["kept"] == r1["kept"]
    assert r0["checksum"] == r1["checksum"], (r0, r1)
    assert r0["events"] == r1["events"]


@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_a_disk_checkpoint_replays_bitwise_on_every_rank_and_a_partial_one_is_refused_on_every_rank(
    layout, tmp_path
):
    r0, r1 = run_ranks(SCRIPT, layout, "replay", str(tmp_path))
    assert r0["path"] == r1["path"]
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "inspector.json"} <= set(r0["files"]), r0
    for r in (r0, r1):
        assert r["by_path"] and r["step_after_path"] == 5, r
        assert r["replay_path"] and r["by_id"] and r["replay_id"], r
        assert r["partial"] is not None and "refused on every rank" in r["partial"], r
        assert "partial checkpoint" in r["partial"] and "is missing" in r["partial"], r
        assert r["unchanged"], r
        assert len(r["errors"]) == 1 and "partial checkpoint" in r["errors"][0], r["errors"]
    assert r0["checksum"] == r1["checksum"]
