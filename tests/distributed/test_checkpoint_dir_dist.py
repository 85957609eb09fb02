"""DCP directories under DDP: two gloo ranks (tests/distributed/dcp_worker.py). The loop writes
its own checkpoint with ``dcp.save`` at a boundary every rank reaches; the inspector's reading
(inspector/whatif/dcp_store.py) refuses a partial directory on every rank before anything is
loaded, and reads a whole one back in place on every rank, bitwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import free_port

WORKER = Path(__file__).with_name("dcp_worker.py")
pytestmark = [pytest.mark.dist, pytest.mark.slow]


def test_two_ranks_read_a_dcp_directory_back_and_refuse_a_partial_one(tmp_path):
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
        "PYTHONUNBUFFERED": "1",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "--out", str(tmp_path)],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert len(r0["files"]) == 2  # each rank wrote its own data file
    for r in (r0, r1):
        assert (
            r["partial"] is not None and "partial checkpoint" in r["partial"] and "is missing" in r["partial"]
        )
        assert r["unchanged"] and r["restored"]
    assert r0["sum"] == r1["sum"]  # ranks in lockstep after the rewind
