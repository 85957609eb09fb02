"""The demo's shadow branch: the same scenario trained from a checkpoint, beside the main run, on the
same batches, with the hooks of the checkpoint (so without the change made since).

A comparison starts at a hook change made from the page (from the automatic checkpoint taken just
before it), or on the page's "compare from here" (a checkpoint of now); one at a time. The
shadow is a second copy of the scenario (`scenarios.make(name, seed)`: the same model, teacher
and data stream), given the checkpoint's model, optimizer, data position and hooks, with an
Inspector of its own (every step sampled, so its statistics are the main run's kind). The demo's
training thread steps it right after every main step (a second training step: the page says it
costs that), until the user ends it, the main run is rewound or reset, or the shadow's loss has
been non-finite for `give_up_after` steps.

Everything the shadow records goes to the history as a run of its own, a branch of the main run
(`branch="shadow"`, `branch_step`, `label`: "without clip_norm h1"), so a replay or the HTML
report shows the comparison; the page gets a `shadow` message per step and a `shadow_state` one
when it starts, ends or its label changes (PROTOCOL.md).
"""

from __future__ import annotations

import logging
import math
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from ..core import Core, CoreCheckpoint

log = logging.getLogger("gradient_inspector.demo")

MAX_POINTS = 3000  # shadow points kept in memory for a page's backfill (GET /api/shadow)
COST_NOTE = "the shadow costs a second training step per step"


def describe_difference(main: list[dict[str, Any]], shadow: list[dict[str, Any]]) -> str:
    """What the shadow's hooks lack or have compared with what the main run has now, in words:
    "without clip_norm h1", "without clip_norm h1, which the main run has disabled: the same hooks
    in effect", "with clip_norm h1, which the main run no longer has", "with clip_norm h1
    enabled, disabled in the main run", "h1 as before (max_norm=1.0), changed in the main run",
    or "same hooks"."""

    def name(h: dict[str, Any]) -> str:
        return f"{h.get('kind')} {h.get('id')}"

    def content(h: dict[str, Any]) -> tuple[Any, ...]:
        return (
            h.get("target"),
            h.get("point"),
            repr(sorted((h.get("params") or {}).items())),
            h.get("enabled"),
        )

    ours = {h["id"]: h for h in shadow}
    theirs = {h["id"]: h for h in main}
    parts = [
        f"without {name(h)}" + ("" if h.get("enabled", True) else ", which the main run has disabled")
        for h in main
        if h["id"] not in ours
    ]
    parts += [f"with {name(h)}, which the main run no longer has" for h in shadow if h["id"] not in theirs]
    for h in shadow:
        m = theirs.get(h["id"])
        if m is None or content(m) == content(h):
            continue
        if m.get("enabled") != h.get("enabled") and content({**m, "enabled": h.get("enabled")}) == content(h):
            on = "enabled" if h.get("enabled") else "disabled"
            parts.append(
                f"with {name(h)} {on}, {'disabled' if h.get('enabled') else 'enabled'} in the main run"
            )
        else:
            params = ", ".join(f"{k}={v}" for k, v in (h.get("params") or {}).items())
            before = f"{name(h)} as before ({params})" if params else f"{name(h)} as before"
            parts.append(f"{before}, changed in the main run")
    if not parts:
        return "same hooks"
    # a hook only the main run has, but disabled there, changes nothing: say the effect is the same
    inert = all(h["id"] in ours or not h.get("enabled", True) for h in main) and all(
        h["id"] in theirs for h in shadow
    )
    same = inert and all(content(theirs[h["id"]]) == content(h) for h in shadow if h["id"] in theirs)
    return "; ".join(parts) + (": the same hooks in effect" if same else "")


class Shadow:
    """One running shadow: its scenario copy and Inspector (made and stepped on the training thread)."""

    def __init__(self, scenario: Any, cp: CoreCheckpoint, run: int | None) -> None:
        import inspector
        from inspector import scenarios

        self.sc = scenarios.make(scenario.name, seed=scenario.seed, device=scenario.device)
        self.insp: Core = inspector.attach(self.sc.model, self.sc.optimizer, every=1, checkpoints=0)
        self.insp.checkpoints.add_state("scenario", self.sc.data_state, self.sc.set_data_state)
        self.insp.checkpoints.adopt(cp)
        self.run = run
        self.branch_step: int = cp.step
        self.bad = 0
        self.hooks = self.insp.hooks()

    def step(self) -> dict[str, Any]:
        loss = self.sc.step()
        self.insp.record(loss=loss)
        value = float(loss.detach().float().sum())  # one host sync, as the main run's
        snap = self.insp.latest() or {}
        self.bad = 0 if math.isfinite(value) else self.bad + 1
        return {
            "step": self.insp.step,
            "loss": value if math.isfinite(value) else ("nan" if math.isnan(value) else "inf"),
            "total_norm_raw": snap.get("total_norm_raw"),
            "total_norm": snap.get("total_norm"),
        }

    def close(self) -> None:
        self.insp.close()  # the last late records reach the history first


class ShadowHost:
    """The demo's what-if: at most one `Shadow`, started and ended on request from any thread, made
    and stepped by the demo's training thread (`after_step`). See the module docstring.

    Args:
        insp: the main run's Inspector.
        scenario: the main run's scenario.
        auto: start a comparison at each hook change from the page (when none runs).
        give_up_after: end a shadow whose loss has been non-finite for this many steps.
    """

    def __init__(self, insp: Core, scenario: Any, *, auto: bool = True, give_up_after: int = 30) -> None:
        self.insp = insp
        self.scenario = scenario
        self.auto = auto
        self.give_up_after = give_up_after
        self.store: Any = None
        self.parent_run: int | None = None
        self.publish: Callable[[str, dict[str, Any], str | None], None] | None = None
        self._lock = threading.Lock()
        self._shadow: Shadow | None = None
        self._start: tuple[str, str] | None = None  # (checkpoint id, why) waiting for the training thread
        self._stop: str | None = None  # why the running shadow is to end
        self._state: dict[str, Any] = {"active": False, "run": None, "branch_step": None, "label": None}
        self._points: deque[dict[str, Any]] = deque(maxlen=MAX_POINTS)
        self._main_hooks: list[dict[str, Any]] = []

    # -- requests (any thread) ------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._shadow is not None or self._start is not None

    def start_from(self, cp_id: str, why: str) -> bool:
        """Ask for a shadow from checkpoint `cp_id`; False when one runs (or is starting) already."""
        with self._lock:
            if self._shadow is not None or self._start is not None:
                return False
            self._start, self._stop = (cp_id, why), None
        return True

    def stop(self, why: str) -> bool:
        """Ask the running (or starting) shadow to end; False when there is none."""
        with self._lock:
            if self._start is not None and self._shadow is None:
                self._start = None
                return True
            if self._shadow is None:
                return False
            self._stop = why
        return True

    def hooks_changed(self, hooks: list[dict[str, Any]]) -> None:
        """The main run's hooks changed (a `hooks` message): the label says the new difference,
        while the shadow runs; one that is ending (a rewind, a stop) keeps the label it ran with."""
        with self._lock:
            self._main_hooks = list(hooks)
            sh = self._shadow
            if sh is None or self._stop is not None:
                return
            label = "shadow: " + describe_difference(self._main_hooks, sh.hooks)
            if label == self._state["label"]:
                return
            self._state = {**self._state, "label": label}
            state = dict(self._state)
        if self.store is not None and sh.run is not None:
            self.store.set_label(sh.run, label)
        self._send("shadow_state", state)

    def state(self) -> dict[str, Any]:
        """`{"active", "run", "branch_step", "label", "step", "cost", "points"}` of the running or
        last shadow (`points`: its newest `MAX_POINTS` steps, `{"step", "loss", "total_norm_raw",
        "total_norm"}`)."""
        with self._lock:
            return {**self._state, "cost": COST_NOTE, "points": list(self._points)}

    # -- the training thread --------------------------------------------------------------------------

    def after_step(self) -> None:
        """Start, step (up to the main run's step) or end the shadow. The demo's training thread,
        between steps."""
        with self._lock:
            start, stop, sh = self._start, self._stop, self._shadow
        if sh is not None and stop is not None:
            self._end(sh, stop)
            return
        if sh is None and start is not None:
            sh = self._begin(*start)
            if sh is None:
                return
        if sh is None:
            return
        while sh.insp.step < self.insp.step:
            point = sh.step()
            with self._lock:
                self._points.append(point)
                self._state = {**self._state, "step": point["step"]}
            self._send("shadow", {"run": sh.run, **point})
            if sh.bad >= self.give_up_after:
                self._end(sh, f"its loss was non-finite for {self.give_up_after} steps")
                return

    def _begin(self, cp_id: str, why: str) -> Shadow | None:
        import inspector

        try:
            cp = self.insp.checkpoints.get(cp_id)
        except inspector.CheckpointNotFound:
            with self._lock:
                self._start = None
            return None
        if cp.step is None:
            return None  # not taken yet: at the next boundary
        run = None
        hooks = cp.info()["hooks"]
        self._main_hooks = self.insp.hooks()
        label = "shadow: " + describe_difference(self._main_hooks, hooks)
        if self.store is not None and self.parent_run is not None:
            run = self.store.new_run(
                params=self.insp.param_info(),
                modules=list(self.insp.modules),
                scenario=self.scenario.name,
                meta={"mode": "shadow", "checkpoint": cp.id, "why": why},
                parent_run=self.parent_run,
                branch_step=cp.step,
                branch="shadow",
                label=label,
            )
        try:
            sh = Shadow(self.scenario, cp, run)
        except Exception as e:  # a shadow that cannot start must not stop the demo
            log.exception("gradient-inspector demo: the shadow could not start")
            with self._lock:
                self._start = None
            self.insp.add_event(
                "shadow_error", message=f"the shadow could not start: {type(e).__name__}: {e}"
            )
            return None
        if run is not None:
            store = self.store

            def record(kind: str, payload: Any) -> None:
                if kind == "snapshot":
                    store.add_snapshot(run, payload)
                elif kind == "scalars":
                    store.add_scalars(run, payload)
                elif kind == "event":
                    store.add_event(run, payload)
                elif kind == "hooks":
                    store.add_hooks(run, int(payload["config_version"]), payload["hooks"])

            sh.insp.subscribe(record, lossless=True)
            store.add_hooks(run, sh.insp.config_version, sh.insp.hooks())
        with self._lock:
            self._shadow, self._start, self._stop = sh, None, None
            self._points.clear()
            self._state = {
                "ended": None,
                "ended_step": None,
                "active": True,
                "run": run,
                "branch_step": cp.step,
                "label": label,
                "step": cp.step,
            }
            state = dict(self._state)
        self.insp.add_event(
            "shadow_started",
            step=cp.step,
            run=run,
            checkpoint=cp.id,
            label=label,
            message=f"comparison from step {cp.step} ({why}): {label}; {COST_NOTE}",
        )
        self._send("shadow_state", state)
        return sh

    def _end(self, sh: Shadow, why: str) -> None:
        try:
            sh.close()
        finally:
            with self._lock:
                self._shadow, self._stop = None, None
                self._state = {**self._state, "active": False, "ended": why, "ended_step": sh.insp.step}
                state = dict(self._state)
        self.insp.add_event(
            "shadow_ended",
            step=self.insp.step,
            run=sh.run,
            message=f"comparison ended at step {sh.insp.step}: {why}",
        )
        self._send("shadow_state", state)

    def close(self) -> None:
        """The demo stops (its training thread has ended): close a running shadow."""
        with self._lock:
            sh, self._shadow = self._shadow, None
        if sh is not None:
            sh.close()

    def _send(self, kind: str, payload: dict[str, Any]) -> None:
        if self.publish is not None:
            try:
                self.publish(kind, payload, None)
            except Exception:  # the page misses a point; training goes on
                log.exception("gradient-inspector demo: a %s message could not be sent", kind)
