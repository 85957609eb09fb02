"""Wire models and strict JSON: everything that crosses HTTP or the websocket.

Pydantic models exist only here, at the wire. They check the shape of a request
(unknown keys, JSON types); the meaning of a hook (kinds, params, targets) is
validated by the core (`inspector.HookError`), never re-implemented here.

Strict JSON: no `NaN`/`Infinity` literals go out. A non-finite float becomes the
string "nan", "inf" or "-inf" (PROTOCOL.md "Conventions"), by the core's rule
(`inspector.wire.records.jsonsafe`). `dumps` tries the fast path first and converts only
when the payload really holds a non-finite float.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, TypeAdapter
from starlette.responses import JSONResponse

from .settings import DETAIL_CAP

# -- strict JSON ------------------------------------------------------------------------------------


def jsonsafe(obj: Any) -> Any:
    """`inspector.wire.records.jsonsafe(obj)`: a copy with every non-finite float replaced by "nan",
    "inf" or "-inf". Imported on first use: the core imports torch, and importing the server
    (for `gradient-inspector --help`, say) does without it."""
    from inspector.wire.records import jsonsafe as core_jsonsafe

    return core_jsonsafe(obj)


def _default(obj: Any) -> Any:
    # Tuples and lists are handled by json itself; this covers what the core may hand over
    # by accident (a set of names, a numpy/torch scalar). Anything else is a bug: say what.
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    for attr in ("tolist", "item"):
        fn = getattr(obj, attr, None)
        if callable(fn):
            return fn()
    # Never fail a response over one odd value (a user's python hook may carry a callable).
    return repr(obj)


def dumps(obj: Any) -> str:
    """Strict, compact JSON text (see the module docstring)."""
    try:
        return json.dumps(obj, allow_nan=False, separators=(",", ":"), default=_default)
    except ValueError:  # a NaN/inf somewhere: rare, so the second pass is fine
        return json.dumps(jsonsafe(obj), allow_nan=False, separators=(",", ":"), default=_default)


class StrictJSONResponse(JSONResponse):
    """The default response class: strict JSON, non-finite floats as strings."""

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")


def error_detail(loc: tuple | list, msg: str) -> list[dict[str, Any]]:
    """The `detail` list of a 422 body and of a websocket `error`."""
    return [{"loc": [p if isinstance(p, (int, str)) else str(p) for p in loc], "msg": msg}]


def pydantic_detail(errors: list[dict[str, Any]], prefix: tuple = ()) -> list[dict[str, Any]]:
    """Pydantic/FastAPI errors reduced to `{"loc", "msg"}` (the input is never echoed: it may
    hold a NaN, which strict JSON cannot carry, or something the client should not see again)."""
    out = []
    for e in errors:
        loc = [*prefix, *e.get("loc", ())]
        out.append(
            {"loc": [p if isinstance(p, (int, str)) else str(p) for p in loc], "msg": str(e.get("msg", ""))}
        )
    return out


# -- HTTP bodies -------------------------------------------------------------------------------------

_FORBID = ConfigDict(extra="forbid")
Target = Annotated[StrictStr, Field(max_length=256)]
HookId = Annotated[StrictStr, Field(min_length=1, max_length=64)]
Params = dict[StrictStr, Any]


class HookCreate(BaseModel):
    """POST /api/hooks: exactly these keys. `params` values go to the core unchanged."""

    model_config = _FORBID
    kind: Annotated[StrictStr, Field(max_length=64)]
    target: Target = "*"
    params: Params = Field(default_factory=dict)
    point: Annotated[StrictStr, Field(max_length=64)] | None = None
    enabled: StrictBool = True


class HookPatch(BaseModel):
    """PATCH /api/hooks/{id}: one change; `params` is merged (only the given keys change)."""

    model_config = _FORBID
    params: Params | None = None
    enabled: StrictBool | None = None
    target: Target | None = None
    position: Annotated[StrictInt, Field(ge=0)] | None = None


class CheckpointBody(BaseModel):
    """POST /api/checkpoints: an optional label."""

    model_config = _FORBID
    label: Annotated[StrictStr, Field(max_length=200)] | None = None


class RewindBody(BaseModel):
    """POST /api/checkpoints/{id}/rewind: an optional `skip`, the batches the new branch does not
    receive (inspector/whatif/skip.py): `"since_checkpoint"`, a count, or `[first, last]`; the core
    checks it against the data position (a 422 naming `skip`, nothing changed)."""

    model_config = _FORBID
    skip: (
        Literal["since_checkpoint"]
        | Annotated[StrictInt, Field(ge=1)]
        | Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=2, max_length=2)]
        | None
    ) = None


class SpikeBody(BaseModel):
    """PUT /api/spikes: the spike detector's settings to change (the others stay); the core checks
    the ranges too (a 422 naming the field, nothing changed)."""

    model_config = _FORBID
    enabled: StrictBool | None = None
    z: Annotated[float, Field(strict=True, ge=0.5, le=1000, allow_inf_nan=False)] | None = None
    warmup: Annotated[StrictInt, Field(ge=2, le=1_000_000)] | None = None
    alpha: Annotated[float, Field(strict=True, ge=1e-6, lt=1, allow_inf_nan=False)] | None = None
    cooldown: Annotated[StrictInt, Field(ge=1, le=1_000_000)] | None = None


class RateBody(BaseModel):
    """POST /api/training/rate: `null` lifts the cap."""

    model_config = _FORBID
    steps_per_second: Annotated[float, Field(strict=True, gt=0, le=10_000, allow_inf_nan=False)] | None


# A preset: `{"format": "gradient-inspector/hooks", "version": 1, "hooks": [spec, ...]}` as
# GET /api/hooks/export writes it (a bare list of specs is accepted too). The core validates it whole.
Preset = dict[StrictStr, Any] | Annotated[list[dict[StrictStr, Any]], Field(max_length=1024)]


# -- HTTP responses (for the OpenAPI document; the routes return plain dicts) -------------------------


class HookSpec(BaseModel):
    id: str
    kind: str
    point: str
    target: str
    params: dict[str, Any]
    enabled: bool
    position: int
    applied_step: int | None


class TrainingState(BaseModel):
    state: Literal["running", "paused", "finished"]
    step: int


class Health(BaseModel):
    status: Literal["ok"]


class Targets(BaseModel):
    matches: list[str]


class SnapshotPage(BaseModel):
    params: list[str]
    snapshots: list[dict[str, Any]]


class EventPage(BaseModel):
    events: list[dict[str, Any]]


class RunInfo(BaseModel):
    id: int
    started: float
    scenario: str | None
    steps: int
    params: int
    live: bool
    branches: list[dict[str, Any]] = Field(
        default_factory=list,
        description="runs that branched from this one: {id, branch (abandoned|shadow), branch_step, label, ...}",
    )


class RunList(BaseModel):
    runs: list[RunInfo]


class DetailPage(BaseModel):
    steps: list[int]
    params: list[str]
    stats: dict[str, list[list[float | str | None]]] = Field(
        description="per statistic, per parameter (in `params` order), one value per step (in `steps` order)"
    )


class ErrorItem(BaseModel):
    loc: list[str | int]
    msg: str


class ErrorBody(BaseModel):
    detail: list[ErrorItem] | str


# -- websocket commands ------------------------------------------------------------------------------
# A command that has an HTTP route carries that route's body model (its fields and checks, once),
# plus `type` and `request_id`.

RequestId = Annotated[StrictStr, Field(max_length=128)] | Annotated[StrictInt, Field()] | None


class _Command(BaseModel):
    model_config = _FORBID
    request_id: RequestId = None


class AddHookCmd(HookCreate, _Command):
    """`add_hook`: the body of POST /api/hooks."""

    type: Literal["add_hook"]


class UpdateHookCmd(HookPatch, _Command):
    """`update_hook`: `id` and the body of PATCH /api/hooks/{id}."""

    type: Literal["update_hook"]
    id: HookId


class RemoveHookCmd(_Command):
    type: Literal["remove_hook"]
    id: HookId


class TrainingCmd(_Command):
    type: Literal["pause", "resume", "step"]


class RateCmd(RateBody, _Command):
    """`rate`: the body of POST /api/training/rate."""

    type: Literal["rate"]


class SubscribeCmd(_Command):
    type: Literal["subscribe"]
    max_rate: Annotated[float, Field(strict=True, gt=0, le=1000, allow_inf_nan=False)] | None = None
    hist: Annotated[list[Annotated[StrictStr, Field(max_length=512)]], Field(max_length=64)] | None = None
    # a large run's per-parameter detail wanted on this socket (PROTOCOL.md); [] drops it
    detail: (
        Annotated[list[Annotated[StrictStr, Field(max_length=512)]], Field(max_length=DETAIL_CAP)] | None
    ) = None


Command = Annotated[
    AddHookCmd | UpdateHookCmd | RemoveHookCmd | TrainingCmd | RateCmd | SubscribeCmd,
    Field(discriminator="type"),
]
COMMAND_TYPES = ("add_hook", "update_hook", "remove_hook", "pause", "resume", "step", "rate", "subscribe")
command_adapter: TypeAdapter[Any] = TypeAdapter(Command)
