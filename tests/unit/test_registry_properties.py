"""Property tests of the hook registry (hypothesis).

Random sequences of add, update, enable, disable, remove and import are submitted from two
editing threads at random moments of a training loop run by the test's own (training)
thread: between steps, or after the forward (a step under way). After every step:

- the hooks in force equal a plain reference model of the registry (no edit is pending
  once a boundary has passed, so the applied config is the requested one);
- ``config_version`` rose exactly once per accepted edit that changed something;
- the gradients the optimizer used equal a reference computed by applying, by hand with
  plain torch ops, the specs that were in force at that step's pre_step;
- nothing raised into the training loop.
"""

from __future__ import annotations

import copy
import threading

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import inspector
from tests.unit.conftest import batch, loss_of, seed_mlp

NAMES = ["0.weight", "0.bias", "2.weight", "2.bias"]
TARGETS = ["*", "0.*", "2.*", "*.bias", "*.weight", "2.bias"]

params_for = {
    "clip_value": st.fixed_dictionaries({"threshold": st.floats(1e-4, 1.0)}),
    "clip_norm": st.fixed_dictionaries(
        {"max_norm": st.floats(1e-3, 2.0), "mode": st.sampled_from(["global", "per_tensor"])}
    ),
    "scale": st.fixed_dictionaries({"factor": st.floats(-2.0, 2.0)}),
    "l2": st.fixed_dictionaries({"lam": st.floats(0.0, 0.1)}),
    "freeze": st.just({}),
}
spec = st.sampled_from(sorted(params_for)).flatmap(
    lambda k: st.fixed_dictionaries(
        {"kind": st.just(k), "target": st.sampled_from(TARGETS), "params": params_for[k]}
    )
)
op = st.one_of(
    st.tuples(st.just("add"), spec),
    st.tuples(st.just("update"), st.integers(0, 5), st.floats(1e-3, 1.0)),
    st.tuples(st.just("enable"), st.integers(0, 5)),
    st.tuples(st.just("disable"), st.integers(0, 5)),
    st.tuples(st.just("remove"), st.integers(0, 5)),
    st.tuples(st.just("move"), st.integers(0, 5), st.integers(0, 5)),
    st.tuples(st.just("invalid"), st.sampled_from(["neg", "kind", "target", "bool"])),
    st.tuples(st.just("import"), st.lists(spec, max_size=3)),
)
# each op: which editing thread, and when (0: between steps, 1: after the forward)
timed = st.tuples(op, st.sampled_from(["A", "B"]), st.sampled_from([0, 1]))

FIRST_PARAM = {"clip_value": "threshold", "clip_norm": "max_norm", "scale": "factor", "l2": "lam"}


def apply_by_hand(specs, grads, params):
    """The reference: each enabled spec in position order, written with plain torch ops."""
    grads = [None if g is None else g.clone() for g in grads]
    for s in sorted(specs, key=lambda s: s.position):
        if not s.enabled:
            continue
        idx = [i for i, n in enumerate(NAMES) if inspector.match_targets([n], s.target)]
        tg = [i for i in idx if grads[i] is not None]
        p = s.params
        if s.kind == "freeze":
            for i in idx:
                grads[i] = None
        elif s.kind == "clip_value":
            for i in tg:
                grads[i] = grads[i].clamp(-p["threshold"], p["threshold"])
        elif s.kind == "scale":
            for i in tg:
                grads[i] = grads[i] * p["factor"]
        elif s.kind == "l2":
            for i in tg:
                grads[i] = grads[i] + p["lam"] * params[i]
        elif s.kind == "clip_norm" and tg:
            if p["mode"] == "global":
                total = torch.stack([grads[i].norm() for i in tg]).norm()
                coef = min(1.0, p["max_norm"] / (float(total) + 1e-6))
                for i in tg:
                    grads[i] = grads[i] * coef
            else:
                for i in tg:
                    grads[i] = grads[i] * min(1.0, p["max_norm"] / (float(grads[i].norm()) + 1e-6))
    return grads


class Reference:
    """What the requested config should be, kept by hand."""

    def __init__(self):
        self.specs: list[dict] = []

    def view(self):
        return [{k: s[k] for k in ("id", "kind", "target", "params", "enabled")} for s in self.specs]


def run_op(insp, ref, item):
    """Submit one edit; return 1 if it should change the config (and bump the version once)."""
    kind = item[0]
    ids = [s["id"] for s in ref.specs]
    try:
        if kind == "add":
            d = item[1]
            h = insp.add_hook(d["kind"], target=d["target"], **d["params"])
            full = insp.hook_spec(h.id)["params"]
            ref.specs.append(
                {"id": h.id, "kind": d["kind"], "target": d["target"], "params": full, "enabled": True}
            )
            return 1
        if kind == "import":
            insp.import_hooks([{**d, "enabled": True} for d in item[1]])
            ref.specs = [
                {k: h[k] for k in ("id", "kind", "target", "params", "enabled")} for h in insp.hooks()
            ]
            assert [(s["kind"], s["target"]) for s in ref.specs] == [
                (d["kind"], d["target"]) for d in item[1]
            ]
            return 1
        if kind == "invalid":
            bad = {
                "neg": lambda: insp.add_hook("clip_value", target="*", threshold=-1.0),
                "kind": lambda: insp.add_hook("explode", target="*"),
                "target": lambda: insp.add_hook("scale", target="nothing.*", factor=1.0),
                "bool": lambda: insp.add_hook("scale", target="*", factor=True),
            }[item[1]]
            try:
                bad()
            except inspector.HookError:
                return 0
            raise AssertionError("invalid edit accepted")
        if not ids:
            return 0
        s = ref.specs[item[1] % len(ids)]
        if kind == "update":
            name = FIRST_PARAM.get(s["kind"])
            if name is None:
                return 0
            value = item[2] if s["kind"] != "scale" else -item[2]
            if s["params"][name] == value:
                return 0
            insp.hook(s["id"]).update(**{name: value})
            s["params"] = {**s["params"], name: value}
            return 1
        if kind in ("enable", "disable"):
            want = kind == "enable"
            getattr(insp.hook(s["id"]), kind)()
            changed = s["enabled"] != want
            s["enabled"] = want
            return int(changed)
        if kind == "remove":
            insp.hook(s["id"]).remove()
            ref.specs.remove(s)
            return 1
        if kind == "move":
            to = item[2] % len(ids)
            if ref.specs.index(s) == to:
                return 0
            insp.update_hook(s["id"], position=to)
            ref.specs.remove(s)
            ref.specs.insert(to, s)
            return 1
    except inspector.HookError as e:
        raise AssertionError(f"valid edit refused: {item}: {e}") from e
    raise AssertionError(item)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(st.lists(timed, max_size=4), min_size=1, max_size=6))
def test_random_edits_from_two_threads(steps):
    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen: dict[str, object] = {}

    def before_ours(o, a, k):  # registered before attach: runs before our pre_step
        seen["raw"] = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
        seen["params"] = [p.detach().clone() for p in model.parameters()]
        seen["in_force"] = list(insp._reg.applied)

    def after_ours(o, a, k):
        seen["final"] = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]

    opt.register_step_pre_hook(before_ours)
    insp = inspector.attach(model, opt)
    opt.register_step_pre_hook(after_ours)
    ref = Reference()
    expected_version = 0
    try:
        for n, ops in enumerate(steps):
            phase_ops = {0: [o for o in ops if o[2] == 0], 1: [o for o in ops if o[2] == 1]}

            def submit(items):
                nonlocal expected_version
                for item, who, _ in items:
                    box = {}
                    t = threading.Thread(
                        target=lambda b=box, i=item: b.update(r=run_op(insp, ref, i)), name=who
                    )
                    t.start()
                    t.join()
                    assert "r" in box, f"edit {item} raised in its thread"
                    expected_version += box["r"]

            submit(phase_ops[0])  # between steps
            x, y = batch(seed=n)
            opt.zero_grad()
            loss = loss_of(model, x, y)
            submit(phase_ops[1])  # a step is under way
            loss.backward()
            opt.step()
            # after the boundary nothing is pending: in force == requested == the reference
            assert [
                {k: h[k] for k in ("id", "kind", "target", "params", "enabled")} for h in insp.hooks()
            ] == ref.view()
            assert all(h["applied_step"] is not None for h in insp.hooks())
            assert insp.config_version == expected_version
            want = apply_by_hand(seen["in_force"], seen["raw"], seen["params"])
            for got, exp in zip(seen["final"], want, strict=True):
                assert (got is None) == (exp is None)
                if got is not None:
                    assert torch.allclose(got, exp, rtol=1e-5, atol=1e-7)
    finally:
        insp.close()
    assert not [e for e in insp.events() if e["kind"] == "hook_error"]
    copy.deepcopy(model)  # the model is intact and free of our hooks
