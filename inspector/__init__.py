"""gradient-inspector's core library: real PyTorch gradient hooks, live-editable, with telemetry.

    import inspector
    insp = inspector.attach(model, optimizer)
    insp.add_hook("clip_norm", target="*", max_norm=1.0)
    url = insp.serve()          # the dashboard (imports the server lazily)

This package imports torch only: no web framework is imported until ``serve()``. Importing
it imports only the wire's tables (the hook kinds, the records, the errors: no torch); torch and
the rest of the core are imported on first use of a name that needs them (``attach``,
``Inspector``, ``compare``, ...), so a server that only reads a recorded run (a replay) never
imports torch.
"""

import importlib as _importlib
import typing as _typing

from ._version import __version__
from .wire.errors import (
    AttachError,
    CheckpointBusy,
    CheckpointError,
    CheckpointNotFound,
    HookError,
    HookNotFound,
    InspectorError,
    RewindPending,
)
from .wire.kinds import POINTS, hook_kinds
from .wire.records import HookSpec, Snapshot

if _typing.TYPE_CHECKING:
    from .hooks.handles import HookHandle
    from .hooks.owned import attached
    from .hooks.targets import match as match_targets
    from .inspector import Inspector, Options, attach
    from .whatif.compare import CompareWarning, Comparison, compare

# name -> (module, attribute): imported on first use (`__getattr__`)
_LAZY = {
    "HookHandle": (".hooks.handles", "HookHandle"),
    "attached": (".hooks.owned", "attached"),
    "match_targets": (".hooks.targets", "match"),
    "Inspector": (".inspector", "Inspector"),
    "Options": (".inspector", "Options"),
    "attach": (".inspector", "attach"),
    "CompareWarning": (".whatif.compare", "CompareWarning"),
    "Comparison": (".whatif.compare", "Comparison"),
    "compare": (".whatif.compare", "compare"),
}


def __getattr__(name: str) -> _typing.Any:
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(where[0], __name__), where[1])
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "__version__",
    "attach",
    "attached",
    "Inspector",
    "Options",
    "HookHandle",
    "HookSpec",
    "Snapshot",
    "hook_kinds",
    "match_targets",
    "POINTS",
    "InspectorError",
    "HookError",
    "HookNotFound",
    "AttachError",
    "CheckpointError",
    "CheckpointNotFound",
    "CheckpointBusy",
    "RewindPending",
    "compare",
    "Comparison",
    "CompareWarning",
]
