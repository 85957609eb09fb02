"""A hook's ``applied_step`` is the first step its own configuration acted on: another hook removed
or added leaves it as it was; a move changes the order of the hooks moved past (inspector/hooks/registry.py)."""

from __future__ import annotations

import torch
from torch import nn

import inspector
from inspector.hooks.registry import Registry


def test_the_registry_keeps_a_hooks_applied_step_when_another_hook_is_removed_or_added():
    reg = Registry(["w", "b"], [""])
    clip, _ = reg.add("clip_value", "*", params={"threshold": 1.0})
    scale, _ = reg.add("scale", "*", params={"factor": 0.5})
    reg.apply_next(1), reg.apply_next(1)
    reg.update(scale.id, params={"factor": 0.25})
    reg.apply_next(4)  # updated after step 3: it acts from step 4
    assert {s.id: s.applied_step for s in reg.applied}[scale.id] == 4
    reg.remove(clip.id)  # the scale hook moves from position 1 to 0, its configuration unchanged
    assert [s.applied_step for s in reg.view()] == [4]  # pending: not a change of the scale hook's
    reg.apply_next(5)
    (s,) = reg.applied
    assert (s.id, s.position, s.applied_step) == (scale.id, 0, 4)
    assert [v.applied_step for v in reg.view()] == [4]
    # another hook added: the scale hook's order among the hooks it had around it is as it was
    other, _ = reg.add("l2", "*", params={"lam": 0.1})
    reg.apply_next(6)
    assert {s.id: s.applied_step for s in reg.applied} == {scale.id: 4, other.id: 6}
    # a move past it changes its order relative to the one moved: both act anew (a pending one: None)
    reg.update(other.id, position=0)
    assert {v.id: v.applied_step for v in reg.view()} == {other.id: None, scale.id: None}
    reg.apply_next(7)
    assert {s.id: s.applied_step for s in reg.applied} == {other.id: 7, scale.id: 7}


def test_removing_one_hook_leaves_the_applied_step_of_the_others_in_a_training_loop():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    insp = inspector.attach(model, opt)
    published: list[list[dict]] = []
    insp.subscribe(lambda kind, payload: published.append(payload["hooks"]) if kind == "hooks" else None)

    def step() -> None:
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
        opt.zero_grad()

    clip = insp.add_hook("clip_value", target="*", threshold=1.0)
    scale = insp.add_hook("scale", target="*", factor=0.5)
    for _ in range(3):
        step()
    scale.update(factor=0.25)  # between steps 3 and 4: it acts from step 4
    step()
    assert scale.spec["applied_step"] == 4
    clip.remove()  # between steps 4 and 5
    step()
    assert [(h["id"], h["applied_step"]) for h in insp.hooks()] == [(scale.id, 4)]
    insp.flush()
    assert [(h["id"], h["applied_step"]) for h in published[-1]] == [(scale.id, 4)]
    insp.close()
