"""Each card's "?" in a real Chromium at 1024x768: every card has one, its note says what the card
shows and names a page of the manual that exists (and a heading of it), the note fits the window,
and Escape closes it and gives the focus back to the button. No console errors.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect

from tests import support
from tests.packaging.test_docs import heading_anchors

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]

# every card, hidden ones included: (its help key, its button's label, its note's text)
CARDS = """() => Array.from(document.querySelectorAll("article.card")).map((card) => {
  const button = card.querySelector(".card-head .help-btn");
  const note = button && document.getElementById(button.getAttribute("aria-controls"));
  return {
    title: card.querySelector("h2").textContent.trim().split("\\n")[0],
    label: button && button.getAttribute("aria-label"),
    text: note && note.textContent,
  };
})"""


def docs_page_named(text: str) -> tuple[Path, str] | None:
    """The manual's page (and anchor) a note names, as `docs/PAGE.md#anchor`."""
    m = re.search(r"\b(docs/[\w-]+\.md)(?:#([\w-]+))?", text)
    return (ROOT / m.group(1), m.group(2) or "") if m else None


def test_every_card_has_a_help_note_naming_a_docs_page(demo: support.ServerProcess, new_page: Any) -> None:
    page, log = new_page()
    page.set_viewport_size({"width": 1024, "height": 768})
    page.goto(demo.url + "#all")
    expect(page.locator('[data-testid="help-loss"]')).to_be_visible()
    cards = page.evaluate(CARDS)
    assert len(cards) >= 18
    for card in cards:
        assert card["label"] and card["label"].startswith("About this card"), card["title"]
        assert card["text"] and len(card["text"]) > 80, card["title"]
        named = docs_page_named(card["text"])
        assert named, f"{card['title']}: the note names no docs page: {card['text']!r}"
        path, anchor = named
        assert path.is_file(), f"{card['title']}: {path.relative_to(ROOT)} does not exist"
        assert not anchor or anchor in heading_anchors(path), f"{card['title']}: no #{anchor} in {path.name}"

    # open the noise scale card's note: it shows, fits the window, and Escape closes it
    button = page.locator('[data-testid="help-noise"]')
    button.scroll_into_view_if_needed()
    button.click()
    note = page.locator('[data-testid="help-note-noise"]')
    expect(note).to_be_visible()
    expect(button).to_have_attribute("aria-expanded", "true")
    expect(note).to_contain_text("docs/instruments.md#gradient-noise-scale")
    box = note.bounding_box()
    assert box and box["x"] >= 0 and box["y"] >= 0
    assert box["x"] + box["width"] <= 1024 and box["y"] + box["height"] <= 768
    if os.environ.get("CARD_HELP_SCREENSHOT"):
        page.screenshot(path=os.environ["CARD_HELP_SCREENSHOT"])
    # one note at a time: another card's "?" closes this one
    page.locator('[data-testid="help-loss"]').click()
    expect(note).to_be_hidden()
    expect(page.locator('[data-testid="help-note-loss"]')).to_be_visible()
    page.keyboard.press("Escape")
    expect(page.locator('[data-testid="help-note-loss"]')).to_be_hidden()
    expect(page.locator('[data-testid="help-loss"]')).to_be_focused()
    expect(page.locator('[data-testid="help-loss"]')).to_have_attribute("aria-expanded", "false")
    assert log.errors == []
