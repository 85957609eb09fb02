"""``exploding``: a deep tanh MLP whose learning-rate warm-up overshoots until the gradients explode."""

from __future__ import annotations

import torch
from torch import nn

from .base import WarmupSGD

__all__ = ["Exploding"]


class Exploding(WarmupSGD):
    """An 8-layer tanh MLP (16 -> 64 x 8 -> 1) on a smooth regression task, SGD, lr warm-up to 0.3.

    The learning rate rises linearly from 0.003 to ``peak_lr`` = 0.3 over the first
    ``warmup_steps`` = 100 steps (it is set on ``optimizer.param_groups`` before every step, so
    the dashboard's ``lr`` shows it). Up to about lr 0.1 the loss falls; past that, plain SGD
    on this deep network is unstable: each update makes the next gradient larger, the
    global gradient norm climbs from about 5 to 1e8 within about ten steps and the loss
    becomes inf, then NaN (seeds 0-9: at steps 48 to 101). Clipping the global gradient norm to 1.0
    before every optimizer step bounds each update to ``lr`` in parameter space, and the same
    run keeps training at lr 0.3 (loss about 0.05-0.3 at step 600, from about 1-4 at the start).

    Weights are drawn from N(0, (gain / sqrt(fan_in))^2) with gain 1.2, biases zero. The
    targets are ``tanh(x @ W1) @ w2`` for a fixed random teacher plus N(0, 0.05^2) noise.
    Parameters: ``0.weight``, ``0.bias``, ``2.weight``, ... ``16.weight``, ``16.bias``.
    """

    name = "exploding"
    description = (
        "An 8-layer tanh MLP trained with SGD while its learning rate warms up to 0.3: past about "
        "lr 0.1 each update makes the next gradient larger, and within ~50-100 steps the loss is NaN."
    )
    try_this = (
        "Add clip_norm (global, max_norm 1.0) on * before step ~40 and watch the raw total norm stay "
        "around 2-3 while the final norm is held at 1.0 and the loss keeps falling instead of going to NaN; "
        "or add zclip on * at the start, with no threshold to choose: after its 25-step warm-up it clips "
        "each spike against the norm's own running statistics and the run stays finite, though the "
        "norm it holds (about 5-10) is still too large a step at lr 0.3 for the loss to keep falling."
    )

    hint_step = 40  # "before step ~40"
    in_features = 16
    width = 64
    depth = 8
    gain = 1.2
    batch_size = 64
    peak_lr = 0.3
    warmup_steps = 100
    teacher_width = 16
    noise_std = 0.05

    def build_model(self) -> nn.Module:
        layers: list[nn.Module] = []
        fan_in = self.in_features
        for _ in range(self.depth):
            layers += [nn.Linear(fan_in, self.width), nn.Tanh()]
            fan_in = self.width
        layers.append(nn.Linear(fan_in, 1))
        return nn.Sequential(*layers)

    def init_parameters(self, model: nn.Module) -> None:
        for m in model.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, self.gain / m.in_features**0.5)
                nn.init.zeros_(m.bias)

    def setup_data(self, gen: torch.Generator) -> None:
        self._w1 = torch.randn(self.in_features, self.teacher_width, generator=gen) / self.in_features**0.5
        self._w2 = torch.randn(self.teacher_width, 1, generator=gen) / 2.0

    def next_batch(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(self.batch_size, self.in_features, generator=gen)
        noise = torch.randn(self.batch_size, 1, generator=gen) * self.noise_std
        return x, torch.tanh(x @ self._w1) @ self._w2 + noise

    def compute_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.model(x), y)
