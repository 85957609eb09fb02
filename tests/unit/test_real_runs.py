"""Attaching never breaks a real training run: copies, pickles, compiled models, a second attach,
and user objects whose formatting fails."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import inspector
from inspector.hooks.owned import DETACHED_LOGGER
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
        h = insp.add_hook("clip_value", "*", threshold=1.0)
        for call, loc in [
            (lambda: insp.add_hook("clip_value", "*", threshold=BadRepr()), ("params", "threshold")),
            (lambda: insp.add_hook("clip_value", BadRepr(), threshold=1.0), ("target",)),
            (lambda: insp.add_hook(BadRepr(), "*"), ("kind",)),
            (lambda: insp.match_targets(BadRepr()), ("glob",)),
            (lambda: insp.record(loss=BadRepr()), ("scalars", "loss")),
            (lambda: insp.update_hook(h.id, enabled=BadRepr()), ("enabled",)),
            (lambda: insp.import_hooks([BadRepr()]), ("hooks", 0)),
        ]:
            with pytest.raises(inspector.HookError) as e:
                call()
            assert e.value.loc == loc and "BadRepr object: its repr() failed" in str(e.value)
        assert [x["id"] for x in insp.hooks()] == [h.id]


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


def test_a_loss_recorded_before_step_reaches_the_scalars_stream_for_every_step_sampled_or_not():
    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    got: dict[int, dict] = {}
    losses = {}
    with inspector.attach(model, opt, every=7) as insp:  # most steps unsampled
        insp.subscribe(
            lambda kind, p: got.__setitem__(p["step"], p) if kind == "scalars" else None, lossless=True
        )
        x, y = batch()
        for step in range(1, 51):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            insp.record(loss=loss)  # the Hugging Face Trainer callback's way: before step()
            loss.backward()
            opt.step()
            losses[step] = float(loss.detach())
        insp.finish()  # what wait() does first: the last steps' records go out while it serves
        assert insp.flush()
        assert sorted(got) == list(range(1, 51))
        assert all(got[s]["loss"] == pytest.approx(losses[s]) for s in got)
        assert {s["step"] for s in insp.snapshots()} == set(range(1, 51, 7))


def test_with_a_dict_of_tensors_a_record_after_step_lands_on_the_step_just_completed():
    w = torch.zeros(3, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    got = []
    with inspector.attach({"w": w}, opt, every=1) as insp:
        insp.subscribe(lambda kind, p: got.append(p) if kind == "scalars" else None)
        for step in (1, 2):
            opt.zero_grad()
            loss = ((w - 1.0) ** 2).sum()
            loss.backward()
            insp.record(during=float(step))  # after backward, before step(): this step's
            opt.step()
            insp.record(after=float(step))  # after step(): still this step's, not the next
        insp.finish()
        assert insp.flush()
        snaps = {s["step"]: s for s in insp.snapshots()}
    assert snaps[1]["scalars"] == {"during": 1.0, "after": 1.0}
    assert snaps[2]["scalars"] == {"during": 2.0, "after": 2.0}
    assert got[-1] == {"step": 2, "loss": None, "scalars": {"during": 2.0, "after": 2.0}}


def test_applied_step_follows_every_applied_change_a_move_and_an_automatic_disable_included():
    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = batch()
    with inspector.attach(model, opt, every=1) as insp:
        a = insp.add_hook("scale", "*", factor=1.0)
        b = insp.add_hook("scale", "*", factor=2.0)
        train_step(model, opt, x, y)
        train_step(model, opt, x, y)
        insp.update_hook(b.id, position=0)  # from the training thread: applies from step 3
        train_step(model, opt, x, y)
        assert {h["id"]: (h["position"], h["applied_step"]) for h in insp.hooks()} == {
            b.id: (0, 3),
            a.id: (1, 3),
        }
        calls = []

        def flaky(name, param):
            calls.append(insp.step)
            if len(calls) > len(insp.params):  # fine during step 4 (once per parameter), fails in step 5
                raise RuntimeError("flaky")

        c = insp.add_hook(flaky, "*")
        train_step(model, opt, x, y)
        train_step(model, opt, x, y)
        train_step(model, opt, x, y)
        spec = c.spec
        assert spec["enabled"] is False and spec["applied_step"] == 5
        disable = [e for e in insp.events() if e["kind"] == "hook_applied" and e["action"] == "disable"]
        assert disable[-1]["applied_step"] == 5


def test_an_edit_from_another_thread_during_the_boundary_does_not_leak_into_that_steps_snapshot(monkeypatch):
    import threading

    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = batch()
    with inspector.attach(model, opt, every=1) as insp:
        h = insp.add_hook("scale", "*", factor=2.0)
        train_step(model, opt, x, y)
        version = insp.config_version
        real = insp._cadence.observe

        def racing(*args):  # the server's thread removes the hook while step 2's boundary runs
            t = threading.Thread(target=insp.remove_hook, args=(h.id,))
            t.start()
            t.join(10)
            assert insp.config_version == version + 1  # applied at once: no step is under way
            return real(*args)

        monkeypatch.setattr(insp._cadence, "observe", racing)
        train_step(model, opt, x, y)
        snap = insp.latest()
        assert snap["step"] == 2 and snap["config_version"] == version  # step 2 ran with the hook
        assert snap["hook_effects"][h.id]["norm_ratio"] == pytest.approx(2.0)


def test_mark_step_before_the_manual_update_makes_the_update_read_the_hooks_edits():
    torch.manual_seed(0)
    w = torch.randn(5, requires_grad=True)
    ref = w.detach().clone()
    x = torch.randn(5) * 100  # large gradients: the clip matters
    with inspector.attach({"w": w}, every=1) as insp:
        insp.add_hook("clip_value", "w", threshold=0.5)
        loss = (w * x).sum()
        loss.backward()
        insp.mark_step()  # where the docstring and docs/your-loop.md put it: before the update
        with torch.no_grad():
            w -= 0.1 * w.grad
        assert torch.allclose(w.detach(), ref - 0.1 * x.clamp(-0.5, 0.5))
        assert insp.latest()["update_ratio"] == [None]  # the update comes after the boundary
    doc = inspector.Inspector.mark_step.__doc__
    assert "**before** your own update" in doc


def test_serve_takes_the_next_free_port_when_the_default_is_taken_but_an_explicit_port_raises(
    monkeypatch, tmp_path, capfd
):
    import socket

    from tests.support import free_port

    busy = socket.socket()
    busy.bind(("127.0.0.1", free_port()))
    busy.listen()
    taken = busy.getsockname()[1]
    monkeypatch.setattr("inspector.dashboard._DEFAULT_PORT", taken)  # a second run on the same box
    model = seed_mlp()
    try:
        with inspector.attach(model) as insp:
            with pytest.raises(OSError, match="already in use"):
                insp.serve(port=taken, db=False)
            url = insp.serve(db=False)
            port = int(url.split(":")[2].split("/")[0])
            assert taken < port <= taken + 50
            assert f"port {taken} is in use; serving on {url}" in capfd.readouterr().err
    finally:
        busy.close()


def test_wait_says_where_it_serves_warns_when_nothing_is_and_returns_only_once_close_has_finished(capfd):
    import threading

    from tests.support import wait_until

    model = seed_mlp()
    insp = inspector.attach(model)
    url = insp.serve(port=0, db=False)
    order: list[str] = []
    real_stop = insp._dashboard.server.stop
    gate = threading.Event()

    def slow_stop():  # the closing thread is still stopping the server when wait() notices the close
        order.append("stop begins")
        gate.wait(10)
        real_stop()
        order.append("stop ends")

    insp._dashboard.server.stop = slow_stop
    closer = threading.Thread(
        target=lambda: (wait_until(lambda: insp.state["state"] == "finished", what="wait()"), insp.close())
    )
    closer.start()
    waiter = threading.Thread(target=lambda: (insp.wait(), order.append("wait returns")))
    waiter.start()
    wait_until(lambda: order == ["stop begins"], what="the close under way")
    assert waiter.is_alive()  # held while the server is still stopping
    gate.set()
    waiter.join(20)
    closer.join(20)
    assert order == ["stop begins", "stop ends", "wait returns"]
    assert f"the dashboard stays up at {url} (Ctrl-C to stop)" in capfd.readouterr().err

    other = inspector.attach(seed_mlp())
    threading.Thread(
        target=lambda: (wait_until(lambda: other.state["state"] == "finished", what="wait()"), other.close())
    ).start()
    with pytest.warns(RuntimeWarning, match="nothing is served"):
        other.wait()


def test_a_failing_hook_of_ours_never_reaches_the_users_forward(monkeypatch):
    import inspector.hooks.owned as owned

    monkeypatch.setattr(owned, "_warned", [])
    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with inspector.attach(model, opt, every=1) as insp:

        def broken(*args):
            raise TypeError("a bug of ours")

        monkeypatch.setattr(insp._lifecycle, "on_forward_pre", broken)
        hook = next(iter(model._forward_pre_hooks.values()))
        hook.fn = broken  # what the root forward pre-hook now runs
        x, y = batch()
        with pytest.warns(RuntimeWarning, match="one of its hooks failed and was skipped"):
            train_step(model, opt, x, y)  # the forward goes on
        train_step(model, opt, x, y)  # reported once
        assert insp.step == 2
