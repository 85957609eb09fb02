"""Server settings: bind address, token rule, limits. Validated when built."""

from __future__ import annotations

import ipaddress
import secrets
from dataclasses import dataclass, field

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
# A run with more parameter tensors than this is "large": its snapshot messages carry the
# per-parameter statistics only of the tensors the pages subscribed to and of the worst-now ones
# (`detail`, PROTOCOL.md); a smaller one's carry every tensor's.
DETAIL_ALL = 64
DETAIL_CAP = 256  # tensors the pages' detail subscriptions hold together, at most
DETAIL_WINDOW = 512  # recorded snapshots of a run whose per-parameter detail the history keeps whole


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine."""
    name = host.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def new_token() -> str:
    """A fresh access token: 32 random bytes (256 bits), URL-safe."""
    return secrets.token_urlsafe(32)


def browse_host(host: str) -> str:
    """The host part of a printable URL for a bind address."""
    name = host.strip("[]")
    if name in ("0.0.0.0", "::", ""):
        return "127.0.0.1"  # a wildcard bind: this machine's loopback works from here
    return f"[{name}]" if ":" in name else name


@dataclass
class Settings:
    """Everything `create_app` needs besides the source.

    Attributes:
        host: the bind address; anything but loopback requires a token.
        port: the TCP port (0: any free port, known once bound).
        token: the access token; generated when None and the bind is not loopback.
        read_only: serve reads and the stream, answer every command with 403.
        max_body: largest HTTP request body in bytes (413 past it).
        max_frame: largest websocket text frame in bytes (the socket is closed with 1008 past it).
        commands_per_second: per-client command budget (HTTP: per address; websocket: per socket),
            sustained; bursts of twice that.
        hello_history: snapshots sent in `hello` (the page keeps 600: frontend/state.js).
        hello_events: events sent in `hello` (the page keeps 400).
        request_timeout: seconds a request may take to arrive whole (headers and body), from its
            first byte or the connection's opening; the connection is closed past it.
        connections_per_client: open HTTP connections per client address; more are closed at once.
        agent_streams_per_client: open event streams of the agent interface (`GET /mcp`) per
            client address (429 past it)...
        agent_streams: ...and on the server (503): they stay open until the client closes them.
        trusted_proxy: the address of a reverse proxy whose `X-Forwarded-For` and
            `X-Forwarded-Proto` are believed (comma-separated list, or "*"); None, the default:
            those headers are ignored from everyone, so a client cannot pick the address that the
            command budget and the access log see (uvicorn believes 127.0.0.1 by default, and
            every SSH-tunnelled client comes from there).
        frame_ancestors: origins whose pages may show the dashboard in a frame (a notebook's;
            `insp.show()` names them); none by default (security.py).
        detail_window: recorded snapshots of a run whose per-parameter statistics the history keeps
            for every step; older steps keep them on every 8th (history/storage.py). The CLI's
            `--detail-window` hands it to the history it opens.
    """

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    token: str | None = None
    read_only: bool = False
    max_body: int = 1 << 20
    max_frame: int = 64 << 10
    commands_per_second: float = 50.0
    hello_history: int = 600
    hello_events: int = 400
    request_timeout: float = 5.0
    connections_per_client: int = 64
    agent_streams_per_client: int = 4
    agent_streams: int = 16
    trusted_proxy: str | None = None
    frame_ancestors: tuple[str, ...] = ()
    detail_window: int = DETAIL_WINDOW
    loopback: bool = field(init=False)

    def __post_init__(self) -> None:
        self.loopback = is_loopback(self.host)
        if self.token is not None and len(self.token) < 8:
            raise ValueError("token: at least 8 characters (a generated one has 43)")
        if self.token is None and not self.loopback:
            self.token = new_token()
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be 0..65535, got {self.port}")
        if not 0 <= self.agent_streams_per_client < self.connections_per_client:
            raise ValueError(
                "agent streams per client: 0 up to fewer than the connections per client "
                f"({self.connections_per_client}), or they could hold them all; got "
                f"{self.agent_streams_per_client}"
            )
        if self.detail_window < 1:
            raise ValueError(f"detail window: at least 1, got {self.detail_window}")

    def url(self, port: int | None = None) -> str:
        """The start-up URL: `http://HOST:PORT/`, with `#token=T` when a token is in force (a
        fragment never leaves the browser: the page keeps it, see frontend/api.js)."""
        base = f"http://{browse_host(self.host)}:{port if port is not None else self.port}/"
        return f"{base}#token={self.token}" if self.token else base
