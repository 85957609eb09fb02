"""Sources: what the routes and the socket read from and send commands to.

The same app serves three things through one interface:

- `LiveSource` (live/source.py): an attached inspector, in demo mode (our own training
  thread) or user mode (the user's script);
- `ReplaySource` (here): a recorded run in a database, read-only.

Routes never touch `inspector` or `HistoryStore` directly; they call a source, and a
source reports failures as `ApiError` (status and `detail`), which the app turns
into the HTTP response or the socket's `error` message.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .history.queries import ALL_STEPS, HistoryQuery
from .history.storage import HistoryStore, StoreError
from .hub import wire_snapshot
from .live.worst import STATS as WORST_STATS
from .live.worst import WINDOW as WORST_WINDOW
from .live.worst import worst_of
from .protocol import error_detail
from .settings import DETAIL_ALL

log = logging.getLogger("gradient_inspector.server")

Publish = Callable[
    [str, dict[str, Any], "str | None"], None
]  # (kind, payload, payload as JSON or None): thread-safe


class ApiError(Exception):
    """A failed request: `status` (4xx) and `detail` (a string, or the `[{loc, msg}]` list)."""

    def __init__(self, status: int, detail: str | list[dict[str, Any]]) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


CAPABILITIES = ("commands", "targets", "checkpoints", "checkpoint", "shadow", "rate")


def read_only_error() -> ApiError:
    return ApiError(403, "read-only: this server does not accept commands")


def param_indices(names: list[str], known: list[str], loc: tuple[str, ...]) -> list[int]:
    """The indices of parameter `names` among `known`, in the order given (repeats once); a 422
    naming the unknown ones (`loc`: where the names came from)."""
    where = {n: i for i, n in enumerate(known)}
    unknown = [n for n in dict.fromkeys(names) if n not in where]
    if unknown:
        shown = ", ".join(repr(n[:200]) for n in unknown[:10])
        more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
        raise ApiError(422, error_detail(loc, f"unknown parameter(s): {shown}{more}"))
    return [where[n] for n in dict.fromkeys(names)]


def groups_of(meta: dict[str, Any], names: list[str]) -> dict[str, Any] | None:
    """A stored run's groups description (`Inspector.groups`, kept in the run's meta), or for a run
    recorded before groups, the core's default partition built from its parameter names (as at
    attach; a run attached with its own `groups=` gets the default); None when even that fails."""
    groups = meta.get("groups")
    if isinstance(groups, dict):
        return groups
    try:
        from inspector.stats.groups import Groups  # on first use, as hook_kinds() imports the core

        described = Groups(names).describe()
    except Exception:  # noqa: BLE001 - names the builder cannot take: no groups
        log.warning("gradient-inspector: no groups for a stored run", exc_info=True)
        return None
    return described if isinstance(described, dict) else None


def hook_kinds() -> dict[str, Any]:
    import inspector  # the kinds' schemas are static: replay needs no live inspector

    return inspector.hook_kinds()


def slim_flight_row(row: dict[str, Any]) -> dict[str, Any]:
    """A flight-recorder row without its per-tensor lists (what pages get)."""
    return {k: v for k, v in row.items() if k not in ("raw", "final")}


class Source:
    """The interface (and the read-only defaults). See the module docstring."""

    mode = "replay"  # "demo" | "user" | "replay"
    read_only = True
    store: HistoryStore | None = None
    run_id: int | None = None

    # lifecycle: called by the app's lifespan, on its event loop
    def start(self, publish: Publish) -> None:
        pass

    def stop(self) -> None:
        pass

    # reads
    def session(self, run: int | None = None) -> dict[str, Any]:
        raise NotImplementedError

    def capabilities(self) -> dict[str, Any]:
        """What this server does besides reading the history (the session's `capabilities`): a
        page calls no route it lists as refused. Each entry is `{"ok": bool, "why": reason or
        null}`: `commands` (hooks, rules, training controls), `targets` (`GET /api/targets`),
        `checkpoints` (`GET /api/checkpoints`, the list), `checkpoint` (`POST /api/checkpoints`, a
        rewind: refused with the reason where the Inspector refuses checkpoints), `shadow` (the
        demo's comparison), `rate` (the demo's speed cap). A replay has none of them."""
        why = "read-only: a replay of a recorded run, nothing to command"
        return {k: {"ok": False, "why": why} for k in CAPABILITIES}

    def param_names(self, run: int | None = None) -> list[str]:
        return [p["name"] for p in self._info(self._run(run))["params"]]

    def snapshots(
        self, run: int | None = None, query: HistoryQuery = ALL_STEPS, *, detail: bool = True
    ) -> list[dict[str, Any]]:
        """Snapshots, oldest first; with `detail` false the stored ones come without their
        per-parameter lists (`HistoryReader.snapshots_at`)."""
        return self._store().snapshots(self._run(run), query, detail=detail)

    def detail(
        self, run: int | None, names: list[str], *, since: int | None = None, limit: int = 600
    ) -> dict[str, Any]:
        """`GET /api/detail`: the per-parameter statistics of the parameters `names` over the newest
        `limit` recorded steps after `since`, oldest first: `{"steps", "params", "stats"}` (`stats`:
        per statistic, per parameter, one value per step; None where a step has none)."""
        known = self.param_names(run)
        index = param_indices(names, known, ("query", "params"))
        steps, stats = self._store().detail(self._run(run), index, since=since, limit=limit)
        return {"steps": steps, "params": [known[i] for i in index], "stats": stats}

    def stored_worst(self, run: int) -> list[dict[str, Any]]:
        """The `worst` of a stored run's newest recorded step, ranked against the `WORST_WINDOW`
        recorded steps before it (their stored statistics; a thinned step counts as none)."""
        steps, stats = self._store().detail(run, None, WORST_STATS, limit=WORST_WINDOW + 1)
        rows = [
            {"step": steps[j], **{k: [per_param[j] for per_param in stats[k]] for k in WORST_STATS}}
            for j in range(len(steps))
        ]  # (the step: a non-finite tensor's `since`)
        return worst_of(rows)

    def set_detail(self, client_id: str, names: list[str]) -> None:
        """One client's detail subscription (`[]` drops it): checked (unknown names: 422); a
        recorded run streams nothing, so nothing else happens."""
        param_indices(names, self.param_names(None), ("detail",))

    def scalars(self, run: int | None = None, query: HistoryQuery = ALL_STEPS) -> list[dict[str, Any]]:
        return self._store().scalars(self._run(run), query)

    def events(
        self, run: int | None = None, *, since: int | None = None, limit: int | None = None
    ) -> list[dict[str, Any]]:
        return self._store().events(self._run(run), since=since, limit=limit)

    def runs(self) -> list[dict[str, Any]]:
        live = self.run_id if self.mode != "replay" else None
        return self.store.runs(live_run=live) if self.store is not None else []

    def hooks(self) -> list[dict[str, Any]]:
        return self._store().hooks(self._run(None))[1]

    def config_version(self) -> int:
        return self._store().hooks(self._run(None))[0]

    def export_hooks(self) -> dict[str, Any]:
        """The stored hooks as a preset, written by the core's rules (as `Inspector.export_hooks`).

        A database can be crafted: each stored hook is validated against its kind's schema (kind,
        point, parameter names and values) as an import would, and one that fails is left out
        (logged), so the preset, and the Python written from it, hold only what the core accepts.
        """
        from inspector.hooks.registry import PRESET_FORMAT
        from inspector.wire.errors import HookError
        from inspector.wire.kinds import check_kind, check_point, validate_params
        from inspector.wire.records import SPEC_FIELDS, HookSpec

        hooks = []
        for h in self.hooks():
            try:
                if not isinstance(h.get("target"), str) or h.get("kind") == "python":
                    continue
                kind = check_kind(h.get("kind"))
                point = check_point(kind, h.get("point"))
                params = validate_params(kind, point, h.get("params") or {})
                spec = HookSpec(
                    **{**{k: h[k] for k in SPEC_FIELDS if k in h}, "point": point, "params": params}
                )
            except (HookError, TypeError) as e:
                log.warning(
                    "gradient-inspector replay: stored hook %r left out of the export: %s", h.get("id"), e
                )
                continue
            hooks.append(spec.preset())
        return {"format": PRESET_FORMAT, "version": 1, "hooks": hooks}

    def targets(self, glob: str, point: str | None) -> list[str]:
        raise read_only_error()

    def hello(
        self,
        history: int = 600,
        events: int = 400,
        *,
        run: int | None = None,
        step: int | None = None,
        since: int | None = None,
        seq: int | None = None,
    ) -> dict[str, Any]:
        """The websocket's first message (without `type`): the session, the newest `history`
        snapshots (as the socket sends them: without `events`) and the newest `events` events.

        A page that reconnects says what it has: its `run`, its newest `step`, its newest
        snapshot's step (`since`) and event's `seq`. When `run` is still the session's, the
        step did not go back and no rewind came since `seq` (the same process, one branch),
        `resumed` is true and only what came after `since` and `seq` is sent. The session is at least as new as the events
        (read again when a change they hold was applied after it), so it holds their changes.

        A large run's snapshots (more than `DETAIL_ALL` parameters) come in their wire form with an
        empty `detail` (the page asks `GET /api/detail` for what it wants); the newest has `worst`
        (for a run recorded without it, ranked from its stored steps: `stored_worst`)."""
        session = self.session()
        now = session["training"].get("step")
        now = now if isinstance(now, int) else 0
        resumed = run is not None and run == session["run_id"] and (step or 0) <= now
        evs = self.events(since=seq if resumed else None, limit=events)
        if resumed and any(e.get("kind") == "rewind" for e in evs):
            # a rewind meanwhile: the page's newest steps may be of the branch it abandoned
            resumed = False
            evs = self.events(limit=events)
        large = len(session.get("params") or ()) > DETAIL_ALL  # its detail comes over /api/detail
        snaps = self.snapshots(
            None, HistoryQuery(since=since if resumed else None, limit=history), detail=not large
        )
        if snaps and "worst" not in snaps[-1] and not session.get("live") and self.run_id is not None:
            snaps[-1] = {**snaps[-1], "worst": self.stored_worst(self.run_id)}  # a run recorded before it
        versions = [e.get("config_version") for e in evs if e.get("kind") == "hook_applied"]
        newest = max((v for v in versions if isinstance(v, int)), default=0)
        version = session.get("config_version")
        if isinstance(version, int) and newest > version:
            session = self.session()
        return {
            "session": session,
            "resumed": resumed,
            "history": [wire_snapshot(s) for s in snaps],
            "events": evs,
        }

    def note_command(self, fields: dict[str, Any]) -> None:
        """Record a `command` event (an agent's command, `commands.record`); a recorded run takes none."""

    # commands: every one is refused by a read-only source
    def add_hook(
        self, kind: str, *, target: str, point: str | None, enabled: bool, params: dict[str, Any]
    ) -> dict[str, Any]:
        raise read_only_error()

    def update_hook(self, hook_id: str, **change: Any) -> dict[str, Any]:
        raise read_only_error()

    def remove_hook(self, hook_id: str) -> None:
        raise read_only_error()

    def import_hooks(self, preset: dict[str, Any] | list[dict[str, Any]]) -> list[dict[str, Any]]:
        raise read_only_error()

    def training_command(self, action: str) -> dict[str, Any]:
        raise read_only_error()

    # rules (inspector.rules): kept by the training process; a replay has their events only
    def rules(self) -> list[dict[str, Any]]:
        return []

    def add_rule(self, rule: dict[str, Any]) -> dict[str, Any]:
        raise read_only_error()

    def update_rule(self, rule_id: str, change: dict[str, Any]) -> dict[str, Any]:
        raise read_only_error()

    def remove_rule(self, rule_id: str) -> None:
        raise read_only_error()

    def load_rules(self, preset: Any) -> list[dict[str, Any]]:
        raise read_only_error()

    def flight(
        self,
        run: int | None = None,
        *,
        since: int | None = None,
        until: int | None = None,
        tensors: bool = False,
    ) -> list[dict[str, Any]]:
        """`GET /api/flight`: the stored flight-recorder rows of a run."""
        return self._store().flight(self._run(run), since=since, until=until, tensors=tensors)

    def flight_now(self, *, tensors: bool = False) -> dict[str, Any]:
        raise read_only_error()

    def spike_settings(self) -> dict[str, Any] | None:
        return None

    def set_spikes(self, change: dict[str, Any]) -> dict[str, Any]:
        raise read_only_error()

    def set_rate(self, steps_per_second: float | None) -> dict[str, Any]:
        raise read_only_error()

    def set_hist(self, client_id: str, names: list[str]) -> None:
        pass  # histograms are computed in training; a replay has what was recorded

    # what-if (whatif.py): checkpoints live in the training process, a replay has none
    def checkpoints(self) -> dict[str, Any]:
        raise ApiError(404, "no live training: checkpoints are kept by the training process")

    def checkpoint(self, label: str | None) -> dict[str, Any]:
        raise read_only_error()

    def rewind(self, cp_id: str, skip: Any = None) -> dict[str, Any]:
        raise read_only_error()

    def shadow_state(self, points: bool = True) -> dict[str, Any] | None:
        return None

    def shadow_start(self) -> dict[str, Any]:
        raise read_only_error()

    def shadow_stop(self) -> None:
        raise read_only_error()

    # helpers
    def _store(self) -> HistoryStore:
        if self.store is None:
            raise ApiError(404, "no history: this server records no database")
        return self.store

    def _run(self, run: int | None) -> int:
        if run is None:
            if self.run_id is None:
                raise ApiError(404, "no run")
            return self.run_id
        self._info(run)
        return run

    def _info(self, run: int) -> dict[str, Any]:
        """The stored run's row: 404 when there is none, 409 when it cannot be read."""
        try:
            info = self._store().run(run)
        except StoreError as e:
            raise ApiError(409, str(e)) from e
        if info is None:
            raise ApiError(404, f"no run {run}")
        return info

    def stored_session(self, run: int, *, read_only: bool, live: bool) -> dict[str, Any]:
        """A session built from the database (a replay, or an earlier run seen from a live server)."""
        info = self._info(run)
        version, hooks = self._store().hooks(run)
        return {
            "run_id": run,
            "mode": self.mode,
            "live": live,
            "params": info["params"],
            "modules": info["modules"],
            "groups": self._stored_groups(run, info),
            "hook_kinds": hook_kinds(),
            "hooks": hooks,
            "config_version": version,
            "training": {
                "state": "finished",
                "step": info["last_step"],
                "scenario": info["scenario"],
                "steps_per_second": None,
            },
            "read_only": read_only,
            "scenario": info["meta"].get("scenario"),
            "history": {"db": self._store().path, "paused": None},
            "checkpoints": None,
            "shadow": None,
            "capabilities": self.capabilities(),
            "branches": self._store().branches_of(run),
            "branch": None
            if info.get("parent_run") is None
            else {k: info[k] for k in ("parent_run", "branch_step", "branch", "label")},
        }

    def _stored_groups(self, run: int, info: dict[str, Any]) -> dict[str, Any] | None:
        """`groups_of` a stored run, worked out once per run (a partition of 10,000 names is not
        free, and every session of the run has it)."""
        cache: dict[int, dict[str, Any] | None] = self.__dict__.setdefault("_groups_of_runs", {})
        if run not in cache:
            names = [str(p.get("name")) for p in info["params"] if isinstance(p, dict)]
            cache[run] = groups_of(info["meta"], names)
        return cache[run]


class ReplaySource(Source):
    """A recorded run, served read-only. Every command answers 403."""

    mode = "replay"
    read_only = True

    def __init__(self, store: HistoryStore, run_id: int | None = None) -> None:
        self.store = store
        run = run_id if run_id is not None else store.latest_run_id()
        if run is None:
            raise ApiError(404, f"{store.path} holds no run")
        try:
            info = store.run(run)
        except StoreError as e:
            raise ApiError(409, str(e)) from e
        if info is None:
            raise ApiError(404, f"{store.path} has no run {run}")
        self.run_id = run

    def session(self, run: int | None = None) -> dict[str, Any]:
        return self.stored_session(self._run(run), read_only=True, live=False)

    def targets(self, glob: str, point: str | None) -> list[str]:
        raise ApiError(403, "read-only: a replay has no live model to match targets against")

    def stop(self) -> None:
        if self.store is not None:
            self.store.close()


def detail_of(exc: BaseException) -> list[dict[str, Any]]:
    """The `[{loc, msg}]` of a core `HookError` (or of anything with `.loc`/`.msg`)."""
    detail = getattr(exc, "detail", None)
    if callable(detail):
        return detail()
    return error_detail(tuple(getattr(exc, "loc", ()) or ()), str(getattr(exc, "msg", exc)))
