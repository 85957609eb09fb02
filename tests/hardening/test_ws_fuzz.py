"""WebSocket fuzzing: malformed and binary frames, huge frames, deeply nested
JSON, wrong types, unknown fields, bursts, and random commands from hypothesis.

Each case: the server answers `error` (the socket stays open) or closes that one socket; it
stays up (health OK), another client keeps streaming snapshots in order, training goes on,
and a rejected command leaves `config_version` and the hooks unchanged.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed

from tests.live import Inbox
from tests.support import wait_until

from .tools import quiesce

KNOWN_TYPES = ["add_hook", "update_hook", "remove_hook", "pause", "resume", "step", "rate", "subscribe"]
FIELDS = [
    "kind",
    "target",
    "params",
    "point",
    "enabled",
    "id",
    "position",
    "steps_per_second",
    "max_rate",
    "hist",
]
KINDS = ["clip_value", "clip_norm", "scale", "l2", "freeze", "nan_guard", "noise", "module_log", "python"]
PARAM_KEYS = [
    "threshold",
    "max_norm",
    "mode",
    "norm_type",
    "factor",
    "lam",
    "action",
    "std",
    "seed",
    "grad_input",
]
NAMES = ["*", "0.*", "0.weight", "2.bias", "", "0", "nothing.*", "[", "**", "x" * 300]


def state_of(srv) -> tuple[int, list[dict[str, Any]]]:
    version = quiesce(srv.insp)
    return version, srv.insp.hooks()


def reset(srv) -> None:
    """Back to a plain demo: running, capped at 50 steps a second, no hooks."""
    srv.insp.import_hooks([])
    srv.trainer.set_rate(50.0)
    srv.insp.resume()
    quiesce(srv.insp)


def drain_reply(box, timeout: float = 20.0) -> dict[str, Any]:
    return box.next(lambda m: m["type"] in ("ack", "error"), timeout)


def closed_with(ws, timeout: float = 20.0) -> int | None:
    with pytest.raises(ConnectionClosed) as info:
        while True:
            ws.recv(timeout=timeout)
    return info.value.rcvd.code if info.value.rcvd is not None else None


def still_fine(srv, obs, steps: int = 2) -> None:
    assert srv.http().get("/api/health").json() == {"status": "ok"}
    before = len(obs.steps)
    srv.wait_step(srv.insp.step + steps)
    wait_until(lambda: len(obs.steps) > before, 20, "the observer's next snapshot")
    obs.check()


# -- fixed cases: every one gets an error, in order, and the socket stays open ------------------------


def nested(depth: int, leaf: str = "1") -> str:
    return "[" * depth + leaf + "]" * depth


ERRORS: list[tuple[str, Any]] = [
    ("", None),
    (" ", None),
    ("{", None),
    ("not json", None),
    ('{"type": "pause"', None),
    ("null", None),
    ("1", None),
    ('"pause"', None),
    ("[]", None),
    ("{}", None),
    ("\u0000", None),
    ("NaN", None),
    ("\ufeff{}", None),
    ('{"type": "pause", "type": 3}', None),
    (nested(20000), None),  # past Python's recursion limit, under 64 KiB
    ('{"a":' * 6000 + "1" + "}" * 6000, None),  # nested objects, ~40 KiB
    (
        json.dumps(
            {
                "type": "add_hook",
                "request_id": "n1",
                "kind": "clip_value",
                "params": {"threshold": json.loads(nested(900))},
            }
        ),
        "n1",
    ),
    (
        '{"type": "add_hook", "request_id": "n2", "kind": "clip_value", "params": {"threshold": '
        + nested(5000)
        + "}}",
        None,
    ),  # too deep: the request_id cannot be read
    ('{"type": "add_hook", "request_id": "n3", "kind": "clip_value", "params": {"threshold": NaN}}', "n3"),
    (
        '{"type": "add_hook", "request_id": "n4", "kind": "clip_value", "params": {"threshold": Infinity}}',
        "n4",
    ),
    ('{"type": "add_hook", "request_id": "n5", "kind": "clip_value", "params": {"threshold": 1e999}}', "n5"),
    ('{"type": "add_hook", "request_id": "n6", "kind": "noise", "params": {"std": 1, "seed": 1.5}}', "n6"),
    (
        '{"type": "add_hook", "request_id": "n7", "kind": "noise", "params": {"std": 1, "seed": '
        + "9" * 5000
        + "}}",
        None,
    ),  # past Python's int-parsing limit: unreadable
    (
        '{"type": "add_hook", "request_id": "n8", "kind": "clip_norm", "params": {"max_norm": 1, '
        '"norm_type": -0.0}}',
        "n8",
    ),
    ('{"type": "add_hook", "request_id": "n9", "kind": "clip_value", "params": {"threshold": "1"}}', "n9"),
    ('{"type": "add_hook", "request_id": "n10", "kind": "clip_value", "params": [1]}', "n10"),
    ('{"type": "add_hook", "request_id": "n11", "kind": "clip_value", "params": null}', "n11"),
    (
        '{"type": "add_hook", "request_id": "n12", "kind": "clip_value", "params": {"threshold": 1, '
        '"enabled": false}}',
        "n12",
    ),
    (
        '{"type": "add_hook", "request_id": "n13", "kind": "clip_value", "target": ["*"], '
        '"params": {"threshold": 1}}',
        "n13",
    ),
    (
        '{"type": "add_hook", "request_id": "n14", "kind": "clip_value", "target": "'
        + "*" * 257
        + '", "params": {"threshold": 1}}',
        "n14",
    ),
    ('{"type": "add_hook", "request_id": "n15", "kind": "module_log", "point": "pre_step"}', "n15"),
    ('{"type": "add_hook", "request_id": "n16", "kind": "python"}', "n16"),
    (
        '{"type": "add_hook", "request_id": "n17", "kind": "clip_value", "point": 7, "params": {"threshold": 1}}',
        "n17",
    ),
    ('{"type": "add_hook", "request_id": "n18", "kind": "' + "k" * 65 + '"}', "n18"),
    (
        '{"type": "add_hook", "request_id": "n19", "kind": "clip_value", "params": {"threshold": 1, '
        '"\\ud800": 1}}',
        "n19",
    ),  # a lone surrogate as a key
    ('{"type": 5, "request_id": "t1"}', "t1"),
    ('{"type": null, "request_id": "t2"}', "t2"),
    ('{"type": ["pause"], "request_id": "t3"}', "t3"),
    ('{"type": {"a": 1}, "request_id": "t4"}', "t4"),
    ('{"type": "PAUSE", "request_id": "t5"}', "t5"),
    ('{"type": "pause ", "request_id": "t6"}', "t6"),
    ('{"type": "pause", "request_id": "t7", "extra": 1}', "t7"),
    ('{"type": "pause", "request_id": ["a"]}', None),
    ('{"type": "pause", "request_id": {"a": 1}}', None),
    ('{"type": "pause", "request_id": 1.5}', None),
    ('{"type": "pause", "request_id": true}', None),
    ('{"type": "pause", "request_id": "' + "r" * 129 + '"}', "r" * 129),  # too long: refused, echoed as read
    ('{"type": "update_hook", "request_id": "u1", "id": 5}', "u1"),
    ('{"type": "update_hook", "request_id": "u2", "id": ""}', "u2"),
    ('{"type": "update_hook", "request_id": "u3", "id": "h1", "position": -1}', "u3"),
    ('{"type": "update_hook", "request_id": "u4", "id": "h1", "position": true}', "u4"),
    ('{"type": "update_hook", "request_id": "u5", "id": "h999999", "params": {}}', "u5"),
    ('{"type": "update_hook", "request_id": "u6", "id": "' + "h" * 65 + '"}', "u6"),
    ('{"type": "remove_hook", "request_id": "u7"}', "u7"),
    ('{"type": "remove_hook", "request_id": "u8", "id": "../h1"}', "u8"),
    ('{"type": "rate", "request_id": "r1", "steps_per_second": "fast"}', "r1"),
    ('{"type": "rate", "request_id": "r2", "steps_per_second": true}', "r2"),
    ('{"type": "rate", "request_id": "r3", "steps_per_second": 0}', "r3"),
    ('{"type": "rate", "request_id": "r4", "steps_per_second": -1}', "r4"),
    ('{"type": "rate", "request_id": "r5", "steps_per_second": NaN}', "r5"),
    ('{"type": "rate", "request_id": "r6", "steps_per_second": 1e400}', "r6"),
    ('{"type": "rate", "request_id": "r7"}', "r7"),
    ('{"type": "subscribe", "request_id": "s1", "max_rate": 0}', "s1"),
    ('{"type": "subscribe", "request_id": "s2", "max_rate": "20"}', "s2"),
    ('{"type": "subscribe", "request_id": "s3", "hist": "0.weight"}', "s3"),
    ('{"type": "subscribe", "request_id": "s4", "hist": [1]}', "s4"),
    (json.dumps({"type": "subscribe", "request_id": "s5", "hist": ["0.weight"] * 65}), "s5"),
    (json.dumps({"type": "subscribe", "request_id": "s6", "hist": ["nope"]}), "s6"),
    ('{"type": "subscribe", "request_id": "s7", "max_rate": 1e-400}', "s7"),  # underflows to 0
]


def test_malformed_commands_get_an_error_and_change_nothing(live, observer):
    srv = live(commands_per_second=10_000)
    srv.wait_step(3)
    obs = observer(srv.ws_url)
    version, hooks = state_of(srv)
    with srv.ws() as ws:
        box = Inbox(ws)
        assert box.next(lambda m: True)["type"] == "hello"
        for text, rid in ERRORS:
            assert len(text.encode()) <= 64 << 10, len(text)
            ws.send(text)
            reply = drain_reply(box)
            assert reply["type"] == "error", (text[:100], reply)
            assert reply["request_id"] == rid, (text[:100], reply)
            assert reply["status"] in (404, 422), (text[:100], reply)
            assert reply["detail"] and all(d["msg"] for d in reply["detail"]), reply
            assert isinstance(reply["detail"][0]["loc"], list)
        ws.send(json.dumps({"type": "subscribe", "request_id": "ok"}))
        assert box.reply("ok")["type"] == "ack", "the socket stays open and working"
    assert state_of(srv) == (version, hooks)
    still_fine(srv, obs)


# -- cases that close the socket: that one, not the server ---------------------------------------------

CLOSING = {
    "binary": (b"\x00\x01binary", {1008}),
    "binary-json": (b'{"type": "pause"}', {1008}),
    "64KiB+1": ("x" * ((64 << 10) + 1), {1008}),
    "multibyte-64KiB": ("\u00e9" * ((32 << 10) + 1), {1008}),  # 32K characters, 64 KiB + 2 bytes
    "nested-200KiB": (nested(100_000), {1008}),
    "900KiB": ("[" + "1," * (450 << 10) + "1]", {1008}),
    "2MiB": ("x" * (2 << 20), {1008, 1009, None}),  # None: the TCP connection dropped mid-send
    "6MiB": ("x" * (6 << 20), {1008, 1009, None}),
}


def test_frames_that_close_only_their_socket(live, observer):
    srv = live(commands_per_second=10_000)
    srv.wait_step(3)
    obs = observer(srv.ws_url)
    version, hooks = state_of(srv)
    codes = {}
    for name, (frame, allowed) in CLOSING.items():
        with srv.ws() as ws:
            ws.recv(timeout=10)  # hello
            try:
                ws.send(frame)
            except ConnectionClosed as e:  # closed while a huge frame was still being sent
                codes[name] = e.rcvd.code if e.rcvd is not None else None
            else:
                codes[name] = closed_with(ws)
        assert codes[name] in allowed, (name, codes[name])
    # invalid UTF-8 in a text frame: the websocket layer closes it (1007), the app never sees it
    with srv.ws() as ws:
        ws.recv(timeout=10)
        ws.send(b'{"type": "pause", "x": "\xff\xfe"}', text=True)
        codes["invalid-utf8"] = closed_with(ws)
    assert codes["invalid-utf8"] in (1007, 1008), codes
    print(codes)
    assert state_of(srv) == (version, hooks)
    assert srv.insp.state["state"] == "running"
    still_fine(srv, obs)


def test_bursts(live, observer):
    """Within the budget (bursts of 100) every command is answered, in order, none dropped;
    past it, that socket is closed and the others stream on."""
    srv = live(commands_per_second=50)
    srv.wait_step(3)
    obs = observer(srv.ws_url)
    with srv.ws() as ws:
        box = Inbox(ws)
        box.next(lambda m: m["type"] == "hello")
        texts = []
        for i in range(90):
            if i % 3 == 0:
                texts.append(json.dumps({"type": "subscribe", "request_id": i, "max_rate": 1000}))
            elif i % 3 == 1:
                texts.append(json.dumps({"type": "update_hook", "request_id": i, "id": "h404"}))
            else:
                texts.append("{broken" if i % 2 else json.dumps({"type": "nope", "request_id": i}))
        for t in texts:
            ws.send(t)
        replies = [drain_reply(box) for _ in texts]
        assert [r["request_id"] for r in replies] == [
            None if t == "{broken" else i for i, t in enumerate(texts)
        ]
        assert [r["type"] for r in replies] == ["ack" if i % 3 == 0 else "error" for i in range(90)]
    with srv.ws() as ws:
        ws.recv(timeout=10)
        with pytest.raises(ConnectionClosed) as info:
            for i in range(1000):
                ws.send(json.dumps({"type": "add_hook", "request_id": i, "kind": "nope"}))
            while True:
                ws.recv(timeout=10)
        assert info.value.rcvd is not None and info.value.rcvd.code == 1008
    still_fine(srv, obs)
    assert srv.insp.hooks() == []


# -- hypothesis: random commands ------------------------------------------------------------------------

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(
        NAMES
        + KINDS
        + PARAM_KEYS
        + [
            "pre_step",
            "post_accumulate",
            "module",
            "global",
            "per_tensor",
            "report",
            "zero",
            "skip",
            "h1",
            "h2",
        ]
    ),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
numbers = st.one_of(st.integers(-3, 10), st.floats(-10, 10), st.sampled_from([1e-300, 1e300, 0.0, -0.0, 0.5]))
params = st.dictionaries(
    st.sampled_from(PARAM_KEYS) | st.text(max_size=6),
    numbers | json_leaf | st.sampled_from(["global", "per_tensor", "report", "zero", "skip"]),
    max_size=4,
)
field_values = {
    "kind": st.sampled_from(KINDS) | json_leaf,
    "target": st.sampled_from(NAMES) | json_leaf,
    "params": params | json_value,
    "point": st.sampled_from(["pre_step", "post_accumulate", "module"]) | json_leaf,
    "enabled": st.booleans() | json_leaf,
    "id": st.sampled_from(["h1", "h2", "h3", "h4"]) | json_leaf,
    "position": st.integers(-1, 5) | json_leaf,
    "steps_per_second": numbers | json_leaf,
    "max_rate": numbers | json_leaf,
    "hist": st.lists(st.sampled_from(["0.weight", "2.bias", "nope"]), max_size=3) | json_value,
}
garbage = st.builds(
    lambda kind, fields, extra: {"type": kind, **fields, **extra},
    st.sampled_from(KNOWN_TYPES) | json_leaf,
    st.fixed_dictionaries({}, optional={f: field_values[f] for f in FIELDS}),
    st.dictionaries(st.text(min_size=1, max_size=6), json_value, max_size=2),
)
positive = st.floats(1e-6, 1e3)
KIND_PARAMS = {
    "clip_value": st.fixed_dictionaries({"threshold": positive}),
    "clip_norm": st.fixed_dictionaries(
        {"max_norm": positive},
        optional={
            "mode": st.sampled_from(["global", "per_tensor"]),
            "norm_type": st.sampled_from([1.0, 2.0, "inf", 0.5]),
        },
    ),
    "scale": st.fixed_dictionaries({"factor": st.floats(-2, 2)}),
    "l2": st.fixed_dictionaries({"lam": st.floats(0, 1)}),
    "freeze": st.just({}),
    "nan_guard": st.fixed_dictionaries({}, optional={"action": st.sampled_from(["report", "zero", "skip"])}),
    "noise": st.fixed_dictionaries({"std": st.floats(0, 0.1)}, optional={"seed": st.integers(0, 2**63)}),
    "module_log": st.fixed_dictionaries({}, optional={"grad_input": st.booleans()}),
}
add_hook = st.sampled_from(sorted(KIND_PARAMS)).flatmap(
    lambda kind: st.fixed_dictionaries(
        {"type": st.just("add_hook"), "kind": st.just(kind), "params": KIND_PARAMS[kind]},
        optional={
            "target": st.sampled_from(["*", "0.*", "2.weight", "nothing.*", "", "0"]),
            "point": st.sampled_from(["pre_step", "post_accumulate", "module"]),
            "enabled": st.booleans(),
        },
    )
)
EXISTING = "<existing>"  # replaced by the id of a hook that exists when the case runs
update_hook = st.fixed_dictionaries(
    {"type": st.just("update_hook"), "id": st.sampled_from([EXISTING, EXISTING, "h404"])},
    optional={
        "params": st.dictionaries(st.sampled_from(PARAM_KEYS), numbers, max_size=2),
        "enabled": st.booleans(),
        "target": st.sampled_from(["*", "2.*", "nothing.*"]),
        "position": st.integers(0, 6),
    },
)
shaped = st.one_of(
    add_hook,
    add_hook,
    update_hook,
    st.fixed_dictionaries({"type": st.just("remove_hook"), "id": st.sampled_from([EXISTING, "h404"])}),
    st.fixed_dictionaries({"type": st.sampled_from(["pause", "resume", "step"])}),
    st.fixed_dictionaries({"type": st.just("rate"), "steps_per_second": st.none() | st.floats(0.5, 500)}),
    st.fixed_dictionaries(
        {"type": st.just("subscribe")},
        optional={
            "max_rate": st.none() | st.floats(0.5, 1000),
            "hist": st.lists(st.sampled_from(["0.weight", "2.bias"]), max_size=2),
        },
    ),
)
# shaped commands with one field broken or one unknown field added
mutated = st.tuples(shaped, st.sampled_from(FIELDS + ["colour", "request_id"]), json_value).map(
    lambda t: {**t[0], t[1]: t[2]}
)
command = st.one_of(shaped, shaped, mutated, garbage)


def encode(cmd: dict[str, Any]) -> str:
    # Python's json writes NaN/Infinity literals, as a careless client would; the server must cope
    return json.dumps(cmd)


@pytest.mark.slow
def test_random_commands(live, observer):
    srv = live(commands_per_second=10_000)
    srv.wait_step(3)
    obs = observer(srv.ws_url)
    with srv.ws() as ws:
        run_random(srv, ws, Inbox(ws))
    reset(srv)
    still_fine(srv, obs, steps=3)


def run_random(srv, ws, box) -> None:
    box.next(lambda m: m["type"] == "hello")
    counter = iter(range(10**9))
    outcomes: dict[str, int] = {}

    @settings(
        max_examples=300,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(cmd=command, data=st.data())
    def case(cmd: dict[str, Any], data: st.DataObject) -> None:
        rid = next(counter)
        if cmd.get("id") == EXISTING:
            ids = [h["id"] for h in srv.insp.hooks()] or ["h404"]
            cmd["id"] = ids[data.draw(st.integers(0, 7)) % len(ids)]
        cmd = {**cmd, "request_id": rid}
        version, hooks = state_of(srv)
        ws.send(encode(cmd))
        reply = box.reply(rid, timeout=20)
        outcomes[reply["type"]] = outcomes.get(reply["type"], 0) + 1
        if reply["type"] == "error":
            assert reply["status"] in (403, 404, 409, 422), (cmd, reply)
            assert reply["detail"], reply
            assert state_of(srv) == (version, hooks), f"a rejected command changed something: {cmd}"
        else:
            assert reply["type"] == "ack"
        # undo what would stall the rest: a rate near zero, a pause, too many hooks
        if cmd.get("type") == "rate" or srv.insp.state["state"] != "running" or len(srv.insp.hooks()) > 4:
            reset(srv)
        for text in (m for m in box.pending if m["type"] == "error" and m.get("status") == 500):
            raise AssertionError(f"internal error: {text}")

    case()
    print(outcomes)
    assert outcomes.get("ack", 0) >= 5 and outcomes.get("error", 0) >= 20, outcomes
    # the fuzzing socket still works, and so does everything else
    ws.send(json.dumps({"type": "subscribe", "request_id": "last", "max_rate": None}))
    assert box.reply("last")["type"] == "ack"
    assert not any(m["type"] == "error" and m.get("status") == 500 for m in box.all)


def test_lifting_a_tiny_rate_cap_takes_effect_at_once(live):
    """`subscribe` with a tiny `max_rate` (one snapshot every ~1e300 s), then `max_rate: null`:
    snapshots flow again at once, not after the old cap's wait."""
    srv = live(rate=50.0)
    srv.wait_step(2)
    with srv.ws() as ws:
        box = Inbox(ws)
        box.next(lambda m: m["type"] == "hello")
        ws.send(json.dumps({"type": "subscribe", "request_id": "slow", "max_rate": 1e-300}))
        assert box.reply("slow")["type"] == "ack"
        ws.send(json.dumps({"type": "subscribe", "request_id": "slower", "max_rate": 5e-324}))
        assert box.reply("slower")["type"] == "ack"
        box.next(lambda m: m["type"] == "snapshot")  # at most the one that was already due
        ws.send(json.dumps({"type": "subscribe", "request_id": "fast", "max_rate": None}))
        assert box.reply("fast")["type"] == "ack"
        box.pending.clear()
        box.next(lambda m: m["type"] == "snapshot", timeout=10)
        ws.send(json.dumps({"type": "subscribe", "request_id": "capped", "max_rate": 0.01}))
        assert box.reply("capped")["type"] == "ack"  # the next one due 100 s after the last one...
        ws.send(json.dumps({"type": "subscribe", "request_id": "ten", "max_rate": 10}))  # ...now 0.1 s
        assert box.reply("ten")["type"] == "ack"
        box.pending.clear()
        box.next(lambda m: m["type"] == "snapshot", timeout=10)
    assert srv.http().get("/api/health").json() == {"status": "ok"}
