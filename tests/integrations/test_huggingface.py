"""GradientInspectorCallback under a real transformers Trainer, on a tiny random GPT-2 on CPU.

The model is built from a config (nothing downloaded). With gradient accumulation the Trainer
hands ``num_items_in_batch`` to GPT-2, whose loss is then each micro-batch's share of the step's:
the recorded loss must still be the step's, as the Trainer itself logs it.
"""

from __future__ import annotations

import threading

import pytest
import torch

from tests.integrations.conftest import need

transformers = need("transformers")
need("accelerate")

from inspector.integrations.huggingface import GradientInspectorCallback, without_effect  # noqa: E402

pytestmark = [pytest.mark.slow]

CLIP = 0.05  # far below this model's gradient norm, so clipping always acts
STEPS = 8


def tiny_gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


class PlainLM(torch.nn.Module):
    """Not a transformers model: no ``**kwargs`` in forward, so the Trainer passes no
    ``num_items_in_batch``, divides the loss by the accumulation steps itself, and the step's
    loss is the mean of its micro-batches'."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(64, 16)
        self.head = torch.nn.Linear(16, 64)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(self.embed(input_ids))  # (B, T, vocab)
        return {
            "loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()),
            "logits": logits,
        }


MODELS = {"gpt2": tiny_gpt2, "plain": PlainLM}


def dataset(n: int = 64) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (n, 16), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def arguments(tmp_path, **args) -> transformers.TrainingArguments:
    """The tests' TrainingArguments (on the CPU, nothing saved or reported); `args` override them."""
    return transformers.TrainingArguments(
        **{
            "output_dir": str(tmp_path / "out"),
            "max_steps": STEPS,
            "per_device_train_batch_size": 4,
            "learning_rate": 1e-3,
            "logging_steps": 1,
            "save_strategy": "no",
            "report_to": [],
            "use_cpu": True,
            "disable_tqdm": True,
            "seed": 0,
            "dataloader_num_workers": 0,
            **args,
        }
    )


def train(tmp_path, callbacks, model: str = "gpt2", **args) -> transformers.Trainer:
    trainer = transformers.Trainer(
        model=MODELS[model](), args=arguments(tmp_path, **args), train_dataset=dataset(), callbacks=callbacks
    )
    trainer.train()
    return trainer


def logged_losses(trainer) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_trainer_clips_before_the_inspector_sees_the_gradients_and_the_loss_is_the_trainers(tmp_path, model):
    seen = {}
    cb = GradientInspectorCallback(every=1, on_attach=lambda insp: seen.setdefault("insp", insp))
    trainer = train(tmp_path, [cb], model, max_grad_norm=CLIP, gradient_accumulation_steps=2)
    insp = seen["insp"]

    assert cb.inspector is None, "closed at the end of train()"
    assert insp.params == [n for n, _ in trainer.model.named_parameters()]
    snaps = insp.snapshots()
    assert [s["step"] for s in snaps] == list(range(1, STEPS + 1))
    logged = logged_losses(trainer)
    for s in snaps:
        # the Trainer clipped before optimizer.step(), so before our pre_step work: "raw" is clipped
        assert s["total_norm_raw"] <= CLIP * (1 + 1e-4), s["total_norm_raw"]
        # the step's loss as the Trainer logs it: gpt2, the sum of its micro-batches' shares; plain, their mean
        assert s["loss"] == pytest.approx(logged[s["step"]], rel=1e-3, abs=1e-4), s["step"]


def test_without_the_trainers_clipping_the_inspector_clips_and_a_hook_added_mid_training_lands(tmp_path):
    added = threading.Event()
    state: dict = {}

    def on_attach(insp):
        state["insp"] = insp

        def watch(kind, payload):  # the hub's thread: "another thread", as the dashboard's server
            if kind == "snapshot" and payload["step"] == 3 and not added.is_set():
                state["hook"] = insp.add_hook("clip_value", target="*", threshold=1e-4).id
                added.set()

        insp.subscribe(watch)

    class Gate(transformers.TrainerCallback):
        """Training waits before step 4 for the other thread's edit: no race with a fast loop."""

        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001
            if state.global_step == 3:
                assert added.wait(60), "the subscriber never added the hook"

    preset = [{"kind": "clip_norm", "target": "*", "params": {"max_norm": CLIP}}]
    cb = GradientInspectorCallback(every=1, hooks=preset, on_attach=on_attach)
    trainer = train(tmp_path, [cb, Gate()], max_grad_norm=0)
    insp = state["insp"]

    spec = next(h for h in insp.hooks() if h["id"] == state["hook"])
    applied = spec["applied_step"]
    assert applied is not None and 4 <= applied <= STEPS - 2, spec
    snaps = {s["step"]: s for s in insp.snapshots()}
    assert sorted(snaps) == list(range(1, STEPS + 1))
    logged = logged_losses(trainer)
    for step, s in snaps.items():
        assert s["loss"] == pytest.approx(logged[step], rel=1e-3, abs=1e-4)
        assert s["total_norm_raw"] > CLIP, "nothing clipped before us: raw is the real gradient"
        if step < applied:  # only our clip_norm
            assert s["total_norm"] == pytest.approx(CLIP, rel=1e-4)
        else:  # then clip_value 1e-4 on every element as well
            assert max(v for v in s["grad_absmax"] if v is not None) <= 1e-4 * (1 + 1e-5)
            assert max(v for v in s["grad_absmax_raw"] if v is not None) > 1e-4


class NumberedLM(torch.nn.Module):
    """PlainLM that notes each training forward's sample numbers (`index`) in `forwards`."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(64, 16)
        self.head = torch.nn.Linear(16, 64)
        self.forwards: list[list[int]] = []

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, index: torch.Tensor) -> dict:
        if self.training:
            self.forwards.append(index.tolist())
        logits = self.head(self.embed(input_ids))
        return {"loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def test_a_rewind_with_skip_drops_the_window_and_the_rest_count_in_order(tmp_path):
    """Accumulation 2, batches of 2: a checkpoint after step 3 (micro-batches 0-5), a rewind after
    step 6 with skip=9: micro-batches 6-14 are the window; 6-11 were received (the Trainer's
    loader goes on), 12-14 are drawn by the Trainer and have no effect: the new branch's step 4
    (12, 13) makes no update, its step 5 keeps 15 alone. The weights equal plain SGD on what was kept, each micro-batch's
    loss divided by 2 as the Trainer divides it."""
    state: dict = {}

    class Rewinder(transformers.TrainerCallback):
        def on_step_end(self, args, st, control, **kwargs):  # noqa: ANN001
            insp = state["insp"]
            if st.global_step == 3:
                state["cp"] = insp.checkpoint()
            elif st.global_step == 6:
                assert insp.rewind(state["cp"], skip=9)["done"]

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (64, 8), generator=g)
    data = [{"input_ids": row, "labels": row, "index": torch.tensor(k)} for k, row in enumerate(ids)]
    model = NumberedLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    cb = GradientInspectorCallback(every=1, on_attach=lambda insp: state.setdefault("insp", insp))
    trainer = transformers.Trainer(
        model=model,
        args=arguments(
            tmp_path,
            max_steps=14,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            max_grad_norm=0,
        ),
        train_dataset=data,
        callbacks=[cb, Rewinder()],
        optimizers=(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)),
    )
    trainer.train()
    insp = state["insp"]

    micro = model.forwards  # every micro-batch the Trainer drew, in order
    assert len(micro) == 28
    pos = insp.data_position
    assert pos["position"] == 28 and pos["dropped"] == 3
    (window,) = pos["windows"]
    assert (window["first"], window["last"], window["received"], window["ahead"]) == (6, 14, 6, 3)
    skipped = [e for e in insp.events() if e["kind"] == "step_skipped"]
    assert [(e["step"], e["reason"]) for e in skipped] == [(4, "batches_skipped")], (
        "the whole-dropped step only"
    )
    snaps = insp.snapshots()
    assert [s["step"] for s in snaps] == list(range(1, 12))
    assert [s["step"] for s in snaps if s["loss"] is None] == [4], "a dropped batch's loss is not recorded"

    ref = NumberedLM()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    kept = [*range(6), *range(15, 28)]
    steps = [[m for m in (2 * s, 2 * s + 1) if m in kept] for s in range(14)]
    for k, step in enumerate(steps):
        if not step or 6 <= 2 * k <= 11:  # no update / the abandoned branch's steps
            continue
        ref_opt.zero_grad()
        for m in step:
            rows = torch.tensor(micro[m])
            out = ref(ids[rows], ids[rows], rows)
            (out["loss"] / 2).backward()
        ref_opt.step()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_dropped_batch_gives_every_parameter_an_exact_zero_even_a_nan_batch():
    model = tiny_gpt2()
    ids = torch.randint(0, 64, (2, 8))
    model.train()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    real = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    emb = model.transformer.wte
    with torch.no_grad():  # a batch that blows up: every activation NaN
        saved = emb.weight[ids[0, 0]].clone()
        emb.weight[ids[0, 0]] = float("nan")
    out = model(input_ids=ids, labels=ids)
    with torch.no_grad():
        emb.weight[ids[0, 0]] = saved
    assert torch.isnan(out.loss)
    out = without_effect(model, out)
    assert type(out).__name__ == "CausalLMOutputWithCrossAttentions" and out.loss == out["loss"]
    out.loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.equal(p.grad, torch.zeros_like(p.grad)), n
    assert any(g.abs().sum() > 0 for g in real.values()), "(the real batch's gradient is not zero)"
