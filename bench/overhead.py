"""What the inspector costs per training step, against plain training and against W&B's watch.

    .venv/bin/python bench/overhead.py            # about 4 minutes on 2 CPU cores
    .venv/bin/python bench/overhead.py --quick    # under a minute: a smoke run, too noisy to judge

Workloads (CPU):
    mlp      the seed model, Linear(10, 10) -> ReLU -> Linear(10, 1), batch 32, SGD (scenario "mlp")
    wide     Linear(784, 2048) -> ReLU -> Linear(2048, 1024) -> ReLU -> Linear(1024, 10), batch 128,
             Adam, cross entropy on random data (a pool of 16 pre-drawn batches, cycled)
    tiny_gpt the scenario "tiny_gpt": 4 layers, d_model 256, 3.3M parameters in 53 tensors, batch 16x128

Variants, each on its own copy of the workload (same seed, so the same model and data):
    plain    the training step alone
    floor    the step with torch's share of what the inspector does every step: its three step hooks
             (optimizer step pre and post, root forward pre) doing nothing but the unsampled step's
             NaN/Inf probe, one fused norm of the gradients: what any every-step check costs here
    default  inspector.attach(model, opt): statistics sampled to stay within a 3% budget; + insp.record(loss=...)
    every=1  inspector.attach(model, opt, every=1): every statistic every step, histograms of the first 8
             parameters every 10 steps (insp.set_hist_params(insp.params[:8])); + insp.record(loss=...)
    wandb    wandb.watch(model, log="gradients", log_freq=1) in offline mode, + wandb.log({"loss": ...})
             per step (watch only stages its histograms; wandb.log is what commits them), where wandb
             is importable; otherwise skipped with a message

Method: after a warm-up long enough for the default cadence to leave the dense sampling of a
run's first steps (it samples at most every step/10-th step early on, see inspector.stats.telemetry;
``--short`` keeps the short warm-ups, to measure those first steps), the variants run in rounds of one block of N steps each; the order
within a round rotates, so that slow drifts and bursts of noise hit every variant alike. Per
variant: the median step time over blocks; the median (and quartiles) of the paired ratios
block time / plain block time of the same round; for the inspector variants, the inspector's
own accounting of its cost (``overhead``, as published in its snapshots: its time per step
over its own wall-clock estimate of a step) and that time as a fraction of the plain step.
Each block is timed twice: by the wall clock (what a user waits for) and by this process's
CPU time (``time.process_time()``), which other processes on a busy shared machine barely
disturb; with one torch thread the two agree on a quiet machine. W&B's offline writer runs in
its own process (wandb-core), so its CPU time is missing from W&B's CPU column (in W&B's favour).

Interleaving and the budget: the inspector measures a step's wall clock from one step
boundary to the next, so the other variants' blocks between two of its blocks would look to
it like one very long step, and its budget would then allow far more sampling than in a loop
that only trains (with blocks of a few tiny_gpt steps, sampling every step instead of every
third or fourth). A real loop has no such gaps between its own steps, so before each block
the benchmark calls ``insp.forget_gap()`` (the first step of a block is then not counted
as a step duration, as after a pause). ``--keep-gaps`` leaves it alone, to see what gaps in a user's loop (an evaluation
pass, a checkpoint) do to the sampling.

Threads: ``torch.set_num_threads(1)`` unless ``--threads`` says otherwise. On the 2-core
reference machine the second core is left to the OS and to W&B's background service
process (wandb-core), so that W&B's asynchronous work does not land in the next variant's block.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import inspector  # noqa: E402
from inspector.scenarios import make  # noqa: E402

StepFn = Callable[[], torch.Tensor]


# ------------------------------------------------------------------------------ workloads


@dataclass
class Workload:
    name: str
    build: Callable[[], tuple[nn.Module, torch.optim.Optimizer, StepFn]]
    warmup: int  # steps per variant before timing
    blocks: int  # rounds
    steps: int  # steps per block
    quick: tuple[int, int, int]  # (warmup, blocks, steps) for --quick


def scenario_workload(name: str) -> Callable[[], tuple[nn.Module, torch.optim.Optimizer, StepFn]]:
    def build() -> tuple[nn.Module, torch.optim.Optimizer, StepFn]:
        sc = make(name, seed=0)
        return sc.model, sc.optimizer, sc.step

    return build


def wide_mlp() -> tuple[nn.Module, torch.optim.Optimizer, StepFn]:
    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 1024), nn.ReLU(), nn.Linear(1024, 10)
        )
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    # Pre-drawn so that drawing data is not part of what is timed.
    pool = [
        (torch.randn(128, 784, generator=gen), torch.randint(10, (128,), generator=gen)) for _ in range(16)
    ]
    batches = itertools.cycle(pool)

    def step() -> torch.Tensor:
        x, y = next(batches)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return model, opt, step


WORKLOADS = [
    # warm-ups long enough for the default cadence to leave its dense start (k <= step / 10, see
    # inspector.stats.telemetry): the rounds then measure what a long run costs (--short: the old ones)
    Workload("mlp", scenario_workload("mlp"), warmup=1000, blocks=16, steps=100, quick=(10, 3, 20)),
    Workload("wide", wide_mlp, warmup=300, blocks=12, steps=10, quick=(1, 2, 2)),
    Workload("tiny_gpt", scenario_workload("tiny_gpt"), warmup=30, blocks=12, steps=4, quick=(0, 2, 1)),
]


# ------------------------------------------------------------------------------ variants


@dataclass
class Running:
    """One variant on its own copy of a workload."""

    name: str
    step: StepFn
    close: Callable[[], None]
    insp: inspector.Inspector | None = None
    wall: list[float] = field(default_factory=list)  # wall-clock seconds per step, one per block
    cpu: list[float] = field(default_factory=list)  # this process's CPU seconds per step, one per block
    overheads: list[float] = field(default_factory=list)  # the inspector's published estimate
    ours: list[float] = field(default_factory=list)  # the inspector's seconds per step
    every: list[int] = field(default_factory=list)  # its sampling interval


def plain(model: nn.Module, opt: torch.optim.Optimizer, step: StepFn) -> Running:
    return Running("plain", step, lambda: None)


def with_inspector(name: str, **kwargs: Any) -> Callable[[nn.Module, torch.optim.Optimizer, StepFn], Running]:
    def setup(model: nn.Module, opt: torch.optim.Optimizer, step: StepFn) -> Running:
        insp = inspector.attach(model, opt, **kwargs)
        if kwargs.get("every") == 1:
            insp.set_hist_params(insp.params[:8])

        def run() -> torch.Tensor:
            loss = step()
            insp.record(loss=loss)
            return loss

        return Running(name, run, insp.close, insp=insp)

    return setup


def floor(model: nn.Module, opt: torch.optim.Optimizer, step: StepFn) -> Running:
    """torch's own share of what the inspector does every step: the three step hooks doing nothing
    but the unsampled step's NaN/Inf probe (one fused norm of the gradients, never read)."""
    params = list(model.parameters())

    def probe(*_: Any) -> None:
        torch._foreach_norm([g for p in params if (g := p.grad) is not None])

    handles = [
        opt.register_step_pre_hook(probe),
        opt.register_step_post_hook(lambda *_: None),
        model.register_forward_pre_hook(lambda *_: None),
    ]
    return Running("floor", step, lambda: [h.remove() for h in handles] and None)


def with_wandb(model: nn.Module, opt: torch.optim.Optimizer, step: StepFn) -> Running:
    import wandb

    wandb.watch(model, log="gradients", log_freq=1)

    def run() -> torch.Tensor:
        loss = step()
        wandb.log({"loss": float(loss)})  # commits the histograms that watch's hooks staged
        return loss

    return Running("wandb", run, lambda: wandb.unwatch(model))


@contextlib.contextmanager
def wandb_offline(enabled: bool) -> Iterator[bool]:
    """An offline W&B run in a temporary folder for the whole benchmark; False when unavailable."""
    if not enabled:
        print("W&B: skipped (--no-wandb)")
        yield False
        return
    try:
        import wandb
    except ImportError:
        print("W&B: skipped (wandb is not importable here; `pip install wandb` to compare against it)")
        yield False
        return
    with tempfile.TemporaryDirectory(prefix="gi-bench-wandb-") as tmp:
        os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=tmp, WANDB_CONSOLE="off")
        run = wandb.init(project="gradient-inspector-bench", dir=tmp)
        print(f"W&B: wandb {wandb.__version__}, offline run in a temporary folder")
        try:
            yield True
        finally:
            run.finish()


# ------------------------------------------------------------------------------ measuring


def inspector_cost(insp: inspector.Inspector) -> tuple[float | None, float | None, int | None]:
    """(published overhead, inspector seconds per step, sampling interval) from the core's accounting."""
    cost = insp.cost  # overhead is relative to the core's own average of the wall-clock step
    overhead, every, wall = cost["overhead"], cost["sampled_every"], cost["step_s"]
    ours = overhead * wall if overhead is not None and wall else None
    return overhead, ours, every


def forget_gap(insp: inspector.Inspector) -> None:
    """Make the inspector treat the next step as the first after a pause (see the docstring)."""
    insp.forget_gap()


SHORT_WARMUP = {"mlp": 200, "wide": 20, "tiny_gpt": 4}  # --short: the warm-ups before 2026-12


def measure(
    wl: Workload, setups: list[Callable[..., Running]], *, quick: bool, keep_gaps: bool, short: bool = False
) -> list[Running]:
    warmup, blocks, steps = wl.quick if quick else (wl.warmup, wl.blocks, wl.steps)
    if short and not quick:
        warmup = SHORT_WARMUP[wl.name]
    running = [setup(*wl.build()) for setup in setups]
    try:
        for r in running:
            for _ in range(warmup):
                r.step()
        for b in range(blocks):
            k = b % len(running)
            for r in running[k:] + running[:k]:  # rotate the order every round
                if r.insp is not None and not keep_gaps:
                    forget_gap(r.insp)
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(steps):
                    r.step()
                r.wall.append((time.perf_counter() - t0) / steps)
                r.cpu.append((time.process_time() - c0) / steps)
                if r.insp is not None:
                    overhead, ours, every = inspector_cost(r.insp)
                    if overhead is not None and ours is not None and every is not None:
                        r.overheads.append(overhead)
                        r.ours.append(ours)
                        r.every.append(every)
    finally:
        for r in running:
            r.close()
    return running


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


CLOCKS = ("wall", "cpu")


def report(wl: Workload, running: list[Running]) -> dict[str, dict[str, float]]:
    """Print one workload's rows; return ``{clock: {variant: median paired ratio}}``."""
    base = running[0]
    assert base.name == "plain"
    ratios: dict[str, dict[str, float]] = {c: {} for c in CLOCKS}
    for r in running:
        cells = [f"{wl.name:<9}", f"{r.name:<8}"]
        for clock in CLOCKS:
            mine, theirs = getattr(r, clock), getattr(base, clock)
            q1, med, q3 = quartiles([t / p for t, p in zip(mine, theirs, strict=True)])
            ratios[clock][r.name] = med
            cells += [f"{statistics.median(mine) * 1e3:9.3f}", f"{med:6.3f} [{q1:.3f}-{q3:.3f}]"]
        if r.overheads:
            ours = statistics.median(r.ours) / statistics.median(base.wall)
            cells += [
                f"{statistics.median(r.overheads) * 100:6.2f}%",
                f"{ours * 100:7.2f}%",
                f"{statistics.median(r.every):4.0f}",
            ]
        print("  ".join(cells).rstrip(), flush=True)
    return ratios


HEADER = """\
                    wall clock                         CPU time of this process           inspector's own accounting
workload   variant   ms/step  ratio to plain            ms/step  ratio to plain         overhead  of plain   k
                      median  median [q1-q3]             median  median [q1-q3]         (own est.)  step"""

LEGEND = """\
ratio to plain: the median, over rounds, of (variant block time / plain block time of the same round).
CPU time: time.process_time(), this process only (all its threads): what other processes on a shared
  machine do barely touches it; W&B's wandb-core is another process, so its share is left out there.
overhead: the inspector's published estimate (its time per step / its own wall-clock step estimate);
of plain step: that time as a fraction of the plain step's wall clock; k: its sampling interval."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run in under a minute (too noisy to judge)")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch.set_num_threads (default 1; see the docstring)"
    )
    ap.add_argument(
        "--workloads", default="mlp,wide,tiny_gpt", help="comma-separated subset of mlp,wide,tiny_gpt"
    )
    ap.add_argument(
        "--keep-gaps", action="store_true", help="let the inspector see the other variants' blocks"
    )
    ap.add_argument("--no-wandb", action="store_true", help="leave W&B out even where it is installed")
    ap.add_argument(
        "--short",
        action="store_true",
        help="the short warm-ups: measure the first steps of a run, where the cadence samples densely",
    )
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    chosen = [w for w in WORKLOADS if w.name in args.workloads.split(",")]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {os.cpu_count()} CPUs; "
        f"inspector {inspector.__version__}; {'quick' if args.quick else 'full'} run"
    )
    t_start = time.perf_counter()
    results: dict[str, dict[str, dict[str, float]]] = {}
    with wandb_offline(not args.no_wandb) as have_wandb:
        setups: list[Callable[..., Running]] = [
            plain,
            floor,
            with_inspector("default"),
            with_inspector("every=1", every=1),
        ]
        if have_wandb:
            setups.append(with_wandb)
        print()
        print(HEADER)
        for wl in chosen:
            running = measure(wl, setups, quick=args.quick, keep_gaps=args.keep_gaps, short=args.short)
            results[wl.name] = report(wl, running)

    print(f"\n{time.perf_counter() - t_start:.0f} s in all.\n{LEGEND}")
    print("\nTargets, judged on each clock (wall / CPU):")
    for name, limit in [("mlp", 1.15), ("wide", 1.03), ("tiny_gpt", 1.03)]:
        if name in results:
            got = [results[name][c]["default"] for c in CLOCKS]
            verdict = " / ".join("yes" if g <= limit else "NO" for g in got)
            fl = [results[name][c]["floor"] for c in CLOCKS]
            print(
                f"  default on {name:<8} ratio {got[0]:.3f} / {got[1]:.3f} <= {limit:.2f}: {verdict}"
                f"   (floor: {fl[0]:.3f} / {fl[1]:.3f})"
            )
    for name, res in results.items():
        if "wandb" in res["wall"]:
            ours = [res[c]["every=1"] - 1.0 for c in CLOCKS]
            theirs = [res[c]["wandb"] - 1.0 for c in CLOCKS]
            verdict = " / ".join(
                "n/a (W&B's cost is lost in the noise)"
                if t <= 0
                else f"{o / t:.2f} of it, " + ("yes" if o <= 0.1 * t else "NO")
                for o, t in zip(ours, theirs, strict=True)
            )
            print(
                f"  every=1 on {name:<8} adds {ours[0]:+.1%} / {ours[1]:+.1%} of a plain step, W&B's watch "
                f"{theirs[0]:+.1%} / {theirs[1]:+.1%}; at most a tenth of W&B's: {verdict}"
            )
    if not results or "wandb" not in next(iter(results.values()))["wall"]:
        print("  every=1 against W&B: not measured (W&B skipped)")
    if args.quick:
        print("(--quick: too few rounds to judge the targets)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
