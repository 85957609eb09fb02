"""What-if on a live source: checkpoints, rewind and the demo's shadow comparison (source.py calls here).

A hook change made from the page (HTTP or websocket) is wrapped by `around_change`: first an
automatic checkpoint is requested (`insp.checkpoints.checkpoint(label, auto=True)`), which the
training thread takes at its next step boundary (the demo's thread between two steps; at once
when training is held or finished); then the change is made as before, and the request returns
at once. The change waits for the checkpoint: it applies right after it (`StepLifecycle.apply_edits`),
so the checkpoint holds the state and hooks from just before it. An invalid change leaves no
checkpoint. In the demo, when no comparison runs, the change starts one from that checkpoint
(shadow.py).

Errors: a refused checkpoint or rewind (CheckpointError) is a 409 with the core's reason, an
unknown checkpoint a 404, a rewind's `skip` that cannot be honoured a 422 (the reason, under `skip`),
a request past the bounded queue (CheckpointBusy: `keep` requests of its
kind already wait for the next boundary) a 429. A hook change while a rewind waits for its
boundary is a 409 (RewindPending, source.py): the rewind would put its checkpoint's hooks back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..sources import ApiError

if TYPE_CHECKING:
    from .source import LiveSource


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    import inspector

    try:
        return fn(*args)
    except inspector.CheckpointNotFound as e:
        raise ApiError(404, str(e)) from e
    except inspector.CheckpointBusy as e:
        raise ApiError(429, str(e)) from e
    except inspector.CheckpointError as e:
        raise ApiError(409, str(e)) from e
    except inspector.HookError as e:  # a rewind's skip that cannot be honoured
        raise ApiError(422, e.detail()) from e
    except inspector.InspectorError as e:  # closed
        raise ApiError(409, str(e)) from e


def around_change(src: LiveSource, label: str, do: Callable[[], Any]) -> Any:
    """`do()` (the change) after an automatic checkpoint; in the demo, a comparison from it."""
    mgr = src.insp.checkpoints
    cp = None
    if mgr.refusal() is None:
        try:
            cp = mgr.checkpoint(label, auto=True)
        except Exception:  # closed meanwhile, refused: the change goes ahead without one
            cp = None
    try:
        result = do()
    except BaseException:
        if cp is not None:
            mgr.discard(cp)
        raise
    wi = src.whatif
    if cp is not None and wi is not None and wi.auto and not wi.busy:
        wi.start_from(cp, label.replace("before ", "at ", 1))
    return result


def checkpoints(src: LiveSource) -> dict[str, Any]:
    """`GET /api/checkpoints`: the core's summary."""
    return src.insp.checkpoints.summary()


def checkpoint(src: LiveSource, label: str | None) -> dict[str, Any]:
    """`POST /api/checkpoints`: the checkpoint as requested (never read back: by the time a
    reply is made the checkpoint may be taken, and already dropped from the newest `keep`)."""
    return _call(lambda: src.insp.checkpoints.request(label, origin="page"))  # type: ignore[no-any-return]


def rewind(src: LiveSource, cp_id: str, skip: Any = None) -> dict[str, Any]:
    """`POST /api/checkpoints/{id}/rewind`; `skip` as `Inspector.rewind`'s (a 422 when it cannot be
    honoured; inspector/whatif/skip.py)."""
    if isinstance(skip, list):
        skip = tuple(skip)
    # a checkpoint's id only: `Inspector.rewind` also takes a directory, which a client on the
    # network never names (its files would be unpickled by the training process)
    return _call(_rewind_by_id, src, cp_id, skip)  # type: ignore[no-any-return]


def _rewind_by_id(src: LiveSource, cp_id: str, skip: Any) -> dict[str, Any]:
    import re

    from inspector.wire.errors import CheckpointNotFound

    if re.fullmatch(r"c[0-9]+", cp_id) is None:
        raise CheckpointNotFound(cp_id, src.insp.checkpoints.keep)
    return src.insp.rewind(cp_id, skip)  # type: ignore[no-any-return]


def shadow_state(src: LiveSource, points: bool) -> dict[str, Any] | None:
    if src.whatif is None:
        return None
    state = src.whatif.state()
    if not points:
        state.pop("points", None)
    return state  # type: ignore[no-any-return]


def _whatif(src: LiveSource) -> Any:
    if src.whatif is None:
        raise ApiError(
            409,
            "the shadow comparison is a demo feature (the demo owns its data and loss): in your own "
            "loop use inspector.compare(model, optimizer, step_fn, batches, hooks_a, hooks_b)",
        )
    return src.whatif


def shadow_start(src: LiveSource) -> dict[str, Any]:
    """`POST /api/shadow` ("compare from here"): a checkpoint now, and a shadow from it."""
    wi = _whatif(src)
    if wi.busy:
        raise ApiError(409, "a comparison is running: end it first (one shadow at a time)")
    cp_id = _call(lambda: src.insp.checkpoints.checkpoint("compare from here", auto=True))
    if not wi.start_from(cp_id, "compare from here"):
        raise ApiError(409, "a comparison is running: end it first (one shadow at a time)")
    return {"checkpoint": cp_id, "active": False, "starting": True}


def shadow_stop(src: LiveSource) -> None:
    """`DELETE /api/shadow`: end the comparison (its recorded branch stays in the history)."""
    if not _whatif(src).stop("ended from the page"):
        raise ApiError(409, "no comparison is running")
