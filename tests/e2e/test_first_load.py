"""The page's first load, in order: the websocket (the hello: session and history) is asked for
before plotly.js runs, and the page's other requests (run picker, flight recorder, what-if, rules)
go only once the loss chart is drawn with the hello's history; live and in a replay.

What is checked is the order of things on the page's own clock, never a duration.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests import support

pytestmark = pytest.mark.e2e

# Before any page script: when window.Plotly is set (plotly.js has run), every websocket made, and
# per chart (its data-testid) when a Plotly call first returned with a trace holding a point.
SPY = """
(() => {
  const spy = (window.__spy = { ws: [], plotly: null, drawn: {} });
  let plotly;
  const wrap = (P) => {
    for (const fn of ["newPlot", "react"]) {
      const orig = P[fn];
      if (typeof orig !== "function") continue;
      P[fn] = function (gd, data, ...rest) {
        const out = orig.call(this, gd, data, ...rest);
        const points = (data || []).some((t) => (t.x && t.x.length > 0) || (t.z && t.z.length > 0));
        const el = typeof gd === "string" ? document.getElementById(gd) : gd;
        const chart = el && el.dataset ? el.dataset.testid || "" : "";
        if (points && !(chart in spy.drawn)) spy.drawn[chart] = performance.now();
        return out;
      };
    }
  };
  Object.defineProperty(window, "Plotly", {
    configurable: true,
    get: () => plotly,
    set: (v) => {
      if (spy.plotly === null) spy.plotly = performance.now();
      plotly = v;
      if (v) wrap(v);
    },
  });
  const WS = window.WebSocket;
  window.WebSocket = function (url, protocols) {
    spy.ws.push({ url: String(url), at: performance.now() });
    return protocols === undefined ? new WS(url) : new WS(url, protocols);
  };
  window.WebSocket.prototype = WS.prototype;
  Object.assign(window.WebSocket, { CONNECTING: 0, OPEN: 1, CLOSING: 2, CLOSED: 3 });
})();
"""

READ = """(paths) => {
  const requests = performance.getEntriesByType("resource")
    .filter((r) => r.initiatorType === "fetch")
    .map((r) => ({ path: new URL(r.name).pathname, start: r.startTime }));
  return { ...window.__spy, requests };
}"""

# the requests a page makes at start-up besides the hello that wait for the first chart (what-if's
# /api/shadow and /api/checkpoints do not: the shadow is drawn on the loss chart, and its messages
# can start before the first draw)
LATER = ("/api/runs", "/api/rules", "/api/flight", "/api/spikes")


def open_and_check(page: Any, url: str) -> dict[str, Any]:
    page.add_init_script(SPY)
    page.goto(url)
    page.wait_for_function("() => window.__spy && 'chart-loss' in window.__spy.drawn", timeout=120_000)
    # the start-up requests made (the run picker's is made by every page)
    page.wait_for_function(
        "() => performance.getEntriesByType('resource').some((r) => r.name.includes('/api/runs'))",
        timeout=120_000,
    )
    got = page.evaluate(READ)
    assert got["ws"], "no websocket was opened"
    assert got["plotly"] is not None
    # the hello was asked for before plotly.js ran: the server builds it while the page loads
    assert got["ws"][0]["at"] < got["plotly"], got
    assert [w["url"] for w in got["ws"]] == [got["ws"][0]["url"]], "one websocket, taken over by the page"
    # the loss chart is drawn with the hello's history before any other start-up request went out
    loss = got["drawn"]["chart-loss"]
    later = [r for r in got["requests"] if r["path"] in LATER]
    assert later, got["requests"]
    assert all(loss <= r["start"] for r in later), (loss, later)
    return got


def test_live_page_asks_for_the_hello_first_and_draws_the_loss_before_other_requests(
    new_page: Any, tmp_path: Path
) -> None:
    with support.start_demo(
        tmp_path, scenario="mlp", rate=20, db=tmp_path / "h.sqlite", timeout=300
    ) as server:
        support.wait_until(
            lambda: (server.get("/api/session")["training"].get("step") or 0) >= 30, timeout=300
        )
        page, log = new_page()
        open_and_check(page, server.url)
        assert log.errors == []


def test_replay_page_asks_for_the_hello_first_and_draws_the_loss_before_other_requests(
    new_page: Any, tmp_path: Path
) -> None:
    db = tmp_path / "h.sqlite"
    with support.start_demo(
        tmp_path, scenario="mlp", rate=0, db=db, extra=["--no-shadow"], timeout=300
    ) as server:
        support.wait_until(
            lambda: (server.get("/api/session")["training"].get("step") or 0) >= 200, timeout=300
        )
    with support.start_cli(["replay", str(db)], log_dir=tmp_path, timeout=300) as replay:
        page, log = new_page()
        open_and_check(page, replay.url)
        assert not [e for e in log.errors if e.startswith("pageerror")], log.errors
