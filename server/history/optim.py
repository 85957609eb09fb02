"""`Snapshot.optim` (inspector/stats/optim_state.py) on the wire and in the history.

Its six per-parameter lists are cut the way the ten `PER_PARAM` lists are: a large run's snapshot
(more than `DETAIL_ALL` tensors) carries them for the followed tensors only, aligned to
`optim["index"]` (the same index as its `detail`), and a snapshot read without detail
(`GET /api/snapshots?detail=false`) for none. The group and model values, `kind` and
`cos_prev_gap` are always sent whole, except a per-group list that holds no value (left out).
Floats are written with the fewest digits that keep their float32 value.

In the history the six lists are packed with the ten (`packing.split`, as columns `optim.<key>` of
the `detail` BLOB) and thinned with them past the full-resolution window (then read back as None
for every parameter); its per-group lists go with the group aggregates (`groups` BLOB, kept for
every step), and the rest of `optim` stays in the snapshot's JSON."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["OPTIM_PER_PARAM", "PREFIX", "cut_optim", "drop_null_lists", "put_optim", "take_optim"]

PREFIX = "optim."  # the packed columns' names: optim.exp_avg_norm, ...

OPTIM_PER_PARAM = (
    "exp_avg_norm",
    "exp_avg_sq_sqrt_norm",
    "below_eps_frac",
    "step_ratio",
    "cos_update_grad",
    "cos_grad_prev",
)


def _short(values: Any) -> Any:
    from .packing import packable, short_values  # (packing imports this module)

    return short_values(values) if isinstance(values, list) and packable(values) else values


def _all_null(values: Any) -> bool:
    """A list with no value (every entry None): nothing to send (an SGD run's Adam moments)."""
    return isinstance(values, list) and all(x is None for x in values)


def drop_null_lists(groups: Any) -> Any:
    """A dict of per-group lists without the lists that hold no value; anything else as it is."""
    if not isinstance(groups, dict):
        return groups
    return {k: v for k, v in groups.items() if not _all_null(v)}


def cut_optim(optim: Any, keep: Sequence[int]) -> Any:
    """`optim` with its per-parameter lists cut to the parameters `keep` (ascending, in range) and
    `"index": keep`, its per-group lists without those that hold no value (an SGD run's Adam
    moments: 2.6 KB of nulls a message at 58 groups); anything that is not an `optim` dict (None,
    a crafted row) as it is."""
    if not isinstance(optim, dict) or "index" in optim:
        return optim
    out: dict[str, Any] = {}
    for k, v in optim.items():
        if k in OPTIM_PER_PARAM and isinstance(v, list):
            out[k] = _short([v[i] if 0 <= i < len(v) else None for i in keep])
        elif k == "groups" and isinstance(v, dict):
            out[k] = {g: _short(x) for g, x in v.items() if not _all_null(x)}
        else:
            out[k] = v
    for k in OPTIM_PER_PARAM:  # (a stored row whose lists were thinned has none)
        out.setdefault(k, [None] * len(keep))
    out["index"] = list(keep)
    return out


def take_optim(snap: dict[str, Any], n: int) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """For the history: `snap` without `optim`'s per-parameter lists of length `n` that can be
    packed, and those lists as columns named `optim.<key>` (none when there is nothing to take)."""
    from .packing import packable  # (packing imports this module)

    optim = snap.get("optim")
    if not isinstance(optim, dict) or "index" in optim or n <= 0:
        return snap, {}
    cols = {
        PREFIX + k: v
        for k in OPTIM_PER_PARAM
        if isinstance(v := optim.get(k), list) and len(v) == n and packable(v)
    }
    if not cols:
        return snap, {}
    rest = {k: v for k, v in optim.items() if PREFIX + k not in cols}
    return {**snap, "optim": rest}, cols


def put_optim(out: dict[str, Any], detail: dict[str, list[Any]] | None, thinned: int | None) -> None:
    """A stored snapshot read back (`out`, in place): `optim`'s per-parameter lists from the packed
    columns (popped from `detail`), or None for each parameter where its detail was thinned."""
    cols = {k: detail.pop(k) for k in [k for k in detail if k.startswith(PREFIX)]} if detail else {}
    optim = out.get("optim")
    if not isinstance(optim, dict) or "index" in optim:
        return
    n = thinned if thinned is not None else None
    if cols:
        out["optim"] = {**optim, **{k[len(PREFIX) :]: v for k, v in cols.items()}}
    elif n is not None and not any(k in optim for k in OPTIM_PER_PARAM):
        out["optim"] = {**optim, **{k: [None] * n for k in OPTIM_PER_PARAM}}
