"""The GPU check: is the inspector cheap enough to leave on, on a GPU?

    .venv/bin/python bench/gpu_check.py             # about 3 minutes on one H100/H200-class GPU
    .venv/bin/python bench/gpu_check.py --quick     # a smoke run (under a minute)

Without CUDA it prints why and exits 0 (skipped cleanly).

Workload: a GPT-2-small-sized decoder (12 layers, d_model 768, 12 heads, context 1024, vocabulary
50257, tied embeddings: about 124M parameters), batch 8 x 1024 tokens of random data, bf16
autocast, ``torch.optim.AdamW(fused=True)``.

Variants, each on its own copy of the same model, run in interleaved blocks (the order rotates
every round): ``plain``; ``default`` (``inspector.attach(model, opt)`` + ``insp.record(loss=loss)``);
``every=1`` (every statistic every step). Printed: per variant the median block time per step and
the median paired ratio against ``plain`` of the same round; the inspector's own CPU time per step
(its cadence's medians, sampled and unsampled); its peak extra device memory (max allocated during
its blocks minus plain's) and its resident memory (what it keeps between steps) against the
parameters' bytes.

Synchronisation: ``torch.cuda.set_sync_debug_mode("error")`` is switched on inside every hook of
ours (forward pre-hook, optimizer step pre/post-hooks, post-accumulate and module hooks), so any
host synchronisation we cause raises. The one exception is the sampled snapshot's single transfer
(``telemetry.Pack.transfer``), which runs with the mode off and is counted instead: the check
prints the transfers per sampled and per unsampled step (the targets are 1 and 0).
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import inspector  # noqa: E402
from inspector.hooks import torch_hooks  # noqa: E402
from inspector.stats import telemetry  # noqa: E402
from inspector.step import lifecycle  # noqa: E402


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int = 50257, ctx: int = 1024, d: int = 768, layers: int = 12, heads: int = 12):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as GPT-2

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


# ------------------------------------------------------------------ sync checking inside our hooks
TRANSFERS = {"n": 0}


def _strict(fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapped(*a: Any, **k: Any) -> Any:
        prev = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn(*a, **k)
        finally:
            torch.cuda.set_sync_debug_mode(prev)

    return wrapped


def _counted_transfer(fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapped(*a: Any, **k: Any) -> Any:
        TRANSFERS["n"] += 1
        prev = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)  # the snapshot's one allowed transfer
        try:
            return fn(*a, **k)
        finally:
            torch.cuda.set_sync_debug_mode(prev)

    return wrapped


def _strict_factory(factory: Any) -> Any:
    @functools.wraps(factory)
    def make(*a: Any, **k: Any) -> Any:
        return _strict(factory(*a, **k))

    return make


def install_strict() -> None:
    L = lifecycle.StepLifecycle
    for name in ("_on_forward_pre", "_on_step_pre", "_on_step_post"):
        setattr(L, name, _strict(getattr(L, name)))
    T = torch_hooks.TorchHooks
    for name in ("_post_hook", "_module_hook", "_module_input_hook", "_module_grad_hook", "_local_hook"):
        setattr(T, name, _strict_factory(getattr(T, name)))
    telemetry.Pack.transfer = _counted_transfer(telemetry.Pack.transfer)  # type: ignore[method-assign]


# ------------------------------------------------------------------ the benchmark
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: fewer, shorter blocks")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--block", type=int, default=None, help="steps per block")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu_check.py: skipped, no CUDA device here (torch.cuda.is_available() is False)")
        return 0
    rounds = args.rounds or (3 if args.quick else 8)
    block = args.block or (5 if args.quick else 20)
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    install_strict()

    def build(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        m = GPT(ctx=args.ctx).to(dev)
        return m, torch.optim.AdamW(m.parameters(), lr=3e-4, fused=True)

    gen = torch.Generator(device=dev).manual_seed(1)
    data = [torch.randint(0, 50257, (args.batch, args.ctx + 1), device=dev, generator=gen) for _ in range(4)]
    variants: dict[str, dict[str, Any]] = {}
    for name, kw in (("plain", None), ("default", {}), ("every=1", {"every": 1})):
        model, opt = build()
        insp = inspector.attach(model, opt, **kw) if kw is not None else None
        variants[name] = {"model": model, "opt": opt, "insp": insp, "times": [], "peak": [], "transfers": []}
    pbytes = sum(p.numel() * p.element_size() for p in variants["plain"]["model"].parameters())
    n_params = sum(p.numel() for p in variants["plain"]["model"].parameters())
    print(f"GPT: {n_params / 1e6:.1f}M parameters ({pbytes / 2**20:.0f} MiB), batch {args.batch}x{args.ctx}")

    def run_block(v: dict[str, Any], steps: int) -> float:
        model, opt, insp = v["model"], v["opt"], v["insp"]
        if insp is not None:
            insp.forget_gap()  # the other variants' blocks are no gap of this loop's
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        TRANSFERS["n"] = 0
        t0 = time.perf_counter()
        for s in range(steps):
            x = data[s % len(data)]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x[:, :-1])
                loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if insp is not None:
                insp.record(loss=loss)
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / steps
        v["peak"].append(torch.cuda.max_memory_allocated())
        v["transfers"].append(TRANSFERS["n"])
        return dt

    names = list(variants)
    for v in variants.values():  # warm-up: kernels, allocator, the inspector's dense first steps
        run_block(v, 25 if not args.quick else 22)
    for v in variants.values():
        v["times"].clear()
        v["peak"].clear()
        v["transfers"].clear()
    ratios: dict[str, list[float]] = {n: [] for n in names if n != "plain"}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        got = {n: run_block(variants[n], block) for n in order}
        for n in names:
            variants[n]["times"].append(got[n])
        for n in ratios:
            ratios[n].append(got[n] / got["plain"])
    print(f"\n{rounds} rounds of {block}-step blocks, interleaved; medians")
    print(
        f"{'variant':10} {'ms/step':>9} {'ratio':>7} {'ours sampled us':>16} {'ours unsampled us':>18} {'k':>4}"
    )
    for n in names:
        v = variants[n]
        ms = statistics.median(v["times"]) * 1e3
        ratio = f"{statistics.median(ratios[n]):.4f}" if n in ratios else "1"
        cs = v["insp"].cost if v["insp"] is not None else {}
        fmt = lambda x: "-" if x is None else f"{x * 1e6:.0f}"  # noqa: E731
        k = v["insp"].cost["sampled_every"] if v["insp"] is not None else "-"
        print(
            f"{n:10} {ms:9.2f} {ratio:>7} {fmt(cs.get('sampled_s')):>16} {fmt(cs.get('unsampled_s')):>18} {k!s:>4}"
        )
    base_peak = max(variants["plain"]["peak"])
    print("\nmemory against the parameters' bytes")
    for n in ("default", "every=1"):
        v = variants[n]
        extra = max(v["peak"]) - base_peak
        resident = v["insp"].memory["update_sample"]
        print(
            f"{n:10} peak extra {extra / 2**20:8.1f} MiB ({100 * extra / pbytes:5.1f} %)   "
            f"resident {resident / 2**20:7.1f} MiB ({100 * resident / pbytes:4.1f} %)"
        )
    print("\ntransfers per block (sync debug mode 'error' inside our hooks: any other sync raised)")
    for n in ("default", "every=1"):
        v = variants[n]
        snaps = v["insp"].snapshots()
        print(f"{n:10} transfers per block {v['transfers']}  (snapshots so far {len(snaps)})")
        errs = [e for e in v["insp"].events() if e["kind"] in ("hook_error", "telemetry_error")]
        print(f"{'':10} errors reported by the inspector: {len(errs)}" + (f": {errs[0]}" if errs else ""))
    for v in variants.values():
        if v["insp"] is not None:
            v["insp"].close()
    worst = max(statistics.median(ratios["default"]), 0)
    print(
        f"\ndefault ratio {worst:.4f} (target <= 1.01)" + ("" if math.isfinite(worst) else " (not measured)")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
