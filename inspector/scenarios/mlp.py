"""``mlp``: the seed example's model, trained on a regression problem that it can actually learn."""

from __future__ import annotations

import torch
from torch import nn

from .base import ReluTeacher

__all__ = ["MLP"]


class MLP(ReluTeacher):
    """``nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 1))``, MSE loss, SGD lr 0.01.

    The model, loss, optimizer and batch size (32) are those of the seed example. Its data
    were ``torch.randn`` inputs and targets, which leaves nothing to learn; here the targets
    come from a fixed random teacher of the same shape plus N(0, 0.1^2) noise, so the loss
    falls (slowly: plain SGD at lr 0.01) towards the noise floor of 0.01.
    Parameters: ``0.weight``, ``0.bias``, ``2.weight``, ``2.bias``.
    """

    name = "mlp"
    description = (
        "The seed example: Linear(10, 10) -> ReLU -> Linear(10, 1) trained with SGD (lr 0.01) "
        "on batches of 32 to imitate a fixed random teacher; nothing goes wrong, it is the baseline."
    )
    try_this = (
        "Add noise (std 3.0) on * and watch the loss climb back up while it is on "
        "(SGD follows the noise), then disable it and watch the loss fall again."
    )

    in_features = 10
    hidden = 10
    batch_size = 32
    lr = 0.01
    noise_std = 0.1

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(self.in_features, self.hidden), nn.ReLU(), nn.Linear(self.hidden, 1))

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=self.lr)
