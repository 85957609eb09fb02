"""Spike detection (inspector/stats/spikes.py, fed by the flight recorder): z-scores against a float64
reference of the same robust EMA, a spike event at the right step, a gradient-norm spike before the
loss moves, the settings' validation, and at most one event per streak."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import inspector
from inspector.stats.spikes import FLOOR_ABS, FLOOR_LOG, FLOOR_REL, SpikeSettings, SpikeState


def reference(xs: list[list[float]], n_lin: int, s: SpikeSettings) -> list[list[float]]:
    """The detector's arithmetic in float64, plainly: the z of each step's values."""
    k = len(xs[0])
    m, v, n = [0.0] * k, [0.0] * k, [0] * k
    out = []
    for x in xs:
        zs = []
        for j in range(k):
            lin = j < n_lin
            ok = math.isfinite(x[j]) and (lin or x[j] > 0)
            if not ok:
                zs.append(0.0)
                continue
            y = x[j] if lin else math.log(x[j])
            floor = max(FLOOR_REL * abs(m[j]), FLOOR_ABS) if lin else FLOOR_LOG
            sd = max(math.sqrt(v[j]), floor)
            armed = n[j] >= s.warmup
            d = y - m[j]
            zs.append(d / sd if armed else 0.0)
            if armed:
                d = max(min(d, s.z * sd), -s.z * sd)
            n[j] += 1
            a = max(s.alpha, 1.0 / n[j])
            m[j] += a * d
            v[j] = (1 - a) * (v[j] + a * d * d)
        out.append(zs)
    return out


def test_z_scores_match_a_float64_reference_of_the_same_ema():
    gen = torch.Generator().manual_seed(0)
    steps = 120
    loss = (2.0 - torch.linspace(0, 1, steps) + 0.05 * torch.randn(steps, generator=gen)).tolist()
    norm = torch.exp(0.1 * torch.randn(steps, generator=gen)).tolist()
    grp = torch.exp(0.3 * torch.randn(steps, generator=gen)).tolist()
    norm[90] *= 40.0  # a spike, clipped into the statistics
    grp[100] = math.nan  # no value: statistics unchanged
    xs = [[a, b, c] for a, b, c in zip(loss, norm, grp, strict=True)]
    s = SpikeSettings(warmup=20, alpha=0.05)
    state = SpikeState(3, 1)
    got = [state.update(x, s)[0] for x in xs]
    want = reference(xs, 1, s)
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, rel=1e-9, abs=1e-9)
    assert want[90][1] > 30 and got[90][1] > 30  # the spike
    assert all(row[1] == 0 for row in got[:20])  # warm-up: nothing armed


def run(steps: int, scale_at: int | None = None, **attach) -> inspector.Inspector:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    insp = inspector.attach(m, opt, every=10, flight=256, **attach)
    insp.set_spike_detection(warmup=30)
    for s in range(1, steps + 1):
        x = torch.randn(32, 6)
        loss = (m(x) - x[:, :1]).pow(2).mean()
        if s == scale_at:
            loss = loss * 1000.0
        opt.zero_grad()
        loss.backward()
        insp.record(loss=loss)
        opt.step()
    insp.finish()
    return insp


def spikes(insp: inspector.Inspector) -> list[dict]:
    return [e for e in insp.events() if e["kind"] == "spike"]


def test_a_scaled_loss_is_a_spike_event_at_its_step_and_a_quiet_run_has_none():
    quiet = run(80)
    assert spikes(quiet) == []
    insp = run(80, scale_at=55)
    got = spikes(insp)
    assert got, "no spike"
    assert {e["step"] for e in got} == {55}
    by = {(e["signal"], e["group"]) for e in got}
    assert ("loss", None) in by and ("grad_norm", None) in by
    loss_ev = next(e for e in got if e["signal"] == "loss")
    assert loss_ev["z"] > 6 and loss_ev["value"] > 100 * loss_ev["mean"]
    insp.close()
    quiet.close()


def test_a_streak_is_one_event_per_signal_and_disabled_fires_none():
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    insp = inspector.attach(m, opt, every=10, flight=256)
    insp.set_spike_detection(warmup=10, cooldown=20)
    for s in range(1, 71):
        x = torch.randn(16, 4)
        loss = m(x).pow(2).mean() * (1e4 if 40 <= s < 46 else 1.0)  # a 6-step storm
        opt.zero_grad()
        loss.backward()
        insp.record(loss=loss)
        opt.step()
    insp.finish()
    got = spikes(insp)
    per_signal = {}
    for e in got:
        per_signal.setdefault((e["signal"], e["group"]), []).append(e["step"])
    assert per_signal and all(v == [40] for v in per_signal.values()), per_signal
    insp.set_spike_detection(enabled=False)
    assert insp.spike_detection["enabled"] is False
    insp.close()


def test_bad_settings_are_refused_and_change_nothing():
    insp = run(3)
    before = insp.spike_detection
    for bad in ({"z": -1}, {"z": math.inf}, {"warmup": 1.5}, {"alpha": 1.0}, {"cooldown": 0}, {"enabled": 1}):
        with pytest.raises(inspector.HookError) as err:
            insp.set_spike_detection(**bad)
        assert err.value.loc == ("spikes", next(iter(bad)))
    assert insp.spike_detection == before
    insp.close()


def test_the_gradient_norm_spikes_before_the_loss_on_the_deep_scenario():
    from inspector.scenarios import make

    sc = make("deep", seed=0)
    insp = inspector.attach(sc.model, sc.optimizer, every=10, flight=256)
    insp.set_spike_detection(warmup=20)
    for _ in range(75):
        loss = sc.step()
        insp.record(loss=loss)
    insp.finish()
    got = spikes(insp)
    grad = [e["step"] for e in got if e["signal"] in ("grad_norm", "group")]
    loss = [e["step"] for e in got if e["signal"] == "loss"]
    assert grad, got
    assert any("71" in (e["group"] or "") for e in got if e["signal"] == "group")
    assert min(grad) >= 55
    assert not loss or min(grad) < min(loss), (grad, loss)
    insp.close()


def test_a_loss_at_zero_moving_by_1e_9_is_no_spike_and_a_real_jump_from_zero_is():
    """A hinge's or a margin's loss sits at 0: 60 steps of 0.0, then 1e-9 is no spike (a floor in
    absolute terms, FLOOR_ABS), while 0.0 then 5.0 is one; each against the float64 reference."""
    s = SpikeSettings()
    for jump, spike in ((1e-9, False), (5.0, True)):
        xs = [[0.0]] * 60 + [[jump]]
        state = SpikeState(1, 1)
        got = [state.update(x, s)[0][0] for x in xs]
        want = [row[0] for row in reference(xs, 1, s)]
        assert got == pytest.approx(want, rel=1e-12, abs=1e-12)
        assert (got[-1] > s.z) is spike, (jump, got[-1])
    assert got[-1] == pytest.approx(5.0 / FLOOR_ABS)


@pytest.mark.parametrize("jump", [1e-9, 5.0])
def test_a_hinge_loss_at_zero_dumps_the_flight_recorder_only_on_a_real_jump(jump):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    insp = inspector.attach(m, opt, every=10, flight=256)
    dumps = []
    insp.subscribe(lambda kind, payload: dumps.append(payload) if kind == "flight" else None, lossless=True)
    for s in range(1, 66):
        x = torch.randn(32, 6)
        opt.zero_grad()
        (m(x) - x[:, :1]).pow(2).mean().backward()
        insp.record(loss=jump if s == 61 else 0.0)  # (the watched loss: 0 but for step 61)
        opt.step()
    insp.finish()
    insp.flush()
    got = spikes(insp)
    insp.close()
    if jump < 1:
        assert got == [] and dumps == [], (got, [d["reason"] for d in dumps])
    else:
        assert [(e["signal"], e["step"]) for e in got] == [("loss", 61)]
        assert [(d["reason"], d["step"]) for d in dumps] == [("spike", 61)]
