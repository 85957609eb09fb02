"""The flight recorder (inspector/stats/flight.py): every step's norms, unsampled ones too, equal to
plain torch norms of that step's gradients; the final norms after a pre_step hook; a dump on a
NaN; wrap-around keeps the last N steps in order; a rewind drops the abandoned steps."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import inspector


def model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    return m, torch.optim.SGD(m.parameters(), lr=0.05)


def train(insp, m, opt, steps, *, poison: int | None = None, first: int = 1) -> dict[int, list[float]]:
    """Run ``steps`` steps; returns each step's plain torch norms of the raw gradients."""
    truth = {}
    for s in range(first, first + steps):
        x = torch.randn(8, 5)
        loss = m(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if s == poison:
            m[0].weight.grad[0, 0] = math.nan
        truth[s] = [p.grad.double().norm().item() for p in m.parameters()]
        insp.record(loss=loss)
        opt.step()
    return truth


def test_every_step_unsampled_too_holds_the_plain_torch_norms():
    m, opt = model()
    insp = inspector.attach(m, opt, every=10, flight=256)
    truth = train(insp, m, opt, 30)
    insp.finish()
    rec = insp.flight_recorder()
    rows = {r["step"]: r for r in rec["rows"]}
    assert sorted(rows) == list(range(1, 31))
    for s, want in truth.items():
        assert rows[s]["raw"] == pytest.approx(want, rel=1e-5), s
        assert rows[s]["final"] == pytest.approx(want, rel=1e-5), s
        assert rows[s]["norm_raw"] == pytest.approx(math.sqrt(sum(v * v for v in want)), rel=1e-5)
        assert rows[s]["loss"] is not None and not rows[s]["nonfinite"]
    assert rec["params"] == insp.params and len(rows[1]["groups_raw"]) == len(rec["groups"])
    assert insp.memory["flight"] == 256 * (2 * 4 + 1) * 4
    insp.close()


@pytest.mark.parametrize("every", [1, 4])
def test_final_norms_after_a_pre_step_hook(every):
    m, opt = model()
    insp = inspector.attach(m, opt, every=every, flight=256)
    insp.add_hook("scale", target="*", factor=0.5)
    truth = train(insp, m, opt, 9)
    insp.finish()
    rows = {r["step"]: r for r in insp.flight_recorder()["rows"]}
    for s, want in truth.items():
        assert rows[s]["raw"] == pytest.approx(want, rel=1e-5)
        assert rows[s]["final"] == pytest.approx([0.5 * v for v in want], rel=1e-5)
    insp.close()


def test_a_nan_dumps_the_ring_once_with_the_bad_step_flagged():
    m, opt = model()
    insp = inspector.attach(m, opt, every=10, flight=256)
    dumps = []
    insp.subscribe(lambda kind, payload: dumps.append(payload) if kind == "flight" else None, lossless=True)
    train(insp, m, opt, 20, poison=13)
    insp.finish()
    insp.flush()
    assert [d["reason"] for d in dumps] == ["nonfinite"]
    rows = {r["step"]: r for r in dumps[0]["rows"]}
    assert rows[13]["nonfinite"] and rows[13]["raw"][0] == "nan"
    assert not any(r["nonfinite"] for s, r in rows.items() if s < 13)
    assert all(r["nonfinite"] for s, r in rows.items() if s > 13)  # (the update spread it: one dump)
    assert 12 in rows and 14 in rows  # the steps around it, at full resolution
    insp.close()


def test_wrap_around_keeps_the_last_n_steps_in_order():
    m, opt = model()
    insp = inspector.attach(m, opt, every=10, flight=16)
    truth = train(insp, m, opt, 41)
    insp.finish()
    rows = insp.flight_recorder()["rows"]
    assert [r["step"] for r in rows] == list(range(26, 42))
    for r in rows:
        assert r["raw"] == pytest.approx(truth[r["step"]], rel=1e-5)
    insp.close()


def test_a_rewind_drops_the_abandoned_steps():
    m, opt = model()
    insp = inspector.attach(m, opt, every=10, flight=256)
    train(insp, m, opt, 10)
    cp = insp.checkpoint()
    train(insp, m, opt, 10, first=11)
    assert insp.rewind(cp)["done"]
    truth = train(insp, m, opt, 3, first=11)
    insp.finish()
    rows = insp.flight_recorder()["rows"]
    assert [r["step"] for r in rows] == list(range(1, 14))
    for r in rows[-3:]:
        assert r["raw"] == pytest.approx(truth[r["step"]], rel=1e-5)
    insp.close()


@pytest.mark.parametrize("off", [{"flight": 0}, {}])
def test_off_and_off_by_default(off):
    m, opt = model()
    insp = inspector.attach(m, opt, **off)
    train(insp, m, opt, 3)
    with pytest.raises(inspector.InspectorError):
        insp.flight_recorder()
    with pytest.raises(inspector.InspectorError):
        insp.set_spike_detection(z=5)
    assert insp.spike_detection is None and insp.memory["flight"] == 0
    with pytest.raises(inspector.AttachError):
        inspector.attach(nn.Linear(2, 2), flight=-1)
    insp.close()


def _drop_bias(name: str, p: torch.Tensor) -> None:
    p.grad = None  # a user's hook that drops the gradient


@pytest.mark.parametrize("hook", ["freeze", "python"])
@pytest.mark.parametrize("every", [1, None])
def test_a_hook_that_drops_a_gradient_leaves_a_null_not_a_missing_row(hook, every):
    """A pre_step hook that sets a gradient to None (``freeze``, a user's Python hook): every step,
    sampled or not, keeps its row (the newest row is the newest step), the dropped tensor's final
    norm is null and the others' are the plain float64 norms, spike detection sees every step, a
    NaN on a later step is dumped, and nothing is reported as a telemetry error."""
    m, opt = model()
    insp = inspector.attach(m, opt, flight=16, **({} if every is None else {"every": every}))
    insp.set_spike_detection(warmup=5, cooldown=5)
    dropped = insp.params.index("2.bias")
    if hook == "freeze":
        insp.add_hook("freeze", target="2.bias")
    else:
        insp.add_hook(_drop_bias, target="2.bias", point="pre_step")
    dumps = []
    insp.subscribe(lambda kind, payload: dumps.append(payload) if kind == "flight" else None, lossless=True)
    truth = {}
    for s in range(1, 41):
        loss = m(torch.randn(8, 5)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if s == 38:
            m[0].weight.grad[0, 0] = math.nan
        truth[s] = [p.grad.double().norm().item() for p in m.parameters()]
        insp.record(loss=loss * 1000 if s == 25 else loss)  # a loss spike at step 25
        opt.step()
    insp.finish()
    insp.flush()
    rows = insp.flight_recorder()["rows"]
    assert [r["step"] for r in rows] == list(range(25, 41))
    for r in rows:
        want = truth[r["step"]]
        assert r["final"][dropped] is None
        assert r["nonfinite"] == (r["step"] >= 38)  # (the NaN's update spread it)
        if r["step"] < 38:
            assert r["raw"] == pytest.approx(want, rel=1e-5)
            kept = [v for i, v in enumerate(want) if i != dropped]
            assert [v for i, v in enumerate(r["final"]) if i != dropped] == pytest.approx(kept, rel=1e-5)
    spikes = [e for e in insp.events() if e["kind"] == "spike"]
    assert (25, "loss") in [(e["step"], e["signal"]) for e in spikes]
    reasons = {(d["reason"], d["step"]) for d in dumps}
    assert ("spike", 25) in reasons and ("nonfinite", 38) in reasons
    nan_rows = {r["step"]: r for r in next(d for d in dumps if d["reason"] == "nonfinite")["rows"]}
    assert nan_rows[38]["nonfinite"] and nan_rows[38]["raw"][0] == "nan" and not nan_rows[37]["nonfinite"]
    assert [e for e in insp.events() if e["kind"] == "telemetry_error"] == []
    insp.close()


def test_the_rings_memory_is_one_formula_everywhere_and_what_its_tensors_hold():
    """``insp.memory["flight"]`` is the bytes of the ring's own tensors (their storages, on the
    CPU), and every place that states the ring's memory states the formula that computes it."""
    import re
    from pathlib import Path

    m, opt = model()
    insp = inspector.attach(m, opt, every=10, flight=256)
    train(insp, m, opt, 3)
    rec = insp._flight
    storages = {}
    for t in rec._rows + rec._final_rows + rec._raw_rows + rec._loss_cells:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    held = sum(storages.values())
    tensors = len(insp.params)
    assert held == insp.memory["flight"] == 256 * (2 * tensors + 1) * 4
    insp.close()
    root = Path(__file__).resolve().parents[2]
    stated = set()
    docs = ["README.md", *(str(p.relative_to(root)) for p in sorted((root / "docs").glob("*.md")))]
    for path in (*docs, "server/PROTOCOL.md", "inspector/stats/flight.py", "inspector/inspector.py"):
        text = (root / path).read_text()
        stated |= {
            re.sub(r"\b(size|flight)\b", "N", f) for f in re.findall(r"`+((?:flight|size) x [^`]*)`", text)
        }
    assert stated == {"N x (2 x tensors + 1) x 4"}
