"""Built-in training scenarios for the demo, the tests and the benchmarks (pure torch).

Each scenario is a small model, its optimizer and a deterministic data stream; see
:class:`~inspector.scenarios.base.Scenario` for what one offers::

    from inspector.scenarios import SCENARIOS, make
    sc = make("nan", seed=0)
    loss = sc.step()            # one full training step; the detached loss tensor

=============  ==============================================================================
``mlp``        the seed example's Linear-ReLU-Linear, SGD; the baseline where nothing goes wrong
``exploding``  a deep tanh MLP whose lr warm-up makes the gradients explode; clip_norm rescues it
``nan``        one batch with an inf record at step 30 (and every 100 after); nan_guard rescues it
``tiny_gpt``   a 4-layer byte-level GPT (3.3M parameters, 53 tensors) on a shipped text file
``deep``       a 110-block Llama-shaped model (993 tensors) where layers.71 goes unstable at step 60
=============  ==============================================================================
"""

from __future__ import annotations

import torch

from .base import Scenario
from .deep import Deep
from .exploding import Exploding
from .mlp import MLP
from .nan import NaNBatch
from .tiny_gpt import TinyGPT

__all__ = ["SCENARIOS", "Scenario", "make"]

_CLASSES: dict[str, type[Scenario]] = {cls.name: cls for cls in (MLP, Exploding, NaNBatch, TinyGPT, Deep)}

SCENARIOS: dict[str, str] = {name: cls.description for name, cls in _CLASSES.items()}
"""Scenario name -> its one-sentence description, in the order the CLI lists them."""


def make(name: str, *, seed: int = 0, device: torch.device | str | None = None) -> Scenario:
    """A new scenario ``name`` (a key of :data:`SCENARIOS`), seeded with ``seed``, on ``device``.

    Raises:
        ValueError: ``name`` is not a known scenario (the message lists the known ones).
    """
    try:
        cls = _CLASSES[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; expected one of: {', '.join(_CLASSES)}") from None
    return cls(seed=seed, device=device)
