"""The agent interface: an MCP server at `/mcp` of the dashboard's port (streamable HTTP).

Built on the official `mcp` SDK (`MCPServer`, its streamable HTTP transport), served by the same
app and so behind the same guards (security.py): the Host and Origin checks, the token (as
`Authorization: Bearer T`), the rate limit and the body checks. MCP carries every message as a
POST, so the read-only guard lets `/mcp` through and each write tool refuses itself on a
read-only server, with an error result and nothing changed.

Every tool calls the command layer (commands.py) that the HTTP routes call: the same validation
(the routes' body models), the same source call, the same errors (an `ApiError` becomes an error
result holding its status and detail; any other exception the HTTP API's 500, `500: internal
error: TYPE: MESSAGE`, never the SDK's bare "Error executing tool"). Every write tool call that
gets past the read-only refusal is recorded in the run's event log as one `command` event with
`who: "agent"` (`commands.record`), whatever its outcome.

The SDK's server configures the process's logging when it is built (`logging.basicConfig`);
`build` keeps the logging as it found it (`_logging_as_found`): the server may run inside the
user's training process.

Without the `mcp` package (`pip install gradient-inspector[agent]`) the product works as before
and `/mcp` answers 501 saying what to install.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field

from . import commands
from . import protocol as p
from .history.queries import HistoryQuery
from .protocol import StrictJSONResponse
from .security import AGENT_PATH, bounded_detail
from .sources import ApiError, Source, read_only_error

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger("gradient_inspector.server")

INSTALL_HINT = "pip install gradient-inspector[agent]"
MAX_HISTORY = 500  # the most snapshots one `history` call returns
MAX_EVENTS = 1000  # the most events one `events` call returns
HookId = Annotated[str, Field(min_length=1, max_length=64)]
CheckpointId = Annotated[str, Field(min_length=1, max_length=64)]
RuleId = Annotated[str, Field(min_length=1, max_length=64)]
INSTRUCTIONS = (
    "gradient-inspector: live gradient statistics of a PyTorch training run, and hooks that edit "
    "the gradients. Read with get_session, latest_statistics, history, events, list_hooks and "
    "list_checkpoints; change the run with add_hook, update_hook, remove_hook, enable_hook, "
    "disable_hook, training (pause/resume/step), checkpoint, rewind, and the rules (list_rules, "
    "add_rule, update_rule, remove_rule). A change is validated "
    "first: an invalid one is an error naming the field, and nothing changes. Every change is "
    "recorded in the run's event log as the agent's."
)


def available() -> bool:
    """Whether the `mcp` SDK is installed (the `agent` extra)."""
    return importlib.util.find_spec("mcp") is not None


def mount(
    app: FastAPI, source: Source, *, read_only: bool
) -> Callable[[], AbstractAsyncContextManager[None]]:
    """Serve the agent interface at `AGENT_PATH` of `app`; returns what the app's lifespan runs
    (the transport's session manager; nothing without the SDK)."""
    if not available():
        _mount_missing(app)
        return _nothing
    from starlette.routing import Route

    server = build(source, read_only=read_only)
    from mcp.server.transport_security import TransportSecuritySettings

    http = server.streamable_http_app(
        streamable_http_path=AGENT_PATH,
        stateless_http=True,  # each POST stands alone: no session state to keep or expire
        json_response=True,
        # Host and Origin are checked by the app's own guard (security.py), with its bind rules
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
    )
    for route in http.routes:
        if isinstance(route, Route) and route.path == AGENT_PATH:
            app.router.routes.append(route)
    return server.session_manager.run


@asynccontextmanager
async def _nothing() -> AsyncIterator[None]:
    yield


def _mount_missing(app: FastAPI) -> None:
    @app.api_route(AGENT_PATH, methods=["GET", "POST", "DELETE"], include_in_schema=False)
    def missing() -> StrictJSONResponse:
        return StrictJSONResponse(
            {
                "detail": "the agent interface (MCP) needs the mcp package, which is not installed: "
                f"{INSTALL_HINT}"
            },
            status_code=501,
        )


def _error(e: ApiError) -> Exception:
    from mcp.server.mcpserver.exceptions import ToolError

    detail = bounded_detail(e.detail)
    text = detail if isinstance(detail, str) else json.dumps(detail)
    return ToolError(f"{e.status}: {text}")


@contextmanager
def _logging_as_found() -> Iterator[None]:
    """The process's logging, as it was on entry, kept through the block: the root logger's
    handlers and level, and the level of every logger there was. The SDK's `MCPServer()`
    configures logging for a process of its own (`logging.basicConfig(level=INFO)` with a Rich
    handler, when the root has no handler): here it runs in the user's process, which owns its
    logging. The root is given a handler for the block, so that `basicConfig` does nothing;
    whatever was added anyway is taken off after it, and the levels put back."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    levels = {
        name: logger.level
        for name, logger in list(logging.Logger.manager.loggerDict.items())
        if isinstance(logger, logging.Logger)
    }
    placeholder = logging.NullHandler()
    root.addHandler(placeholder)
    try:
        yield
    finally:
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)
                if handler is not placeholder:
                    handler.close()
        root.setLevel(level)
        for name, was in levels.items():
            logger = logging.getLogger(name)
            if logger.level != was:
                logger.setLevel(was)


def _failure(what: str, e: Exception) -> ApiError:
    """A tool's failure as the HTTP API would answer it: an `ApiError` as it is, anything else
    (a bug, a failing disk) the 500 naming the exception (`commands.internal_error`), logged
    with its traceback as the app logs a route's."""
    if isinstance(e, ApiError):
        return e
    log.error("gradient-inspector agent: unexpected error in %s tool", what, exc_info=e)
    return commands.internal_error(e)


def _record(source: Source, what: str, args: dict[str, Any], **outcome: Any) -> None:
    """`commands.record` of one agent write; a failure to record is logged, and the tool's own
    outcome (the change made, or its error) is what the agent is told."""
    try:
        commands.record(source, "agent", what, args, **outcome)
    except Exception:  # noqa: BLE001
        log.exception("gradient-inspector agent: the %s command could not be recorded", what)


def build(source: Source, *, read_only: bool) -> Any:
    """The `MCPServer` with every tool, on `source`."""
    from mcp.server.mcpserver import MCPServer
    from mcp_types import ToolAnnotations

    from .app import version

    with _logging_as_found():  # its constructor calls logging.basicConfig(INFO, a Rich handler)
        server = MCPServer("gradient-inspector", version=version(), instructions=INSTRUCTIONS)
    reads = ToolAnnotations(read_only_hint=True, destructive_hint=False)
    writes = ToolAnnotations(read_only_hint=False, destructive_hint=True)

    def read(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - every failure is an error result with its reason
            raise _error(_failure("a read", e)) from None

    def write(what: str, args: dict[str, Any], fn: Callable[[], Any], hook_id: str | None = None) -> Any:
        if read_only:
            raise _error(read_only_error())
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - every failure is recorded, and answered with its reason
            error = _failure(what, e)
            _record(source, what, args, error=error, hook_id=hook_id)
            raise _error(error) from None
        if what == "add_hook" and isinstance(result, dict) and isinstance(result.get("id"), str):
            hook_id = result["id"]
        _record(source, what, args, hook_id=hook_id)
        return result

    # -- reads ---------------------------------------------------------------------------------------

    @server.tool(annotations=reads)
    def get_session() -> dict[str, Any]:
        """The session, as GET /api/session returns it: parameters, modules, groups, hook kinds
        (with their parameters), hooks, the training state, read_only, checkpoints."""
        return read(lambda: commands.session(source))

    @server.tool(annotations=reads)
    def latest_statistics(tensors: bool = False) -> dict[str, Any]:
        """The newest snapshot's statistics: the whole model's (loss, total gradient norm before
        and after the hooks, learning rates, hook effects, noise scale), each group's aggregates,
        the worst tensors now (`worst`), and with `tensors` each tensor's ten statistics (runs of
        at most 64 tensors; larger runs: look at `worst` and `groups`)."""
        return read(lambda: commands.latest(source, tensors=tensors))

    @server.tool(annotations=reads)
    def history(
        since: Annotated[int | None, Field(ge=-1)] = None,
        until: Annotated[int | None, Field(ge=0)] = None,
        limit: Annotated[int, Field(ge=1, le=MAX_HISTORY)] = 50,
        points: Annotated[int | None, Field(ge=1, le=MAX_HISTORY)] = None,
        buckets: Annotated[int | None, Field(ge=1, le=MAX_HISTORY // 2)] = None,
        detail: bool = False,
    ) -> dict[str, Any]:
        """Recorded snapshots with since < step <= until, oldest first, as GET /api/snapshots:
        the newest `limit` (at most 500), then `points` spread evenly, or with `buckets` the steps
        of each bucket's smallest and largest gradient norm. `detail` false: a run of more than 64
        tensors comes without its per-tensor lists."""
        query = HistoryQuery(since=since, until=until, limit=limit, points=points, buckets=buckets)
        return read(lambda: commands.snapshots(source, query, detail=detail))

    @server.tool(annotations=reads)
    def events(
        since: Annotated[int | None, Field(ge=-1)] = None,
        limit: Annotated[int, Field(ge=1, le=MAX_EVENTS)] = 100,
    ) -> dict[str, Any]:
        """Events with seq > since, oldest first (the newest `limit`): hook changes, NaN/Inf,
        hook errors, spikes, checkpoints, rewinds, the agent's own commands."""
        return read(lambda: commands.events(source, since=since, limit=limit))

    @server.tool(annotations=reads)
    def list_hooks() -> dict[str, Any]:
        """The hooks as requested, pending changes included (`applied_step` null until applied)."""
        return {"hooks": read(lambda: commands.hooks(source))}

    @server.tool(annotations=reads)
    def list_checkpoints() -> dict[str, Any]:
        """The checkpoints kept in memory, and `refused`: why none can be taken (null if they can)."""
        return read(lambda: commands.checkpoints(source))

    # -- writes --------------------------------------------------------------------------------------

    @server.tool(annotations=writes)
    def add_hook(
        kind: str,
        target: str = "*",
        params: dict[str, Any] | None = None,
        point: str | None = None,
        enabled: bool = True,
    ) -> dict[str, Any]:
        """Add a hook of `kind` (see get_session's hook_kinds) on the parameters `target` matches
        (an fnmatch pattern over dotted names). Validated first; returns the hook as accepted."""
        args = {"kind": kind, "target": target, "params": params or {}, "point": point, "enabled": enabled}
        return write(
            "add_hook", args, lambda: commands.add_hook(source, commands.validated(p.HookCreate, args))
        )

    @server.tool(annotations=writes)
    def update_hook(
        hook_id: HookId,
        params: dict[str, Any] | None = None,
        enabled: bool | None = None,
        target: str | None = None,
        position: int | None = None,
    ) -> dict[str, Any]:
        """One change to a hook: merge `params` (only the keys given change), enable or disable,
        retarget, or move to `position`."""
        args = {
            k: v
            for k, v in {"params": params, "enabled": enabled, "target": target, "position": position}.items()
            if v is not None
        }
        return write(
            "update_hook",
            {"hook_id": hook_id, **args},
            lambda: commands.update_hook(source, hook_id, commands.validated(p.HookPatch, args)),
            hook_id=hook_id,
        )

    @server.tool(annotations=writes)
    def enable_hook(hook_id: HookId) -> dict[str, Any]:
        """Enable a hook."""
        body = p.HookPatch(enabled=True)
        return write(
            "enable_hook",
            {"hook_id": hook_id},
            lambda: commands.update_hook(source, hook_id, body),
            hook_id=hook_id,
        )

    @server.tool(annotations=writes)
    def disable_hook(hook_id: HookId) -> dict[str, Any]:
        """Disable a hook (it stays in the list, doing nothing)."""
        body = p.HookPatch(enabled=False)
        return write(
            "disable_hook",
            {"hook_id": hook_id},
            lambda: commands.update_hook(source, hook_id, body),
            hook_id=hook_id,
        )

    @server.tool(annotations=writes)
    def remove_hook(hook_id: HookId) -> dict[str, Any]:
        """Remove a hook."""

        def run() -> dict[str, Any]:
            commands.remove_hook(source, hook_id)
            return {"removed": hook_id}

        return write("remove_hook", {"hook_id": hook_id}, run, hook_id=hook_id)

    @server.tool(annotations=writes)
    def training(action: Literal["pause", "resume", "step"]) -> dict[str, Any]:
        """Pause, resume, or run exactly one step then pause."""
        return write("training", {"action": action}, lambda: commands.training(source, action))

    @server.tool(annotations=writes)
    def checkpoint(label: str | None = None) -> dict[str, Any]:
        """Save the model, optimizer and inspector state at the next step boundary."""
        args = {"label": label} if label is not None else {}
        return write(
            "checkpoint",
            args,
            lambda: commands.checkpoint(source, commands.validated(p.CheckpointBody, args)),
        )

    @server.tool(annotations=writes)
    def rewind(checkpoint_id: CheckpointId, skip: str | int | list[int] | None = None) -> dict[str, Any]:
        """Go back to a checkpoint at the next step boundary (state, step counter, hooks). `skip`:
        batches the new branch does not receive: "since_checkpoint", a count, or [first, last]."""
        args = {"skip": skip} if skip is not None else {}
        return write(
            "rewind",
            {"checkpoint_id": checkpoint_id, **args},
            lambda: commands.rewind(source, checkpoint_id, commands.validated(p.RewindBody, args)),
        )

    # -- rules (inspector/rules.py) -------------------------------------------------------------------

    @server.tool(annotations=reads)
    def list_rules() -> dict[str, Any]:
        """The rules ("when SIGNAL OP THRESHOLD [for K steps] then ACTION"), each with its state,
        and the shipped presets."""
        return read(lambda: commands.rules(source))

    @server.tool(annotations=writes)
    def add_rule(rule: dict[str, Any] | None = None, preset: str | None = None) -> dict[str, Any]:
        """Add a rule (`{"signal", "op", "threshold", "for_steps", "action", "args", "cooldown"}`,
        as POST /api/rules takes it), or with `preset` the rules of a shipped preset."""
        body = {"preset": preset} if preset is not None else (rule or {})
        return write("add_rule", body, lambda: commands.add_rule(source, body))

    @server.tool(annotations=writes)
    def update_rule(rule_id: RuleId, change: dict[str, Any]) -> dict[str, Any]:
        """Change some fields of a rule (`{"enabled": false}`, `{"threshold": 20}`...)."""
        return write(
            "update_rule",
            {"rule_id": rule_id, "change": change},  # its arguments as given: a key of change named
            # rule_id stays in change, where the refusal names it
            lambda: commands.update_rule(source, rule_id, change),
        )

    @server.tool(annotations=writes)
    def remove_rule(rule_id: RuleId) -> dict[str, Any]:
        """Remove a rule."""

        def run() -> dict[str, Any]:
            commands.remove_rule(source, rule_id)
            return {"removed": rule_id}

        return write("remove_rule", {"rule_id": rule_id}, run)

    return server
