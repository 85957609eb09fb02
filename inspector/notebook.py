"""The inspector in a Jupyter or VS Code notebook: a link to its dashboard, or the dashboard inline.

A notebook displays any object with a ``_repr_html_`` method as that HTML. ``Inspector`` has
two one-line methods that come here:

- ``insp`` as a cell's last expression shows `status_html(insp)`: a link to the dashboard when
  it is served (``insp.serve()``), else a line saying how to serve it;
- ``insp.show(height=720)`` serves the dashboard if it is not served yet (loopback, the
  default port) and returns an `Embed`, which a notebook displays as an ``<iframe>`` of the
  served page, as TensorBoard's notebook extension does (display it from the middle of a cell
  with ``IPython.display.display(insp.show())``).

Standard library only: nothing here imports IPython, so the inspector works without it. The
iframe loads the page from the server of this process, so the notebook's browser must reach
that address (on a remote kernel, through the same SSH tunnel as the page itself).

Framing: the dashboard refuses to be shown in another page's frame (clickjacking), except by the
origins its server names. ``show()`` names the notebook's (`NOTEBOOK_FRAME_ANCESTORS`: a page on
a loopback port, as Jupyter is locally or through a tunnel, and VS Code's notebook webviews),
plus any given as ``frame_ancestors`` (a JupyterHub on its own domain); on a server that
``insp.serve()`` started, from then on. Every other origin stays refused.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

# Where notebooks show their outputs: Jupyter on a loopback port (locally, or through an SSH
# tunnel), and VS Code's notebook webviews.
NOTEBOOK_FRAME_ANCESTORS = (
    "http://localhost:*",
    "http://127.0.0.1:*",
    "https://localhost:*",
    "https://127.0.0.1:*",
    "vscode-webview:",
)


def served_url(insp: Any) -> str | None:
    """The URL the dashboard is served at (with its ``#token=`` when one is in force), or None."""
    server = getattr(insp, "_server", None)
    return None if server is None else str(server.url)


def status_html(insp: Any) -> str:
    """One line of HTML: the inspector's state and a link to its dashboard (or how to serve it)."""
    state = insp.state
    head = (
        f"<b>gradient-inspector</b>: {len(insp.params)} parameters, "
        f"{html.escape(str(state['state']))} at step {int(state['step'])}"
    )
    url = served_url(insp)
    if url is None:
        return f"<div>{head}; not served: call <code>insp.serve()</code> or <code>insp.show()</code></div>"
    link = html.escape(url, quote=True)
    return f'<div>{head}; dashboard at <a href="{link}" target="_blank" rel="noopener">{link}</a></div>'


class Embed:
    """The served dashboard as an ``<iframe>`` (its ``_repr_html_``), ``height`` pixels tall.

    Args:
        url: the dashboard's URL, as ``insp.serve()`` returns it.
        height: the iframe's height in CSS pixels.
    """

    def __init__(self, url: str, height: int = 720) -> None:
        _check_height(height)
        self.url = url
        self.height = height

    def _repr_html_(self) -> str:
        src = html.escape(self.url, quote=True)
        return (
            f'<iframe src="{src}" width="100%" height="{self.height}" frameborder="0" '
            f'title="gradient-inspector dashboard"></iframe>'
            f'<div><a href="{src}" target="_blank" rel="noopener">open the dashboard in its own tab</a></div>'
        )

    def __repr__(self) -> str:
        return f"Embed({self.url!r}, height={self.height})"


def show(insp: Any, height: int = 720, *, frame_ancestors: Sequence[str] = ()) -> Embed | None:
    """`Embed` of the dashboard, serving it first when it is not served, and letting the
    notebook's origins (and ``frame_ancestors``) frame it; None where this rank does not serve
    (under ``torch.distributed``, ranks other than 0)."""
    _check_height(height)  # before anything is served
    if isinstance(frame_ancestors, str):
        frame_ancestors = [frame_ancestors]
    origins = (*NOTEBOOK_FRAME_ANCESTORS, *frame_ancestors)
    server = getattr(insp, "_server", None)
    if server is not None:
        server.allow_frames(origins)
        url: str | None = str(server.url)
    else:
        url = insp.serve(frame_ancestors=origins)
    return None if url is None else Embed(url, height)


def _check_height(height: Any) -> None:
    if not isinstance(height, int) or isinstance(height, bool) or height <= 0:
        raise ValueError(f"height must be a positive number of pixels, got {height!r}")
