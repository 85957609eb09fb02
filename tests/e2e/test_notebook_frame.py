"""The notebook's frame in a real Chromium: `insp.show()` lets a page on another loopback port
(Jupyter's, as a notebook shows its outputs) frame the dashboard, while a foreign origin still
cannot, and a server that `show()` did not touch lets nobody frame it.

The framing pages are real pages served from loopback (a page Playwright's router made up has no
address, and Chromium's local-network checks would refuse any loopback frame in it): the
notebook's on 127.0.0.1 or localhost, the foreign one on 127.0.0.2, an origin the dashboard
does not name."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import torch
from torch import nn

import inspector

pytestmark = pytest.mark.e2e


@pytest.fixture
def insp(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.chdir(tmp_path)  # show() serves with the default history file, ./gradient-inspector.sqlite
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    i = inspector.attach(model, torch.optim.SGD(model.parameters(), lr=0.05), every=1)
    yield i
    i.close()


@pytest.fixture
def host_page() -> Iterator[Callable[[str, str], str]]:
    """``host_page(host, src)``: the URL of a page served from ``host`` (port chosen free) whose
    only content is an iframe of ``src``."""
    servers: list[ThreadingHTTPServer] = []

    def make(host: str, src: str) -> str:
        body = (
            f'<!doctype html><title>notebook</title><iframe src="{src}" width="1200" height="700"></iframe>'
        ).encode()

        class Page(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer((host, 0), Page)
        servers.append(server)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return f"http://{host}:{server.server_address[1]}/notebooks/train.ipynb"

    yield make
    for server in servers:
        server.shutdown()
        server.server_close()


def framed(new_page: Any, parent: str) -> tuple[Any, Any, Any]:
    """``parent`` opened: (page, its iframe's locator, the page's log), the iframe loaded."""
    page, log = new_page()
    page.goto(parent)
    page.wait_for_load_state("load")  # the iframe's load (or its refusal) included
    return page, page.frame_locator("iframe"), log


def refused_frame(new_page: Any, parent: str) -> str:
    """Open ``parent`` and wait for Chromium to say it refused the dashboard in its iframe (the
    console message of a ``frame-ancestors`` refusal, which it logs on the framing page)."""
    page, _ = new_page()
    with page.expect_console_message(lambda m: "frame-ancestors" in m.text) as message:
        page.goto(parent)
    return str(message.value.text)


def refused(page: Any) -> bool:
    """Whether the iframe was blocked: Chromium puts its error page there instead."""
    child = page.frames[1] if len(page.frames) > 1 else None
    return child is not None and child.url.startswith("chrome-error://")


def test_a_notebook_on_another_loopback_port_frames_the_dashboard_and_a_foreign_origin_cannot(
    insp: Any, new_page: Any, host_page: Any
) -> None:
    url = insp.show(height=600).url
    page, frame, log = framed(new_page, host_page("127.0.0.1", url))
    frame.get_by_test_id("step-counter").wait_for(state="visible")
    frame.get_by_test_id("training-state").wait_for(state="visible")
    assert not refused(page)
    assert log.errors == [], log.errors
    text = refused_frame(new_page, host_page("127.0.0.2", url))  # an origin the dashboard does not name
    assert f"Framing '{url.split('#')[0]}' violates" in text and "has been blocked" in text, text


def test_a_server_show_did_not_start_refuses_every_frame(insp: Any, new_page: Any, host_page: Any) -> None:
    url = insp.serve(port=0, db=False)
    text = refused_frame(new_page, host_page("127.0.0.1", url))  # show() did not start it: nobody may
    assert "frame-ancestors 'none'" in text and "has been blocked" in text, text
    insp.show()  # from now on the notebook may frame it
    page, frame, _ = framed(new_page, host_page("localhost", url))
    frame.get_by_test_id("step-counter").wait_for(state="visible")
    assert not refused(page)
