"""Attaching never breaks a real training run: copies, pickles, compiled models, a second attach,
and user objects whose formatting fails (issue 11)."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import inspector
from inspector.owned import DETACHED_LOGGER
from tests.unit.conftest import batch, seed_mlp, train_step


def hooks_of(model: nn.Module) -> list:
    return [h for m in model.modules() for d in (m._forward_pre_hooks, m._forward_hooks) for h in d.values()]


def test_saving_copying_and_averaging_the_model_work_while_attached():
    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with inspector.attach(model, opt, every=1) as insp:
        insp.add_hook("module_log", "0")
        insp.add_hook("clip_value", "*", point="post_accumulate", threshold=1.0)
        x, y = batch()
        train_step(model, opt, x, y)
        buf = io.BytesIO()
        torch.save(model, buf)  # pytorch/examples word_language_model does this at every epoch's end
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        copies = [loaded, copy.deepcopy(model), torch.optim.swa_utils.AveragedModel(model).module]
        pickle.loads(pickle.dumps(opt))
        copy.deepcopy(opt)
        for c in copies:
            # no hook of ours in a copy: where ours stood, only the inert stand-in (owned.py)
            assert all(
                getattr(h, "__self__", None) is not None and h.__self__.name == DETACHED_LOGGER
                for h in hooks_of(c)
            ), hooks_of(c)
            assert not any(getattr(p, "_post_accumulate_grad_hooks", None) for p in c.parameters())
            # a copy trains like a plain model and does not touch the original's inspector
            ref = seed_mlp()
            ref.load_state_dict(c.state_dict())
            out, want = c(x), ref(x)
            assert torch.equal(out, want)
        step = insp.step
        train_step(model, opt, x, y)  # the original is still inspected
        assert insp.step == step + 1 and insp.latest()["step"] == step + 1
        assert insp.latest()["modules"]["0"]["grad_output_norm"] > 0


def test_attaching_twice_to_the_same_model_or_optimizer_is_refused():
    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    first = inspector.attach(model, opt)
    with pytest.raises(inspector.AttachError, match="already watched"):
        inspector.attach(model, opt)
    with pytest.raises(inspector.AttachError, match="this optimizer is already watched"):
        inspector.attach({"w": torch.zeros(2, requires_grad=True)}, opt)
    with pytest.raises(inspector.AttachError, match="a parameter of this model"):
        inspector.attach(dict(model.named_parameters()))
    assert inspector.attached(model) is first and inspector.attached(opt) is first
    inspector.attached(model).close()  # the way back after a re-run notebook cell lost the reference
    assert inspector.attached(model) is None
    second = inspector.attach(model, opt)  # once closed, attaching again is fine
    x, y = batch()
    train_step(model, opt, x, y)
    assert second.step == 1 and first.step == 0
    second.close()


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("even the message is broken")


class BadRepr:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


def test_a_hook_whose_exception_cannot_be_formatted_is_disabled_and_training_goes_on():
    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with inspector.attach(model, opt, every=1) as insp:

        def bad(name, param):
            raise Unprintable()

        h = insp.add_hook(bad, target="*")
        x, y = batch()
        train_step(model, opt, x, y)  # must not raise
        train_step(model, opt, x, y)
        errors = [e for e in insp.events() if e["kind"] == "hook_error"]
        assert len(errors) == 1 and errors[0]["hook_id"] == h.id
        assert errors[0]["message"].startswith("Unprintable: <its message could not be formatted")
        assert h.spec["enabled"] is False and insp.step == 2


def test_user_objects_whose_repr_fails_still_give_a_clear_hook_error():
    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with inspector.attach(model, opt) as insp:
        for call, loc in [
            (lambda: insp.add_hook("clip_value", "*", threshold=BadRepr()), ("params", "threshold")),
            (lambda: insp.add_hook("clip_value", BadRepr(), threshold=1.0), ("target",)),
            (lambda: insp.add_hook(BadRepr(), "*"), ("kind",)),
            (lambda: insp.match_targets(BadRepr()), ("glob",)),
        ]:
            with pytest.raises(inspector.HookError) as e:
                call()
            assert e.value.loc == loc and "BadRepr object: its repr() failed" in str(e.value)
        assert insp.hooks() == []


@pytest.mark.parametrize("how", ["torch.compile", "module.compile"])
def test_module_hooks_are_refused_for_a_compiled_model_before_anything_is_registered(how):
    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if how == "torch.compile":
        compiled = torch.compile(model, fullgraph=True, backend="eager")
    else:
        model.compile(
            backend="eager"
        )  # (fullgraph=True fails on a plain Sequential in torch 2.13, hooks or not)
        compiled = model
    with inspector.attach(compiled, opt) as insp:
        for call in (
            lambda: insp.add_hook("module_log", "0"),
            lambda: insp.add_hook("nan_guard", "*", point="module"),
            lambda: insp.import_hooks([{"kind": "module_log", "target": "0", "params": {}}]),
        ):
            with pytest.raises(inspector.HookError, match="compiled") as e:
                call()
            assert e.value.loc[-1] == "point"
        assert insp.hooks() == [] and not any(m._forward_hooks for m in model.modules())
        insp.add_hook("clip_norm", "*", max_norm=1.0)  # parameter points are fine
        x, y = batch()
        train_step(compiled, opt, x, y)
        assert insp.step == 1
