"""Checkpoints and rewind in a user-style loop, and ``inspector.compare``."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

import inspector
from inspector.scenarios import make
from tests.support import wait_until


def same_tensors(a, b) -> bool:
    """Bitwise equality of two nested state structures (tensors compared with torch.equal)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same_tensors(x, y) for x, y in zip(a, b, strict=True))
    return a == b


class Loop:
    """The mlp scenario's model and data in the user's own loop, with Adam (state to restore)."""

    def __init__(self, **attach) -> None:
        self.sc = make("mlp", seed=0)
        self.model = self.sc.model
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.insp = inspector.attach(self.model, self.opt, **{"every": 1, **attach})
        gen = torch.Generator().manual_seed(1)
        self.batches = [self.sc.next_batch(gen) for _ in range(60)]
        self.losses: dict[int, float] = {}

    def step(self, i: int) -> None:
        x, y = self.batches[i]
        self.opt.zero_grad()
        loss = nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.insp.record(loss=loss)
        self.losses[self.insp.step] = float(loss.detach())

    def run(self, batches: range) -> None:
        for i in batches:
            self.step(i)

    def config(self):
        return [(h["id"], h["kind"], h["target"], h["params"], h["enabled"]) for h in self.insp.hooks()]


def test_rewind_restores_state_step_and_hooks_bitwise():
    loop = Loop()
    insp = loop.insp
    loop.run(range(10))
    h1 = insp.add_hook("clip_norm", target="*", max_norm=0.5)
    insp.add_hook("noise", target="0.*", std=0.01, seed=3)
    loop.run(range(10, 15))
    cp = insp.checkpoint("before the change")  # the training thread, between steps: taken now
    info = insp.checkpoints.list()[0]
    assert info["id"] == cp and info["step"] == 15 and info["taken"] and info["bytes"] > 0
    ref_model = copy.deepcopy(loop.model.state_dict())
    ref_opt = copy.deepcopy(loop.opt.state_dict())
    ref_config = loop.config()
    h1.update(max_norm=5.0)
    insp.add_hook("scale", target="*", factor=0.5)
    loop.run(range(15, 25))
    after_first = copy.deepcopy(loop.model.state_dict())
    assert insp.step == 25 and not same_tensors(after_first, ref_model)

    out = insp.rewind(cp)
    assert out == {"checkpoint": cp, "step": 15, "done": True}
    assert insp.step == 15
    assert same_tensors(loop.model.state_dict(), ref_model)
    assert same_tensors(loop.opt.state_dict(), ref_opt)
    assert loop.config() == ref_config  # ids, params and order of the checkpoint
    assert all(p.grad is None for p in loop.model.parameters())
    assert [s["step"] for s in insp.snapshots()][-1] == 15  # the abandoned steps left the ring
    events = insp.events()
    rewind = [e for e in events if e["kind"] == "rewind"][-1]
    assert rewind["step"] == 15 and rewind["from_step"] == 25 and rewind["checkpoint"] == cp
    assert [e for e in events if e["kind"] == "hook_applied"][-1]["action"] == "rewind"

    # The same batches again from the checkpoint: the noise stream and Adam's moments were
    # restored too, so the branch retraces the first one's steps bit for bit... with the old config.
    loop.run(range(15, 25))
    assert insp.step == 25
    replay = copy.deepcopy(loop.model.state_dict())
    insp.rewind(cp)
    h1b = insp.hook(h1.id)
    h1b.update(max_norm=5.0)
    insp.add_hook("scale", target="*", factor=0.5)
    loop.run(range(15, 25))
    assert same_tensors(loop.model.state_dict(), after_first), "same state, hooks and batches: same result"
    assert not same_tensors(replay, after_first)
    new_id = insp.hooks()[-1]["id"]
    assert new_id not in {c[0] for c in ref_config} and new_id != "h3", "ids of the old branch are not reused"
    insp.close()


def test_a_rewind_from_another_thread_waits_for_the_next_boundary():
    loop = Loop()
    insp = loop.insp
    loop.run(range(5))
    cp = insp.checkpoint()
    ref = copy.deepcopy(loop.model.state_dict())
    loop.run(range(5, 12))
    result = {}
    t = threading.Thread(target=lambda: result.update(insp.rewind(cp)))
    t.start()
    t.join(10)
    assert result == {"checkpoint": cp, "step": 5, "done": False}
    assert (
        insp.step == 12 and insp.checkpoints.queued
    )  # nothing happens between steps off the training thread
    loop.step(12)  # step 13 runs whole; at its boundary the training thread rewinds
    assert insp.step == 5 and not insp.checkpoints.queued
    assert same_tensors(loop.model.state_dict(), ref)
    loop.step(13)
    assert insp.step == 6 and insp.latest()["step"] == 6
    insp.close()


def test_a_checkpoint_requested_while_running_is_taken_at_the_boundary_and_while_paused_at_once():
    loop = Loop()
    insp = loop.insp
    loop.run(range(3))
    got = []
    t = threading.Thread(target=lambda: got.append(insp.checkpoint("from the server")))
    t.start()
    t.join(10)
    assert insp.checkpoints.list()[0]["taken"] is False
    loop.step(3)
    assert insp.checkpoints.list()[0]["step"] == 4

    # held at a boundary: the held training thread takes it at once, and waiters are told
    insp.pause()
    trainer = threading.Thread(target=lambda: loop.run(range(4, 8)))
    trainer.start()
    wait_until(lambda: insp.state["held"], what="the pause to take hold")
    cp = insp.checkpoint("paused")
    assert insp.checkpoints.wait(cp, timeout=10)
    assert insp.checkpoints.get(cp).step == 5
    insp.rewind(got[0])
    wait_until(lambda: insp.step == 4, what="the held thread to rewind")
    insp.resume()
    trainer.join(20)
    assert insp.step == 7
    insp.close()


def test_only_the_newest_k_are_kept_and_memory_is_counted():
    loop = Loop(checkpoints=2)
    insp = loop.insp
    ids = []
    for i in range(4):
        loop.step(i)
        ids.append(insp.checkpoint())
    kept = insp.checkpoints.summary()
    assert [c["id"] for c in kept["checkpoints"]] == ids[-2:] and kept["keep"] == 2
    one = sum(p.numel() * 4 for p in loop.model.parameters())
    assert kept["bytes"] == sum(c["bytes"] for c in kept["checkpoints"]) and kept["bytes"] >= 2 * 3 * one
    with pytest.raises(inspector.CheckpointNotFound, match="only the newest 2"):
        insp.rewind(ids[0])
    insp.close()


def test_refusals_name_the_reason():
    loop = Loop(checkpoints=0)
    with pytest.raises(inspector.CheckpointError, match="checkpoints=0"):
        loop.insp.checkpoint()
    loop.insp.close()
    w = torch.zeros(3, requires_grad=True)
    insp = inspector.attach({"w": w})
    with pytest.raises(inspector.CheckpointError, match="without a torch optimizer"):
        insp.checkpoint()
    insp.close()

    class NoStateOptimizer(torch.optim.SGD):
        state_dict = None  # type: ignore[assignment]

    m = nn.Linear(2, 1)
    insp = inspector.attach(m, NoStateOptimizer(m.parameters(), lr=0.1))
    with pytest.raises(inspector.CheckpointError, match="no state_dict"):
        insp.checkpoint()
    insp.close()
    with pytest.raises(inspector.HookError, match="checkpoints"):
        inspector.attach(nn.Linear(2, 1), checkpoints=-1)


def test_a_dict_of_tensors_and_a_grad_scaler_are_restored():
    w = torch.ones(4, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    insp = inspector.attach({"w": w}, opt, scaler=scaler)

    def step():
        insp.begin_step()
        opt.zero_grad()
        scaler.scale((w * w).sum()).backward()
        scaler.step(opt)
        scaler.update()

    for _ in range(3):
        step()
    cp = insp.checkpoint()
    ref_w, ref_opt, ref_scale = w.detach().clone(), copy.deepcopy(opt.state_dict()), scaler.get_scale()
    for _ in range(3):
        step()
    scaler.update(new_scale=5.0)
    insp.rewind(cp)
    assert torch.equal(w.detach(), ref_w) and same_tensors(opt.state_dict(), ref_opt)
    assert scaler.get_scale() == ref_scale and insp.step == 3
    insp.close()


def test_compare_runs_two_branches_from_the_same_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    start = copy.deepcopy(model.state_dict())
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen)) for _ in range(12)]

    def step(batch):
        x, y = batch
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    clip = [{"kind": "clip_norm", "target": "*", "params": {"max_norm": 0.01}}]
    cmp = inspector.compare(model, opt, step, iter(batches), hooks_a=None, hooks_b=clip)
    same = inspector.compare(model, opt, step, batches, hooks_a=[], hooks_b=[])
    assert same_tensors(model.state_dict(), start), "the model is put back as it was"
    assert len(cmp.a.losses) == 12 and all(isinstance(v, float) for v in cmp.a.losses + cmp.b.losses)
    assert same.a.losses == same.b.losses == cmp.a.losses, "same state, batches and RNG: same losses"
    assert cmp.a.losses[0] == cmp.b.losses[0] and cmp.a.losses[-1] != cmp.b.losses[-1]
    assert [s["step"] for s in cmp.b.snapshots] == list(range(1, 13))
    assert max(s["total_norm"] for s in cmp.b.snapshots) <= 0.01 * (1 + 1e-5)
    assert cmp.b.hooks[0]["kind"] == "clip_norm" and cmp.a.hooks == []
    with pytest.raises(inspector.HookError, match="hooks_b"):
        inspector.compare(model, opt, step, batches, hooks_b="clip")


def test_a_comparison_is_saved_and_served_as_a_run_and_its_branch(tmp_path):
    import httpx

    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.ones(4, 3) * i, torch.zeros(4, 1)) for i in range(5)]

    def step(batch):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(batch[0]), batch[1])
        loss.backward()
        opt.step()
        return loss

    cmp = inspector.compare(
        model, opt, step, batches, hooks_b=[{"kind": "scale", "target": "*", "params": {"factor": 0.5}}]
    )
    url = cmp.serve(db=tmp_path / "cmp.sqlite")
    try:
        c = httpx.Client(base_url=url.rstrip("/"), trust_env=False, timeout=10)
        (run,) = c.get("/api/runs").json()["runs"]
        (b,) = run["branches"]
        assert b["branch"] == "shadow" and b["branch_step"] == 0 and b["label"] == "B: scale on '*'"
        losses = [r["loss"] for r in c.get("/api/scalars", params={"run": b["id"]}).json()["scalars"]]
        assert losses == cmp.b.losses
        assert c.post("/api/hooks", json={"kind": "freeze"}).status_code == 403
        c.close()
    finally:
        cmp.close()
