"""Hugging Face ``transformers.Trainer``: attach the inspector with one callback.

    from inspector.integrations.huggingface import GradientInspectorCallback

    trainer = transformers.Trainer(model=model, args=args, train_dataset=ds,
                                   callbacks=[GradientInspectorCallback(serve=True)])
    trainer.train()

Install with ``pip install 'gradient-inspector[hf]'`` (transformers and accelerate).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch
from torch import nn

from ..inspector import Inspector
from ..wrappers import enabled_scaler
from ._common import Session, SessionCallback

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as e:
    raise ImportError(
        "inspector.integrations.huggingface needs transformers: pip install 'gradient-inspector[hf]'"
    ) from e

__all__ = ["GradientInspectorCallback"]


class GradientInspectorCallback(SessionCallback, TrainerCallback):  # type: ignore[misc]
    """Attaches an inspector to the Trainer's model and optimizer when training begins.

    Args:
        serve: serve the dashboard from a background thread (``insp.serve()``); the URL is printed
            and kept on :attr:`url`. Under distributed training only rank 0 serves.
        host, port, token, read_only, db: passed to ``insp.serve()`` (loopback by default; any other
            host needs a token, generated when None).
        wait: when serving, block at the end of ``train()`` until Ctrl-C so the dashboard stays up.
            Without it the server keeps serving from its background thread after ``train()``
            returns, as long as the process lives: call ``callback.inspector.wait()`` or
            ``callback.close()``.
        hooks: a preset (as ``insp.export_hooks()`` or the dashboard's export writes it) or the path
            of one, imported once attached, e.g. ``[{"kind": "clip_norm", "target": "*",
            "params": {"max_norm": 1.0}}]``.
        on_attach: ``on_attach(insp) -> None``, called once attached (after ``hooks``), on the
            training thread: add hooks there, Python ones included.
        **attach_kwargs: passed to :func:`inspector.attach`: ``every``, ``budget``, ``hist_every``,
            ``scaler``... Accelerate's fp16 ``GradScaler`` is passed for you when one is in use.

    When things happen:

    - ``on_train_begin``: attach to the Trainer's model (``trainer.model``, parameter names as
      in its ``named_parameters()``) and the real ``torch.optim.Optimizer`` inside Accelerate's
      ``AcceleratedOptimizer`` (its ``.optimizer``), whose ``step()`` is the step boundary.
    - each training forward: the model's ``loss`` output is collected (eval forwards are not);
      ``on_pre_optimizer_step`` records it for the step: the mean over the step's micro-batches,
      or their sum when the Trainer hands ``num_items_in_batch`` to the model (the model then
      divides by the whole step's token count). When the model returns no loss (a
      ``compute_loss_func``, label smoothing), the loss of ``on_log`` is recorded instead, for the
      step it is logged at (HF averages it over ``logging_steps``).
    - each training forward also counts its batch (``insp.take_batch()``), so that a rewind can
      skip batches (``insp.rewind(cp, skip=...)``, the page's "skip the batches since the
      checkpoint"). The Trainer draws the batches itself, so a batch in the skipped window is
      still drawn and run forward, but has no effect: the forward's outputs are replaced by zeros
      joined to the parameters by a factor 0, so its backward gives every parameter an exact zero
      (a NaN batch included), its loss is not recorded, and a step whose batches were all
      skipped makes no update (every gradient set to None before ``optimizer.step()``). In a step
      of which only some micro-batches were skipped, the kept ones are still divided as the
      Trainer divides them (by the accumulation steps, or by the step's whole token count).
    - ``on_train_end``: the inspector is closed, unless it serves (see ``wait``). If ``train()``
      raises, call ``callback.close()``.

    .. warning::
        The Trainer clips gradients itself, by default: ``max_grad_norm=1.0`` in
        ``TrainingArguments``. It clips before ``optimizer.step()``, so before the inspector's
        ``pre_step`` work: the inspector's raw statistics are then of the already clipped
        gradients (a raw total norm never above ``max_grad_norm``). To see the real gradients
        and clip with the inspector instead, turn the Trainer's clipping off
        (``TrainingArguments(max_grad_norm=0)``) and add a ``clip_norm`` hook, which equals
        ``clip_grad_norm_``::

            GradientInspectorCallback(hooks=[{"kind": "clip_norm", "target": "*",
                                              "params": {"max_norm": 1.0}}])
            # or, once attached: callback.inspector.add_hook("clip_norm", target="*", max_norm=1.0)

        The raw statistics are then before clipping, the final ones after, and the clip can be
        changed or turned off from the dashboard while training runs. (The ``grad_norm`` the
        Trainer logs is its own pre-clip norm.)
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
        **attach_kwargs: Any,
    ) -> None:
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
        self._forward_handle: Any = None
        self._losses: list[torch.Tensor] = []
        self._partial = False  # the losses are shares of the step's (num_items_in_batch): sum, not mean
        self._model_gives_loss = False
        self._loss_scale = 1

    def close(self) -> None:
        """Close the inspector: our hooks are removed and the server stops. Idempotent."""
        self._remove_forward_hook()
        super().close()

    # ------------------------------------------------------------------ Trainer events
    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        if model is None or optimizer is None:
            raise RuntimeError("the Trainer passed no model or optimizer to on_train_begin")
        self._remove_forward_hook()
        insp = self._session.open(model, optimizer, scaler=enabled_scaler(getattr(optimizer, "scaler", None)))
        left = int(state.max_steps or 0) - int(state.global_step or 0)
        if left >= 1:
            insp.expect_last_step(insp.step + left)  # the run's last step is always sampled
        self._losses.clear()
        self._model_gives_loss = False
        # under token averaging the model divides by the token count of every process's batch
        world = args.world_size if getattr(args, "average_tokens_across_devices", False) else 1
        self._loss_scale = max(int(world), 1)
        self._forward_handle = model.register_forward_hook(self._on_forward, with_kwargs=True)

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        insp = self._session.inspector
        if insp is None or not self._losses:
            return
        losses = torch.stack(self._losses)
        insp.record(loss=losses.sum() * self._loss_scale if self._partial else losses.mean())
        self._losses.clear()

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        insp = self._session.inspector
        if insp is None or self._model_gives_loss or not logs:
            return
        loss = logs.get("loss")
        if isinstance(loss, int | float) and not isinstance(loss, bool):
            insp.record(loss=float(loss))

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._remove_forward_hook()
        self._session.finish()

    # ------------------------------------------------------------------ internals
    def _on_forward(self, module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> Any:
        if not module.training or not torch.is_grad_enabled():
            return None  # evaluation and prediction forwards
        insp = self._session.inspector
        if insp is not None and insp.take_batch():  # in a skipped window: no effect
            return without_effect(module, output)
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return None
        self._model_gives_loss = True
        self._partial = kwargs.get("num_items_in_batch") is not None
        self._losses.append(loss.detach().float().reshape(()))
        return None

    def _remove_forward_hook(self) -> None:
        handle, self._forward_handle = self._forward_handle, None
        if handle is not None:
            handle.remove()


def without_effect(module: nn.Module, output: Any) -> Any:
    """``output`` with every floating-point tensor replaced by zeros plus ``z``, a 0 joined to each
    trainable parameter by a factor 0 (``p.reshape(-1)[:1].sum() * 0``): a loss computed from it,
    and its backward, give every parameter an exact zero gradient, whatever the batch held (NaN
    included), and every parameter one (as a kept batch gives them, so nothing is left unused)."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        return output
    device = params[0].device
    z = sum((p.reshape(-1)[:1].float().sum() * 0).to(device) for p in params)

    def zeroed(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return torch.zeros_like(v) + z.to(v.device, v.dtype)
        return v

    if isinstance(output, torch.Tensor):
        return zeroed(output)
    if isinstance(output, MutableMapping):  # a ModelOutput (an OrderedDict) or a dict, fresh from the forward
        for k in list(output.keys()):
            output[k] = zeroed(output[k])
        return output
    if isinstance(output, tuple | list):
        return type(output)(zeroed(v) for v in output)
    return output
