"""PyTorch Lightning: attach the inspector with one callback.

    from inspector.integrations.lightning import GradientInspectorCallback

    trainer = lightning.pytorch.Trainer(callbacks=[GradientInspectorCallback(serve=True)])
    trainer.fit(model)

Works with the ``lightning`` package (``lightning.pytorch``) and, when that is not installed,
with the older ``pytorch_lightning`` one. Install with ``pip install 'gradient-inspector[lightning]'``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..inspector import Inspector
from ..wire.errors import AttachError
from ..wrappers import enabled_scaler
from ._common import Session, SessionCallback, begin_step

try:
    from lightning.pytorch import Callback, LightningModule, Trainer
except ImportError:  # the older, standalone package
    try:
        from pytorch_lightning import Callback, LightningModule, Trainer  # type: ignore[no-redef]
    except ImportError as e:
        raise ImportError(
            "inspector.integrations.lightning needs PyTorch Lightning: "
            "pip install 'gradient-inspector[lightning]'"
        ) from e

__all__ = ["GradientInspectorCallback"]


class GradientInspectorCallback(SessionCallback, Callback):  # type: ignore[misc]
    """Attaches an inspector to the LightningModule and its optimizer when training starts.

    Args:
        serve: serve the dashboard from a background thread (``insp.serve()``); the URL is printed
            and kept on :attr:`url`. Under DDP only rank 0 serves.
        host, port, token, read_only, db: passed to ``insp.serve()`` (loopback by default; any other
            host needs a token, generated when None).
        wait: when serving, block at the end of ``fit`` until Ctrl-C so the dashboard stays up.
            Without it the server keeps serving from its background thread after ``fit`` returns,
            as long as the process lives: call ``callback.inspector.wait()`` or ``callback.close()``.
        hooks: a preset (as ``insp.export_hooks()`` or the dashboard's export writes it) or the path
            of one, imported once attached, e.g. ``[{"kind": "clip_norm", "target": "*",
            "params": {"max_norm": 1.0}}]``.
        on_attach: ``on_attach(insp) -> None``, called once attached (after ``hooks``), on the
            training thread: add hooks there, Python ones included.
        optimizer_index: which of ``trainer.optimizers`` to watch when there are several (one
            inspector per optimizer).
        **attach_kwargs: passed to :func:`inspector.attach`: ``every``, ``budget``, ``hist_every``,
            ``scaler``... Lightning's AMP ``GradScaler`` is passed for you when one is in use.

    When things happen:

    - ``on_train_start``: attach to ``pl_module`` (parameter names as in its
      ``named_parameters()``) and the real ``torch.optim.Optimizer`` in ``trainer.optimizers``
      (not the ``LightningOptimizer`` wrapper). Lightning steps it with a closure that runs
      ``training_step`` and ``backward``; the inspector's ``pre_step`` work runs after that
      closure, so the raw statistics are of the accumulated gradients.
    - ``on_train_batch_start``: marks the step under way (``training_step`` need not call
      ``self(x)``); hook edits made on the dashboard land here or at the step boundary. The batch
      is counted (``insp.take_batch()``), so that a rewind can skip batches
      (``insp.rewind(cp, skip=...)``, the page's "skip the batches since the checkpoint"): a batch
      in the skipped window never reaches your ``training_step`` (the callback wraps it on the
      module while attached and returns None for that batch, which Lightning takes as "skip this
      batch"), and a step whose batches were all skipped makes no update.
    - ``on_train_batch_end``: records the loss (``outputs["loss"]`` or a returned tensor; under
      automatic optimization Lightning divides it by ``accumulate_grad_batches``, so it is
      multiplied back), once per optimizer step, averaged over the step's micro-batches.
    - ``on_fit_end`` (or ``on_exception``): the inspector is closed, unless it serves (see ``wait``).

    .. warning::
        Lightning clips gradients itself (``Trainer(gradient_clip_val=...)``) inside the step's
        closure, *before* the inspector's ``pre_step`` work: the inspector's raw statistics are
        then of the already clipped gradients (a raw total norm never above ``gradient_clip_val``).
        To see the real gradients and clip with the inspector instead, turn Lightning's clipping
        off (``gradient_clip_val=None``) and add a ``clip_norm`` hook, which
        equals ``clip_grad_norm_``::

            GradientInspectorCallback(hooks=[{"kind": "clip_norm", "target": "*",
                                              "params": {"max_norm": 1.0}}])
            # or, once attached: callback.inspector.add_hook("clip_norm", target="*", max_norm=1.0)

        The raw statistics are then before clipping, the final ones after, and the clip can be
        changed or turned off from the dashboard while training runs.
    """

    def __init__(
        self,
        *,
        serve: bool = False,
        host: str = "127.0.0.1",
        port: int = 8000,
        token: str | None = None,
        read_only: bool = False,
        db: Any = None,
        wait: bool = False,
        hooks: Any = None,
        on_attach: Callable[[Inspector], None] | None = None,
        optimizer_index: int | None = None,
        **attach_kwargs: Any,
    ) -> None:
        super().__init__()
        self._session = Session(
            serve=serve,
            host=host,
            port=port,
            token=token,
            read_only=read_only,
            db=db,
            wait=wait,
            hooks=hooks,
            on_attach=on_attach,
            attach_kwargs=attach_kwargs,
        )
        self.optimizer_index = optimizer_index
        self._losses: list[torch.Tensor] = []
        self._recorded_step = 0
        self._drop = False  # the batch under way falls in a skipped window
        # the module whose training_step is wrapped, and its own training_step attribute (None: none)
        self._wrapped: tuple[LightningModule, Any] | None = None

    # ------------------------------------------------------------------ Lightning hooks
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        optimizers = list(trainer.optimizers)
        if not optimizers:
            raise AttachError("the trainer has no optimizer to watch (configure_optimizers returned none)")
        index = self.optimizer_index
        if index is None:
            if len(optimizers) > 1:
                raise AttachError(
                    f"the trainer has {len(optimizers)} optimizers: pick one with "
                    "GradientInspectorCallback(optimizer_index=i), one callback per optimizer"
                )
            index = 0
        if not 0 <= index < len(optimizers):
            raise AttachError(f"optimizer_index {index} is out of range: the trainer has {len(optimizers)}")
        precision = getattr(trainer.strategy, "precision_plugin", None)
        insp = self._session.open(
            pl_module, optimizers[index], scaler=enabled_scaler(getattr(precision, "scaler", None))
        )
        self._losses.clear()
        self._recorded_step = insp.step
        self._wrap_training_step(pl_module)
        total = trainer.estimated_stepping_batches  # the run's optimizer steps (inf without a limit)
        left = total - trainer.global_step if isinstance(total, int) else None
        if left is not None and left >= 1:
            insp.expect_last_step(insp.step + left)  # the run's last step is always sampled

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        insp = self._session.inspector
        if insp is not None:
            begin_step(insp, pl_module)
            self._drop = insp.take_batch()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        insp = self._session.inspector
        if insp is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            loss = loss.detach().float().reshape(())
            if pl_module.automatic_optimization:
                loss = loss * trainer.accumulate_grad_batches  # Lightning normalised it for accumulation
            self._losses.append(loss)
        if self._losses and insp.step != self._recorded_step:  # an optimizer step ended in this batch
            insp.record(loss=torch.stack(self._losses).mean())  # one host transfer, at the next step
            self._losses.clear()
            self._recorded_step = insp.step

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._unwrap_training_step()
        self._session.finish()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._unwrap_training_step()
        self._session.finish(wait=False)  # keep serving if asked (a post-mortem), never block here

    def close(self) -> None:
        """Close the inspector: our hooks are removed and the server stops. Idempotent."""
        self._unwrap_training_step()
        super().close()

    # ------------------------------------------------------------------ skipped batches
    def _wrap_training_step(self, module: LightningModule) -> None:
        """Put a ``training_step`` on the module instance that returns None (Lightning: skip this
        batch, no backward) for a batch in a skipped window, and calls the module's own otherwise."""
        self._unwrap_training_step()
        own = module.__dict__.get("training_step")  # (an instance attribute of the user's, kept)
        inner = module.training_step

        def training_step(*args: Any, **kwargs: Any) -> Any:
            if self._drop:
                return None
            return inner(*args, **kwargs)

        module.training_step = training_step
        self._wrapped = (module, own)
        self._drop = False

    def _unwrap_training_step(self) -> None:
        wrapped, self._wrapped = self._wrapped, None
        if wrapped is None:
            return
        module, own = wrapped
        if own is None:
            module.__dict__.pop("training_step", None)
        else:
            module.training_step = own
