"""The agent interface (server/agent.py): the MCP SDK's own client against a real server.

Each test starts a demo (`live`: uvicorn on a free 127.0.0.1 port) and talks to `/mcp` with
`mcp.client.streamable_http.streamable_http_client` and `ClientSession`, then checks what the
HTTP API sees: the same hooks, the same refusals, and the agent's commands in the event log.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from typing import Any

import anyio
import httpx
import pytest

from tests.support import wait_until

pytest.importorskip("mcp", reason="the agent extra: pip install gradient-inspector[agent]")

import httpx2  # noqa: E402 - the SDK's HTTP client, installed with it
from mcp.client.session import ClientSession  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402
from mcp.shared.exceptions import MCPError  # noqa: E402

TOKEN = "agent-token-0123456789"
READS = {
    "get_session",
    "latest_statistics",
    "history",
    "events",
    "list_hooks",
    "list_checkpoints",
    "list_rules",
}
WRITES = {
    "add_rule",
    "update_rule",
    "remove_rule",
    "add_hook",
    "update_hook",
    "enable_hook",
    "disable_hook",
    "remove_hook",
    "training",
    "checkpoint",
    "rewind",
}


def agent(
    base: str,
    calls: list[tuple[str, dict[str, Any]]],
    token: str | None = None,
    statuses: list[int] | None = None,
) -> dict[str, Any]:
    """Open a session on `base`/mcp, list the tools, make `calls` in order: `{"tools": names,
    "results": [CallToolResult, ...]}`; every HTTP response's status is appended to `statuses`."""

    async def seen(response: Any) -> None:
        if statuses is not None:
            statuses.append(response.status_code)

    async def go() -> dict[str, Any]:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        hooks = {"response": [seen]}
        async with (
            httpx2.AsyncClient(headers=headers, timeout=30.0, trust_env=False, event_hooks=hooks) as http,
            streamable_http_client(f"{base}/mcp", http_client=http) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            tools = (await session.list_tools()).tools
            results = [await session.call_tool(name, args) for name, args in calls]
            return {"tools": tools, "results": results}

    return anyio.run(go)


def text(result: Any) -> str:
    return " ".join(getattr(c, "text", "") for c in result.content)


def data(result: Any) -> Any:
    assert not result.is_error, text(result)
    return result.structured_content if result.structured_content is not None else json.loads(text(result))


def test_tools_listed_with_read_and_write_hints(live):
    srv = live()
    tools = {t.name: t for t in agent(srv.base, [])["tools"]}
    assert READS | WRITES <= set(tools), sorted(tools)
    for name in READS:
        assert tools[name].annotations.read_only_hint is True, name
    for name in WRITES:
        assert tools[name].annotations.read_only_hint is False, name


def test_session_and_latest_statistics_match_the_http_api(live):
    srv = live()
    srv.wait_step(3)
    # the worst-now ranking needs 8 sampled values of a tensor: wait for it (a busy machine trains slowly)
    wait_until(
        lambda: data(agent(srv.base, [("latest_statistics", {})])["results"][0])["worst"],
        120,
        "a worst-now ranking",
        interval=0.5,
    )
    out = agent(
        srv.base, [("get_session", {}), ("latest_statistics", {"tensors": True}), ("history", {"limit": 2})]
    )
    session, latest, history = (data(r) for r in out["results"])
    http = srv.http().get("/api/session").json()
    assert session["run_id"] == http["run_id"]
    assert [q["name"] for q in session["params"]] == [q["name"] for q in http["params"]]
    assert set(session["hook_kinds"]) == set(http["hook_kinds"])

    names = [q["name"] for q in http["params"]]
    assert latest["step"] >= 3 and latest["tensor_count"] == len(names)
    assert set(latest["tensors"]) == set(names)
    # the newest snapshot the HTTP API has at that step holds the same numbers
    snap = (
        srv.http().get("/api/snapshots", params={"since": latest["step"] - 1, "until": latest["step"]}).json()
    )
    (row,) = snap["snapshots"]
    assert latest["total_norm"] == row["total_norm"] and latest["total_norm_raw"] == row["total_norm_raw"]
    assert latest["loss"] in (None, row["loss"])  # a step's loss is merged in once recorded (late)
    for i, name in enumerate(snap["params"]):
        assert latest["tensors"][name]["grad_norm"] == row["grad_norm"][i]
    assert isinstance(latest["worst"], list) and latest["worst"], latest["worst"]
    group_names = http["groups"]["names"]
    assert list(latest["groups"]) == group_names
    assert len(history["snapshots"]) == 2 and history["params"] == names


def test_an_agents_hook_is_the_http_apis_and_its_event_says_agent(live):
    srv = live()
    srv.wait_step(1)
    out = agent(
        srv.base,
        [("add_hook", {"kind": "clip_norm", "target": "*", "params": {"max_norm": 0.5}})],
    )
    hook = data(out["results"][0])
    assert hook["kind"] == "clip_norm" and hook["params"]["max_norm"] == 0.5
    c = srv.http()
    listed = {h["id"]: h for h in c.get("/api/hooks").json()}
    assert listed[hook["id"]]["params"]["max_norm"] == 0.5

    def command() -> dict[str, Any] | None:
        evs = c.get("/api/events").json()["events"]
        return next((e for e in evs if e["kind"] == "command" and e.get("hook_id") == hook["id"]), None)

    ev = wait_until(command, timeout=10, what="a command event for the agent's hook")
    assert ev["who"] == "agent" and ev["what"] == "add_hook" and ev["result"] == "ok"
    assert ev["args"]["params"] == {"max_norm": 0.5}
    # the history keeps it (a replay serves it from there)
    store = srv.source.store
    stored = wait_until(
        lambda: [e for e in store.events(srv.source.run_id) if e["kind"] == "command"],
        timeout=10,
        what="the command event stored",
    )
    assert stored[0]["who"] == "agent" and stored[0]["hook_id"] == hook["id"]

    # the same hook disabled, then removed, through the agent: the HTTP API sees each change
    out = agent(srv.base, [("disable_hook", {"hook_id": hook["id"]})])
    assert data(out["results"][0])["enabled"] is False
    assert {h["id"]: h for h in c.get("/api/hooks").json()}[hook["id"]]["enabled"] is False
    out = agent(srv.base, [("remove_hook", {"hook_id": hook["id"]})])
    assert data(out["results"][0]) == {"removed": hook["id"]}
    assert hook["id"] not in {h["id"] for h in c.get("/api/hooks").json()}


def test_a_bad_hook_comes_back_with_the_validation_message_and_nothing_changes(live):
    srv = live()
    c = srv.http()
    before = c.get("/api/hooks").json()
    # the HTTP API's answer to the same body, for comparison
    http = c.post("/api/hooks", json={"kind": "clip_norm", "params": {"max_norm": -1}})
    assert http.status_code == 422
    out = agent(
        srv.base,
        [
            ("add_hook", {"kind": "clip_norm", "params": {"max_norm": -1}}),
            ("add_hook", {"kind": "no_such_kind"}),
            ("update_hook", {"hook_id": "h999", "enabled": False}),
        ],
    )
    bad_param, bad_kind, unknown = out["results"]
    assert bad_param.is_error and "422" in text(bad_param)
    assert http.json()["detail"][0]["msg"] in text(bad_param)
    assert bad_kind.is_error and "422" in text(bad_kind) and "no_such_kind" in text(bad_kind)
    assert unknown.is_error and "404" in text(unknown) and "h999" in text(unknown)
    assert c.get("/api/hooks").json() == before
    # each refused command is recorded too, with its status
    evs = [e for e in c.get("/api/events").json()["events"] if e["kind"] == "command"]
    assert [(e["what"], e["result"], e["status"]) for e in evs] == [
        ("add_hook", "error", 422),
        ("add_hook", "error", 422),
        ("update_hook", "error", 404),
    ]


def test_a_write_that_fails_past_the_command_layer_is_recorded_once_with_its_reason(live, monkeypatch):
    """A failure other than an `ApiError` (here the core's add_hook raising) is the HTTP API's 500:
    the agent reads the reason, and the event log holds one `command` event for it, as for a
    success and for a refusal."""
    srv = live()
    srv.wait_step(1)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the registry is unreadable")

    monkeypatch.setattr(srv.insp, "add_hook", broken)
    monkeypatch.setattr(srv.insp, "hooks", broken)
    out = agent(
        srv.base,
        [
            ("add_hook", {"kind": "clip_norm", "params": {"max_norm": 1.0}}),
            ("training", {"action": "pause"}),
            ("update_hook", {"hook_id": "h999", "enabled": False}),
            ("list_hooks", {}),
        ],
    )
    failed, paused, unknown, listed = out["results"]
    reason = "500: internal error: RuntimeError: the registry is unreadable"
    assert failed.is_error and reason in text(failed), text(failed)
    assert data(paused)["state"] == "paused"
    assert unknown.is_error and "404" in text(unknown)
    assert listed.is_error and reason in text(listed), text(listed)  # a read says why too
    c = srv.http()
    evs = [e for e in c.get("/api/events").json()["events"] if e["kind"] == "command"]
    assert [(e["what"], e["result"], e.get("status")) for e in evs] == [
        ("add_hook", "error", 500),
        ("training", "ok", None),
        ("update_hook", "error", 404),
    ]
    assert evs[0]["detail"] == "internal error: RuntimeError: the registry is unreadable"


def test_read_only_refuses_every_write_tool_and_still_reads(live):
    srv = live(read_only=True)
    srv.wait_step(1)
    out = agent(
        srv.base,
        [
            ("add_hook", {"kind": "clip_norm", "params": {"max_norm": 1.0}}),
            ("training", {"action": "pause"}),
            ("checkpoint", {}),
            ("get_session", {}),
        ],
    )
    *refused, session = out["results"]
    for r in refused:
        assert r.is_error and "403" in text(r) and "read-only" in text(r), text(r)
    assert data(session)["read_only"] is True
    c = srv.http()
    assert c.get("/api/hooks").json() == []
    assert c.get("/api/session").json()["training"]["state"] == "running"
    assert not [e for e in c.get("/api/events").json()["events"] if e["kind"] == "command"]
    # the read-only guard itself still refuses the HTTP API's commands
    assert c.post("/api/training/pause").status_code == 403


def test_a_token_is_required_when_one_is_in_force(live):
    srv = live(token=TOKEN)
    c = srv.http()
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    accept = {"accept": "application/json, text/event-stream"}
    assert c.post("/mcp", json=body, headers=accept).status_code == 401
    wrong = {**accept, "authorization": "Bearer wrong-token-0123"}
    assert c.post("/mcp", json=body, headers=wrong).status_code == 401
    statuses: list[int] = []
    with pytest.raises(Exception) as caught:  # the SDK's client: initialize fails on the 401
        agent(srv.base, [("add_hook", {"kind": "clip_norm"})], statuses=statuses)
    assert caught.group_contains(MCPError), repr(caught.value)
    assert statuses == [401], statuses
    assert c.get("/api/hooks", headers={"authorization": f"Bearer {TOKEN}"}).json() == []
    # with the token: the same call goes through
    out = agent(srv.base, [("add_hook", {"kind": "clip_norm", "params": {"max_norm": 1.0}})], token=TOKEN)
    assert data(out["results"][0])["kind"] == "clip_norm"


def test_a_foreign_host_or_origin_is_refused(live):
    srv = live()
    c = srv.http()
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    accept = {"accept": "application/json, text/event-stream"}
    assert c.post("/mcp", json=body, headers={**accept, "host": "evil.example"}).status_code == 403
    foreign = {**accept, "origin": "http://evil.example"}
    assert c.post("/mcp", json=body, headers=foreign).status_code == 403


def test_event_streams_are_origin_checked_and_bounded_and_health_still_answers(live):
    """`GET /mcp` opens an event stream that stays open until the client closes it: a foreign
    Origin is refused as on /ws; past the cap (4 per address by default, well under the 64
    connections an address may hold) one more is refused with the reason while /api/health
    still answers; a closed stream frees its slot."""
    srv = live()
    c = srv.http()
    sse = {"accept": "text/event-stream"}
    streams = httpx.Client(base_url=srv.base, trust_env=False, timeout=10.0)
    srv._clients.append(streams)

    def refusal(client: httpx.Client, headers: dict[str, str]) -> tuple[int, Any]:
        """A stream's status and, if refused, its detail (an open stream is closed at once)."""
        with client.stream("GET", "/mcp", headers=headers) as r:
            if r.status_code == 200:
                return 200, None
            r.read()
            return r.status_code, r.json()["detail"]

    status, detail = refusal(streams, {**sse, "origin": "http://evil.example"})
    assert status == 403, status
    # the rule and the answer of /ws and of the commands
    command = c.post("/api/training/pause", headers={"origin": "http://evil.example"})
    assert command.status_code == 403 and detail == command.json()["detail"]
    assert "Origin does not match Host" in detail

    own = {**sse, "origin": srv.base}
    with ExitStack() as held:
        for _ in range(4):
            r = held.enter_context(streams.stream("GET", "/mcp", headers=own))
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        status, detail = refusal(streams, sse)
        assert status == 429, status
        assert "at most 4" in detail and "GET /mcp" in detail
        assert c.get("/api/health").status_code == 200
        assert c.get("/api/session").status_code == 200
    # the four closed: their slots are free again (the server sees each disconnect)
    with ExitStack() as held:

        def opened() -> bool:
            r = held.enter_context(streams.stream("GET", "/mcp", headers=sse))
            return r.status_code == 200

        for _ in range(4):
            wait_until(opened, timeout=10, what="a stream's slot freed")

    # and a cap on the whole server: 503
    srv2 = live(agent_streams=2)
    c2 = srv2.http()
    with ExitStack() as held:
        for _ in range(2):
            assert held.enter_context(c2.stream("GET", "/mcp", headers=sse)).status_code == 200
        status, detail = refusal(c2, sse)
        assert status == 503 and "at most 2" in detail, (status, detail)
        assert c2.get("/api/health").status_code == 200


def test_training_and_checkpoint_tools_act(live):
    srv = live()
    srv.wait_step(2)
    out = agent(srv.base, [("training", {"action": "pause"}), ("checkpoint", {"label": "agent"})])
    state, cp = (data(r) for r in out["results"])
    assert state["state"] == "paused"
    c = srv.http()
    assert c.get("/api/session").json()["training"]["state"] == "paused"
    # the checkpoint is taken at the next boundary: one step lets it through
    agent(srv.base, [("training", {"action": "step"})])
    wait_until(
        lambda: any(
            k["id"] == cp["id"] and k["taken"] for k in c.get("/api/checkpoints").json()["checkpoints"]
        ),
        timeout=20,
        what="the agent's checkpoint taken",
    )
    out = agent(srv.base, [("rewind", {"checkpoint_id": cp["id"], "skip": [5, 2]})])
    assert out["results"][0].is_error and "422" in text(out["results"][0])


def test_rules_through_the_agent_are_the_http_apis(live):
    srv = live()
    c = srv.http()
    bad = {"signal": "loss", "op": "=>", "threshold": 1, "action": "alert"}
    http = c.post("/api/rules", json=bad)
    assert http.status_code == 422
    good = {"signal": "loss", "op": ">", "threshold": 100, "action": "alert"}
    out = agent(
        srv.base,
        [
            ("add_rule", {"rule": bad}),
            ("add_rule", {"rule": good}),
            ("update_rule", {"rule_id": "r1", "change": {"enabled": False}}),
            ("list_rules", {}),
            ("remove_rule", {"rule_id": "r9"}),
        ],
    )
    refused, added, updated, listed, unknown = out["results"]
    assert refused.is_error and "422" in text(refused) and http.json()["detail"][0]["msg"] in text(refused)
    assert data(added)["id"] == "r1" and data(updated)["enabled"] is False
    assert [r["id"] for r in data(listed)["rules"]] == ["r1"]
    assert unknown.is_error and "404" in text(unknown)
    assert [(r["id"], r["enabled"]) for r in c.get("/api/rules").json()["rules"]] == [("r1", False)]


def test_an_update_rule_command_event_keeps_the_rule_id_apart_from_the_change(live):
    """The audit records the tool's arguments as given: a change that names a field `rule_id`
    (refused, 422) does not overwrite the id of the rule the agent asked to change."""
    srv = live()
    c = srv.http()
    assert c.post(
        "/api/rules", json={"signal": "loss", "op": ">", "threshold": 100, "action": "alert"}
    ).is_success
    out = agent(srv.base, [("update_rule", {"rule_id": "r1", "change": {"rule_id": "r7"}})])
    (refused,) = out["results"]
    assert refused.is_error and "422" in text(refused)
    evs = [e for e in c.get("/api/events").json()["events"] if e["kind"] == "command"]
    assert [(e["what"], e["result"], e["args"]) for e in evs] == [
        ("update_rule", "error", {"rule_id": "r1", "change": {"rule_id": "r7"}})
    ]


def test_without_the_sdk_mcp_answers_501_with_the_install_hint(monkeypatch):
    from fastapi.testclient import TestClient

    from server import agent as agent_module
    from server.app import create_app
    from server.sources import Source

    class Empty(Source):
        def session(self, run: int | None = None) -> dict[str, Any]:
            return {}

    monkeypatch.setattr(agent_module, "available", lambda: False)
    with TestClient(create_app(Empty()), base_url="http://127.0.0.1") as c:
        r = c.post("/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
        assert r.status_code == 501
        assert "pip install gradient-inspector[agent]" in r.json()["detail"]


def test_the_rewind_tool_refuses_a_skip_past_what_can_be_drawn(live):
    """The agent's `rewind` with `skip` 10**12: a 422 naming the bound (MAX_SKIP), as the HTTP
    route's, the run as it was."""
    srv = live(rate=None)
    srv.wait_step(3)
    c = srv.http()
    cp = c.post("/api/checkpoints", json={}).json()["id"]
    wait_until(
        lambda: any(x["id"] == cp and x["taken"] for x in c.get("/api/checkpoints").json()["checkpoints"])
    )
    hooks, version = c.get("/api/hooks").json(), srv.insp.config_version
    out = agent(srv.base, [("rewind", {"checkpoint_id": cp, "skip": 10**12})])
    (refused,) = out["results"]
    assert refused.is_error and "422" in text(refused) and "MAX_SKIP" in text(refused), text(refused)
    assert srv.insp.checkpoints.rewinds == 0 and srv.insp.checkpoints.pending_rewind() is None
    assert srv.insp.data_position["pending"] is None
    assert c.get("/api/hooks").json() == hooks and srv.insp.config_version == version
    step = srv.insp.step
    srv.wait_step(step + 3)
