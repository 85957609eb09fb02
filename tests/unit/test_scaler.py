"""GradScaler: skipped iterations (first, middle, last) and fused optimizers.

Real ``torch.amp.GradScaler("cpu")`` and real fused CPU optimizers; an iteration is made to
overflow by putting an inf in its batch, so the scaler skips its update.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import inspector

from .conftest import batch, loss_of, seed_mlp

FUSED = {
    "Adam": lambda ps, fused: torch.optim.Adam(ps, lr=0.01, fused=fused),
    "AdamW": lambda ps, fused: torch.optim.AdamW(ps, lr=0.01, fused=fused),
    "SGD": lambda ps, fused: torch.optim.SGD(ps, lr=0.01, momentum=0.9, fused=fused),
}


def batches(n: int, bad: tuple[int, ...] = ()) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for s in range(n):
        x, y = batch(seed=s)
        if s in bad:
            x = x.clone()
            x[0, 0] = float("inf")  # this iteration's gradients overflow: the scaler skips its update
        out.append((x, y))
    return out


def amp_iteration(model, opt, scaler, x, y, insp=None):  # noqa: ANN001, ANN201
    opt.zero_grad(set_to_none=True)
    loss = loss_of(model, x, y)
    if insp is not None:
        insp.record(loss=loss)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss


def skipped_steps(insp: inspector.Inspector) -> list[int]:
    return [e["step"] for e in insp.events() if e["kind"] == "step_skipped" and e["reason"] == "scaler"]


# ----------------------------------------------------------------- every skip reported, nothing leaks
def test_scaler_skip_of_the_first_iteration_is_reported():
    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with inspector.attach(model, opt, scaler=scaler, every=1) as insp:
        for x, y in batches(3, bad=(0,)):  # the scale is still unset at the first forward
            amp_iteration(model, opt, scaler, x, y)
        assert insp.step == 2
        assert skipped_steps(insp) == [1]
        assert [s["step"] for s in insp.snapshots()] == [1, 2]


def test_scaler_skip_of_the_last_iteration_is_reported():
    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    insp = inspector.attach(model, opt, scaler=scaler, every=1)
    for x, y in batches(3, bad=(2,)):  # no forward comes after the last iteration
        amp_iteration(model, opt, scaler, x, y)
    insp.close()
    assert insp.step == 2
    assert skipped_steps(insp) == [3]


def test_scaler_skip_of_the_last_iteration_is_reported_by_finish():
    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with inspector.attach(model, opt, scaler=scaler, every=1) as insp:
        for x, y in batches(2, bad=(1,)):
            amp_iteration(model, opt, scaler, x, y)
        insp.finish()
        assert skipped_steps(insp) == [2]
    assert skipped_steps(insp) == [2]  # close() does not report it twice


def test_scaler_every_skipped_iteration_is_reported_once():
    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with inspector.attach(model, opt, scaler=scaler, every=1) as insp:
        for x, y in batches(7, bad=(0, 2, 3, 6)):
            amp_iteration(model, opt, scaler, x, y)
            model(x)  # an extra forward (evaluation) between iterations changes nothing
    assert insp.step == 3
    # iterations 0 and 2, 3 and 6 would have been steps 1, 2, 2 and 4
    assert skipped_steps(insp) == [1, 2, 2, 4]


def test_scaler_skipped_iteration_records_and_module_norms_do_not_leak_into_the_next_step():
    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with inspector.attach(model, opt, scaler=scaler, every=1) as insp:
        insp.add_hook("module_log", target="*", point="module")
        losses = []
        for x, y in batches(3, bad=(1,)):
            losses.append(float(amp_iteration(model, opt, scaler, x, y, insp).detach()))
        snaps = insp.snapshots()
    assert [s["step"] for s in snaps] == [1, 2]
    assert not math.isfinite(losses[1])
    # step 2 is the third iteration: its own loss and module norms, not the skipped one's
    assert snaps[1]["loss"] == pytest.approx(losses[2])
    norms = [v for m in snaps[1]["modules"].values() for v in m.values()]
    assert norms and all(v is not None and math.isfinite(v) for v in norms)


# ----------------------------------------------------------------- fused optimizers under a scaler
@pytest.mark.parametrize("name", sorted(FUSED))
def test_fused_optimizer_under_scaler_statistics_and_hooks_see_unscaled_gradients(name):
    model = seed_mlp()
    x, y = batch()
    ref = copy.deepcopy(model)
    loss_of(ref, x, y).backward()
    expected = [float(p.grad.norm()) for p in ref.parameters()]
    opt = FUSED[name](model.parameters(), True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    seen: dict[str, float] = {}

    def look(pname, param):  # noqa: ANN001
        seen[pname] = float(param.grad.norm())

    with inspector.attach(model, opt, scaler=scaler, every=1) as insp:
        insp.add_hook(look, target="*")
        amp_iteration(model, opt, scaler, x, y)
        snap = insp.latest()
    assert snap is not None and snap["step"] == 1
    for got, want in zip(snap["grad_norm_raw"], expected, strict=True):
        assert got == pytest.approx(want, rel=1e-4)
    assert [seen[n] for n in insp.params] == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("name", sorted(FUSED))
def test_fused_optimizer_under_scaler_trains_like_the_unfused_one_with_a_pre_step_hook(name):
    data = batches(6, bad=(2,))
    result = {}
    for fused in (False, True):
        model = seed_mlp()
        opt = FUSED[name](model.parameters(), fused)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        with inspector.attach(model, opt, scaler=scaler, every=1) as insp:
            insp.add_hook("clip_norm", target="*", max_norm=0.05)  # acts on the unscaled gradients
            for x, y in data:
                amp_iteration(model, opt, scaler, x, y)
            result[fused] = (
                [p.detach().clone() for p in model.parameters()],
                insp.step,
                skipped_steps(insp),
                [s["total_norm"] for s in insp.snapshots()],
            )
    (p0, step0, skip0, tot0), (p1, step1, skip1, tot1) = result[False], result[True]
    assert step1 == step0 == 5 and skip1 == skip0 == [3]
    assert tot1 == pytest.approx(tot0, rel=1e-5)
    for a, b in zip(p0, p1, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fused_optimizer_under_scaler_skipped_step_is_not_counted_and_leaves_parameters():
    model = seed_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with inspector.attach(model, opt, scaler=scaler, every=1) as insp:
        calls = []
        insp.add_hook(lambda n, p: calls.append(n), target="0.weight")
        data = batches(3, bad=(1,))
        amp_iteration(model, opt, scaler, *data[0])
        before = [p.detach().clone() for p in model.parameters()]
        amp_iteration(model, opt, scaler, *data[1])  # skipped: the fused kernel leaves the parameters
        for a, p in zip(before, model.parameters(), strict=True):
            assert torch.equal(a, p)
        assert insp.step == 1 and len(calls) == 1  # no pre_step hook on the skipped iteration
        amp_iteration(model, opt, scaler, *data[2])
        assert insp.step == 2 and len(calls) == 2
        assert skipped_steps(insp) == [2]
        assert not any(e["kind"] == "nonfinite" for e in insp.events())
        assert [s["step"] for s in insp.snapshots()] == [1, 2]


def test_fused_optimizer_under_scaler_without_scaler_given_to_attach():
    """The scaler hands a fused optimizer its scale: that is enough to unscale and to see skips."""
    model = seed_mlp()
    x, y = batch()
    ref = copy.deepcopy(model)
    loss_of(ref, x, y).backward()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with inspector.attach(model, opt, every=1) as insp:
        for x2, y2 in [(x, y), *batches(2, bad=(0,))]:
            amp_iteration(model, opt, scaler, x2, y2)
        snaps = insp.snapshots()
    assert [s["step"] for s in snaps] == [1, 2]
    for got, r in zip(snaps[0]["grad_norm"], ref.parameters(), strict=True):
        assert got == pytest.approx(float(r.grad.norm()), rel=1e-4)
    assert skipped_steps(insp) == [2]


def test_optimizer_that_unscales_with_a_grad_scaler_argument_is_refused_under_a_scaler():
    class OwnScaling(torch.optim.SGD):
        """The older contract: step(grad_scaler=...) unscales inside the optimizer."""

        _step_supports_amp_scaling = True

        def step(self, closure=None, grad_scaler=None):  # noqa: ANN001, ANN201
            return super().step(closure)

    model = seed_mlp()
    opt = OwnScaling(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(inspector.AttachError, match="grad_scaler"):
        inspector.attach(model, opt, scaler=scaler)


def test_records_after_a_fused_skip_are_forgotten_with_the_skipped_iteration():
    """A fused optimizer's skip leaves the iteration 'under way' (no boundary came): the next
    forward must still forget what was recorded after that step(), not skip the check as a later
    forward of the same step would."""
    model = seed_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with inspector.attach(model, opt, every=1) as insp:
        for i, (x, y) in enumerate(batches(3, bad=(1,))):
            amp_iteration(model, opt, scaler, x, y)
            insp.record(**{f"after_{i}": 1.0})
    snaps = insp.snapshots()  # after close(), which sends the last late records
    assert skipped_steps(insp) == [2]
    assert [s["step"] for s in snaps] == [1, 2]
    assert set(snaps[-1]["scalars"]) == {"after_2"}, snaps[-1]["scalars"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(FUSED))
def test_fused_optimizer_under_a_scale_that_is_no_power_of_two_is_bitwise_plain(name, dtype):
    """Attached with no hooks, a fused optimizer under GradScaler(init_scale=1000) updates the
    weights bit for bit as unattached: the gradients are divided by the scale, as its kernel does."""
    data = batches(6, bad=(2,))
    result = []
    for attached in (False, True):
        model = seed_mlp().to(dtype)
        opt = FUSED[name](model.parameters(), True)
        scaler = torch.amp.GradScaler("cpu", init_scale=1000.0, growth_interval=2)
        insp = inspector.attach(model, opt, scaler=scaler, every=1) if attached else None
        for x, y in data:
            amp_iteration(model, opt, scaler, x.to(dtype), y.to(dtype))
        result.append([p.detach().clone() for p in model.parameters()])
        if insp is not None:
            insp.close()
    for a, b in zip(*result, strict=True):
        assert torch.equal(a, b)
