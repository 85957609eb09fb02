"""User mode: `insp.serve()` beside the user's own loop, its failures, and the shipped example."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import torch
import uvicorn
from torch import nn
from websockets.sync.client import connect

import inspector
from tests.support import wait_until

REPO = Path(__file__).resolve().parents[2]


def tiny():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def train(model, opt, insp, steps):
    for _ in range(steps):
        x = torch.randn(16, 4)
        loss = nn.functional.mse_loss(model(x), x[:, :1])
        opt.zero_grad()
        loss.backward()
        opt.step()
        insp.record(loss=loss)


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_serve_beside_a_users_loop(tmp_path):
    model, opt = tiny()
    insp = inspector.attach(model, opt, every=1)
    url = insp.serve(port=0, db=str(tmp_path / "user.sqlite"))
    try:
        port = urlsplit(url).port
        assert url == f"http://127.0.0.1:{port}/"
        c = httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=10)
        train(model, opt, insp, 5)
        session = c.get("/api/session").json()
        assert session["mode"] == "user" and session["training"]["step"] == 5
        assert session["training"]["scenario"] is None and session["history"]["db"].endswith("user.sqlite")
        with connect(f"ws://127.0.0.1:{port}/ws", proxy=None, max_size=None) as ws:
            assert json.loads(ws.recv(timeout=10))["type"] == "hello"
            assert (
                c.post(
                    "/api/hooks", json={"kind": "clip_value", "target": "*", "params": {"threshold": 1e-4}}
                ).status_code
                == 201
            )
            train(model, opt, insp, 3)  # the user's thread applies the edit at its next step
            while True:
                msg = json.loads(ws.recv(timeout=10))
                if msg["type"] == "snapshot" and msg["data"]["config_version"] >= 1:
                    assert max(msg["data"]["grad_absmax"]) <= 1e-4 * (1 + 1e-6)
                    break
        assert c.post("/api/training/rate", json={"steps_per_second": 5}).status_code == 409
        c.close()
    finally:
        insp.close()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/api/health", trust_env=False, timeout=2)


def test_a_taken_port_is_a_clear_error_and_training_goes_on():
    model, opt = tiny()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with inspector.attach(model, opt) as insp:
            with pytest.raises(OSError, match="already in use"):
                insp.serve(port=port, db=False)
            train(model, opt, insp, 3)
            assert insp.step == 3


def test_a_crash_of_the_server_thread_is_reported_and_training_goes_on(monkeypatch):
    async def boom(self):
        raise RuntimeError("boom")

    monkeypatch.setattr(uvicorn.Server, "main_loop", boom)
    model, opt = tiny()
    with inspector.attach(model, opt) as insp:
        insp.serve(port=0, db=False)
        wait_until(lambda: any(e["kind"] == "server_error" for e in insp.events()), what="server_error event")
        event = next(e for e in insp.events() if e["kind"] == "server_error")
        assert "boom" in event["message"]
        assert insp._dashboard.error is not None
        train(model, opt, insp, 3)
        assert insp.step == 3


@pytest.mark.slow
def test_serve_loads_our_server_package_beside_a_users_server_py(tmp_path):
    (tmp_path / "server.py").write_text("raise SystemExit('the user\\'s own server.py was imported')\n")
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent("""
        import json, urllib.request
        import torch, inspector
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        insp = inspector.attach(model, opt)
        url = insp.serve(port=0, db=False)
        model(torch.ones(1, 2)).sum().backward(); opt.step()
        with urllib.request.urlopen(url.rstrip("/") + "/api/session", timeout=10) as r:
            print(json.load(r)["mode"])
        insp.close()
    """)
    )
    out = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "user"


@pytest.mark.slow
def test_serve_leaves_the_processs_logging_as_it_found_it(tmp_path):
    """A fresh process, as a user's script: the root logger's handlers and level and every
    logger's level are the same after `serve()` (and a request served) as before it, and a
    library's INFO line is not printed after it, as it was not before."""
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent("""
        import json, logging, urllib.request
        import torch, inspector

        def state():
            root = logging.getLogger()
            levels = {
                name: logger.level
                for name, logger in logging.Logger.manager.loggerDict.items()
                if isinstance(logger, logging.Logger)
            }
            return {"handlers": [id(h) for h in root.handlers], "level": root.level, "levels": levels}

        logging.getLogger("somelib").setLevel(logging.INFO)  # a library's own logger, not silenced
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        insp = inspector.attach(model, opt)
        before = state()
        url = insp.serve(port=0, db=False)
        with urllib.request.urlopen(url.rstrip("/") + "/api/session", timeout=10) as r:
            assert json.load(r)["mode"] == "user"
        after = state()
        logging.getLogger("somelib").info("somelib: an INFO line nobody asked to see")
        insp.close()
        print(json.dumps({"before": before, "after": after}))
    """)
    )
    out = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    before, after = seen["before"], seen["after"]
    assert after["handlers"] == before["handlers"] and after["level"] == before["level"], seen
    changed = {
        n: (lv, after["levels"].get(n)) for n, lv in before["levels"].items() if after["levels"].get(n) != lv
    }
    assert not changed, changed
    assert "nobody asked to see" not in out.stderr + out.stdout, out.stderr


@pytest.mark.slow
def test_the_example_script_runs(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "examples" / "train_with_dashboard.py"),
            "--steps",
            "30",
            "--port",
            "0",
            "--delay",
            "0",
            "--no-wait",
            "--db",
            str(tmp_path / "ex.sqlite"),
        ],
        cwd=tmp_path,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("dashboard: http://127.0.0.1:") and "training done" in out.stdout
    assert (tmp_path / "ex.sqlite").exists()
