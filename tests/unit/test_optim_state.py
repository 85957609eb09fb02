"""The optimizer's state and update geometry (``Snapshot.optim``, inspector/stats/optim_state.py),
against float64 references made from the optimizer's own state and the parameters and gradients
before and after each step, in plain torch."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import inspector
from inspector.stats import optim_state
from inspector.stats.update_ratio import FLOOR

from .conftest import batch, loss_of

GEO = ("step_ratio", "cos_update_grad", "cos_grad_prev")
ADAM = ("exp_avg_norm", "exp_avg_sq_sqrt_norm", "below_eps_frac")


def model(seed: int = 0) -> nn.Sequential:
    """Two blocks of two tensors each, and a head: groups of several members."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Sequential(nn.Linear(10, 16), nn.Tanh()),
        nn.Sequential(nn.Linear(16, 8), nn.Tanh()),
        nn.Linear(8, 1),
    )


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


class Trace:
    """Per step, as plain torch sees it: the final gradients (a step pre-hook registered after the
    inspector's), the parameters before and after the update, and the optimizer's state after it."""

    def __init__(self, params: list[torch.Tensor], opt: torch.optim.Optimizer) -> None:
        self.params, self.opt = params, opt
        self.steps: list[dict[str, Any]] = []
        opt.register_step_pre_hook(self._pre)
        opt.register_step_post_hook(self._post)

    def _pre(self, *_: Any) -> None:
        self.steps.append(
            {
                "g": [p.grad.detach().double().flatten().clone() for p in self.params],
                "before": [p.detach().double().flatten().clone() for p in self.params],
            }
        )

    def _post(self, *_: Any) -> None:
        s = self.steps[-1]
        s["after"] = [p.detach().double().flatten().clone() for p in self.params]
        s["state"] = []
        for p in self.params:
            st = self.opt.state.get(p, {})
            s["state"].append(
                {k: (v.detach().double().clone() if torch.is_tensor(v) else v) for k, v in st.items()}
            )
        s["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]


def reference(trace: Trace, k: int, members: list[list[int]]) -> dict[str, Any]:
    """The float64 values of step ``k`` (0-based) and of the previous one: per tensor, per group
    (a group's values are those of its members' tensors concatenated) and, under ``"model"``, of
    every tensor concatenated."""
    out = _reference(trace, k, [*members, list(range(len(trace.params)))])
    out["model"] = {key: v.pop() for key, v in out["groups"].items()}
    return out


def _reference(trace: Trace, k: int, members: list[list[int]]) -> dict[str, Any]:
    s, prev = trace.steps[k], trace.steps[k - 1] if k else None
    n = len(trace.params)
    delta = [s["after"][i] - s["before"][i] for i in range(n)]
    g = s["g"]
    out: dict[str, Any] = {
        "step_ratio": [float(delta[i].norm() / g[i].norm()) for i in range(n)],
        "cos_update_grad": [_cos(delta[i], -g[i]) for i in range(n)],
        "cos_grad_prev": [_cos(g[i], prev["g"][i]) if prev else None for i in range(n)],
    }
    cat = lambda xs, m: torch.cat([xs[i] for i in m])  # noqa: E731
    out["groups"] = {
        "step_ratio": [float(cat(delta, m).norm() / cat(g, m).norm()) for m in members],
        "cos_update_grad": [_cos(cat(delta, m), -cat(g, m)) for m in members],
        "cos_grad_prev": [_cos(cat(g, m), cat(prev["g"], m)) if prev else None for m in members],
    }
    state = s["state"]
    if state and "exp_avg" in state[0]:
        grp = s["groups"][0]
        eps, beta2 = grp["eps"], grp["betas"][1]
        m_ = [st["exp_avg"].flatten() for st in state]
        v_ = [st["exp_avg_sq"].flatten() for st in state]
        t = [float(st["step"]) for st in state]
        below = [(v_[i] / (1 - beta2 ** t[i]) < eps * eps).double() for i in range(n)]
        out["exp_avg_norm"] = [float(x.norm()) for x in m_]
        out["exp_avg_sq_sqrt_norm"] = [float(x.sqrt().norm()) for x in v_]
        out["below_eps_frac"] = [float(b.mean()) for b in below]
        out["groups"]["exp_avg_norm"] = [float(cat(m_, m).norm()) for m in members]
        out["groups"]["exp_avg_sq_sqrt_norm"] = [float(cat(v_, m).sqrt().norm()) for m in members]
        out["groups"]["below_eps_frac"] = [float(cat(below, m).mean()) for m in members]
    return out


def close(got: Any, want: Any, rel: float, ab: float, what: str) -> None:
    assert len(got) == len(want), what
    for j, (a, b) in enumerate(zip(got, want, strict=True)):
        if b is None:
            assert a is None, f"{what}[{j}]: {a} for no value"
        else:
            assert a is not None and a == pytest.approx(b, rel=rel, abs=ab), f"{what}[{j}]: {a} != {b}"


def run(
    make_opt: Any, steps: int = 4, every: int = 1, net: nn.Module | None = None
) -> tuple[Trace, Any, list]:
    net = net if net is not None else model()
    opt = make_opt(net.parameters())
    insp = inspector.attach(net, opt, every=every)
    trace = Trace(list(net.parameters()), opt)
    snaps = []
    try:
        for s in range(1, steps + 1):
            opt.zero_grad(set_to_none=True)
            x, y = batch(seed=s)
            loss_of(net, x, y).backward()
            opt.step()
            if (latest := insp.latest()) is not None and latest["step"] == s:
                snaps.append(latest)
        members = insp.groups["members"]
        errors = [e for e in insp.events() if e["kind"] == "telemetry_error"]
    finally:
        insp.close()
    assert not errors, errors
    return trace, members, snaps


OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False),
    "adam-foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "adam-fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "sgd-nesterov-foreach": lambda ps: torch.optim.SGD(
        ps, lr=0.05, momentum=0.9, nesterov=True, foreach=True
    ),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_against_float64_references_per_tensor_and_group(name):
    trace, members, snaps = run(OPTIMIZERS[name])
    assert [s["step"] for s in snaps] == [1, 2, 3, 4]
    adam = name.startswith("adam")
    for k, snap in enumerate(snaps):
        got, want = snap["optim"], reference(trace, k, members)
        assert got["kind"] == ("adam" if adam else "other")
        assert got["cos_prev_gap"] == (1 if k else None)
        for key in GEO:
            close(got[key], want[key], 1e-5, 1e-6, f"step {k + 1} {key}")
            close(got["groups"][key], want["groups"][key], 1e-5, 1e-6, f"step {k + 1} group {key}")
            close([got["model"][key]], [want["model"][key]], 1e-5, 1e-6, f"step {k + 1} model {key}")
        for key in ADAM:
            if adam:
                close(got[key], want[key], 1e-5, 1e-7, f"step {k + 1} {key}")
                close(got["groups"][key], want["groups"][key], 1e-5, 1e-7, f"step {k + 1} group {key}")
                close([got["model"][key]], [want["model"][key]], 1e-5, 1e-7, f"step {k + 1} model {key}")
            else:
                assert got[key] == [None] * len(trace.params) and set(got["groups"][key]) == {None}


def test_plain_sgd_steps_along_the_negative_gradient():
    _, members, snaps = run(lambda ps: torch.optim.SGD(ps, lr=0.1), steps=3)
    for snap in snaps:
        o = snap["optim"]
        assert o["cos_update_grad"] == pytest.approx([1.0] * 6, abs=1e-6)
        assert o["groups"]["cos_update_grad"] == pytest.approx([1.0] * len(members), abs=1e-6)
        assert o["step_ratio"] == pytest.approx([0.1] * 6, rel=1e-4)
        assert o["groups"]["step_ratio"] == pytest.approx([0.1] * len(members), rel=1e-4)


def leaf_run(grads: list[torch.Tensor], make_opt: Any, every: int = 1) -> list[dict]:
    """A ``{name: leaf tensor}`` run whose gradient at step ``s`` is ``grads[s - 1]`` exactly."""
    w = nn.Parameter(torch.zeros_like(grads[0]))
    opt = make_opt([w])
    insp = inspector.attach({"w": w}, opt, every=every)
    out = []
    try:
        for s, g in enumerate(grads, start=1):
            opt.zero_grad(set_to_none=True)
            (w * g).sum().backward()
            opt.step()
            if (latest := insp.latest()) is not None and latest["step"] == s:
                out.append(latest["optim"])
    finally:
        insp.close()
    return out


@pytest.fixture(params=["whole", "chunked"])
def chunk(request, monkeypatch):
    """The share below eps**2 counted in one comparison, or a chunk of 5 elements at a time."""
    if request.param == "chunked":
        monkeypatch.setattr(optim_state, "CHUNK", 5)


def test_below_eps_share_on_known_tiny_gradients(chunk):
    """At step 1 Adam's bias-corrected second moment is g**2: below eps**2 exactly where |g| < eps.
    1e-7 is above eps = 1e-8 but its raw moment (1 - beta2) g**2 is below eps**2: a share taken
    without the bias correction would be 2/3."""
    g = torch.tensor([1e-12, 1e-7, 1.0] * 4)
    got = leaf_run([g, g], lambda ps: torch.optim.Adam(ps, lr=1e-3, eps=1e-8))
    assert got[0]["below_eps_frac"] == [pytest.approx(1 / 3)]
    assert got[0]["groups"]["below_eps_frac"] == [pytest.approx(1 / 3)]
    # m = (1 - beta1) g, v = (1 - beta2) g**2 after the first step
    assert got[0]["exp_avg_norm"][0] == pytest.approx(0.1 * float(g.double().norm()), rel=1e-6)
    assert got[0]["exp_avg_sq_sqrt_norm"][0] == pytest.approx(
        math.sqrt(0.001) * float(g.double().norm()), rel=1e-6
    )
    tiny = torch.full((8,), 1e-12)
    assert leaf_run([tiny], lambda ps: torch.optim.Adam(ps, eps=1e-8))[0]["below_eps_frac"] == [1.0]


def test_consecutive_sampled_gradients_on_known_pairs():
    a, b, c = torch.tensor([1.0, 0, 0, 0]), torch.tensor([1.0, 1, 0, 0]), torch.tensor([0.0, 0, 1, 0])
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    got = leaf_run([a, b, c], sgd)
    assert [o["cos_grad_prev"][0] for o in got] == [
        None,
        pytest.approx(1 / math.sqrt(2)),
        pytest.approx(0.0, abs=1e-7),
    ]
    assert [o["cos_prev_gap"] for o in got] == [None, 1, 1]
    # sampled every 2nd step (1, 3, 5): the previous *sampled* step's gradient, 2 steps back
    got = leaf_run([a, c, -a, b, b], sgd, every=2)
    assert [o["cos_prev_gap"] for o in got] == [None, 2, 2]
    assert [o["cos_grad_prev"][0] for o in got] == [
        None,
        pytest.approx(-1.0),
        pytest.approx(-1 / math.sqrt(2)),
    ]


def test_a_model_past_the_memory_floor_is_sampled_and_estimated():
    """Past the update ratio's memory bound the update and gradients are sampled (every s-th block):
    plain SGD still gives 1 on any sample; consecutive gradients are estimated closely."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(512, 1024), nn.Tanh(), nn.Linear(1024, 10))
    assert sum(p.numel() * 4 for p in net.parameters()) > 2 * FLOOR
    x = torch.randn(64, 512)
    y = torch.randn(64, 10)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    insp = inspector.attach(net, opt, every=1)
    grads = []
    try:
        for _ in range(2):
            opt.zero_grad()
            nn.functional.mse_loss(net(x + 0.1 * torch.randn_like(x)), y).backward()
            grads.append([p.grad.detach().double().flatten().clone() for p in net.parameters()])
            opt.step()
        o = insp.latest()["optim"]
        held = insp._stats.optim.resident_bytes  # noqa: SLF001
        kept = insp._stats.update.resident_bytes  # noqa: SLF001
    finally:
        insp.close()
    assert 0 < held <= kept <= max(FLOOR, 0.1 * sum(p.numel() * 4 for p in net.parameters()))
    assert o["cos_update_grad"] == pytest.approx([1.0] * 4, abs=1e-5)
    want = [_cos(a, b) for a, b in zip(grads[1], grads[0], strict=True)]
    assert o["cos_grad_prev"] == pytest.approx(want, abs=0.03)


def test_many_small_tensors_take_the_flat_path(monkeypatch):
    """At least 32 small CPU tensors kept whole: the flat passes (the Adam state's too), the same values."""
    from inspector.stats.tensor_stats import FlatPlan

    flat_adam = []
    real = FlatPlan.adam_state

    def spy(self, *args):  # noqa: ANN001
        flat_adam.append(1)
        return real(self, *args)

    monkeypatch.setattr(FlatPlan, "adam_state", spy)
    torch.manual_seed(1)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(10, 10), nn.Tanh()) for _ in range(20)], nn.Linear(10, 1))
    trace, members, snaps = run(OPTIMIZERS["adamw"], steps=3, net=net)
    assert len(trace.params) >= 32
    assert len(flat_adam) == 3, "each sampled step's Adam state took the flat passes"
    for k, snap in enumerate(snaps):
        got, want = snap["optim"], reference(trace, k, members)
        for key in (*GEO, *ADAM):
            close(got[key], want[key], 1e-5, 1e-6, f"step {k + 1} {key}")
            close(got["groups"][key], want["groups"][key], 1e-5, 1e-6, f"step {k + 1} group {key}")


def test_stacks_of_larger_tensors_take_the_flat_passes_too(monkeypatch):
    """A deep model's repeated blocks (tensors of 2,304 elements, one shape: stacked), a larger
    tensor of its own shape and 30-odd small ones: the Adam state in flat passes, the same values
    as plain torch's, with an ``eps`` large enough that a share of each ``v`` is below it."""
    from inspector.stats.tensor_stats import FlatPlan

    flat_adam = []
    real = FlatPlan.adam_state

    def spy(self, *args):  # noqa: ANN001
        flat_adam.append(bool(self.large) and not self.cheap_norms)
        return real(self, *args)

    monkeypatch.setattr(FlatPlan, "adam_state", spy)
    torch.manual_seed(2)
    net = nn.Sequential(
        nn.Linear(10, 48),
        *[nn.Sequential(nn.Linear(48, 48), nn.Tanh()) for _ in range(30)],
        nn.Linear(48, 64),  # (3,072 elements, a shape of its own: outside every stack)
        nn.Linear(64, 1),
    )
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-3, eps=1e-4, weight_decay=0.1)  # noqa: E731
    trace, members, snaps = run(adamw, steps=3, net=net)
    assert flat_adam == [True] * 3, "each sampled step's Adam state took the flat passes, stacks and all"
    shares = [x for snap in snaps for x in snap["optim"]["below_eps_frac"]]
    assert any(0 < x < 1 for x in shares), "some tensors with part of v below eps**2: counts tested"
    for k, snap in enumerate(snaps):
        got, want = snap["optim"], reference(trace, k, members)
        for key in (*GEO, *ADAM):
            close(got[key], want[key], 1e-5, 1e-6, f"step {k + 1} {key}")
            close(got["groups"][key], want["groups"][key], 1e-5, 1e-6, f"step {k + 1} group {key}")


@pytest.mark.parametrize("sampled", [False, True])
def test_stacked_samples_read_as_each_tensors_own(monkeypatch, sampled):
    """The list path's stacks (parameters of one shape: their gradients' samples taken a part at
    a time, their previous samples rows of one buffer) give what each tensor's own sample gives,
    kept whole or block-sampled past the update ratio's budget (``sampled``)."""
    from inspector.stats import update_ratio

    side, many = (256, 48) if sampled else (48, 12)

    def net() -> nn.Module:
        torch.manual_seed(3)
        return nn.Sequential(
            nn.Linear(10, side),
            *[nn.Sequential(nn.Linear(side, side), nn.Tanh()) for _ in range(many)],
            nn.Linear(side, 1),
        )

    sgd = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731
    taken = []
    real = optim_state.stacked_samples

    def spy(ts, s, scratch):  # noqa: ANN001, ANN202
        taken.append((len(ts), s))
        return real(ts, s, scratch)

    monkeypatch.setattr(optim_state, "stacked_samples", spy)
    _, _, stacked = run(sgd, steps=3, net=net())
    # each step: the weights (many) and the biases (many + 1) stacked; past the budget the
    # weights are block-sampled, the small biases kept whole
    assert taken == [(many + 1, 1), (many, 11 if sampled else 1)] * 3, taken
    monkeypatch.setattr(optim_state, "stack_groups", lambda ps, st: [])
    monkeypatch.setattr(update_ratio, "stack_groups", lambda ps, st: [])
    _, _, alone = run(sgd, steps=3, net=net())
    for a, b in zip(stacked, alone, strict=True):
        for key in GEO:
            close(a["optim"][key], b["optim"][key], 1e-5, 1e-7, f"step {a['step']} {key}")
        close(a["update_ratio"], b["update_ratio"], 1e-5, 1e-9, f"step {a['step']} update_ratio")
    assert all(x is not None for x in stacked[-1]["optim"]["cos_grad_prev"])


def test_a_model_cast_mid_run_compares_no_gradient_with_a_sample_of_before():
    """The stacks are made again when the parameters change dtype (``model.double()``): the first
    sampled step after it has no previous sample to compare with (None, not a cosine with an
    empty buffer), the next one compares again."""
    torch.manual_seed(4)
    net = nn.Sequential(nn.Linear(10, 48), *[nn.Sequential(nn.Linear(48, 48), nn.Tanh()) for _ in range(12)])
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    got = []
    with inspector.attach(net, opt, every=1) as insp:
        for s in range(1, 5):
            if s == 3:
                net.double()
            x = batch(seed=s)[0].to(next(net.parameters()).dtype)
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
            got.append(insp.latest()["optim"]["cos_grad_prev"])
    stacked = range(2, 2 + 2 * 12, 2)  # the 12 weights of 48 x 48
    assert all(got[1][i] is not None for i in stacked)
    assert all(got[2][i] is None for i in stacked), got[2]
    assert all(got[3][i] is not None and -1 <= got[3][i] <= 1 for i in stacked)


def test_a_mark_step_loop_has_consecutive_gradients_only():
    """Without an optimizer the update comes after the boundary (``mark_step()`` before it): no
    update to measure, as for the update ratio; the gradients are compared."""
    torch.manual_seed(0)
    w = torch.randn(6, requires_grad=True)
    insp = inspector.attach({"w": w}, every=1)
    grads = []
    try:
        for _ in range(2):
            (w * w * w).sum().backward()
            grads.append(w.grad.detach().double().clone())
            insp.mark_step()
            with torch.no_grad():
                w -= 0.1 * w.grad
            w.grad = None
        o = insp.latest()["optim"]
    finally:
        insp.close()
    assert o["kind"] == "other" and o["exp_avg_norm"] == [None]
    assert o["cos_update_grad"] == [None] and o["step_ratio"] == [None]
    assert (
        o["cos_grad_prev"] == [pytest.approx(_cos(grads[1], grads[0]), abs=1e-6)] and o["cos_prev_gap"] == 1
    )


def test_a_failure_turns_the_instrument_off_and_is_reported(monkeypatch):
    def broken(self, *args):  # noqa: ANN001, ANN002
        raise RuntimeError("boom")

    monkeypatch.setattr(optim_state.OptimProbe, "_add_adam", broken)
    net = model()
    opt = torch.optim.Adam(net.parameters())
    insp = inspector.attach(net, opt, every=1)
    try:
        for s in range(1, 4):
            opt.zero_grad()
            x, y = batch(seed=s)
            loss_of(net, x, y).backward()
            opt.step()
        snaps = insp.snapshots()
        errors = [e for e in insp.events() if e["kind"] == "telemetry_error"]
    finally:
        insp.close()
    assert [s["step"] for s in snaps] == [1, 2, 3], "training and the snapshots go on"
    assert all(s["optim"] is None for s in snaps) and snaps[2]["grad_norm"][0] is not None
    assert len(errors) == 1 and "optimizer state" in errors[0]["message"] and "boom" in errors[0]["message"]


@pytest.mark.parametrize("chunk_size", [None, 40])
def test_batched_dots_and_counts_equal_the_one_at_a_time_ones(monkeypatch, chunk_size):
    """`dots` and `counts_below` (stacked, a batch of at most CHUNK elements) against `_dot` and
    `_count_below` pair by pair, on a mix: shapes that batch together, one alone, float64,
    bfloat16 and complex pairs, a tensor past CHUNK, and a threshold that is a tensor; the values
    come back in the order given."""
    if chunk_size is not None:
        monkeypatch.setattr(optim_state, "CHUNK", chunk_size)
    gen = torch.Generator().manual_seed(0)

    def r(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    a = [r(4, 3), r(4, 3), r(7), r(4, 3), r(4, 3, dtype=torch.float64), r(4, 3, dtype=torch.float64)]
    a += [r(5, dtype=torch.bfloat16), r(3, dtype=torch.complex64), r(60), r(4, 3)[:, 1]]
    b = [r(*x.shape, dtype=x.dtype) for x in a]
    got = optim_state.dots(a, b)
    assert len(got) == len(a) and all(g.dim() == 0 for g in got)
    for x, y, g in zip(a, b, got, strict=True):
        assert float(g) == pytest.approx(float(optim_state._dot(x, y)), rel=1e-5, abs=1e-6)  # noqa: SLF001
    vs = [r(4, 3).abs() for _ in range(3)] + [r(60).abs(), r(7, dtype=torch.float64).abs(), r(4, 3).abs()]
    thresholds: list[Any] = [0.5, 0.5, 1.0, 0.5, 0.5, torch.tensor(0.7)]
    counts = optim_state.counts_below(vs, thresholds)
    assert [int(c) for c in counts] == [int((v < t).sum()) for v, t in zip(vs, thresholds, strict=True)]


def test_a_half_precision_second_moment_is_compared_in_float32():
    """eps**2 times the bias correction (about 1e-19) rounds to 0 in float16: compared in the
    state's own dtype, not even v = 0 would be below it (before: 0 counted on the per-tensor and
    batched paths, all of them on the flat one)."""
    v = torch.zeros(16, dtype=torch.float16)
    assert int(optim_state._count_below(v, 1e-19)) == 16  # noqa: SLF001
    assert [int(c) for c in optim_state.counts_below([v, v.clone()], [1e-19, 1e-19])] == [16, 16]
    assert [int(c) for c in optim_state.counts_below([v.bfloat16(), v.bfloat16()], [1e-19, 1e-19])] == [
        16,
        16,
    ]


# gradual unfreezing: which units (the input layer, each block, the head) train at each sampled step
UNFREEZING = [
    "all",
    "head",
    "head",
    "all",  # back after two sampled steps away: the previous sampled step had none of them
    "head,b-1",
    "head,b-1,b-2",
    "all",
]


def _unfreezing_net(width: int, blocks: int) -> nn.Sequential:
    torch.manual_seed(5)
    return nn.Sequential(
        nn.Linear(10, width),
        *[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(blocks)],
        nn.Linear(width, 1),
    )


@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize("path", ["flat", "stacked", "per-tensor"])
def test_gradual_unfreezing_compares_each_tensor_with_the_previous_sampled_step(monkeypatch, path, every):
    """Layers frozen, then unfrozen over sampled steps: a tensor's ``cos_grad_prev`` compares its
    gradient with its gradient on the previous sampled step where it had one there, else None;
    the groups' and the model's come from the tensors that have both. Against float64 cosines of
    the gradients this test kept, on each of the probe's paths: the flat one (many small CPU
    tensors kept whole), the stacks (CPU tensors of one shape) and one tensor at a time."""
    from inspector.stats import update_ratio

    width, blocks = (8, 16) if path == "flat" else (16, 6)
    net = _unfreezing_net(width, blocks)
    units = {"in": [net[0]], "head": [net[-1]], **{f"b-{k}": [net[-1 - k][0]] for k in range(1, blocks + 1)}}
    taken: dict[str, list[bool]] = {"flat": [], "stacked": []}
    real_flat, real_stacked = optim_state.OptimProbe._flat_before, optim_state.stacked_samples  # noqa: SLF001

    def flat_spy(self, *args):  # noqa: ANN001, ANN002, ANN202
        taken["flat"].append(got := real_flat(self, *args))
        return got

    def stacked_spy(*args):  # noqa: ANN002, ANN202
        taken["stacked"].append(True)
        return real_stacked(*args)

    monkeypatch.setattr(optim_state.OptimProbe, "_flat_before", flat_spy)
    monkeypatch.setattr(optim_state, "stacked_samples", stacked_spy)
    if path == "per-tensor":
        monkeypatch.setattr(optim_state, "stack_groups", lambda ps, st: [])
        monkeypatch.setattr(update_ratio, "stack_groups", lambda ps, st: [])
    params = list(net.parameters())
    opt = torch.optim.SGD(params, lr=0.01)
    kept: dict[int, dict[int, torch.Tensor]] = {}  # step -> tensor -> its final gradient
    insp = inspector.attach(net, opt, every=every)
    step = [0]
    opt.register_step_pre_hook(
        lambda *_: kept.__setitem__(
            step[0],
            {
                i: p.grad.detach().double().flatten().clone()
                for i, p in enumerate(params)
                if p.grad is not None
            },
        )
    )
    snaps = []
    try:
        for s in range(1, every * (len(UNFREEZING) - 1) + 2):
            plan = UNFREEZING[(s - 1) // every]
            on = set(units) if plan == "all" else set(plan.split(","))
            for name, mods in units.items():
                for m in mods:
                    m.requires_grad_(name in on)
            step[0] = s
            opt.zero_grad(set_to_none=True)
            x, y = batch(seed=s)
            loss_of(net, x, y).backward()
            opt.step()
            if (latest := insp.latest()) is not None and latest["step"] == s:
                snaps.append(latest)
        members = insp.groups["members"]
        errors = [e for e in insp.events() if e["kind"] == "telemetry_error"]
    finally:
        insp.close()
    assert not errors, errors
    assert [s["step"] for s in snaps] == list(range(1, every * (len(UNFREEZING) - 1) + 2, every))
    if path == "flat":
        assert taken["flat"] and all(taken["flat"]), "the flat path"
    else:
        assert not taken["flat"] and bool(taken["stacked"]) == (path == "stacked"), taken
    n = len(params)
    for k, snap in enumerate(snaps):
        o, now = snap["optim"], kept[snap["step"]]
        before = kept[snaps[k - 1]["step"]] if k else {}
        both = [i for i in range(n) if i in now and i in before]
        want = [_cos(now[i], before[i]) if i in both else None for i in range(n)]
        close(o["cos_grad_prev"], want, 1e-5, 1e-6, f"step {snap['step']} cos_grad_prev")

        groups = [
            _cos(torch.cat([now[i] for i in q]), torch.cat([before[i] for i in q])) if q else None
            for q in ([i for i in m if i in both] for m in members)
        ]
        close(o["groups"]["cos_grad_prev"], groups, 1e-5, 1e-6, f"step {snap['step']} groups")
        model_want = (
            _cos(torch.cat([now[i] for i in both]), torch.cat([before[i] for i in both])) if both else None
        )
        close([o["model"]["cos_grad_prev"]], [model_want], 1e-5, 1e-6, f"step {snap['step']} model")
        assert o["cos_prev_gap"] == (every if k else None)
    assert snaps[3]["optim"]["cos_grad_prev"][-1] is not None, "the head, on both steps, has its cosine"


@pytest.mark.parametrize("path", ["whole", "flat"])
def test_lbfgs_measures_the_step_against_the_first_evaluations_gradient(path):
    """LBFGS evaluates its closure several times a step; ``g`` is the first evaluation's gradient
    (at the point the step starts from) for ``step_ratio`` and the cosines alike, against float64
    references of ``||delta theta|| / ||g_0||``, ``cos(delta theta, -g_0)`` and ``cos(g_0, g_0 prev)``."""
    net = (
        model() if path == "whole" else nn.Sequential(*[nn.Linear(6, 6) for _ in range(17)], nn.Linear(6, 1))
    )
    torch.manual_seed(0)
    params = list(net.parameters())
    opt = torch.optim.LBFGS(params, lr=0.5, max_iter=4, history_size=4)
    insp = inspector.attach(net, opt, every=1)
    firsts, befores, afters, evaluations, snaps = [], [], [], [], []
    try:
        for s in range(1, 4):
            x, y = batch(seed=s)
            x = x[:, : params[0].shape[1]]
            grads: list[list[torch.Tensor]] = []

            def closure(x=x, y=y, grads=grads) -> torch.Tensor:  # noqa: ANN001
                opt.zero_grad(set_to_none=True)
                loss = loss_of(net, x, y)
                loss.backward()
                grads.append([p.grad.detach().double().flatten().clone() for p in params])
                return loss

            befores.append([p.detach().double().flatten().clone() for p in params])
            opt.step(closure)
            afters.append([p.detach().double().flatten().clone() for p in params])
            firsts.append(grads[0])
            evaluations.append(len(grads))
            snaps.append(insp.latest())
        members = insp.groups["members"]
        if path == "flat":
            assert insp._stats.optim._prev_flat is not None, "the flat path"  # noqa: SLF001
        errors = [e for e in insp.events() if e["kind"] == "telemetry_error"]
    finally:
        insp.close()
    assert not errors, errors
    assert [s["step"] for s in snaps] == [1, 2, 3] and min(evaluations) > 1
    n = len(params)
    for k, snap in enumerate(snaps):
        o, g = snap["optim"], firsts[k]
        d = [afters[k][i] - befores[k][i] for i in range(n)]
        want = {
            "step_ratio": [float(d[i].norm() / g[i].norm()) for i in range(n)],
            "cos_update_grad": [_cos(d[i], -g[i]) for i in range(n)],
            "cos_grad_prev": [_cos(g[i], firsts[k - 1][i]) if k else None for i in range(n)],
        }
        for key, values in want.items():
            close(o[key], values, 1e-5, 1e-6, f"step {k + 1} {key}")
        for name, ms in (("groups", members), ("model", [list(range(n))])):
            cat = [(torch.cat([d[i] for i in m]), torch.cat([g[i] for i in m])) for m in ms]
            got = o["groups"] if name == "groups" else {key: [v] for key, v in o["model"].items()}
            close(
                got["step_ratio"], [float(a.norm() / b.norm()) for a, b in cat], 1e-5, 1e-6, f"{name} ratio"
            )
            close(got["cos_update_grad"], [_cos(a, -b) for a, b in cat], 1e-5, 1e-6, f"{name} cos")
