"""FSDP2 (``fully_shard``) under torch.distributed: two gloo processes on 127.0.0.1, one config
for the job, statistics of the full gradients.

The tests drive rank 0's HTTP API while both ranks train (tests/distributed/fsdp_worker.py) and
then check every step of both ranks' logs.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.distributed.test_ddp import assert_script_hook_agrees, last_step, log, poll
from tests.support import free_port

WORKER = Path(__file__).with_name("fsdp_worker.py")
pytestmark = [pytest.mark.dist, pytest.mark.slow]


def spawn(tmp_path: Path, *extra: str) -> tuple[list[subprocess.Popen], int]:
    master, http_port = free_port(), free_port()
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master),
        "WORLD_SIZE": "2",
        "PYTHONUNBUFFERED": "1",
    }
    cmd = [sys.executable, str(WORKER), "--out", str(tmp_path), "--port", str(http_port), *extra]
    procs = [
        subprocess.Popen(
            cmd, env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for r in (0, 1)
    ]
    return procs, http_port


def finish(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out


def kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.communicate()


def run_ranks(script: str, *args: str) -> list[dict]:
    """Run `script` (python -c) on two gloo ranks to the end; each rank's `RESULT {json}` line,
    parsed (a rank that failed fails the test with its output)."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    root = Path(__file__).resolve().parents[2]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, *args],
            env={**env, "RANK": str(r)},
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        kill(procs)
    results = []
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out
        results.append(json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:]))
    return results


def wait_for_server(c: httpx.Client, procs: list[subprocess.Popen]) -> None:
    def health():
        try:
            return c.get("/api/health").status_code == 200
        except httpx.TransportError:
            assert all(p.poll() is None for p in procs), "a worker died"
            return False

    poll(health, what="rank 0's server")


def test_fsdp2_two_ranks_share_hooks_pause_and_report_full_gradients(tmp_path):
    procs, port = spawn(
        tmp_path, "--steps", "300", "--rate", "40", "--every", "1", "--nan-step", "12", "--interleave", "5"
    )
    c = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)
    try:
        wait_for_server(c, procs)
        session = lambda: c.get("/api/session").json()["training"]  # noqa: E731
        poll(lambda: session()["step"] >= 15, what="step 15")

        # a clip_norm global added through rank 0's API lands on both ranks at the same step
        r = c.post("/api/hooks", json={"kind": "clip_norm", "target": "*", "params": {"max_norm": 0.01}})
        assert r.status_code == 201, r.text
        applied = poll(lambda: c.get("/api/hooks").json()[-1]["applied_step"], what="applied_step")
        poll(
            lambda: min(last_step(tmp_path, 0), last_step(tmp_path, 1)) >= applied + 3,
            what="steps after the hook",
        )

        # pause holds both ranks at the same boundary; a single step advances both by one
        assert c.post("/api/training/pause").status_code == 202

        def held():
            s = session()
            # "held": the pause has taken hold (the state says "paused" as soon as it is asked for, while
            # the boundary under way may still let its step go: then a single step would run two)
            ok = (
                s["state"] == "paused"
                and s["held"]
                and last_step(tmp_path, 0) == last_step(tmp_path, 1) == s["step"] - 1
            )
            return s["step"] if ok else None

        held_at = poll(held, what="both ranks held")
        assert c.post("/api/training/step").status_code == 202
        poll(lambda: held() == held_at + 1, what="one more step on both ranks")
        assert last_step(tmp_path, 0) == last_step(tmp_path, 1) == held_at

        events = c.get("/api/events").json()["events"]
        assert c.post("/api/training/resume").status_code == 202
        finish(procs)
    finally:
        c.close()
        kill(procs)

    rows0, rows1 = log(tmp_path, 0), log(tmp_path, 1)
    assert len(rows0) == len(rows1) == 300
    for a, b in zip(rows0, rows1, strict=True):
        assert a["step"] == b["step"]
        assert a["version"] == b["version"], f"config differs at step {a['step']}"
        assert a["applied"] == b["applied"], f"hook ids differ at step {a['step']}"
    assert_script_hook_agrees(rows0, rows1, 5)
    for rows in (rows0, rows1):
        for row in rows:
            if row["step"] < applied:
                assert row["clip_err"] is None
            elif row["step"] != 12:
                assert row["clip_err"] is not None and row["clip_err"] < 1e-6, row
            if row["step"] != 12:  # the snapshot's raw total norm is the full gradient's, not the shard's
                assert row["snap_total_raw"] == pytest.approx(row["full_norm"], rel=1e-5), row
    assert any(abs(r["local_norm"] - r["full_norm"]) > 1e-3 * r["full_norm"] for r in rows0)

    # the NaN in rank 1's shard is reported naming rank 1, and both ranks skip that step
    nonfinite = [e for e in events if e["kind"] == "nonfinite"]
    assert nonfinite and nonfinite[0]["rank"] == 1 and nonfinite[0]["step"] == 12, nonfinite
    assert nonfinite[0]["param"] == "0.weight" and nonfinite[0]["action_taken"] == "skip"
    assert any(e["kind"] == "step_skipped" and e["step"] == 12 for e in events)
    for rows in (rows0, rows1):
        assert [r["step"] for r in rows if not r["moved"]] == [12]

    # close() leaves no hook of ours on any rank
    for rank in (0, 1):
        counts = json.loads((tmp_path / f"close{rank}.json").read_text())
        assert counts["after"] == counts["before"], counts


def test_fsdp2_defaults_mixed_parameters_and_histograms(tmp_path):
    """The budgeted cadence; a parameter FSDP does not shard beside sharded ones; a histogram that
    only rank 0 asks for (as the page does) is taken on both ranks, of the full gradient."""
    procs, port = spawn(tmp_path, "--steps", "80", "--rate", "200", "--mixed", "--hist", "0.weight")
    c = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)
    try:
        wait_for_server(c, procs)
        poll(lambda: min(last_step(tmp_path, 0), last_step(tmp_path, 1)) >= 40, what="step 40")
        snaps = c.get("/api/snapshots", params={"limit": 50}).json()["snapshots"]
        finish(procs)
    finally:
        c.close()
        kill(procs)
    rows0, rows1 = log(tmp_path, 0), log(tmp_path, 1)
    assert len(rows0) == len(rows1) == 80
    sampled = [r for r in rows0 if r["snap_total_raw"] is not None]
    assert sampled
    for row in sampled:
        assert row["snap_total_raw"] == pytest.approx(row["full_norm"], rel=1e-5), row
    with_hist = [s for s in snaps if s["hist"]]
    assert with_hist, "no histogram"
    for s in with_hist:
        h = s["hist"]["0.weight"]
        assert sum(h["raw"]) == 16 * 32  # every element of the full gradient, from both shards
    assert all(math.isfinite(v) for s in snaps for v in s["grad_norm_raw"])
    # the per-rank spread: shard norms for the sharded parameters, the local (pre-reduce) norm for the
    # plain one, each in its own column
    spread = snaps[-1]["ranks"]
    assert all(v is not None for v in spread["norm_min"] + spread["norm_max"]), spread
    assert spread["norm_min"][3] < spread["norm_max"][3]  # 2.bias: each rank's own data
    assert all(r["snap_hist"] == ["0.weight"] for r in rows1 if r["snap_hist"])
    assert any(r["snap_hist"] for r in rows1)  # rank 1 took it too: rank 0 chose it for both


REFUSED = """
import sys, torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
import inspector
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:" + sys.argv[1])
hsdp = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
fully_shard(hsdp, mesh=init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard")))
tp = nn.Linear(4, 4)
tp.weight = nn.Parameter(distribute_tensor(tp.weight.detach(), init_device_mesh("cpu", (1,)), [Shard(1)]))
for model in (hsdp, tp):
    try:
        inspector.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
        print("ATTACHED")
    except inspector.AttachError as e:
        print("REFUSED", e)
dist.destroy_process_group()
"""


def test_hsdp_and_tensor_parallel_are_refused_at_attach():
    """A 2-D mesh (HSDP) and a DTensor that FSDP2 does not manage (tensor parallel) are refused by
    attach() with a message, before training can reach step()."""
    out = subprocess.run(
        [sys.executable, "-c", REFUSED, str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(("REFUSED", "ATTACHED"))]
    assert len(lines) == 2, out.stdout + out.stderr
    assert lines[0].startswith("REFUSED") and "2-D device mesh" in lines[0], lines
    assert lines[1].startswith("REFUSED") and "does not manage" in lines[1], lines


EVERY_KIND = """
import json, sys, torch, torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
import inspector
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
fully_shard(model[0]); fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
insp = inspector.attach(model, opt, every=1)
seen = []
insp.add_hook(lambda name, p: (seen.append(type(p.grad).__name__), p.grad.mul_(1.0)), target="2.bias")
insp.add_hook("clip_value", target="0.*", threshold=10.0)
insp.add_hook("scale", target="2.*", factor=0.5)
insp.add_hook("l2", target="*", lam=1e-4)
insp.add_hook("noise", target="0.weight", std=1e-3, seed=7)
insp.add_hook("clip_norm", target="*", max_norm=0.05, mode="per_tensor")
insp.add_hook("nan_guard", target="*", action="zero")
insp.add_hook("scale", target="0.bias", point="post_accumulate", factor=1.0)
insp.add_hook("module_log", target="2", point="module", grad_input=True)
insp.add_hook("freeze", target="2.weight")
insp.set_hist_params(["0.weight"])
data = torch.Generator().manual_seed(rank)
from torch.utils._python_dispatch import TorchDispatchMode
class HostData(TorchDispatchMode):  # tensors made from host data (torch.tensor(list)) by our statistics
    def __init__(self):
        super().__init__(); self.made = []
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.lift_fresh.default:
            f = sys._getframe(1)
            while f is not None:
                name = f.f_globals.get("__name__", "")
                if name.startswith("inspector."):
                    # (the control plane's rows are CPU tensors for its own gloo group, by design)
                    if name != "inspector.distributed":
                        self.made.append(f"{name}:{f.f_lineno}")
                    break
                f = f.f_back
        return func(*args, **(kwargs or {}))
host_data = HostData()
for i in range(6):
    opt.zero_grad()
    model(torch.randn(4, 6, generator=data)).square().mean().backward()
    if i >= 2:  # sampled steps after the first: on a GPU such a tensor is a copy that synchronises
        with host_data:
            opt.step()
    else:
        opt.step()
final = [p.grad.full_tensor().norm().item() if p.grad is not None else None for p in model.parameters()]
full = [p.grad.full_tensor().double() for p in model.parameters() if p.grad is not None]
moments = [[g.mean().item() for g in full], [g.std().item() for g in full]]
snap = insp.latest()
errors = [e for e in insp.events() if e["kind"] in ("hook_error", "telemetry_error", "distributed_error")]
print("RESULT " + json.dumps({"rank": rank, "final": final, "grad_norm": snap["grad_norm"], "seen": seen[:1],
      "hist": [sum(s["hist"]["0.weight"]["raw"]) for s in insp.snapshots() if s["hist"]], "modules": snap["modules"],
      "moments": moments, "snap_moments": [[v for v in snap[k] if v is not None] for k in ("grad_mean", "grad_std")],
      "errors": errors, "host_data": host_data.made}), flush=True)
insp.close()
del insp, model, opt  # an FSDP2 model freed after destroy_process_group() can abort the process (gloo)
import gc; gc.collect()
dist.destroy_process_group()
"""


def test_fsdp2_every_kind_acts_on_shards_and_reports_full_tensors(tmp_path):
    """Every hook kind on an FSDP2 model, on both ranks, without an error: per_tensor clip_norm by
    each full tensor's norm (the final full norms are at most max_norm), freeze drops the gradient,
    a python hook sees the DTensor, a histogram counts the full gradient, module_log reports."""
    results = run_ranks(EVERY_KIND)
    for res in results:
        assert res["errors"] == [], res["errors"]
        assert res["host_data"] == [], res["host_data"]  # masks, indices, counts: device constants
        assert res["seen"] == ["DTensor"]
        assert res["final"][2] is None  # frozen
        assert all(n <= 0.05 * (1 + 1e-5) for n in res["final"] if n is not None), res["final"]
        assert res["grad_norm"][:2] == pytest.approx(res["final"][:2], rel=1e-5)  # the full tensors' norms
        assert res["grad_norm"][2] is None
        # the full tensors' mean and std (sums and squares combined across the ranks, then made on the host)
        for got, want in zip(res["snap_moments"], res["moments"], strict=True):
            assert len(got) == len(want) == 3, res
            assert got == pytest.approx(want, rel=1e-4, abs=1e-7), res
        assert res["hist"] and all(n == 8 * 6 for n in res["hist"]), res[
            "hist"
        ]  # the full gradient's elements
        assert set(res["modules"]["2"]) == {"grad_output_norm", "grad_input_norm"}
    assert results[0]["grad_norm"] == results[1]["grad_norm"]
