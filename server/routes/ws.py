"""The websocket endpoint `/ws` (PROTOCOL.md "WebSocket `/ws`" has examples).

The connection opens with `hello` (`Source.hello`): a page that reconnects names what it
has in the query (`/ws?run=R&step=S&since=N&seq=Q`, `resume_of`) and gets only what came
after. Then one connection runs two tasks: the client's sender (`hub.ClientQueue.run`) and a
receive loop that answers commands. Either ending ends the connection:

- the peer went away: the receive loop ends;
- a binary frame, a frame over `max_frame` bytes, or a flood past the command
  budget: closed with 1008 (policy violation);
- the client fell too far behind: the hub kicks it, closed with 1013 (try again later);
- `hello` could not be built: closed with 1011 (internal error);
- the server shuts down: closed with 1001 (going away).

A text frame that is not JSON, or an invalid command, gets an `error` (with the
command's `request_id`, or null when it cannot be read) and the socket stays open.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from typing import Any

from fastapi import WebSocket
from pydantic import ValidationError
from starlette.status import WS_1000_NORMAL_CLOSURE, WS_1008_POLICY_VIOLATION, WS_1011_INTERNAL_ERROR

from .. import commands
from ..hub import ClientHub, ClientQueue
from ..protocol import COMMAND_TYPES, command_adapter, dumps, error_detail, pydantic_detail
from ..security import WS_SUBPROTOCOL, TokenBucket, bounded_detail
from ..settings import Settings
from ..sources import ApiError, Source

log = logging.getLogger("gradient_inspector.server")

RESUME_KEYS = ("run", "step", "since", "seq")


def resume_of(query: Any) -> dict[str, int]:
    """What a reconnecting page says it has, from the websocket's query: its `run`, newest `step`,
    newest snapshot's step (`since`) and newest event's `seq`. A value that is not a plain
    non-negative integer is left out (without `run` the hello is a whole one, as for a new page)."""
    out = {}
    for key in RESUME_KEYS:
        value = query.get(key)
        if isinstance(value, str) and re.fullmatch(r"[0-9]{1,18}", value):
            out[key] = int(value)
    return out


class Connection:
    """One websocket client: hello, then commands in, messages out."""

    def __init__(self, ws: WebSocket, source: Source, hub: ClientHub, settings: Settings) -> None:
        self.ws = ws
        self.source = source
        self.hub = hub
        self.settings = settings
        self.client: ClientQueue = hub.new_client(ws.send_text)
        self.budget = TokenBucket(settings.commands_per_second, 2 * settings.commands_per_second)
        self.hist_set = False
        self.detail_set = False

    async def run(self) -> None:
        client = self.client
        try:
            resume = resume_of(self.ws.query_params)
            hello = await asyncio.to_thread(
                self.source.hello, self.settings.hello_history, self.settings.hello_events, **resume
            )
            had_step = resume.get("since", -1) if hello["resumed"] else -1
            had_seq = resume.get("seq", -1) if hello["resumed"] else -1
            steps = [s.get("step", -1) for s in hello["history"]]
            seqs = [e.get("seq", -1) for e in hello["events"]]
            client.forget_before(max(steps, default=had_step), max(seqs, default=had_seq))
            await self.ws.send_text(dumps({"type": "hello", **hello}))
            if client.close_code is not None:  # kicked while hello was being built
                return
            client.task = asyncio.create_task(client.run())
            receiver = asyncio.create_task(self.receive())
            done, pending = await asyncio.wait({client.task, receiver}, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            for task in (*done, *pending):
                with contextlib.suppress(BaseException):
                    await task
        except Exception as e:  # a failing hello (the source broke): say why, close
            client.kick(WS_1011_INTERNAL_ERROR, f"server error: {type(e).__name__}")
        finally:
            self.hub.remove(client)
            if self.hist_set:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(self.source.set_hist, client.id, [])
            if self.detail_set:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(self.source.set_detail, client.id, [])
            code = client.close_code or WS_1000_NORMAL_CLOSURE
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.ws.close(code, client.close_reason[:120]), 2.0)

    async def receive(self) -> None:
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            text = message.get("text")
            if text is None:
                return self.client.kick(WS_1008_POLICY_VIOLATION, "binary frames are not accepted")
            if len(text) > self.settings.max_frame or len(text.encode("utf-8")) > self.settings.max_frame:
                return self.client.kick(
                    WS_1008_POLICY_VIOLATION, f"frame larger than {self.settings.max_frame} bytes"
                )
            if not self.budget.take():
                return self.client.kick(WS_1008_POLICY_VIOLATION, "too many commands")
            await self.handle(text)

    def reply(self, kind: str, request_id: Any, **fields: Any) -> None:
        self.client.offer(kind, dumps({"type": kind, "request_id": request_id, **fields}))

    def error(self, request_id: Any, status: int, detail: Any) -> None:
        if isinstance(detail, str):
            detail = error_detail((), detail)
        self.reply("error", request_id, status=status, detail=bounded_detail(detail))

    async def handle(self, text: str) -> None:
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as e:
            msg = "nested too deeply" if isinstance(e, RecursionError) else str(e)
            return self.error(None, 422, error_detail(("body",), f"invalid JSON: {msg}"))
        if not isinstance(data, dict):
            return self.error(None, 422, error_detail(("body",), "a command is a JSON object"))
        rid = data.get("request_id")
        rid = rid if isinstance(rid, (str, int)) and not isinstance(rid, bool) else None
        kind = data.get("type")
        if kind not in COMMAND_TYPES:
            return self.error(
                rid,
                422,
                error_detail(("type",), f"unknown command {kind!r}: one of {', '.join(COMMAND_TYPES)}"),
            )
        try:
            cmd = command_adapter.validate_python(data)
        except ValidationError as e:
            errors = [{**err, "loc": tuple(err["loc"])[1:]} for err in e.errors(include_url=False)]
            return self.error(rid, 422, pydantic_detail(errors))
        try:
            result = await self.run_command(cmd)
        except ApiError as e:
            return self.error(rid, e.status, e.detail)
        except Exception as e:  # a bug (ours or the core's): say so, keep the socket open
            log.exception("gradient-inspector server: command %r failed", cmd.type)
            return self.error(rid, 500, f"internal error: {type(e).__name__}: {e}")
        self.reply("ack", rid, result=result)

    async def run_command(self, cmd: Any) -> Any:
        """A command through the command layer (commands.py), as the HTTP API and the agent run
        it: the websocket's command models are the routes' bodies with a `type` (protocol.py)."""
        src = self.source
        if cmd.type == "add_hook":
            return await asyncio.to_thread(commands.add_hook, src, cmd)
        if cmd.type == "update_hook":
            return await asyncio.to_thread(commands.update_hook, src, cmd.id, cmd)
        if cmd.type == "remove_hook":
            await asyncio.to_thread(commands.remove_hook, src, cmd.id)
            return {"id": cmd.id}
        if cmd.type in ("pause", "resume", "step"):
            return await asyncio.to_thread(commands.training, src, cmd.type)
        if cmd.type == "rate":
            return await asyncio.to_thread(commands.set_rate, src, cmd)
        # subscribe: a read (allowed on a read-only server), it changes only this client's stream
        if "max_rate" in cmd.model_fields_set:
            self.client.set_max_rate(cmd.max_rate)
        if cmd.hist is not None:
            await asyncio.to_thread(src.set_hist, self.client.id, cmd.hist)
            self.hist_set = True
        result = {"max_rate": self.client.max_rate, "hist": cmd.hist}
        if cmd.detail is not None:  # a large run's per-parameter detail (unknown names: 422)
            await asyncio.to_thread(src.set_detail, self.client.id, cmd.detail)
            self.detail_set = True
            result["detail"] = cmd.detail
        return result


async def websocket_endpoint(ws: WebSocket) -> None:
    app = ws.app
    # the page offers its token as a second subprotocol (security.py); a browser fails a handshake
    # that selects none of those it offered, so select ours, never the one holding the token
    offered = ws.scope.get("subprotocols") or []
    await ws.accept(subprotocol=WS_SUBPROTOCOL if WS_SUBPROTOCOL in offered else None)
    await Connection(ws, app.state.source, app.state.hub, app.state.settings).run()
