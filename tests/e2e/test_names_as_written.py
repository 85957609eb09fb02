"""Tensor names as written, in a real Chromium.

`0.weight` (an nn.Sequential's first layer) is drawn "0", ".", "weight" from left to right (no
`direction: rtl`, which drew "weight.0"), its full name is the tooltip, the page's search finds
it, and a name too long for its column is cut at its start, its end in view.
"""

from __future__ import annotations

from typing import Any

import pytest
from playwright.sync_api import expect

from tests import support

pytestmark = pytest.mark.e2e

# Where each character of an element's text is drawn: [{c, left, right}], and the element's box.
GLYPHS = """(el) => {
  const node = el.querySelector('.name-text') || el;
  const text = node.firstChild;
  const out = [];
  for (let k = 0; k < text.length; k++) {
    const r = document.createRange();
    r.setStart(text, k);
    r.setEnd(text, k + 1);
    const b = r.getBoundingClientRect();
    out.push({ c: text.data[k], left: b.left, right: b.right });
  }
  const box = el.getBoundingClientRect();
  const dirs = [];
  for (let e = el; e; e = e.parentElement) dirs.push(getComputedStyle(e).direction);
  return { glyphs: out, left: box.left, right: box.right, dirs, text: el.innerText,
           cut: el.hasAttribute('data-cut') };
}"""


def open_page(new_page: Any, server: support.ServerProcess) -> tuple[Any, Any]:
    page, log = new_page()
    page.set_viewport_size({"width": 1440, "height": 900})
    page.goto(server.url)
    expect(page.get_by_test_id("connection-status")).to_have_attribute("data-state", "live")
    expect(page.get_by_test_id("worst-item").first).to_be_visible(timeout=60_000)
    return page, log


def hold_worst(page: Any) -> list[str]:
    """The pointer over worst now (the list holds still); the names it shows."""
    page.get_by_test_id("worst-list").hover()
    expect(page.get_by_test_id("worst-note")).to_have_attribute("data-held", "true", timeout=30_000)
    return page.eval_on_selector_all('[data-testid="worst-item"]', "els => els.map((e) => e.dataset.param)")


def test_names_read_as_written_in_worst_now(demo: Any, new_page: Any) -> None:
    """`0.weight` (an nn.Sequential's first layer) reads "0.weight", not "weight.0"."""
    page, log = open_page(new_page, demo)
    support.wait_until(lambda: "0.weight" in hold_worst(page), 60, "0.weight in worst now")
    name = page.locator('[data-testid="worst-item"][data-param="0.weight"] .w-name')
    got = name.evaluate(GLYPHS)
    assert got["text"] == "0.weight"
    lefts = [g["left"] for g in got["glyphs"]]
    assert "".join(g["c"] for g in got["glyphs"]) == "0.weight"
    drawn = "".join(g["c"] for g in sorted(got["glyphs"], key=lambda g: g["left"]))
    assert drawn == "0.weight", f"drawn left to right as {drawn!r}"
    assert lefts[0] < lefts[-1]
    assert set(got["dirs"]) == {"ltr"}, got["dirs"]
    assert name.get_attribute("title") == "0.weight"
    assert not got["cut"]
    # The page's search finds what is read.
    assert page.evaluate("() => window.find('0.weight')")

    # Too long for its column (the list narrowed, as in a narrow window): cut at its start, the
    # end in view, the characters still in order.
    page.get_by_test_id("worst-list").evaluate("(el) => { el.style.width = '300px'; }")
    expect(name).to_have_attribute("data-cut", "")
    got = name.evaluate(GLYPHS)
    last = got["glyphs"][-1]
    assert last["right"] <= got["right"] + 0.5, "the end of the name is in view"
    assert got["glyphs"][0]["left"] < got["left"], "the start is cut"
    lefts = [g["left"] for g in got["glyphs"]]
    assert lefts == sorted(lefts)
    assert log.errors == []
