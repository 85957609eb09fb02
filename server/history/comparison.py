"""`inspector.compare(...)`'s results in a history database, and served read-only.

`save` writes branch A as a run and branch B as its branch from step 0 (`branch="shadow"`, the
label naming B's hooks), so the dashboard (and `gradient-inspector replay`, and the HTML report)
shows B dashed over A, as the demo's shadow comparison; the comparison's warnings (why the
branches may differ by more than their hooks) are a `compare_warning` event in each run. `serve`
saves to a file (a temporary one by default) and serves it read-only from a background thread.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

from ..app import create_app
from ..serving import ThreadedServer
from ..settings import Settings
from ..sources import ReplaySource
from .storage import HistoryStore


def _label(hooks: list[dict[str, Any]]) -> str:
    if not hooks:
        return "B: no hooks"
    return "B: " + ", ".join(f"{h.get('kind')} on {h.get('target')!r}" for h in hooks)


def save(cmp: Any, path: str) -> tuple[int, int]:
    """Write both branches to the database `path`; returns `(run_a, run_b)`."""
    store = HistoryStore(path)
    try:
        meta = {"mode": "compare"}
        run_a = store.new_run(params=cmp.params, modules=cmp.modules, meta={**meta, "branch": "a"})
        run_b = store.new_run(
            params=cmp.params,
            modules=cmp.modules,
            meta={**meta, "branch": "b"},
            parent_run=run_a,
            branch_step=0,
            branch="shadow",
            label=_label(cmp.b.hooks),
        )
        store.start_writer()
        for run, branch in ((run_a, cmp.a), (run_b, cmp.b)):
            # why the branches may differ by more than their hooks: in each run's event log
            for seq, w in enumerate(getattr(cmp, "warnings", ()), start=1):
                store.add_event(run, {"seq": seq, "kind": "compare_warning", "time": time.time(), **w})
            store.add_hooks(run, 1, branch.hooks)
            for snap in branch.snapshots:
                store.add_snapshot(run, snap)
            for row in branch.scalars:
                store.add_scalars(run, row)
        store.flush(30.0)
    finally:
        store.close()
    return run_a, run_b


class ComparisonServer:
    def __init__(self, server: ThreadedServer, store: HistoryStore) -> None:
        self._server, self._store = server, store
        self.url = server.url

    def stop(self) -> None:
        self._server.stop()
        self._store.close()


def serve(cmp: Any, *, host: str, port: int, token: str | None, db: Any) -> ComparisonServer:
    path = (
        os.fspath(db)
        if db is not None
        else os.path.join(tempfile.mkdtemp(prefix="gi-compare-"), "compare.sqlite")
    )
    run_a, _ = save(cmp, path)
    store = HistoryStore(path, read_only=True)
    settings = Settings(host=host, port=port, token=token, read_only=True)
    server = ThreadedServer(create_app(ReplaySource(store, run_a), settings), settings, quiet=True)
    server.start()
    return ComparisonServer(server, store)
