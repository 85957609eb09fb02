"""Spike detection: a robust z-score of the loss, the global gradient norm and each group's norm
against their own recent statistics, every step, with no host read during a step.

Each signal ``y`` (the log of a norm; the loss itself, which may be negative) is compared with an
exponential moving mean ``m`` and variance ``v`` of its own past values, before the step's value
joins them: ``z = (y - m) / s`` with ``s = max(sqrt(v), floor)`` (``FLOOR_LOG`` for a log-norm,
``max(FLOOR_REL * |m|, FLOOR_ABS)`` for the loss: a constant signal does not make every wobble a
spike, and a loss that sits at 0, a hinge's or a margin's, does not make 1e-9 one). Then the
statistics take the step's value with weight ``a = max(alpha, 1 / n)`` (``n``: the values seen so
far, this one included, so that the first steps are a plain running mean and variance and the EMA
takes over after ``1 / alpha`` steps): ``m += a * d``, ``v = (1 - a) * (v + a * d * d)`` with
``d = y - m``. Robust: once armed (``warmup`` values seen), ``d`` is clipped to ``z_max * s``
first, so a spike moves the statistics no more than a ``z_max``-sigma value would. A non-finite
value (a NaN/Inf gradient: the NaN/Inf report's business) is no value: z 0, statistics unchanged.

Where: the flight recorder (:mod:`inspector.stats.flight`) writes each step's per-tensor norms
and loss into its device ring (one write each) and starts that row's copy to the host through
the NaN/Inf checks' deferred queue; at a later boundary the host makes the global and group
norms of the row and :class:`SpikeState` updates the statistics, in float64 (a dozen float operations per
signal, ``2 + groups`` signals: no device op for them, nothing waited for).
:class:`SpikeReport` turns the z-scores into ``spike`` events there, at most one per signal per
``cooldown`` steps (a streak of spiking steps is one event).

The default threshold, 6: a log-normal signal's 6-sigma excursion has a probability of about
1e-9 a step, so over a million steps and sixty groups a false alarm stays unlikely, even with the
heavier tails real gradient norms have; a real spike (OLMo 2's, PaLM's) is tens of sigmas.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from ..wire.errors import HookError

__all__ = [
    "FLOOR_ABS",
    "FLOOR_LOG",
    "FLOOR_REL",
    "SpikeReport",
    "SpikeSettings",
    "SpikeState",
    "check_spike_settings",
]

FLOOR_LOG = 0.01  # the least spread of a log-norm (1%): a constant norm is not all spikes
FLOOR_REL = 0.01  # the least spread of the loss, relative to its mean
# The least spread of the loss in absolute terms, where its mean gives none (a loss at 0): about
# 8 float32 rounding steps (2**-23 each) of a loss of order one, the scale a normalised loss
# starts at (cross-entropy's nats, a hinge's margin, a standardised regression's squared error).
# A loss at 0 then spikes once it moves past z * 1e-6; the norms, compared as logs, have no floor
# in absolute terms and watch a loss that lives below 1e-4, where this floor is the larger one.
FLOOR_ABS = 1e-6


@dataclass(frozen=True)
class SpikeSettings:
    """The detector's thresholds (live-editable: ``Inspector.set_spike_detection``)."""

    enabled: bool = True
    z: float = 6.0  # a spike: z above this
    warmup: int = 50  # values a signal must have seen before it can spike
    alpha: float = 0.02  # the EMA's weight of a new value (about a 1 / alpha = 50-step memory)
    cooldown: int = 50  # at most one spike event per signal per this many steps

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_LIMITS = {"z": (0.5, 1000.0), "warmup": (2, 1_000_000), "alpha": (1e-6, 1.0), "cooldown": (1, 1_000_000)}


def check_spike_settings(current: SpikeSettings, change: dict[str, Any]) -> SpikeSettings:
    """``current`` with ``change`` applied, or HookError naming the first bad field (nothing is
    changed then): ``enabled`` a bool, ``z`` in [0.5, 1000], ``warmup`` an int in [2, 1e6],
    ``alpha`` in [1e-6, 1) , ``cooldown`` an int in [1, 1e6]."""
    out = asdict(current)
    for key, value in change.items():
        if key not in out:
            raise HookError(("spikes", key), f"unknown setting (known: {', '.join(out)})")
        if value is None:
            continue
        if key == "enabled":
            if not isinstance(value, bool):
                raise HookError(("spikes", key), f"must be true or false (got {value!r})")
        else:
            lo, hi = _LIMITS[key]
            integer = key in ("warmup", "cooldown")
            if isinstance(value, bool) or not isinstance(value, int if integer else int | float):
                kind = "an integer" if integer else "a number"
                raise HookError(("spikes", key), f"must be {kind} (got {value!r})")
            if not (math.isfinite(value) and lo <= value <= hi) or (key == "alpha" and value >= 1):
                top = "< 1" if key == "alpha" else f"<= {hi:g}"
                raise HookError(("spikes", key), f"must be >= {lo:g} and {top} (got {value!r})")
            value = int(value) if integer else float(value)
        out[key] = value
    return SpikeSettings(**out)


class SpikeState:
    """The EMA statistics of ``n`` signals, the first ``n_lin`` of them linear (the loss), the
    others norms taken as their logs (module docstring), in float64 on the host (plain floats: a
    few signals' dozen operations each cost less so than as vector ops)."""

    def __init__(self, n: int, n_lin: int) -> None:
        self.n_lin = n_lin
        self.mean = [0.0] * n
        self.var = [0.0] * n
        self.count = [0] * n

    def reset(self) -> None:
        k = len(self.mean)
        self.mean, self.var, self.count = [0.0] * k, [0.0] * k, [0] * k

    def update(self, x: list[float], s: SpikeSettings) -> tuple[list[float], list[float]]:
        """Take one step's values ``x`` (NaN: none): returns ``(z, mean)``, the z-scores against
        the statistics before this step and those statistics' mean in ``x``'s units; the
        statistics then take ``x`` in."""
        m, v, n = self.mean, self.var, self.count
        n_lin, warmup, zmax, alpha = self.n_lin, s.warmup, s.z, s.alpha
        isfinite, log, exp, sqrt = math.isfinite, math.log, math.exp, math.sqrt
        zs: list[float] = []
        means: list[float] = []
        for j, xj in enumerate(x):
            lin = j < n_lin
            mj = m[j]
            means.append(mj if lin else exp(mj))
            if not isfinite(xj) or not (lin or xj > 0):
                zs.append(0.0)  # no value: the statistics stay as they are
                continue
            y = xj if lin else log(xj)
            sd = sqrt(v[j])
            floor = max(FLOOR_REL * abs(mj), FLOOR_ABS) if lin else FLOOR_LOG
            if sd < floor:
                sd = floor
            d = y - mj
            if n[j] >= warmup:
                zs.append(d / sd)
                lim = zmax * sd
                d = lim if d > lim else (-lim if d < -lim else d)
            else:
                zs.append(0.0)
            nj = n[j] = n[j] + 1
            a = 1.0 / nj if 1.0 / nj > alpha else alpha
            m[j] = mj + a * d
            v[j] = (1 - a) * (v[j] + a * d * d)
        return zs, means


class SpikeReport:
    """Host side: the z-scores of each step, read at a later boundary, become ``spike`` events, at
    most one per signal per ``cooldown`` steps (a step whose z is over the threshold within
    ``cooldown`` steps of the signal's last such step is part of the same streak)."""

    def __init__(self, signals: list[tuple[str, str | None]]) -> None:
        self.signals = signals  # (signal, group name or None), in the vector's order
        self.last_over: dict[int, int] = {}  # signal -> the last step it was over the threshold

    def reset(self) -> None:
        self.last_over.clear()

    def spikes(
        self, step: int, z: list[float], x: list[float], mean: list[float], s: SpikeSettings
    ) -> list[dict[str, Any]]:
        """The events' fields for step ``step``'s values (none while disabled)."""
        out: list[dict[str, Any]] = []
        if not s.enabled:
            return out
        for k, zk in enumerate(z):
            if not (math.isfinite(zk) and zk > s.z):
                continue
            last = self.last_over.get(k)
            self.last_over[k] = step
            if last is not None and 0 <= step - last <= s.cooldown:
                continue  # the same streak
            signal, group = self.signals[k]
            out.append(
                {
                    "step": step,
                    "signal": signal,
                    "group": group,
                    "z": round(zk, 2),
                    "value": x[k],
                    "mean": mean[k],
                    "threshold": s.z,
                }
            )
        return out
