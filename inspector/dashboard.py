"""Serving the dashboard from the training process: ``serve()`` and ``wait()``; in a notebook,
``_repr_html_()`` (a link to it) and ``show()`` (it inline), from :mod:`inspector.notebook`.

:class:`Dashboard` is a base of the :class:`~inspector.Inspector`; ``serve()`` loads the ``server``
package lazily (:mod:`inspector.server_loader`), so importing ``inspector`` imports no web code.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from . import notebook
from .server_loader import load_server_module

__all__ = ["Dashboard"]

_DEFAULT_PORT = 8000  # serve()'s, when no port is given ...
_PORT_RETRIES = 50  # ... or the next free one of the ports after it, as Jupyter does


class Dashboard:
    """``serve()``, ``wait()``, ``_repr_html_()`` and ``show()``; the state used here is the Inspector's."""

    rank: int
    _server: Any
    _cond: threading.Condition
    _closed: bool
    _reg: Any  # the hook registry (registry.py)

    if TYPE_CHECKING:  # the Inspector's (inspector.py, lifecycle.py)

        def _check_open(self) -> None: ...
        def _drain_locked(self, *, torch_ok: bool) -> None: ...
        def finish(self) -> None: ...
        def close(self) -> None: ...

    def serve(
        self,
        host: str = "127.0.0.1",
        port: int | None = None,
        token: str | None = None,
        read_only: bool = False,
        db: str | os.PathLike[str] | bool | None = None,
        *,
        frame_ancestors: Sequence[str] = (),
    ) -> str | None:
        """Serve the dashboard from a background thread of this process; returns its URL.

        Loads the ``server`` package shipped with ``inspector`` (even when the working
        directory has a ``server.py`` of its own). Under ``torch.distributed`` only rank 0
        serves; on the other ranks this returns None.

        Args:
            host: bind address; anything but loopback requires a token (generated when None and
                printed once in the returned URL).
            port: TCP port. None (the default): 8000, or when that is taken (a second run on the
                same box) the next free one of the 50 after it, printed as Jupyter does; an explicit
                port that is taken raises ``PortInUse``; 0 picks any free one.
            token: the access token.
            read_only: serve the dashboard and the stream, refuse every command (403).
            db: the history file: None for ``./gradient-inspector.sqlite``, a path for that
                file, False for no history on disk.
            frame_ancestors: origins whose pages may show the dashboard in a frame, e.g.
                ``["https://hub.example.com"]``; none by default (no other page can frame it).
                :meth:`show` allows a notebook's own.
        """
        self._check_open()
        if self.rank != 0:
            return None  # under torch.distributed only rank 0 serves
        if self._server is not None:
            return str(self._server.url)
        chosen = _DEFAULT_PORT if port is None else port
        self._server = load_server_module("live.embed").start(
            self,
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

    def requested_config(self) -> tuple[int, list[dict[str, Any]]]:
        """``(config_version, hooks)`` of the requested hook configuration, read together: the
        hooks as ``hooks()`` lists them, and the ``config_version`` they have once every pending
        change is applied (the applied count plus the changes pending). The server records it
        before it acknowledges a change, so the change outlives a crash right after the reply."""
        with self._cond:
            return self._reg.version + len(self._reg.pending), [s.to_dict() for s in self._reg.view()]

    def _repr_html_(self) -> str:  # a notebook's display: a link to the dashboard (inspector/notebook.py)
        return notebook.status_html(self)

    def show(self, height: int = 720, *, frame_ancestors: Sequence[str] = ()) -> Any:
        """The dashboard inline in a notebook (an iframe; served first if need be), which it lets
        frame it: loopback pages and VS Code's webviews, and ``frame_ancestors`` (your notebook
        server's origin when it is not on loopback, e.g. ``["https://hub.example.com"]``).
        See inspector/notebook.py."""
        return notebook.show(self, height, frame_ancestors=frame_ancestors)

    def wait(self) -> None:
        """Keep serving after training ended, until Ctrl-C; edits apply at once meanwhile.

        Prints where it serves and how to stop it (a warning when nothing is served: then it
        only holds the process until Ctrl-C). Returns once ``close()`` has finished.
        """
        self.finish()  # the last step's records are sent now, while the dashboard serves
        if self._server is not None:
            print(
                f"gradient-inspector: training finished; the dashboard stays up at {self._server.url} "
                "(Ctrl-C to stop)",
                file=sys.stderr,
                flush=True,
            )
        elif self.rank == 0:
            warnings.warn(
                "insp.wait(): nothing is served (call insp.serve() first); waiting for Ctrl-C anyway",
                RuntimeWarning,
                stacklevel=2,
            )
        try:
            while True:
                with self._cond:
                    if self._closed:
                        break
                    self._drain_locked(torch_ok=True)
                    self._cond.wait(timeout=0.5)  # wake for edits; the timeout lets Ctrl-C through
        except KeyboardInterrupt:
            pass
        finally:
            self.close()  # also when another thread closed: returns once that close has finished
