"""Load, CI form: 20 websocket clients in another process against one server.

CI runs the `mlp` scenario capped at RATE steps per second (a `tiny_gpt` step takes about a
second of CPU here, too slow for a short test to say anything); `bench/load.py` has the
full-length figure on `tiny_gpt`, uncapped. The clients (tests/hardening/swarm.py): 8 read
everything, 4 read slowly, 4 never read (not even at the TCP level), 4 reconnect in a loop.

What must hold: the step rate stays close to the rate without clients (a loose bound: the
machine has 2 shared cores), the server's memory stays bounded, every per-client queue stays
bounded, every client sees snapshot steps in order, and the readers get every `hooks` message.
"""

from __future__ import annotations

import time

import pytest

from tests.support import wait_until

from .tools import quiesce, rss_bytes

RATE = 25.0  # steps per second: the demo's cap, well under what mlp reaches here (about 100)


def sample(seconds: float, step, probe) -> float:
    """The step rate over a window of `seconds`, calling `probe()` every 0.1 s meanwhile
    (a measurement window, not a synchronisation)."""
    s0, t0 = step(), time.monotonic()
    while time.monotonic() < t0 + seconds:
        probe()
        time.sleep(0.1)
    return (step() - s0) / (time.monotonic() - t0)


@pytest.mark.slow
def test_twenty_clients_in_another_process(live, swarm):
    srv = live("mlp", rate=RATE)
    srv.wait_step(5)
    step = lambda: srv.insp.step  # noqa: E731
    rss: list[int] = []
    queues: list[tuple[int, int, int]] = []  # (clients, longest control backlog, most backlog bytes)
    coalesced = {}

    def probe() -> None:
        rss.append(rss_bytes())
        clients = srv.source_clients()
        queues.append(
            (
                len(clients),
                max((len(c.controls) for c in clients), default=0),
                max((c.backlog_bytes for c in clients), default=0),
            )
        )
        coalesced.update({c.id: c.coalesced for c in clients})

    base = sample(3.0, step, probe)
    rss_before = max(rss)
    crowd = swarm(srv.ws_url, readers=8, slow=4, stalled=4, reconnect=4)
    wait_until(lambda: len(srv.source_clients()) >= 16, what="the swarm's clients on the server")

    # a few hook changes while loaded: every reader must get every `hooks` message
    c = srv.http()
    v0 = quiesce(srv.insp)
    hook = c.post(
        "/api/hooks", json={"kind": "clip_value", "target": "*", "params": {"threshold": 5.0}}
    ).json()
    for change in ({"params": {"threshold": 4.0}}, {"enabled": False}, {"enabled": True}):
        assert c.patch(f"/api/hooks/{hook['id']}", json=change).status_code == 200
    v1 = quiesce(srv.insp)
    loaded = sample(6.0, step, probe)
    final_step = srv.insp.step
    report = crowd.finish()
    after = sample(3.0, step, probe)

    by_kind: dict[str, list[dict]] = {}
    for cl in report["clients"]:
        by_kind.setdefault(cl["kind"], []).append(cl)
    growth = max(rss) - rss_before
    print(
        f"\nsteps/s: {base:.1f} without clients, {loaded:.1f} with 20, {after:.1f} after; "
        f"RSS {rss_before / 2**20:.0f} MiB -> max {max(rss) / 2**20:.0f} MiB; "
        f"longest control backlog {max(q[1] for q in queues)}; coalesced {sum(coalesced.values())}; "
        f"reconnect cycles {[cl['cycles'] for cl in by_kind['reconnect']]}; "
        f"hello p50 {sorted(h for cl in report['clients'] for h in cl['hello_s'])[len(report['clients']) // 2]:.3f} s"
    )

    # loose: 2 shared cores, and each hello (200 snapshots) costs the server tens of ms of GIL
    assert loaded >= 0.5 * min(base, after), (base, loaded, after)
    assert growth < 64 * 2**20, f"the server grew by {growth / 2**20:.0f} MiB under load"
    assert max(q[1] for q in queues) <= 64 and max(q[2] for q in queues) <= 1 << 20, max(queues)
    for cl in report["clients"]:
        assert not cl["errors"] and not cl["violations"], cl
    for cl in by_kind["reader"] + by_kind["slow"]:
        assert not cl["close_codes"], f"a reading client was closed: {cl}"
        assert cl["snapshots"] > 0
        assert [v for v in cl["hooks_versions"] if v > v0] == list(range(v0 + 1, v1 + 1)), cl[
            "hooks_versions"
        ]
    for cl in by_kind["reader"]:
        assert cl["last_step"] >= final_step - 2 * RATE, (cl["last_step"], final_step)
    for cl in by_kind["reconnect"]:
        assert cl["cycles"] >= 2, cl
    assert c.get("/api/health").json() == {"status": "ok"}
