"""The built-in scenarios: each one trains, fails the way it says, and is rescued the way it says.

Plain torch first (a step pre-hook is exactly "between backward and optimizer.step()"), then
the same rescues through the inspector's own hooks.
"""

from __future__ import annotations

import math

import pytest
import torch

import inspector
from inspector.scenarios import SCENARIOS, Scenario, make
from inspector.scenarios.deep import Deep
from inspector.scenarios.exploding import Exploding
from inspector.scenarios.mlp import MLP
from inspector.scenarios.nan import NaNBatch
from inspector.scenarios.tiny_gpt import GPT, TinyGPT, load_corpus

CHEAP = ["mlp", "exploding", "nan"]  # a step in about a millisecond; tiny_gpt takes about a second


def run(sc: Scenario, steps: int) -> list[float]:
    """``steps`` steps; the losses, read back once at the end."""
    return torch.stack([sc.step() for _ in range(steps)]).tolist()


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def all_finite(sc: Scenario) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in sc.model.parameters())


def clip_before_step(sc: Scenario, max_norm: float = 1.0) -> None:
    """Plain torch's rescue: clip_grad_norm_ between backward and optimizer.step()."""

    def hook(opt: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        torch.nn.utils.clip_grad_norm_(sc.model.parameters(), max_norm)

    sc.optimizer.register_step_pre_hook(hook)


def guard_before_step(sc: Scenario, action: str) -> None:
    """Plain torch's NaN guard: on non-finite gradients skip the step or zero those gradients."""

    def hook(opt: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        params = list(sc.model.parameters())
        bad = [p for p in params if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
        for p in params if (bad and action == "skip") else bad:
            if action == "skip":
                p.grad = None
            else:
                p.grad.zero_()

    sc.optimizer.register_step_pre_hook(hook)


# ---------------------------------------------------------------------------- the registry


def test_registry_lists_the_scenarios_with_their_texts():
    classes = {"mlp": MLP, "exploding": Exploding, "nan": NaNBatch, "tiny_gpt": TinyGPT, "deep": Deep}
    assert list(SCENARIOS) == list(classes)
    for name, cls in classes.items():
        assert cls.name == name and SCENARIOS[name] == cls.description
        for text in (cls.description, cls.try_this):
            assert text.endswith(".") and ". " not in text, (name, text)  # one sentence each
        assert cls.try_this.startswith("Add ")


def test_make_rejects_an_unknown_name_and_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown scenario 'nope'.*mlp, exploding, nan, tiny_gpt, deep"):
        make("nope")


@pytest.mark.parametrize("name", CHEAP)
def test_step_runs_one_full_training_step(name):
    sc = make(name)
    before = [p.detach().clone() for p in sc.model.parameters()]
    loss = sc.step()
    assert sc.steps_done == 1 and sc.step_under_way == 2
    assert loss.dim() == 0 and not loss.requires_grad and bool(torch.isfinite(loss))
    after = list(sc.model.parameters())
    assert any(not torch.equal(b, a) for b, a in zip(before, after, strict=True)), (
        "optimizer.step() moved nothing"
    )
    assert all(p.grad is not None for p in sc.model.parameters())


# ---------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("name", CHEAP)
def test_same_seed_same_losses_and_the_global_rng_is_left_alone(name):
    state = torch.get_rng_state()
    a, b, c = make(name, seed=3), make(name, seed=3), make(name, seed=4)
    la, lb, lc = run(a, 20), run(b, 20), run(c, 20)
    assert torch.equal(torch.get_rng_state(), state)
    assert la == lb
    assert la != lc
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_tiny_gpt_data_stream_is_deterministic():
    a, b, c = make("tiny_gpt", seed=1), make("tiny_gpt", seed=1), make("tiny_gpt", seed=2)
    xa, ya = a.next_batch(a._data_gen)
    xb, yb = b.next_batch(b._data_gen)
    xc, _ = c.next_batch(c._data_gen)
    assert torch.equal(xa, xb) and torch.equal(ya, yb) and not torch.equal(xa, xc)
    assert xa.shape == ya.shape == (16, 128) and xa.dtype == torch.long
    assert torch.equal(xa[:, 1:], ya[:, :-1])  # targets are the inputs shifted by one byte


# ---------------------------------------------------------------------------- reset


@pytest.mark.parametrize("name", CHEAP)
def test_reset_restores_the_start_in_place(name):
    sc = make(name, seed=5)
    model, opt = sc.model, sc.optimizer
    tensors = list(sc.model.parameters())
    first = run(sc, 10)
    run(sc, 190)  # exploding and nan are non-finite by now
    sc.reset()
    assert sc.model is model and sc.optimizer is opt and sc.steps_done == 0
    assert all(p is q for p, q in zip(sc.model.parameters(), tensors, strict=True))
    assert not sc.optimizer.state and all(p.grad is None for p in tensors)
    assert all_finite(sc)
    fresh = make(name, seed=5)
    for p, q in zip(sc.model.parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert run(sc, 10) == first  # the data stream starts over too


# ---------------------------------------------------------------------------- mlp


def test_mlp_is_the_seed_model_and_learns():
    sc = make("mlp")
    assert [n for n, _ in sc.model.named_parameters()] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert [type(m).__name__ for m in sc.model] == ["Linear", "ReLU", "Linear"]
    assert isinstance(sc.optimizer, torch.optim.SGD) and sc.optimizer.param_groups[0]["lr"] == 0.01
    losses = run(sc, 500)
    assert mean(losses[-50:]) < 0.5 * mean(losses[:10])


# ---------------------------------------------------------------------------- exploding


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exploding_diverges_without_a_hook(seed):
    sc = make("exploding", seed=seed)
    losses = run(sc, 150)
    assert not all(math.isfinite(v) for v in losses)
    assert not all_finite(sc)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exploding_trains_with_clip_grad_norm(seed):
    sc = make("exploding", seed=seed)
    clip_before_step(sc, 1.0)
    losses = run(sc, 300)
    assert all(math.isfinite(v) for v in losses) and all_finite(sc)
    assert mean(losses[-30:]) < 0.5 * mean(losses[:10])


def test_exploding_warms_its_learning_rate_up():
    sc = make("exploding")
    sc.step()
    assert sc.optimizer.param_groups[0]["lr"] == pytest.approx(0.003)
    run(sc, 119)
    assert sc.optimizer.param_groups[0]["lr"] == pytest.approx(0.3)


# ---------------------------------------------------------------------------- nan


def test_nan_bad_steps():
    assert [s for s in range(1, 400) if NaNBatch.is_bad_step(s)] == [30, 130, 230, 330]


def test_nan_ruins_every_weight_without_a_guard():
    sc = make("nan")
    losses = run(sc, 40)
    assert all(math.isfinite(v) for v in losses[:29])
    assert math.isnan(losses[29])  # step 30
    assert all(bool(torch.isnan(p).all()) for p in sc.model.parameters())


@pytest.mark.parametrize("action", ["skip", "zero"])
def test_nan_trains_on_when_the_bad_step_is_guarded(action):
    sc = make("nan")
    guard_before_step(sc, action)
    losses = run(sc, 150)
    bad = [i + 1 for i, v in enumerate(losses) if not math.isfinite(v)]
    assert bad == [30, 130]  # the bad steps' own losses, and nothing else
    assert all_finite(sc)
    assert mean(losses[-20:]) < 0.5 * mean(losses[20:29])


# ---------------------------------------------------------------------------- tiny_gpt


def test_tiny_gpt_shape_and_one_step():
    sc = make("tiny_gpt")
    assert isinstance(sc.model, GPT) and isinstance(sc.optimizer, torch.optim.AdamW)
    named = list(sc.model.named_parameters())
    assert len(named) == 53
    assert sum(p.numel() for _, p in named) == 3_323_392
    assert [n for n, _ in named][:3] == ["tok_emb.weight", "pos_emb.weight", "blocks.0.ln1.weight"]
    assert named[-1][0] == "head.weight"
    loss = sc.step()
    assert abs(float(loss) - math.log(256)) < 0.5  # an untrained byte model: about uniform
    sc.reset()
    assert not sc.optimizer.state and sc.steps_done == 0
    fresh = make("tiny_gpt")
    assert all(
        torch.equal(p, q) for p, q in zip(sc.model.parameters(), fresh.model.parameters(), strict=True)
    )


def test_tiny_gpt_corpus_ships_as_package_data():
    data = load_corpus()
    assert data.dtype == torch.uint8 and 50_000 <= data.numel() <= 200_000
    text = bytes(data.tolist()).decode("ascii")  # plain ASCII English
    assert text.startswith("# tiny_corpus.txt")


# ---------------------------------------------------------------------------- through the inspector


@pytest.mark.parametrize("seed", [0, 1])
def test_inspector_clip_norm_rescues_exploding(seed):
    sc = make("exploding", seed=seed)
    with inspector.attach(sc.model, sc.optimizer) as insp:
        insp.add_hook("clip_norm", target="*", max_norm=1.0)
        losses = run(sc, 300)
        assert insp.step == 300
        snap = insp.latest()
    assert all(math.isfinite(v) for v in losses) and all_finite(sc)
    assert mean(losses[-30:]) < 0.5 * mean(losses[:10])
    assert snap is not None and snap["total_norm"] == pytest.approx(1.0, rel=1e-3)
    assert snap["total_norm_raw"] > 1.0


def test_inspector_hooks_survive_reset():
    sc = make("exploding")
    with inspector.attach(sc.model, sc.optimizer) as insp:
        insp.add_hook("clip_norm", target="*", max_norm=1.0)
        run(sc, 50)
        sc.reset()
        losses = run(sc, 300)
    assert all(math.isfinite(v) for v in losses) and all_finite(sc)


@pytest.mark.parametrize("action", ["skip", "zero"])
def test_inspector_nan_guard_rescues_nan(action):
    sc = make("nan")
    with inspector.attach(sc.model, sc.optimizer) as insp:
        insp.add_hook("nan_guard", target="*", action=action)
        losses = run(sc, 150)
        events = insp.events()
    assert [i + 1 for i, v in enumerate(losses) if not math.isfinite(v)] == [30, 130]
    assert all_finite(sc)
    assert mean(losses[-20:]) < 0.5 * mean(losses[20:29])
    nonfinite = [e for e in events if e["kind"] == "nonfinite"]
    assert [e["step"] for e in nonfinite] == [30, 130]
    assert all(e["action_taken"] == action for e in nonfinite)
    skipped = [e["step"] for e in events if e["kind"] == "step_skipped"]
    assert skipped == ([30, 130] if action == "skip" else [])


def test_inspector_nan_guard_report_only_names_the_damage():
    sc = make("nan")
    with inspector.attach(sc.model, sc.optimizer) as insp:
        insp.add_hook("nan_guard", target="*")  # action "report"
        run(sc, 31)
        events = [e for e in insp.events() if e["kind"] == "nonfinite"]
    assert events and events[0]["step"] == 30 and events[0]["action_taken"] == "report"
    assert events[0]["param"] in [n for n, _ in sc.model.named_parameters()]
    assert not all_finite(sc)


# ---------------------------------------------------------------------------- gradient accumulation


class AccumulatingMLP(MLP):
    micro_batches = 4  # 4 micro-batches of 8


def test_micro_batches_give_the_whole_batch_step():
    """K micro-batches of a batch, each loss divided by K: the same data stream, the same step
    as one backward on the whole batch (up to rounding), and the mean of the K losses."""
    whole, acc = MLP(seed=2), AccumulatingMLP(seed=2)
    backwards = []
    acc.model[0].weight.register_hook(lambda g: backwards.append(acc.steps_done))
    for _ in range(20):
        lw, la = whole.step(), acc.step()
        assert float(la) == pytest.approx(float(lw), rel=1e-5)
        for p, q in zip(whole.model.parameters(), acc.model.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-7)
    assert backwards == [s for s in range(20) for _ in range(4)]  # 4 backward passes per step
    assert torch.equal(whole._data_gen.get_state(), acc._data_gen.get_state())  # the same batches drawn


def test_tiny_gpt_accumulates_four_micro_batches_of_four():
    """The demo that gives the noise-scale card its two batch sizes: 4 backward passes of 4
    windows per step, whose summed gradient is the whole batch's."""
    assert TinyGPT.micro_batches == 4 and TinyGPT.batch_size % TinyGPT.micro_batches == 0
    sc = make("tiny_gpt")
    gen = torch.Generator()
    gen.set_state(sc._data_gen.get_state())
    idx, targets = sc.next_batch(gen)  # the batch the step will draw
    sizes = []
    handle = sc.model.register_forward_pre_hook(lambda m, args: sizes.append(args[0].shape[0]))
    grads = {}
    for n, p in sc.model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: grads.__setitem__(n, p.grad.detach().clone()))
    sc.step()
    handle.remove()
    assert sizes == [4, 4, 4, 4]
    fresh = make("tiny_gpt")
    fresh.compute_loss(idx, targets).backward()
    for n, p in fresh.model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6)


def test_the_inspector_sees_the_micro_batches_as_the_noise_scale_small_batch():
    sc = AccumulatingMLP(seed=0)
    with inspector.attach(sc.model, sc.optimizer) as insp:
        for _ in range(30):
            insp.record(loss=sc.step())
        ns = insp.latest()["noise_scale"]
    assert ns["mode"] == "accumulation" and ns["k"] == 4 and ns["reason"] is None
    assert (ns["b_small"], ns["b_big"], ns["batch_source"]) == (8, 32, "inferred")
    assert ns["samples"] >= 1 and ns["trace_sigma"] is not None and ns["g_sq"] is not None
