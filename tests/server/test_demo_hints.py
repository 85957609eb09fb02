"""Hints that can be followed, and a replay that asks nothing it is refused:

- the session's `capabilities` say what a server serves (a live demo: everything; a replay:
  nothing to command, no target lookup, no checkpoints), each refusal with its reason;
- "checkpoint now" (`POST /api/checkpoints`): taken at the next boundary and listed on a live
  run; 403 with the reason on a replay; 409 with the reason where the Inspector refuses them;
- every demo scenario keeps a checkpoint every few steps (bounded), so "rewind to before step
  N" finds one;
- a scenario whose hint names a step pauses itself a few steps before it, once, with a
  `hint_pause` event and the reason in the training state, until resumed; off, it trains on.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from torch import nn

import inspector
from inspector import scenarios
from server.app import create_app
from server.cli import build_parser
from server.history.storage import HistoryStore
from server.live.demo import Trainer
from server.sources import ReplaySource
from tests.support import wait_until

CAPABILITIES = ("commands", "targets", "checkpoints", "checkpoint", "shadow", "rate")


def recorded(tmp_path):
    """A tiny stored run (two steps) in a database, served by a replay."""
    path = tmp_path / "h.sqlite"
    store = HistoryStore(path)
    store.start_writer()
    run = store.new_run(
        params=[{"name": "w", "shape": [1], "numel": 1, "module": ""}], modules=[""], scenario="mlp"
    )
    for step in (1, 2):
        store.add_snapshot(
            run,
            {
                "step": step,
                "time": float(step),
                "config_version": 0,
                "loss": 0.5,
                "scalars": {},
                "events": [],
            },
        )
    assert store.flush()
    store.close()
    return ReplaySource(HistoryStore(path, read_only=True))


def test_a_replay_says_it_serves_no_command_and_refuses_a_checkpoint_with_the_reason(tmp_path):
    with TestClient(create_app(recorded(tmp_path)), base_url="http://127.0.0.1") as c:
        caps = c.get("/api/session").json()["capabilities"]
        assert set(caps) == set(CAPABILITIES)
        assert all(v["ok"] is False and "read-only" in v["why"] for v in caps.values())
        r = c.post("/api/checkpoints", json={})
        assert r.status_code == 403 and "read-only" in r.json()["detail"]


def test_a_live_demo_serves_everything_and_checkpoint_now_is_listed(live):
    srv = live("mlp", rate=50.0)
    c = srv.http()
    caps = c.get("/api/session").json()["capabilities"]
    assert {k: v["ok"] for k, v in caps.items()} == {k: True for k in CAPABILITIES}
    srv.wait_step(2)
    r = c.post("/api/checkpoints", json={"label": "now"})
    assert r.status_code == 202, r.text
    cp = r.json()["id"]
    wait_until(
        lambda: any(x["id"] == cp and x["taken"] for x in c.get("/api/checkpoints").json()["checkpoints"]),
        20,
        "the checkpoint taken and listed",
    )
    listed = next(x for x in c.get("/api/checkpoints").json()["checkpoints"] if x["id"] == cp)
    assert listed["label"] == "now" and listed["origin"] == "page"


def test_where_the_inspector_refuses_checkpoints_the_capability_and_the_post_say_why():
    model = nn.Linear(2, 1)
    insp = inspector.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), checkpoints=0)
    url = insp.serve(port=0, db=False)
    try:
        with httpx.Client(base_url=url.rstrip("/"), trust_env=False, timeout=10) as c:
            caps = c.get("/api/session").json()["capabilities"]
            assert caps["checkpoints"]["ok"] and not caps["checkpoint"]["ok"]
            assert "checkpoints=0" in caps["checkpoint"]["why"]
            assert not caps["shadow"]["ok"] and not caps["rate"]["ok"]  # no demo here
            r = c.post("/api/checkpoints", json={})
            assert r.status_code == 409 and "checkpoints=0" in r.json()["detail"]
    finally:
        insp.close()


@pytest.mark.parametrize("name", ["mlp", "exploding", "nan"])
def test_every_small_demo_keeps_a_bounded_number_of_checkpoints_every_few_steps(name):
    """As the demo attaches (server/cli.py): by step 75 the checkpoints of steps 20..70 are the
    ones kept (the newest 6; nan keeps one every 8 steps, those of steps 32..56 not taken: its
    gradients were NaN)."""
    sc = scenarios.make(name, seed=0)
    insp = inspector.attach(
        sc.model, sc.optimizer, checkpoint_every=sc.checkpoint_every, checkpoints=sc.checkpoints
    )
    try:
        for _ in range(75):
            insp.record(loss=sc.step())
        steps = [c["step"] for c in insp.checkpoints.list() if c["taken"]]
        assert len(steps) <= sc.checkpoints == 6
        assert steps and all(s % sc.checkpoint_every == 0 for s in steps)
        if name == "nan":
            assert 24 in steps and 32 not in steps, "the last finite state before the bad batch is kept"
        else:
            assert steps == [20, 30, 40, 50, 60, 70]
    finally:
        insp.close()


def hint_trainer(name, pause):
    sc = scenarios.make(name, seed=0)
    insp = inspector.attach(sc.model, sc.optimizer, every=1)
    return Trainer(sc, insp, steps_per_second=None, pause_before_hint=pause), insp


def test_a_demo_pauses_five_steps_before_the_step_its_hint_names_until_resumed():
    trainer, insp = hint_trainer("nan", 5)
    assert trainer.scenario.hint_step == 30
    trainer.start()
    try:
        wait_until(lambda: insp.state["state"] == "paused" and insp.state["held"], 60, "the hint's pause")
        assert insp.step == 25
        ev = [e for e in insp.events() if e["kind"] == "hint_pause"]
        assert len(ev) == 1 and ev[0]["step"] == 25 and ev[0]["hint_step"] == 30
        assert "step 30" in trainer.pause_reason and "resume" in trainer.pause_reason
        assert insp.step == 25, "held until resumed"
        insp.resume()
        wait_until(lambda: insp.step >= 40, 60, "training on past the hint's step")
        assert trainer.pause_reason is None and insp.state["state"] == "running"
        assert len([e for e in insp.events() if e["kind"] == "hint_pause"]) == 1, "once"
    finally:
        trainer.stop()
        insp.close()


def test_with_the_pause_off_a_demo_trains_straight_through_its_hints_step():
    trainer, insp = hint_trainer("nan", None)
    trainer.start()
    try:
        wait_until(lambda: insp.step >= 35, 60, "past the hint's step")
        assert insp.state["state"] == "running"
        assert not [e for e in insp.events() if e["kind"] == "hint_pause"]
    finally:
        trainer.stop()
        insp.close()


def test_the_cli_flag_turns_the_pause_off():
    demo = build_parser().parse_args(["demo", "--scenario", "nan"])
    assert demo.no_pause_before_hint is False
    off = build_parser().parse_args(["demo", "--scenario", "nan", "--no-pause-before-hint"])
    assert off.no_pause_before_hint is True
