"""`Core`: the Inspector as the server uses it, the one seam between the server and the core.

The server is handed an attached `inspector.Inspector` (`insp.serve()`, the demo's CLI) and
reaches it only through the members declared here: `Core` for the Inspector itself, and the
three small protocols for what its members return (`insp.checkpoints`, the checkpoints it holds,
the handle `add_hook` returns). A member the server starts using is added here first; a member
renamed in the core fails `tests/packaging/test_seam.py`, which checks the real classes against
these protocols (names, parameters and their kinds).

Only for typing: nothing here imports the core, so replay and export never import torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

__all__ = ["Core", "CoreCheckpoint", "CoreCheckpoints", "CoreHookHandle"]


class CoreHookHandle(Protocol):
    """The handle `Core.add_hook` returns."""

    @property
    def id(self) -> str: ...

    @property
    def accepted(self) -> dict[str, Any] | None:
        """The spec as the change that made the hook was accepted."""
        ...


class CoreCheckpoint(Protocol):
    """One checkpoint (`CoreCheckpoints.get`); `step` is None until it is taken."""

    @property
    def id(self) -> str: ...

    @property
    def step(self) -> int | None: ...

    def info(self) -> dict[str, Any]:
        """`{"id", "label", "auto", "step", "time", "bytes", "taken", "config_version", "hooks"}`."""
        ...


class CoreCheckpoints(Protocol):
    """`Core.checkpoints`: the checkpoints and the queue of checkpoint and rewind requests."""

    on_request: list[Callable[[], None]]  # called after a request is queued (any thread)
    keep: int  # the newest this many are kept (a 404 names it)

    def refusal(self) -> str | None:
        """Why checkpoints cannot be taken here, or None."""
        ...

    def checkpoint(self, label: str | None = None, *, auto: bool = False, origin: str | None = None) -> str:
        """Request a checkpoint; its id (`origin`: who asks, `page` for the server)."""
        ...

    def request(
        self, label: str | None = None, *, auto: bool = False, origin: str | None = None
    ) -> dict[str, Any]:
        """Request a checkpoint; its `info()` as of the request."""
        ...

    def list(self) -> list[dict[str, Any]]:
        """The checkpoints kept, oldest first, then those requested and not taken yet."""
        ...

    def discard(self, cp_id: str) -> None: ...

    def summary(self) -> dict[str, Any]:
        """`{"checkpoints", "bytes", "keep", "rewinds", "refused", "every", "budget", "auto_refused"}`
        (`GET /api/checkpoints`)."""
        ...

    def add_state(
        self, key: str, save: Callable[[], Any], load: Callable[[Any], None], *, data: bool = False
    ) -> None:
        """Save `save()` with every checkpoint, and `load(value)` it on a rewind (`data`: the data
        stream's state, so `batches()`'s position goes back with it)."""
        ...

    def service(self, *, owner: bool = False) -> None:
        """Carry the queued requests out, if this is a safe point (the demo's thread, between steps)."""
        ...

    def get(self, cp_id: str) -> CoreCheckpoint: ...

    def adopt(self, cp: CoreCheckpoint) -> None:
        """Start this run from another Inspector's checkpoint (`get`'s) of the same model."""
        ...


class Core(Protocol):
    """The members of `inspector.Inspector` the server uses (see the module docstring)."""

    params: list[str]
    modules: list[str]

    # -- state -----------------------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Completed optimizer steps."""
        ...

    @property
    def config_version(self) -> int:
        """How many hook changes have been applied."""
        ...

    @property
    def state(self) -> dict[str, Any]:
        """`{"state": "running" | "paused" | "finished", "step", "held"}`."""
        ...

    @property
    def groups(self) -> dict[str, Any]:
        """`{"source", "names", "members", "stacks"}`: the parameters' groups (plain data)."""
        ...

    def param_info(self) -> list[dict[str, Any]]: ...

    @property
    def spike_detection(self) -> dict[str, Any] | None:
        """The spike detector's settings (None: the flight recorder is off)."""
        ...

    def set_spike_detection(
        self,
        *,
        enabled: bool | None = None,
        z: float | None = None,
        warmup: int | None = None,
        alpha: float | None = None,
        cooldown: int | None = None,
    ) -> dict[str, Any]: ...

    def flight_recorder(self) -> dict[str, Any]: ...

    def match_targets(self, glob: str, point: str = "pre_step") -> list[str]: ...

    # -- hooks -----------------------------------------------------------------------------------------

    def add_hook(
        self,
        kind: str,
        target: str = "*",
        point: str | None = None,
        *,
        enabled: bool = True,
        params: Mapping[str, Any] | None = None,
    ) -> CoreHookHandle: ...

    def update_hook(
        self,
        hook_id: str,
        *,
        params: Mapping[str, Any] | None = None,
        enabled: bool | None = None,
        target: str | None = None,
        position: int | None = None,
    ) -> dict[str, Any]: ...

    def remove_hook(self, hook_id: str) -> None: ...

    # rules (inspector.rules)
    @property
    def rules(self) -> list[dict[str, Any]]: ...

    def add_rule(self, rule: Mapping[str, Any] | None = None, /, **fields: Any) -> dict[str, Any]: ...

    def update_rule(
        self, rule_id: str, change: Mapping[str, Any] | None = None, /, **fields: Any
    ) -> dict[str, Any]: ...

    def remove_rule(self, rule_id: str) -> None: ...

    def load_rules(self, preset: Any) -> list[dict[str, Any]]: ...

    def set_rule_handler(self, action: str, fn: Callable[[dict[str, Any]], Any] | None) -> None: ...

    def hooks(self) -> list[dict[str, Any]]: ...

    def export_hooks(self) -> dict[str, Any]: ...

    def import_hooks(self, preset: Mapping[str, Any] | list[Any]) -> list[dict[str, Any]]: ...

    def requested_config(self) -> tuple[int, list[dict[str, Any]]]:
        """`(config_version, hooks)` of the requested configuration, read together."""
        ...

    # -- data ------------------------------------------------------------------------------------------

    def record(self, **scalars: Any) -> None: ...

    def snapshots(self, since: int | None = None) -> list[dict[str, Any]]:
        """The ring buffer's snapshots with `step > since`, as wire dicts."""
        ...

    def latest(self) -> dict[str, Any] | None: ...

    def events(self, since: int | None = None) -> list[dict[str, Any]]:
        """The ring buffer's events with `seq > since`."""
        ...

    def subscribe(
        self, callback: Callable[[str, Any], None], *, lossless: bool = False
    ) -> Callable[[], None]:
        """`callback(kind, payload)` for every record, off the training thread; returns the unsubscribe."""
        ...

    def add_event(self, kind: str, **fields: Any) -> dict[str, Any]: ...

    def set_hist_subscription(self, key: str, names: list[str]) -> None:
        """Histogram parameters wanted by one consumer (`key`); `[]` drops it."""
        ...

    # -- control ---------------------------------------------------------------------------------------

    def pause(self) -> dict[str, Any]: ...

    def resume(self) -> dict[str, Any]: ...

    def step_once(self) -> dict[str, Any]: ...

    def close(self) -> None: ...

    # -- what-if ---------------------------------------------------------------------------------------

    @property
    def checkpoints(self) -> CoreCheckpoints: ...

    def rewind(self, checkpoint: str, skip: Any = None) -> dict[str, Any]: ...

    def batches(self, iterable: Any) -> Iterator[Any]: ...
