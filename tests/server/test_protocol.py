"""The server's wire models, strict JSON, presets and rate limit against the core they must not copy."""

from __future__ import annotations

import pytest

import inspector
from inspector import scenarios
from inspector.wire.records import SPEC_FIELDS, HookSpec, jsonsafe
from server import protocol as p
from server.history.storage import HistoryStore
from server.security import TokenBucket
from server.sources import ReplaySource


def test_the_wire_hook_spec_has_exactly_the_cores_fields():
    assert tuple(p.HookSpec.model_fields) == SPEC_FIELDS
    spec = HookSpec("h1", "clip_value", "pre_step", "*", {"threshold": 1.0}).to_dict()
    assert p.HookSpec.model_validate(spec).model_dump() == spec


@pytest.mark.parametrize(
    ("command", "body"),
    [
        (p.AddHookCmd, p.HookCreate),
        (p.UpdateHookCmd, p.HookPatch),
        (p.RateCmd, p.RateBody),
    ],
)
def test_a_websocket_command_carries_its_http_routes_body_model(command, body):
    assert issubclass(command, body)
    own = set(command.model_fields) - set(body.model_fields)
    assert own <= {"type", "request_id", "id"}
    for name, field in body.model_fields.items():
        assert repr(command.model_fields[name]) == repr(field), name  # the same type, default and checks


def test_strict_json_writes_non_finite_floats_by_the_cores_rule():
    value = {"a": [1.0, float("nan"), (float("inf"), -float("inf"))], 2: None}
    assert p.jsonsafe(value) == jsonsafe(value) == {"a": [1.0, "nan", ["inf", "-inf"]], "2": None}
    assert p.dumps(value) == '{"a":[1.0,"nan",["inf","-inf"]],"2":null}'


def test_token_bucket_allows_a_burst_then_refuses():
    bucket = TokenBucket(rate=1e-9, burst=3)  # refills about once in 30 years: no time dependence
    assert [bucket.take() for _ in range(5)] == [True, True, True, False, False]
    bucket = TokenBucket(rate=1e9, burst=2)  # refills at once
    assert all(bucket.take() for _ in range(100))


def test_a_replay_exports_the_preset_the_live_inspector_exported(tmp_path):
    sc = scenarios.make("mlp")
    with inspector.attach(sc.model, sc.optimizer) as insp:
        insp.add_hook("clip_norm", target="0.*", max_norm=1.0, norm_type=float("inf"), enabled=False)
        insp.add_hook("scale", target="2.weight", factor=-0.5)
        insp.add_hook(lambda name, param: None, target="*")  # python: left out of both
        live = insp.export_hooks()
        store = HistoryStore(tmp_path / "h.sqlite")
        run = store.new_run(params=insp.param_info(), modules=list(insp.modules), scenario="mlp")
        store.start_writer()
        store.add_hooks(run, 3, insp.hooks())
        store.close()
    replay = ReplaySource(HistoryStore(tmp_path / "h.sqlite", read_only=True))
    try:
        assert replay.export_hooks() == live
        assert [h["kind"] for h in live["hooks"]] == ["clip_norm", "scale"]
    finally:
        replay.stop()
