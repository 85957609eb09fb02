"""Rules (inspector/rules.py): "when SIGNAL OP THRESHOLD [for K steps] then ACTION", evaluated at the
step boundary from host values; their actions, debouncing, failures, validation and presets."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

import inspector
from inspector.rules import PRESETS, Rules, quantile
from inspector.scenarios import make

from .conftest import batch, loss_of, seed_mlp, train_step


class Fake:
    """The Inspector methods the actions call, recording what they were asked."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.cps: list[dict] = []
        self.now = 0
        self.events: list[dict] = []

    def api(self) -> dict:
        def add_hook(kind, **kw):
            self.calls.append(("add_hook", kind, kw))
            return SimpleNamespace(id=f"h{len(self.calls)}")

        return {
            "add_hook": add_hook,
            "update_hook": lambda hid, **kw: self.calls.append(("update_hook", hid, kw)) or {"id": hid},
            "pause": lambda: self.calls.append(("pause",)) or {"paused": True},
            "checkpoint": lambda label: "c9",
            "rewind": lambda cp, skip: (
                self.calls.append(("rewind", cp, skip)) or {"checkpoint": cp, "done": True}
            ),
            "checkpoints": lambda: self.cps,
            "step": lambda: self.now,
            "params": ["a", "b"],
            "group_names": lambda: ["g"],
        }

    def emit(self, kind, **fields):
        self.events.append({"kind": kind, **fields})

    def kinds(self, kind):
        return [e for e in self.events if e["kind"] == kind]


def snap(loss=1.0, total=1.0, raw=1.0, norms=(1.0, 2.0)):
    return SimpleNamespace(
        loss=loss,
        total_norm=total,
        total_norm_raw=raw,
        grad_norm=list(norms),
        grad_norm_raw=list(norms),
        update_ratio=[0.1, 0.3],
        noise_scale=None,
        groups={"norm": [5.0], "norm_raw": [6.0]},
    )


def drive(rules: Rules, fake: Fake, values: list, signal_field="loss", start=1) -> list[int]:
    """Feed one snapshot per step with ``signal_field`` set from ``values`` (None: unsampled); a
    recorded loss as the step's value arriving before its boundary."""
    for k, v in enumerate(values):
        fake.now = start + k
        if signal_field == "loss":
            if v is not None:
                rules.arrived(start + k, {"loss": v})
            rules.boundary(start + k, snap(loss=None), [])
            continue
        rules.boundary(start + k, None if v is None else snap(**{signal_field: v}), [])
    return [e["at"] for e in fake.kinds("rule_fired")]


@pytest.mark.parametrize(
    ("op", "threshold", "fires_on"),
    [
        (">", 2.0, [3.0, math.inf]),
        (">=", 2.0, [2.0, 3.0, math.inf]),
        ("<", 2.0, [1.0]),
        ("<=", 2.0, [1.0, 2.0]),
        ("==", 2.0, [2.0]),
        ("!=", 2.0, [1.0, 3.0, math.nan, math.inf]),
        ("is_nonfinite", None, [math.nan, math.inf]),
    ],
)
def test_each_op_fires_exactly_where_the_condition_holds(op, threshold, fires_on):
    values = [1.0, 2.0, 3.0, math.nan, math.inf]
    fake = Fake()
    r = Rules(fake.api(), fake.emit)
    r.add({"signal": "loss", "op": op, "threshold": threshold, "action": "alert", "cooldown": 0})
    fired = drive(r, fake, values)
    expected = [
        k + 1
        for k, v in enumerate(values)
        if any(v == f or (math.isnan(v) and math.isnan(f)) for f in fires_on)
    ]
    assert fired == expected
    assert [e["value"] for e in fake.kinds("rule_fired")] == pytest.approx(
        [values[s - 1] for s in expected], nan_ok=True
    )


def test_for_k_steps_counts_consecutive_evaluated_steps_and_unsampled_ones_leave_the_streak():
    fake = Fake()
    r = Rules(fake.api(), fake.emit)
    r.add({"signal": "loss", "op": ">", "threshold": 1, "for_steps": 3, "action": "alert", "cooldown": 0})
    # steps:      1    2    3     4     5    6    7    8    9    10
    values = [2.0, 2.0, 0.5, 2.0, None, 2.0, 2.0, 2.0, 2.0, 2.0]
    # a streak broken at 3; 4, (5 unsampled: not counted, not broken), 6, 7 -> fires at 7; then a
    # fresh streak: 8, 9, 10 -> 10
    assert drive(r, fake, values) == [7, 10]


def test_cooldown_and_the_flood_cap_per_window():
    fake = Fake()
    r = Rules(fake.api(), fake.emit)
    r.add({"signal": "step", "op": ">", "threshold": 0, "action": "alert", "cooldown": 2})
    assert drive(r, fake, [1.0] * 10) == [1, 4, 7, 10]  # waits 2 steps after each firing
    fake = Fake()
    r = Rules(fake.api(), fake.emit)
    r.add(
        {
            "signal": "step",
            "op": ">",
            "threshold": 0,
            "action": "alert",
            "cooldown": 0,
            "cap": 3,
            "window": 10,
        }
    )
    fired = drive(r, fake, [1.0] * 25)
    assert fired == [1, 2, 3, 11, 12, 13, 21, 22, 23]
    assert len(fake.kinds("rule_capped")) == 3  # one per window, however many it held back
    assert r.list()[0]["state"]["fired"] == 9


def test_a_failing_action_records_why_and_disables_the_rule_after_n_failures():
    fake = Fake()
    r = Rules(fake.api(), fake.emit)
    r.add(
        {
            "signal": "step",
            "op": ">",
            "threshold": 0,
            "action": "rewind_skip",
            "cooldown": 0,
            "max_failures": 3,
        }
    )
    drive(r, fake, [1.0] * 6)
    failed = fake.kinds("rule_failed")
    assert [e["at"] for e in failed] == [1, 2, 3]
    assert "no checkpoint taken" in failed[0]["reason"]
    assert [e["disabled"] for e in failed] == [False, False, True]
    assert not r.list()[0]["enabled"] and not fake.kinds("rule_fired")
    # enabling it again clears its failures
    r.update("r1", {"enabled": True})
    assert r.list()[0]["state"]["failures"] == 0


def test_rewind_skip_picks_the_newest_checkpoint_at_least_m_steps_back_else_the_fallback_pauses():
    fake = Fake()
    fake.cps = [
        {"id": "c1", "step": 10, "taken": True},
        {"id": "c2", "step": 18, "taken": True},
        {"id": "c3", "step": None, "taken": False},
    ]
    r = Rules(fake.api(), fake.emit)
    r.add({"signal": "step", "op": "==", "threshold": 20, "action": "rewind_skip", "args": {"min_steps": 5}})
    r.add(
        {
            "signal": "step",
            "op": "==",
            "threshold": 21,
            "action": "rewind_skip",
            "args": {"min_steps": 50, "fallback": "pause"},
        }
    )
    drive(r, fake, [1.0] * 21)
    assert ("rewind", "c1", "since_checkpoint") in fake.calls  # c2 is only 2 steps back
    assert ("pause",) in fake.calls
    fired = {e["rule"]: e["result"] for e in fake.kinds("rule_fired")}
    assert fired["r2"]["paused"] and not fired["r2"]["rewound"]


def test_clip_norm_uses_the_quantile_of_the_recent_sampled_global_raw_norms():
    fake = Fake()
    r = Rules(fake.api(), fake.emit)
    r.add(
        {
            "signal": "step",
            "op": ">=",
            "threshold": 30,
            "action": "clip_norm",
            "args": {"quantile": 0.99},
            "cooldown": 5,
        }
    )
    norms = [float(k % 17) + 0.5 for k in range(1, 31)]
    for k, n in enumerate(norms, start=1):
        r.boundary(k, snap(raw=n), [])
    (call,) = [c for c in fake.calls if c[0] == "add_hook"]
    want = float(torch.quantile(torch.tensor(norms, dtype=torch.float64), 0.99))
    assert call[1] == "clip_norm" and call[2]["params"]["max_norm"] == pytest.approx(want)
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    # firing again updates the hook it added instead of stacking another
    for k in range(31, 38):
        r.boundary(k, snap(raw=1.0), [])
    assert [c[0] for c in fake.calls] == ["add_hook", "update_hook"]


def test_event_signals_nonfinite_and_spikes():
    fake = Fake()
    r = Rules(fake.api(), fake.emit)
    r.add({"signal": "nonfinite", "op": ">=", "threshold": 2, "action": "alert", "cooldown": 0})
    r.add({"signal": "spike:grad_norm", "op": ">", "threshold": 6, "action": "alert", "cooldown": 0})
    r.add({"signal": "spike:blocks", "op": ">", "threshold": 6, "action": "alert", "cooldown": 0})
    nf = {"kind": "nonfinite", "param": "a", "n_params": 2}
    sp = {"kind": "spike", "signal": "grad_norm", "group": None, "z": 9.5}
    gsp = {"kind": "spike", "signal": "group", "group": "blocks", "z": 7.0}
    r.boundary(1, None, [nf])
    r.boundary(2, None, [sp, {"kind": "spike", "signal": "loss", "z": 50.0}])
    r.boundary(3, None, [gsp, {**nf, "n_params": 1}])
    assert [(e["rule"], e["at"], e["value"]) for e in fake.kinds("rule_fired")] == [
        ("r1", 1, 2.0),
        ("r2", 2, 9.5),
        ("r3", 3, 7.0),
    ]


def _deep(depth: int) -> dict:
    root: dict = {}
    node = root
    for _ in range(depth):
        node["x"] = {}
        node = node["x"]
    return root


@pytest.mark.parametrize(
    ("spec", "loc"),
    [
        ({"signal": "los", "op": ">", "threshold": 1, "action": "alert"}, ["signal"]),
        ({"signal": "loss", "op": "=>", "threshold": 1, "action": "alert"}, ["op"]),
        ({"signal": "loss", "op": ">", "threshold": "1", "action": "alert"}, ["threshold"]),
        ({"signal": "loss", "op": ">", "threshold": math.nan, "action": "alert"}, ["threshold"]),
        ({"signal": "loss", "op": ">", "threshold": 1, "action": "explode"}, ["action"]),
        ({"signal": "loss", "op": ">", "threshold": 1, "action": "alert", "for_steps": 0}, ["for_steps"]),
        ({"signal": "loss", "op": ">", "threshold": 1, "action": "alert", "cooldown": -1}, ["cooldown"]),
        ({"signal": "loss", "op": ">", "threshold": 1, "action": "alert", "when": 1}, ["when"]),
        (
            {"signal": "loss", "op": ">", "threshold": 1, "action": "add_hook", "args": {"kind": "clip"}},
            ["args", "kind"],
        ),
        (
            {
                "signal": "loss",
                "op": ">",
                "threshold": 1,
                "action": "add_hook",
                "args": {"kind": "clip_norm", "params": {"max_norm": -1}},
            },
            ["args", "params", "max_norm"],
        ),
        (
            {"signal": "loss", "op": ">", "threshold": 1, "action": "disable_hook", "args": {}},
            ["args", "hook_id"],
        ),
        (
            {"signal": "loss", "op": ">", "threshold": 1, "action": "clip_norm", "args": {"quantile": 2}},
            ["args", "quantile"],
        ),
        ({"signal": "loss", "op": ">", "threshold": 10**400, "action": "alert"}, ["threshold"]),
        ({"signal": "loss", "op": ">", "threshold": -(10**400), "action": "alert"}, ["threshold"]),
        ({"signal": "loss", "op": ">", "threshold": 10**5000, "action": "alert"}, ["threshold"]),
        ({"signal": "step", "op": ">", "threshold": 1, "action": "alert", "args": _deep(900)}, ["args", "x"]),
        (
            {"signal": "step", "op": ">", "threshold": 1, "action": "alert", "args": {"a": math.nan}},
            ["args", "a"],
        ),
        (
            {"signal": "step", "op": ">", "threshold": 1, "action": "pause", "args": {"a": [0, 10**400]}},
            ["args", "a", 1],
        ),
        ({"signal": "step", "op": ">", "threshold": 1, "action": "alert", "args": {1: 2}}, ["args"]),
        (
            {"signal": "step", "op": ">", "threshold": 1, "action": "alert", "args": {"a": object()}},
            ["args", "a"],
        ),
        (
            {"signal": "step", "op": ">", "threshold": 1, "action": "alert", "args": {"a": [0] * 5000}},
            ["args"],
        ),
    ],
)
def test_a_bad_rule_is_refused_naming_the_field_and_nothing_changes(spec, loc):
    insp = inspector.attach(seed_mlp(), torch.optim.SGD(seed_mlp().parameters(), lr=0.1))
    try:
        insp.add_rule(signal="step", op=">", threshold=3, action="alert")
        before = insp.rules
        with pytest.raises(inspector.HookError) as e:
            insp.add_rule(spec)
        assert list(e.value.loc) == loc, e.value
        with pytest.raises(inspector.HookError) as e:
            insp.update_rule("r1", **{k: v for k, v in spec.items()})
        assert insp.rules == before
        with pytest.raises(inspector.HookError):
            insp.load_rules([{"signal": "step", "op": ">", "threshold": 1, "action": "alert"}, spec])
        assert insp.rules == before  # all or nothing
    finally:
        insp.close()


def test_a_change_is_one_mapping_whose_every_key_is_a_field():
    """``update_rule(id, change)``: a key named like an argument (``rule_id``, ``self``) is a field
    of the change, refused by name; an unknown id is the id's error."""
    insp = inspector.attach(seed_mlp(), torch.optim.SGD(seed_mlp().parameters(), lr=0.1))
    try:
        insp.add_rule(signal="step", op=">", threshold=3, action="alert")
        before = insp.rules
        for key in ("rule_id", "self", "change", "fields"):
            with pytest.raises(inspector.HookError) as e:
                insp.update_rule("r1", {key: 1})
            assert list(e.value.loc) == [key] and "unknown field" in e.value.msg
        with pytest.raises(inspector.HookError) as e:
            insp.update_rule("r9", {"enabled": False})
        assert list(e.value.loc) == ["rule_id"] and e.value.msg.startswith("no rule with id")
        assert insp.rules == before
        assert insp.update_rule("r1", {"threshold": 4}, enabled=False)["threshold"] == 4.0
    finally:
        insp.close()


def train(insp, model, opt, steps, start=0):
    for s in range(start + 1, start + steps + 1):
        x, y = batch(seed=s)
        opt.zero_grad()
        loss = loss_of(model, x, y)
        insp.record(loss=loss)
        loss.backward()
        opt.step()


def test_rules_are_saved_and_loaded_and_every_change_is_an_event(tmp_path):
    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    insp = inspector.attach(model, opt, rules="safe overnight")
    try:
        insp.add_rule(signal="loss", op=">", threshold=100, for_steps=2, action="pause", name="diverging")
        insp.update_rule("r2", threshold=50.0)
        path = tmp_path / "rules.json"
        insp.save_rules(path)
        saved = json.loads(path.read_text())
        assert [r["name"] for r in saved["rules"]] == ["safe overnight", "diverging"]
        assert saved["rules"][1]["threshold"] == 50.0 and saved["rules"][0] == {
            **PRESETS["safe overnight"][0],
            "threshold": 0.0,
            "for_steps": 1,
            "enabled": True,
            "max_failures": 3,
            "cap": 10,
            "window": 1000,
        }
        insp.remove_rule("r1")
        kinds = [e["kind"] for e in insp.events() if e["kind"].startswith("rule_")]
        assert kinds == ["rule_added", "rule_added", "rule_updated", "rule_removed"]
    finally:
        insp.close()
    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with inspector.attach(model, opt, rules=str(path)) as again:
        assert [{k: v for k, v in r.items() if k not in ("id", "state")} for r in again.rules] == saved[
            "rules"
        ]
    with pytest.raises(inspector.HookError):
        inspector.attach(seed_mlp(), None, rules=str(tmp_path / "missing.json"))


def test_a_pause_rule_holds_training_at_the_boundary_where_it_fires():
    import threading

    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    insp = inspector.attach(model, opt, every=1)
    insp.add_rule(signal="step", op="==", threshold=3, action="pause")
    t = threading.Thread(target=train, args=(insp, model, opt, 6))
    t.start()
    try:
        deadline = 60.0
        import time

        end = time.monotonic() + deadline
        while not insp.state.get("held") and time.monotonic() < end:
            time.sleep(0.01)  # the training thread is ours: poll its state
        assert insp.state["held"] and insp.step == 3
        insp.resume()
        t.join(60)
        assert insp.step == 6
    finally:
        insp.close()


def test_an_add_hook_rule_adds_the_hook_through_the_registry_and_it_applies_next_step():
    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    insp = inspector.attach(model, opt, every=1)
    try:
        insp.add_rule(
            signal="total_norm_raw",
            op=">",
            threshold=0,
            action="add_hook",
            args={"kind": "clip_norm", "target": "*", "params": {"max_norm": 1e-3}},
            cooldown=1000,
        )
        train(insp, model, opt, 3)
        (h,) = insp.hooks()
        assert h["kind"] == "clip_norm" and h["applied_step"] == 2
        snaps = {s["step"]: s for s in insp.snapshots()}
        assert snaps[1]["total_norm"] > 1e-3 and snaps[3]["total_norm"] == pytest.approx(1e-3, rel=1e-4)
        # a rule whose hook is refused records why (an unknown target at fire time)
        insp.add_rule(
            signal="step",
            op=">",
            threshold=0,
            action="add_hook",
            args={"kind": "scale", "target": "nope.*", "params": {"factor": 0.5}},
            cooldown=0,
            max_failures=2,
        )
        train(insp, model, opt, 3, start=3)
        failed = [e for e in insp.events() if e["kind"] == "rule_failed"]
        assert len(failed) == 2 and "target" in failed[0]["reason"] and failed[-1]["disabled"]
    finally:
        insp.close()


def test_safe_overnight_rewinds_and_skips_the_nan_batch_and_training_continues_finite():
    """The ``nan`` scenario (a batch of inf features at step 30), a checkpoint at step 20, the
    "safe overnight" preset: the NaN found at boundary 31 rewinds to step 20 and skips batches
    20..30; the run goes on finite, bitwise as the scenario with those batches thrown away."""
    sc = make("nan", seed=0)
    insp = inspector.attach(sc.model, sc.optimizer, rules="safe overnight")
    insp.checkpoints.add_state("scenario", sc.data_state, sc.set_data_state, data=True)
    sc.batch_source = insp.batches(sc.stream())
    losses: list[tuple[int, float]] = []
    try:
        while len(losses) < 31 + 25:
            losses.append((insp.step + 1, float(sc.step())))
            if insp.step == 20 and not insp.checkpoints.list():
                insp.checkpoint()
        assert math.isnan(losses[29][1])  # step 30 met the bad batch
        (fired,) = [e for e in insp.events() if e["kind"] == "rule_fired"]
        assert fired["at"] == 31 and fired["signal"] == "nonfinite" and fired["value"] >= 1
        assert (
            fired["result"]["rewound"]
            and fired["result"]["checkpoint"] == "c1"
            and fired["result"]["step"] == 20
        )
        (skipped,) = [e for e in insp.events() if e["kind"] == "batches_skipped"]
        assert (skipped["first"], skipped["last"], skipped["steps"]) == (20, 30, [21, 31])
        after = [v for _, v in losses[31:]]
        assert all(math.isfinite(v) for v in after), after
        assert insp.step == 20 + 25
        # ground truth: the scenario alone with batches 20..30 thrown away
        ref = make("nan", seed=0)
        out = []
        while len(out) < 45:
            if ref.batches_drawn == 20:
                for _ in range(11):
                    ref.draw_batch()
            out.append(float(ref.step()))
        assert after == out[20:]
    finally:
        insp.close()


def test_safe_overnight_without_a_checkpoint_pauses():
    sc = make("nan", seed=0)
    insp = inspector.attach(sc.model, sc.optimizer, rules="safe overnight")
    try:
        for _ in range(30):
            sc.step()
        import threading

        t = threading.Thread(target=sc.step)  # step 31: its boundary finds step 30's NaN and holds
        t.start()
        end = __import__("time").monotonic() + 60
        while not insp.state.get("held") and __import__("time").monotonic() < end:
            __import__("time").sleep(0.01)
        assert insp.state["held"] and insp.step == 31
        (fired,) = [e for e in insp.events() if e["kind"] == "rule_fired"]
        assert fired["result"] == {"rewound": False, "paused": True, "reason": fired["result"]["reason"]}
        insp.resume()
        t.join(60)
    finally:
        insp.close()


def loop(insp, model, opt, steps, where, seen, start=0):
    """The README's loop with ``insp.record(loss=loss)`` on one side of ``opt.step()`` (``where``:
    "before", "after", or "both": half the batch's loss before, the other half's after); ``seen``
    gets each step's recorded mean, read here (the test's reference, not the product's)."""
    for s in range(start + 1, start + steps + 1):
        x, y = batch(seed=s)
        opt.zero_grad()
        loss = loss_of(model, x, y)
        if where == "both":
            a, b = loss_of(model, x[:16], y[:16]).detach(), loss_of(model, x[16:], y[16:]).detach()
            seen[s] = (a.double().item() + b.double().item()) / 2
        else:
            seen[s] = loss.double().item()
        if where in ("before", "both"):
            insp.record(loss=a if where == "both" else loss)
        loss.backward()
        opt.step()
        if where in ("after", "both"):
            insp.record(loss=b if where == "both" else loss)


@pytest.mark.parametrize("every", [1, 3])
@pytest.mark.parametrize(("where", "lag"), [("before", 1), ("after", 2), ("both", 2)])
def test_a_loss_rule_is_evaluated_once_a_step_whichever_side_of_step_the_loss_is_recorded(where, lag, every):
    """A rule on the recorded loss fires for every step, sampled or not, with the step's own value
    (its records' mean), at the boundary where that value reached the host: the next one for a
    record before ``step()``, the one after for a record after it (on the CPU)."""
    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    insp = inspector.attach(model, opt, every=every)
    try:
        insp.add_rule(signal="loss", op=">", threshold=0, action="alert", cooldown=0, cap=1000)
        every3 = insp.add_rule(
            signal="loss", op=">", threshold=0, for_steps=3, action="alert", cooldown=0, cap=1000
        )
        seen: dict[int, float] = {}
        loop(insp, model, opt, 12, where, seen)
        fired = [e for e in insp.events() if e["kind"] == "rule_fired"]
        one = [e for e in fired if e["rule"] == "r1"]
        assert [e["step"] for e in one] == list(range(1, 13 - lag)), [(e["step"], e["at"]) for e in one]
        assert all(e["at"] == e["step"] + lag for e in one)
        assert [e["value"] for e in one] == pytest.approx([seen[e["step"]] for e in one], rel=1e-6)
        # "for 3 steps": each step counted once -> steps 3, 6, 9 (not 2, 4, ... had a step counted twice)
        three = [e for e in fired if e["rule"] == every3["id"]]
        assert [e["step"] for e in three] == [s for s in (3, 6, 9) if s <= 12 - lag]
        state = insp.rules[0]["state"]
        assert state["last_step"] == 12 - lag and state["waiting"] is None
        assert state["last_value"] == pytest.approx(seen[12 - lag], rel=1e-6)
    finally:
        insp.close()


def test_a_loss_rule_that_never_gets_a_loss_says_why_in_its_state():
    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    insp = inspector.attach(model, opt, every=1)
    try:
        insp.add_rule(signal="loss", op=">", threshold=0, action="alert")
        insp.add_rule(signal="total_norm", op=">", threshold=0, action="alert")
        insp.add_rule(signal="norm:nope", op=">", threshold=0, action="alert")
        before = [r["state"]["waiting"] for r in insp.rules]
        assert "insp.record(loss=...)" in before[0] and "sampled step" in before[1]
        assert before[2] == "no parameter named 'nope' here"
        for s in range(1, 4):
            train_step(model, opt, *batch(seed=s))  # nothing recorded
        loss_rule, norm_rule, nope = insp.rules
        assert (
            loss_rule["state"]["last_step"] is None
            and "insp.record(loss=...)" in loss_rule["state"]["waiting"]
        )
        assert norm_rule["state"]["last_step"] == 3 and norm_rule["state"]["waiting"] is None
        assert nope["state"]["waiting"] == "no parameter named 'nope' here"
    finally:
        insp.close()


@pytest.mark.parametrize(("where", "lag"), [("before", 1), ("after", 2)])
def test_a_loss_pause_rule_holds_training_at_the_boundary_its_steps_value_reached(where, lag):
    import threading
    import time

    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    insp = inspector.attach(model, opt, every=4)
    insp.add_rule(signal="loss", op=">", threshold=0, for_steps=2, action="pause", cooldown=1000)
    seen: dict[int, float] = {}
    t = threading.Thread(target=loop, args=(insp, model, opt, 8, where, seen))
    t.start()
    try:
        end = time.monotonic() + 60.0
        while not insp.state.get("held") and t.is_alive() and time.monotonic() < end:
            time.sleep(0.01)  # the training thread is ours: poll its state
        assert insp.state["held"] and insp.step == 2 + lag
        (ev,) = [e for e in insp.events() if e["kind"] == "rule_fired"]
        assert ev["step"] == 2 and ev["at"] == 2 + lag and ev["action"] == "pause"
        assert ev["value"] == pytest.approx(seen[2], rel=1e-6)
        insp.resume()
        t.join(60)
        assert insp.step == 8
    finally:
        insp.close()


def test_loss_values_of_a_branch_a_rewind_left_are_not_evaluated_and_cooldown_0_fires_for_each_step():
    """Records alternate sides of ``step()``, so two steps' values may reach one boundary: with
    cooldown 0 both fire there. A rewind drops the values of the steps it abandons that were still
    to be evaluated: the rule fires for the new branch's steps only."""
    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    insp = inspector.attach(model, opt, every=3)
    try:
        insp.add_rule(signal="loss", op=">", threshold=0, action="alert", cooldown=0, cap=1000)
        for s in range(1, 16):
            x, y = batch(seed=s)
            opt.zero_grad()
            loss = loss_of(model, x, y)
            if s % 2:
                insp.record(loss=loss)  # odd steps: before step(), read at the next boundary
            loss.backward()
            opt.step()
            if not s % 2:
                insp.record(loss=loss)  # even steps: after it, read at the one after
            if s == 4:
                cp = insp.checkpoint()
            if s == 8:
                insp.rewind(cp)  # back to step 4: steps 5-8 abandoned, step 8's value among them
        fired = [(e["step"], e["at"]) for e in insp.events() if e["kind"] == "rule_fired"]
        # (the abandoned branch's own firings went with its events)
        assert fired == [(1, 2), (2, 4), (3, 4), (5, 6), (6, 8), (7, 8), (8, 10), (9, 10)], fired
        # and 4 on the branch left (steps 4-7's, at its boundaries 6 and 8): none for its step 8
        assert insp.rules[0]["state"]["fired"] == 8 + 4
    finally:
        insp.close()
