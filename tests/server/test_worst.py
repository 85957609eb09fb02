"""Worst now (server/live/worst.py): the robust z-score ranking of each snapshot against each
tensor's own recent history, on synthetic histories."""

from __future__ import annotations

import math

import numpy as np

from server.live.worst import MAD_FLOOR, MIN_VALUES, TOP, WINDOW, WorstNow, worst_of

N = 20


def snap(norms, ratios=None) -> dict:
    return {
        "grad_norm_raw": list(norms),
        "update_ratio": list(ratios) if ratios is not None else [None] * len(norms),
    }


def noisy_history(steps: int, seed: int = 0) -> list[list[float]]:
    rng = np.random.default_rng(seed)
    base = 10 ** rng.normal(-2, 0.5, N)
    return [(base * 10 ** rng.normal(0, 0.05, N)).tolist() for _ in range(steps)]


def reference_z(history: list[float], value: float) -> tuple[float, float]:
    """The z and the median (linear) of `value` against `history`, written out plainly."""
    logs = np.log10(np.array(history[-WINDOW:]))
    med = float(np.median(logs))
    mad = float(np.median(np.abs(logs - med)))
    return (math.log10(value) - med) / (1.4826 * max(mad, MAD_FLOOR)), 10**med


def test_a_tensor_that_jumps_ranks_first_with_its_z():
    tracker = WorstNow()
    hist = noisy_history(40)
    for row in hist:
        tracker.update(snap(row))
    now = list(hist[-1])
    now[7] *= 100  # two decades up
    worst = tracker.update(snap(now))
    assert worst[0]["param"] == 7 and worst[0]["stat"] == "grad_norm_raw"
    z, median = reference_z([h[7] for h in hist], now[7])
    assert math.isclose(worst[0]["z"], z, abs_tol=1e-3) and z > 20
    assert math.isclose(worst[0]["median"], median, rel_tol=1e-9)
    assert worst[0]["value"] == now[7]
    assert len(worst) <= TOP
    assert [abs(w["z"]) for w in worst] == sorted((abs(w["z"]) for w in worst), reverse=True)


def test_a_drop_ranks_with_a_negative_z():
    tracker = WorstNow()
    hist = noisy_history(20, seed=1)
    for row in hist:
        tracker.update(snap(row))
    now = list(hist[-1])
    now[3] /= 1000
    worst = tracker.update(snap(now))
    assert worst[0]["param"] == 3 and worst[0]["z"] < -20


def test_flat_histories_do_not_blow_up():
    tracker = WorstNow()
    for _ in range(WINDOW):
        assert all(
            abs(w["z"]) < 1e-9 for w in tracker.update(snap([0.5] * N, [1e-3] * N))
        )  # numpy warnings are errors here (pyproject: filterwarnings)
    worst = tracker.update(snap([0.5] * (N - 1) + [5.0], [1e-3] * N))
    assert worst[0]["param"] == N - 1
    assert math.isclose(worst[0]["z"], 1 / (1.4826 * MAD_FLOOR), rel_tol=1e-3)  # the MAD's floor
    assert all(math.isfinite(w["z"]) for w in worst)


def test_fewer_than_min_values_are_not_ranked():
    tracker = WorstNow()
    for _ in range(MIN_VALUES - 1):
        tracker.update(snap([0.5] * N))
    assert tracker.update(snap([50.0] * N)) == [], "7 values of history: no tensor is ranked"
    tracker = WorstNow()
    for _ in range(MIN_VALUES):
        tracker.update(snap([0.5] * N))
    assert len(tracker.update(snap([50.0] * N))) == TOP


def test_non_finite_values_rank_first_even_without_history():
    tracker = WorstNow()
    hist = noisy_history(12)
    for row in hist:
        tracker.update(snap(row))
    now: list = list(hist[-1])
    now[2] *= 1e6  # a huge finite jump
    now[5] = "nan"
    now[9] = "inf"
    worst = tracker.update(snap(now))
    assert [(w["param"], w["z"], w["value"]) for w in worst[:2]] == [(5, "inf", "nan"), (9, "inf", "inf")]
    assert worst[2]["param"] == 2
    assert worst[0]["median"] is not None
    fresh = WorstNow().update(snap([0.1, "-inf", None]))
    assert [(w["param"], w["z"], w["median"]) for w in fresh] == [(1, "inf", None)]


def test_none_and_zero_are_not_ranked_nor_remembered():
    tracker = WorstNow()
    for _ in range(10):
        tracker.update(snap([0.5, None, 0.0]))
    ranked = tracker.update(snap([0.5, 5.0, 5.0]))
    assert [w["param"] for w in ranked] == [0], "no history of values for tensors 1 and 2"


def test_one_entry_per_tensor_with_the_larger_z():
    tracker = WorstNow()
    for _ in range(10):
        tracker.update(snap([0.5] * 3, [1e-3] * 3))
    worst = tracker.update(snap([5.0, 0.5, 0.5], [1.0, 1e-3, 1e-3]))  # tensor 0: norm x10, ratio x1000
    assert sorted(w["param"] for w in worst) == [0, 1, 2], "each tensor once"
    assert worst[0]["param"] == 0 and worst[0]["stat"] == "update_ratio" and worst[0]["z"] > 90


def test_worst_of_a_stored_run_ranks_its_last_row():
    hist = noisy_history(33)
    hist[-1][4] *= 1000
    worst = worst_of(snap(row) for row in hist)
    assert worst[0]["param"] == 4


def test_non_finite_tensors_rank_by_origin_then_by_their_rise_before_it():
    tracker = WorstNow()
    hist = noisy_history(20, seed=2)
    for s, row in enumerate(hist, start=1):
        tracker.update({**snap(row), "step": s})
    rising = list(hist[-1])
    rising[15] *= 1000  # three decades up at step 21: the lead
    tracker.update({**snap(rising), "step": 21})
    now: list = list(rising)
    now[11] = "inf"  # step 22: tensor 11 goes first
    first = tracker.update({**snap(now), "step": 22})
    assert (first[0]["param"], first[0]["since"], first[0]["before"]) == (11, 22, None)
    everything = tracker.update({**snap(["nan"] * N), "step": 23})  # step 23: every tensor
    assert [w["param"] for w in everything[:2]] == [11, 15], "the origin, then the tensor that rose"
    assert everything[1]["since"] == 23 and everything[1]["before"]["step"] == 21
    assert everything[1]["before"]["z"] > 20
    assert [w["param"] for w in everything[2:]] == list(range(TOP - 2)), "then parameter order"
    again = tracker.update({**snap(hist[-1]), "step": 24})  # finite again: no streak left
    assert all("since" not in w for w in again)
    assert tracker.update({**snap(["nan"] * N), "step": 25})[0]["since"] == 25
