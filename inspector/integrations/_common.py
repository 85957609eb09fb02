"""What the framework callbacks share: the options, presets, serving, the end, and the members a
callback shows (`SessionCallback`); wrapped optimizers and scalers are seen through by
`inspector.wrappers`, the rule `attach` itself uses.

No framework is imported here.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from ..inspector import Inspector, attach

_ATTACH_OPTIONS = frozenset(
    p for p in inspect.signature(attach).parameters if p not in ("model", "optimizer")
)


def load_preset(hooks: Any) -> Any:
    """A preset as ``import_hooks`` takes it, or the path of a JSON file holding one."""
    if isinstance(hooks, str | os.PathLike):
        with open(hooks, encoding="utf-8") as f:
            return json.load(f)
    return hooks


class Session:
    """One training run's inspector: attached at the start, served if asked, finished at the end.

    Args:
        serve: serve the dashboard from a background thread of the training process.
        host, port, token, read_only, db: passed to ``insp.serve()``.
        wait: when serving, block at the end of training until Ctrl-C (``insp.wait()``).
        hooks: a preset (``insp.export_hooks()``, ``GET /api/hooks/export``) or the path of one,
            imported once attached.
        on_attach: ``on_attach(insp) -> None``, called once attached (after ``hooks``): the place
            for ``insp.add_hook(...)``, including Python hooks.
        attach_kwargs: passed to :func:`inspector.attach` (``every``, ``budget``, ``scaler``...).
    """

    def __init__(
        self,
        *,
        serve: bool,
        host: str,
        port: int,
        token: str | None,
        read_only: bool,
        db: Any,
        wait: bool,
        hooks: Any,
        on_attach: Callable[[Inspector], None] | None,
        attach_kwargs: Mapping[str, Any],
    ) -> None:
        unknown = sorted(set(attach_kwargs) - _ATTACH_OPTIONS)
        if unknown:
            raise TypeError(
                f"unknown option {unknown[0]!r}: the options are serve, host, port, token, read_only, "
                f"db, wait, hooks, on_attach, and inspector.attach's {sorted(_ATTACH_OPTIONS)}"
            )
        if on_attach is not None and not callable(on_attach):
            raise TypeError(f"on_attach must be callable, got {type(on_attach).__name__}")
        self.serve = serve
        self.serve_kwargs = {"host": host, "port": port, "token": token, "read_only": read_only, "db": db}
        self.wait = wait
        self.hooks = hooks
        self.on_attach = on_attach
        self.attach_kwargs = dict(attach_kwargs)
        self.inspector: Inspector | None = None
        self.url: str | None = None

    def open(self, model: nn.Module, optimizer: Any, *, scaler: Any = None) -> Inspector:
        """Attach to ``model`` and ``optimizer`` (closing any earlier one); ``attach`` finds the real
        optimizer inside a framework's wrapper."""
        self.close()
        kwargs = dict(self.attach_kwargs)
        if scaler is not None and kwargs.get("scaler") is None:
            kwargs["scaler"] = scaler  # the framework's AMP scaler: skipped steps reported, stats unscaled
        insp = attach(model, optimizer, **kwargs)  # attach looks through wrapped optimizers
        try:
            if self.hooks is not None:
                insp.import_hooks(load_preset(self.hooks))
            if self.on_attach is not None:
                self.on_attach(insp)
            if self.serve:
                self.url = insp.serve(**self.serve_kwargs)
                if self.url is not None:  # None on the ranks other than 0
                    print(f"gradient-inspector: open {self.url}", flush=True)
        except BaseException:
            insp.close()
            raise
        self.inspector = insp
        return insp

    def finish(self, *, wait: bool = True) -> None:
        """Training ended: close the inspector, unless it serves (then wait for Ctrl-C if asked)."""
        insp = self.inspector
        if insp is None:
            return
        if self.url is None:
            self.close()
        elif self.wait and wait:
            insp.wait()  # returns on Ctrl-C, closed
            self.inspector = None
        else:  # keep serving from the background thread; the caller may call insp.wait() or close()
            insp.finish()

    def close(self) -> None:
        insp, self.inspector, self.url = self.inspector, None, None
        if insp is not None:
            insp.close()


class SessionCallback:
    """The members every framework callback has, served by its ``Session`` (``_session``); a base
    class listed before the framework's own callback class."""

    _session: Session

    @property
    def inspector(self) -> Inspector | None:
        """The attached inspector (None before training starts and once closed)."""
        return self._session.inspector

    @property
    def url(self) -> str | None:
        """The dashboard's URL while serving, else None."""
        return self._session.url

    def close(self) -> None:
        """Close the inspector: our hooks are removed and the server stops. Idempotent."""
        self._session.close()


def begin_step(insp: Inspector, root: nn.Module) -> None:
    """Mark a step under way, as the root module's forward pre-hook would.

    The core learns that a step is under way from the root module's forward pre-hook. A
    Lightning ``training_step`` may never call the LightningModule's own ``forward``
    (``self.net(x)``), so the callback calls that hook itself at the start of each batch;
    calling it again when ``training_step`` does call ``self(x)`` is harmless.
    """
    insp.begin_step()
