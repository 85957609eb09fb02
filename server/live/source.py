"""`LiveSource`: an attached inspector (demo mode or user mode), with optional history.

The core calls `_on_message` on its dispatcher thread for every message. That
callback does only cheap work: queue the row for the store's writer, remember
late scalars, and hand the message to the event loop (`publish`). It never
raises into the core.

History for the current run is the database (at most ~1 s behind) followed by
the core's in-memory ring buffer for the newest steps, so a request never waits
for the writer.

Recording and serving have separate lives. `record()` opens the run, starts the
store's writer and subscribes to the core; `start(publish)` (the app's lifespan)
records, if it was not already, and connects the websocket hub. In demo mode the
lifespan's `stop()` ends everything; in user mode (`history_outlives_server`) it
only disconnects the hub: the history goes on recording while the training does,
even after the server thread died, until `close()` (`insp.close()`).

A hook change (add, update, remove, import; over HTTP or the websocket) returns
only once it is durable: the core has accepted it, and the requested configuration
is committed to the history (`HistoryStore.record_request`). The core announces
the change when it is applied, possibly a step later, and that is recorded too.

Each snapshot is ranked for `worst` (worst.py) and, for a large run (more than `DETAIL_ALL`
parameters), cut down to the per-parameter detail of the union of the pages' subscriptions
(`set_detail`, fair turns, at most `DETAIL_CAP` parameters) and of its worst-now tensors, once,
on the dispatcher thread; the history gets it whole (the writer packs it).

What the websocket gets (`_send`) is each fact once: a snapshot without its `events` (they
go out as `event` messages), and an applied hook change as one `hooks` message carrying its
`hook_applied` event. Training-state changes (pause, resume, single steps, a pause taking
hold, the end of training) come from the core as `training` messages, pushed as they are.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ..core import Core
from ..history.packing import PER_PARAM
from ..history.queries import ALL_STEPS, HistoryQuery
from ..history.storage import HistoryStore
from ..hub import wire_snapshot
from ..protocol import dumps
from ..settings import DETAIL_CAP
from ..sources import (
    ApiError,
    Publish,
    Source,
    detail_of,
    hook_kinds,
    param_indices,
    read_only_error,
    slim_flight_row,
)
from . import whatif
from .worst import WorstNow

log = logging.getLogger("gradient_inspector.server")

FLIGHT_KEPT = 4096  # flight-recorder rows of the last dumps kept in memory (16 dumps of 256)


class LiveSource(Source):
    """An attached inspector.

    Args:
        insp: the object `inspector.attach(...)` returned.
        mode: "demo" (our own training thread, `trainer`) or "user" (the user's loop).
        store: the history database, or None for no history.
        read_only: answer every command with 403.
        trainer: the demo's training thread (`demo.Trainer`), started and stopped with the app.
        scenario: the demo scenario's `{"name", "description", "try_this"}`.
        owns_inspector: close `insp` when the app stops (demo mode).
        history_outlives_server: the app's stop leaves the recording on (user mode: `close()` ends
            it, from `insp.close()`), so a crash of the server thread does not stop the history.
    """

    def __init__(
        self,
        insp: Core,
        *,
        mode: str = "user",
        store: HistoryStore | None = None,
        read_only: bool = False,
        trainer: Any = None,
        scenario: dict[str, Any] | None = None,
        owns_inspector: bool = False,
        history_outlives_server: bool = False,
    ) -> None:
        self.insp = insp
        self.mode = mode
        self.store = store
        self.read_only = read_only
        self.trainer = trainer
        self.scenario = scenario
        self.owns_inspector = owns_inspector
        self.history_outlives_server = history_outlives_server
        self.run_id = 0 if store is None else None
        self.whatif = getattr(trainer, "whatif", None)  # the demo's shadow comparisons (shadow.py)
        if self.whatif is not None and hasattr(insp, "set_rule_handler"):
            insp.set_rule_handler("end_shadow", self._end_shadow)  # the rules' end_shadow action
        self.started = time.time()
        self._publish: Publish | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._recording = False
        self._closed = False
        self._requests = 0  # hook requests recorded in this run (their seq)
        self._request_lock = threading.Lock()
        self._recent_scalars: OrderedDict[int, dict[str, Any]] = OrderedDict()  # step -> scalars payload
        self._lock = threading.Lock()
        self._hist_lock = threading.Lock()
        self._hist_subs: dict[str, list[str]] = {}  # client id -> its histogram parameters
        self._applied: dict[str, Any] | None = None  # a hook_applied event, until its hooks message
        self.callback_errors = 0
        self._worst = WorstNow()  # updated on the dispatcher thread, under _worst_lock
        self._worst_lock = threading.Lock()
        self._worst_at: OrderedDict[int, list[dict[str, Any]]] = OrderedDict()  # step -> its worst
        self._flight_recent: dict[int, dict[str, Any]] = {}  # step -> the last dumps' rows (pages' form)
        self._detail_lock = threading.Lock()
        self._detail_subs: dict[str, list[int]] = {}  # client id -> its detail parameters
        self._detail_index: tuple[int, ...] = ()  # their fair union, capped (replaced whole)

    def _end_shadow(self, args: dict[str, Any]) -> dict[str, Any]:
        """The rules' ``end_shadow`` action (inspector.rules): asks the demo's shadow to end (a flag
        under the shadow's lock: safe on the training thread at the boundary)."""
        if not self.whatif.stop("ended by a rule"):
            raise RuntimeError("no comparison is running")
        return {"ended": True}

    def groups(self) -> dict[str, Any]:
        """The run's groups description (`Inspector.groups`): `{"source", "names", "members", "stacks"}`."""
        return self.insp.groups

    # -- lifecycle -----------------------------------------------------------------------------------

    def record(self) -> None:
        """Open this run in the history and subscribe to the core (idempotent; any thread)."""
        with self._lock:
            if self._recording or self._closed:
                return
            self._recording = True
        if self.store is not None:
            name = self.scenario["name"] if self.scenario else None
            self.run_id = self.store.new_run(
                params=self.insp.param_info(),
                modules=list(self.insp.modules),
                scenario=name,
                meta={"mode": self.mode, "scenario": self.scenario, "groups": self.groups()},
            )
            self.store.start_writer(on_status=self._history_status)
        if self.whatif is not None:
            self.whatif.store, self.whatif.parent_run = self.store, self.run_id
            self.whatif.publish = self._publish_now  # the hub's, while the server runs
        # lossless: the history records every step; slow browsers are coalesced per client (hub.py)
        self._unsubscribe = self.insp.subscribe(self._on_message, lossless=True)
        if self.store is not None and self.run_id is not None:
            self.store.add_hooks(self.run_id, self.insp.config_version, self.insp.hooks())

    def _publish_now(self, kind: str, payload: Any, text: str | None = None) -> None:
        publish = self._publish
        if publish is not None:
            publish(kind, payload, text)

    def start(self, publish: Publish) -> None:
        self.record()
        self._publish = publish
        if self.trainer is not None:
            self.trainer.start()

    def _training(self, state: dict[str, Any]) -> dict[str, Any]:
        """The core's training state, with the demo's rate cap (null: none) and, while the demo
        holds before its hint's step, `pause_reason` (null otherwise)."""
        tr = self.trainer
        why = tr.pause_reason if tr is not None and state.get("state") == "paused" else None
        return {**state, "steps_per_second": tr.rate if tr is not None else None, "pause_reason": why}

    def stop(self) -> None:
        """The app stops: the hub is disconnected; the recording too unless it outlives the server."""
        self._publish = None
        if not self.history_outlives_server:
            self.close()

    def close(self) -> None:
        """Stop the demo's training, the subscription and the store. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._publish = None
        if self.trainer is not None:
            self.trainer.stop()
        if self.owns_inspector:
            # before letting go: closing delivers what the core still has queued (its dispatcher
            # may be steps behind training), so the last steps reach the history too
            self.insp.close()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self.store is not None:
            self.store.close()

    def note_command(self, fields: dict[str, Any]) -> None:
        """A `command` event in the run's event log (`commands.record`), at the current step."""
        self.insp.add_event("command", step=self.insp.step, **fields)

    def _history_status(self, kind: str, reason: str) -> None:
        self.insp.add_event(kind, reason=reason)

    def _on_message(self, kind: str, payload: dict[str, Any]) -> None:
        try:
            store, run = self.store, self.run_id
            if kind == "scalars":
                with self._lock:
                    self._recent_scalars[int(payload["step"])] = payload
                    while len(self._recent_scalars) > 4096:
                        self._recent_scalars.popitem(last=False)
            text = None
            if kind == "snapshot":  # ranked, then encoded once for every socket; the history packs it
                with self._worst_lock:
                    worst = self._worst.update(payload)
                payload = {**payload, "worst": worst}
                with self._lock:
                    self._worst_at[int(payload.get("step") or 0)] = worst
                    while len(self._worst_at) > 1024:
                        self._worst_at.popitem(last=False)
                index = {*self._detail_index, *(w["param"] for w in worst)}
                text = dumps(wire_snapshot(payload, sorted(index)))
            if store is not None and run is not None:
                if kind == "snapshot":
                    store.add_snapshot(run, payload)
                elif kind == "scalars":
                    store.add_scalars(run, payload)
                elif kind == "event":
                    store.add_event(run, payload)
                elif kind == "hooks":
                    store.add_hooks(run, int(payload["config_version"]), payload["hooks"])
                elif kind == "flight":
                    store.add_flight(run, payload["rows"])
            if kind == "flight":  # the pages get the steps without their per-tensor lists
                payload = {**payload, "rows": [slim_flight_row(r) for r in payload["rows"]]}
                payload.pop("params", None)
                with self._lock:  # kept here too: a page that connects before the store has them
                    for r in payload["rows"]:
                        self._flight_recent.pop(int(r["step"]), None)
                        self._flight_recent[int(r["step"])] = r
                    while len(self._flight_recent) > FLIGHT_KEPT:
                        self._flight_recent.pop(next(iter(self._flight_recent)))
            if kind == "event" and payload.get("kind") == "rewind":
                self._rewound(payload)
            elif (
                kind == "event"
                and payload.get("kind") == "hook_applied"
                and payload.get("action") == "rewind"
                and self.whatif is not None
            ):
                # a rewind's hooks come next in this stream: the shadow ends, and keeps the label
                # it had while it ran (compared with the main run it branched from)
                self.whatif.stop("the main run was rewound")
            elif kind == "hooks" and self.whatif is not None:
                self.whatif.hooks_changed(payload["hooks"])
            self._send(kind, payload, text)
        except Exception:  # never raise into the core's dispatcher
            self.callback_errors += 1
            if self.callback_errors == 1:
                log.exception("gradient-inspector server: failed to handle a %r message", kind)

    def _send(self, kind: str, payload: dict[str, Any], text: str | None) -> None:
        """Hand a core message to the hub (dispatcher thread). The core announces an applied hook
        change with a `hook_applied` event and, next in its stream, the `hooks` message of the same
        `config_version` (both under its lock): the event waits here and goes out inside that
        message (`event`), so the change is one websocket message."""
        if kind == "event" and payload.get("kind") == "hook_applied":
            held, self._applied = self._applied, payload
            if held is not None:  # its hooks message never came (not the core's order): as it is
                self._publish_now("event", held, None)
            return
        if kind == "hooks" and self._applied is not None:
            payload = {**payload, "event": self._applied}
            self._applied = None
        elif kind == "training":  # the core's state, with the demo's rate cap (null: none)
            payload = self._training(payload)
        self._publish_now(kind, payload, text)

    def _rewound(self, ev: dict[str, Any]) -> None:
        """A rewind (the core's `rewind` event): the steps past the checkpoint's are an abandoned
        branch now, a run of its own linked to this one (`parent_run`, `branch_step`)."""
        step = int(ev["step"])
        with self._worst_lock:  # the run went back: its recent history is of the abandoned steps
            self._worst.reset()
        with self._lock:
            for s in [s for s in self._recent_scalars if s > step]:
                del self._recent_scalars[s]
            for s in [s for s in self._worst_at if s > step]:  # the abandoned steps' rankings
                del self._worst_at[s]
            for s in [s for s in self._flight_recent if s > step]:  # the abandoned steps' dumps
                del self._flight_recent[s]
        store, run = self.store, self.run_id
        if store is None or run is None or int(ev.get("from_step") or 0) <= step:
            return  # at the checkpoint's own step no step was abandoned: no branch to keep
        label = f"abandoned at step {ev.get('from_step')}: rewound to {ev.get('checkpoint')}"
        if ev.get("label"):
            label += f" ({ev['label']})"
        branch = store.new_run(
            params=self.insp.param_info(),
            modules=list(self.insp.modules),
            scenario=self.scenario["name"] if self.scenario else None,
            meta={"mode": self.mode, "scenario": self.scenario, "groups": self.groups()},
            parent_run=run,
            branch_step=step,
            branch="abandoned",
            label=label,
        )
        seqs = (int(ev.get("seq_after") or 0), int(ev.get("seq_until") or 0))
        store.move_branch(run, branch, step, seqs, int(ev.get("config_version") or 0))
        store.flush(5.0)  # moved before a page asks for this run's history again

    # -- reads ---------------------------------------------------------------------------------------

    def _is_current(self, run: int | None) -> bool:
        return run is None or run == self.run_id

    def hello(self, history: int = 600, events: int = 400, **resume: Any) -> dict[str, Any]:
        if self.trainer is not None:
            self.trainer.client_arrived()  # a demo waiting for its first page trains from now on
        return super().hello(history, events, **resume)

    def session(self, run: int | None = None) -> dict[str, Any]:
        if not self._is_current(run):
            return self.stored_session(self._run(run), read_only=self.read_only, live=False)
        insp = self.insp
        # the version first: the hooks read after it are at least as new (a `hooks` message of a
        # later version, applied meanwhile, is then newer than this session for the page)
        version = insp.config_version
        return {
            "run_id": self.run_id,
            "mode": self.mode,
            "live": True,
            "params": insp.param_info(),
            "modules": list(insp.modules),
            "groups": self.groups(),
            "hook_kinds": hook_kinds(),
            "hooks": insp.hooks(),
            "config_version": version,
            "training": {
                **self._training(insp.state),
                "scenario": self.scenario["name"] if self.scenario else None,
            },
            "read_only": self.read_only,
            "scenario": self.scenario,
            "history": {
                "db": self.store.path if self.store is not None else None,
                "paused": self.store.paused_reason if self.store is not None else None,
            },
            "checkpoints": self.checkpoints(),
            "shadow": self.shadow_state(points=False),
            "capabilities": self.capabilities(),
            "branches": self.store.branches_of(self.run_id) if self.store is not None and self.run_id else [],
            "branch": None,
        }

    def capabilities(self) -> dict[str, Any]:
        def cap(why: str | None) -> dict[str, Any]:
            return {"ok": why is None, "why": why}

        ro = "read-only: this server does not accept commands" if self.read_only else None
        demo = None if self.trainer is not None else "the demo's only: no built-in training here"
        return {
            "commands": cap(ro),
            "targets": cap(None),
            "checkpoints": cap(None),
            "checkpoint": cap(ro or self.insp.checkpoints.refusal()),
            "shadow": cap(ro or demo),
            "rate": cap(ro or demo),
        }

    def param_names(self, run: int | None = None) -> list[str]:
        if self._is_current(run):
            return list(self.insp.params)
        return super().param_names(run)

    def snapshots(
        self, run: int | None = None, query: HistoryQuery = ALL_STEPS, *, detail: bool = True
    ) -> list[dict[str, Any]]:
        if not self._is_current(run):
            return super().snapshots(run, query, detail=detail)
        # the core's ring: each snapshot's dict converted once, late scalars already merged in
        ring = {s["step"]: s for s in self.insp.snapshots(query.since) if query.covers(s["step"])}
        chosen = query.choose("snapshots", self.store, self.run_id, ring)
        old = [s for s in chosen if s not in ring]
        out = (
            self.store.snapshots_at(self.run_id, old, detail=detail)
            if (old and self.store is not None)
            else []
        )
        with self._lock:
            worst = {s: self._worst_at[s] for s in chosen if s in ring and s in self._worst_at}
        newest = chosen[-1] if chosen else None
        if newest is not None and newest in ring and newest not in worst:
            # published, not ranked yet (the dispatcher is behind): ranked here, not remembered
            with self._worst_lock:
                worst[newest] = self._worst.update(ring[newest], remember=False)
        return out + [{**ring[s], "worst": worst[s]} if s in worst else ring[s] for s in chosen if s in ring]

    def detail(
        self, run: int | None, names: list[str], *, since: int | None = None, limit: int = 600
    ) -> dict[str, Any]:
        if not self._is_current(run):
            return super().detail(run, names, since=since, limit=limit)
        known = list(self.insp.params)
        index = param_indices(names, known, ("query", "params"))
        ring = self.insp.snapshots(since)[-limit:] if limit > 0 else []
        before = ring[0]["step"] if ring else None
        steps: list[int] = []
        stats: dict[str, list[list[Any]]] = {k: [[] for _ in index] for k in PER_PARAM}
        if self.store is not None and self.run_id is not None and len(ring) < limit:
            steps, stats = self.store.detail(
                self.run_id, index, since=since, before=before, limit=limit - len(ring)
            )
        for snap in ring:
            steps.append(int(snap["step"]))
            for k in PER_PARAM:
                values = snap.get(k)
                for row, i in zip(stats[k], index, strict=True):
                    row.append(values[i] if isinstance(values, list) and i < len(values) else None)
        return {"steps": steps, "params": [known[i] for i in index], "stats": stats}

    def scalars(self, run: int | None = None, query: HistoryQuery = ALL_STEPS) -> list[dict[str, Any]]:
        if not self._is_current(run):
            return super().scalars(run, query)
        with self._lock:
            recent = {s: p for s, p in self._recent_scalars.items() if query.covers(s)}
        chosen = query.choose("scalars", self.store, self.run_id, recent)
        old = [s for s in chosen if s not in recent]
        out = self.store.scalars_at(self.run_id, old) if (old and self.store is not None) else []
        return out + [
            {"step": s, "loss": recent[s].get("loss"), "scalars": recent[s].get("scalars") or {}}
            for s in chosen
            if s in recent
        ]

    def events(
        self, run: int | None = None, *, since: int | None = None, limit: int | None = None
    ) -> list[dict[str, Any]]:
        if not self._is_current(run):
            return super().events(run, since=since, limit=limit)
        ring = list(self.insp.events(since))
        out = ring
        if limit and len(ring) >= limit:
            return ring[-limit:]
        if self.store is not None:
            first = ring[0]["seq"] if ring else None
            stored = self.store.events(self.run_id, since=since)
            out = [e for e in stored if first is None or e["seq"] < first] + ring
        return out[-limit:] if limit else out

    def runs(self) -> list[dict[str, Any]]:
        if self.store is not None:
            return super().runs()
        state = self.insp.state
        return [
            {
                "id": self.run_id,
                "started": self.started,
                "scenario": self.scenario["name"] if self.scenario else None,
                "steps": state["step"],
                "params": len(self.insp.params),
                "live": True,
            }
        ]

    def hooks(self) -> list[dict[str, Any]]:
        return self.insp.hooks()

    def config_version(self) -> int:
        return int(self.insp.config_version)

    def export_hooks(self) -> dict[str, Any]:
        return self.insp.export_hooks()

    def targets(self, glob: str, point: str | None) -> list[str]:
        return self._core(self.insp.match_targets, glob, **({"point": point} if point else {}))

    # -- commands ------------------------------------------------------------------------------------

    def _core(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        import inspector

        try:
            return fn(*args, **kwargs)
        except inspector.HookNotFound as e:  # its message names the id: "no hook with id 'h3'"
            raise ApiError(404, str(e)) from e
        except inspector.HookError as e:
            raise ApiError(422, detail_of(e)) from e
        except inspector.RewindPending as e:  # a rewind waits: it would undo the change unseen
            raise ApiError(409, str(e)) from e

    def _command(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.read_only:
            raise read_only_error()
        return self._core(fn, *args, **kwargs)

    def _accepted(self, action: str, hook_id: str | None) -> None:
        """A page's change was accepted: the requested configuration, read once, is recorded and
        the call returns once it is committed (at most a few seconds: while history is paused the
        reply does not wait for it, the row is written when writes succeed again); then every page
        is told (a `requested` message: its hooks, pending ones with `applied_step` null, and the
        `config_version` it has once applied). The `hooks` message of that version says it was
        applied; a page shows the requested list until then, whichever of the two comes first."""
        store, run = self.store, self.run_id
        with self._request_lock:
            self._requests += 1
            seq = self._requests
            version, hooks = self.insp.requested_config()  # read in the order the seqs are given
        if store is not None and run is not None:
            store.record_request(
                run, seq, action=action, hook_id=hook_id, config_version=version, hooks=hooks
            )
        self._publish_now("requested", {"config_version": version, "hooks": hooks}, None)

    def add_hook(
        self, kind: str, *, target: str, point: str | None, enabled: bool, params: dict[str, Any]
    ) -> dict[str, Any]:
        handle = self._change(
            f"before add {kind}",
            self.insp.add_hook,
            kind,
            target=target,
            point=point,
            enabled=enabled,
            params=params,
        )
        self._accepted("add", handle.id)
        # the spec as accepted: read back now, it may be gone already (a rewind carried out
        # meanwhile puts its checkpoint's hooks back), and the reply is about this request
        return dict(handle.accepted)

    def update_hook(self, hook_id: str, **change: Any) -> dict[str, Any]:
        given = {k: v for k, v in change.items() if v is not None}
        spec = self._change(f"before update {hook_id}", self.insp.update_hook, hook_id, **given)
        self._accepted("update", hook_id)
        return spec  # type: ignore[no-any-return]

    def remove_hook(self, hook_id: str) -> None:
        self._change(f"before remove {hook_id}", self.insp.remove_hook, hook_id)
        self._accepted("remove", hook_id)

    def import_hooks(self, preset: dict[str, Any] | list[dict[str, Any]]) -> list[dict[str, Any]]:
        hooks = self._change("before import", self.insp.import_hooks, preset)
        self._accepted("import", None)
        return hooks  # type: ignore[no-any-return]

    def _change(self, label: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A hook change from the page, with the what-if around it (whatif.py)."""
        if self.read_only:
            raise read_only_error()
        return whatif.around_change(self, label, lambda: self._core(fn, *args, **kwargs))

    def checkpoints(self) -> dict[str, Any]:
        return whatif.checkpoints(self)

    def checkpoint(self, label: str | None) -> dict[str, Any]:
        if self.read_only:
            raise read_only_error()
        return whatif.checkpoint(self, label)

    def rewind(self, cp_id: str, skip: Any = None) -> dict[str, Any]:
        if self.read_only:
            raise read_only_error()
        return whatif.rewind(self, cp_id, skip)

    def shadow_state(self, points: bool = True) -> dict[str, Any] | None:
        return whatif.shadow_state(self, points)

    def shadow_start(self) -> dict[str, Any]:
        if self.read_only:
            raise read_only_error()
        return whatif.shadow_start(self)

    def shadow_stop(self) -> None:
        if self.read_only:
            raise read_only_error()
        whatif.shadow_stop(self)

    def rules(self) -> list[dict[str, Any]]:
        return self.insp.rules

    def add_rule(self, rule: dict[str, Any]) -> dict[str, Any]:
        return self._rule_command(self.insp.add_rule, rule)  # type: ignore[no-any-return]

    def update_rule(self, rule_id: str, change: dict[str, Any]) -> dict[str, Any]:
        # (the body as one mapping: a key of it named like an argument is a field, refused by name)
        return self._rule_command(self.insp.update_rule, rule_id, change)  # type: ignore[no-any-return]

    def remove_rule(self, rule_id: str) -> None:
        self._rule_command(self.insp.remove_rule, rule_id)

    def load_rules(self, preset: Any) -> list[dict[str, Any]]:
        return self._rule_command(self.insp.load_rules, preset)  # type: ignore[no-any-return]

    def _rule_command(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A rule command: 422 naming the field, 404 for an unknown rule id (nothing changed)."""
        import inspector

        try:
            return self._command(fn, *args, **kwargs)
        except ApiError as e:
            if (
                e.status == 422
                and isinstance(e.detail, list)
                and e.detail
                and e.detail[0].get("loc") == ["rule_id"]
                and str(e.detail[0].get("msg", "")).startswith("no rule with id")
            ):
                raise ApiError(404, e.detail[0]["msg"]) from e
            raise
        except inspector.InspectorError as e:  # closed
            raise ApiError(409, str(e)) from e

    def training_command(self, action: str) -> dict[str, Any]:
        fn = {"pause": self.insp.pause, "resume": self.insp.resume, "step": self.insp.step_once}[action]
        self._command(fn)
        return dict(self.insp.state)

    def flight(
        self,
        run: int | None = None,
        *,
        since: int | None = None,
        until: int | None = None,
        tensors: bool = False,
    ) -> list[dict[str, Any]]:
        """`GET /api/flight`: the stored rows, and for this run also the last dumps' rows kept in
        memory (a dump is sent to the pages before the history writer has stored it, and a server
        with no database stores none); a stored row with its per-tensor lists wins when asked for."""
        if run is not None and run != self.run_id:
            return super().flight(run, since=since, until=until, tensors=tensors)
        rows: dict[int, dict[str, Any]] = {}
        with self._lock:
            for s, r in self._flight_recent.items():
                if (since is None or s > since) and (until is None or s <= until):
                    rows[s] = r
        if self.store is not None and self.run_id is not None:
            for r in super().flight(self.run_id, since=since, until=until, tensors=tensors):
                step = int(r["step"])
                if tensors or step not in rows:  # (kept rows are the newer where both have a step)
                    rows[step] = r
        return [rows[s] for s in sorted(rows)]

    def _flight_on(self) -> None:
        if self.insp.spike_detection is None:
            raise ApiError(409, "the flight recorder is off: attach(..., flight=256) turns it on")

    def flight_now(self, *, tensors: bool = False) -> dict[str, Any]:
        self._flight_on()
        rec = dict(self._command(self.insp.flight_recorder))
        if not tensors:
            rec["rows"] = [slim_flight_row(r) for r in rec["rows"]]
        return rec

    def spike_settings(self) -> dict[str, Any] | None:
        return self.insp.spike_detection

    def set_spikes(self, change: dict[str, Any]) -> dict[str, Any]:
        self._flight_on()
        return self._command(self.insp.set_spike_detection, **change)

    def set_rate(self, steps_per_second: float | None) -> dict[str, Any]:
        if self.read_only:
            raise read_only_error()
        if self.trainer is None:
            raise ApiError(
                409, "the step rate is set by your own training loop: rate control is demo mode only"
            )
        self.trainer.set_rate(steps_per_second)
        self._publish_now("training", self._training(self.insp.state), None)  # every page learns it at once
        return {"steps_per_second": self.trainer.rate}

    def set_detail(self, client_id: str, names: list[str]) -> None:
        """One client's detail subscription (`[]` drops it; unknown names: 422). A large run's
        snapshot messages carry the detail of the union: every client's first choice, then every
        client's second, and so on (as for histograms, `set_hist`), up to `DETAIL_CAP` parameters,
        plus the snapshot's worst-now tensors."""
        wanted = param_indices(names, list(self.insp.params), ("detail",))
        with self._detail_lock:
            subs = {k: v for k, v in self._detail_subs.items() if k != client_id}
            if wanted:
                subs[client_id] = wanted
            fair: dict[int, None] = {}
            for rank in range(max((len(v) for v in subs.values()), default=0)):
                for chosen in subs.values():
                    if rank < len(chosen) and len(fair) < DETAIL_CAP:
                        fair.setdefault(chosen[rank])
            self._detail_subs = subs
            self._detail_index = tuple(fair)

    def set_hist(self, client_id: str, names: list[str]) -> None:
        """One client's histogram parameters (`[]` drops them). The core's cap (HIST_CAP) is shared
        fairly: the dashboards' list handed to the core takes every client's first choice, then
        every client's second, and so on, so one client asking for the whole cap first cannot
        deny histograms to another (each of up to HIST_CAP clients gets its first choice)."""
        with self._hist_lock:
            subs = {k: v for k, v in self._hist_subs.items() if k != client_id}
            if names:
                subs[client_id] = list(dict.fromkeys(names))
            fair: list[str] = []
            for rank in range(max((len(v) for v in subs.values()), default=0)):
                for wanted in subs.values():
                    if rank < len(wanted) and wanted[rank] not in fair:
                        fair.append(wanted[rank])
            self._core(self.insp.set_hist_subscription, "dashboards", fair)  # unknown names: 422
            self._hist_subs = subs
