"""Running the app under uvicorn: in the foreground (the CLI) or in a daemon thread (user mode).

The socket is bound here, before uvicorn starts, so a taken port fails at once
with a clear message, and port 0 resolves to the real port for the URL.

HTTP is uvicorn's h11 protocol with two bounds for slow or greedy clients
(`guarded_http`): a request not received whole (headers and body) within
`Settings.request_timeout` seconds of its first byte (or of the connection's
opening) is closed, and each client address holds at most
`Settings.connections_per_client` open HTTP connections (more are closed at
once), so partial requests can neither pile up nor lock out a complete one.
"""

from __future__ import annotations

import asyncio
import copy
import errno
import socket
import threading
import time
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.config import LOGGING_CONFIG

from .security import RedactTokenFilter
from .settings import Settings


class PortInUse(OSError):
    pass


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port); raises `PortInUse` with a clear message."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise PortInUse(
                e.errno,
                f"port {port} on {host} is already in use: pick another with --port "
                f"(or port=...), or 0 for any free port",
            ) from e
        raise
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def log_config() -> dict[str, Any]:
    """uvicorn's logging, with the token stripped from every line (access log and websocket lines)."""
    config = copy.deepcopy(LOGGING_CONFIG)
    config["filters"] = {"redact_token": {"()": RedactTokenFilter}}
    for handler in config["handlers"].values():
        handler["filters"] = ["redact_token"]
    return config


def guarded_http(
    request_timeout: float, per_client: int, base: type[asyncio.Protocol] | None = None
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (`base`: httptools' when installed, else h11's, as uvicorn picks),
    bounded (see the module docstring); one class per server, which holds that server's count of
    open connections per client address."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        base = AutoHTTPProtocol
    open_per_client: dict[str, int] = {}

    class GuardedHTTPProtocol(base):  # type: ignore[valid-type, misc]
        _counted: str | None = None
        _deadline: asyncio.TimerHandle | None = None
        _in_request = True  # from the opening until a request has arrived whole

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            address = self.client[0] if self.client else "?"
            if open_per_client.get(address, 0) >= per_client:
                transport.close()  # over the cap: refused before it costs anything more
                return
            open_per_client[address] = open_per_client.get(address, 0) + 1
            self._counted = address
            self._arm()

        def _arm(self) -> None:  # not re-armed while armed: trickling bytes do not extend it
            if self._deadline is None:
                self._deadline = self.loop.call_later(request_timeout, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if self._in_request and not self.transport.is_closing():
                self.transport.close()  # the request never arrived whole

        def _started(self) -> None:
            self._in_request = True
            self._arm()

        def _complete(self) -> None:
            self._in_request = False
            self._disarm()

        def _uncount(self) -> None:
            if self._counted is not None:
                left = open_per_client.get(self._counted, 1) - 1
                if left > 0:
                    open_per_client[self._counted] = left
                else:
                    open_per_client.pop(self._counted, None)
                self._counted = None

        # httptools: its parser calls these by name
        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._started()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._complete()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            conn = getattr(self, "conn", None)
            if isinstance(conn, h11.Connection):  # h11: read its state
                if conn.their_state in (h11.IDLE, h11.SEND_BODY):
                    self._started()
                else:
                    self._complete()

        def handle_websocket_upgrade(self, *args: Any) -> None:
            self._complete()
            self._uncount()  # the websocket protocol takes the connection over (ws.py bounds it)
            super().handle_websocket_upgrade(*args)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self._uncount()
            super().connection_lost(exc)

    return GuardedHTTPProtocol


def uvicorn_config(app: FastAPI, settings: Settings, *, quiet: bool) -> uvicorn.Config:
    """`quiet` (user mode): no access log and no logging set-up, the user's process owns its logging."""
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None if quiet else log_config(),
        log_level="warning" if quiet else "info",
        access_log=not quiet,
        lifespan="on",
        http=guarded_http(settings.request_timeout, settings.connections_per_client),
        ws_max_size=max(4 * settings.max_frame, 1 << 20),  # past max_frame the app closes with 1008
        ws_per_message_deflate=False,  # compressing each snapshot per client costs more CPU than it saves here
        timeout_graceful_shutdown=3,
        server_header=False,
        # X-Forwarded-For only from a proxy the user named (settings.py, `trusted_proxy`)
        proxy_headers=settings.trusted_proxy is not None,
        forwarded_allow_ips=settings.trusted_proxy or "",
    )


class ThreadedServer:
    """A uvicorn server on a daemon thread (user mode, tests). `start()` returns once it serves."""

    def __init__(self, app: FastAPI, settings: Settings, *, quiet: bool = True) -> None:
        self.settings = settings
        self.sock = bind(settings.host, settings.port)
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn_config(app, settings, quiet=quiet))
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="gradient-inspector-server", daemon=True)
        self._on_crash: list[Any] = []

    @property
    def url(self) -> str:
        return self.settings.url(self.port)

    def on_crash(self, fn: Any) -> None:
        self._on_crash.append(fn)

    async def _serve(self) -> None:
        try:
            await self.server.serve(sockets=[self.sock])
        except BaseException:
            for listener in getattr(self.server, "servers", []):  # uvicorn's asyncio servers: close them
                listener.close()
            raise

    def _run(self) -> None:
        try:
            if hasattr(asyncio, "Runner"):  # Python 3.11+
                with asyncio.Runner(loop_factory=self.server.config.get_loop_factory()) as runner:
                    runner.run(self._serve())
            else:
                self.server.run(sockets=[self.sock])
        except BaseException as e:  # noqa: BLE001 - reported, never raised into training
            self.error = e
        if self.error is None and not self.server.should_exit and self.server.started:
            self.error = RuntimeError("the server stopped on its own")
        if self.error is not None:
            for fn in self._on_crash:
                try:
                    fn(self.error)
                except Exception:
                    pass

    def start(self, timeout: float = 30.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout
        # uvicorn exposes readiness as a flag, not an event: poll it against a deadline.
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"the server did not start: {self.error or 'see the log above'}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start within {timeout} s")
            time.sleep(0.005)

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout)
        try:
            self.sock.close()
        except OSError:
            pass
