"""API fuzzing with schemathesis against a real server's OpenAPI document.

Every operation in `/openapi.json`, with schema-conforming (positive) and schema-violating
(negative) requests, bounded per operation (MAX_EXAMPLES each way). For every case:

- no 5xx (schemathesis' `not_a_server_error`), and the body is strict JSON when it is JSON;
- a rejected request (4xx) leaves `config_version` and the hook list unchanged (compared with
  every accepted change applied, before and after the case);
- the server stays up and training goes on (checked at the end, and by an observer socket).

Not checked here: schemathesis' schema-conformance checks (its 422 model expects pydantic's
`type` field, which the server strips on purpose; the core rejects schema-valid but meaningless
hooks). `GI_FUZZ_RANDOM=1` fuzzes with fresh random seeds instead of CI's fixed ones.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from .tools import quiesce

MAX_EXAMPLES = 15


def strict_json(text: str) -> None:
    def refuse(literal: str) -> None:
        raise AssertionError(f"non-strict JSON literal {literal} in a response")

    json.loads(text, parse_constant=refuse)


VALID_HOOKS = [
    {"kind": "clip_value", "target": "*", "params": {"threshold": 1.0}},
    {"kind": "clip_norm", "target": "0.*", "params": {"max_norm": 0.5, "mode": "per_tensor"}},
    {"kind": "nan_guard", "target": "*", "params": {"action": "zero"}},
    {"kind": "module_log", "target": "*", "point": "module", "params": {"grad_input": True}},
    {
        "kind": "l2",
        "target": "2.weight",
        "point": "post_accumulate",
        "params": {"lam": 0.01},
        "enabled": False,
    },
]


# Values that once answered 500: integers past the float (and SQLite) range,
# and NUL bytes. schemathesis draws neither on its own, so they are mixed into the cases.
EDGES = st.sampled_from([10**400, -(10**400), 2**63, 2**64, "\x00", "a\x00b", "*\x00"])
NUMERIC_PARAMS = st.sampled_from(["threshold", "max_norm", "factor", "std", "seed", "lam", "position"])
# the integer query parameters of the reads
QUERY_INTS = {
    "GET /api/session": ["run"],
    "GET /api/snapshots": ["since", "limit", "run"],
    "GET /api/events": ["since", "run"],
}


def edge_hook(hook: dict, key: str, value: object) -> dict:
    if key == "position":  # not a parameter: the target gets the value instead
        return {**hook, "target": value if isinstance(value, str) else hook["target"]}
    return {**hook, "params": {**hook["params"], key: value}}


EDGE_HOOKS = st.builds(edge_hook, st.sampled_from(VALID_HOOKS), NUMERIC_PARAMS, EDGES)


def strategy(srv, op, mode):
    """schemathesis' cases, plus (positive mode) some that pass the core's validation too:
    valid hook bodies, and the ids of hooks that exist, so the fuzzing reaches past 404/422;
    and cases carrying `EDGES` (big integers, NUL bytes) in parameters and query values."""
    base = op.as_strategy(generation_mode=mode)
    if mode is not GenerationMode.POSITIVE:
        return base
    if op.label == "POST /api/hooks":
        return st.one_of(
            base,
            st.sampled_from(VALID_HOOKS).flatmap(lambda b: op.as_strategy(body=b)),
            EDGE_HOOKS.flatmap(lambda b: op.as_strategy(body=b)),
        )
    if op.label == "POST /api/hooks/import":
        return st.one_of(
            base,
            st.lists(st.one_of(st.sampled_from(VALID_HOOKS), EDGE_HOOKS), max_size=3).flatmap(
                lambda hooks: op.as_strategy(
                    body={"format": "gradient-inspector/hooks", "version": 1, "hooks": hooks}
                )
            ),
        )
    if op.label == "POST /api/training/rate":
        return st.one_of(base, EDGES.flatmap(lambda v: op.as_strategy(body={"steps_per_second": v})))
    if op.label in QUERY_INTS:
        names = st.sampled_from(QUERY_INTS[op.label])
        return st.one_of(base, st.tuples(names, EDGES).flatmap(lambda q: op.as_strategy(query=dict([q]))))
    if "{hook_id}" in op.label:
        ids = [h["id"] for h in srv.insp.import_hooks(VALID_HOOKS[:3])]
        quiesce(srv.insp)
        strategies = [
            base,
            st.sampled_from(ids).flatmap(lambda i: op.as_strategy(path_parameters={"hook_id": i})),
        ]
        if op.label.startswith("PATCH"):
            strategies.append(
                st.tuples(st.sampled_from(ids), NUMERIC_PARAMS, EDGES).flatmap(
                    lambda t: op.as_strategy(
                        path_parameters={"hook_id": t[0]},
                        body={"position": t[2]} if t[1] == "position" else {"params": {t[1]: t[2]}},
                    )
                )
            )
        return st.one_of(*strategies)
    return base


def fuzzer(srv, session, op, mode, seen, restore):
    """A hypothesis test over one operation's cases (see the module docstring)."""

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=not os.environ.get("GI_FUZZ_RANDOM"),
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy(srv, op, mode))
    def run(case) -> None:
        before = (quiesce(srv.insp), srv.insp.hooks())
        response = case.call(base_url=srv.base, session=session, timeout=20)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        case.validate_response(response, checks=[not_a_server_error])
        assert response.status_code < 500, (case.as_curl_command(), response.text[:300])
        if "json" in response.headers.get("content-type", "") and response.text:
            strict_json(response.text)
        if response.status_code >= 400:
            after = (quiesce(srv.insp), srv.insp.hooks())
            assert after == before, f"rejected ({response.status_code}) yet changed: {case.as_curl_command()}"
        restore()

    return run


@pytest.mark.slow
# schemathesis' negative-mode strategies draw from `random` themselves (its issue, not ours)
@pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies")
def test_every_route_no_5xx_and_rejections_change_nothing(live, observer):
    srv = live("mlp", rate=50.0, commands_per_second=100_000)
    srv.wait_step(3)
    obs = observer(srv.ws_url)
    schema = schemathesis.openapi.from_url(f"{srv.base}/openapi.json", timeout=10)
    session = requests.Session()
    session.trust_env = False  # 127.0.0.1 only, never through a proxy
    ops = [r.ok() for r in schema.get_all_operations()]
    labels = {op.label for op in ops}
    assert {
        "GET /api/session",
        "POST /api/hooks",
        "PATCH /api/hooks/{hook_id}",
        "DELETE /api/hooks/{hook_id}",
        "POST /api/hooks/import",
        "POST /api/training/{action}",
        "POST /api/training/rate",
        "GET /api/snapshots",
        "GET /api/events",
        "GET /api/targets",
    } <= labels, labels
    stats: dict[str, dict[int, int]] = {}
    t0 = time.monotonic()

    def restore() -> None:
        """Undo what would stall the next cases: a pause, a tiny rate, many hooks."""
        if srv.insp.state["state"] != "running":
            srv.insp.resume()
        if srv.trainer.rate != 50.0:
            srv.trainer.set_rate(50.0)
        if len(srv.insp.hooks()) > 6:
            srv.insp.import_hooks([])

    for op in ops:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            seen = stats.setdefault(f"{op.label} {mode.value}", {})

            run = fuzzer(srv, session, op, mode, seen, restore)
            try:
                run()
            except Unsatisfiable:  # nothing to violate (no parameters): positive covered it
                assert mode is GenerationMode.NEGATIVE
    elapsed = time.monotonic() - t0
    print(f"\n{sum(sum(s.values()) for s in stats.values())} requests in {elapsed:.1f} s")
    for label, seen in stats.items():
        print(f"  {label}: {dict(sorted(seen.items()))}")
    # the fuzzing reached past validation on the routes that change things
    for label in (
        "POST /api/hooks",
        "POST /api/hooks/import",
        "PATCH /api/hooks/{hook_id}",
        "DELETE /api/hooks/{hook_id}",
        "POST /api/training/{action}",
        "GET /api/snapshots",
    ):
        assert any(code < 300 for code in stats[f"{label} positive"]), (label, stats[f"{label} positive"])
        negative = stats[f"{label} negative"]  # (a string path parameter cannot be made schema-invalid)
        assert not negative or any(400 <= code < 500 for code in negative), (label, negative)
    srv.insp.import_hooks([])
    restore()
    assert srv.http().get("/api/health").json() == {"status": "ok"}
    step = srv.insp.step
    srv.wait_step(step + 3)
    obs.check()
    assert obs.steps and obs.steps[-1] > step - 200


@settings(max_examples=60, deadline=None, database=None, derandomize=not os.environ.get("GI_FUZZ_RANDOM"))
@given(
    prefix=st.sampled_from(["/static/", "/docs-assets/", "/vendor/"]),
    name=st.lists(st.sampled_from(["a", ".", "/", "%00", "%2e", "\x00", "app.js", "é"]), max_size=8).map(
        "".join
    ),
)
def test_page_paths_with_nul_bytes_never_answer_5xx(page_server, prefix, name):
    """The page's routes are not in the OpenAPI document: their paths are fuzzed here, NUL
    bytes (raw and percent-encoded) among them."""
    r = page_server.get(prefix + name.replace("\x00", "%00"))
    assert r.status_code < 500, (prefix + name, r.status_code, r.text[:300])


@pytest.fixture(scope="module")
def page_server(tmp_path_factory):
    from tests.live import Live

    srv = Live(
        tmp_path_factory.mktemp("pages"),
        "mlp",
        rate=None,
        db=False,
        read_only=False,
        host="127.0.0.1",
        token=None,
        every=1,
    )
    yield srv.http()
    srv.stop()
