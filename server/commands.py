"""The command layer: what the HTTP API (routes/api.py), the websocket's commands (routes/ws.py)
and the agent interface (agent.py) do.

Each function takes the `Source` and input already validated by the protocol's models
(`protocol.HookCreate`, `HookPatch`, `CheckpointBody`, `RewindBody`, `RateBody`...), calls the
source, and returns the result as the HTTP API answers it. A failure is an `ApiError` (status and
`detail`): a route lets the app turn it into the 4xx response, the websocket into an `error`
message, an agent tool into an error result with the same status and detail. Every interface
calls these functions, so they cannot drift apart: the same validation, the same source call, the
same errors.

`validated(model, data)` builds a body from plain values (the agent's tool arguments) with the
same model a route uses, a failure being the route's 422 detail. `internal_error(e)` is the 500
that any other exception becomes (the app's answer to a route's, the agent's error result).
`record(...)` puts one command of an agent in the run's event log (`command` events, PROTOCOL.md
"Events").
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ValidationError

from . import protocol as p
from .history.packing import PER_PARAM as PER_TENSOR
from .history.queries import HistoryQuery
from .hub import wire_snapshot
from .protocol import pydantic_detail
from .security import bounded_detail
from .settings import DETAIL_ALL
from .sources import ApiError, Source

Model = TypeVar("Model", bound=BaseModel)
Action = Literal["pause", "resume", "step"]


def validated(model: type[Model], data: dict[str, Any]) -> Model:
    """`data` as a `model` (a request body's model), or the 422 a route answers for it."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ApiError(422, pydantic_detail(e.errors())) from None  # type: ignore[arg-type]


def internal_error(e: BaseException) -> ApiError:
    """What a failure other than an `ApiError` (a bug, a failing disk) is answered as: a 500
    naming the exception, never a bare 500."""
    return ApiError(500, f"internal error: {type(e).__name__}: {e}")


# -- reads -----------------------------------------------------------------------------------------------


def session(source: Source, run: int | None = None) -> dict[str, Any]:
    """`GET /api/session`."""
    return source.session(run)


def hooks(source: Source) -> list[dict[str, Any]]:
    """`GET /api/hooks`: the requested configuration, pending changes included."""
    return source.hooks()


def events(
    source: Source, run: int | None = None, *, since: int | None = None, limit: int | None = None
) -> dict[str, Any]:
    """`GET /api/events`: events with seq > since, oldest first (the newest `limit`)."""
    return {"events": source.events(run, since=since, limit=limit)}


def checkpoints(source: Source) -> dict[str, Any]:
    """`GET /api/checkpoints`."""
    return source.checkpoints()


def one_of(query: HistoryQuery) -> None:
    """`points` and `buckets` are two ways of thinning a range: a query takes one. Checked after
    every parameter (`run` too) passed validation."""
    if query.points is not None and query.buckets is not None:
        raise ApiError(422, [{"loc": ["query", "buckets"], "msg": "give points or buckets, not both"}])


def snapshots(
    source: Source, query: HistoryQuery, run: int | None = None, *, detail: bool = True
) -> dict[str, Any]:
    """`GET /api/snapshots`: `{"params", "snapshots"}`; with `detail` false a large run's snapshots
    (more than `DETAIL_ALL` tensors) come in the websocket's form, without per-parameter lists."""
    one_of(query)
    names = source.param_names(run)
    if detail or len(names) <= DETAIL_ALL:
        rows = source.snapshots(run, query)
    else:
        rows = [
            {**wire_snapshot(s), **({"events": s["events"]} if "events" in s else {})}
            for s in source.snapshots(run, query, detail=False)
        ]
    return {"params": names, "snapshots": rows}


# the run-wide statistics of a snapshot, as the page's summary shows them
SUMMARY_KEYS = (
    "step",
    "time",
    "config_version",
    "loss",
    "scalars",
    "lr",
    "total_norm_raw",
    "total_norm",
    "total_norm_backward",
    "sampled_every",
    "overhead",
    "hook_effects",
    "noise_scale",
)


def latest(source: Source, *, tensors: bool = False) -> dict[str, Any]:
    """The newest snapshot, bounded: the whole model's statistics (`SUMMARY_KEYS`), the groups'
    aggregates by group name, the worst-now tensors (`worst`), and with `tensors` each tensor's ten
    statistics by name for a run of at most `DETAIL_ALL` tensors (a larger run: `tensors` is null,
    its `worst` and `groups` say where to look). `{"step": null}` before the first snapshot."""
    rows = source.snapshots(None, HistoryQuery(limit=1))
    if not rows:
        return {"step": None, "message": "no snapshot yet: training has not completed a sampled step"}
    snap = rows[-1]
    out: dict[str, Any] = {k: snap.get(k) for k in SUMMARY_KEYS}
    out["worst"] = snap.get("worst")
    names = source.param_names(None)
    groups = snap.get("groups")
    described = source.session(None).get("groups") if isinstance(groups, dict) else None
    group_names = described.get("names") if isinstance(described, dict) else None
    if isinstance(groups, dict) and isinstance(group_names, list):
        out["groups"] = {
            str(name): {k: v[i] for k, v in groups.items() if isinstance(v, list) and i < len(v)}
            for i, name in enumerate(group_names)
        }
    else:
        out["groups"] = None
    out["tensor_count"] = len(names)
    if tensors and len(names) <= DETAIL_ALL:
        out["tensors"] = {
            name: {k: snap[k][i] for k in PER_TENSOR if isinstance(snap.get(k), list) and i < len(snap[k])}
            for i, name in enumerate(names)
        }
    else:
        out["tensors"] = None
    return out


# -- commands ----------------------------------------------------------------------------------------------


def add_hook(source: Source, body: p.HookCreate) -> dict[str, Any]:
    """`POST /api/hooks`: the core validates kind, params, point and target; nothing changes on error."""
    return source.add_hook(
        body.kind, target=body.target, point=body.point, enabled=body.enabled, params=body.params
    )


def update_hook(source: Source, hook_id: str, body: p.HookPatch) -> dict[str, Any]:
    """`PATCH /api/hooks/{id}`: one change (params merged, enable/disable, retarget, move)."""
    return source.update_hook(
        hook_id, params=body.params, enabled=body.enabled, target=body.target, position=body.position
    )


def remove_hook(source: Source, hook_id: str) -> None:
    """`DELETE /api/hooks/{id}`."""
    source.remove_hook(hook_id)


def import_hooks(source: Source, preset: Any) -> list[dict[str, Any]]:
    """`POST /api/hooks/import`: every hook replaced by a preset, as one change."""
    return source.import_hooks(preset)


def training(source: Source, action: Action) -> dict[str, Any]:
    """`POST /api/training/{pause,resume,step}`."""
    return source.training_command(action)


def set_rate(source: Source, body: p.RateBody) -> dict[str, Any]:
    """`POST /api/training/rate`: the demo's steps-per-second cap."""
    return source.set_rate(body.steps_per_second)


def checkpoint(source: Source, body: p.CheckpointBody | None) -> dict[str, Any]:
    """`POST /api/checkpoints`: a checkpoint at the next step boundary."""
    return source.checkpoint(body.label if body is not None else None)


def rewind(source: Source, cp_id: str, body: p.RewindBody | None) -> dict[str, Any]:
    """`POST /api/checkpoints/{id}/rewind`, with its optional `skip`."""
    return source.rewind(cp_id, body.skip if body is not None else None)


def rules(source: Source) -> dict[str, Any]:
    """`GET /api/rules`: the rules (inspector/rules.py), each with its `state`, and the presets."""
    from inspector.rules import PRESETS

    return {"rules": source.rules(), "presets": PRESETS}


def add_rule(source: Source, body: dict[str, Any]) -> dict[str, Any]:
    """`POST /api/rules`: one rule; or, with `{"preset": name}`, a shipped preset's rules
    (`{"rules": [...]}`). A bad field is a 422 naming it; nothing changes."""
    if set(body) == {"preset"}:
        from inspector.rules import PRESETS

        name = body["preset"]
        if not isinstance(name, str) or name not in PRESETS:
            raise ApiError(422, [{"loc": ["body", "preset"], "msg": f"one of {', '.join(PRESETS)}"}])
        return {"rules": source.load_rules(name)}
    return source.add_rule(body)


def update_rule(source: Source, rule_id: str, body: dict[str, Any]) -> dict[str, Any]:
    """`PATCH /api/rules/{id}`: some fields of a rule; 422 naming a bad field, nothing changed."""
    return source.update_rule(rule_id, body)


def remove_rule(source: Source, rule_id: str) -> None:
    """`DELETE /api/rules/{id}`."""
    source.remove_rule(rule_id)


# -- the audit of an agent's commands ----------------------------------------------------------------------


def record(
    source: Source,
    who: str,
    what: str,
    args: dict[str, Any],
    *,
    error: ApiError | None = None,
    hook_id: str | None = None,
) -> None:
    """One command of `who` (`"agent"`) in the run's event log, as a `command` event: `what` (the
    tool), `args` (bounded), `result` (`"ok"` or `"error"`, with the error's `status` and
    `detail`: a failure other than an `ApiError` as `internal_error` words it), and `hook_id`
    when it names a hook. Nothing is recorded where nothing can be (a replay)."""
    fields: dict[str, Any] = {
        "who": who,
        "what": what,
        "args": bounded_detail(args, 200),
        "result": "ok" if error is None else "error",
    }
    if hook_id is not None:
        fields["hook_id"] = hook_id
    if error is not None:
        fields["status"] = error.status
        fields["detail"] = bounded_detail(error.detail, 200)
    source.note_command(fields)
