"""The gradient noise scale (inspector/stats/noise_scale.py) against ground truth.

The truth: a frozen model (lr 0, so the true gradient G and the per-example covariance Sigma stay
fixed) on a fixed dataset; every example's gradient by ``torch.func`` (``vmap(grad)``), in float64:
``|G|^2``, ``tr(Sigma)`` (the population covariance's trace) and ``B_simple = tr(Sigma) / |G|^2``,
for the whole model and for each group. The inspector, fed random mini-batches (with replacement,
so a batch of B has covariance exactly Sigma / B), must land within 20 % of it: here through
gradient accumulation (one process), in tests/distributed/test_noise_scale_dist.py through DDP.
"""

from __future__ import annotations

import copy
import fnmatch
import pickle
from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import inspector
from inspector.wire.errors import AttachError

N, D = 4096, 8


def problem(noise: float = 0.5, seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    x = torch.randn(N, D)
    y = torch.tanh(x @ torch.randn(D, 1)) + noise * torch.randn(N, 1)
    model = nn.Sequential(nn.Linear(D, 16), nn.Tanh(), nn.Linear(16, 1))
    return model, x, y


def truth(model: nn.Module, x: torch.Tensor, y: torch.Tensor, members: list[list[int]]) -> dict:
    """Per-example gradients of the mean-squared-error loss, in float64: the true B_simple, trace
    and |G|^2 of the whole model and of each group (``members``: parameter indices)."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss1(p, xi, yi):
        return ((functional_call(model, p, (xi[None],)) - yi[None]) ** 2).mean()

    per = vmap(grad(loss1), in_dims=(None, 0, 0))(params, x, y)
    cols = [v.reshape(len(x), -1).double() for v in per.values()]

    def of(idx: list[int]) -> tuple[float, float, float]:
        flat = torch.cat([cols[i] for i in idx], 1)
        g = flat.mean(0)
        trace = float(((flat - g) ** 2).sum(1).mean())
        g_sq = float(g.square().sum())
        return trace / g_sq, trace, g_sq

    whole = of(list(range(len(cols))))
    return {"whole": whole, "groups": [of(m) for m in members]}


def train(
    model, x, y, *, steps: int, k: int, b: int, seed: int = 1, **attach
) -> tuple[inspector.Inspector, list]:
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    insp = inspector.attach(model, opt, every=1, **attach)
    gen = torch.Generator().manual_seed(seed)
    seen = []
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(k):
            idx = torch.randint(0, len(x), (b,), generator=gen)
            (((model(x[idx]) - y[idx]) ** 2).mean() / k).backward()
        opt.step()
        seen.append(insp.latest()["noise_scale"])
    return insp, seen


def close_to(got: float | None, want: float, tol: float = 0.2) -> bool:
    return got is not None and abs(got / want - 1) <= tol


def test_accumulation_estimate_matches_per_example_truth():
    model, x, y = problem()
    insp, seen = train(model, x, y, steps=500, k=4, b=16, noise_ema=0.99)
    try:
        members = insp.groups["members"]
        want = truth(model, x, y, members)
        ns = seen[-1]
        assert ns["mode"] == "accumulation" and ns["k"] == 4
        assert (ns["b_small"], ns["b_big"], ns["batch_source"]) == (16, 64, "inferred")
        assert ns["samples"] == 500
        b_true, tr_true, gsq_true = want["whole"]
        assert close_to(ns["b_simple"], b_true), (ns["b_simple"], b_true)
        assert close_to(ns["trace_sigma"], tr_true), (ns["trace_sigma"], tr_true)
        assert close_to(ns["g_sq"], gsq_true), (ns["g_sq"], gsq_true)
        assert len(ns["groups"]["b_simple"]) == len(members) >= 2
        for g, (bt, _, _) in enumerate(want["groups"]):
            assert close_to(ns["groups"]["b_simple"][g], bt, 0.3), (g, ns["groups"]["b_simple"][g], bt)
    finally:
        insp.close()


def test_the_loss_scaling_does_not_change_b_simple():
    """A loss summed over the micro-batches (no / K) scales both halves by K^2: the same B_simple."""
    m1, x, y = problem()
    m2 = pickle.loads(pickle.dumps(m1))
    insp1, s1 = train(m1, x, y, steps=60, k=3, b=8)
    insp1.close()
    opt = torch.optim.SGD(m2.parameters(), lr=0.0)
    insp2 = inspector.attach(m2, opt, every=1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(60):
        opt.zero_grad()
        for _ in range(3):
            idx = torch.randint(0, len(x), (8,), generator=gen)
            ((m2(x[idx]) - y[idx]) ** 2).mean().backward()
        opt.step()
    s2 = insp2.latest()["noise_scale"]
    insp2.close()
    assert s2["b_simple"] == pytest.approx(s1[-1]["b_simple"], rel=1e-4)
    assert s2["trace_sigma"] == pytest.approx(9 * s1[-1]["trace_sigma"], rel=1e-4)


def test_nulls_before_an_estimate_and_without_a_small_batch():
    model, x, y = problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with inspector.attach(model, opt, every=1) as insp:
        for _ in range(3):  # one backward per step: no small batch
            opt.zero_grad()
            ((model(x[:16]) - y[:16]) ** 2).mean().backward()
            opt.step()
        ns = insp.latest()["noise_scale"]
        assert ns["b_simple"] is None and ns["trace_sigma"] is None and ns["g_sq"] is None
        assert ns["b_small"] is None and ns["samples"] == 0 and ns["k"] == 1
        assert "accumulation" in ns["reason"] and ns["batch_source"] == "inferred"
        assert ns["groups"]["b_simple"] == [None] * len(insp.groups["names"])
        # the first accumulated step after those is seen (only one parameter's hook counted its
        # backward passes); the next one gives an estimate at once (bias-corrected average)
        for step in range(2):
            opt.zero_grad()
            for i in range(2):
                ((model(x[i * 16 : i * 16 + 16]) - y[i * 16 : i * 16 + 16]) ** 2).mean().div(2).backward()
            opt.step()
            ns = insp.latest()["noise_scale"]
            assert ns["samples"] == step and ns["k"] == 2
            if step == 0:
                assert ns["b_simple"] is None and "next sampled step" in ns["reason"]
        assert ns["reason"] is None and ns["b_big"] == 32
        assert ns["trace_sigma"] is not None and ns["g_sq"] is not None


def test_attach_batch_size_and_off():
    model, x, y = problem()
    insp, seen = train(model, x, y, steps=3, k=2, b=5, batch_size=5)
    assert seen[-1]["batch_source"] == "attach" and seen[-1]["b_big"] == 10
    insp.close()
    model, x, y = problem()
    insp, seen = train(model, x, y, steps=2, k=2, b=5, noise_scale=False)
    insp.close()
    assert seen == [None, None]


@pytest.mark.parametrize(
    ("kw", "err", "words"),
    [
        ({"batch_size": 0}, ValueError, "positive integer"),
        ({"batch_size": -3}, ValueError, "positive integer"),
        ({"batch_size": 2.5}, AttachError, "positive integer"),
        ({"batch_size": True}, AttachError, "positive integer"),
        ({"batch_size": "8"}, AttachError, "positive integer"),
        ({"noise_ema": 1.0}, ValueError, "[0, 1)"),
        ({"noise_ema": -0.1}, ValueError, "[0, 1)"),
        ({"noise_ema": "0.9"}, AttachError, "number"),
        ({"noise_scale": 1}, AttachError, "True or False"),
    ],
)
def test_bad_options_are_refused_with_the_reason(kw, err, words):
    model = nn.Linear(2, 1)
    with pytest.raises(err, match=None) as info:
        inspector.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), **kw)
    assert words in str(info.value)
    assert inspector.attached(model) is None


def test_hooks_only_on_sampled_steps_and_none_after_close():
    """The tensor hooks live from a sampled step's first forward to its boundary; close() removes
    the root's pre-hook; a copy of the model carries none of ours."""
    model, x, y = problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    insp = inspector.attach(model, opt, every=3)
    hooked = []
    for s in range(1, 7):
        opt.zero_grad()
        for _ in range(2):
            model(x[:4]).sum().backward()
            hooked.append((s, bool(model[0].weight._backward_hooks)))
        opt.step()
    assert [h for s, h in hooked] == [s % 3 == 1 for s, _ in hooked]
    assert not model[0].weight._backward_hooks  # removed at the boundary
    copy = pickle.loads(pickle.dumps(model))
    assert not copy._forward_pre_hooks
    insp.close()
    assert not model._forward_pre_hooks and not model[0].weight._backward_hooks
    assert "__getstate__" not in model.__dict__
    assert [s["noise_scale"]["samples"] for s in insp.snapshots()] == [1, 2]  # steps 1 and 4


def test_the_history_keeps_it(tmp_path):
    """Stored by the history (its per-group lists packed in float32 with the group aggregates, the
    rest in the snapshot's JSON) and returned by a replay's GET /api/snapshots."""
    import numpy as np
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.history.storage import HistoryStore
    from server.settings import Settings
    from server.sources import ReplaySource

    model, x, y = problem()
    insp, _ = train(model, x, y, steps=4, k=2, b=8)
    snaps = insp.snapshots()
    insp.close()
    path = tmp_path / "h.sqlite"
    store = HistoryStore(path)
    store.start_writer()
    run = store.new_run(params=[{"name": n} for n in insp.params], modules=[""])
    for s in snaps:
        store.add_snapshot(run, s)
    store.close()
    source = ReplaySource(HistoryStore(path, read_only=True))
    with TestClient(create_app(source, Settings(read_only=True)), base_url="http://127.0.0.1") as c:
        r = c.get("/api/snapshots")
        assert r.status_code == 200, r.text
        got = {s["step"]: s["noise_scale"] for s in r.json()["snapshots"]}

    def f32(x):  # noqa: ANN001, ANN202  (a value as float32, printed short, as the history reads it back)
        return (
            float(repr(np.float32(x)).removeprefix("np.float32(").removesuffix(")"))
            if type(x) is float
            else x
        )

    def stored(ns):  # noqa: ANN001, ANN202
        return {**ns, "groups": {k: [f32(x) for x in v] for k, v in ns["groups"].items()}}

    assert all(len(s["noise_scale"]["groups"]) for s in snaps), "(per-group lists to pack)"
    assert got == {s["step"]: stored(s["noise_scale"]) for s in snaps}
    assert got[4]["samples"] == 4 and got[4]["b_simple"] is not None


# ----------------------------------------------------------------------------- what the big batch is
def _one_accumulated_step(
    hook: tuple[str, str, dict[str, Any]] | None = None, user_clip: float | None = None
) -> tuple[dict[str, Any], dict[str, float]]:
    """One step of 4 micro-batches of 8 (float64, every step sampled, no smoothing) with an optional
    ``post_accumulate`` hook (kind, target, params) and the user's own ``clip_grad_norm_`` between
    backward() and step(); its ``noise_scale`` and the reference from the micro-batch gradients of
    the parameters no hook edits: {"trace", "g_sq"} (in float64; the snapshot's sums travel in
    float32, hence a relative 1e-5)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    plain = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    k, b = 4, 8
    xs = [torch.randn(b, 6, dtype=torch.float64) for _ in range(k)]
    with inspector.attach(model, opt, every=1, noise_ema=0.0) as insp:
        if hook is not None:
            insp.add_hook(hook[0], target=hook[1], point="post_accumulate", **hook[2])
        opt.zero_grad()
        for x in xs:
            (model(x).pow(2).sum() / b / k).backward()
        if user_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), user_clip)
        opt.step()
        got = insp.latest()["noise_scale"]
    names = [n for n, _ in plain.named_parameters()]
    kept = [i for i, n in enumerate(names) if hook is None or not fnmatch.fnmatchcase(n, hook[1])]
    per = []
    for x in xs:
        plain.zero_grad()
        (plain(x).pow(2).sum() / b).backward()
        grads = [p.grad for p in plain.parameters()]
        per.append(
            torch.cat([grads[i].flatten() for i in kept]) if kept else torch.zeros(0, dtype=torch.float64)
        )
    small = sum(float(g.pow(2).sum()) for g in per) / k
    big = float((sum(per) / k).pow(2).sum())
    bs, bb = b, k * b
    return got, {"trace": (small - big) / (1 / bs - 1 / bb), "g_sq": (bb * big - bs * small) / (bb - bs)}


@pytest.mark.parametrize(
    "kind, params", [("scale", {"factor": 0.5}), ("l2", {"lam": 0.5}), ("clip_value", {"threshold": 1e-3})]
)
def test_parameters_a_post_accumulate_hook_edits_are_left_out_of_both_batches(kind, params) -> None:
    """The increments and the accumulated gradient of an edited parameter are no longer of one sum:
    it is left out of the estimate, which stays that of the others (a scale of 0.5 gave 6x, an l2 a
    negative trace, before)."""
    got, ref = _one_accumulated_step((kind, "0.*", params))
    assert got["left_out"] == 2
    assert got["trace_sigma"] == pytest.approx(ref["trace"], rel=1e-5)
    assert got["g_sq"] == pytest.approx(ref["g_sq"], rel=1e-5)
    every, _ = _one_accumulated_step((kind, "*", params))
    assert every["b_simple"] is None and "post_accumulate" in every["reason"]


def test_the_users_own_clip_between_backward_and_step_does_not_change_the_big_batch() -> None:
    """The big batch is the gradient as the last backward left it, not what a clip_grad_norm_ of the
    user's own made of it before the step."""
    clipped, ref = _one_accumulated_step(user_clip=1e-3)
    plain, _ = _one_accumulated_step()
    assert clipped["trace_sigma"] == pytest.approx(ref["trace"], rel=1e-5)
    assert clipped["g_sq"] == pytest.approx(ref["g_sq"], rel=1e-5)
    assert clipped["b_simple"] == pytest.approx(plain["b_simple"], rel=1e-5)


# ----------------------------------------------------------------------------- the units under a GradScaler
def _micro_reference(grads_per_micro: list[list[torch.Tensor]], sizes: list[int]) -> dict[str, float]:
    """The step's trace and |G|^2 from each micro-batch's mean gradient (float64) with the loss / K:
    E|g_k|^2 = |G|^2 + tr/b_k, so the mean over k of |g_k|^2 has tr/H (H the sizes' harmonic mean)
    and |mean_k g_k|^2 has tr/(K H)."""
    k = len(sizes)
    per = [torch.cat([g.flatten().double() for g in gs]) for gs in grads_per_micro]
    small = sum(float(g.pow(2).sum()) for g in per) / k
    big = float((sum(per) / k).pow(2).sum())
    bs = k / sum(1 / b for b in sizes)
    bb = k * bs
    return {"trace": (small - big) / (1 / bs - 1 / bb), "g_sq": (bb * big - bs * small) / (bb - bs)}


@pytest.mark.parametrize(("fused", "given"), [(True, False), (True, True), (False, True)])
def test_under_a_grad_scaler_both_batches_are_unscaled(fused: bool, given: bool) -> None:
    """The increments and the big batch are both unscaled: a fused Adam under a GradScaler not
    given as scaler= (it unscales inside its step; its grad_scale divides the increments' sums at
    the step), and the same given, and an unfused one given (its scale at each increment)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    plain = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    k, b = 4, 8
    xs = [torch.randn(b, 6, dtype=torch.float64) for _ in range(k)]
    with inspector.attach(model, opt, every=1, noise_ema=0.0, scaler=scaler if given else None) as insp:
        opt.zero_grad()
        for x in xs:
            scaler.scale(model(x).pow(2).sum() / b / k).backward()
        scaler.step(opt)
        scaler.update()
        got = insp.latest()["noise_scale"]
    grads = []
    for x in xs:
        plain.zero_grad()
        (plain(x).pow(2).sum() / b).backward()
        grads.append([p.grad.clone() for p in plain.parameters()])
    ref = _micro_reference(grads, [b] * k)
    assert got["k"] == k and got["b_small"] == b
    assert got["trace_sigma"] == pytest.approx(ref["trace"], rel=1e-5)
    assert got["g_sq"] == pytest.approx(ref["g_sq"], rel=1e-5)


# ----------------------------------------------------------------------------- counting backward passes
class _Branches(nn.Module):
    """``first`` (the first parameter) is unused, used by every other forward, or both branches run
    in reentrant activation checkpoints (every parameter's gradient in a nested backward, two per
    backward pass)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.first = nn.Linear(6, 2)
        self.body = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
        self.how = how
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "checkpointed":
            from torch.utils.checkpoint import checkpoint

            leaf = x.detach().requires_grad_()  # (a reentrant checkpoint needs an input with a gradient)
            return checkpoint(self.body, leaf, use_reentrant=True) + checkpoint(
                self.first, leaf, use_reentrant=True
            )
        out = self.body(x)
        if self.how == "every other" and self.calls % 2 == 0:
            out = out + self.first(x)
        self.calls += 1
        return out


@pytest.mark.parametrize("how", ["unused", "every other", "checkpointed", "input gradient"])
def test_backward_passes_are_counted_whichever_parameters_each_one_reaches(how: str) -> None:
    """K is the step's backward passes whether the first parameter is unused (it was 0: "needs
    gradient accumulation"), used by every other micro-batch (it was 2 for 4: a negative trace)
    or reached in a checkpoint's nested backward, and a gradient with respect to the input is no
    backward pass of the step; the trace and |G|^2 are the float64 reference's
    from each micro-batch's gradient (zero for a parameter it does not use)."""
    torch.manual_seed(0)
    model = _Branches(how).double()
    plain = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    k, b = 4, 8
    xs = [torch.randn(b, 6, dtype=torch.float64) for _ in range(k)]
    with inspector.attach(model, opt, every=1, noise_ema=0.0) as insp:
        opt.zero_grad()  # one backward: the next sampled step's hooks only count (one parameter's)
        (model(xs[0]).pow(2).sum() / b).backward()
        opt.step()
        assert insp.latest()["noise_scale"]["k"] == 1
        for step in range(2):  # counted, then measured
            before = copy.deepcopy(model.state_dict())
            model.calls = 0
            opt.zero_grad()
            for x in xs:
                if how == "input gradient":  # a backward that reaches no parameter: no micro-batch
                    xr = x.clone().requires_grad_()
                    torch.autograd.grad(model(xr).sum(), xr)
                (model(x).pow(2).sum() / b / k).backward()
            opt.step()
            got = insp.latest()["noise_scale"]
            if step == 0:  # (only counting, a backward from the output counts: at worst one measures)
                assert got["k"] == (2 * k if how == "input gradient" else k), got
            else:
                assert got["k"] == k, got
    plain.load_state_dict(before)  # (the last step's parameters, before its update)
    used = [n for n, _ in plain.named_parameters() if how != "unused" or not n.startswith("first.")]
    grads = []
    for x in xs:
        plain.zero_grad()
        (plain(x).pow(2).sum() / b).backward()
        named = dict(plain.named_parameters())
        grads.append(
            [named[n].grad if named[n].grad is not None else torch.zeros_like(named[n]) for n in used]
        )
    ref = _micro_reference(grads, [b] * k)
    assert got["reason"] is None and got["b_small"] == b and got["b_big"] == k * b
    assert got["trace_sigma"] == pytest.approx(ref["trace"], rel=1e-5)
    assert got["g_sq"] == pytest.approx(ref["g_sq"], rel=1e-5)


def test_a_dict_of_tensors_whose_first_sits_out_the_last_micro_batch() -> None:
    """With no module (a dict of tensors), the big batch is the gradient at the end of the step's
    last backward even where the first tensor is not in it (it was the gradient of three
    micro-batches of four: every other micro-batch uses it)."""
    torch.manual_seed(0)
    w1 = nn.Parameter(torch.randn(2, 6, dtype=torch.float64))
    w2 = nn.Parameter(torch.randn(2, 6, dtype=torch.float64))
    opt = torch.optim.SGD([w1, w2], lr=0.0)
    k, b = 4, 8
    xs = [torch.randn(b, 6, dtype=torch.float64) for _ in range(k)]

    def loss(x: torch.Tensor, i: int) -> torch.Tensor:
        out = x @ w2.T + (x @ w1.T if i % 2 == 0 else 0)
        return out.tanh().pow(2).sum() / b

    with inspector.attach({"first": w1, "body": w2}, opt, every=1, noise_ema=0.0, batch_size=b) as insp:
        for _ in range(2):
            opt.zero_grad()
            for i, x in enumerate(xs):
                (loss(x, i) / k).backward()
            opt.step()
        got, snap = insp.latest()["noise_scale"], insp.latest()
    grads = []
    for i, x in enumerate(xs):
        w1.grad = w2.grad = None
        loss(x, i).backward()
        grads.append([w1.grad if w1.grad is not None else torch.zeros_like(w1), w2.grad])
    ref = _micro_reference(grads, [b] * k)
    big = float(torch.cat([sum(g[j] for g in grads).flatten() / k for j in range(2)]).norm())
    assert got["k"] == k and snap["total_norm_backward"] == pytest.approx(big, rel=1e-6)
    assert got["trace_sigma"] == pytest.approx(ref["trace"], rel=1e-5)
    assert got["g_sq"] == pytest.approx(ref["g_sq"], rel=1e-5)


# ----------------------------------------------------------------------------- uneven micro-batches
def test_uneven_micro_batches_match_the_per_example_truth() -> None:
    """Micro-batches of 8, 8, 8 and 2 examples, each loss its mean / K: each micro-batch gradient
    has E|g_k|^2 = |G|^2 + tr/b_k, so the small batch is the sizes' harmonic mean (4.57), not their
    arithmetic mean (6.5, which put B_simple about 42 % high), and the big one K times it."""
    model, x, y = problem()
    sizes = [8, 8, 8, 2]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    insp = inspector.attach(model, opt, every=1, noise_ema=0.99)
    gen = torch.Generator().manual_seed(1)
    try:
        for _ in range(500):
            opt.zero_grad()
            for b in sizes:
                idx = torch.randint(0, len(x), (b,), generator=gen)
                (((model(x[idx]) - y[idx]) ** 2).mean() / len(sizes)).backward()
            opt.step()
        ns = insp.latest()["noise_scale"]
        b_true, tr_true, gsq_true = truth(model, x, y, insp.groups["members"])["whole"]
    finally:
        insp.close()
    assert close_to(ns["b_simple"], b_true), (ns["b_simple"], b_true)
    assert close_to(ns["trace_sigma"], tr_true), (ns["trace_sigma"], tr_true)
    assert close_to(ns["g_sq"], gsq_true), (ns["g_sq"], gsq_true)
    h = 4 / (3 / 8 + 1 / 2)
    assert ns["sizes"] == sizes and ns["k"] == 4 and ns["samples"] == 500
    assert ns["b_small"] == pytest.approx(h) and ns["b_big"] == pytest.approx(4 * h)


def test_uneven_micro_batches_one_step_against_float64() -> None:
    """One step of micro-batches of 8, 8, 8, 2 (no smoothing): the trace and |G|^2 of each
    micro-batch's float64 gradient with the harmonic mean; sizes that cannot be matched to the
    backward passes (two forwards for each) leave the step out, and `step_reason` says why."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    plain = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sizes = [8, 8, 8, 2]
    k = len(sizes)
    xs = [torch.randn(b, 6, dtype=torch.float64) for b in sizes]
    with inspector.attach(model, opt, every=1, noise_ema=0.0) as insp:
        opt.zero_grad()
        for x in xs:
            (model(x).pow(2).mean() / k).backward()
        opt.step()
        got = insp.latest()["noise_scale"]
        opt.zero_grad()
        for x in xs:  # a second forward of each micro-batch: 8 sizes for 4 backward passes
            ((model(x).pow(2).mean() + model(x).abs().mean()) / k).backward()
        opt.step()
        twice = insp.latest()["noise_scale"]
    grads = []
    for x in xs:
        plain.zero_grad()
        plain(x).pow(2).mean().backward()
        grads.append([p.grad.clone() for p in plain.parameters()])
    ref = _micro_reference(grads, sizes)
    assert got["trace_sigma"] == pytest.approx(ref["trace"], rel=1e-5)
    assert got["g_sq"] == pytest.approx(ref["g_sq"], rel=1e-5)
    assert twice["b_small"] is None and twice["samples"] == 1
    assert "uneven sizes (8, 8, 8, 8, 8, 8, 2, 2)" in twice["step_reason"], twice
    assert "8 forwards for 4 backward passes" in twice["step_reason"]


def test_a_backward_that_raises_leaves_no_stale_wait_for_its_end() -> None:
    """A backward that raises on a sampled step (an out-of-memory error the loop catches and
    retries) never runs the callbacks queued for its end: the step's later backward passes are
    still counted (K was 0: the dead pass stayed pending), and the norm at the backward's end is
    still taken on the steps after it (it was null for the rest of the run), so the big batch is
    the gradient before the loop's own clip."""
    torch.manual_seed(0)
    fail = {"left": 0}

    def flaky(grad: torch.Tensor) -> torch.Tensor:  # on the hidden layer: the head's gradients are in
        if fail["left"]:
            fail["left"] -= 1
            raise RuntimeError("out of memory (simulated)")
        return grad

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.a(x))
            h.register_hook(flaky)
            return self.b(h)

    model = Net().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    k, b = 4, 8
    xs = [torch.randn(b, 6, dtype=torch.float64) for _ in range(k)]

    def step() -> list[float]:
        opt.zero_grad()
        for x in xs:
            try:
                (model(x).pow(2).sum() / b / k).backward()
            except RuntimeError:  # the loop's retry: the step again from zero
                return step()
        pre = [p.grad.detach().clone() for p in model.parameters()]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # the loop's own clip
        opt.step()
        return [torch.linalg.vector_norm(torch.stack([g.norm() for g in pre])).item()]

    with inspector.attach(model, opt, every=1, noise_ema=0.0) as insp:
        for _ in range(3):
            step()
        fail["left"] = 1
        step()
        assert insp.latest()["noise_scale"]["k"] == k
        for _ in range(2):
            (want,) = step()
            snap = insp.latest()
            assert snap["total_norm_backward"] == pytest.approx(want, rel=1e-6)
            assert snap["noise_scale"]["k"] == k
