"""Request guards (PROTOCOL.md "Security, briefly"), as one pure ASGI middleware in front of the app.

Order of checks, for HTTP and for the websocket handshake:

1. DNS-rebinding guard (loopback binds only): the `Host` name must be
   `localhost`, `[::1]` or an address of 127.0.0.0/8 written plainly
   (`127.0.0.2`; not `127.1`, `2130706433` or `127.000.0.1`), with a port of
   digits or none. Otherwise 403.
2. Origin (mutating methods, `/ws` and every method of `/mcp`): a present `Origin`
   must name the request's own scheme and `Host` (the default port normalised), else
   403. This holds through an SSH tunnel on any local port, and stops another site's
   page from changing hooks or pausing training, even with a body-less POST, or from
   holding the agent interface's event streams open.
3. Token (when one is in force): `Authorization: Bearer T`, `?token=T`, or on
   the websocket handshake the subprotocol `gi-token.HEX` (the token's UTF-8
   bytes in hex, offered next to `gradient-inspector`: a browser cannot set
   headers on a websocket), compared in constant time, else 401. The page's
   static shell (`PUBLIC_PATHS`: the page, its scripts and styles, the API
   docs) and `/api/health` need none: they hold no data. No cookie is ever
   set: cookies ignore ports, so one would reach every other server on the
   same host. The page keeps the token in `sessionStorage`, which is scoped
   to its origin, port included (frontend/api.js).
4. Read-only: every mutating method answers 403 before its body is looked at, except on the
   agent interface (`AGENT_PATH`, server/agent.py): MCP carries reads and writes alike as POSTs,
   and its write tools refuse themselves on a read-only server (an error result, nothing changed).
5. A per-client budget of mutating requests (429 past it).
6. Bodies of mutating requests: 413 past `max_body` bytes; a non-empty body
   must be JSON (`application/json` or `+json`, else 415) and parse (else 422,
   `loc: ["body"]`).
7. The agent interface's event streams (`GET /mcp`, open until the client closes them; a
   stateless server sends nothing on them): at most `streams_per_client` open at once per
   client address (429 past it) and `streams` on the server (503), each slot freed when its
   stream ends. Every page and SSH tunnel of the machine shares 127.0.0.1, whose open HTTP
   connections are capped (serving.py): the streams can never take them all.

No CORS headers are ever sent. Every HTTP response carries `nosniff` and `no-referrer`, and
says who may show it in a frame: nobody by default (`X-Frame-Options: DENY` and
`Content-Security-Policy: frame-ancestors 'none'`: another site cannot overlay the page to
trick a click). A server that `insp.show()` started or was told to (`Guard.frame_ancestors`)
lets the origins it names frame it, and nobody else: `frame-ancestors 'self'` and those origins
(for `show()`, a notebook's: `inspector.notebook.NOTEBOOK_FRAME_ANCESTORS`, loopback pages and VS
Code's webviews), without `X-Frame-Options`, which cannot name an origin.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

from starlette.status import WS_1008_POLICY_VIOLATION
from starlette.types import ASGIApp, Message, Receive, Scope, Send

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
# The static shell of the page: served without a token (a browser's navigation and its <script>
# and <link> requests carry no Authorization header), none of it holds data.
PUBLIC_PATHS = ("/", "/api/health", "/docs", "/openapi.json", "/vendor/plotly.min.js")
PUBLIC_PREFIXES = ("/static/", "/docs-assets/")
AGENT_PATH = "/mcp"  # the agent interface (MCP, streamable HTTP): behind every check but read-only's 403
WS_SUBPROTOCOL = "gradient-inspector"  # what the server selects when the page offers its token
WS_TOKEN_PREFIX = "gi-token."
_SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
_EXTRA_HEADERS = [
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]
_NO_FRAMES = [(b"x-frame-options", b"DENY"), (b"content-security-policy", b"frame-ancestors 'none'")]
_SOURCE = re.compile(r"[a-z][a-z0-9+.-]*:(//[A-Za-z0-9.*-]+(:(\*|[0-9]{1,5}))?(/[A-Za-z0-9._~/-]*)?)?")


def check_frame_ancestor(source: str) -> str:
    """``source`` if it is an origin a CSP `frame-ancestors` list can name (`https://hub.example.com`,
    `http://localhost:*`, `vscode-webview:`); else ValueError naming it."""
    if not isinstance(source, str) or not _SOURCE.fullmatch(source):
        raise ValueError(
            f"frame_ancestors: {source!r} is not an origin such as 'https://hub.example.com' or "
            "'http://localhost:*' (scheme, host, optional port or *)"
        )
    return source


@dataclass
class Guard:
    """What the middleware enforces.

    Attributes:
        token: the access token, or None (loopback binds without `--token`).
        loopback: the server is bound to a loopback address (turns on the Host check).
        read_only: refuse every mutating request with 403.
        max_body: the largest request body, in bytes.
        rate: mutating requests per second per client address, sustained...
        burst: ...and in a burst.
        frame_ancestors: origins whose pages may show this server in a frame (none by default:
            see the module docstring); `allow_frames` adds more while it serves.
        streams_per_client: open `GET /mcp` event streams per client address...
        streams: ...and on the server.
    """

    token: str | None = None
    loopback: bool = True
    read_only: bool = False
    max_body: int = 1 << 20
    rate: float = 50.0
    burst: float = 100.0
    frame_ancestors: tuple[str, ...] = ()
    streams_per_client: int = 4
    streams: int = 16
    headers: list[tuple[bytes, bytes]] = field(
        default_factory=list, init=False, repr=False
    )  # every response's

    def __post_init__(self) -> None:
        self.allow_frames(self.frame_ancestors)

    def allow_frames(self, sources: tuple[str, ...]) -> None:
        """Let pages of these origins (and of its own) show this server in a frame, on top of
        those allowed before; `()` keeps the current rule. Each is checked (ValueError)."""
        added = tuple(check_frame_ancestor(s) for s in sources)
        self.frame_ancestors = tuple(dict.fromkeys((*self.frame_ancestors, *added)))
        if self.frame_ancestors:
            policy = " ".join(("frame-ancestors", "'self'", *self.frame_ancestors)).encode("ascii")
            self.headers = [*_EXTRA_HEADERS, (b"content-security-policy", policy)]
        else:
            self.headers = [*_EXTRA_HEADERS, *_NO_FRAMES]


class TokenBucket:
    """A token bucket: `rate` tokens a second, at most `burst` held, full at the start. One per
    client address here (mutating requests), one per websocket in ws.py (commands)."""

    __slots__ = ("rate", "burst", "tokens", "last")

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens, self.last = burst, time.monotonic()

    def take(self) -> bool:
        """Spend one token if one is there; False (nothing spent) if not."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


def is_loopback_name(name: str) -> bool:
    """Whether a Host name (as `host_name` returns it) is `localhost`, `[::1]`, or a 127.0.0.0/8
    address in plain dotted-quad form: every loopback address a bind can print in its URL."""
    if name in LOOPBACK_NAMES:
        return True
    parts = name.split(".")
    return (
        len(parts) == 4
        and parts[0] == "127"
        and all(p.isascii() and p.isdigit() and str(int(p)) == p and int(p) <= 255 for p in parts)
    )


def host_port_ok(host: str) -> bool:
    """Whether the port part of a Host header value, if any, is digits (`localhost:evil` is not)."""
    host = host.strip()
    if host.startswith("["):
        rest = host[host.find("]") + 1 :] if "]" in host else "?"
    else:
        rest = host[host.find(":") :] if ":" in host else ""
    return rest == "" or (rest[0] == ":" and rest[1:].isascii() and rest[1:].isdigit() and len(rest) <= 6)


def host_name(host: str) -> str:
    """The name part of a Host header value: "[::1]:8000" -> "[::1]", "localhost:80" -> "localhost"."""
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[: end + 1] if end >= 0 else host
    return host.rsplit(":", 1)[0] if ":" in host else host


def _netloc(scheme: str, netloc: str) -> str:
    netloc = netloc.lower()
    default = {"http": ":80", "https": ":443", "ws": ":80", "wss": ":443"}.get(scheme)
    return netloc[: -len(default)] if default and netloc.endswith(default) else netloc


def origin_matches(origin: str, host: str | None, scheme: str) -> bool:
    """Whether an Origin header names the request's own scheme and Host (`https://H` is not the
    origin of a plain-HTTP request to H)."""
    if not host:
        return False
    try:
        parts = urlsplit(origin.strip())
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return False
    own_scheme = "https" if scheme in ("https", "wss") else "http"
    if parts.scheme != own_scheme:
        return False
    return _netloc(parts.scheme, parts.netloc) == _netloc(own_scheme, host)


def is_public(path: str) -> bool:
    """Whether `path` is part of the page's static shell (no token needed)."""
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)


def subprotocol_token(value: str) -> str | None:
    """The token a `Sec-WebSocket-Protocol` header carries as `gi-token.HEX`, or None."""
    for item in value.split(","):
        item = item.strip()
        if item.startswith(WS_TOKEN_PREFIX):
            try:
                return bytes.fromhex(item[len(WS_TOKEN_PREFIX) :]).decode("utf-8")
            except ValueError:  # not hex, or not UTF-8: no token
                return None
    return None


DETAIL_STRING_LIMIT = 1000  # characters of any one string in an error's detail


def bounded_detail(detail: Any, limit: int = DETAIL_STRING_LIMIT) -> Any:
    """An error `detail` with every string in it (messages, `loc` entries) cut to `limit`
    characters plus a note of the full length: a 422 or 404 never echoes unbounded input."""
    if isinstance(detail, str):
        return detail if len(detail) <= limit else f"{detail[:limit]}... ({len(detail)} characters)"
    if isinstance(detail, dict):
        return {bounded_detail(k, limit): bounded_detail(v, limit) for k, v in detail.items()}
    if isinstance(detail, list | tuple):
        return [bounded_detail(v, limit) for v in detail]
    return detail


def _detail(status: int, detail: Any) -> bytes:
    return json.dumps({"detail": detail}, separators=(",", ":")).encode()


class SecurityMiddleware:
    def __init__(self, app: ASGIApp, guard: Guard) -> None:
        self.app = app
        self.guard = guard
        self._buckets: dict[str, TokenBucket] = {}  # client address -> its budget of mutating requests
        self._streams: dict[str, int] = {}  # client address -> its open `GET /mcp` streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        host = headers.get("host")
        method = scope.get("method", "GET") if kind == "http" else "GET"
        mutating = kind == "http" and method not in _SAFE_METHODS
        agent = scope["path"] == AGENT_PATH
        stream = kind == "http" and method == "GET" and agent  # an agent's event stream
        deny = self._check(scope, headers, host, mutating or kind == "websocket" or agent)
        public = kind == "http" and not mutating and is_public(scope["path"])
        if deny is None and self.guard.token and not public:
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            if not self._authorized(headers, query):
                deny = (
                    401,
                    "missing or wrong token: open the URL printed at start-up, or send "
                    "'Authorization: Bearer TOKEN'",
                )
        if deny is None and mutating and self.guard.read_only and not agent:
            deny = (403, "read-only: this server does not accept commands")
        if deny is None and mutating and not self._take(scope):
            deny = (429, "too many commands: slow down")
        if deny is None and stream:
            deny = self._open_stream(scope)
        if deny is not None:
            if kind == "websocket":
                return await self._refuse_socket(scope, receive, send, *deny)
            return await self._respond(send, *deny)
        if kind == "websocket":
            return await self.app(scope, receive, send)
        if stream:
            try:
                return await self.app(scope, receive, _with_headers(send, self.guard.headers))
            finally:
                self._close_stream(scope)
        if mutating:
            body = await self._read_body(receive, headers, send)
            if body is None:
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, _with_headers(send, self.guard.headers))

    # -- checks --------------------------------------------------------------------------------------

    def _check(
        self, scope: Scope, headers: dict[str, str], host: str | None, check_origin: bool
    ) -> tuple[int, str] | None:
        if self.guard.loopback and (
            not host or not is_loopback_name(host_name(host)) or not host_port_ok(host)
        ):
            return (
                403,
                "Host not allowed: on a loopback bind use localhost, 127.0.0.1 (any 127.x.y.z) or "
                "[::1] (DNS-rebinding guard)",
            )
        origin = headers.get("origin")
        if (
            check_origin
            and origin is not None
            and not origin_matches(origin, host, scope.get("scheme", "http"))
        ):
            return (403, "Origin does not match Host: commands are accepted from this server's own page only")
        return None

    def _valid(self, candidate: str) -> bool:
        token = self.guard.token or ""
        return hmac.compare_digest(candidate.encode("utf-8", "replace"), token.encode("utf-8"))

    def _authorized(self, headers: dict[str, str], query: dict[str, list[str]]) -> bool:
        auth = headers.get("authorization", "")
        if auth[:7].lower() == "bearer " and self._valid(auth[7:].strip()):
            return True
        if "token" in query and self._valid(query["token"][0]):
            return True
        offered = subprotocol_token(headers.get("sec-websocket-protocol", ""))
        return offered is not None and self._valid(offered)

    def _take(self, scope: Scope) -> bool:
        client = (scope.get("client") or ("?", 0))[0]
        bucket = self._buckets.get(client)
        if bucket is None:
            if len(self._buckets) >= 10_000:  # many addresses: forget them all rather than grow
                self._buckets.clear()
            bucket = self._buckets[client] = TokenBucket(self.guard.rate, self.guard.burst)
        return bucket.take()

    def _open_stream(self, scope: Scope) -> tuple[int, str] | None:
        """Take a slot for one `GET /mcp` stream, or say why there is none."""
        client = (scope.get("client") or ("?", 0))[0]
        if self._streams.get(client, 0) >= self.guard.streams_per_client:
            return (
                429,
                f"too many open agent event streams (GET /mcp) from this address: at most "
                f"{self.guard.streams_per_client} at once; close one first",
            )
        if sum(self._streams.values()) >= self.guard.streams:
            return (
                503,
                f"too many open agent event streams (GET /mcp) on this server: at most "
                f"{self.guard.streams} at once; close one first",
            )
        self._streams[client] = self._streams.get(client, 0) + 1
        return None

    def _close_stream(self, scope: Scope) -> None:
        client = (scope.get("client") or ("?", 0))[0]
        left = self._streams.get(client, 1) - 1
        if left > 0:
            self._streams[client] = left
        else:
            self._streams.pop(client, None)

    # -- bodies --------------------------------------------------------------------------------------

    async def _read_body(self, receive: Receive, headers: dict[str, str], send: Send) -> bytes | None:
        limit = self.guard.max_body
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            await self._respond(send, 413, f"request body larger than {limit} bytes")
            return None
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._respond(send, 413, f"request body larger than {limit} bytes")
                return None
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        if not body:
            return body
        ctype = headers.get("content-type", "").split(";")[0].strip().lower()
        if not (
            ctype == "application/json" or (ctype.startswith("application/") and ctype.endswith("+json"))
        ):
            await self._respond(send, 415, "the body must be JSON: send 'Content-Type: application/json'")
            return None
        try:
            json.loads(body)
        except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            msg = "nested too deeply" if isinstance(e, RecursionError) else str(e)
            await self._respond(send, 422, [{"loc": ["body"], "msg": f"invalid JSON: {msg}"}])
            return None
        return body

    # -- responses -----------------------------------------------------------------------------------

    async def _respond(self, send: Send, status: int, detail: Any) -> None:
        body = _detail(status, detail)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    *self.guard.headers,
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def _refuse_socket(
        self, scope: Scope, receive: Receive, send: Send, status: int, detail: str
    ) -> None:
        message = await receive()  # websocket.connect
        if message["type"] != "websocket.connect":
            return
        if "websocket.http.response" in scope.get("extensions", {}):
            body = _detail(status, detail)
            await send(
                {
                    "type": "websocket.http.response.start",
                    "status": status,
                    "headers": [(b"content-type", b"application/json"), *self.guard.headers],
                }
            )
            await send({"type": "websocket.http.response.body", "body": body})
        else:
            await send({"type": "websocket.close", "code": WS_1008_POLICY_VIOLATION, "reason": detail[:120]})


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _with_headers(send: Send, extra: list[tuple[bytes, bytes]]) -> Send:
    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = dict(message)
            message["headers"] = [*message.get("headers", []), *extra]
        await send(message)

    return wrapped


# `token=`, also with letters percent-encoded (`%74oken=`): the query parser decodes names, so
# such a spelling authenticates and must not reach the access log either
_TOKEN_RE = re.compile(
    r"((?:t|%74|%54)(?:o|%6f|%4f)(?:k|%6b|%4b)(?:e|%65|%45)(?:n|%6e|%4e)=)[^&\s\"']+", re.IGNORECASE
)


def redact(text: str) -> str:
    """`token=...` in a URL or query string becomes `token=<redacted>` (however it is spelled)."""
    return _TOKEN_RE.sub(r"\1<redacted>", text)


class RedactTokenFilter(logging.Filter):
    """A logging filter that strips `token=...` from a record's message and arguments
    (uvicorn's access log line holds the full path with its query string)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        return True
