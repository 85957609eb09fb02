"""The budgeted cadence: short runs are dense, and nothing latches.

The :class:`~inspector.stats.telemetry.Cadence` is driven with synthetic timings (seconds of the
inspector's own work and of the wall-clock step), so these tests do not depend on the machine;
one end-to-end run checks that a real short run is dense.
"""

from __future__ import annotations

import pytest
import torch

import inspector
from inspector.stats.telemetry import DENSE_STEPS, Cadence

from .conftest import batch, seed_mlp, train_step

# a fast step where the statistics cost far more than the budget allows: the budget alone samples
# about every 18th step (0.9 ms extra against half of 3 % of 10 ms, less the 0.1 ms base: 0.05 ms)
WALL, SAMPLED, BASE = 0.010, 0.001, 0.0001
BUDGET_K = 18


def run(c: Cadence, steps: range, cost=None, wall=None) -> list[int]:  # noqa: ANN001
    """Drive ``c`` over ``steps``; returns the sampled ones."""
    out = []
    for step in steps:
        sampled = c.is_sampled(step)
        ours = cost(step, sampled) if cost else (SAMPLED if sampled else BASE)
        c.observe(step, sampled, ours, wall(step) if wall else WALL)
        if sampled:
            out.append(step)
    return out


def test_cadence_samples_every_step_at_first():
    c = Cadence(0.03, None)
    sampled = run(c, range(1, DENSE_STEPS + 1))
    assert sampled == list(range(1, DENSE_STEPS + 1))


def test_cadence_short_run_is_dense_to_its_end():
    c = Cadence(0.03, None)
    sampled = run(c, range(1, 101))
    # without the dense start the budget gave 1, 2, 4, 8, 16, 32, 64: 7 snapshots, the last at 64
    assert len(sampled) >= 30
    assert sampled[-1] >= 91
    gaps = [b - a for a, b in zip(sampled, sampled[1:], strict=False)]
    assert all(g <= max(1, a // 10) for a, g in zip(sampled, gaps, strict=False))


def test_cadence_long_run_still_keeps_the_budget():
    c = Cadence(0.03, None)
    sampled = run(c, range(1, 3001))
    assert c.k >= BUDGET_K  # the budget's own interval, reached once a tenth of the steps allows it
    late = [s for s in sampled if s > 2000]
    assert len(late) <= 1000 / BUDGET_K + 1


def test_cadence_one_slow_early_step_does_not_latch():
    """A slow unsampled step early on (a garbage collection, a lazy initialisation) once made the
    unsampled cost look dearer than the sampled one: k = 1 from then on, and with every step
    sampled the unsampled cost was never measured again."""
    c = Cadence(0.03, None)
    first_unsampled = []

    def cost(step, sampled):  # noqa: ANN001, ANN202
        if not sampled and not first_unsampled:
            first_unsampled.append(step)
            return 0.050  # 50 ms of our own time, once
        return SAMPLED if sampled else BASE

    sampled = run(c, range(1, 1001), cost=cost)
    assert first_unsampled  # the slow step happened
    assert c.k >= BUDGET_K
    assert len([s for s in sampled if s > 800]) <= 200 / BUDGET_K + 1


def test_cadence_one_slow_early_wall_step_is_re_measured():
    c = Cadence(0.03, None)
    run(c, range(1, 31))
    k_before = c.k
    run(c, range(31, 32), wall=lambda s: 5.0)  # an evaluation pass between two steps
    assert c.costs["step_s"] == WALL  # outvoted by the median of the recent steps
    run(c, range(32, 200))
    assert c.k >= k_before


def test_cadence_grows_gradually_and_keeps_about_a_snapshot_a_second():
    c = Cadence(0.03, None)
    # 10 ms steps, every-step work alone over budget (1 ms > 0.3 ms), 2 ms statistics
    ks = []
    for step in range(1, 400):
        sampled = c.is_sampled(step)
        c.observe(step, sampled, 0.002 if sampled else 0.001, 0.010)
        if sampled:
            ks.append(c.k)
    assert ks[: DENSE_STEPS - 1] == [1] * (DENSE_STEPS - 1)  # the dense start
    assert all(b <= 2 * a for a, b in zip(ks, ks[1:], strict=False))  # then at most doubling
    assert max(ks) <= 100  # about one snapshot a second at 100 steps a second
    # the statistics' own extra cost within a quarter (MIN_ROOM) of half the budget (the cadence's
    # safety margin), on top of the every-step work that took it all: ceil(1 / (0.25 * 0.15))
    assert ks[-1] == 27


def test_cadence_every_n_is_fixed_from_the_first_step():
    c = Cadence(0.03, 3)
    assert run(c, range(1, 11)) == [1, 4, 7, 10]


def test_cadence_short_run_end_to_end_is_dense():
    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with inspector.attach(model, opt) as insp:  # the default budget
        for s in range(100):
            train_step(model, opt, *batch(seed=s))
        steps = [snap["step"] for snap in insp.snapshots()]
    assert steps[:DENSE_STEPS] == list(range(1, DENSE_STEPS + 1))
    assert len(steps) >= 30 and steps[-1] >= 91


def test_the_last_step_of_a_run_that_says_its_length_is_always_sampled():
    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = batch()
    for total in (100, 137):  # wherever the budget's cadence would fall
        with inspector.attach(model, opt) as insp:
            insp.expect_last_step(total)
            for _ in range(total):
                train_step(model, opt, x, y)
            assert insp.latest()["step"] == total
    with inspector.attach(model, opt) as insp, pytest.raises(inspector.HookError):
        insp.expect_last_step(0)


def drive(c: Cadence, steps: int, wall: float, sampled_s: float, base_s: float) -> None:
    for step in range(1, steps + 1):
        c.observe(step, c.is_sampled(step), sampled_s if c.is_sampled(step) else base_s, wall)


def test_a_snapshot_a_second_gives_way_to_the_whole_budget():
    """A large model on a CPU: 250 ms steps, 5 ms of every-step work, 90 ms a sampled step. A
    snapshot a second (k = 4) would cost 26 ms a step, 10 %; the cadence samples as often as the
    whole 3 % allows instead: k = ceil(85 / (7.5 - 5)) = 34 (before: 4, whatever the budget)."""
    c = Cadence(0.03, None)
    drive(c, 2000, 0.25, 0.090, 0.005)
    assert c.k == 34
    assert c.overhead is not None and c.overhead <= 0.03


def test_a_snapshot_a_second_is_kept_where_it_fits_in_the_whole_budget():
    """100 ms steps, 20 ms a sampled step, almost no every-step work: half the budget alone would
    sample every 15th step (1.5 s); a snapshot a second (k = 10) costs 2 %, within the whole 3 %."""
    c = Cadence(0.03, None)
    drive(c, 2000, 0.1, 0.0201, 0.0001)
    assert c.k == 10
    assert c.overhead is not None and c.overhead <= 0.03


def test_what_a_sampled_step_costs_the_step_around_it_counts_too():
    """The same large model as above, but its sampled steps take 45 ms longer on the wall clock
    than our timers see (caches our passes evicted, memory they allocated): the cadence takes the
    wall-clock difference, 129 ms, as the sampled step's extra cost: k = ceil(129 / 2.5) = 52
    (before: 34, from the timers alone, a real cost of 4.8 % against the 3 % promised)."""
    c = Cadence(0.03, None)
    for step in range(1, 3001):
        sampled = c.is_sampled(step)
        c.observe(step, sampled, 0.090 if sampled else 0.005, 0.25 + (0.129 if sampled else 0.0))
    assert c.k == 52
    felt = 0.005 + 0.129 / c.k
    assert c.overhead == pytest.approx(felt / 0.25, rel=0.05)  # (the published overhead says so too)


def test_a_snapshot_built_after_the_boundary_counts_in_its_own_step():
    """The snapshot is built after the step's cost was observed (the next step's sampling is
    decided first): ``observe_late`` adds its time to that sampled step, not to the next one,
    so the cadence sees the same as if it had been timed in the step."""
    late, whole = Cadence(0.03, None), Cadence(0.03, None)
    for step in range(1, 2001):
        sampled = late.is_sampled(step)
        assert sampled == whole.is_sampled(step)
        late.observe(step, sampled, 0.040 if sampled else 0.005, 0.25)
        late.observe_late(sampled, 0.050 if sampled else 0.0)
        whole.observe(step, sampled, 0.090 if sampled else 0.005, 0.30 if sampled else 0.25)
    assert late.k == whole.k == 34
    assert late.costs == whole.costs


def test_the_snapshot_is_counted_in_the_sampled_steps_cost(monkeypatch):
    """End to end: building a snapshot (here made to take 30 ms) is counted in the sampled
    steps' cost, which ``insp.cost`` reports, and not in the unsampled steps' after them."""
    import time

    from inspector.stats.step_stats import StepStats

    build = StepStats.snapshot

    def slow(self, *args, **kwargs):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        out = build(self, *args, **kwargs)
        while time.perf_counter() - t0 < 0.030:  # (work that takes 30 ms, not a wait)
            pass
        return out

    monkeypatch.setattr(StepStats, "snapshot", slow)
    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with inspector.attach(model, opt, every=4) as insp:
        for s in range(40):
            train_step(model, opt, *batch(seed=s))
        cost = insp.cost
    assert cost["sampled_s"] >= 0.030
    assert cost["unsampled_s"] < 0.030
