"""gradient-inspector's core library: real PyTorch gradient hooks, live-editable, with telemetry.

    import inspector
    insp = inspector.attach(model, optimizer)
    insp.add_hook("clip_norm", target="*", max_norm=1.0)
    url = insp.serve()          # the dashboard (imports the server lazily)

This package imports torch only: no web framework is imported until ``serve()``.
"""

from ._version import __version__
from .hooks.handles import HookHandle
from .hooks.owned import attached
from .hooks.targets import match as match_targets
from .inspector import Inspector, Options, attach
from .whatif.compare import CompareWarning, Comparison, compare
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
