"""``nan``: a small regression MLP fed one corrupted batch at step 30 and every 100 steps after."""

from __future__ import annotations

import torch
from torch import nn

from .base import ReluTeacher

__all__ = ["NaNBatch"]


class NaNBatch(ReluTeacher):
    """A 3-layer ReLU MLP (8 -> 32 -> 32 -> 1), MSE loss, SGD lr 0.02 with momentum 0.9.

    The ``bad_step``-th batch drawn (30, counting the first as 1: the batch of step 30) and
    every ``bad_every``-th (100) after it (130, 230, ...) holds one corrupted record: its
    features are all ``inf``. The forward pass turns that row into NaN (inf times weights of
    both signs), so the loss and every parameter's gradient are NaN on that step. Without a
    guard the optimizer writes NaN into every weight and the model is lost for good; with the
    step skipped (every gradient set to None, so SGD leaves all parameters and momentum
    buffers alone) or the non-finite gradients zeroed (momentum carries the update), the bad
    step's own loss is NaN but training carries on and the loss keeps falling.

    The data stream is the same with and without the corruption: the bad batch is drawn like
    any other and then one row is overwritten. Targets come from a fixed random teacher of
    the same shape plus N(0, 0.1^2) noise.
    Parameters: ``0.weight``, ``0.bias``, ``2.weight``, ``2.bias``, ``4.weight``, ``4.bias``.
    """

    name = "nan"
    description = (
        "A small ReLU MLP whose batch at step 30 (and every 100 steps after) holds one record of inf "
        "features: the loss and every gradient turn NaN, and one SGD step ruins every weight for good."
    )
    try_this = (
        'Add nan_guard with action "skip" (or "zero") on * before step 30 and watch the bad step '
        'appear as an event while the loss carries on falling; with the default "report" it only names the damage.'
    )

    bad_step = 30
    hint_step = bad_step
    # a checkpoint every 8 steps (24 is the newest before the bad batch); not 10, whose step 30
    # would read the bad step's NaN/Inf check at its own boundary (a checkpoint step waits for it)
    checkpoint_every = 8
    bad_every = 100
    in_features = 8
    hidden = 32
    batch_size = 32
    lr = 0.02
    momentum = 0.9
    noise_std = 0.1

    @classmethod
    def is_bad_step(cls, n: int) -> bool:
        """Whether the (1-based) ``n``-th batch drawn is a corrupted one: 30, 130, 230, ... It is the
        batch of step ``n`` unless a rewind skipped batches (the stream is then ahead of the steps)."""
        return n >= cls.bad_step and (n - cls.bad_step) % cls.bad_every == 0

    def build_model(self) -> nn.Module:
        h = self.hidden
        return nn.Sequential(
            nn.Linear(self.in_features, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 1)
        )

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=self.lr, momentum=self.momentum)

    def next_batch(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = super().next_batch(gen)
        if self.is_bad_step(self.batches_drawn + 1):
            x[0] = float("inf")  # the corrupted record; its target stays finite
        return x, y
