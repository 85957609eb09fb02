"""The one seam from the core to the server: the dashboard served from the training process.

Only this module of ``inspector`` reaches the ``server`` package, and only inside a call, never
at import: :class:`Dashboard` serves an Inspector (``insp.serve()``, ``wait()``, ``show()`` and
a notebook's ``_repr_html_``) and :func:`save_comparison` / :func:`serve_comparison` do the same
for ``inspector.compare()``'s results. The server takes the Inspector through its public API
(``server/core.py`` names the members it uses). Importing ``inspector`` imports no web code.

The ``server`` package loaded is the one shipped beside ``inspector``, even when the user's
working directory (first on ``sys.path``) has a ``server.py`` or ``server/`` of its own: then it
is loaded from its file under a private alias instead of by name.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from . import notebook
from .wire.errors import InspectorError

if TYPE_CHECKING:
    from .inspector import Inspector
    from .step.gate import PauseGate

__all__ = ["Dashboard", "load_server_module", "save_comparison", "serve_comparison"]

_DEFAULT_PORT = 8000  # serve()'s, when no port is given ...
_PORT_RETRIES = 50  # ... or the next free one of the ports after it, as Jupyter does
_ALIAS = "_gradient_inspector_server"


def _server_package() -> ModuleType:
    """The ``server`` package shipped beside ``inspector``, even if ``server`` names another module."""
    here = Path(__file__).resolve().parent.parent / "server"
    existing = sys.modules.get("server")
    if existing is not None and Path(getattr(existing, "__file__", "") or "").resolve().parent == here:
        return existing
    if existing is None:
        spec = importlib.util.find_spec("server")
        if spec is not None and spec.origin and Path(spec.origin).resolve().parent == here:
            return importlib.import_module("server")
    if _ALIAS in sys.modules:
        return sys.modules[_ALIAS]
    spec = importlib.util.spec_from_file_location(
        _ALIAS, here / "__init__.py", submodule_search_locations=[str(here)]
    )
    if spec is None or spec.loader is None:
        raise InspectorError(f"the server package is missing from {here}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[_ALIAS] = mod
    spec.loader.exec_module(mod)
    return mod


def load_server_module(name: str) -> ModuleType:
    """``server.<name>`` from the shipped package (e.g. ``"live.embed"``)."""
    return importlib.import_module(f"{_server_package().__name__}.{name}")


def save_comparison(comparison: Any, db: str | os.PathLike[str]) -> tuple[int, int]:
    """Write a comparison's two branches to a history database (``Comparison.save``)."""
    return load_server_module("history.comparison").save(comparison, os.fspath(db))  # type: ignore[no-any-return]


def serve_comparison(comparison: Any, *, host: str, port: int, token: str | None, db: Any) -> Any:
    """Serve a comparison's two branches read-only (``Comparison.serve``); returns the server."""
    return load_server_module("history.comparison").serve(
        comparison, host=host, port=port, token=token, db=db
    )


class Dashboard:
    """An Inspector's dashboard: the server it runs in this process, and the wait after training.

    ``core`` is the Inspector the server is given (its public API only); ``gate`` its pause gate
    (closed, and the condition a waiting thread sleeps on); ``apply_edits`` its edit rule, run
    while ``wait()`` keeps the process serving after training (lock held).
    """

    def __init__(self, core: Inspector, gate: PauseGate, apply_edits: Callable[[], None]) -> None:
        self._core = core
        self._gate = gate
        self._apply_edits = apply_edits
        self._server: Any = None
        self._lock = threading.Lock()  # one serve() at a time

    @property
    def url(self) -> str | None:
        """The served URL (with its ``#token=`` when one is in force), or None."""
        server = self._server
        return None if server is None else str(server.url)

    @property
    def server(self) -> Any:
        """The running server (``server.live.embed.EmbeddedServer``), or None."""
        return self._server

    @property
    def error(self) -> BaseException | None:
        """What stopped the server, when it stopped on its own (None while it serves)."""
        server = self._server
        return None if server is None else server.error

    def serve(
        self,
        *,
        host: str,
        port: int | None,
        token: str | None,
        read_only: bool,
        db: Any,
        frame_ancestors: Sequence[str],
    ) -> str | None:
        """See ``Inspector.serve``."""
        if self._core.rank != 0:
            return None  # under torch.distributed only rank 0 serves
        with self._lock:
            if self._server is not None:
                return str(self._server.url)
            chosen = _DEFAULT_PORT if port is None else port
            self._server = load_server_module("live.embed").start(
                self._core,
                host=host,
                port=chosen,
                token=token,
                read_only=read_only,
                db=db,
                port_retries=_PORT_RETRIES if port is None else 0,
                frame_ancestors=tuple(frame_ancestors),
            )
        if port is None and self._server.port != chosen:
            print(
                f"gradient-inspector: port {chosen} is in use; serving on {self._server.url}",
                file=sys.stderr,
                flush=True,
            )
        return str(self._server.url)

    def stop(self) -> None:
        """Stop the server (``close()``: after the feed delivered the last records to it)."""
        server, self._server = self._server, None
        if server is not None:
            server.stop()

    def status_html(self) -> str:
        """A notebook's display of the Inspector: its state and a link to the dashboard."""
        core = self._core
        return notebook.status_html(core.state, len(core.params), self.url)

    def show(self, height: int = 720, *, frame_ancestors: Sequence[str] = ()) -> Any:
        """The dashboard inline in a notebook, served first if need be (see inspector/notebook.py);
        None where this rank does not serve (under ``torch.distributed``, ranks other than 0)."""
        notebook.check_height(height)  # before anything is served
        origins = notebook.frame_origins(frame_ancestors)
        server = self._server
        if server is not None:
            server.allow_frames(origins)
            url: str | None = str(server.url)
        else:
            url = self._core.serve(frame_ancestors=origins)
        return None if url is None else notebook.Embed(url, height)

    def wait(self) -> None:
        """See ``Inspector.wait``."""
        core, gate = self._core, self._gate
        core.finish()  # the last step's records are sent now, while the dashboard serves
        if self._server is not None:
            print(
                f"gradient-inspector: training finished; the dashboard stays up at {self._server.url} "
                "(Ctrl-C to stop)",
                file=sys.stderr,
                flush=True,
            )
        elif core.rank == 0:
            warnings.warn(
                "insp.wait(): nothing is served (call insp.serve() first); waiting for Ctrl-C anyway",
                RuntimeWarning,
                stacklevel=3,
            )
        try:
            while True:
                with gate.cond:
                    if gate.closed:
                        break
                    self._apply_edits()
                    gate.cond.wait(timeout=0.5)  # wake for edits; the timeout lets Ctrl-C through
        except KeyboardInterrupt:
            pass
        finally:
            core.close()  # also when another thread closed: returns once that close has finished
