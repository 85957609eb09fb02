"""Running the app under uvicorn: in the foreground (the CLI) or in a daemon thread (user mode).

The socket is bound here, before uvicorn starts, so a taken port fails at once
with a clear message, and port 0 resolves to the real port for the URL.
"""

from __future__ import annotations

import asyncio
import copy
import errno
import socket
import threading
import time
from typing import Any

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
