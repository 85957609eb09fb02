"""The demo's training thread: a built-in scenario stepped in the background.

Each iteration runs one full training step (`scenario.step()`), records the
loss, then waits so that at most `rate` steps run per second (`None`: as fast as
the machine goes). The cap can change at run time (`set_rate`, the
`/api/training/rate` route) and takes effect at once. Pause, resume and single
step are the core's (`insp.pause()`...): the thread blocks at the step boundary.

Waiting for a page: with `wait_for_client=True` (the CLI's default; `--no-wait`
turns it off) the thread trains nothing until `client_arrived()` is called,
which the live source does when the first websocket (a page) says hello, so a
person who opens the URL sees the scenario from step 0 and can follow hints
such as "add clip_norm before step ~40".

Non-finite runs: a scenario whose loss stays non-finite for `reset_after`
consecutive steps (its weights are NaN: nothing can recover) is reset in place
(`scenario.reset()`: fresh weights and optimizer state, same model objects).
It stays the same run: the step counter goes on, the hooks stay, and a
`scenario_reset` event marks the moment, so a hook added to tame the
explosion is seen working on the fresh start.

Hints that can be followed: a scenario whose hint names a step (`scenario.hint_step`: "add
clip_norm before step ~40") is paused `pause_before_hint` steps before it (held at that step's
boundary), once per run, with a `hint_pause` event and the reason in the training state
(`pause_reason`) until the user resumes; `pause_before_hint=None` (the CLI's
`--no-pause-before-hint`) trains straight through.

What-if (server/live/shadow.py): between two steps the thread carries out the
inspector's checkpoint and rewind requests (`insp.checkpoints.service`), and
makes and steps the shadow copy of a comparison (`whatif.after_step`). A
checkpoint of the demo also saves the scenario's data position, so a rewind
replays the same batches (in a user's loop the data loader goes on). The scenario
takes its batches through `insp.batches(scenario.stream())`, its state registered
as the data stream's (`add_state(..., data=True)`): a rewind with `skip` goes back
to the checkpoint's position and draws and drops the skipped window
(inspector/whatif/skip.py): on `nan`, a rewind from past step 30 to before it
with the batches since the checkpoint skipped never meets the bad batch again.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

from ..core import Core

log = logging.getLogger("gradient_inspector.demo")


class Trainer:
    """Runs `scenario.step()` in a daemon thread; see the module docstring.

    Args:
        scenario: from `inspector.scenarios.make(name)`.
        insp: the inspector attached to the scenario's model and optimizer.
        steps_per_second: the cap (None for none).
        reset_after: consecutive non-finite losses before the scenario is reset.
        wait_for_client: train nothing until `client_arrived()` (the first page).
        auto_shadow: start a shadow comparison at each hook change from the page.
        pause_before_hint: hold training this many steps before the scenario's `hint_step`, once
            (None: never).
    """

    def __init__(
        self,
        scenario: Any,
        insp: Core,
        *,
        steps_per_second: float | None = 10.0,
        reset_after: int = 30,
        wait_for_client: bool = False,
        auto_shadow: bool = True,
        pause_before_hint: int | None = None,
    ) -> None:
        from .shadow import ShadowHost

        self.scenario = scenario
        self.insp = insp
        self.reset_after = reset_after
        self.resets = 0
        self.bad = 0  # consecutive non-finite losses
        self._in_step = False  # inside scenario.step() (a checkpoint taken at its boundary)
        self.whatif = ShadowHost(insp, scenario, auto=auto_shadow, give_up_after=reset_after)
        # the scenario's data stream is seekable: a rewind puts it back, and can skip batches
        insp.checkpoints.add_state("scenario", self._save_state, self._load_state, data=True)
        scenario.batch_source = insp.batches(scenario.stream())
        insp.checkpoints.on_request.append(self._request)
        self.error: BaseException | None = None
        self._rate = steps_per_second
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._go = threading.Event()  # set: training may run (a page arrived, or no wait asked)
        if not wait_for_client:
            self._go.set()
        self._thread: threading.Thread | None = None
        self._service = False  # a request waits for the next point between steps
        hint = getattr(scenario, "hint_step", None)
        # the step whose boundary holds for the hint (once per run); None: no pause
        self._hint_hold: int | None = (
            max(1, int(hint) - pause_before_hint)
            if hint is not None and pause_before_hint is not None
            else None
        )
        self._hint_step = hint
        self.pause_reason: str | None = None  # why training is held, while the hint's pause lasts

    @property
    def rate(self) -> float | None:
        return self._rate

    def set_rate(self, steps_per_second: float | None) -> None:
        self._rate = steps_per_second
        self._wake.set()  # a long wait under the old cap ends now

    @property
    def waiting(self) -> bool:
        """True while training waits for its first page (`wait_for_client`)."""
        return not self._go.is_set()

    def client_arrived(self) -> None:
        """A page connected: training starts now if it was waiting; harmless afterwards."""
        self._go.set()
        self._wake.set()

    def _request(self) -> None:
        """A checkpoint or rewind was asked for: carry it out between steps now, not after the wait."""
        self._service = True
        self._wake.set()

    def _save_state(self) -> dict[str, Any]:
        # at a boundary inside scenario.step() its counter has not counted that step yet
        state = self.scenario.data_state()
        state["steps_done"] += 1 if self._in_step else 0
        return state

    def _load_state(self, state: dict[str, Any]) -> None:
        self.scenario.set_data_state(state)
        if self._in_step:
            self.scenario.steps_done -= 1  # step() counts the step it is in when it returns
        self.bad = 0
        self.whatif.stop("the main run was rewound")

    def _between_steps(self) -> None:
        """The safe point between two steps: checkpoints, rewinds, the shadow."""
        self._service = False
        try:
            self.insp.checkpoints.service(owner=True)
            self.whatif.after_step()
        except Exception as e:  # the what-if must never stop the demo's training
            log.exception("gradient-inspector demo: the what-if failed")
            self.insp.add_event("shadow_error", message=f"{type(e).__name__}: {e}", step=self.insp.step)

    def _before_hint(self) -> None:
        """Between two steps: the step before the hint's hold asks for a pause (it holds at the next
        boundary, the hold step's); a reason stays only while that pause lasts."""
        step = self.insp.step
        if self.pause_reason is not None and self.insp.state["state"] != "paused":
            self.pause_reason = None
        hold = self._hint_hold
        if hold is None or step != hold - 1:
            return
        self._hint_hold = None  # once per run: a rewind or a reset before it does not pause again
        self.pause_reason = (
            f"paused at step {hold}, {self._hint_step - hold} steps before step {self._hint_step}"
            " that the scenario's hint names: follow it (add the hook), then resume"
        )
        self.insp.add_event("hint_pause", step=hold, hint_step=self._hint_step, reason=self.pause_reason)
        self.insp.pause()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gradient-inspector-demo", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._go.set()  # a thread still waiting for its first page sees the stop flag
        if self._thread is not None and self._thread.is_alive():
            if self.insp.state["state"] == "paused":
                self.insp.resume()  # the thread waits at the boundary: let it reach the stop flag
            self._thread.join(timeout)

    def _run(self) -> None:
        self._service = False
        while not self._go.is_set() and not self._stop.is_set():
            self._wake.wait()  # a page, a stop, or a checkpoint asked for before the first step
            self._wake.clear()
            self._between_steps()
        try:
            while not self._stop.is_set():
                t0 = time.monotonic()
                self._in_step = True
                try:
                    loss = self.scenario.step()
                finally:
                    self._in_step = False
                self.insp.record(loss=loss)
                # One host sync per step: fine at a demo's rate.
                value = float(loss.detach().float().sum()) if hasattr(loss, "detach") else float(loss)
                self.bad = 0 if math.isfinite(value) else self.bad + 1
                if self.bad >= self.reset_after:
                    self.bad = 0
                    self.resets += 1
                    self.scenario.reset()
                    self.whatif.stop("the scenario was reset")
                    self.insp.add_event(
                        "scenario_reset",
                        step=self.insp.step,
                        reason=f"loss non-finite for {self.reset_after} steps: fresh weights, same hooks",
                    )
                self._between_steps()
                self._before_hint()
                while not self._stop.is_set():  # the rate cap's wait, woken early for requests
                    rate = self._rate
                    delay = t0 + 1.0 / rate - time.monotonic() if rate else 0.0
                    if delay <= 0:
                        break
                    self._wake.wait(min(delay, 60.0))  # (a tiny rate: a wait too long for the OS timer)
                    self._wake.clear()
                    if self._service:
                        self._between_steps()
                self._wake.clear()
        except Exception as e:  # a failing scenario stops training, not the server
            self.error = e
            log.exception("gradient-inspector demo: training stopped")
            self.insp.add_event("training_error", message=f"{type(e).__name__}: {e}", step=self.insp.step)
        finally:
            self.whatif.close()
