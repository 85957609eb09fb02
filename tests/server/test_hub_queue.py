"""The hub's per-client queues, driven directly on an event loop (no sockets)."""

from __future__ import annotations

import asyncio
import json

from server.hub import TOO_FAR_BEHIND, ClientHub, ClientQueue, message_text
from server.protocol import dumps, jsonsafe


def run(coro):
    return asyncio.run(coro)


def test_one_serialization_per_message_for_every_client():
    async def main():
        hub = ClientHub()
        sent: dict[str, list[str]] = {"a": [], "b": []}
        gates = {k: asyncio.Event() for k in sent}

        def sender(key):
            async def send(text):
                sent[key].append(text)
                gates[key].set()

            return send

        clients = [hub.new_client(sender(k)) for k in sent]
        for c in clients:
            c.task = asyncio.create_task(c.run())
        hub.publish("event", {"seq": 1, "kind": "hook_applied", "time": 0.0})
        await asyncio.wait_for(asyncio.gather(*(g.wait() for g in gates.values())), 5)
        assert sent["a"][0] is sent["b"][0], "the same str object: serialized once"
        for c in clients:
            c.task.cancel()

    run(main())


def test_snapshots_and_scalars_coalesce_latest_wins_controls_never_drop():
    async def main():
        release = asyncio.Event()
        out: list[dict] = []

        async def blocked_send(text):
            await release.wait()
            out.append(json.loads(text))

        hub = ClientHub()
        client = hub.new_client(blocked_send)
        client.task = asyncio.create_task(client.run())
        hub.publish("event", {"seq": 1, "kind": "a", "time": 0})  # the sender blocks on this one
        await asyncio.sleep(0)
        for step in range(2, 50):
            hub.publish("snapshot", {"step": step})
            hub.publish("scalars", {"step": step, "loss": 1.0, "scalars": {}})
            if step % 10 == 0:
                hub.publish("hooks", {"config_version": step, "hooks": []})
        release.set()
        while not (out and out[-1].get("type") == "scalars" and out[-1]["step"] == 49):
            await asyncio.sleep(0.001)
        kinds = [m["type"] for m in out]
        assert [m["config_version"] for m in out if m["type"] == "hooks"] == [10, 20, 30, 40]
        snaps = [m["data"]["step"] for m in out if m["type"] == "snapshot"]
        assert snaps == [49], "only the newest snapshot waited"
        assert kinds.count("scalars") == 1 and client.coalesced > 90
        client.task.cancel()

    run(main())


def test_a_client_too_far_behind_is_kicked_and_others_are_not():
    async def main():
        async def never(text):
            await asyncio.Event().wait()

        got = []

        async def fast(text):
            got.append(text)

        hub = ClientHub(max_backlog=20)
        slow, ok = hub.new_client(never), hub.new_client(fast)
        for c in (slow, ok):
            c.task = asyncio.create_task(c.run())
        for seq in range(1, 40):
            hub.publish("event", {"seq": seq, "kind": "x", "time": 0})
            await asyncio.sleep(0)
        assert slow.close_code == TOO_FAR_BEHIND and slow.task.cancelled() or slow.task.done()
        assert ok.close_code is None
        while len(got) < 39:
            await asyncio.sleep(0.001)
        ok.task.cancel()

    run(main())


def test_max_rate_spaces_snapshots_and_duplicates_are_skipped():
    async def main():
        times = []

        async def send(text):
            times.append((asyncio.get_running_loop().time(), json.loads(text)))

        client = ClientQueue(send)
        client.max_rate = 20  # one per 50 ms
        client.task = asyncio.create_task(client.run())
        client.forget_before(step=3, seq=0)
        for step in range(1, 40):
            client.offer("snapshot", dumps({"type": "snapshot", "data": {"step": step}}), step=step)
            await asyncio.sleep(0.005)  # a producer at about 200 snapshots a second
        while not (times and times[-1][1]["data"]["step"] == 39):
            await asyncio.sleep(0.001)
        steps = [m["data"]["step"] for _, m in times]
        assert steps[0] >= 4, "hello already carried steps up to 3"
        assert steps == sorted(steps) and steps[-1] == 39
        gaps = [b[0] - a[0] for a, b in zip(times, times[1:], strict=False)]
        assert all(g >= 0.045 for g in gaps), gaps
        client.task.cancel()

    run(main())


def test_strict_json_and_message_shapes():
    assert (
        dumps({"a": float("nan"), "b": [float("inf"), -float("inf"), 1.5]})
        == '{"a":"nan","b":["inf","-inf",1.5]}'
    )
    assert jsonsafe((1.0, float("nan"))) == [1.0, "nan"]
    assert json.loads(message_text("snapshot", {"step": 1})) == {"type": "snapshot", "data": {"step": 1}}
    assert json.loads(message_text("hooks", {"config_version": 2, "hooks": []})) == {
        "type": "hooks",
        "config_version": 2,
        "hooks": [],
    }
    assert dumps({"odd": object()}).startswith('{"odd":"<object')


def test_close_all_kicks_every_client_going_away():
    async def main():
        async def send(text):
            pass

        hub = ClientHub()
        clients = [hub.new_client(send) for _ in range(3)]
        hub.close_all()
        assert [(c.close_code, c.close_reason) for c in clients] == [(1001, "server shutting down")] * 3
        assert TOO_FAR_BEHIND == 1013  # the close codes PROTOCOL.md documents

    run(main())
