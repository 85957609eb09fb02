"""``zclip`` (adaptive clipping, inspector.hooks.zclip) against a plain-Python reference of ZClip.

The gradients are made with chosen norms (the loss is linear in the weights, so each weight's
gradient is a chosen tensor), spikes included; the reference is ZClip's published algorithm in
float64: warm-up statistics (mean and population variance of the first ``warmup`` norms), then
a z-score test against EMAs of the norm and its variance, updated with the clipped norm.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import inspector
from inspector.scenarios import make

from .conftest import GradCapture


def zclip_reference(norms, *, z=2.5, alpha=0.97, warmup=25, floor=0.0, clip_to="reciprocal", z_at=None):
    """Per norm ``(threshold or None, the norm after clipping)``; ``z_at``: {step: z} edits."""
    buf: list[float] = []
    mean = var = None
    out = []
    for i, g in enumerate(norms):
        z = (z_at or {}).get(i, z)
        if mean is None:
            buf.append(g)
            if len(buf) == warmup:
                mean = sum(buf) / len(buf)
                var = sum((x - mean) ** 2 for x in buf) / len(buf)
            out.append((None, g))
            continue
        std = math.sqrt(var)
        threshold = max(mean + z * std, floor)
        g_star = g
        if g > threshold:
            if clip_to == "reciprocal":
                z_t = (g - mean) / std  # the norm's z-score
                g_star = max(mean + (z / z_t) * z * std, floor)
            else:
                g_star = threshold
        mean = alpha * mean + (1 - alpha) * g_star
        var = alpha * var + (1 - alpha) * (g_star - mean) ** 2
        out.append((threshold, g_star))
    return out


class Linear2(nn.Module):
    """Two bias-free weights whose gradients are the tensors given to forward()."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3, bias=False)
        self.b = nn.Linear(5, 2, bias=False)

    def forward(self, da: torch.Tensor, db: torch.Tensor) -> torch.Tensor:
        return (self.a.weight * da).sum() + (self.b.weight * db).sum()


def norm_sequence(n: int, seed: int, spikes: dict[int, float]) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    base = (1.0 + 0.2 * torch.randn(n, generator=gen, dtype=torch.float64)).abs().tolist()
    return [v * spikes.get(i, 1.0) for i, v in enumerate(base)]


def directions(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        da, db = torch.randn(3, 4, generator=gen), torch.randn(2, 5, generator=gen)
        s = torch.cat([da.flatten(), db.flatten()]).norm()
        out.append((da / s, db / s))
    return out


def run(norms_a, norms_b=None, *, edits=None, attach=None, **params):
    """Train Linear2 with gradients of the given global norms (or, with ``norms_b``, the given
    norm of ``a``'s and of ``b``'s); per step (raw norms, final norms, the hook's effect)."""
    model = Linear2()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    insp = inspector.attach(model, opt, every=1, **(attach or {}))
    cap = GradCapture(opt)
    h = insp.add_hook("zclip", target="*", **params)
    out = []
    try:
        for i, (da, db) in enumerate(directions(len(norms_a), seed=7)):
            if edits and i in edits:
                h.update(**edits[i])
            if norms_b is None:
                da, db = da * norms_a[i], db * norms_a[i]
            else:
                da, db = da / da.norm() * norms_a[i], db / db.norm() * norms_b[i]
            opt.zero_grad()
            model(da, db).backward()
            opt.step()
            ga, gb = (g.double().norm().item() for g in cap.grads)
            snap = insp.latest()
            assert snap["step"] == i + 1
            out.append(
                (da.double().norm().item(), db.double().norm().item(), ga, gb, snap["hook_effects"][h.id])
            )
    finally:
        insp.close()
    return out


@pytest.mark.parametrize("clip_to", ["reciprocal", "threshold"])
def test_global_zclip_equals_the_reference_on_a_sequence_with_spikes(clip_to):
    norms = norm_sequence(60, seed=1, spikes={10: 3.0, 30: 20.0, 31: 8.0, 40: 50.0, 41: 50.0, 42: 50.0})
    got = run(norms, warmup=25, clip_to=clip_to)
    ref = zclip_reference(norms, warmup=25, clip_to=clip_to)
    clipped = 0
    for i, ((_, _, ga, gb, eff), (thr, g_star)) in enumerate(zip(got, ref, strict=True)):
        final = math.hypot(ga, gb)
        assert final == pytest.approx(g_star, rel=1e-5), f"step {i + 1}"
        if thr is None:
            assert eff["threshold"] is None and eff["clipped"] == 0, f"step {i + 1}: warming up"
            assert eff["warmup"] == 25 - (i + 1)
        else:
            assert eff["threshold"] == pytest.approx(thr, rel=1e-5), f"step {i + 1}"
            assert eff["clipped"] == (1 if g_star < norms[i] else 0) and eff["warmup"] == 0
        clipped += eff["clipped"]
    # the spike during warm-up went through; the later ones were clipped
    assert ref[10][1] == norms[10] and clipped >= 4
    assert all(ref[i][1] < norms[i] / 5 for i in (30, 40, 41, 42))


def test_nothing_is_clipped_during_warm_up():
    norms = [1.0, 100.0, 1.0, 1e4, 1.0]
    got = run(norms, warmup=5)
    for n, (_, _, ga, gb, eff) in zip(norms, got, strict=True):
        assert math.hypot(ga, gb) == pytest.approx(n, rel=1e-6)
        assert eff["clipped"] == 0 and eff["changed"] == 0 and eff["threshold"] is None


def test_a_floor_and_the_threshold_clip():
    norms = [1.0] * 5 + [1.5, 3.0, 1.0]  # constant warm-up: std 0, the threshold is the mean (1.0)
    got = run(norms, warmup=5, min_threshold=2.0, clip_to="threshold")
    finals = [math.hypot(ga, gb) for _, _, ga, gb, _ in got]
    assert finals[5] == pytest.approx(1.5, rel=1e-6)  # under the floor: not clipped
    assert finals[6] == pytest.approx(2.0, rel=1e-5)  # clipped to the floor, not to the mean
    assert got[6][4]["threshold"] == pytest.approx(2.0) and got[6][4]["clipped"] == 1
    assert zclip_reference(norms, warmup=5, floor=2.0, clip_to="threshold")[6] == (2.0, 2.0)


def test_group_mode_keeps_statistics_per_group():
    na = norm_sequence(45, seed=2, spikes={30: 40.0})
    nb = norm_sequence(45, seed=3, spikes={35: 40.0})
    nb = [3.0 * v for v in nb]  # another scale: the global statistics would clip neither spike
    got = run(na, nb, attach={"groups": {"a.*": "A", "b.*": "B"}}, mode="group", warmup=20)
    ref_a, ref_b = zclip_reference(na, warmup=20), zclip_reference(nb, warmup=20)
    for i, (_, _, ga, gb, eff) in enumerate(got):
        assert ga == pytest.approx(ref_a[i][1], rel=1e-5), f"step {i + 1}, group A"
        assert gb == pytest.approx(ref_b[i][1], rel=1e-5), f"step {i + 1}, group B"
        assert eff["clipped"] == (ref_a[i][1] < na[i]) + (ref_b[i][1] < nb[i])
        assert eff["threshold"] is None  # one per group: not one number
    assert got[30][2] < na[30] / 5 and got[30][3] == pytest.approx(nb[30], rel=1e-6)
    assert got[35][3] < nb[35] / 5 and got[35][2] == pytest.approx(na[35], rel=1e-6)


def test_an_edit_of_z_keeps_the_statistics_and_one_of_alpha_restarts_them():
    norms = norm_sequence(40, seed=4, spikes={30: 4.0, 36: 4.0})
    got = run(norms, warmup=10, edits={20: {"z": 1.0}})
    ref = zclip_reference(norms, warmup=10, z_at={20: 1.0})
    for i, ((_, _, ga, gb, eff), (thr, g_star)) in enumerate(zip(got, ref, strict=True)):
        assert math.hypot(ga, gb) == pytest.approx(g_star, rel=1e-5), f"step {i + 1}"
        if thr is not None:
            assert eff["threshold"] == pytest.approx(thr, rel=1e-5)
    got = run(norms, warmup=10, edits={20: {"alpha": 0.9}})
    assert [e["warmup"] for *_, e in got[19:22]] == [0, 9, 8]  # warming up again
    assert got[20][4]["threshold"] is None


def test_a_non_finite_norm_is_left_alone_and_kept_out_of_the_statistics():
    norms = norm_sequence(20, seed=5, spikes={})
    model = Linear2()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    insp = inspector.attach(model, opt, every=1)
    h = insp.add_hook("zclip", target="*", warmup=5)
    thresholds = []
    for i, (da, db) in enumerate(directions(20, seed=7)):
        if i == 12:
            da = da.clone()
            da[0, 0] = math.inf
        opt.zero_grad()
        model(da * norms[i], db * norms[i]).backward()
        opt.step()
        thresholds.append(insp.latest()["hook_effects"][h.id]["threshold"])
        if i == 12:
            assert math.isinf(model.a.weight.grad[0, 0]) and bool(torch.isfinite(model.b.weight.grad).all())
    insp.close()
    ref = zclip_reference(norms[:12] + norms[13:], warmup=5)
    expected = [t for t, _ in ref[:12]] + [ref[12][0]] + [t for t, _ in ref[12:]]
    assert thresholds[13:] == pytest.approx(expected[13:], rel=1e-5)
    assert thresholds[12] == pytest.approx(thresholds[13], rel=1e-5)  # the Inf step left them alone


def test_a_rewind_restores_the_statistics_and_replays_bitwise():
    sc = make("mlp", seed=0)
    model, opt = sc.model, torch.optim.Adam(sc.model.parameters(), lr=1e-2)
    insp = inspector.attach(model, opt, every=1)
    h = insp.add_hook("zclip", target="*", warmup=5, z=1.5)
    gen = torch.Generator().manual_seed(1)
    batches = [sc.next_batch(gen) for _ in range(30)]
    for i in (18, 19, 23):  # spikes after the checkpoint
        batches[i] = (batches[i][0] * 30, batches[i][1])

    def steps(r):
        out = []
        for i in r:
            x, y = batches[i]
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            out.append(insp.latest()["hook_effects"][h.id])
        return out

    steps(range(15))
    cp = insp.checkpoint()
    first = steps(range(15, 30))
    after_first = copy.deepcopy(model.state_dict())
    assert sum(e["clipped"] for e in first) >= 2
    insp.rewind(cp)
    assert steps(range(15, 30)) == first  # thresholds and effects, bit for bit
    assert all(torch.equal(v, after_first[k]) for k, v in model.state_dict().items())
    insp.close()


def test_zclip_keeps_the_exploding_demo_finite_without_a_threshold_to_choose():
    """The exploding demo's norm climbs to 1e8 and its loss to NaN within ~100 steps; zclip with its
    defaults holds the norm near its warm-up level and the loss stays finite."""
    plain = make("exploding", seed=0)
    plain_losses = [float(plain.step()) for _ in range(300)]
    assert not all(math.isfinite(v) for v in plain_losses)
    sc = make("exploding", seed=0)
    insp = inspector.attach(sc.model, sc.optimizer, every=10)
    h = insp.add_hook("zclip", target="*")
    losses = [float(sc.step()) for _ in range(300)]
    snaps = insp.snapshots()
    insp.close()
    assert all(math.isfinite(v) for v in losses)
    assert all(bool(torch.isfinite(p).all()) for p in sc.model.parameters())
    assert max(losses) < max(v for v in plain_losses if math.isfinite(v)) / 1e3
    late = [s for s in snaps if s["step"] > 100]
    assert any(s["hook_effects"][h.id]["clipped"] for s in late)
    assert max(s["total_norm"] for s in late) < 20 < max(s["total_norm_raw"] for s in late)


def test_the_kind_table_validates_zclip():
    model = Linear2()
    insp = inspector.attach(model, torch.optim.SGD(model.parameters(), lr=0.0))
    try:
        h = insp.add_hook("zclip", target="*")
        assert h.spec["params"] == {
            "z": 2.5,
            "alpha": 0.97,
            "warmup": 25,
            "min_threshold": 0.0,
            "clip_to": "reciprocal",
            "mode": "global",
            "norm_type": 2.0,
        }
        for bad in ({"alpha": 1.0}, {"alpha": 0.0}, {"z": 0}, {"warmup": 0}, {"warmup": 2.5}, {"mode": "x"}):
            with pytest.raises(inspector.HookError):
                insp.add_hook("zclip", target="*", **bad)
        with pytest.raises(inspector.HookError, match="does not run at post_accumulate"):
            insp.add_hook("zclip", target="*", point="post_accumulate")
        schema = inspector.hook_kinds()["zclip"]
        assert schema["properties"]["alpha"]["exclusiveMaximum"] == 1
        assert schema["points"] == ["pre_step"] and schema["modifies"]
    finally:
        insp.close()
