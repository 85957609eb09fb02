"""What the inspector costs per step as the number of parameter tensors grows (the core's half of
the scale benchmarks: time only; the server's bytes are measured elsewhere).

    .venv/bin/python bench/scale.py              # about 6 minutes on this machine
    .venv/bin/python bench/scale.py --quick      # a smoke run, too noisy to judge
    .venv/bin/python bench/scale.py --only 1000  # one workload
    .venv/bin/python bench/scale.py --probe      # the unsampled step's probe by itself (seconds)
    .venv/bin/python bench/scale.py --only 1000 --long 600   # also the defaults past a run's opening

Workloads (CPU, one torch thread, AdamW, pre-drawn batches cycled):
    100      a Llama-shaped stack of 11 tiny blocks (RMSNorm, q/k/v/o, RMSNorm, gate/up/down: 9 tensors
             each) with an embedding, a final norm and a head: 102 tensors
    1000     the same with 110 blocks: 993 tensors, widths chosen for a step of about 200 ms here
    10000    5,000 tiny Linear(4, 4) layers in a chain: 10,000 tensors of 16 and 4 elements

Variants, each on its own copy of the workload (same seed):
    plain      the training step alone
    default    inspector.attach(model, opt) (attach's defaults, docs/your-loop.md) + insp.record(loss=...)
    unsampled  attach(..., every=10**9): after its first step no step is sampled (hooks, the
               NaN/Inf check, the step machine: what every step pays)
    sampled    attach(..., every=1): every step sampled (every statistic, one transfer)
    long       (with --long N) the defaults again, warmed up for N steps first: a run's opening is
               sampled densely whatever the budget (the interval within a tenth of the steps so
               far), so the defaults above are those of a run's first hundred steps, and these
               the cadence's once the budget decides it. A block then holds a sampled step or
               none, so its ratio is the mean over all its blocks (its CPU time over plain's in
               the same rounds, three times as many rounds as without --long), with how many of
               its measured steps were sampled

Method (as bench/overhead.py): times are this process's CPU time (``time.process_time()``, one
torch thread), which other processes on a busy shared machine barely disturb; the wall-clock
ratio of the default variant is shown beside it. After a warm-up (past the default cadence's dense first steps),
rounds of one block of N steps per variant, the order rotating each round; ``insp.forget_gap()``
before each block, so the other variants' blocks do not count as a long step of this one. Per
variant: the median step time over blocks and the median of the paired ratios to plain's block of
the same round. "ours per step" is (variant - plain) per step from those medians (unsampled and
sampled), and also, from the inspector's own accounting (``insp.cost``), the time its step hooks
measured themselves (which leaves out the backward's hooks and allocator effects).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import inspector  # noqa: E402
from inspector.stats.step_stats import StepStats  # noqa: E402

StepFn = Callable[[], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.mlp_norm = RMSNorm(d)
        self.gate, self.up = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False)
        self.down = nn.Linear(h, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.attn_norm(x)
        q, k, v = self.q(a), self.k(a), self.v(a)
        att = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        x = x + self.o(att @ v)
        m = self.mlp_norm(x)
        return x + self.down(nn.functional.silu(self.gate(m)) * self.up(m))


class Llama(nn.Module):
    def __init__(self, blocks: int, d: int, h: int, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, h) for _ in range(blocks))
        self.norm = RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for b in self.layers:
            x = b(x)
        return self.lm_head(self.norm(x))


class Chain(nn.Module):
    def __init__(self, n: int, d: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.layers:
            x = torch.tanh(lin(x))
        return x


def llama(blocks: int, d: int, h: int, batch: int, seq: int) -> Callable[[], tuple[nn.Module, Any, StepFn]]:
    def build() -> tuple[nn.Module, Any, StepFn]:
        torch.manual_seed(0)
        vocab = 64
        model = Llama(blocks, d, h, vocab)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(0)
        pool = [torch.randint(vocab, (batch, seq + 1), generator=gen) for _ in range(8)]
        batches = itertools.cycle(pool)

        def step() -> torch.Tensor:
            t = next(batches)
            opt.zero_grad(set_to_none=True)
            logits = model(t[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), t[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            return loss.detach()

        return model, opt, step

    return build


def chain(n: int, d: int, batch: int) -> Callable[[], tuple[nn.Module, Any, StepFn]]:
    def build() -> tuple[nn.Module, Any, StepFn]:
        torch.manual_seed(0)
        model = Chain(n, d)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # (foreach: torch's default)
        gen = torch.Generator().manual_seed(0)
        pool = [torch.randn(batch, d, generator=gen) for _ in range(8)]
        batches = itertools.cycle(pool)

        def step() -> torch.Tensor:
            x = next(batches)
            opt.zero_grad(set_to_none=True)
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            return loss.detach()

        return model, opt, step

    return build


@dataclass
class Workload:
    name: str
    build: Callable[[], tuple[nn.Module, Any, StepFn]]
    warmup: int
    blocks: int
    steps: int


WORKLOADS = [
    Workload("100", llama(11, 64, 128, 8, 64), 60, 9, 20),
    Workload("1000", llama(110, 48, 96, 4, 64), 40, 7, 8),
    Workload("10000", chain(5000, 4, 4), 24, 5, 4),
]

VARIANTS: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "default": {},
    "unsampled": {"every": 10**9},
    "sampled": {"every": 1},
}


@dataclass
class Run:
    name: str
    step: StepFn
    insp: Any = None
    times: list[float] = field(default_factory=list)  # per block: CPU seconds per step
    walls: list[float] = field(default_factory=list)  # per block: wall-clock seconds per step

    def block(self, n: int) -> None:
        if self.insp is not None:
            self.insp.forget_gap()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            loss = self.step()
            if self.insp is not None:
                self.insp.record(loss=loss)
        self.times.append((time.process_time() - c0) / n)
        self.walls.append((time.perf_counter() - t0) / n)


def measure(w: Workload, quick: bool, long: int = 0) -> dict[str, Any]:
    warm, blocks, steps = (8, 3, 3) if quick else (w.warmup, w.blocks, w.steps)
    blocks *= 3 if long else 1
    runs = []
    ntensors = 0
    variants = {**VARIANTS, **({"long": {}} if long else {})}
    for name, opts in variants.items():
        model, opt, step = w.build()
        ntensors = sum(1 for _ in model.parameters())
        insp = inspector.attach(model, opt, **opts) if opts is not None else None
        runs.append(Run(name, step, insp))
    for r in runs:  # warm-up, each alone
        for _ in range(max(warm, long) if r.name == "long" else warm):
            loss = r.step()
            if r.insp is not None:
                r.insp.record(loss=loss)
    counted = {r.name: r.insp.cost["sampled_steps"] for r in runs if r.insp is not None}
    for i in range(blocks):
        order = runs[i % len(runs) :] + runs[: i % len(runs)]
        for r in order:
            r.block(steps)
    plain = runs[0]
    out: dict[str, Any] = {
        "workload": w.name,
        "tensors": ntensors,
        "plain_ms": statistics.median(plain.times) * 1e3,
    }
    for r in runs[1:]:
        ratios = [a / b for a, b in zip(r.times, plain.times, strict=True)]
        walls = [a / b for a, b in zip(r.walls, plain.walls, strict=True)]
        out[r.name] = {
            "ms": statistics.median(r.times) * 1e3,
            "wall_ratio": statistics.median(walls),
            "ratio": statistics.median(ratios),
            "ours_us": (statistics.median(r.times) - statistics.median(plain.times)) * 1e6,
            "cost": dict(r.insp.cost),
            "mean_ratio": sum(r.times) / sum(plain.times),
            "sampled_steps": r.insp.cost["sampled_steps"] - counted[r.name],
            "measured_steps": blocks * steps,
        }
        r.insp.close()
    return out


def probe_cost(w: Workload, reps: int = 20) -> tuple[int, float]:
    """CPU microseconds of the unsampled step's statistics alone: the NaN/Inf probe of every
    gradient (``StepStats.probe()``, the part an Inspector builds, here built on its own: the
    figure the flat passes change) and its read on the host at the next boundary, after one
    backward; the median of ``reps``."""
    model, opt, step = w.build()
    names, tensors = zip(*model.named_parameters(), strict=True)
    stats = StepStats(list(names), list(tensors))
    step()
    opt.zero_grad(set_to_none=False)  # (gradients kept: zeros)
    times = []
    for _ in range(reps):
        c0 = time.process_time()
        got = stats.probe()
        if got is not None:
            flat = got[1]
            _ = flat.tolist() if isinstance(flat, torch.Tensor) else [x.item() for x in flat]
        times.append(time.process_time() - c0)
    return len(tensors), statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", action="append", help="a workload name (100, 1000, 10000); repeatable")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--probe", action="store_true", help="only the unsampled step's probe, by itself")
    ap.add_argument(
        "--long", type=int, default=0, metavar="N", help="also the defaults after N steps of warm-up"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(
        "tensors | plain ms | default ratio (wall) | k | unsampled: ratio, ours us (self-timed) "
        "| sampled: ratio, ours us (self-timed)",
        flush=True,
    )
    if args.probe:
        print("tensors | the probe: CPU us per unsampled step", flush=True)
        for w in WORKLOADS:
            if not args.only or w.name in args.only:
                n, us = probe_cost(w)
                print(f"{n:>7} | {us:9.0f}", flush=True)
        return
    for w in WORKLOADS:
        if args.only and w.name not in args.only:
            continue
        r = measure(w, args.quick, args.long)
        d, u, s = r["default"], r["unsampled"], r["sampled"]

        def us(x: float | None) -> str:
            return "-" if x is None else f"{x * 1e6:.0f}"

        print(
            f"{r['tensors']:>7} | {r['plain_ms']:8.1f} | {d['ratio']:.3f} ({d['wall_ratio']:.3f}) "
            f"| {d['cost']['sampled_every']:>3} "
            f"| {u['ratio']:.3f}, {u['ours_us']:7.0f} ({us(u['cost']['unsampled_s'])}) "
            f"| {s['ratio']:.3f}, {s['ours_us']:7.0f} ({us(s['cost']['sampled_s'])})",
            flush=True,
        )
        if "long" in r:
            g = r["long"]
            print(
                f"{'':>7}   defaults after {args.long} steps of warm-up: {g['mean_ratio']:.3f} "
                f"({g['sampled_steps']} of {g['measured_steps']} steps sampled), k "
                f"{g['cost']['sampled_every']}, its own accounting {g['cost']['overhead'] * 100:.1f} %",
                flush=True,
            )


if __name__ == "__main__":
    main()
