"""GradientInspectorCallback under a real Lightning Trainer, on a tiny CPU regressor.

The regressor's targets are large, so its gradients are far above the clip thresholds used
here: clipping visibly matters. Its ``training_step`` calls ``self.net(x)``, never the
LightningModule's own forward, as many Lightning modules do.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest
import torch
from torch import nn

from tests.integrations.conftest import need

pl = need("lightning.pytorch")

from inspector.integrations.lightning import GradientInspectorCallback  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    # Lightning's advice for real jobs (more dataloader workers, a logger...), not about us
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*(GPU|TPU|HPU) available:UserWarning"),
    # Lightning 2.6 on torch 2.13: torch deprecated the pytree LeafSpec that Lightning still builds
    pytest.mark.filterwarnings("ignore:.*LeafSpec.* is deprecated:FutureWarning"),
]

CLIP = 0.5
STEPS = 8


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.losses: list[float] = []  # every training_step's loss, in order

    def training_step(self, batch, batch_idx):  # noqa: ANN001
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(256, 8, generator=g)
        y = 20.0 * x.sum(dim=1, keepdim=True)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def fit(tmp_path, model: pl.LightningModule | None = None, max_steps: int = STEPS, **trainer_kwargs):
    """Train `model` (a new Regressor by default) on the CPU for `max_steps`; returns the model."""
    model = Regressor() if model is None else model
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
        **trainer_kwargs,
    )
    trainer.fit(model)
    return model


def test_lightning_clips_before_the_inspector_sees_the_gradients_and_the_loss_is_recorded(tmp_path):
    seen = {}
    cb = GradientInspectorCallback(every=1, on_attach=lambda insp: seen.setdefault("insp", insp))
    model = fit(tmp_path, callbacks=[cb], gradient_clip_val=CLIP, accumulate_grad_batches=2)
    insp = seen["insp"]

    assert cb.inspector is None, "closed at the end of fit"
    assert insp.params == ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]
    snaps = insp.snapshots()
    assert [s["step"] for s in snaps] == list(range(1, STEPS + 1))
    for s in snaps:
        # Lightning's clip ran inside the closure, before our pre_step work: "raw" is already clipped
        assert s["total_norm_raw"] <= CLIP * (1 + 1e-4), s["total_norm_raw"]
        assert s["total_norm"] == pytest.approx(s["total_norm_raw"])
        # the loss of the step: the mean of its two micro-batches, un-normalised
        first, second = model.losses[2 * s["step"] - 2 : 2 * s["step"]]
        assert s["loss"] == pytest.approx((first + second) / 2, rel=1e-5), s["step"]


def test_without_lightnings_clipping_the_inspector_clips_and_a_hook_added_mid_training_lands(tmp_path):
    added = threading.Event()
    state: dict = {}

    def on_attach(insp):
        state["insp"] = insp

        def watch(kind, payload):  # the hub's thread: "another thread", as the dashboard's server
            if kind == "snapshot" and payload["step"] == 3 and not added.is_set():
                state["hook"] = insp.add_hook("clip_value", target="*", threshold=1e-4).id
                added.set()

        insp.subscribe(watch)

    class Gate(pl.Callback):
        """Training waits at the 4th batch for the other thread's edit: no race with a fast loop."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001
            if batch_idx == 3:
                assert added.wait(60), "the subscriber never added the hook"

    preset = [{"kind": "clip_norm", "target": "*", "params": {"max_norm": CLIP}}]
    cb = GradientInspectorCallback(every=1, hooks=preset, on_attach=on_attach)
    model = fit(tmp_path, callbacks=[cb, Gate()], gradient_clip_val=None)
    insp = state["insp"]

    spec = next(h for h in insp.hooks() if h["id"] == state["hook"])
    applied = spec["applied_step"]
    assert applied is not None and 4 <= applied <= STEPS - 2, spec
    snaps = {s["step"]: s for s in insp.snapshots()}
    assert sorted(snaps) == list(range(1, STEPS + 1))
    for step, s in snaps.items():
        assert s["loss"] == pytest.approx(model.losses[step - 1], rel=1e-5)
        assert s["total_norm_raw"] > CLIP, "nothing clipped before us: raw is the real gradient"
        if step < applied:  # only our clip_norm
            assert s["total_norm"] == pytest.approx(CLIP, rel=1e-4)
        else:  # then clip_value 1e-4 on every element as well
            assert max(s["grad_absmax"]) <= 1e-4 * (1 + 1e-5)
            assert max(s["grad_absmax_raw"]) > 1e-4


def test_serve_keeps_the_dashboard_up_after_fit_until_closed(tmp_path):
    cb = GradientInspectorCallback(serve=True, port=0, db=False, every=1)
    fit(tmp_path, callbacks=[cb])
    try:
        assert cb.inspector is not None and cb.url is not None, "serving: not closed at the end of fit"
        base = cb.url.split("?")[0].rstrip("/")
        with urllib.request.urlopen(f"{base}/api/health", timeout=30) as r:
            assert json.load(r) == {"status": "ok"}
        with urllib.request.urlopen(f"{base}/api/snapshots", timeout=30) as r:
            assert [s["step"] for s in json.load(r)["snapshots"]] == list(range(1, STEPS + 1))
    finally:
        cb.close()
    assert cb.inspector is None
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{base}/api/health", timeout=5)


def test_an_unknown_option_is_refused_when_the_callback_is_made():
    with pytest.raises(TypeError, match="unknown option 'evry'"):
        GradientInspectorCallback(evry=1)


class Numbered(pl.LightningModule):
    """Batch k of the data is sample k: `seen` lists the batches its training_step ran on."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)
        self.seen: list[int] = []

    def training_step(self, batch, batch_idx):  # noqa: ANN001
        x, y, k = batch
        self.seen.append(int(k))
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    @staticmethod
    def data() -> torch.utils.data.TensorDataset:
        g = torch.Generator().manual_seed(2)
        x = torch.randn(40, 4, generator=g)
        return torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True), torch.arange(40))

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data(), batch_size=1)


@pytest.mark.filterwarnings("ignore:`training_step` returned `None`:UserWarning")  # (the skip itself)
def test_a_rewind_with_skip_drops_the_window_and_the_rest_come_in_order(tmp_path):
    """Checkpoint after batch 4, rewind after batch 9 with skip=8: batches 5-12 are the window;
    5-9 were received (a trainer's loader goes on: never again), 10-12 are drawn by the trainer and
    dropped (training_step never runs on them, their steps make no update), 13 on come in order.
    The weights equal plain SGD on batches 0-4 then 13-29."""
    state: dict = {}

    class Rewinder(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
            insp = state["insp"]
            if trainer.global_step == 5:
                state["cp"] = insp.checkpoint()
            elif trainer.global_step == 10:
                assert insp.rewind(state["cp"], skip=8)["done"]

    cb = GradientInspectorCallback(every=1, on_attach=lambda insp: state.setdefault("insp", insp))
    model = fit(tmp_path, Numbered(), max_steps=30, callbacks=[cb, Rewinder()])
    insp = state["insp"]

    assert model.seen == list(range(10)) + list(range(13, 30)), "the window's batches are not trained on"
    pos = insp.data_position
    assert pos["position"] == 30 and pos["dropped"] == 3
    (window,) = pos["windows"]
    assert (window["first"], window["last"], window["received"], window["ahead"]) == (5, 12, 5, 3)
    skipped = [e for e in insp.events() if e["kind"] == "step_skipped"]
    assert [(e["step"], e["reason"]) for e in skipped] == [(s, "batches_skipped") for s in (6, 7, 8)]
    assert "training_step" not in model.__dict__, "the module's own training_step is back"

    ref = Numbered()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    data = Numbered.data()
    for k in [*range(5), *range(13, 30)]:
        x, y, _ = data[k : k + 1]
        opt.zero_grad()
        nn.functional.mse_loss(ref.net(x), y).backward()
        opt.step()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)
