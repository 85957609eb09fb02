"""The ``deep`` scenario: a Llama-shaped model of 993 tensors in which only ``layers.71`` goes wrong,
and goes wrong relative to its own history (the robust z-score that the worst-now list ranks by),
not only in raw magnitude; the scale hook of its hint rescues it."""

from __future__ import annotations

import math

import pytest
import torch

import inspector
from inspector.scenarios import make
from inspector.scenarios.deep import BAD_LAYER, Deep, Llama

KINDS = [
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
]
BAD = [f"layers.{BAD_LAYER}.self_attn.{p}_proj.weight" for p in "qkv"]


def robust_z(history: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """Per tensor: (log10 current - median) / (1.4826 * MAD), over ``history`` (steps x tensors) in
    log10, the MAD floored at 0.02 decades: the worst-now list's score."""
    logs = torch.log10(history)
    med = logs.median(0).values
    mad = (logs - med).abs().median(0).values.clamp_min(0.02)
    return (torch.log10(current) - med) / (1.4826 * mad)


def grad_norms(sc: Deep) -> torch.Tensor:
    return torch.stack(torch._foreach_norm([p.grad for p in sc.model.parameters()]))


def test_shape_names_and_one_step():
    sc = make("deep")
    assert isinstance(sc, Deep) and isinstance(sc.model, Llama)
    assert isinstance(sc.optimizer, torch.optim.SGD)
    names = [n for n, _ in sc.model.named_parameters()]
    assert len(names) == 993 == 9 * 110 + 3
    assert sum(p.numel() for p in sc.model.parameters()) == 286_160
    assert names[0] == "embed_tokens.weight" and names[-2:] == ["norm.weight", "lm_head.weight"]
    assert names[1:-2] == [f"layers.{i}.{k}" for i in range(110) for k in KINDS]
    loss = sc.step()
    assert abs(float(loss) - math.log(32)) < 0.5  # an untrained model: about uniform over 32 tokens
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in sc.model.parameters())


def test_same_seed_same_run_and_the_global_rng_is_left_alone():
    state = torch.get_rng_state()
    a, b, c = make("deep", seed=3), make("deep", seed=3), make("deep", seed=4)
    la, lb, lc = ([float(sc.step()) for _ in range(3)] for sc in (a, b, c))
    assert torch.equal(torch.get_rng_state(), state)
    assert la == lb and la != lc
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True))


def test_data_state_replays_the_same_batches():
    sc = make("deep", seed=1)
    sc.step()
    saved = sc.data_state()
    first = sc.next_batch(sc._data_gen)
    sc.set_data_state(saved)
    again = sc.next_batch(sc._data_gen)
    assert all(torch.equal(x, y) for x, y in zip(first, again, strict=True))
    x, y = first
    assert x.shape == y.shape == (8, 16) and torch.equal(x[:, 1:], y[:, :-1])


def test_only_layers_71_qkv_stand_out_from_their_own_history():
    """Before step 60 nothing is special; from it the three penalised gradients climb about 3x a
    step, far outside their own history, while every other tensor stays within its usual noise."""
    sc = make("deep", seed=0)
    names = [n for n, _ in sc.model.named_parameters()]
    bad = [names.index(n) for n in BAD]
    others = [i for i, n in enumerate(names) if not n.startswith(f"layers.{BAD_LAYER}.")]
    norms = []
    for _ in range(64):
        loss = sc.step()
        norms.append(grad_norms(sc))
    assert bool(torch.isfinite(loss))
    h = torch.stack(norms)  # (64 steps, 993 tensors)

    quiet = robust_z(h[26:58], h[58])  # step 59, the last one without the penalty
    assert quiet[bad].abs().max() < 10

    z = robust_z(h[31:63], h[63])  # step 64 against steps 32-63
    assert z[bad].min() > 15, z[bad]
    assert z[others].abs().max() < 10
    top3 = {names[i] for i in z.abs().argsort(descending=True)[:3].tolist()}
    assert top3 == set(BAD)
    assert h[63, bad].min() > 30 * h[:58, bad].max()  # in raw magnitude too


@pytest.mark.slow
def test_the_hints_scale_hook_rescues_it():
    sc = make("deep", seed=0)
    names = [n for n, _ in sc.model.named_parameters()]
    bad = [names.index(n) for n in BAD]
    with inspector.attach(sc.model, sc.optimizer) as insp:
        insp.add_hook("scale", target=f"layers.{BAD_LAYER}.*", factor=0.25)
        losses = [float(sc.step()) for _ in range(70)]
    assert all(math.isfinite(v) for v in losses)
    assert max(losses[-10:]) < 2.5  # without the hook: about 100 by now
    assert grad_norms(sc)[bad].max() < 0.05  # settled again (without the hook: about 50)


def test_the_demo_checkpoints_deep_so_a_rewind_to_before_step_60_is_there_at_step_66():
    """The demo attaches with the scenario's ``checkpoint_every`` and ``checkpoints`` (server/cli.py):
    at step 66, where the hint's trouble shows, the newest checkpoint before step 60 is step 50's,
    and a rewind to it gives back the weights of step 50, bitwise."""
    sc = make("deep", seed=0)
    insp = inspector.attach(
        sc.model, sc.optimizer, checkpoint_every=sc.checkpoint_every, checkpoints=sc.checkpoints
    )
    try:
        for _ in range(50):
            sc.step()
        at_50 = {k: v.clone() for k, v in sc.model.state_dict().items()}
        for _ in range(16):
            sc.step()
        kept = insp.checkpoints.list()
        assert [c["step"] for c in kept] == [10, 20, 30, 40, 50, 60]
        before = max((c for c in kept if c["step"] < 60), key=lambda c: c["step"])
        assert insp.rewind(before["id"])["done"] and insp.step == 50
        now = sc.model.state_dict()
        assert all(torch.equal(now[k], at_50[k]) for k in at_50)
    finally:
        insp.close()
