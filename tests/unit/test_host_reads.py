"""Count the blocking host reads the inspector makes in each step.

On CUDA a host read of a tensor waits for the kernels that write it, so a read of anything
written during the step under way stalls the CPU until the device has drained that step's queue.
This test runs on the CPU and counts such reads the way CUDA would suffer them:

- a ``TorchDispatchMode`` active for the whole step (forward, backward, ``optimizer.step()``,
  ``record()``) records the storages that ops write (outputs and arguments written in place;
  views are not writes);
- ``Tensor.item``, ``tolist``, ``numpy``, ``cpu``, ``__bool__``, ``__float__``, ``__int__``,
  ``__index__``, a ``to`` the CPU from another device and a blocking ``copy_`` into a CPU
  tensor are wrapped: a call made from the
  inspector's code (a frame of the ``inspector`` package on the stack) on a tensor whose storage was
  written during the same step counts. A read of a buffer filled in an earlier step does not: its
  copy was queued a step ago, so on CUDA it has long completed.

Also counted: tensors the inspector makes from host data (``torch.tensor(list)``, seen as
``aten.lift_fresh``), which on a GPU arrive by a synchronising copy: none after the first two steps.

0 on unsampled steps, at most 1 (the snapshot's one transfer) on sampled steps, for the defaults,
``every=1``, each hook kind at each point, a GradScaler and gradient accumulation. An enabled
``nan_guard`` ``skip`` reads once per step, by design (documented in docs/instruments.md and ops.py).
"""

from __future__ import annotations

import math
import sys
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import inspector

from .conftest import batch, loss_of, seed_mlp


def _key(t: Any) -> int | None:
    if not isinstance(t, Tensor) or t.layout != torch.strided or t.is_meta:
        return None
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return ptr or None


class Reads(TorchDispatchMode):
    """Records the storages written while active, and counts the inspector's reads of them."""

    READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__")

    def __init__(self) -> None:
        super().__init__()
        self.written: set[int] = set()
        self.reads: list[str] = []  # where each counted read came from
        # tensors the inspector made from host data (torch.tensor(list)) in the window: on a GPU,
        # moved there from pageable memory, each is a copy that synchronises
        self.made: list[str] = []
        self.active = False
        self._saved: dict[str, Callable[..., Any]] = {}

    # ------------------------------------------------------------------ writes
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten.lift_fresh.default and self.active:
            where = self._ours_where()
            if where is not None:
                self.made.append(where)
        out = func(*args, **kwargs)
        schema = func._schema
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                v = args[i] if i < len(args) else kwargs.get(arg.name)
                for t in tree_flatten(v)[0]:
                    self._mark(t)
        outs = out if isinstance(out, tuple | list) else (out,)
        for ret, o in zip(schema.returns, outs, strict=False):
            if ret.alias_info is None or ret.alias_info.is_write:  # a new tensor, or one written in place
                for t in tree_flatten(o)[0]:
                    self._mark(t)
        return out

    def _mark(self, t: Any) -> None:
        k = _key(t)
        if k is not None:
            self.written.add(k)

    def _ours_where(self) -> str | None:
        """The first inspector frame on the stack (None: none, or the control plane's, whose rows
        are CPU tensors for its own gloo group by design)."""
        f = sys._getframe(2)
        while f is not None:
            name = f.f_globals.get("__name__", "")
            if name == "inspector" or name.startswith("inspector."):
                return None if name == "inspector.distributed" else f"{name}:{f.f_lineno}"
            f = f.f_back
        return None

    # ------------------------------------------------------------------ reads
    def _ours(self) -> bool:
        f = sys._getframe(2)
        while f is not None:
            name = f.f_globals.get("__name__", "")
            if name == "inspector" or name.startswith("inspector."):
                return True
            f = f.f_back
        return False

    def _count(self, what: str, t: Tensor) -> None:
        if self.active and _key(t) in self.written and self._ours():
            self.reads.append(what + "\n" + "".join(traceback.format_stack(limit=8)[:-2]))

    def install(self) -> None:
        for name in self.READS:
            orig = getattr(Tensor, name)
            self._saved[name] = orig

            def wrapped(t: Tensor, *a: Any, _orig: Any = orig, _name: str = name, **k: Any) -> Any:
                self._count(_name, t)
                return _orig(t, *a, **k)

            setattr(Tensor, name, wrapped)
        to, copy_ = Tensor.to, Tensor.copy_
        self._saved["to"], self._saved["copy_"] = to, copy_

        def wrapped_to(t: Tensor, *a: Any, **k: Any) -> Any:
            target = next((x for x in (*a, k.get("device")) if isinstance(x, str | torch.device)), None)
            # a move to the host from another device (on the CPU a .to(its own device) is no copy)
            cpu = target is not None and torch.device(target).type == "cpu"
            if cpu and t.device.type != "cpu" and not k.get("non_blocking"):
                self._count("to(cpu)", t)
            return to(t, *a, **k)

        def wrapped_copy(t: Tensor, src: Tensor, non_blocking: bool = False) -> Any:
            if not non_blocking and t.device.type == "cpu":
                self._count("copy_", src)
            return copy_(t, src, non_blocking)

        Tensor.to, Tensor.copy_ = wrapped_to, wrapped_copy  # type: ignore[method-assign]

    def uninstall(self) -> None:
        for name, orig in self._saved.items():
            setattr(Tensor, name, orig)
        self._saved.clear()

    def step(self, fn: Callable[[], Any]) -> list[str]:
        """Run one training step inside a fresh window; the reads it counted."""
        self.written.clear()
        self.reads = []
        self.made = []
        self.active = True
        try:
            with self:
                fn()
        finally:
            self.active = False
        return self.reads


@pytest.fixture
def reads():
    r = Reads()
    r.install()
    try:
        yield r
    finally:
        r.uninstall()


def run(
    reads: Reads,
    setup: Callable[[inspector.Inspector], Any] = lambda insp: None,
    *,
    steps: int = 12,
    accumulate: int = 1,
    scaler: bool = False,
    poison: int | None = None,
    make_opt: Callable[[Any], torch.optim.Optimizer] | None = None,
    **attach: Any,
) -> tuple[list[tuple[int, bool, list[str]]], inspector.Inspector]:
    """Train the seed MLP for ``steps`` steps in a user-style loop; per step (number, sampled, reads)."""
    model = seed_mlp()
    opt = (
        make_opt(model.parameters())
        if make_opt is not None
        else torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    )
    sc = torch.amp.GradScaler("cpu", init_scale=2.0**8) if scaler else None
    insp = inspector.attach(model, opt, scaler=sc, **attach)
    insp.found_after = []  # type: ignore[attr-defined]  # the nonfinite events visible after each step
    setup(insp)
    out = []
    try:
        for s in range(1, steps + 1):

            def one(s: int = s) -> None:
                opt.zero_grad(set_to_none=True)
                for m in range(accumulate):
                    x, y = batch(seed=s * 10 + m)
                    if poison == s:
                        x[0, 0] = math.nan
                    loss = loss_of(model, x, y) / accumulate
                    insp.record(loss=loss)
                    (sc.scale(loss) if sc is not None else loss).backward()
                if sc is not None:
                    sc.step(opt)
                    sc.update()
                else:
                    opt.step()
                insp.record(acc=loss.detach() * 2)  # a late record, after the boundary

            got = reads.step(one)
            # masks, indices and counts are built once (stats.device_constant), in the first steps
            assert s <= 2 or not reads.made, f"step {s}: tensors made from host data at {reads.made}"
            latest = insp.latest()
            out.append((s, latest is not None and latest["step"] == s, got))
            insp.found_after.append([e for e in insp.events() if e["kind"] == "nonfinite"])  # type: ignore[attr-defined]
    finally:
        insp.close()
    return out, insp


def check(per_step: list[tuple[int, bool, list[str]]], *, unsampled_expected: bool = True) -> None:
    for step, sampled, got in per_step:
        limit = 1 if sampled else 0
        assert len(got) <= limit, (
            f"step {step} ({'sampled' if sampled else 'unsampled'}): {len(got)} reads\n" + ("\n".join(got))
        )
    if unsampled_expected:
        assert any(not s for _, s, _ in per_step), "no unsampled step was exercised"
    assert any(s for _, s, _ in per_step)


def test_the_counter_counts_a_same_step_read_from_inspector_code_only(reads):
    """The instrument itself: a read from inspector code of a tensor written in the same window
    counts; the same read from the test's own code, or of an earlier window's tensor, does not."""
    ours = {"__name__": "inspector.fake"}  # code run with these globals counts as the inspector's
    p = nn.Parameter(torch.ones(3))
    old: list[Tensor] = []

    def first() -> None:
        (p * 2).sum().backward()
        old.append(p.grad.norm())
        float(old[0])  # the test's own read: not counted

    assert reads.step(first) == []
    fresh: list[Tensor] = []

    def second() -> None:
        fresh.append(torch.ones(()) * 3)
        exec("float(x)", {**ours, "x": old[0]})  # written in the first window: not counted
        exec("float(x)", {**ours, "x": fresh[0]})  # this window's: counted
        exec("x.tolist()", {**ours, "x": p.grad})  # the gradient was written in the first window

    got = reads.step(second)
    assert len(got) == 1 and got[0].startswith("__float__")


def test_defaults(reads):
    per_step, _ = run(reads, steps=40)
    check(per_step, unsampled_expected=False)  # the budget decides; the dense first steps are sampled


def test_every_3_and_every_1(reads):
    check(run(reads, every=3)[0])
    check(run(reads, every=1)[0], unsampled_expected=False)


HOOKS = [
    ("clip_value", "pre_step", {"threshold": 0.01}),
    ("clip_value", "post_accumulate", {"threshold": 0.01}),
    ("clip_norm", "pre_step", {"max_norm": 0.1}),
    ("clip_norm", "pre_step", {"max_norm": 0.1, "mode": "per_tensor"}),
    ("clip_norm", "pre_step", {"max_norm": 0.1, "norm_type": math.inf}),
    ("clip_norm", "post_accumulate", {"max_norm": 0.1, "mode": "per_tensor"}),
    ("zclip", "pre_step", {"warmup": 2, "z": 0.1}),  # clips from step 3 on: every decision on the device
    ("zclip", "pre_step", {"warmup": 2, "z": 0.1, "mode": "group", "clip_to": "threshold"}),
    ("scale", "pre_step", {"factor": 0.5}),
    ("scale", "post_accumulate", {"factor": 0.5}),
    ("l2", "pre_step", {"lam": 0.01}),
    ("l2", "post_accumulate", {"lam": 0.01}),
    ("freeze", "pre_step", {}),
    ("nan_guard", "pre_step", {"action": "report"}),
    ("nan_guard", "pre_step", {"action": "zero"}),
    ("nan_guard", "post_accumulate", {"action": "report"}),
    ("nan_guard", "post_accumulate", {"action": "zero"}),
    ("nan_guard", "module", {}),
    ("noise", "pre_step", {"std": 0.01}),
    ("noise", "post_accumulate", {"std": 0.01}),
    ("module_log", "module", {"grad_input": True}),
]


@pytest.mark.parametrize(("kind", "point", "params"), HOOKS, ids=[f"{k}-{p}-{len(q)}" for k, p, q in HOOKS])
def test_each_hook_kind_at_each_point(reads, kind, point, params):
    target = "*" if point != "module" else "0"
    if kind == "freeze":
        target = "0.weight"

    def setup(insp: inspector.Inspector) -> None:
        insp.add_hook(kind, target=target, point=point, **params)

    check(run(reads, setup, every=3)[0])


@pytest.mark.parametrize("point", ["pre_step", "post_accumulate"])
def test_a_python_hook(reads, point):
    def halve(name: str, param: Tensor) -> None:
        param.grad.mul_(0.5)

    check(run(reads, lambda insp: insp.add_hook(halve, target="*", point=point), every=3)[0])


def test_a_scaler_and_gradient_accumulation(reads):
    check(run(reads, every=3, scaler=True)[0])
    check(run(reads, every=3, accumulate=3)[0])
    check(run(reads, every=3, accumulate=2, scaler=True)[0])


POST_CHAINS = {
    "head": [("l2", {"lam": 0.01}), ("scale", {"factor": 0.5}), ("noise", {"std": 0.01})],
    "tail": [
        ("clip_value", {"threshold": 0.01}),
        ("scale", {"factor": 0.5}),
        ("l2", {"lam": 0.01}),
        ("noise", {"std": 0.01}),
    ],
    "middle": [
        ("clip_value", {"threshold": 0.01}),
        ("scale", {"factor": 0.5}),
        ("clip_norm", {"max_norm": 0.1, "mode": "per_tensor"}),
    ],
}


@pytest.mark.parametrize("name", list(POST_CHAINS))
def test_post_accumulate_chains_under_gradient_accumulation(reads, name):
    """The pre-accumulation hook (inspector/hooks/accumulation.py): a head ``scale`` of each later
    backward, the tail taken back and done again, the head's effect measured again: no host read."""

    def setup(insp: inspector.Inspector) -> None:
        for kind, params in POST_CHAINS[name]:
            insp.add_hook(kind, target="*", point="post_accumulate", **params)

    check(run(reads, setup, every=3, accumulate=3)[0])


OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=False),
    "adam-foreach": lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, nesterov=True),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_optimizer_state_and_update_geometry_read_nothing_more(reads, name):
    """``Snapshot.optim`` (inspector/stats/optim_state.py): the Adam state's norms and counts (its
    ``step`` a tensor) and the update's dot products ride the one transfer."""
    per_step, insp = run(reads, every=3, make_opt=OPTIMIZERS[name])
    check(per_step)
    optim = insp.latest()["optim"]
    assert optim["kind"] == ("adam" if name.startswith("adam") else "other")
    assert optim["cos_update_grad"][0] is not None and optim["cos_grad_prev"][0] is not None


def test_the_noise_scale_under_accumulation(reads):
    """The gradient noise scale (on by default; here with an estimate on every sampled step): its
    increments' sums ride in the snapshot's one transfer, nothing is read on other steps."""
    per_step, insp = run(reads, every=3, accumulate=3, batch_size=8)
    check(per_step)
    assert insp.snapshots()[-1]["noise_scale"]["samples"] >= 3
    check(run(reads, every=3, accumulate=2, scaler=True)[0])


def test_a_skip_guard_reads_once_per_step_by_design(reads):
    per_step, _ = run(reads, lambda insp: insp.add_hook("nan_guard", target="*", action="skip"), every=3)
    for step, sampled, got in per_step:
        assert len(got) <= (2 if sampled else 1), (step, got)


def test_a_nan_on_an_unsampled_step_is_read_later_and_reported_by_the_next_boundary(reads):
    per_step, insp = run(reads, every=3, poison=5)  # step 5 is unsampled (1, 4, 7, ... are)
    assert not per_step[4][1]
    # up to the step after it (from then on the NaN is in the weights: a sampled step that shows
    # non-finite gradients counts them, a read each, the documented rare path)
    check(per_step[:6])
    nonfinite = [e for e in insp.events() if e["kind"] == "nonfinite"]
    assert [(e["step"], e["param"]) for e in nonfinite] == [(5, "0.weight")]
    assert nonfinite[0]["nan"] is None  # not counted on an unsampled step without a guard
    seen = insp.found_after  # type: ignore[attr-defined]
    assert seen[4] == [] and len(seen[5]) == 1  # not during step 5: at step 6's boundary


def test_the_flight_recorder_and_spike_detection_read_nothing_more(reads):
    """The flight recorder's every-step ring writes and the spike detector's z-scores
    (inspector/stats/flight.py) ride the deferred queue: nothing more on an unsampled step, also
    with a NaN (a dump copies the ring and reads it at a later boundary) and with a hook."""

    dumps: list[Any] = []

    def setup(insp: inspector.Inspector) -> None:
        insp.set_spike_detection(warmup=3)
        insp.subscribe(lambda kind, p: dumps.append(p) if kind == "flight" else None, lossless=True)

    # a NaN at unsampled step 8: found at boundary 9, the ring copied then and read at boundary 10
    # (from step 11, sampled, the NaN it spread reads its counts: by design, test above)
    per_step, insp = run(reads, setup, steps=12, every=5, poison=8, flight=256)
    check(per_step[:10])
    insp.flush()
    assert [d["reason"] for d in dumps] == ["nonfinite"] and dumps[0]["rows"][-1]["step"] >= 9
    per_step, insp = run(reads, lambda i: i.add_hook("scale", target="*", factor=0.5), every=4, flight=256)
    check(per_step)
    assert any(r["final"] != r["raw"] for r in insp.flight_recorder()["rows"])


def test_counting_and_skipping_batches_reads_nothing(reads):
    """``insp.batches`` (inspector/whatif/skip.py) counts batches and drops a skipped window
    without reading a tensor: nothing more on any step, before and after a rewind-and-skip."""
    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    insp = inspector.attach(model, opt, every=4)
    data = [batch(seed=i) for i in range(16)]
    it = insp.batches(data)
    per_step = []
    cp = None
    try:
        for s in range(1, 11):

            def one() -> None:
                x, y = next(it)
                opt.zero_grad(set_to_none=True)
                loss_of(model, x, y).backward()
                opt.step()

            got = reads.step(one)
            latest = insp.latest()
            per_step.append((s, latest is not None and latest["step"] == insp.step, got))
            if s == 2:
                cp = insp.checkpoint()  # between steps, outside the counted step
            if s == 4:
                insp.rewind(cp, skip=4)  # batches 2-5: 2 and 3 received, 4 and 5 dropped ahead
    finally:
        insp.close()
    check(per_step)
    assert insp.data_position["dropped"] == 2 and insp.data_position["position"] == 4 + 2 + 6


def test_rules_read_nothing_more(reads):
    """Rules (inspector/rules.py) read the snapshot's host values and the boundary's events: nothing
    more on any step, with a rule on every kind of signal firing (an alert and a hook added)."""

    def setup(insp: inspector.Inspector) -> None:
        insp.set_spike_detection(warmup=3)
        for signal in ("loss", "total_norm", "total_norm_raw", "update_ratio", "norm:0.weight", "step"):
            insp.add_rule(signal=signal, op=">=", threshold=0, action="alert", cooldown=0)
        insp.add_rule(signal="nonfinite", op=">", threshold=0, action="alert", cooldown=0)
        insp.add_rule(signal="spike", op=">=", threshold=0, action="alert", cooldown=0)
        insp.add_rule(signal="step", op="==", threshold=5, action="clip_norm", args={"quantile": 0.9})

    per_step, insp = run(reads, setup, steps=12, every=4, poison=9, flight=256)
    check(per_step[:9])  # (from the poisoned step on, the NaN it spread is counted by design, above)
    fired = [e for e in insp.events() if e["kind"] == "rule_fired"]
    wanted = {"loss", "total_norm", "norm:0.weight", "step", "nonfinite", "spike"}
    assert {e["signal"] for e in fired} >= wanted
    assert any(e["action"] == "clip_norm" and e["at"] == 5 for e in fired)


def test_only_copies_in_flight_count_towards_waiting_for_the_oldest(monkeypatch):
    """The deferred queue waits for its oldest copy only when more than ``MAX_PENDING`` copies are
    in flight (a device far behind): items with nothing to copy (a rule's per-step close of the
    recorded values, a snapshot's scalars message) are no copies and make nothing wait."""
    from inspector.stats import deferred
    from inspector.stats.telemetry import Pack

    class Event:  # a GPU copy that has not completed: query() False until waited for
        waited = 0

        def __init__(self) -> None:
            self.done = False

        def query(self) -> bool:
            return self.done

        def synchronize(self) -> None:
            Event.waited += 1
            self.done = True

    class Copy(deferred._Item):
        def __init__(self, step, flat, split, consume):
            super().__init__(step, flat, split, consume)
            if flat is not None:
                self.event = Event()

    monkeypatch.setattr(deferred, "_Item", Copy)
    q = deferred.Deferred()
    got: list[int] = []
    for k in range(deferred.MAX_PENDING):
        pack = Pack()
        pack.add("x", [torch.ones(())])
        q.submit(k, pack, lambda v, k=k: got.append(k))
        q.submit(k, None, lambda v: got.append(-1))  # nothing to copy: queued behind the copy
    q.drain(before=10**9)
    assert Event.waited == 0 and got == []  # 8 copies in flight (16 items): none waited for
    pack = Pack()
    pack.add("x", [torch.ones(())])
    q.submit(99, pack, lambda v: got.append(99))
    q.drain(before=10**9)
    assert Event.waited >= 1 and got[:2] == [0, -1]  # 9 copies: the oldest is waited for
