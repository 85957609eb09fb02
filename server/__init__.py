"""gradient-inspector's server: the FastAPI app, the websocket hub, history and the CLI.

Imports `inspector`; `inspector` never imports this package at module level
(`insp.serve()` loads it lazily). Modules import each other relatively only: the
core may load this package under another name when the user's working
directory has a `server.py` of its own.
"""

from .app import create_app
from .history.storage import HistoryStore
from .live.embed import EmbeddedServer, start
from .live.source import LiveSource
from .settings import Settings
from .sources import ApiError, ReplaySource, Source

__all__ = [
    "ApiError",
    "EmbeddedServer",
    "HistoryStore",
    "LiveSource",
    "ReplaySource",
    "Settings",
    "Source",
    "create_app",
    "start",
]
