"""The websocket clients' hub: fan-out of core messages to every client, each behind its own queue.

Threads: the core calls the source's subscriber on its dispatcher thread; the
source hands each message to `ClientHub.publish` through `loop.call_soon_threadsafe`,
so everything here runs on the server's event loop and needs no lock.

Each message is serialized once (`protocol.dumps`) and the same text goes to
every client: a large run's snapshot carries the per-parameter detail of the union of what the
clients subscribed to (`wire_snapshot`), not one cut per client. Each client has a `ClientQueue` and a sender task:

- `hooks`, `event`, `ack`, `error` (control messages) wait in order and are
  never dropped (only those `hello` already carried are skipped: see `forget_before`);
- `snapshot` and `scalars` are coalesced: a client keeps at most one pending of
  each, the newest (latest wins), and snapshots go out at most `max_rate` per
  second when the client asked for a cap;
- a client whose control backlog passes `max_backlog` messages or
  `max_backlog_bytes`, or whose socket accepted nothing for `stall_timeout`
  seconds while messages wait, is closed (code 1013, "try again later"); when it
  reconnects, its `hello` (or the HTTP API) brings what it missed.

A stalled socket therefore costs one pending snapshot, one pending scalars and
its bounded backlog; it slows neither training (which never waits for the hub)
nor the other clients (each has its own sender task).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from starlette.status import WS_1001_GOING_AWAY, WS_1013_TRY_AGAIN_LATER

from .history.optim import cut_optim, drop_null_lists
from .history.packing import PER_PARAM, packable, short_values
from .protocol import dumps
from .settings import DETAIL_ALL

TOO_FAR_BEHIND = WS_1013_TRY_AGAIN_LATER  # the close code of a client kicked for its backlog or a stall

SendText = Callable[[str], Awaitable[None]]  # a socket's send_text


FINAL_OF_RAW = {"norm": "norm_raw", "absmax": "absmax_raw"}  # group aggregates: final -> raw


def wire_snapshot(snap: dict[str, Any], index: Sequence[int] = ()) -> dict[str, Any]:
    """A snapshot as the websocket sends it: without `events` (each event goes out once, as an
    `event` message or inside its `hooks` message; the history keeps them in the snapshot).

    A small run's (at most `DETAIL_ALL` parameter tensors) is sent without its group aggregates:
    its page shows every tensor, not groups, and the message stays the size it was before groups
    existed (the history and `GET /api/snapshots` keep them).

    A large run's (more than `DETAIL_ALL` parameter tensors) has its ten per-parameter lists
    replaced by one `detail`: `{"index": [...], key: [values aligned to index], ...}` for the
    parameters `index` (ascending; an out-of-range one is left out). A snapshot that has its
    `detail` already (history read without it) is left as it is. `optim`'s per-parameter lists are
    cut to the same `index` (`optim["index"]`, server/history/optim.py); `optim`'s and
    `noise_scale`'s per-group lists that hold no value (every group's None: an SGD run's Adam
    moments, a noise scale not measured) are left out, and so is a final group aggregate (`norm`,
    `absmax`) equal to its raw one (no hook changed those gradients). The group aggregates and the
    detail's values are written with the fewest digits that keep their float32 value
    (`short_values`: exact for the core's float32 statistics, half as long)."""
    first = snap.get("grad_norm_raw")
    if isinstance(first, list) and len(first) <= DETAIL_ALL and "detail" not in snap:
        # a small run's page shows every tensor, not its groups
        return {k: v for k, v in snap.items() if k not in ("events", "groups")}
    groups = snap.get("groups")
    if isinstance(groups, dict) and all(packable(v) for v in groups.values()):
        short = {k: short_values(v) for k, v in groups.items()}
        for final, raw in FINAL_OF_RAW.items():  # (untouched by any hook: the same list twice)
            if final in short and short[final] == short.get(raw):
                del short[final]
        snap = {**snap, "groups": short}
    if not isinstance(first, list) or "detail" in snap:
        return {k: v for k, v in snap.items() if k != "events"} if "events" in snap else snap
    n = len(first)
    keep = sorted({i for i in index if 0 <= i < n})
    detail: dict[str, list[Any]] = {"index": keep}
    out: dict[str, Any] = {}
    for k, v in snap.items():
        if k in PER_PARAM:
            values = [v[i] for i in keep] if isinstance(v, list) and len(v) == n else [None] * len(keep)
            detail[k] = short_values(values) if packable(values) else values
        elif k != "events":
            out[k] = v
    out["detail"] = detail
    if "optim" in out:  # its per-parameter lists cut the same way (server/history/optim.py)
        out["optim"] = cut_optim(out["optim"], keep)
    noise = out.get("noise_scale")
    if isinstance(noise, dict) and isinstance(noise.get("groups"), dict):
        out["noise_scale"] = {**noise, "groups": drop_null_lists(noise["groups"])}
    return out


def message_text(kind: str, payload: dict[str, Any], data_text: str | None = None) -> str:
    """The wire text of a message (`kind` as the source publishes it).

    `data_text` is the payload already encoded for the wire (for a snapshot, `dumps` of
    `wire_snapshot(payload)`, done once per snapshot by the source, which shares it with the
    history writer): it is wrapped, not encoded again."""
    if kind in ("snapshot", "event"):
        if data_text is not None:
            return f'{{"type":"{kind}","data":{data_text}}}'
        data = wire_snapshot(payload) if kind == "snapshot" else payload
        return dumps({"type": kind, "data": data})
    return dumps({"type": kind, **payload})


def event_seq(kind: str, payload: dict[str, Any]) -> int | None:
    """The event `seq` a message carries (an `event`, or a `hooks` message with its change's
    `hook_applied` event), or None."""
    ev = payload if kind == "event" else payload.get("event") if kind == "hooks" else None
    seq = ev.get("seq") if isinstance(ev, dict) else None
    return seq if isinstance(seq, int) else None


class ClientQueue:
    """One client's outbound queue and its sender loop (see the module docstring)."""

    _ids = itertools.count(1)

    def __init__(
        self,
        send: SendText,
        *,
        max_backlog: int = 512,
        max_backlog_bytes: int = 16 << 20,
        stall_timeout: float = 30.0,
    ) -> None:
        self.id = f"c{next(self._ids)}"
        self._send = send
        self.max_backlog = max_backlog
        self.max_backlog_bytes = max_backlog_bytes
        self.stall_timeout = stall_timeout
        self.max_rate: float | None = None
        self.controls: deque[tuple[str, int | None]] = deque()  # (text, event seq or None)
        self.backlog_bytes = 0
        self.snapshot: str | None = None
        self.snapshot_step = -1
        self.scalars: str | None = None
        self.last_step = -1  # newest snapshot step queued or in hello (duplicates are skipped)
        self.hello_seq = -1  # newest event seq `hello` carried: events up to it are skipped
        self.sent = 0
        self.coalesced = 0
        self.close_code: int | None = None
        self.close_reason = ""
        self.task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._next_snapshot = 0.0
        self._last_snapshot: float | None = None  # loop time of the last snapshot sent
        self._sending_since: float | None = None

    # -- producer side (event loop, synchronous) -----------------------------------------------------

    def rewound(self, step: int) -> None:
        """The run went back to `step` (a rewind): newer snapshots waiting here are of the abandoned
        branch, and the new branch's steps, at or below the last one sent, must go out."""
        if self.snapshot is not None and self.snapshot_step > step:
            self.snapshot = None
        self.scalars = None
        self.last_step = min(self.last_step, step)

    def offer(self, kind: str, text: str, *, step: int | None = None, seq: int | None = None) -> None:
        if self.close_code is not None:
            return
        if kind == "snapshot":
            if step is not None:
                if step <= self.last_step:
                    return
                self.last_step = step
            if self.snapshot is not None:
                self.coalesced += 1
            self.snapshot, self.snapshot_step = text, (step if step is not None else -1)
        elif kind == "scalars":
            if self.scalars is not None:
                self.coalesced += 1
            self.scalars = text
        else:
            if seq is not None and seq <= self.hello_seq:
                return
            self.controls.append((text, seq))
            self.backlog_bytes += len(text)
            if len(self.controls) > self.max_backlog or self.backlog_bytes > self.max_backlog_bytes:
                self.kick(TOO_FAR_BEHIND, "too far behind: reconnect and backfill over HTTP")
                return
        loop_time = asyncio.get_running_loop().time()
        if self._sending_since is not None and loop_time - self._sending_since > self.stall_timeout:
            self.kick(TOO_FAR_BEHIND, "stalled: reconnect and backfill over HTTP")
            return
        self._wake.set()

    def set_max_rate(self, max_rate: float | None) -> None:
        """Change the snapshot rate cap (None: none), counted from the last snapshot sent; a wait
        under the old cap is cut short (event loop only)."""
        self.max_rate = max_rate
        if self._last_snapshot is not None:
            self._next_snapshot = self._last_snapshot + (1.0 / max_rate if max_rate else 0.0)
        self._wake.set()

    def forget_before(self, step: int, seq: int) -> None:
        """Drop what `hello` already carried (or the page had): snapshots up to `step`, events up
        to `seq` (an `event`, or a `hooks` message whose `hook_applied` event it is: the hello's
        session is at least as new as its events, so it has that change's hooks already)."""
        if self.snapshot is not None and self.snapshot_step <= step:
            self.snapshot = None
        kept = [(t, q) for t, q in self.controls if q is None or q > seq]
        self.controls = deque(kept)
        self.backlog_bytes = sum(len(t) for t, _ in kept)
        self.last_step = max(self.last_step, step)
        self.hello_seq = max(self.hello_seq, seq)

    def kick(self, code: int, reason: str) -> None:
        """Stop sending: the endpoint sees the sender task end and closes the socket with `code`."""
        if self.close_code is None:
            self.close_code, self.close_reason = code, reason
            self.controls.clear()
            self.snapshot = self.scalars = None
            if self.task is not None:
                self.task.cancel()

    # -- consumer side -------------------------------------------------------------------------------

    async def _out(self, text: str) -> None:
        self._sending_since = asyncio.get_running_loop().time()
        await self._send(text)
        self._sending_since = None
        self.sent += 1

    async def run(self) -> None:
        """Send until cancelled (by `kick`, or by the endpoint when the socket goes away)."""
        loop = asyncio.get_running_loop()
        while self.close_code is None:
            if not (self.controls or self.snapshot or self.scalars):
                self._wake.clear()
                await self._wake.wait()
            while self.controls:
                text, _ = self.controls.popleft()
                self.backlog_bytes -= len(text)
                await self._out(text)
            wait = 0.0
            if self.snapshot is not None:
                wait = self._next_snapshot - loop.time()
                if wait <= 0:
                    text, self.snapshot = self.snapshot, None
                    self._last_snapshot = loop.time()
                    self._next_snapshot = self._last_snapshot + (
                        1.0 / self.max_rate if self.max_rate else 0.0
                    )
                    await self._out(text)
            if self.scalars is not None:
                text, self.scalars = self.scalars, None
                await self._out(text)
            if wait > 0 and not self.controls:
                self._wake.clear()  # a new control message or scalars ends the wait early
                try:
                    await asyncio.wait_for(self._wake.wait(), wait)
                except TimeoutError:
                    pass


class ClientHub:
    """Every connected websocket client of one app; `publish` runs on the event loop.

    The server's end of the stream; the core's own message feed (its dispatcher thread and
    subscribers) is in `inspector`, one layer down."""

    def __init__(self, **client_options: Any) -> None:
        self.clients: dict[str, ClientQueue] = {}
        self.client_options = client_options
        self.published = 0

    def new_client(self, send: SendText) -> ClientQueue:
        client = ClientQueue(send, **self.client_options)
        self.clients[client.id] = client
        return client

    def remove(self, client: ClientQueue) -> None:
        self.clients.pop(client.id, None)

    def publish(self, kind: str, payload: dict[str, Any], data_text: str | None = None) -> None:
        """Serialize once (or wrap `data_text`, the payload already encoded) and offer to every client."""
        if not self.clients:
            return
        text = message_text(kind, payload, data_text)
        step = payload.get("step") if kind == "snapshot" else None
        seq = event_seq(kind, payload)
        self.published += 1
        rewound = kind == "event" and payload.get("kind") == "rewind"
        for client in list(self.clients.values()):
            if rewound:
                client.rewound(int(payload.get("step") or 0))
            client.offer(kind, text, step=step, seq=seq)

    def close_all(self, code: int = WS_1001_GOING_AWAY, reason: str = "server shutting down") -> None:
        for client in list(self.clients.values()):
            client.kick(code, reason)
