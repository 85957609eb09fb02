"""The shadow's label says what differs from what the main run has NOW: after the main run's
hook is disabled, then removed, the label follows each change (server/live/shadow.py)."""

from __future__ import annotations

from server.live.shadow import describe_difference


def clip(hook_id: str = "h1", enabled: bool = True, **params: float) -> dict:
    return {
        "id": hook_id,
        "kind": "clip_norm",
        "target": "*",
        "point": "pre_step",
        "params": params or {"max_norm": 1.0},
        "enabled": enabled,
    }


def test_a_shadow_from_before_an_add_follows_the_main_runs_disable_then_remove():
    shadow: list[dict] = []  # the checkpoint before "add clip_norm h1": no hooks
    assert describe_difference([clip()], shadow) == "without clip_norm h1"
    disabled = describe_difference([clip(enabled=False)], shadow)
    assert disabled == "without clip_norm h1, which the main run has disabled: the same hooks in effect"
    assert describe_difference([], shadow) == "same hooks"


def test_a_shadow_from_before_a_disable_follows_the_main_runs_remove():
    shadow = [clip()]  # the checkpoint before "update h1 enabled=false": h1 on
    assert (
        describe_difference([clip(enabled=False)], shadow)
        == "with clip_norm h1 enabled, disabled in the main run"
    )
    assert describe_difference([], shadow) == "with clip_norm h1, which the main run no longer has"
    assert describe_difference([clip(max_norm=5.0)], shadow) == (
        "clip_norm h1 as before (max_norm=1.0), changed in the main run"
    )
