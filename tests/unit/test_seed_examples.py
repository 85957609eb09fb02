"""The source material's hook examples, run literally, each beside the inspector hook that does what was meant.

gradient-inspector exists because the two source documents misuse PyTorch's gradient hooks:

- ``/work/shared/seeds/000_*.txt`` (Chinese) registers the deprecated ``Module.register_backward_hook``
  on ``model[0]`` of ``nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 1))`` for five
  uses: 1. clip (``clip_grad_norm_`` of the module's parameters inside the hook), 2. log (print
  ``grad_output[0].norm()``), 3. scale (``return tuple(g * 0.1 for g in grad_input)``), 4. L2
  (``param.grad += 0.01 * param.data``), 5. a NaN check on ``grad_output``; every one ends with the same
  100-step SGD loop (``optimizer.step()`` then ``optimizer.zero_grad()``).
- ``/work/shared/seeds/003_*.txt`` (Russian) documents ``Tensor.register_post_accumulate_grad_hook``
  as if the hook received the gradient (it receives the *parameter*): print, ``clamp_(-2, 2)``,
  mean/std statistics, and ``handle.remove()``.

For every example there are two tests, named after it ("000 #1 clip", ..., "003 print", ...):

- ``..._literal``: the source's code, verbatim, on the installed torch, asserting what it really
  does, including the warnings torch gives (pytest runs with ``filterwarnings = error``, so every
  warning here is caught and asserted) and what it prints (``capsys``). Where the source states a
  result, the test also asserts whether the claim holds.
- ``..._inspector``: the inspector hook that does what the example meant, asserted against a
  plain-torch reference computed on a deep copy of the same model with the same batch.

What the literal code does on torch 2.13 (the reasons the product's hook points are what they are):

- 000: the non-full module backward hook fires on the first layer's ``AddmmBackward`` node, before the
  layer's parameters accumulate their gradients, so ``module.parameters()`` have ``grad is None``
  there (the loop's ``zero_grad()`` sets them to None): #1 clip and #4 L2 do nothing at all, on any
  step. #3 scale raises ``TypeError`` (``grad_input`` holds ``None`` for the input). #2 log and #5 NaN
  check work, but only on the one module, through a hook torch warns about on every forward
  (``FutureWarning``), and the replacement ``register_full_backward_hook`` raises when an in-place op
  (``ReLU(inplace=True)``) follows the layer.
- 003: the post-accumulate hook's argument is the parameter: "print" prints the weights, "clamp"
  clamps the weights and leaves the gradient alone, "stats" reports the weights' mean/std (and the
  document's printed numbers match neither the weights nor the gradient).
"""

from __future__ import annotations

import contextlib
import copy
import math
import re
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import inspector

# torch 2.13 says this once per forward of a module that has a non-full backward hook
NON_FULL_HOOK = re.compile(
    r"Using a non-full backward hook when the forward contains multiple autograd Nodes is deprecated"
)
STEPS = 100  # the source's loop length


# ----------------------------------------------------------------------------- helpers
def seed_mlp(inplace: bool = False) -> nn.Sequential:
    """The source's model, with fixed weights."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 10), nn.ReLU(inplace=inplace), nn.Linear(10, 1))


def one_batch(seed: int = 1, target_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(32, 10, generator=g), target_scale * torch.randn(32, 1, generator=g)


def source_training_loop(model: nn.Module, steps: int = STEPS) -> None:
    """The loop every 000 example ends with, verbatim; its data come from the global RNG, seeded here."""
    torch.manual_seed(1)
    # --- verbatim from 000 ---
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    for _ in range(steps):
        inputs = torch.randn(32, 10)
        targets = torch.randn(32, 1)
        outputs = model(inputs)
        loss = loss_fn(outputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def first_source_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of the first iteration of ``source_training_loop``."""
    torch.manual_seed(1)
    return torch.randn(32, 10), torch.randn(32, 1)


@contextlib.contextmanager
def non_full_hook_warnings(forwards: int) -> Iterator[None]:
    """Assert that the body gives exactly one FutureWarning per forward, and no other warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    got = [(w.category, bool(NON_FULL_HOOK.search(str(w.message)))) for w in caught]
    assert got == [(FutureWarning, True)] * forwards, [f"{w.category.__name__}: {w.message}" for w in caught]


def register_deprecated(module: nn.Module, hook) -> torch.utils.hooks.RemovableHandle:  # noqa: ANN001
    """``module.register_backward_hook(hook)``: registering gives no warning on torch 2.13 (forwards do)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = module.register_backward_hook(hook)
    assert caught == []
    return handle


def mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def reference_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Plain-torch gradients of a deep copy of ``model`` on one batch (no hooks of any kind)."""
    ref = copy.deepcopy(model)
    mse(ref, x, y).backward()
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def capture_step_grads(opt: torch.optim.Optimizer, model: nn.Module) -> dict[str, torch.Tensor | None]:
    """The gradients the optimizer is about to use: a step pre-hook registered after the inspector's."""
    names = {id(p): n for n, p in model.named_parameters()}
    seen: dict[str, torch.Tensor | None] = {}

    def hook(o, args, kwargs):  # noqa: ANN001
        for g in o.param_groups:
            for p in g["params"]:
                seen[names[id(p)]] = None if p.grad is None else p.grad.detach().clone()

    opt.register_step_pre_hook(hook)
    return seen


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ============================================================================= 003 (Russian): post-accumulate hooks
def test_003_print_literal(capsys):
    """003 print: the hook receives the PARAMETER, so the "gradient" printed is the tensor [1, 2, 3]."""

    # --- verbatim from 003 ---
    def print_grad_hook(grad):
        print(f"Gradient: {grad}")

    t = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    hook_handle = t.register_post_accumulate_grad_hook(print_grad_hook)

    loss = (t**2).sum()
    loss.backward()
    print(t.grad)
    # --- end ---
    out = capsys.readouterr().out
    assert out == "Gradient: tensor([1., 2., 3.], requires_grad=True)\ntensor([2., 4., 6.])\n"
    assert "Gradient: tensor([2., 4., 6.])" not in out  # what the document claims it prints
    hook_handle.remove()


def test_003_print_inspector():
    """003 print, as meant: a ``python`` hook at ``post_accumulate`` reads ``param.grad`` == [2, 4, 6]."""
    t = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    seen = []
    with inspector.attach({"t": t}, every=1) as insp:
        insp.add_hook(
            lambda name, param: seen.append((name, param, param.grad.clone())),
            target="t",
            point="post_accumulate",
        )
        (t**2).sum().backward()
        insp.mark_step()
        snap = insp.latest()
    assert len(seen) == 1
    name, param, grad = seen[0]
    assert name == "t" and param is t
    assert torch.equal(grad, torch.tensor([2.0, 4.0, 6.0]))
    assert snap["grad_norm"][0] == pytest.approx(math.sqrt(4 + 16 + 36))


def test_003_clamp_literal():
    """003 clamp: ``grad.clamp_(-2, 2)`` clamps the WEIGHTS (the hook's argument) and leaves the gradient."""

    # --- verbatim from 003 ---
    def clip_grad_hook(grad):
        # Ограничиваем значения градиента диапазоном [-2, 2]
        grad.clamp_(-2, 2)

    t = torch.tensor([-5.0, 0.0, 5.0], requires_grad=True)
    hook_handle = t.register_post_accumulate_grad_hook(clip_grad_hook)

    loss = (t**2).sum()
    loss.backward()
    # --- end ---
    assert torch.equal(t.grad, torch.tensor([-10.0, 0.0, 10.0]))  # the document claims [-2, 0, 2]
    assert torch.equal(t.detach(), torch.tensor([-2.0, 0.0, 2.0]))  # the parameter was overwritten
    hook_handle.remove()


def test_003_clamp_inspector():
    """003 clamp, as meant: ``clip_value`` (threshold 2) at ``post_accumulate`` clamps the gradient only."""
    t = torch.tensor([-5.0, 0.0, 5.0], requires_grad=True)
    with inspector.attach({"t": t}, every=1) as insp:
        h = insp.add_hook("clip_value", target="t", point="post_accumulate", threshold=2)
        (t**2).sum().backward()
        assert torch.equal(t.grad, torch.tensor([-2.0, 0.0, 2.0]))  # already during the backward
        insp.mark_step()
        snap = insp.latest()
    assert torch.equal(t.grad, torch.tensor([-2.0, 0.0, 2.0]))
    assert torch.equal(t.detach(), torch.tensor([-5.0, 0.0, 5.0]))
    assert snap["grad_absmax"][0] == pytest.approx(2.0)
    assert snap["hook_effects"][h.id]["changed"] == 2


def test_003_stats_literal(capsys):
    """003 stats: the literal hook prints the WEIGHTS' mean/std; the document's numbers are neither."""

    # --- verbatim from 003 ---
    def grad_stats_hook(grad):
        grad_mean = grad.mean().item()
        grad_std = grad.std().item()
        print(f"Grad stats - mean: {grad_mean:.4f}, std: {grad_std:.4f}")

    torch.manual_seed(0)
    t = torch.randn(10, requires_grad=True)
    hook_handle = t.register_post_accumulate_grad_hook(grad_stats_hook)

    loss = (t**3).sum()
    loss.backward()
    # --- end ---
    hook_handle.remove()
    out = capsys.readouterr().out
    w = t.detach()
    assert out == f"Grad stats - mean: {w.mean().item():.4f}, std: {w.std().item():.4f}\n"
    assert out == "Grad stats - mean: -0.2727, std: 1.1286\n"
    claimed = "Grad stats - mean: 2.1757, std: 2.3448\n"  # what the document says it prints
    real = f"Grad stats - mean: {t.grad.mean().item():.4f}, std: {t.grad.std().item():.4f}\n"
    assert real == "Grad stats - mean: 3.6625, std: 4.4051\n"  # the gradient 3 t^2
    assert claimed not in (out, real)


def test_003_stats_inspector():
    """003 stats, as meant: the snapshot's ``grad_mean``/``grad_std`` are the gradient's (3 t^2), unbiased std."""
    torch.manual_seed(0)
    t = torch.randn(10, requires_grad=True)
    with inspector.attach({"t": t}, every=1) as insp:
        (t**3).sum().backward()
        insp.mark_step()
        snap = insp.latest()
    expected = 3 * t.detach() ** 2
    assert torch.equal(t.grad, expected)
    assert snap["step"] == 1
    assert snap["grad_mean"][0] == pytest.approx(3.6625, abs=1e-4)
    assert snap["grad_std"][0] == pytest.approx(4.4051, abs=1e-4)
    assert snap["grad_mean"][0] == pytest.approx(expected.mean().item(), rel=1e-6)
    assert snap["grad_std"][0] == pytest.approx(expected.std(unbiased=True).item(), rel=1e-6)


def test_003_remove_literal(capsys):
    """003 remove: after ``handle.remove()`` the hook no longer runs (this example is right)."""

    # --- verbatim from 003 ---
    def my_hook(grad):
        print("Hook called!")

    t = torch.tensor([1.0, 2.0], requires_grad=True)
    handle = t.register_post_accumulate_grad_hook(my_hook)

    # Первый backward вызовет хук
    loss1 = (t**2).sum()
    loss1.backward()

    # Удаляем хук
    handle.remove()

    # Второй backward не вызовет хук
    t.grad.zero_()  # обнуляем градиент для повторного расчёта
    loss2 = (t**3).sum()
    loss2.backward()
    # --- end ---
    assert capsys.readouterr().out == "Hook called!\n"
    assert torch.equal(t.grad, torch.tensor([3.0, 12.0]))


def test_003_remove_inspector():
    """003 remove, as meant: ``h.remove()`` from the training thread applies at once; the hook stops running."""
    t = torch.tensor([1.0, 2.0], requires_grad=True)
    calls = []
    with inspector.attach({"t": t}, every=1) as insp:
        h = insp.add_hook(
            lambda name, param: calls.append(param.grad.clone()), target="t", point="post_accumulate"
        )
        (t**2).sum().backward()
        insp.mark_step()
        h.remove()
        assert insp.hooks() == []
        removed = [e for e in insp.events() if e["kind"] == "hook_applied" and e["action"] == "remove"]
        assert len(removed) == 1 and removed[0]["hook_id"] == h.id and removed[0]["applied_step"] == 2
        t.grad.zero_()
        (t**3).sum().backward()
        insp.mark_step()
        assert insp.step == 2
    assert len(calls) == 1 and torch.equal(calls[0], torch.tensor([2.0, 4.0]))
    assert torch.equal(t.grad, torch.tensor([3.0, 12.0]))


# ============================================================================= 000 (Chinese): module backward hooks
def test_000_1_clip_literal():
    """000 #1 clip: inside the first layer's backward hook its parameters have no gradient yet, on every
    step (``zero_grad()`` sets them to None), so ``clip_grad_norm_`` clips nothing: training is exactly
    the unhooked training."""

    # --- verbatim from 000 #1 ---
    def clip_gradient(module, grad_input, grad_output):
        max_norm = 1.0
        torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)

    # --- end ---
    seen = []

    def spy(module, grad_input, grad_output):
        seen.append([p.grad for p in module.parameters()])
        return clip_gradient(module, grad_input, grad_output)

    model = seed_mlp()
    register_deprecated(model[0], spy)
    with non_full_hook_warnings(STEPS):
        source_training_loop(model)
    assert len(seen) == STEPS
    assert all(g is None for grads in seen for g in grads)

    plain = seed_mlp()
    source_training_loop(plain)
    for (n, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q), n  # bit for bit: the literal clip never changed a gradient


@pytest.mark.parametrize(("target", "which"), [("*", "model"), ("0.*", "model[0]")])
def test_000_1_clip_inspector(target, which):
    """000 #1 clip, as meant: ``clip_norm`` (global, max_norm 1.0, pre_step) equals ``clip_grad_norm_`` on
    the reference gradients: the whole model ("*"), or the first layer as the example wrote ("0.*")."""
    model = seed_mlp()
    x, y = one_batch(target_scale=30.0)  # large targets: the gradient norm is well above 1
    ref = copy.deepcopy(model)
    mse(ref, x, y).backward()
    clipped = ref if which == "model" else ref[0]
    total = torch.nn.utils.clip_grad_norm_(clipped.parameters(), 1.0)
    assert total > 1.0
    torch.optim.SGD(ref.parameters(), lr=0.01).step()

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with inspector.attach(model, opt, every=1) as insp:
        insp.add_hook("clip_norm", target=target, max_norm=1.0)
        mse(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        snap = insp.latest()
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert close(p, q), n
    if which == "model":
        assert snap["total_norm_raw"] == pytest.approx(total.item(), rel=1e-5)
        assert snap["total_norm"] == pytest.approx(1.0, rel=1e-5)


def test_000_2_log_literal(capsys):
    """000 #2 log: prints the norm of the gradient w.r.t. model[0]'s output (correct, through the
    deprecated hook: one FutureWarning per forward)."""

    # --- verbatim from 000 #2 ---
    def log_gradient(module, grad_input, grad_output):
        print(f"Gradient for {module.__class__.__name__}: {grad_output[0].norm().item()}")

    # --- end ---
    model = seed_mlp()
    ref = copy.deepcopy(model)
    register_deprecated(model[0], log_gradient)
    with non_full_hook_warnings(STEPS):
        source_training_loop(model)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == STEPS
    assert all(re.fullmatch(r"Gradient for Linear: \d+\.\d+(e-?\d+)?", line) for line in lines)

    x, y = first_source_batch()
    h0 = ref[0](x)
    h0.retain_grad()
    nn.functional.mse_loss(ref[2](ref[1](h0)), y).backward()
    assert float(lines[0].rpartition(": ")[2]) == pytest.approx(h0.grad.norm().item(), rel=1e-6)


def test_000_2_log_full_backward_hook_raises_with_inplace_relu(capsys):
    """000 #2 log with ``ReLU(inplace=True)``: the deprecated hook still logs; its replacement,
    ``register_full_backward_hook``, raises inside the user's forward."""

    def log_gradient(module, grad_input, grad_output):
        print(f"Gradient for {module.__class__.__name__}: {grad_output[0].norm().item()}")

    x, y = one_batch()
    model = seed_mlp(inplace=True)
    model[0].register_full_backward_hook(log_gradient)
    with pytest.raises(RuntimeError, match="BackwardHookFunction is a view and is being modified inplace"):
        model(x)

    model = seed_mlp(inplace=True)
    register_deprecated(model[0], log_gradient)
    with non_full_hook_warnings(1):
        mse(model, x, y).backward()
    ref = seed_mlp()
    h0 = ref[0](x)
    h0.retain_grad()
    nn.functional.mse_loss(ref[2](ref[1](h0)), y).backward()
    printed = capsys.readouterr().out
    assert printed.startswith("Gradient for Linear: ")
    assert float(printed.rpartition(": ")[2]) == pytest.approx(h0.grad.norm().item(), rel=1e-6)


@pytest.mark.parametrize("inplace", [False, True], ids=["relu", "relu_inplace"])
def test_000_2_log_inspector(inplace):
    """000 #2 log, as meant: ``module_log`` on module "0" reports ``modules["0"]["grad_output_norm"]``, the
    norm of the gradient w.r.t. model[0]'s output, also when ``ReLU(inplace=True)`` follows it."""
    x, y = one_batch()
    ref = seed_mlp()
    h0 = ref[0](x)
    h0.retain_grad()
    nn.functional.mse_loss(ref[2](ref[1](h0)), y).backward()

    model = seed_mlp(inplace=inplace)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with inspector.attach(model, opt, every=1) as insp:
        insp.add_hook("module_log", target="0", point="module")
        mse(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        snap = insp.latest()
    assert snap["step"] == 1
    assert snap["modules"]["0"]["grad_output_norm"] == pytest.approx(h0.grad.norm().item(), rel=1e-6)


def test_000_3_scale_literal():
    """000 #3 scale: the literal hook raises TypeError in the backward: for Linear the deprecated hook's
    ``grad_input`` is (grad bias, None for the input, grad of weight.T), and ``None * 0.1`` fails."""

    # --- verbatim from 000 #3 ---
    def modify_gradient(module, grad_input, grad_output):
        # 将梯度乘以一个因子
        factor = 0.1
        return tuple(g * factor for g in grad_input)

    # --- end ---
    model = seed_mlp()
    register_deprecated(model[0], modify_gradient)
    x, y = first_source_batch()
    with non_full_hook_warnings(1):
        loss = mse(model, x, y)
    with pytest.raises(
        TypeError, match=re.escape("unsupported operand type(s) for *: 'NoneType' and 'float'")
    ):
        loss.backward()
    assert model[0].weight.grad is None and model[0].bias.grad is None
    assert model[2].weight.grad is not None and model[2].bias.grad is not None  # accumulated before the raise


def test_000_3_scale_none_safe_version():
    """000 #3 scale, made None-safe: it does scale model[0].weight.grad and .bias.grad by 0.1 (the hook sees
    them as grad_input[0] and grad_input[2] = weight grad transposed), and nothing else."""
    x, y = one_batch()
    model = seed_mlp()
    ref = reference_grads(model, x, y)
    seen = []

    def modify_gradient(module, grad_input, grad_output):
        seen.append(grad_input)
        factor = 0.1
        return tuple(g * factor if g is not None else None for g in grad_input)

    register_deprecated(model[0], modify_gradient)
    with non_full_hook_warnings(1):
        mse(model, x, y).backward()
    (gi,) = seen
    assert len(gi) == 3 and gi[1] is None
    assert close(gi[0], ref["0.bias"]) and close(gi[2], ref["0.weight"].T)
    for n, p in model.named_parameters():
        assert close(p.grad, 0.1 * ref[n] if n.startswith("0.") else ref[n]), n


def test_000_3_scale_inspector():
    """000 #3 scale, as meant: ``scale`` (factor 0.1) on "0.*" gives exactly 0.1 x the reference gradients
    of 0.weight and 0.bias; 2.* untouched."""
    x, y = one_batch()
    model = seed_mlp()
    ref = reference_grads(model, x, y)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with inspector.attach(model, opt, every=1) as insp:
        insp.add_hook("scale", target="0.*", factor=0.1)
        got = capture_step_grads(opt, model)
        mse(model, x, y).backward()
        opt.step()
    assert set(got) == set(ref)
    for n, g in got.items():
        assert close(g, 0.1 * ref[n] if n.startswith("0.") else ref[n]), n


def test_000_4_l2_literal():
    """000 #4 L2: ``if param.grad is not None`` is never true inside the first layer's backward hook
    (no gradient yet; the loop's zero_grad() sets it to None), so nothing is ever added."""

    # --- verbatim from 000 #4 ---
    def gradient_regularization(module, grad_input, grad_output):
        # 添加L2正则化
        l2_lambda = 0.01
        for param in module.parameters():
            if param.grad is not None:
                param.grad += l2_lambda * param.data

    # --- end ---
    seen = []

    def spy(module, grad_input, grad_output):
        seen.append([p.grad for p in module.parameters()])
        return gradient_regularization(module, grad_input, grad_output)

    model = seed_mlp()
    register_deprecated(model[0], spy)
    with non_full_hook_warnings(STEPS):
        source_training_loop(model)
    assert len(seen) == STEPS
    assert all(g is None for grads in seen for g in grads)

    plain = seed_mlp()
    source_training_loop(plain)
    for (n, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q), n  # bit for bit: no L2 was ever applied


def test_000_4_l2_literal_only_works_by_accident_without_set_to_none():
    """000 #4 L2 with ``zero_grad(set_to_none=False)`` instead of the loop's default: the first backward
    still adds nothing (no gradient yet); from the second on the hook adds 0.01 * param to the zeroed
    gradient before this backward's gradient accumulates into it, so the result is what was meant."""

    def gradient_regularization(module, grad_input, grad_output):
        l2_lambda = 0.01
        for param in module.parameters():
            if param.grad is not None:
                param.grad += l2_lambda * param.data

    x, y = one_batch()
    model = seed_mlp()
    register_deprecated(model[0], gradient_regularization)
    for step in (1, 2):
        ref = reference_grads(seed_mlp(), x, y)  # the weights never move here: no optimizer step
        model.zero_grad(set_to_none=False)
        with non_full_hook_warnings(1):
            mse(model, x, y).backward()
        for n, p in model.named_parameters():
            added = step == 2 and n.startswith("0.")
            assert close(p.grad, ref[n] + 0.01 * p.detach() if added else ref[n]), (step, n)


@pytest.mark.parametrize("target", ["*", "0.*"])
def test_000_4_l2_inspector(target):
    """000 #4 L2, as meant: ``l2`` (lam 0.01) makes the gradient the optimizer sees reference + 0.01 * param."""
    x, y = one_batch()
    model = seed_mlp()
    ref = reference_grads(model, x, y)
    before = params_of(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with inspector.attach(model, opt, every=1) as insp:
        insp.add_hook("l2", target=target, lam=0.01)
        got = capture_step_grads(opt, model)
        mse(model, x, y).backward()
        opt.step()
    for n, g in got.items():
        hit = target == "*" or n.startswith("0.")
        assert close(g, ref[n] + 0.01 * before[n] if hit else ref[n]), n


def nan_in_2_weight_path(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A loss whose only non-finite gradient is 2.weight's (a NaN term that touches only that parameter)."""
    bad = torch.full((1, 10), math.nan)
    return mse(model, x, y) + (model[2].weight * bad).sum()


def test_000_5_nan_check_literal(capsys):
    """000 #5 NaN check: it works, but only on model[0]'s output: it sees a NaN input batch, and misses a
    NaN that arises in another layer's gradient (2.weight)."""

    # --- verbatim from 000 #5 ---
    def check_gradient(module, grad_input, grad_output):
        for i, grad in enumerate(grad_output):
            if grad is not None and torch.isnan(grad).any():
                print(f"NaN detected in gradients of {module.__class__.__name__} at output {i}")

    # --- end ---
    model = seed_mlp()
    register_deprecated(model[0], check_gradient)
    with non_full_hook_warnings(STEPS):
        source_training_loop(model)
    assert capsys.readouterr().out == ""  # healthy data: silent

    x, y = one_batch()
    x[3, 4] = math.nan
    model = seed_mlp()
    register_deprecated(model[0], check_gradient)
    with non_full_hook_warnings(1):
        mse(model, x, y).backward()
    assert capsys.readouterr().out == "NaN detected in gradients of Linear at output 0\n"

    x, y = one_batch()
    model = seed_mlp()
    register_deprecated(model[0], check_gradient)
    with non_full_hook_warnings(1):
        nan_in_2_weight_path(model, x, y).backward()
    assert capsys.readouterr().out == ""  # missed
    assert torch.isnan(model[2].weight.grad).all()


@pytest.mark.parametrize("action", ["report", "zero", "skip"])
def test_000_5_nan_check_inspector(action):
    """000 #5 NaN check, as meant: ``nan_guard`` names the parameter whose gradient went non-finite
    (2.weight) in a ``nonfinite`` event with the configured ``action_taken``; "zero" and "skip" keep the
    weights finite."""
    x, y = one_batch()
    model = seed_mlp()
    before = params_of(model)
    ref = copy.deepcopy(model)
    mse(ref, x, y).backward()  # 2.weight's NaN term aside, the other gradients are the plain ones
    torch.optim.SGD(ref.parameters(), lr=0.01).step()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with inspector.attach(model, opt, every=1) as insp:
        insp.add_hook("nan_guard", target="*", action=action)
        nan_in_2_weight_path(model, x, y).backward()
        opt.step()
        snap = insp.latest()
    events = [e for e in insp.events() if e["kind"] != "hook_applied"]  # findings: at close() at the latest
    nonfinite = [e for e in events if e["kind"] == "nonfinite"]
    assert len(nonfinite) == 1
    ev = nonfinite[0]
    assert (ev["param"], ev["step"], ev["action_taken"]) == ("2.weight", 1, action)
    assert (ev["nan"], ev["inf"]) == (10, 0)
    i = insp.params.index("2.weight")
    assert (snap["nan_count"][i], snap["inf_count"][i]) == (10, 0)
    skipped = [e for e in events if e["kind"] == "step_skipped"]
    assert len(skipped) == (1 if action == "skip" else 0)

    now = params_of(model)
    if action == "report":
        assert torch.isnan(now["2.weight"]).all()
    else:
        assert all(torch.isfinite(p).all() for p in now.values())
    for n, p in now.items():
        if action == "skip" or (action == "zero" and n == "2.weight"):
            assert torch.equal(p, before[n]), n  # not moved
        elif n != "2.weight":
            assert close(p, ref.get_parameter(n)), n  # updated as without the NaN
    if action == "skip":
        assert (skipped[0]["step"], skipped[0]["reason"]) == (1, "nan_guard")


def test_000_5_nan_check_inspector_module_point():
    """000 #5 NaN check at the literal's own place: ``nan_guard`` at point ``module`` on "0" watches
    model[0]'s grad_output (no deprecated hook) and reports the NaN input batch, naming module "0"."""
    x, y = one_batch()
    x[3, 4] = math.nan
    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with inspector.attach(model, opt, every=1) as insp:
        insp.add_hook("nan_guard", target="0", point="module")
        mse(model, x, y).backward()
        opt.step()
    events = [e for e in insp.events() if e["kind"] == "nonfinite"]  # reported at close() at the latest
    by_point = {e["point"]: e for e in events}
    assert by_point["module"]["module"] == "0"
    assert by_point["module"]["action_taken"] == "report"
    assert by_point["pre_step"]["param"] == "0.weight"  # every gradient is NaN; the first is named
