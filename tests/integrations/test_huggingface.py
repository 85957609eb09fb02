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

from inspector.integrations.huggingface import GradientInspectorCallback  # noqa: E402

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


def train(tmp_path, callbacks, model: str = "gpt2", **args) -> transformers.Trainer:
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
        **args,
    )
    trainer = transformers.Trainer(
        model=MODELS[model](), args=arguments, train_dataset=dataset(), callbacks=callbacks
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
