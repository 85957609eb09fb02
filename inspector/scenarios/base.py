"""The :class:`Scenario` base class: a model, its optimizer and its data, one step at a time; and
:class:`ReluTeacher`, the regression data stream that ``mlp`` and ``nan`` share.

A scenario owns everything one training step needs, so the demo loop (and a test) is just::

    sc = make("exploding", seed=0)
    insp = inspector.attach(sc.model, sc.optimizer)
    for _ in range(200):
        loss = sc.step()        # zero_grad, forward, loss, backward, optimizer.step()
        insp.record(loss=loss)

Determinism: the parameters are initialised under ``torch.random.fork_rng`` seeded with
``seed`` (the caller's global RNG state is left exactly as it was), and the data comes from the
scenario's own ``torch.Generator``, never the global RNG. Two scenarios made with the same name
and seed produce the same losses, step for step, on the same device and thread count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import nn

__all__ = ["ReluTeacher", "Scenario", "WarmupSGD"]


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the body with the CPU global RNG seeded by ``seed``, then restore the caller's state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class Scenario:
    """A small, self-contained training problem that the inspector can watch.

    Subclasses set the class attributes ``name``, ``description`` and ``try_this`` and
    implement :meth:`build_model`, :meth:`build_optimizer`, :meth:`next_batch` and
    :meth:`compute_loss`; they may override :meth:`init_parameters`, :meth:`setup_data` and
    :meth:`before_step`.

    Attributes:
        name: the scenario's name, as given to :func:`inspector.scenarios.make`.
        description: one sentence for the dashboard: what the model is and what goes wrong.
        try_this: one sentence: which hook to add and what to watch.
        model: the ``nn.Module``; built on the CPU, then moved to ``device``.
        optimizer: the ``torch.optim.Optimizer`` over ``model.parameters()``.
        steps_done: completed calls to :meth:`step` since construction or :meth:`reset`.
        micro_batches: a class attribute: backward passes per step (gradient accumulation; 1:
            none). Each batch is drawn whole, as without accumulation, and split along its
            first dimension into that many micro-batches (``torch.tensor_split``; a subclass
            keeps its batch a multiple of it, so they are equal).
        batches_drawn: batches drawn from the data stream since construction or :meth:`reset`
            (equal to ``steps_done`` unless a rewind skipped some: then the stream is ahead).
        batch_source: None (each :meth:`step` draws its batch), or an iterator of batches that
            :meth:`step` takes its batch from instead, e.g. ``insp.batches(sc.stream())`` (the
            demo: so that a rewind can skip batches, inspector/whatif/skip.py).
        checkpoint_every, checkpoints: class attributes the demo attaches with
            (``attach(..., checkpoint_every=, checkpoints=)``): an automatic checkpoint every
            that many steps, the newest that many kept (by default every 10 steps, 6 kept: a
            small model's checkpoint is a few KB), so a hint's "rewind to before step N" finds one.
        hint_step: a class attribute: the step the scenario's ``try_this`` asks the user to act
            before (None: the hint names no step). The demo pauses a few steps before it, saying
            why, until the user resumes (``gradient-inspector demo --no-pause-before-hint``: not).
    """

    name: ClassVar[str]
    description: ClassVar[str]
    try_this: ClassVar[str]
    micro_batches: ClassVar[int] = 1
    checkpoint_every: ClassVar[int | None] = 10
    checkpoints: ClassVar[int] = 6
    hint_step: ClassVar[int | None] = None

    def __init__(self, *, seed: int = 0, device: torch.device | str | None = None) -> None:
        self.seed = seed
        self.device = torch.device("cpu" if device is None else device)
        with seeded(seed):
            model = self.build_model()
            with torch.no_grad():
                self.init_parameters(model)
        # The initial values, kept on the CPU: reset() copies them back in place, so a reset
        # model is bit-identical to a fresh one on any device.
        self._initial_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.model: nn.Module = model.to(self.device)
        self.optimizer: torch.optim.Optimizer = self.build_optimizer(self.model)
        # The data stream is drawn on the CPU from this generator, then moved to `device`.
        self._data_gen = torch.Generator()
        self.steps_done = 0
        self.batches_drawn = 0
        self.batch_source: Iterator[tuple[Any, ...]] | None = None
        self._reset_data()

    # -- subclass interface ------------------------------------------------------------------

    def build_model(self) -> nn.Module:
        """Construct the model on the CPU (called once, under a seeded global RNG)."""
        raise NotImplementedError

    def init_parameters(self, model: nn.Module) -> None:
        """Initialise ``model``'s parameters (called once, under ``no_grad`` and a seeded RNG).

        The default keeps the modules' own initialisation from construction.
        """

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """Construct the optimizer over ``model``'s parameters (already on ``device``)."""
        raise NotImplementedError

    def setup_data(self, gen: torch.Generator) -> None:
        """Draw the fixed parts of the data (a teacher network, ...) from ``gen``.

        Called at construction and by :meth:`reset`, right after ``gen`` is re-seeded.
        """

    def next_batch(self, gen: torch.Generator) -> tuple[Any, ...]:
        """Draw the next batch from ``gen`` (on the CPU); :meth:`step` moves it to ``device``."""
        raise NotImplementedError

    def compute_loss(self, *batch: torch.Tensor) -> torch.Tensor:
        """Forward pass and loss for one batch (already on ``device``); a scalar tensor."""
        raise NotImplementedError

    def before_step(self) -> None:
        """Called at the start of every :meth:`step`, before the batch is drawn (a schedule)."""

    # -- public API -------------------------------------------------------------------------

    @property
    def step_under_way(self) -> int:
        """The 1-based number of the step that the next :meth:`step` call runs."""
        return self.steps_done + 1

    def step(self) -> torch.Tensor:
        """Run one full training step and return the detached loss (a 0-d tensor on ``device``).

        ``zero_grad(set_to_none=True)``, forward, loss, ``backward()``, ``optimizer.step()``.
        With ``micro_batches`` K > 1 the batch is split into K equal micro-batches, each with its
        own forward and ``backward()`` of its loss divided by K (the usual accumulation: the
        summed gradient is that of the whole batch's mean loss, up to rounding); the loss
        returned is the mean of the K losses. Nothing here reads a value back to the host (no
        ``.item()``): the caller decides when to pay for that sync.
        """
        self.before_step()
        drawn = next(self.batch_source) if self.batch_source is not None else self.draw_batch()
        batch = tuple(t.to(self.device, non_blocking=True) for t in drawn)
        self.optimizer.zero_grad(set_to_none=True)
        k = self.micro_batches
        if k == 1:
            loss = self.compute_loss(*batch)
            loss.backward()
        else:
            losses = []
            for part in zip(*(t.tensor_split(k) for t in batch), strict=True):
                micro = self.compute_loss(*part)
                (micro / k).backward()
                losses.append(micro.detach())
            loss = torch.stack(losses).mean()
        self.optimizer.step()
        self.steps_done += 1
        return loss.detach()

    def draw_batch(self) -> tuple[Any, ...]:
        """The next batch of the data stream (on the CPU), counted in ``batches_drawn``."""
        batch = self.next_batch(self._data_gen)
        self.batches_drawn += 1
        return batch

    def stream(self) -> Iterator[tuple[Any, ...]]:
        """The data stream as an endless iterator (:meth:`draw_batch` at each ``next``); it follows
        :meth:`set_data_state` and :meth:`reset`."""
        while True:
            yield self.draw_batch()

    def data_state(self) -> dict[str, Any]:
        """Where the scenario is: ``{"steps_done", "batches", "gen"}`` (batches drawn, its data
        generator's state), for a checkpoint."""
        return {
            "steps_done": self.steps_done,
            "batches": self.batches_drawn,
            "gen": self._data_gen.get_state(),
        }

    def set_data_state(self, state: dict[str, Any]) -> None:
        """Go back (or on) to a :meth:`data_state`: the next batches are those that followed it."""
        self.steps_done = int(state["steps_done"])
        self.batches_drawn = int(state.get("batches", state["steps_done"]))
        self._data_gen.set_state(state["gen"].clone())

    def reset(self) -> None:
        """Start over: initial parameters, empty optimizer state, the data stream from its start.

        Everything is done in place: ``model``, its parameter tensors and ``optimizer`` stay
        the same objects, so hooks attached to them (the inspector's included) stay valid.
        """
        with torch.no_grad():
            for key, value in self.model.state_dict().items():
                value.copy_(self._initial_state[key])  # state_dict() tensors share storage
        for p in self.model.parameters():
            p.grad = None
        self.optimizer.state.clear()  # Adam/AdamW/momentum buffers are rebuilt on the next step
        self.steps_done = 0
        self.batches_drawn = 0
        self._reset_data()

    def _reset_data(self) -> None:
        self._data_gen.manual_seed(self.seed)
        self.setup_data(self._data_gen)

    def __repr__(self) -> str:
        n = sum(p.numel() for p in self.model.parameters())
        return (
            f"{type(self).__name__}(name={self.name!r}, seed={self.seed}, device={str(self.device)!r}, "
            f"params={n}, steps_done={self.steps_done})"
        )


class WarmupSGD(Scenario):
    """A scenario trained with plain SGD whose learning rate rises linearly to ``peak_lr`` over
    the first ``warmup_steps`` steps, then stays there (set on ``optimizer.param_groups`` before
    every step, so a rewind or a reset replays it). Subclasses set both class attributes."""

    peak_lr: ClassVar[float]
    warmup_steps: ClassVar[int]

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=self.lr_at(1))

    def lr_at(self, step: int) -> float:
        """The learning rate of (1-based) step ``step``: linear warm-up, then constant."""
        return self.peak_lr * min(1.0, step / self.warmup_steps)

    def before_step(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.step_under_way)


class ReluTeacher(Scenario):
    """A regression on a fixed random teacher, trained with MSE: targets ``relu(x @ W1) @ w2`` plus
    N(0, ``noise_std``^2) noise, for inputs ``x`` of N(0, 1) features.

    The teacher has the shape ``in_features -> hidden -> 1``; ``W1`` is drawn with std
    ``1 / sqrt(in_features)`` and ``w2`` with std ``2 / sqrt(hidden)``, from the data generator.
    Subclasses set ``in_features``, ``hidden``, ``batch_size`` and ``noise_std``, and build the
    model and optimizer; a subclass may alter the batch after ``super().next_batch(gen)``.
    """

    in_features: ClassVar[int]
    hidden: ClassVar[int]
    batch_size: ClassVar[int]
    noise_std: ClassVar[float]

    def setup_data(self, gen: torch.Generator) -> None:
        # The teacher: fixed random weights, kept on the CPU.
        self._w1 = torch.randn(self.in_features, self.hidden, generator=gen) / self.in_features**0.5
        self._w2 = torch.randn(self.hidden, 1, generator=gen) / self.hidden**0.5 * 2.0

    def next_batch(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(self.batch_size, self.in_features, generator=gen)
        noise = torch.randn(self.batch_size, 1, generator=gen) * self.noise_std
        y = torch.relu(x @ self._w1) @ self._w2 + noise
        return x, y

    def compute_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.model(x), y)
