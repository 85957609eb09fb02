"""Attach/close, error isolation, threads, telemetry details and packaging of the core."""

from __future__ import annotations

import gc
import json
import pkgutil
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

import inspector
from tests.support import wait_until
from tests.unit.conftest import batch, loss_of, seed_mlp, train_step

ROOT = Path(__file__).resolve().parents[2]


def our_hook_count(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    n = len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks)
    for m in model.modules():
        n += len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._backward_hooks)
    for p in model.parameters():
        n += len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
    return n


def test_import_does_not_import_web_code():
    code = "import sys, inspector; bad = [m for m in ('fastapi', 'uvicorn', 'starlette', 'server') if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_all_matches_exports():
    for name in inspector.__all__:
        assert hasattr(inspector, name), name
    public = {n for n in dir(inspector) if not n.startswith("_")}
    modules = {m.name for m in pkgutil.iter_modules(inspector.__path__)}  # submodules are not exports
    assert public - modules - set(inspector.__all__) == set()


def test_close_removes_every_hook_and_frees_the_inspector(mlp):
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    baseline = our_hook_count(mlp, opt)
    insp = inspector.attach(mlp, opt, every=1)
    insp.add_hook("clip_value", target="*", point="post_accumulate", threshold=1.0)
    insp.add_hook("module_log", target="0")
    insp.add_hook(lambda name, p: None, target="*")
    insp.subscribe(lambda kind, payload: None)
    train_step(mlp, opt, *batch())
    assert our_hook_count(mlp, opt) > baseline
    insp.close()
    insp.close()  # twice is harmless
    assert our_hook_count(mlp, opt) == baseline
    ref = weakref.ref(insp)
    del insp
    gc.collect()
    assert ref() is None, gc.get_referrers(ref())
    train_step(mlp, opt, *batch())  # the model trains on without us


def test_with_block_closes(mlp):
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    baseline = our_hook_count(mlp, opt)
    with inspector.attach(mlp, opt) as insp:
        insp.add_hook("scale", target="*", point="post_accumulate", factor=1.0)
        train_step(mlp, opt, *batch())
    assert our_hook_count(mlp, opt) == baseline
    with pytest.raises(inspector.InspectorError):
        insp.add_hook("scale", target="*", factor=1.0)


def test_removing_a_hook_restores_untouched_gradients(mlp):
    opt = torch.optim.SGD(mlp.parameters(), lr=0.0)
    with inspector.attach(mlp, opt, every=1) as insp:
        h = insp.add_hook("clip_value", target="*", point="post_accumulate", threshold=1e-4)
        train_step(mlp, opt, *batch())
        assert insp.latest()["grad_absmax"][0] <= 1e-4 + 1e-9
        h.remove()
        h.remove()
        train_step(mlp, opt, *batch())
        s = insp.latest()
        assert s["grad_norm"] == s["grad_norm_raw"] and s["grad_absmax"][0] > 1e-4
        assert all(
            not p._post_accumulate_grad_hooks
            for p in mlp.parameters()
            if getattr(p, "_post_accumulate_grad_hooks", None) is not None
        )


def test_raising_hook_is_disabled_and_training_goes_on(mlp):
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)

    def boom(name, param):
        raise RuntimeError("user bug")

    with inspector.attach(mlp, opt, every=1) as insp:
        h1 = insp.add_hook(boom, target="0.weight")
        h2 = insp.add_hook(boom, target="0.bias", point="post_accumulate")
        for s in range(3):
            train_step(mlp, opt, *batch(seed=s))
        assert insp.step == 3
        errors = [e for e in insp.events() if e["kind"] == "hook_error"]
        assert {e["hook_id"] for e in errors} == {h1.id, h2.id}
        assert all("user bug" in e["message"] for e in errors)
        assert [h["enabled"] for h in insp.hooks()] == [False, False]
        assert not mlp[0].bias._post_accumulate_grad_hooks  # torch hook dropped at the next safe point


def test_module_log_with_inplace_relu():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(inplace=True), nn.Linear(10, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = batch()
    ref = seed_mlp()
    ref.load_state_dict(model.state_dict())
    h = ref[0](x)
    h.retain_grad()
    loss_of(nn.Sequential(nn.Identity(), ref[1], ref[2]), h, y).backward()
    with inspector.attach(model, opt, every=1) as insp:
        insp.add_hook("module_log", target="0", grad_input=True)
        train_step(model, opt, x, y)
        mods = insp.latest()["modules"]
    assert mods["0"]["grad_output_norm"] == pytest.approx(float(h.grad.norm()), rel=1e-5)
    assert "grad_input_norm" not in mods["0"] or mods["0"]["grad_input_norm"] >= 0  # x needs no grad


def test_dict_of_tensors_with_mark_step():
    t = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    with inspector.attach({"t": t}, every=1) as insp:
        insp.add_hook("scale", target="t", factor=2.0)
        (t**2).sum().backward()
        insp.mark_step()
        snap = insp.latest()
    assert snap["step"] == 1 and snap["grad_norm_raw"][0] == pytest.approx(
        float(torch.tensor([2.0, 4, 6]).norm())
    )
    assert torch.equal(t.grad, torch.tensor([4.0, 8.0, 12.0]))
    with pytest.raises(inspector.AttachError):
        inspector.attach({"x": torch.ones(2, requires_grad=True) * 2})


def test_attach_refuses_what_it_cannot_inspect(mlp):
    with pytest.raises(inspector.AttachError, match="one optimizer"):
        inspector.attach(mlp, [torch.optim.SGD(mlp.parameters(), lr=0.1)] * 2)
    with pytest.raises(inspector.AttachError):
        inspector.attach(object())
    with pytest.raises(inspector.HookError):
        inspector.attach(mlp, budget=2.0)


def test_wrapper_prefixes_are_stripped(mlp):
    class DataParallelLike(nn.Module):  # the name is what wrapper detection keys on
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, x):
            return self.module(x)

    DataParallelLike.__name__ = "DataParallel"
    wrapped = DataParallelLike(mlp)
    with inspector.attach(wrapped) as insp:
        assert insp.params == ["0.weight", "0.bias", "2.weight", "2.bias"]
        assert insp.modules[0] == "" and "0" in insp.modules


def test_snapshot_is_strict_json_with_nonfinite_as_strings(mlp):
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    x, y = batch()
    x[0, 0] = float("nan")
    with inspector.attach(mlp, opt, every=1) as insp:
        insp.add_hook("nan_guard", target="*", action="zero")
        train_step(mlp, opt, x, y)
        snap = insp.latest()
    events = insp.events()  # a finding is reported by the next boundary, or at close()
    text = json.dumps(snap, allow_nan=False)
    assert '"nan"' in text
    nf = [e for e in events if e["kind"] == "nonfinite"]
    assert nf and nf[0]["param"] == "0.weight" and nf[0]["action_taken"] == "zero" and nf[0]["nan"] > 0
    assert snap["nan_count"][0] > 0 and snap["grad_norm"][0] == 0.0
    assert all(torch.isfinite(p).all() for p in mlp.parameters())


def test_nan_guard_skip_leaves_parameters_unchanged(mlp):
    opt = torch.optim.SGD(mlp.parameters(), lr=0.1)
    x, y = batch()
    x[0, 0] = float("inf")
    before = [p.detach().clone() for p in mlp.parameters()]
    with inspector.attach(mlp, opt, every=1) as insp:
        insp.add_hook("nan_guard", target="*", action="skip")
        train_step(mlp, opt, x, y)
    kinds = [e["kind"] for e in insp.events()]  # the finding: reported at close() at the latest
    assert all(torch.equal(a, b) for a, b in zip(before, mlp.parameters(), strict=True))
    assert "step_skipped" in kinds and "nonfinite" in kinds


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_gradients(dtype):
    torch.manual_seed(0)
    model = nn.Linear(64, 64).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with inspector.attach(model, opt, every=1) as insp:
        insp.add_hook("clip_norm", target="*", max_norm=0.01)
        insp.set_hist_params(["weight"])
        x = torch.randn(8, 64).to(dtype)
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        ref = model.weight.grad.float().norm()
        opt.step()
        snap = insp.latest()
    assert snap["grad_norm_raw"][0] == pytest.approx(float(ref), rel=1e-3)
    assert snap["total_norm"] <= 0.01 * 1.01
    assert sum(snap["hist"]["weight"]["raw"]) == 64 * 64


def test_sparse_gradients_are_reported_and_left_alone():
    torch.manual_seed(0)
    emb = nn.Embedding(20, 4, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    with inspector.attach(emb, opt, every=1) as insp:
        insp.add_hook("clip_value", target="*", threshold=1e-6)
        opt.zero_grad()
        emb(torch.tensor([1, 2, 2])).sum().backward()
        opt.step()
        snap = insp.latest()
    assert snap["grad_norm_raw"][0] == pytest.approx(float(torch.tensor([1.0] * 4 + [2.0] * 4).norm()))
    assert snap["grad_mean"][0] is None


def test_histograms_every_k_sampled_steps(mlp):
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    with inspector.attach(mlp, opt, every=1, hist_every=3) as insp:
        insp.set_hist_params(["0.weight"])
        insp.add_hook("clip_value", target="0.weight", threshold=0.01)
        for s in range(7):
            train_step(mlp, opt, *batch(seed=s))
        snaps = insp.snapshots()
    with_hist = [s["step"] for s in snaps if s["hist"]]
    assert with_hist == [1, 4, 7]
    h = snaps[0]["hist"]["0.weight"]
    assert len(h["edges"]) == 65 and sum(h["raw"]) == 100 and sum(h["final"]) == 100
    assert h["final"] != h["raw"]


def test_every_n_and_budgeted_cadence(mlp):
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    with inspector.attach(mlp, opt, every=3) as insp:
        for s in range(7):
            train_step(mlp, opt, *batch(seed=s))
        assert [s["step"] for s in insp.snapshots()] == [1, 4, 7]
        assert insp.latest()["sampled_every"] == 3
        assert insp.cost["sampled_steps"] == 3  # steps 1, 4 and 7 (step 8 not yet chosen)
    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with inspector.attach(model, opt, budget=0.01) as insp:  # a tiny model: the stats cost more than 1%
        for s in range(150):
            train_step(model, opt, *batch(seed=s))
        snaps = insp.snapshots()
        k = insp.cost["sampled_every"]
    assert 2 < len(snaps) < 75 and k > 1
    assert snaps[-1]["sampled_every"] > 1 and snaps[-1]["overhead"] is not None


def test_pause_and_step_once_hold_the_training_thread(mlp):
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    insp = inspector.attach(mlp, opt, every=1)
    stop = threading.Event()

    def train():
        while not stop.is_set():
            train_step(mlp, opt, *batch())

    def held_at(step):
        return wait_until(lambda: insp.state["held"] and insp.step == step, what=f"held at step {step}")

    insp.pause()  # holds at the first boundary
    t = threading.Thread(target=train, daemon=True)
    t.start()
    assert held_at(1)
    assert insp.state == {"state": "paused", "step": 1, "held": True}
    insp.add_hook("scale", target="*", point="post_accumulate", factor=1.0)  # applied by the waiting thread
    wait_until(lambda: insp.config_version == 1, what="the change applied by the held thread")
    assert insp.hooks()[0]["applied_step"] == 2
    insp.step_once()
    assert held_at(2)
    assert insp.step == 2
    stop.set()
    insp.close()  # releases the paused thread
    t.join(timeout=10)
    assert not t.is_alive()


def test_subscriber_errors_are_counted_not_raised(mlp):
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    good = []
    with inspector.attach(mlp, opt, every=1) as insp:

        def bad(kind, payload):
            raise ValueError("consumer bug")

        insp.subscribe(bad)
        insp.subscribe(lambda kind, payload: good.append(kind))
        with pytest.warns(RuntimeWarning, match="consumer bug"):
            for s in range(3):
                train_step(mlp, opt, *batch(seed=s))
            assert insp.flush()
        assert insp._feed.callback_errors >= 3
    assert good.count("snapshot") == 3


def test_records_reach_their_step_when_the_root_forward_is_never_called(mlp):
    """A loop that calls a submodule (Lightning's training_step often does): late records still land."""
    wrapper = nn.Module()
    wrapper.net = mlp
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    with inspector.attach(wrapper, opt, every=1) as insp:
        for s in range(3):
            opt.zero_grad()
            loss = loss_of(wrapper.net, *batch(seed=s))
            loss.backward()
            opt.step()
            insp.record(loss=float(s))
        insp.finish()
        assert insp.state["state"] == "finished"
        assert [s["loss"] for s in insp.snapshots()] == [0.0, 1.0, 2.0]


def test_framework_optimizer_wrappers_are_unwrapped(mlp):
    class Wrapper:  # the shape of HF Accelerate's AcceleratedOptimizer
        def __init__(self, optimizer):
            self.optimizer = optimizer

        def step(self):
            self.optimizer.step()

    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    with inspector.attach(mlp, Wrapper(opt), every=1) as insp:
        w = Wrapper(opt)
        opt.zero_grad()
        loss_of(mlp, *batch()).backward()
        w.step()
        assert insp.step == 1


def test_add_hook_takes_params_as_a_mapping_even_named_like_its_own_arguments(mlp):
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    with inspector.attach(mlp, opt) as insp:
        h = insp.add_hook("clip_value", "*", params={"threshold": 0.5})
        assert h.spec["params"] == {"threshold": 0.5}
        # a key that is one of add_hook's own keywords is still a parameter, so the kind refuses it
        with pytest.raises(inspector.HookError) as e:
            insp.add_hook("clip_value", "*", params={"threshold": 0.5, "enabled": False})
        assert e.value.loc == ("params", "enabled")
        with pytest.raises(inspector.HookError) as e:
            insp.add_hook("clip_value", "*", params={"threshold": 0.5}, threshold=1.0)
        assert e.value.loc == ("params", "threshold")
        assert len(insp.hooks()) == 1


def test_each_snapshot_is_converted_once_and_shared(mlp):
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    got = []
    with inspector.attach(mlp, opt, every=1) as insp:
        insp.subscribe(lambda kind, payload: got.append(payload) if kind == "snapshot" else None)
        x, y = batch()
        train_step(mlp, opt, x, y)
        assert insp.flush()
        assert got and got[0] is insp.latest() is insp.snapshots()[0]


def test_a_telemetry_failure_is_its_own_event_and_training_goes_on(mlp, monkeypatch):
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    with inspector.attach(mlp, opt, every=1) as insp:

        def broken(**kw):
            raise RuntimeError("stats bug")

        monkeypatch.setattr(insp._stats, "snapshot", broken)
        x, y = batch()
        train_step(mlp, opt, x, y)
        train_step(mlp, opt, x, y)
        errors = [e for e in insp.events() if e["kind"] == "telemetry_error"]
        assert [e["step"] for e in errors] == [1, 2] and "stats bug" in errors[0]["message"]
        assert not [e for e in insp.events() if e["kind"] == "hook_error"]
        assert insp.step == 2


@pytest.mark.parametrize("part", ["raw", "final", "probe"])
def test_a_statistics_failure_inside_step_is_reported_once_and_the_hooks_still_apply(mlp, monkeypatch, part):
    """Our raw/final statistics and the unsampled probe run inside the user's optimizer.step():
    one that raises must not take the step down, nor keep a clip from applying."""
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    clip = part != "probe"  # (the probe alone is the unsampled step without a pre_step hook)
    with inspector.attach(mlp, opt, every=1 if clip else 1000) as insp:
        if clip:
            insp.add_hook("clip_value", point="pre_step", threshold=1e-4)

        def broken(*a, **kw):
            raise RuntimeError(f"{part} bug")

        monkeypatch.setattr(insp._stats, part, broken)
        x, y = batch()
        for _ in range(3):
            train_step(mlp, opt, x, y)
            assert not clip or all(p.grad.abs().max() <= 1e-4 + 1e-9 for p in mlp.parameters())
        assert insp.step == 3
    errors = [e for e in insp.events() if e["kind"] == "telemetry_error"]
    assert len(errors) == 1 and f"{part} bug" in errors[0]["message"], errors
    assert not [e for e in insp.events() if e["kind"] == "hook_error"]


def test_close_says_when_the_last_late_records_are_lost(mlp, monkeypatch):
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    insp = inspector.attach(mlp, opt)

    def broken() -> None:
        raise RuntimeError("transfer failed")

    monkeypatch.setattr(insp._lifecycle, "flush_late", broken)
    with pytest.warns(RuntimeWarning, match="late records could not be sent"):
        insp.close()
    assert our_hook_count(mlp, opt) == 0


def test_a_lossless_subscriber_gets_every_record_while_an_ordinary_one_lags():
    from inspector.feed import Feed

    feed = Feed(max_queue=4)
    gate = threading.Event()
    lossy: list[int] = []
    lossless: list[int] = []

    def slow(kind, payload):
        gate.wait(10)  # the first call blocks the dispatcher: everything after it queues up
        lossy.append(payload["step"])

    feed.subscribe(slow)
    feed.subscribe(lambda kind, payload: lossless.append(payload["step"]), lossless=True)
    for step in range(1, 51):
        feed.publish("scalars", {"step": step})
    gate.set()
    assert feed.flush()
    assert lossless == list(range(1, 51))  # the history's view: nothing lost
    assert feed.dropped > 0 and len(lossy) < 50 and lossy == sorted(lossy)  # bounded for the slow one
    feed.close()


def test_close_on_another_thread_drains_under_the_inspectors_lock(mlp):
    """close() from another thread consumes what is still on its way to the host (findings, records)
    holding the Inspector's lock. With a lock of the queue's own, the two threads could deadlock:
    close() held the queue's lock while a consumer waited for the Inspector's (a finding's event),
    and a rewind on the training thread held the Inspector's while it drained (waiting for the
    queue's). Here the training thread tries the Inspector's lock while close() is consuming."""
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    insp = inspector.attach(mlp, opt, every=1)
    train_step(mlp, opt, *batch())
    inside, checked = threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def consume(_values: list[float]) -> None:
        inside.set()
        checked.wait(timeout=30)  # set by the main thread once it has tried the lock

    insp._deferred.submit_flat(insp.step + 1, torch.zeros(1), consume)  # (what a step's check does)
    closer = threading.Thread(target=insp.close, daemon=True)
    closer.start()
    try:
        assert inside.wait(timeout=30)
        seen["free"] = insp._lock.acquire(blocking=False)
        if seen["free"]:
            insp._lock.release()
    finally:
        checked.set()
        closer.join(timeout=30)
    assert not closer.is_alive()
    assert seen["free"] is False  # held by close()'s drain: no second lock to take in another order


def test_a_drain_waits_for_a_copy_still_under_way_outside_the_lock_and_keeps_the_order():
    """A drain that must wait for a device copy (finish, close, a pause, under torch.distributed
    every boundary) waits with the Inspector's lock released, so its other threads (the server's
    requests) go on meanwhile; the items are still consumed in order. A stand-in for the CUDA
    event (no GPU here): ready once waited for."""
    from inspector.stats.deferred import Deferred

    lock = threading.RLock()
    q = Deferred(lock)

    class Event:
        def __init__(self) -> None:
            self.done = False
            self.lock_held_while_waiting: bool | None = None

        def query(self) -> bool:
            return self.done

        def synchronize(self) -> None:
            self.lock_held_while_waiting = lock._is_owned()  # type: ignore[attr-defined]
            self.done = True

    got: list[int] = []
    events = []
    for k in range(3):
        q.submit_flat(k, [torch.tensor(float(k))], lambda v: got.append(int(v[0])))
        ev = Event()
        q._q[-1].event = ev  # (as a CUDA copy's item has)
        events.append(ev)
    q.drain(wait=True)
    assert got == [0, 1, 2]
    assert [ev.lock_held_while_waiting for ev in events] == [False, False, False]
