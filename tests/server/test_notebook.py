"""The inspector in a notebook: `_repr_html_` links to its dashboard and
`insp.show()` embeds the served page in an iframe (rendered here as a notebook would: no
nbclient in this environment, so the HTML a notebook displays is checked directly)."""

from __future__ import annotations

import httpx
import pytest
import torch
from torch import nn

import inspector
from inspector.notebook import Embed


@pytest.fixture
def insp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    i = inspector.attach(model, torch.optim.SGD(model.parameters(), lr=0.05), every=1)
    yield i
    i.close()


def test_repr_html_links_to_the_served_dashboard(insp):
    before = insp._repr_html_()
    assert "not served" in before and "insp.serve()" in before and "4 parameters" in before
    url = insp.serve(port=0, db=False)
    shown = insp._repr_html_()
    assert f'href="{url}"' in shown and "not served" not in shown
    page = httpx.get(url, trust_env=False, timeout=10)
    assert page.status_code == 200 and "gradient-inspector" in page.text


def test_show_embeds_the_served_dashboard_inline(insp):
    url = insp.serve(port=0, db=False)
    embed = insp.show(height=500)
    shown = embed._repr_html_()
    assert f'<iframe src="{url}"' in shown and 'height="500"' in shown
    assert insp.show().url == url  # served once: show() reuses the server


def test_show_serves_when_not_served_and_checks_height_first(insp):
    with pytest.raises(ValueError, match="height"):
        insp.show(height=0)
    assert insp._repr_html_().count("not served") == 1  # a refused call served nothing


def test_embed_escapes_the_url():
    shown = Embed('http://127.0.0.1:1/?a=1&b="<x>"', 300)._repr_html_()
    assert "<x>" not in shown and "&amp;b=&quot;&lt;x&gt;&quot;" in shown


def test_only_the_origins_a_server_names_may_frame_it(insp, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = insp.serve(port=0, db=False)
    headers = httpx.get(url, trust_env=False, timeout=10).headers
    assert (
        headers["x-frame-options"] == "DENY"
        and headers["content-security-policy"] == "frame-ancestors 'none'"
    )
    with pytest.raises(ValueError, match="frame_ancestors: 'https://x; script-src \\*' is not an origin"):
        insp.show(frame_ancestors=["https://x; script-src *"])
    assert httpx.get(url, trust_env=False, timeout=10).headers["x-frame-options"] == "DENY", "nothing changed"
    insp.show(frame_ancestors=["https://hub.example.com"])
    for path in ("/", "/api/session", "/api/nope"):
        headers = httpx.get(url.rstrip("/") + path, trust_env=False, timeout=10).headers
        assert "x-frame-options" not in headers
        policy = headers["content-security-policy"]
        assert policy.startswith("frame-ancestors 'self' http://localhost:* http://127.0.0.1:*")
        assert policy.endswith("vscode-webview: https://hub.example.com")
