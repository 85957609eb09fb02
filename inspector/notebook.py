"""The inspector in a Jupyter or VS Code notebook: a link to its dashboard, or the dashboard inline.

A notebook displays any object with a ``_repr_html_`` method as that HTML. ``Inspector`` has
two methods that come here (through :mod:`inspector.dashboard`, which owns the server):

- ``insp`` as a cell's last expression shows `status_html`: a link to the dashboard when
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


def status_html(state: dict[str, Any], n_params: int, url: str | None) -> str:
    """One line of HTML: the inspector's state and a link to its dashboard (or how to serve it)."""
    head = (
        f"<b>gradient-inspector</b>: {n_params} parameters, "
        f"{html.escape(str(state['state']))} at step {int(state['step'])}"
    )
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
        check_height(height)
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


def frame_origins(frame_ancestors: Sequence[str] | str) -> tuple[str, ...]:
    """The origins ``show()`` lets frame the dashboard: the notebook's, and ``frame_ancestors``."""
    if isinstance(frame_ancestors, str):
        frame_ancestors = [frame_ancestors]
    return (*NOTEBOOK_FRAME_ANCESTORS, *frame_ancestors)


def check_height(height: Any) -> None:
    if not isinstance(height, int) or isinstance(height, bool) or height <= 0:
        raise ValueError(f"height must be a positive number of pixels, got {height!r}")
