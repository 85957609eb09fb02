"""History when not every step is sampled (`attach(every=N)`, or the default budget, which
samples every k-th step with k chosen at run time): the thinning rule keeps multiples of
2^(k+1) in each octave of age, so where those steps were never recorded, it must keep the
first recorded step after each, not nothing (found by bench/soak.py --every 2: of 100,000
steps only the newest 1024 survived)."""

from __future__ import annotations

import torch

import inspector
from inspector import scenarios
from server.history.storage import HistoryStore
from tests.support import wait_until

from .tools import thinning_bound

W = 64  # a small full window, so a few thousand steps span several octaves


SLACK = 256  # rows newer than the last thinning pass (it runs each time the newest step moved 64 on: room to spare)


def record(store: HistoryStore, run: int, steps: list[int]) -> None:
    for s in steps:
        store.add_snapshot(run, {"step": s, "time": float(s), "events": []})
        if s % 128 < (steps[1] - steps[0]):
            assert store.flush()
    assert store.flush()


def octave(age: int) -> int:
    return (age // W).bit_length() - 1


def check(kept: list[int], newest: int, cadence: int) -> None:
    """Each octave of age that a thinning pass has covered keeps about one row per bucket of its
    stride, or every recorded row where the stride is finer than the cadence: at least half of
    that (the last pass ran up to SLACK steps before `newest`, which blurs the octaves' edges)."""
    for k in range(octave(newest)):
        lo_age, hi_age = W * 2**k, W * 2 ** (k + 1)
        if lo_age < W + SLACK or hi_age > newest:
            continue  # not yet thinned, or not a whole octave
        rows = [s for s in kept if lo_age <= newest - s < hi_age]
        expected = (hi_age - lo_age) / max(2 ** (k + 1), cadence)
        assert len(rows) >= expected / 2, (
            f"octave {k} (stride {2 ** (k + 1)}): {len(rows)} rows of about {expected:.0f}"
        )


def test_odd_steps_only(tmp_path):
    store = HistoryStore(tmp_path / "h.sqlite", full_window=W, flush_interval=0.01)
    store.start_writer()
    run = store.new_run(params=[], modules=[""])
    recorded = list(range(1, 8192, 2))  # every=2 starting at step 1: never a multiple of 2
    record(store, run, recorded)
    kept = store.steps("snapshots", run, cap=None)
    newest = recorded[-1]
    assert set(r for r in recorded if r > newest - W) <= set(kept), "the full window is kept"
    check(kept, newest, 2)
    assert len(kept) <= thinning_bound(newest, W, slack=SLACK)
    store.close()


def test_every_step_is_unchanged(tmp_path):
    """The documented rule, exactly, when every step is recorded."""
    store = HistoryStore(tmp_path / "h.sqlite", full_window=W, flush_interval=0.01)
    store.start_writer()
    run = store.new_run(params=[], modules=[""])
    recorded = list(range(1, 4097))
    record(store, run, recorded)
    kept = store.steps("snapshots", run, cap=None)
    for s in kept:
        age = 4096 - s
        if age >= W:
            assert s % 2 ** (octave(age) + 1) == 0, s
    store.close()


def test_a_sampled_run_keeps_old_history(tmp_path):
    """A loop with `attach(model, opt, every=7)` (the default budget samples irregularly, the
    same way): snapshots older than the full window survive thinning, one per bucket."""
    torch.manual_seed(0)
    sc = scenarios.make("mlp", seed=0)
    insp = inspector.attach(sc.model, sc.optimizer, every=7)
    store = HistoryStore(tmp_path / "h.sqlite", full_window=W, flush_interval=0.01)
    store.start_writer()
    run = store.new_run(params=insp.param_info(), modules=list(insp.modules))
    published: list[int] = []

    def on(kind, payload):
        if kind == "snapshot":
            published.append(payload["step"])
            store.add_snapshot(run, payload)

    insp.subscribe(on)
    for _ in range(3000):
        loss = sc.step()
        insp.record(loss=loss)
    wait_until(lambda: published and published[-1] > insp.step - 7, 10, "the last snapshot")
    insp.close()
    assert store.flush()
    kept = store.steps("snapshots", run, cap=None)
    check(kept, published[-1], 7)
    assert len(kept) <= thinning_bound(published[-1], W, slack=SLACK)
    store.close()
