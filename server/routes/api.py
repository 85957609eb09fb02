"""The HTTP routes under /api. PROTOCOL.md ("HTTP") shows each with example JSON.

Routes are plain `def`s: FastAPI runs them on its thread pool, so a core call that
waits for a lock never blocks the event loop that feeds the websockets.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Depends, Path, Query, Request, Response
from fastapi.responses import PlainTextResponse

from .. import commands
from .. import protocol as p
from ..history.export import python_code
from ..history.queries import MAX_BUCKETS, MAX_ROWS, HistoryQuery
from ..settings import DETAIL_CAP
from ..sources import ApiError, Source

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": p.ErrorBody, "description": "missing or wrong token"},
    403: {"model": p.ErrorBody, "description": "foreign Origin or Host, or a command on a read-only server"},
}
_INVALID = {422: {"model": p.ErrorBody, "description": "invalid input: `detail` names the field"}}
_COMMAND = {
    **_INVALID,
    413: {"model": p.ErrorBody, "description": "body too large"},
    415: {"model": p.ErrorBody, "description": "the body is not JSON"},
    429: {"model": p.ErrorBody, "description": "too many commands"},
}
_UNKNOWN = {404: {"model": p.ErrorBody, "description": "unknown id or run"}}

router = APIRouter(prefix="/api", responses=_ERRORS)


def get_source(request: Request) -> Source:
    return request.app.state.source


SourceDep = Annotated[Source, Depends(get_source)]
SQLITE_MAX = 2**63 - 1  # the largest SQLite INTEGER: a bigger id or step would be a 500 (OverflowError)
RunQuery = Annotated[
    int | None, Query(ge=0, le=SQLITE_MAX, description="a run id; the current (or replayed) run when absent")
]
SinceQuery = Annotated[
    int | None, Query(ge=-1, le=SQLITE_MAX, description="only items after this step (seq for events)")
]
LimitQuery = Annotated[int | None, Query(ge=1, le=MAX_ROWS, description="only the newest N")]
PointsQuery = Annotated[
    int | None, Query(ge=1, le=MAX_ROWS, description="N points spread evenly over the range")
]
UntilQuery = Annotated[int | None, Query(ge=0, le=SQLITE_MAX, description="only steps <= this one")]
BucketsQuery = Annotated[
    int | None,
    Query(
        ge=1,
        le=MAX_BUCKETS,
        description="downsampled: the range cut into N buckets of equal width, of each the steps of the"
        " smallest and largest values kept (spikes survive); every step when there are no more than N",
    ),
]


def history_query(
    since: SinceQuery = None,
    until: UntilQuery = None,
    limit: LimitQuery = None,
    points: PointsQuery = None,
    buckets: BucketsQuery = None,
) -> HistoryQuery:
    """The query parameters of `/api/snapshots` and `/api/scalars`, validated, as one `HistoryQuery`."""
    return HistoryQuery(since=since, until=until, limit=limit, points=points, buckets=buckets)


HistoryQueryDep = Annotated[HistoryQuery, Depends(history_query)]


@router.get("/health", response_model=p.Health, tags=["server"])
def health() -> dict[str, str]:
    """Liveness; needs no token."""
    return {"status": "ok"}


@router.get("/session", response_model=None, tags=["server"], responses=_UNKNOWN)
def session(source: SourceDep, run: RunQuery = None) -> dict[str, Any]:
    """Everything a page needs to start: parameters, modules, hook kinds, hooks, training state."""
    return commands.session(source, run)


@router.get("/runs", response_model=None, tags=["history"], responses={200: {"model": p.RunList}})
def runs(source: SourceDep) -> dict[str, Any]:
    """The runs in the database, newest first."""
    return {"runs": source.runs()}


@router.get(
    "/targets", response_model=None, tags=["hooks"], responses={200: {"model": p.Targets}, **_INVALID}
)
def targets(
    source: SourceDep,
    glob: Annotated[str, Query(max_length=256, description="fnmatchcase pattern over full dotted names")],
    point: Annotated[str | None, Query(max_length=64)] = None,
) -> dict[str, Any]:
    """The parameter (or, for `point=module`, module) names a target pattern matches."""
    return {"matches": source.targets(glob, point)}


@router.get("/hooks", response_model=None, tags=["hooks"], responses={200: {"model": list[p.HookSpec]}})
def list_hooks(source: SourceDep) -> list[dict[str, Any]]:
    """The requested configuration, pending changes included (`applied_step: null`)."""
    return commands.hooks(source)


@router.post(
    "/hooks",
    response_model=None,
    status_code=201,
    tags=["hooks"],
    responses={201: {"model": p.HookSpec}, **_COMMAND},
)
def add_hook(source: SourceDep, body: p.HookCreate) -> dict[str, Any]:
    """Add a hook. The core validates kind, params, point and target; nothing changes on error."""
    return commands.add_hook(source, body)


@router.get(
    "/hooks/export",
    response_model=None,
    tags=["hooks"],
    responses={
        200: {
            "content": {"application/json": {}, "text/x-python": {}},
            "description": "a preset, or Python code",
        },
        **_INVALID,
    },
)
def export_hooks(source: SourceDep, format: Literal["json", "python"] = "json") -> Any:
    """The hooks as a preset (JSON, for `/api/hooks/import` and `demo --hooks`), or as Python code
    that recreates them with `insp.add_hook(...)`."""
    preset = source.export_hooks()
    if format == "python":
        return PlainTextResponse(python_code(preset), media_type="text/x-python; charset=utf-8")
    return preset


@router.post(
    "/hooks/import",
    response_model=None,
    tags=["hooks"],
    responses={200: {"model": list[p.HookSpec]}, **_COMMAND},
)
def import_hooks(source: SourceDep, preset: Annotated[p.Preset, Body()]) -> list[dict[str, Any]]:
    """Replace every hook with a preset, as one change (all validated first)."""
    return commands.import_hooks(source, preset)


@router.patch(
    "/hooks/{hook_id}",
    response_model=None,
    tags=["hooks"],
    responses={200: {"model": p.HookSpec}, **_COMMAND, **_UNKNOWN},
)
def update_hook(source: SourceDep, hook_id: str, body: p.HookPatch) -> dict[str, Any]:
    """One change: merge `params` (only the given keys change), enable/disable, retarget, or move."""
    return commands.update_hook(source, hook_id, body)


@router.delete(
    "/hooks/{hook_id}",
    response_model=None,
    status_code=204,
    tags=["hooks"],
    responses={**_UNKNOWN, 429: _COMMAND[429]},
)
def remove_hook(source: SourceDep, hook_id: str) -> Response:
    commands.remove_hook(source, hook_id)
    return Response(status_code=204)


@router.get("/rules", response_model=None, tags=["rules"])
def list_rules(source: SourceDep) -> dict[str, Any]:
    """The rules (inspector/rules.py), each with its definition and `state`, and the presets."""
    return commands.rules(source)


@router.post("/rules", status_code=201, response_model=None, tags=["rules"], responses=_COMMAND)
def add_rule(source: SourceDep, body: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
    """Add a rule: `{"signal", "op", "threshold", "for_steps", "action", "args", "cooldown", ...}`;
    or, with `{"preset": name}`, the rules of a shipped preset (`{"rules": [...]}` returned then).
    A bad field is a 422 naming it; nothing is changed."""
    return commands.add_rule(source, body)


@router.patch("/rules/{rule_id}", response_model=None, tags=["rules"], responses={**_COMMAND, **_UNKNOWN})
def update_rule(source: SourceDep, rule_id: str, body: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
    """Change some fields of a rule (`{"enabled": false}`...); 422 naming a bad field, nothing changed."""
    return commands.update_rule(source, rule_id, body)


@router.delete("/rules/{rule_id}", status_code=204, response_model=None, tags=["rules"], responses=_UNKNOWN)
def remove_rule(source: SourceDep, rule_id: str) -> Response:
    commands.remove_rule(source, rule_id)
    return Response(status_code=204)


@router.get("/flight", response_model=None, tags=["history"], responses={**_INVALID, **_UNKNOWN})
def flight(
    source: SourceDep,
    run: RunQuery = None,
    since: SinceQuery = None,
    until: UntilQuery = None,
    tensors: bool = False,
) -> dict[str, Any]:
    """The flight recorder's dumped steps (stored on a spike, a NaN/Inf or a request), oldest
    first: `{"rows": [{"step", "loss", "nonfinite", "norm_raw", "norm", "groups_raw"}, ...]}`, with
    each tensor's `raw` and `final` norms when `tensors`."""
    return {"rows": source.flight(run, since=since, until=until, tensors=tensors)}


@router.post("/flight", response_model=None, tags=["training"], responses=_COMMAND)
def flight_now(source: SourceDep, tensors: bool = False) -> dict[str, Any]:
    """Read the live flight recorder now (one device-to-host transfer): its last steps, stored and
    sent to every page as a `flight` message; also the recorder's memory (`bytes`)."""
    return source.flight_now(tensors=tensors)


@router.get("/spikes", response_model=None, tags=["training"])
def spikes(source: SourceDep) -> dict[str, Any]:
    """The spike detector's settings (`null`: no live training, or the recorder is off)."""
    return {"settings": source.spike_settings()}


@router.put("/spikes", response_model=None, tags=["training"], responses=_COMMAND)
def set_spikes(source: SourceDep, body: p.SpikeBody) -> dict[str, Any]:
    """Change the spike detector's settings (those given): takes effect at the next step."""
    return {"settings": source.set_spikes(body.model_dump(exclude_none=True))}


@router.post(
    "/training/rate",
    response_model=None,
    tags=["training"],
    responses={409: {"model": p.ErrorBody, "description": "not a demo"}, **_COMMAND},
)
def training_rate(source: SourceDep, body: p.RateBody) -> dict[str, Any]:
    """The demo's steps-per-second cap (`null`: none). Takes effect at once."""
    return commands.set_rate(source, body)


@router.post(
    "/training/{action}",
    status_code=202,
    response_model=None,
    tags=["training"],
    responses={202: {"model": p.TrainingState}, 429: _COMMAND[429], **_INVALID},
)
def training(source: SourceDep, action: Literal["pause", "resume", "step"]) -> dict[str, Any]:
    """Pause, resume, or run exactly one step then pause. No body needed."""
    return commands.training(source, action)


@router.get(
    "/snapshots",
    response_model=None,
    tags=["history"],
    responses={200: {"model": p.SnapshotPage}, **_INVALID, **_UNKNOWN},
)
def snapshots(
    source: SourceDep,
    query: HistoryQueryDep,
    run: RunQuery = None,
    detail: Annotated[
        bool,
        Query(
            description="false: a large run's snapshots (more than 64 tensors) without their per-parameter"
            " lists, in the websocket's form (an empty `detail`; `GET /api/detail` has them)"
        ),
    ] = True,
) -> dict[str, Any]:
    """Snapshots with since < step <= until, oldest first: the newest `limit`, then `points` spread
    evenly, or with `buckets` the steps of each bucket's smallest and largest global gradient norms
    (raw and final)."""
    return commands.snapshots(source, query, run, detail=detail)


@router.get("/scalars", response_model=None, tags=["history"], responses={**_INVALID, **_UNKNOWN})
def scalars(source: SourceDep, query: HistoryQueryDep, run: RunQuery = None) -> dict[str, Any]:
    """Loss and scalars of every recorded step (also the steps the sampler skipped); with `buckets`
    the steps of each bucket's smallest and largest loss."""
    one_of(query)
    rows = source.scalars(run, query)
    return {"scalars": rows}


one_of = commands.one_of  # checked in the route, after every parameter (`run` too) passed validation


DETAIL_LIMIT = 5000  # the most steps one `/api/detail` request returns
DETAIL_CELLS = 256 * 600  # the most (parameter, step) pairs one answer holds: a page's own backfill


@router.get(
    "/detail",
    response_model=None,
    tags=["history"],
    responses={200: {"model": p.DetailPage}, **_INVALID, **_UNKNOWN},
)
def detail(
    source: SourceDep,
    params: Annotated[
        str,
        Query(
            min_length=1,
            max_length=256 * 513,
            description="parameter names, comma-separated (at most 256)",
        ),
    ],
    since: SinceQuery = None,
    limit: Annotated[int, Query(ge=1, le=DETAIL_LIMIT, description="only the newest N steps")] = 600,
    run: RunQuery = None,
) -> dict[str, Any]:
    """The ten per-parameter statistics of some parameters over the newest `limit` recorded steps
    after `since`, oldest first: `{"steps", "params", "stats": {statistic: [[value per step] per
    parameter]}}`; null where a step has no value (its detail thinned past the history's window).
    One answer holds at most 153,600 (parameter, step) pairs (256 parameters x 600 steps, or fewer
    parameters over more steps): ask in parts for more."""
    names = [n.strip() for n in params.split(",") if n.strip()]
    if not names or len(names) > DETAIL_CAP:
        raise ApiError(
            422,
            [{"loc": ["query", "params"], "msg": f"give 1 to {DETAIL_CAP} parameter names, comma-separated"}],
        )
    if len(names) * limit > DETAIL_CELLS:
        raise ApiError(
            422,
            [
                {
                    "loc": ["query", "limit"],
                    "msg": f"{len(names)} parameters x {limit} steps is over {DETAIL_CELLS} values of"
                    f" each statistic in one answer: at most {DETAIL_CELLS // len(names)} steps for"
                    f" {len(names)} parameters",
                }
            ],
        )
    return source.detail(run, names, since=since, limit=limit)


@router.get(
    "/events",
    response_model=None,
    tags=["history"],
    responses={200: {"model": p.EventPage}, **_INVALID, **_UNKNOWN},
)
def events(
    source: SourceDep, since: SinceQuery = None, limit: LimitQuery = None, run: RunQuery = None
) -> dict[str, Any]:
    """Events with seq > since, oldest first."""
    return commands.events(source, run, since=since, limit=limit)


# -- what-if: checkpoints, rewind, the demo's shadow comparison (server/live/whatif.py) --------------------
_WHATIF = {409: {"model": p.ErrorBody, "description": "refused here: `detail` says why"}}
CheckpointId = Annotated[str, Path(min_length=1, max_length=64, description="a checkpoint id, e.g. c2")]


@router.get("/checkpoints", response_model=None, tags=["what-if"], responses=_UNKNOWN)
def list_checkpoints(source: SourceDep) -> dict[str, Any]:
    """The checkpoints kept in host memory (newest `keep`), their bytes, and `refused`: why
    checkpoints cannot be taken here (null when they can)."""
    return commands.checkpoints(source)


@router.post(
    "/checkpoints",
    status_code=202,
    response_model=None,
    tags=["what-if"],
    responses={**_COMMAND, **_WHATIF},
)
def take_checkpoint(source: SourceDep, body: p.CheckpointBody | None = None) -> dict[str, Any]:
    """Save the model, optimizer and inspector state at the next step boundary (`taken` false
    until then)."""
    return commands.checkpoint(source, body)


@router.post(
    "/checkpoints/{cp_id}/rewind",
    status_code=202,
    response_model=None,
    tags=["what-if"],
    responses={**_COMMAND, **_UNKNOWN, **_WHATIF, **_INVALID},
)
def rewind(source: SourceDep, cp_id: CheckpointId, body: p.RewindBody | None = None) -> dict[str, Any]:
    """Go back to a checkpoint at the next step boundary: state, step counter and hooks; the
    abandoned steps stay in the history as a branch run (`/api/runs`). `skip`: batches the new
    branch does not receive (`"since_checkpoint"`, a count, `[first, last]`), recorded as a
    `batches_skipped` event; one that cannot be honoured is a 422 naming why, nothing changed."""
    return commands.rewind(source, cp_id, body)


@router.get("/shadow", response_model=None, tags=["what-if"])
def shadow(source: SourceDep) -> dict[str, Any]:
    """The demo's comparison: the running (or last) shadow and its points; `active: false` and
    no `run` when there has been none (or this is not a demo)."""
    state = source.shadow_state()
    return state if state is not None else {"active": False, "run": None, "branch_step": None, "label": None}


@router.post(
    "/shadow", status_code=202, response_model=None, tags=["what-if"], responses={**_COMMAND, **_WHATIF}
)
def shadow_start(source: SourceDep) -> dict[str, Any]:
    """ "Compare from here": a checkpoint now and a shadow copy trained from it on the same batches
    with the current hooks, while later hook changes apply to the main run only. Demo only."""
    return source.shadow_start()


@router.delete("/shadow", status_code=204, response_model=None, tags=["what-if"], responses=_WHATIF)
def shadow_stop(source: SourceDep) -> Response:
    """End the comparison; what it recorded stays in the history."""
    source.shadow_stop()
    return Response(status_code=204)
