"""An edit from another thread in a loop without a torch optimizer (``mark_step()``): its
``applied_step`` is the first step whose gradients, as the loop's own update reads them, show it.
Checked for the ways such a loop marks a step under way: the root module's forward, a submodule
called directly (no forward of ours), and a dict of tensors (its first backward)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import inspector


def _loop(variant: str, point: str, edit_after_backward_of: int, steps: int = 6) -> tuple[list[float], int]:
    """The ratio of each step's gradient, as the update reads it, to the plain one (1 or the
    hook's 0.5), and the hook's applied_step."""
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    lin = nn.Linear(4, 1, bias=False)
    if variant == "dict":
        w = nn.Parameter(torch.ones(1, 4))
        insp = inspector.attach({"w": w}, every=1)
        params = [w]

        def forward() -> torch.Tensor:
            return (x * w).sum()
    elif variant == "submodule":
        root = nn.Sequential(lin)
        insp = inspector.attach(root, every=1)
        params = list(root.parameters())

        def forward() -> torch.Tensor:
            return root[0](x).sum()  # the root itself is never called
    else:
        insp = inspector.attach(lin, every=1)
        params = list(lin.parameters())

        def forward() -> torch.Tensor:
            return lin(x).sum()

    ratios: list[float] = []
    hook: list[inspector.HookHandle] = []
    with insp:
        for step in range(1, steps + 1):
            forward().backward()
            if step == edit_after_backward_of:  # the dashboard's edit, from another thread
                t = threading.Thread(
                    target=lambda: hook.append(insp.add_hook("scale", point=point, factor=0.5))
                )
                t.start()
                t.join()
            insp.mark_step()
            with torch.no_grad():
                g = params[0].grad
                ratios.append(float((g / x).mean()))  # the plain gradient is x, every step
                for p in params:
                    p -= 0.01 * p.grad
                    p.grad = None
        applied = hook[0].spec["applied_step"]
    return ratios, applied


@pytest.mark.parametrize("point", ["pre_step", "post_accumulate"])
@pytest.mark.parametrize("variant", ["root", "submodule", "dict"])
def test_an_edit_between_backward_and_mark_step_reads_the_step_its_effect_starts(variant, point):
    ratios, applied = _loop(variant, point, edit_after_backward_of=3)
    first = next(i + 1 for i, r in enumerate(ratios) if r == pytest.approx(0.5))
    assert all(r == pytest.approx(1.0) for r in ratios[: first - 1]), ratios
    assert all(r == pytest.approx(0.5) for r in ratios[first - 1 :]), ratios
    assert applied == first, (variant, ratios, applied)
