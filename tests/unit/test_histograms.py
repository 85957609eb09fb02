"""The fast histogram (``stats.histograms``): the exact one's counts, in bounded memory for every dtype."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from inspector.stats import tensor_stats as stats


class LargestMade(TorchDispatchMode):
    """The most elements of any tensor an op makes new memory for while active (a view, a
    ``detach`` or an ``out=`` argument makes none)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        seen = {
            a.untyped_storage().data_ptr()
            for a in pytree.tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor)
        }
        out = func(*args, **kwargs)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.complex64]
)
def test_a_histogram_counts_as_the_exact_one_and_converts_a_chunk_at_a_time(dtype):
    """A gradient that is not float32 was once copied whole to float32 for its histogram (a bf16
    model's largest gradient took twice its own memory again); now each chunk is converted into
    the scratch, so nothing larger than a chunk is made, and the counts are the exact path's."""
    n = 3 * stats.HIST_CHUNK + 17
    gen = torch.Generator().manual_seed(0)
    raw = torch.randn(n, generator=gen).to(dtype)
    if dtype.is_complex:
        raw = raw + 1j * torch.randn(n, generator=gen).to(dtype)
    final = raw * 0.5  # a hook's edit: the final histogram shares the edges
    with LargestMade() as made:
        fast = stats.histograms(raw, final, 64)
    exact = stats.exact_histograms(raw, final, 64)
    assert fast.tolist() == exact.tolist()
    assert fast[2:66].sum() == fast[66:].sum() == n
    assert made.largest <= stats.HIST_CHUNK


def _edited_model(monkeypatch):  # type: ignore[no-untyped-def]
    """Three 64x64 parameters a hook edits in place, and one it leaves; a copy budget of one of them."""
    from torch import nn

    from inspector.stats import histsel

    monkeypatch.setattr(histsel, "COPY_FLOOR", 0, raising=False)  # (the floor lets a small model copy all)
    params = {f"w{i}": nn.Parameter(torch.randn(64, 64)) for i in range(3)}
    params["free"] = nn.Parameter(torch.randn(64, 64))
    return params


def _taken(params, opt, step, steps: int) -> list[list[str]]:  # type: ignore[no-untyped-def]
    """Which parameters each step's snapshot has histograms of, every histogram asked for, with
    ``scale`` editing the w* gradients in place; each edited one's raw and final count it all."""
    import inspector

    taken = []
    with inspector.attach(params, opt, every=1, hist_every=1) as insp:
        insp.set_hist_params(list(params))
        insp.add_hook("scale", target="w*", factor=0.5)
        for _ in range(steps):
            step()
            h = insp.latest()["hist"]
            taken.append(sorted(h))
            for name in h:  # an edited one's histograms: raw before the hook, final after it
                if name != "free":
                    assert sum(h[name]["raw"]) == sum(h[name]["final"]) == 64 * 64
    return taken


def test_raw_copies_for_the_histograms_of_edited_gradients_stay_within_the_largest_parameter(monkeypatch):
    """A pre_step hook that edits gradients in place makes each of their raw histograms need a copy
    of the raw gradient until the final one is taken: up to HIST_CAP copies at once (a clip on a
    model's eight largest matrices held eight of them). The copies now stay within the largest
    parameter's bytes; the other edited parameters get their histograms on the next sampled
    steps, in turn, and a parameter no hook edits gets its own every time."""
    params = _edited_model(monkeypatch)
    opt = torch.optim.SGD(params.values(), lr=0.01)

    def step() -> None:
        opt.zero_grad()
        sum((p * p).sum() for p in params.values()).backward()
        opt.step()

    assert _taken(params, opt, step, 6) == [["free", "w0"], ["free", "w1"], ["free", "w2"]] * 2


def test_a_parameter_without_a_gradient_takes_none_of_the_copy_budget(monkeypatch):
    """Nothing is copied for a parameter the step left without a gradient, so it leaves the budget
    to the others (it once took a turn of its own, and w1 and w2 had histograms every other step)."""
    params = _edited_model(monkeypatch)
    opt = torch.optim.SGD(params.values(), lr=0.01)

    def step() -> None:
        opt.zero_grad()
        sum((p * p).sum() for n, p in params.items() if n != "w0").backward()  # w0 unused
        opt.step()

    assert _taken(params, opt, step, 4) == [["free", "w1"], ["free", "w2"]] * 2


def test_a_closure_evaluated_many_times_takes_the_same_histograms_each_time(monkeypatch):
    """An optimizer that evaluates its closure several times a step (LBFGS) runs the pre_step work
    after each: the histograms are chosen once per step, so the copy budget's turns go on in order
    (the second evaluation once took the turn put off by the first, and w0's was lost)."""
    params = _edited_model(monkeypatch)
    opt = torch.optim.LBFGS(params.values(), lr=0.01, max_iter=3)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = sum((p * p).sum() for p in params.values())
        loss.backward()
        return loss

    assert _taken(params, opt, lambda: opt.step(closure), 3) == [
        ["free", "w0"],
        ["free", "w1"],
        ["free", "w2"],
    ]


def test_a_transposed_gradient_is_binned_in_memory_order_without_a_copy():
    """A gradient that is dense but not contiguous (a transposed weight's, a channels_last one's) is
    read in memory order: ``reshape(-1)`` copied the whole of it first."""
    gen = torch.Generator().manual_seed(0)
    for g in (
        torch.randn(1024, 1030, generator=gen).t(),
        torch.randn(8, 3, 200, 200, generator=gen).to(memory_format=torch.channels_last),
    ):
        assert not g.is_contiguous()
        with LargestMade() as made:
            fast = stats.histograms(g, None, 64)
        assert fast.tolist() == stats.exact_histograms(g, None, 64).tolist()
        assert made.largest <= stats.HIST_CHUNK


def test_after_a_rewind_the_step_takes_the_histograms_chosen_now(mlp):
    """The histograms are chosen once per step (for a closure's evaluations); a rewind to the step
    before the last one runs that step number again, and it takes the parameters chosen now, not
    those the abandoned step took."""
    import inspector
    from tests.unit.conftest import batch, train_step

    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    with inspector.attach(mlp, opt, every=1, hist_every=1) as insp:
        first, second = insp.params[0], insp.params[2]
        insp.set_hist_params([first])
        train_step(mlp, opt, *batch(seed=0))
        cp = insp.checkpoint()  # at step 1, from the training thread between steps: at once
        train_step(mlp, opt, *batch(seed=1))
        assert list(insp.latest()["hist"]) == [first]
        assert insp.rewind(cp)["done"]
        insp.set_hist_params([second])
        train_step(mlp, opt, *batch(seed=2))
        assert insp.latest()["step"] == 2
        assert list(insp.latest()["hist"]) == [second]
