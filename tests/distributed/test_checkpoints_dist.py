"""Checkpoints and rewind under torch.distributed (two gloo ranks): every rank takes and restores its
own state (DDP: its state_dict; FSDP2: its shards through get_state_dict/set_state_dict) at the same
boundary; a rewind that cannot be carried out on one rank is carried out on none; "safe overnight"
rewinds every rank and skips the same batches; a rank that dies during a rewind leaves the other at a
boundary with the reason, within the control plane's timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.test_fsdp import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow]

# The loop trains on the batch of index insp.step + 1 (different on each rank): a rewind replays
# the same batches. Phases: a checkpoint after step 3 (the script, every rank); steps to 6; a rewind
# from the script (every rank); steps 4-6 again; a rewind asked for by another thread on rank 0 (as
# the page's, the agent's), which the next exchange carries to every rank; steps again; then a
# rewind to a checkpoint that rank 1 no longer holds: refused on every rank, nothing changed.
COMMON = r"""
import hashlib, json, sys, threading, torch, torch.distributed as dist
from torch import nn
import inspector
from inspector import CheckpointError

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)


def batch(i):
    g = torch.Generator().manual_seed(1000 * rank + i)
    return torch.randn(8, 4, generator=g)


def train(i):
    loss = model(batch(i)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

CHECKS = r"""
def run():
    first, second, third = {}, {}, {}
    for i in range(1, 7):
        train(i)
        first[insp.step] = checksum()
        if insp.step == 3:
            cp = insp.checkpoint("k")
    out = insp.rewind(cp)
    assert insp.step == 3, insp.step
    for _ in range(3):
        train(insp.step + 1)
        second[insp.step] = checksum()
    if rank == 0:  # another thread (the server's): rank 0 only; it travels in the next exchange
        t = threading.Thread(target=lambda: insp.rewind(cp))
        t.start()
        t.join()
    for _ in range(4):  # step 7, at whose boundary every rank rewinds to step 3; then 4-6
        train(insp.step + 1)
        third[insp.step] = checksum()
    before, step = checksum(), insp.step
    if rank == 1:
        insp.checkpoints.discard(cp)  # rank 1 no longer holds it
    try:
        insp.rewind(cp)
        refused = None
    except CheckpointError as e:
        refused = str(e)
    events = [
        {k: e.get(k) for k in ("kind", "step", "from_step", "checkpoint", "message")}
        for e in insp.events()
        if e["kind"] in ("checkpoint", "rewind", "rewind_error")
    ]
    print("RESULT " + json.dumps({
        "rank": rank, "first": first, "second": second, "third": third, "out": out,
        "refused": refused, "unchanged": checksum() == before and insp.step == step,
        "events": events,
    }))


run()
insp.close()
dist.destroy_process_group()
"""

DDP = (
    COMMON
    + r"""
from torch.nn.parallel import DistributedDataParallel as DDP
model = DDP(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
insp = inspector.attach(model, opt, every=1)


def checksum():
    h = hashlib.sha1()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    for st in opt.state.values():  # Adam's moments too
        for v in st.values():
            h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()
"""
    + CHECKS
)

FSDP = (
    COMMON
    + r"""
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
fully_shard(model[0])
fully_shard(model)
opt = torch.optim.Adam(model.parameters(), lr=0.01)
insp = inspector.attach(model, opt, every=1)


def checksum():
    # the full tensors (gathered from every rank's shards: a collective, for the test only)
    h = hashlib.sha1()
    for p in model.parameters():
        h.update(p.detach().full_tensor().contiguous().numpy().tobytes())
    for st in opt.state.values():
        for v in st.values():
            v = v.full_tensor() if isinstance(v, DTensor) else v
            h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()
"""
    + CHECKS
)


def _check(r0: dict, r1: dict) -> None:
    for r in (r0, r1):
        # a rewind from the script, then one from rank 0's other thread: the steps after the
        # checkpoint replayed on the same batches are bitwise those of the first pass
        assert r["second"] == {k: r["first"][k] for k in ("4", "5", "6")}, r
        assert r["third"]["3"] == r["first"]["3"], r  # step 7's boundary rewound to step 3
        assert {k: r["third"][k] for k in ("4", "5", "6")} == r["second"], r
        assert r["out"] == {"checkpoint": "c1", "step": 3, "done": True}, r
        # refused on every rank (rank 1 no longer holds c1), with the same reason; nothing changed
        assert r["refused"] and "rank 1" in r["refused"] and "c1" in r["refused"], r
        assert r["unchanged"], r
    assert r0["first"] == r1["first"] and r0["third"] == r1["third"], (r0, r1)  # ranks equal
    assert r0["refused"] == r1["refused"], (r0["refused"], r1["refused"])
    # every rank's events alike: the checkpoint, the last rewind (from step 7; the first one's event
    # is on the branch it abandoned, dropped from the log), the refusal
    # (a checkpoint's message gives this rank's bytes: under FSDP2 its shards', uneven across ranks)
    alike = [
        [{**e, "message": None} if e["kind"] == "checkpoint" else e for e in r["events"]] for r in (r0, r1)
    ]
    assert alike[0] == alike[1], (r0["events"], r1["events"])
    kinds = [(e["kind"], e["step"], e["from_step"]) for e in r0["events"]]
    assert kinds == [("checkpoint", 3, None), ("rewind", 3, 7), ("rewind_error", 6, None)], kinds


def test_ddp_rewind_is_carried_out_on_every_rank_and_replays_bitwise_or_is_refused_on_every_rank():
    _check(*run_ranks(DDP))


def test_fsdp2_rewind_restores_every_ranks_shards_and_replays_bitwise_or_is_refused_on_every_rank():
    _check(*run_ranks(FSDP))


# "safe overnight" under DDP and FSDP2: rank 1's batch of index BAD (step BAD + 1's) is all inf. The loop
# checkpoints every 5 steps (insp.checkpoint(), every rank: "script"), or attach(checkpoint_every=5)
# does ("every"); the rule, decided on rank 0, rewinds every rank to the newest checkpoint and skips
# the batches since it; the loader goes on to its end.
OVERNIGHT = r"""
import hashlib, json, math, sys, torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
import inspector

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
if sys.argv[1] == "fsdp":
    from torch.distributed.fsdp import fully_shard
    fully_shard(model[0])
    fully_shard(model)
    full = lambda t: t.full_tensor()  # a collective: the test's comparison only
else:
    model = DDP(model)
    full = lambda t: t
opt = torch.optim.Adam(model.parameters(), lr=0.01)
auto, bad = sys.argv[2] == "every", int(sys.argv[3])
insp = inspector.attach(model, opt, every=1, rules="safe overnight", checkpoint_every=5 if auto else None)
data = [torch.randn(8, 4, generator=torch.Generator().manual_seed(1000 * rank + i)) for i in range(30)]
if rank == 1:
    data[bad] = torch.full((8, 4), math.inf)
for x in insp.batches(data):
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if not auto and insp.step % 5 == 0:
        insp.checkpoint()
h = hashlib.sha1()
params = [full(p.detach()) for p in model.parameters()]
for p in params:
    h.update(p.contiguous().numpy().tobytes())
keep = ("kind", "step", "from_step", "checkpoint", "first", "last", "count", "result", "at", "action")
events = [
    {k: e[k] for k in keep if k in e}
    for e in insp.events()
    if e["kind"] in ("rule_fired", "rule_failed", "rewind", "rewind_error", "batches_skipped", "distributed_error")
]
print("RESULT " + json.dumps({
    "rank": rank, "step": insp.step, "finite": all(bool(torch.isfinite(p).all()) for p in params),
    "checksum": h.hexdigest(), "events": events,
}))
insp.close()
dist.destroy_process_group()
"""


@pytest.mark.parametrize(
    ("layout", "how", "bad", "back_to"),
    [
        ("ddp", "script", 12, 10),
        ("fsdp", "script", 12, 10),
        # checkpoint_every=5 and the inf batch at step 10, a multiple of 5: that step's state is
        # not kept (every rank knows its NaN/Inf before the boundary's checkpoint), so the run
        # goes back to step 5's
        ("ddp", "every", 9, 5),
        ("fsdp", "every", 9, 5),
    ],
)
def test_safe_overnight_rewinds_every_rank_skips_the_same_window_and_reaches_the_end(
    layout, how, bad, back_to
):
    r0, r1 = run_ranks(OVERNIGHT, layout, how, str(bad))
    for r in (r0, r1):
        assert r["finite"], r
        kinds = [e["kind"] for e in r["events"]]
        # (the rule's firing is logged with its result, after the rewind it made)
        assert kinds == ["rewind", "batches_skipped", "rule_fired"], r["events"]
        rewind, skipped, fired = r["events"]
        assert fired["action"] == "rewind_skip" and fired["result"]["rewound"] is True, fired
        assert rewind["step"] == back_to and rewind["checkpoint"] == fired["result"]["checkpoint"], rewind
        # the window: the batches since the checkpoint (indices back_to...), the inf one among them
        assert skipped["first"] == back_to and skipped["first"] <= bad <= skipped["last"], skipped
        # the loader went on to its end: 30 batches, those skipped made no step
        assert r["step"] == 30 - skipped["count"], (r["step"], skipped)
    # ranks in lockstep (DDP: bitwise equal replicas; FSDP2: every rank gathers the same full tensors)
    assert r0["checksum"] == r1["checksum"], (r0, r1)
    assert r0["events"] == r1["events"], (r0["events"], r1["events"])  # every rank's log alike


# A rank that dies during a rewind: rank 1 exits after step 5, while rank 0 rewinds to the checkpoint
# of step 3, either from the script ("script") or from another thread ("page", as the server's: the
# request waits for the next boundary's exchange). No DDP (its all-reduce would fail first, with its
# own error): the control plane's collectives are the only ones. Rank 0 must come back from the
# collective with the reason (within dist_timeout; at once where the peer's socket closes), its state
# unchanged, the request refused, and no request left waiting.
DIES = r"""
import hashlib, json, os, sys, threading, torch, torch.distributed as dist
from torch import nn
import inspector
from inspector import CheckpointError

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
insp = inspector.attach(model, opt, every=1, dist_timeout=20)
how = sys.argv[1]


def train():
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1000 * rank + insp.step))
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def checksum():
    h = hashlib.sha1()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


for _ in range(5):
    train()
    if insp.step == 3:
        cp = insp.checkpoint()
if rank == 1:
    print("RESULT " + json.dumps({"rank": 1}), flush=True)
    os._exit(0)  # gone, without a word to the others
before, step, raised = checksum(), insp.step, None
if how == "script":
    try:
        insp.rewind(cp)
    except CheckpointError as e:
        raised = str(e)
else:
    threading.Thread(target=lambda: insp.rewind(cp)).start()
    train()  # its boundary's exchange fails: the rewind waiting for it is refused
    before, step = None, 5  # (this step trained: the state is step 6's, not the checkpoint's)
events = [
    {k: e.get(k) for k in ("kind", "checkpoint", "message")}
    for e in insp.events()
    if e["kind"] in ("rewind", "rewind_error", "distributed_error")
]
print("RESULT " + json.dumps({
    "rank": 0, "raised": raised, "step": insp.step, "unchanged": before in (None, checksum()),
    "pending": insp.checkpoints.pending_rewind() is not None, "events": events,
    "refused": insp.checkpoints.refusal(),
}), flush=True)
os._exit(0)  # (no destroy_process_group: its peer is gone)
"""


@pytest.mark.parametrize("how", ["script", "page"])
def test_a_rank_that_dies_during_a_rewind_leaves_the_other_at_a_boundary_with_the_reason(how):
    r0, _ = run_ranks(DIES, how)
    kinds = [e["kind"] for e in r0["events"]]
    # the collective failed on rank 0: a distributed_error, then the rewind refused, nothing changed
    assert "rewind" not in kinds and "distributed_error" in kinds and kinds[-1] == "rewind_error", r0
    assert r0["unchanged"] and r0["step"] == (5 if how == "script" else 6), r0
    assert r0["events"][-1]["checkpoint"] == "c1", r0
    if how == "script":
        assert r0["raised"] and "nothing changed" in r0["raised"], r0
    assert not r0["pending"], r0  # no rewind left waiting (hook changes are not refused for ever)
    assert r0["refused"] and "control collective failed" in r0["refused"], r0  # and say why from now


# The page's path while paused: rank 0 pauses from another thread (every rank holds at the same
# boundary), asks for a checkpoint there (its heartbeat exchange carries it: every rank takes it
# while held) and resumes; later the script rewinds to it on every rank, and the replay is bitwise.
HELD = r"""
import hashlib, json, threading, time, torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
import inspector

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
insp = inspector.attach(model, opt, every=1)


def train():
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1000 * rank + insp.step))
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def checksum():
    h = hashlib.sha1()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def page():  # rank 0's server thread, as the dashboard's buttons drive it
    insp.pause()
    while not insp.state["held"]:
        time.sleep(0.01)
    cid = insp.checkpoints.checkpoint("from the page")
    got["taken"] = insp.checkpoints.wait(cid, 60)
    got["id"] = cid
    insp.resume()


got, first, again = {}, {}, {}
t = threading.Thread(target=page) if rank == 0 else None
for _ in range(8):
    train()
    first[insp.step] = checksum()
    if insp.step == 2 and t is not None:
        t.start()
if t is not None:
    t.join()
out = insp.rewind("c1")  # the script, every rank: the id is the same everywhere
while insp.step < 8:
    train()
    again[insp.step] = checksum()
cps = [(c["id"], c["step"], c["label"]) for c in insp.checkpoints.list()]
print("RESULT " + json.dumps({"rank": rank, "got": got, "first": first, "again": again, "out": out, "cps": cps}))
insp.close()
dist.destroy_process_group()
"""


def test_a_checkpoint_asked_for_on_rank_0_while_paused_is_taken_on_every_rank_and_rewinds_bitwise():
    r0, r1 = run_ranks(HELD)
    assert r0["got"] == {"taken": True, "id": "c1"}, r0["got"]
    assert r0["cps"] == r1["cps"] and r0["cps"][0][2] == "from the page", (r0["cps"], r1["cps"])
    step = r0["out"]["step"]
    assert r0["out"] == r1["out"] and r0["out"]["done"] and 2 <= step < 8, (r0["out"], r1["out"])
    for r in (r0, r1):
        assert r["again"] and r["again"] == {k: v for k, v in r["first"].items() if int(k) > step}, r
    assert r0["first"] == r1["first"] and r0["again"] == r1["again"], (r0, r1)


# "safe overnight" under the Lightning callback with DDP (two gloo ranks, launched as torchrun
# would: LOCAL_RANK set, Lightning creates no process). Each rank its own 30 batches in order
# (no distributed sampler); rank 1's batch 12 is all inf; a callback checkpoints every 5 steps.
LIGHTNING = r"""
import os
os.environ["LOCAL_RANK"] = os.environ["RANK"]
import hashlib, json, math, warnings, torch
from torch import nn
import lightning.pytorch as pl
from inspector.integrations.lightning import GradientInspectorCallback

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
rank = int(os.environ["RANK"])
state = {}


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self):
        x = torch.randn(120, 4, generator=torch.Generator().manual_seed(1000 + rank))
        if rank == 1:
            x[48:52] = math.inf  # batch 12
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)


class Every5(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        insp = state["insp"]
        if insp.step % 5 == 0:
            insp.checkpoint()


cb = GradientInspectorCallback(every=1, rules="safe overnight", on_attach=lambda insp: state.setdefault("insp", insp))
model = Net()
trainer = pl.Trainer(
    accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, use_distributed_sampler=False,
    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    num_sanity_val_steps=0, callbacks=[cb, Every5()],
)
trainer.fit(model)
insp = state["insp"]
h = hashlib.sha1()
for p in model.parameters():
    h.update(p.detach().contiguous().numpy().tobytes())
keep = ("kind", "step", "from_step", "checkpoint", "first", "last", "count", "result", "at", "action")
events = [
    {k: e[k] for k in keep if k in e}
    for e in insp.events()
    if e["kind"] in ("rule_fired", "rule_failed", "rewind", "rewind_error", "batches_skipped", "distributed_error")
]
print("RESULT " + json.dumps({
    "rank": rank, "step": insp.step, "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
    "checksum": h.hexdigest(), "events": events,
}), flush=True)
"""


def test_safe_overnight_under_the_lightning_callback_with_ddp_rewinds_every_rank_alike():
    pytest.importorskip("lightning.pytorch")
    r0, r1 = run_ranks(LIGHTNING)
    for r in (r0, r1):
        assert r["finite"], r
        kinds = [e["kind"] for e in r["events"]]
        assert kinds == ["rewind", "batches_skipped", "rule_fired"], r["events"]
        rewind, skipped, fired = r["events"]
        assert fired["action"] == "rewind_skip" and fired["result"]["rewound"] is True, fired
        assert skipped["first"] == rewind["step"] == 10 and skipped["first"] <= 12 <= skipped["last"], r
        assert r["step"] == 30 - skipped["count"], (r["step"], skipped)
    assert r0["checksum"] == r1["checksum"], (r0, r1)
    assert r0["events"] == r1["events"], (r0["events"], r1["events"])


# The same under the Hugging Face Trainer with DDP (two gloo ranks, launched as torchrun would): rank
# 1's 13th forward (its batch of index 12) returns an inf loss; a callback checkpoints every 5 steps.
HF = r"""
import os
os.environ["LOCAL_RANK"] = os.environ["RANK"]
import hashlib, json, math, warnings, torch
import transformers
from inspector.integrations.huggingface import GradientInspectorCallback

warnings.filterwarnings("ignore")
transformers.logging.set_verbosity_error()
torch.set_num_threads(1)
rank = int(os.environ["RANK"])
state = {}


class LM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(64, 16)
        self.head = torch.nn.Linear(16, 64)
        self.calls = 0

    def forward(self, input_ids, labels):
        logits = self.head(self.embed(input_ids))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        if rank == 1 and self.calls == 12:
            loss = loss * math.inf
        self.calls += 1
        return {"loss": loss, "logits": logits}


class Every5(transformers.TrainerCallback):
    def on_step_end(self, args, st, control, **kw):
        insp = state["insp"]
        if insp.step % 5 == 0:
            insp.checkpoint()


g = torch.Generator().manual_seed(1)
ids = torch.randint(0, 64, (256, 16), generator=g)
data = [{"input_ids": row, "labels": row} for row in ids]
out = os.environ["OUT_DIR"]
args = transformers.TrainingArguments(
    output_dir=out, max_steps=30, per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1,
    save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0,
    ddp_backend="gloo",
)
cb = GradientInspectorCallback(every=1, rules="safe overnight", on_attach=lambda insp: state.setdefault("insp", insp))
model = LM()
trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[cb, Every5()])
trainer.train()
insp = state["insp"]
h = hashlib.sha1()
for p in model.parameters():
    h.update(p.detach().contiguous().numpy().tobytes())
keep = ("kind", "step", "from_step", "checkpoint", "first", "last", "count", "result", "at", "action")
events = [
    {k: e[k] for k in keep if k in e}
    for e in insp.events()
    if e["kind"] in ("rule_fired", "rule_failed", "rewind", "rewind_error", "batches_skipped", "distributed_error")
]
print("RESULT " + json.dumps({
    "rank": rank, "step": insp.step, "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
    "checksum": h.hexdigest(), "events": events, "world": torch.distributed.get_world_size(),
}), flush=True)
insp.close()
torch.distributed.destroy_process_group()  # (the Trainer leaves it: gloo's threads would abort the exit)
"""


def test_safe_overnight_under_the_hugging_face_callback_with_ddp_rewinds_every_rank_alike(
    tmp_path, monkeypatch
):
    pytest.importorskip("transformers")
    monkeypatch.setenv("OUT_DIR", str(tmp_path))
    r0, r1 = run_ranks(HF)
    for r in (r0, r1):
        assert r["world"] == 2 and r["finite"], r
        kinds = [e["kind"] for e in r["events"]]
        assert kinds == ["rewind", "batches_skipped", "rule_fired"], r["events"]
        rewind, skipped, fired = r["events"]
        assert fired["action"] == "rewind_skip" and fired["result"]["rewound"] is True, fired
        assert skipped["first"] == rewind["step"] == 10 and skipped["first"] <= 12 <= skipped["last"], r
    assert r0["checksum"] == r1["checksum"], (r0, r1)
    assert r0["events"] == r1["events"], (r0["events"], r1["events"])


# The page's buttons under DDP, through rank 0's HTTP server: the script starts paused (rank 0's
# pause holds both ranks at the first boundary); the test asks for a checkpoint there, resumes,
# pauses again, asks for a rewind to it, resumes. Every rank takes it and rewinds, at the same
# boundaries; the replayed steps are bitwise the first pass's.
PAGE = r"""
import hashlib, json, sys, threading, torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
import inspector

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
insp = inspector.attach(model, opt, every=1)
insp.serve(port=int(sys.argv[1]), db=False)
if rank == 0:
    insp.pause()  # held at the first boundary, every rank with it
tick, seen = threading.Event(), []
while insp.step < 40 and len(seen) < 400:
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1000 * rank + insp.step))
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    h = hashlib.sha1()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    seen.append((insp.step, h.hexdigest()))
    tick.wait(0.1)  # a rate cap so the test can act mid-run, not a synchronisation
events = [
    {k: e.get(k) for k in ("kind", "step", "from_step", "checkpoint")}
    for e in insp.events()
    if e["kind"] in ("checkpoint", "rewind", "rewind_error", "checkpoint_error")
]
print("RESULT " + json.dumps({"rank": rank, "seen": seen, "events": events}), flush=True)
insp.close()
dist.destroy_process_group()
"""


def test_the_pages_checkpoint_and_rewind_reach_every_rank_through_rank_0s_server():
    import httpx

    from tests.distributed.test_ddp import poll
    from tests.distributed.test_fsdp import kill
    from tests.support import free_port

    master, port = free_port(), free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master), "WORLD_SIZE": "2"}
    root = Path(__file__).resolve().parents[2]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PAGE, str(port)],
            env={**env, "RANK": str(r)},
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:

            def up():
                try:
                    return c.get("/api/health").status_code == 200
                except httpx.TransportError:
                    assert all(p.poll() is None for p in procs), "a worker died"
                    return False

            poll(up, what="rank 0's server")
            held = lambda: c.get("/api/session").json()["training"]["held"]  # noqa: E731
            poll(held, what="the first pause")
            assert c.post("/api/checkpoints", json={"label": "page"}).status_code in (200, 201, 202)
            taken = lambda: [x for x in c.get("/api/checkpoints").json()["checkpoints"] if x["taken"]]  # noqa: E731
            (cp,) = poll(taken, what="the checkpoint taken while held")
            assert c.post("/api/training/resume").status_code == 202
            poll(lambda: c.get("/api/session").json()["training"]["step"] >= cp["step"] + 3, what="steps")
            assert c.post("/api/training/pause").status_code == 202
            poll(held, what="the second pause")
            r = c.post(f"/api/checkpoints/{cp['id']}/rewind", json={})
            assert r.status_code in (200, 202), r.text
            poll(lambda: c.get("/api/session").json()["training"]["step"] == cp["step"], what="the rewind")
            assert c.post("/api/training/resume").status_code == 202
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        kill(procs)
    r0, r1 = (json.loads(next(ln for ln in o.splitlines() if ln.startswith("RESULT "))[7:]) for o in outs)
    assert r0["events"] == r1["events"], (r0["events"], r1["events"])
    kinds = [(e["kind"], e["step"]) for e in r0["events"]]
    assert kinds[0] == ("checkpoint", cp["step"]) and kinds[1][0] == "rewind", kinds
    assert r0["seen"] == r1["seen"], "the ranks went apart"
    first: dict[int, str] = {}
    replayed = 0
    for step, digest in r0["seen"]:
        if step in first:
            assert first[step] == digest, f"step {step} replayed differently"
            replayed += 1
        first[step] = digest
    assert replayed >= 3, r0["seen"]
