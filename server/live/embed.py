"""User mode: the dashboard inside the user's own training process.

`insp.serve(...)` (in the core) loads this package and calls `start`, which runs
the app on a uvicorn server in a daemon thread and returns once it serves. The
user's loop is untouched: the server only subscribes to the inspector.

A crash of the server thread never reaches training: it is kept on the
handle's `.error` and reported with a `server_error` event. The history does not
depend on the server thread: it records from before the server starts until
`insp.close()` (`EmbeddedServer.stop`), crash or not.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any

from ..app import create_app
from ..core import Core
from ..history.storage import DEFAULT_DB, HistoryStore
from ..serving import PortInUse, ThreadedServer
from ..settings import DEFAULT_HOST, DEFAULT_PORT, Settings
from .source import LiveSource


class EmbeddedServer:
    """The handle `start` returns.

    Attributes:
        url: the start-up URL, with `#token=T` when a token is in force.
        port: the bound port (useful with port=0).
        db: the history file, or None.
        run_id: this process's run in it.
        error: None, or the exception that stopped the server thread.
    """

    def __init__(self, server: ThreadedServer, source: LiveSource, guard: Any = None) -> None:
        self._server = server
        self._source = source
        self._guard = guard
        self._lock = threading.Lock()
        self._stopped = False
        self.url = server.url
        self.port = server.port
        self.db = source.store.path if source.store is not None else None
        self.run_id = source.run_id

    @property
    def error(self) -> BaseException | None:
        return self._server.error

    def allow_frames(self, origins: tuple[str, ...]) -> None:
        """Let pages of these origins show the dashboard in a frame from now on (`insp.show()` on a
        server that `insp.serve()` started); ValueError for one that is not an origin."""
        if self._guard is not None:
            self._guard.allow_frames(tuple(origins))

    def stop(self) -> None:
        """Stop serving, then stop recording (flushing the history). Idempotent; training is not touched."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._server.stop()
        self._source.close()


def start(
    insp: Core,
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    token: str | None = None,
    read_only: bool = False,
    db: str | os.PathLike[str] | None | bool = None,
    port_retries: int = 0,
    frame_ancestors: tuple[str, ...] = (),
) -> EmbeddedServer:
    """Serve `insp` in a background thread and return once the server answers.

    Args:
        insp: an attached inspector.
        host: the bind address; anything but loopback requires a token (generated when None).
        port: the TCP port; 0 picks a free one (see the handle's `.port`).
        port_retries: when `port` is taken, try this many of the ports after it (as Jupyter does).
        token: the access token.
        read_only: serve reads and the stream, refuse every command (403).
        db: the history file; None means `./gradient-inspector.sqlite`, False means no history.
        frame_ancestors: origins whose pages may show the dashboard in a frame (none by default).

    Raises:
        PortInUse: the port (and every one tried after it) is taken (an OSError).
        RuntimeError: the server did not start.
    """
    store = None if db is False else HistoryStore(DEFAULT_DB if db in (None, True) else db)  # type: ignore[arg-type]
    source = LiveSource(insp, mode="user", store=store, read_only=read_only, history_outlives_server=True)
    try:
        for candidate in range(port, port + port_retries + 1) if port else [port]:
            settings = Settings(
                host=host, port=candidate, token=token, read_only=read_only, frame_ancestors=frame_ancestors
            )
            try:
                app = create_app(source, settings)
                server = ThreadedServer(app, settings, quiet=True)
                break
            except PortInUse:
                if candidate == port + port_retries or not port:
                    raise
    except BaseException:
        if store is not None:
            store.close()
        raise

    def report(exc: BaseException) -> None:
        source.stop()  # the hub is gone; the history records on (and records this event)
        insp.add_event("server_error", message=f"the dashboard server stopped: {type(exc).__name__}: {exc}")

    server.on_crash(report)
    source.record()  # before serving, and independent of the server thread's life
    try:
        server.start()
    except BaseException:
        source.close()
        raise
    handle = EmbeddedServer(server, source, app.state.guard)
    if store is not None:
        # A script that ends without insp.close() or insp.wait() still gets its last
        # half-second of history written (the writer is a daemon thread).
        atexit.register(store.flush, 2.0)
    return handle
