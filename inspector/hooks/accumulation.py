"""``post_accumulate`` hooks under gradient accumulation: each micro-batch's contribution edited once.

A ``post_accumulate`` hook runs after every backward on the **accumulated** ``param.grad``. For
``clip_value``, ``clip_norm``, ``nan_guard`` and ``python`` (the *accumulated kinds*) that is what
they mean: they act on the accumulated gradient after each backward. ``scale``, ``l2`` and
``noise`` (the *contribution kinds*) must not compound: ``scale(0.5)`` over four micro-batches
would otherwise give 0.9375x of the summed gradient, and ``l2``/``noise`` would be added four
times. A parameter's enabled ``post_accumulate`` hooks form a chain in position order; the chain
splits into

- the **head**: the contribution kinds before its first accumulated kind (a chain with no
  accumulated kind is all head). It acts on the step's summed gradient as if applied once: a head
  ``scale`` multiplies each later backward's own gradient before it is accumulated (so every
  contribution is scaled once), a head ``l2`` or ``noise`` is added once per step, at the step's
  first backward that reaches the parameter;
- the **tail**: the contribution kinds after its last accumulated kind. From the step's second
  backward on, they are undone on ``param.grad`` before the new gradient is accumulated (in reverse
  order: ``scale`` divided out, ``l2`` subtracted, ``noise`` subtracted, redrawn from the
  generator state saved before it was drawn) and the chain after the head runs again, so the tail
  acts once on the final accumulated value (the same noise draw each time);
- the **middle**: contribution kinds between two accumulated kinds. They cannot be made exact (an
  accumulated kind before them cannot be undone) and act on the accumulated gradient after each
  backward, like the accumulated kinds.

The step's first backward runs the whole chain on ``param.grad`` as it stands, exactly as with a
single backward (bit for bit). A later backward *continues* the step when it accumulates into the
very ``.grad`` tensor the chain left (``zero_grad()``'s default, setting it to None, starts over);
the step boundary (:meth:`Accumulation.end_step`) forgets everything.

The undo and the head ``scale`` of later backwards run in a pre-accumulation hook
(``param.register_hook``: it receives this backward's gradient before ``AccumulateGrad`` adds it
to ``.grad``), registered only on parameters whose chain has a head ``scale`` or a tail. It does
nothing when the backward does not accumulate into ``.grad`` (``torch.autograd.grad``). Without
the private ``torch._C._will_engine_execute_node`` that check rests on, or under FSDP2 (a sharded
parameter's gradient arrives through FSDP2's reduce-scatter, which calls the post-accumulate hooks
itself, and the parameter it lives on is no autograd leaf of the backward), no pre-accumulation
hook is used: the hooks act after each backward on the accumulated gradient, as the accumulated
kinds do, and :attr:`Accumulation.inexact` lists the parameters where a step had more than one.

Effects (measured on sampled steps): a head ``scale`` sums its contributions' squared norms
before and after (its norm ratio is exactly ``|factor|``); every other hook keeps, per target,
the norms of its last application in the step (the one whose result the optimizer sees; a head
``l2``/``noise`` of a chain that is all head is measured again at each later backward, on a copy
taken back to before it), and the
elements changed of that application (contribution kinds, applied once per step) or summed over
the step's backwards (the accumulated kinds and a middle one, which act on every backward).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..stats.tensor_stats import sq_norm
from .ops import HookState, ParamTarget, PostFinding, _stream, apply_post_accumulate

__all__ = ["ACCUMULATED_KINDS", "CONTRIBUTION_KINDS", "Accumulation", "Chain", "split", "supported"]

CONTRIBUTION_KINDS = frozenset({"scale", "l2", "noise"})
ACCUMULATED_KINDS = frozenset({"clip_value", "clip_norm", "nan_guard", "python"})

Entry = tuple[HookState, ParamTarget]
_WILL_EXECUTE: Callable[[Any], bool] | None = getattr(torch._C, "_will_engine_execute_node", None)


@dataclass(frozen=True, slots=True)
class Chain:
    """One parameter's enabled ``post_accumulate`` hooks in position order, split (module docstring)."""

    entries: tuple[Entry, ...]
    head: int  # entries[:head]: the head
    tail: int  # entries[tail:]: the tail (tail >= head)
    exact: bool  # the pre-accumulation hook can be used (not FSDP2)

    @property
    def factor(self) -> float:
        """The product of the head's ``scale`` factors (1.0: none)."""
        f = 1.0
        for st, _ in self.entries[: self.head]:
            if st.spec.kind == "scale":
                f *= float(st.spec.params["factor"])
        return f

    @property
    def head_scales(self) -> list[HookState]:
        return [st for st, _ in self.entries[: self.head] if st.spec.kind == "scale"]

    @property
    def needs_pre(self) -> bool:
        """Whether the parameter needs the pre-accumulation hook: a head ``scale`` or a tail."""
        return self.exact and (bool(self.head_scales) or self.tail < len(self.entries))

    @property
    def contributes(self) -> bool:
        return any(st.spec.kind in CONTRIBUTION_KINDS for st, _ in self.entries)

    def effect_mode(self, j: int) -> str:
        """How entry ``j``'s measured application joins the step's effect (``apply_post_accumulate``)."""
        kind = self.entries[j][0].spec.kind
        if not self.exact:
            return "last_norms"
        if j < self.head:
            return "sum" if kind == "scale" else "last"
        if j >= self.tail:
            return "last"
        return "last_norms"  # an accumulated kind, or a middle contribution kind


def split(entries: tuple[Entry, ...], exact: bool) -> Chain:
    """The chain of ``entries`` (position order) with its head and tail."""
    acc = [j for j, (st, _) in enumerate(entries) if st.spec.kind not in CONTRIBUTION_KINDS]
    if not acc:
        return Chain(entries, len(entries), len(entries), exact)
    return Chain(entries, acc[0], acc[-1] + 1, exact)


@dataclass(slots=True)
class _Undo:
    """One tail application to take back: ``kind`` with its value; for ``noise`` its generator and
    the state it had before the draw."""

    state: HookState
    target: ParamTarget
    kind: str
    value: float
    gen: torch.Generator | None = None
    gen_state: Tensor | None = None


class Accumulation:
    """Which backward of the step each parameter is at, and what its chain's tail did to undo it.

    Owned by :class:`~inspector.hooks.torch_hooks.TorchHooks`, which calls :meth:`pre_hook`'s
    function from ``param.register_hook`` and :meth:`run` from its post-accumulate hook.
    """

    def __init__(self) -> None:
        self._left: dict[int, weakref.ref[Tensor]] = {}  # param -> the .grad its chain left this step
        self._undo: dict[int, list[_Undo]] = {}  # param -> the tail applications on that .grad
        self._head: dict[int, list[_Undo]] = {}  # param -> its head's applications (a chain all head)
        self._armed: set[int] = set()  # params whose pre-accumulation hook prepared this backward
        self.inexact: list[tuple[int, str]] = []  # (param, name) acted per backward under accumulation

    def end_step(self) -> None:
        """The step boundary: the next backward starts a step."""
        if self._left:
            self._left.clear()
        if self._undo:
            self._undo.clear()
        if self._head:
            self._head.clear()
        if self._armed:
            self._armed.clear()

    def _continues(self, i: int, grad: Tensor | None) -> bool:
        ref = self._left.get(i)
        return grad is not None and ref is not None and ref() is grad

    # ---------------------------------------------------------------- before AccumulateGrad
    def pre_hook(
        self, i: int, param: Tensor, chain_of: Callable[[], Chain | None], measure: Callable[[], bool]
    ) -> Callable[[Tensor], Tensor | None]:
        """The function for ``param.register_hook``: at a backward that continues the step, undo the
        tail on ``param.grad`` and return this backward's gradient times the head's factor."""

        def hook(g: Tensor) -> Tensor | None:
            chain = chain_of()
            if chain is None or not chain.needs_pre or not self._continues(i, param.grad):
                return None
            if _WILL_EXECUTE is None or not _accumulates(param):
                return None
            with torch.no_grad():
                for u in reversed(self._undo.pop(i, [])):
                    _undo(u)
                self._armed.add(i)
                scales = chain.head_scales
                if not scales or g.layout != torch.strided:
                    return None
                if measure():
                    _measure_scales(scales, g)
                return g * chain.factor

        return hook

    # ---------------------------------------------------------------- after AccumulateGrad
    def run(
        self,
        i: int,
        chain: Chain,
        param: Tensor,
        measure: bool,
        on_finding: Callable[[int, HookState, PostFinding], None],
        on_failure: Callable[[HookState, ParamTarget, BaseException], None],
    ) -> None:
        """Run the chain's hooks on ``param.grad`` after this backward's accumulation: all of them at
        the step's first backward, those after the head at a later one (the tail was undone)."""
        if chain.needs_pre:
            cont = i in self._armed
            self._armed.discard(i)
        else:
            cont = self._continues(i, param.grad)
        if cont and not chain.exact and chain.contributes and not any(j == i for j, _ in self.inexact):
            self.inexact.append((i, chain.entries[0][1].name))
        start = chain.head if cont and chain.exact else 0
        if cont and chain.exact and measure and chain.head == len(chain.entries):
            self._remeasure_head(i, param)
        undo: list[_Undo] = []
        head: list[_Undo] | None = (
            [] if chain.exact and start == 0 and chain.head == len(chain.entries) else None
        )
        for j in range(start, len(chain.entries)):
            st, t = chain.entries[j]
            tail = chain.exact and j >= chain.tail
            u = _prepare(st, t) if tail or head is not None else None
            try:
                finding = apply_post_accumulate(st, t, measure, chain.effect_mode(j))
            except Exception as e:
                on_failure(st, t, e)
                continue
            if u is not None:
                (undo if tail else head).append(u)  # type: ignore[union-attr]
            if finding is not None:
                on_finding(i, st, finding)
        if undo:
            self._undo[i] = undo
        else:
            self._undo.pop(i, None)
        if head is not None:
            self._head[i] = head
        grad = param.grad
        if grad is None:
            self._left.pop(i, None)
        else:
            self._left[i] = weakref.ref(grad)

    def _remeasure_head(self, i: int, param: Tensor) -> None:
        """A chain that is all head, at a later backward of a sampled step: each ``l2``/``noise``
        hook's norms before and after it, on the step's gradient as it stands now (its last
        measurement), found by taking the head back one application at a time on a copy."""
        recs, g = self._head.get(i), param.grad
        if not recs or g is None or g.layout != torch.strided or not any(u.kind != "scale" for u in recs):
            return
        with torch.no_grad():
            x = g.detach().clone()
            for u in reversed(recs):
                if u.kind == "scale" and u.value == 0.0:
                    return  # nothing before it can be recovered
                after = sq_norm(x)
                _take_back(u, x, restore=True)
                if u.kind != "scale":
                    prev = u.state.last.get(u.target.index)
                    u.state.last[u.target.index] = (prev[0] if prev else 0.0, sq_norm(x), after)
                    u.state.measured = True


def supported() -> bool:
    """Whether this torch answers the question :func:`_accumulates` asks (else no pre-accumulation hook)."""
    return _WILL_EXECUTE is not None


def _accumulates(param: Tensor) -> bool:
    """Whether this backward accumulates into ``param.grad`` (not ``torch.autograd.grad``, which
    returns the gradient without running ``AccumulateGrad``, and where torch refuses the question)."""
    assert _WILL_EXECUTE is not None
    try:
        return bool(_WILL_EXECUTE(torch.autograd.graph.get_gradient_edge(param).node))
    except RuntimeError:
        return False


def _prepare(st: HookState, t: ParamTarget) -> _Undo | None:
    """What taking back this tail application will need, read before it runs; None: it edits nothing."""
    g = t.grad()
    if g is None or g.layout != torch.strided:
        return None
    p, kind = st.spec.params, st.spec.kind
    if kind == "scale":
        return _Undo(st, t, kind, float(p["factor"]))
    if kind == "l2":
        return _Undo(st, t, kind, float(p["lam"]))
    if kind == "noise" and float(p["std"]) > 0:
        gen = st.generator(g.device, _stream(t))
        return _Undo(st, t, kind, float(p["std"]), gen, gen.get_state())
    return None


def _undo(u: _Undo) -> None:
    """Take one tail application back from the parameter's gradient (no_grad, in place)."""
    g = u.target.grad()
    if g is not None and g.layout == torch.strided:
        _take_back(u, g, restore=False)


def _take_back(u: _Undo, g: Tensor, restore: bool) -> None:
    """Take application ``u`` back from ``g`` in place. ``noise`` is drawn again from the state saved
    before its draw; the generator is then left at that state (the redo draws the same noise), or,
    with ``restore``, where it was."""
    if u.kind == "scale":
        if u.value == 0.0:
            g.zero_()  # nothing to divide back: the redo multiplies by zero anyway
        else:
            g.div_(u.value)
    elif u.kind == "l2":
        g.sub_(u.target.param.detach(), alpha=u.value)
    elif u.kind == "noise":
        assert u.gen is not None and u.gen_state is not None
        now = u.gen.get_state() if restore else u.gen_state
        u.gen.set_state(u.gen_state)
        g.sub_(torch.randn(g.shape, generator=u.gen, device=g.device, dtype=g.dtype), alpha=u.value)
        u.gen.set_state(now)


def _measure_scales(scales: list[HookState], g: Tensor) -> None:
    """The head ``scale`` hooks' effect on one contribution ``g``: before and after each one."""
    base = sq_norm(g.detach())
    nonzero = (g != 0).sum().float()
    prefix = 1.0
    for st in scales:
        f = float(st.spec.params["factor"])
        st.changed = st.changed + (nonzero if prefix != 0.0 else 0.0)
        st.before_sq = st.before_sq + base * (prefix * prefix)
        prefix *= f
        st.after_sq = st.after_sq + base * (prefix * prefix)
        st.measured = True
