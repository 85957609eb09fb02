"""Shared tiny models for the unit tests: real torch on CPU, no mocks."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn


def seed_mlp(seed: int = 0) -> nn.Sequential:
    """The source material's model: Linear(10, 10), ReLU, Linear(10, 1)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 1))


def batch(seed: int = 1, n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 10, generator=g), torch.randn(n, 1, generator=g)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def reference_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """Gradients of a deep copy of ``model`` on one batch, with no inspector attached."""
    ref = copy.deepcopy(model)
    loss_of(ref, x, y).backward()
    return [p.grad.detach().clone() for p in ref.parameters()]


def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss = loss_of(model, x, y)
    loss.backward()
    opt.step()
    return loss


class GradCapture:
    """Captures the gradients the optimizer is about to use (a step pre-hook registered after ours)."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.grads: list[torch.Tensor | None] = []
        self.handle = opt.register_step_pre_hook(self._hook)
        self.opt = opt

    def _hook(self, opt, args, kwargs):  # noqa: ANN001
        self.grads = [
            p.grad.detach().clone() if p.grad is not None else None
            for g in opt.param_groups
            for p in g["params"]
        ]


@pytest.fixture
def mlp() -> nn.Sequential:
    return seed_mlp()
