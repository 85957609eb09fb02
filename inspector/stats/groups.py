"""Groups: a partition of the run's parameters, built once at attach, and their per-step aggregates.

The partition comes from the parameter names (``Inspector.params`` order, wrapper prefixes
stripped), read as a tree: the model, then each dotted component. A node whose children are all
integer names (two or more: ``layers.0`` ... ``layers.47``) is a *stack* of repeated blocks.

- **Default** (``source: "tree"``), "the depth that fits": the groups start as the root's children;
  then, repeatedly, the group with the most parameter tensors is expanded into its children, as
  long as the groups stay at most :data:`MAX_GROUPS` and it holds more than one tensor. Repeated
  structure expands together: the blocks of a stack appear all at once, and a part of a block
  (``layers.3.mlp``) expands only with the same part of every other block of its stack, so the
  partition is the same in every block. A stack with more blocks than there is room for is cut
  into runs of consecutive blocks instead (``layers.0-7``, ``layers.8-15``, ...), which then expand
  no further. Parameters directly on the root (no dot) each form a group of their own, or one group
  ``(root)`` when there would be more than :data:`MAX_GROUPS` groups otherwise (the root's
  integer-named parameters, a ``ParameterList``, are cut into runs like a stack's blocks).
- **User** (``source: "user"``): ``attach(..., groups={"glob": "name", ...})``; a parameter goes to
  the group of the first glob that matches its full name (``fnmatchcase``), and the parameters no
  glob matches to the group ``other``. A name given to several globs is one group.

Groups are ordered by their first member's index; a group's members are ascending parameter
indices. :meth:`Groups.describe` is the plain-data description (``Inspector.groups``, the session's
``groups``), which also lists every stack of the tree with, per block, the parameter of each kind
(the name after ``<stack>.<i>.``).

:meth:`Groups.aggregate` computes a snapshot's group aggregates (``Snapshot.groups``) from the
per-tensor statistic vectors, on their device, with a parameter-to-group index and a padded
``[groups, widest]`` member table built once: ``index_add_`` / ``scatter_reduce_`` for norms and
abs-max, one sort of the padded table for the minimum, lower median and maximum. The result is one
flat float32 tensor that rides in the snapshot's one host transfer; :meth:`Groups.unpack` turns its
host values into the aggregate lists. The NaN and Inf counts are summed on the host from the
per-tensor counts (which are themselves found on the host, and are zero but for rare tensors).
:meth:`Groups.aggregate_host` makes the same lists from the per-tensor lists on the host: under
FSDP2, and for a model of fewer than ``step_stats.DEVICE_GROUPS`` tensors (a few dozen floats).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import Tensor

from ..wire.errors import AttachError

__all__ = ["MAX_GROUPS", "AGG_KEYS", "Groups", "check_user_groups"]

MAX_GROUPS = 60  # the most groups the default partition makes

# the keys of Snapshot.groups, in this order
AGG_KEYS = (
    "norm_raw",
    "norm",
    "absmax_raw",
    "absmax",
    "nan_count",
    "inf_count",
    "norm_min",
    "norm_median",
    "norm_max",
    "ratio_min",
    "ratio_median",
    "ratio_max",
)
# the rows of the device-side result (counts of members with a value come along, to say None)
_ROWS = (*(k for k in AGG_KEYS if k not in ("nan_count", "inf_count")), "n_raw", "n_final", "n_ratio")


def check_user_groups(groups: Any) -> tuple[tuple[str, str], ...] | None:
    """``groups`` (the ``attach`` option) checked: ``None``, or its ``(glob, name)`` pairs in order.

    Raises:
        AttachError (a ``TypeError``): not a mapping of strings to strings.
        ValueError: an empty glob or group name.
    """
    if groups is None:
        return None
    if not isinstance(groups, Mapping):
        raise AttachError(
            f"groups must be a mapping of parameter globs to group names, e.g. {{'layers.*': 'body'}} "
            f"(got {type(groups).__name__})"
        )
    pairs = []
    for glob, name in groups.items():
        if not isinstance(glob, str):
            raise AttachError(f"groups: each key is a glob over parameter names, a string (got {glob!r})")
        if not isinstance(name, str):
            raise AttachError(f"groups[{glob!r}]: each value is a group name, a string (got {name!r})")
        if not glob:
            raise ValueError("groups: an empty glob matches no parameter name")
        if not name.strip():
            raise ValueError(f"groups[{glob!r}]: the group name is empty")
        pairs.append((glob, name))
    return tuple(pairs)


class _Node:
    """One node of the name tree: a dotted prefix of one or more parameter names."""

    __slots__ = ("path", "children", "own", "members")

    def __init__(self, path: str) -> None:
        self.path = path
        self.children: dict[str, _Node] = {}  # component -> node, in first-seen order
        self.own: int | None = None  # the parameter whose full name is this path
        self.members: list[int] = []  # every parameter at or under this node, ascending

    @property
    def is_stack(self) -> bool:
        return len(self.children) >= 2 and all(c.isdigit() for c in self.children)


def _child_path(path: str, comp: str) -> str:
    return f"{path}.{comp}" if path else comp


def _tree(names: Sequence[str]) -> _Node:
    root = _Node("")
    for i, name in enumerate(names):
        node = root
        node.members.append(i)
        for comp in name.split("."):
            nxt = node.children.get(comp)
            if nxt is None:
                nxt = node.children[comp] = _Node(_child_path(node.path, comp))
            node = nxt
            node.members.append(i)
        node.own = i
    return root


def _stacks(root: _Node) -> list[_Node]:
    out: list[_Node] = []
    todo = [root]
    while todo:
        node = todo.pop()
        if node.is_stack:
            out.append(node)
        todo.extend(reversed(node.children.values()))
    out.sort(key=lambda n: n.members[0])
    return out


class _Part:
    """A group of the default partition while it is being built."""

    __slots__ = ("name", "node", "members", "key", "final")

    def __init__(self, name: str, node: _Node | None, members: list[int], key: str, final: bool) -> None:
        self.name = name
        self.node = node  # None: a run of blocks, the root's parameters, or the node's own parameter
        self.members = members
        self.key = key  # the path with stack indices as "*": parts with one key expand together
        self.final = final  # expands no further


def _children_parts(node: _Node, key: str) -> list[_Part]:
    """The parts a node expands into: its own parameter (if any), then one per child."""
    parts = []
    if node.own is not None:
        parts.append(_Part(node.path, None, [node.own], key + ".", True))
    stack = node.is_stack
    for comp, child in node.children.items():
        ckey = _child_path(key, "*" if stack else comp)
        parts.append(_Part(child.path, child, child.members, ckey, not child.children))
    return parts


def _runs(node: _Node, key: str, room: int) -> list[_Part]:
    """A stack's blocks cut into at most ``room`` runs of consecutive blocks."""
    blocks = list(node.children.items())
    size = math.ceil(len(blocks) / room)
    parts = []
    for a in range(0, len(blocks), size):
        chunk = blocks[a : a + size]
        first, last = chunk[0][0], chunk[-1][0]
        label = first if len(chunk) == 1 else f"{first}-{last}"
        members = sorted(i for _, b in chunk for i in b.members)
        parts.append(_Part(_child_path(node.path, label), None, members, f"{key}#{a}", True))
    return parts


def _default(root: _Node, limit: int) -> list[tuple[str, list[int]]]:
    kids = list(root.children.values())
    parts: list[_Part]
    if len(kids) <= limit:
        parts = _children_parts(root, "")
    elif root.is_stack:  # a ParameterList or Sequential as the model: runs of its entries
        parts = _runs(root, "", limit)
    else:  # many parameters directly on the root: one group of them
        parts = [_Part(c.path, c, c.members, c.path, False) for c in kids if c.children]
        own = sorted(c.own for c in kids if c.own is not None)
        if own:
            parts.append(_Part("(root)", None, own, "(root)", True))
    while True:
        open_parts = [p for p in parts if not p.final and len(p.members) > 1]
        if not open_parts:
            break
        big = max(open_parts, key=lambda p: (len(p.members), -p.members[0]))
        unit = [p for p in parts if p.key == big.key and not p.final]
        node = big.node
        assert node is not None
        grown = sum(len(_children_parts(p.node, p.key)) - 1 for p in unit if p.node is not None)
        if len(parts) + grown <= limit:
            new: list[_Part] = []
            for p in parts:
                if p.key == big.key and not p.final and p.node is not None:
                    new.extend(_children_parts(p.node, p.key))
                else:
                    new.append(p)
            parts = new
            continue
        room = limit - len(parts) + 1
        if len(unit) == 1 and node.is_stack and room >= 2:  # too many blocks: runs of them
            i = parts.index(big)
            parts[i : i + 1] = _runs(node, big.key, room)
        break
    return [(p.name, sorted(p.members)) for p in parts]


def _user(names: Sequence[str], pairs: tuple[tuple[str, str], ...]) -> list[tuple[str, list[int]]]:
    by_name: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        group = next((g for glob, g in pairs if fnmatchcase(name, glob)), "other")
        by_name.setdefault(group, []).append(i)
    return list(by_name.items())


class Groups:
    """The partition of a run's parameters into groups, and their aggregates (module docstring).

    ``names``: the parameter names in ``Inspector.params`` order; ``user``: the checked
    ``(glob, name)`` pairs of :func:`check_user_groups`, or None for the default partition.
    """

    def __init__(
        self,
        names: Sequence[str],
        user: tuple[tuple[str, str], ...] | None = None,
        *,
        limit: int = MAX_GROUPS,
    ) -> None:
        self.n = len(names)
        root = _tree(names)
        self.source = "tree" if user is None else "user"
        found = _default(root, limit) if user is None else _user(names, user)
        found = [(name, members) for name, members in found if members]
        found.sort(key=lambda g: g[1][0])
        self.names: list[str] = [name for name, _ in found]
        self.members: list[list[int]] = [members for _, members in found]
        self.of: list[int] = [0] * self.n  # parameter index -> group index
        for g, members in enumerate(self.members):
            for i in members:
                self.of[i] = g
        self._stacks = self._describe_stacks(root)
        self._dev: dict[torch.device, tuple[Tensor, Tensor, Tensor]] = {}  # device -> (of, table, pad)

    def __len__(self) -> int:
        return len(self.names)

    def _describe_stacks(self, root: _Node) -> list[dict[str, Any]]:
        by_members = {tuple(m): g for g, m in enumerate(self.members)}
        out = []
        for node in _stacks(root):
            blocks = list(node.children.values())
            kinds: dict[str, list[int | None]] = {}
            for b, block in enumerate(blocks):
                cut = len(block.path) + 1
                for i in block.members:
                    suffix = self._name_of(block, i)[cut:]
                    kinds.setdefault(suffix, [None] * len(blocks))[b] = i
            groups = [by_members.get(tuple(block.members)) for block in blocks]
            out.append(
                {
                    "name": node.path,
                    "groups": groups if all(g is not None for g in groups) else None,
                    "blocks": [block.path for block in blocks],
                    "kinds": kinds,
                }
            )
        return out

    @staticmethod
    def _name_of(block: _Node, i: int) -> str:
        node = block
        while node.own != i:  # walk down to the parameter's own node
            node = next(c for c in node.children.values() if i in c.members)
        return node.path

    def describe(self) -> dict[str, Any]:
        """The plain-data description: ``{"source", "names", "members", "stacks"}``."""
        return {
            "source": self.source,
            "names": list(self.names),
            "members": [list(m) for m in self.members],
            "stacks": [
                {
                    "name": s["name"],
                    "groups": None if s["groups"] is None else list(s["groups"]),
                    "blocks": list(s["blocks"]),
                    "kinds": {k: list(v) for k, v in s["kinds"].items()},
                }
                for s in self._stacks
            ],
        }

    # ------------------------------------------------------------------ aggregates
    def _tables(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """``(of, table, pad)`` on ``device``: the parameter -> group index, the ``[G, M]`` member
        table (padded with ``n``, a slot past the last parameter) and its padding mask; built once."""
        got = self._dev.get(device)
        if got is None:
            width = max((len(m) for m in self.members), default=1)
            table = torch.full((len(self.members), width), self.n, dtype=torch.long)
            for g, m in enumerate(self.members):
                table[g, : len(m)] = torch.tensor(m, dtype=torch.long)
            got = (
                _to(torch.tensor(self.of, dtype=torch.long), device),
                _to(table, device),
                _to(table == self.n, device),
            )
            self._dev[device] = got
        return got

    def aggregate(
        self,
        raw_norm: Tensor,
        raw_absmax: Tensor,
        raw_ok: Tensor,
        final_norm: Tensor,
        final_absmax: Tensor,
        final_ok: Tensor,
        ratio: Tensor,
        ratio_ok: Tensor,
    ) -> Tensor:
        """The group aggregates on the vectors' device, one flat float32 tensor for the transfer
        (:meth:`unpack` reads it back). Every argument is a full-length per-parameter vector (``n``);
        the ``*_ok`` are masks of the parameters that have the value (a gradient, a ratio)."""
        dev = raw_norm.device
        of, table, pad = self._tables(dev)
        g = len(self.members)
        rows = []
        for vals, ok in ((raw_norm, raw_ok), (final_norm, final_ok)):
            rows.append(_group_norm(vals, ok, of, g))
        for vals, ok in ((raw_absmax, raw_ok), (final_absmax, final_ok)):
            rows.append(_group_max(vals, ok, of, g))
        rows.extend(_min_median_max(raw_norm, raw_ok, table, pad))
        rows.extend(_min_median_max(ratio, ratio_ok, table, pad))
        for ok in (raw_ok, final_ok, ratio_ok):
            rows.append(torch.zeros(g, device=dev, dtype=torch.float32).index_add_(0, of, ok.float()))
        return torch.cat([r.float() for r in rows])

    def unpack(
        self,
        host: Sequence[float],
        nan_count: Sequence[int | None],
        inf_count: Sequence[int | None],
        counted: Mapping[int, tuple[int, int]],
    ) -> dict[str, list[Any]]:
        """The aggregates from :meth:`aggregate`'s host values. ``counted``: the parameters whose
        NaN/Inf counts may be non-zero or unknown (every other one with a gradient counts 0 and 0)."""
        g = len(self.members)
        row = {k: list(host[j * g : (j + 1) * g]) for j, k in enumerate(_ROWS)}
        out: dict[str, list[Any]] = {}
        for key, n_key in (
            ("norm_raw", "n_raw"),
            ("norm", "n_final"),
            ("absmax_raw", "n_raw"),
            ("absmax", "n_final"),
            ("norm_min", "n_raw"),
            ("norm_median", "n_raw"),
            ("norm_max", "n_raw"),
            ("ratio_min", "n_ratio"),
            ("ratio_median", "n_ratio"),
            ("ratio_max", "n_ratio"),
        ):
            out[key] = [v if c > 0 else None for v, c in zip(row[key], row[n_key], strict=True)]
        out["nan_count"], out["inf_count"] = self._counts(row["n_raw"], nan_count, inf_count, counted)
        return {k: out[k] for k in AGG_KEYS}

    def _counts(
        self,
        n_raw: Sequence[float],
        nan_count: Sequence[int | None],
        inf_count: Sequence[int | None],
        counted: Mapping[int, tuple[int, int]],
    ) -> tuple[list[int | None], list[int | None]]:
        """Summed NaN/Inf counts per group: over the members whose count is known; None where no
        member has a gradient (or none a known count). Only the rare ``counted`` are visited."""
        known = [int(c) for c in n_raw]
        nans: list[int | None] = [0] * len(known)
        infs: list[int | None] = [0] * len(known)
        for i in counted:
            g = self.of[i]
            a, b = nan_count[i], inf_count[i]
            if a is None or b is None:
                known[g] -= 1
                continue
            nans[g] += a  # type: ignore[operator]
            infs[g] += b  # type: ignore[operator]
        for g, k in enumerate(known):
            if k <= 0:
                nans[g] = infs[g] = None
        return nans, infs

    def aggregate_host(
        self,
        raw_norm: Sequence[float | None],
        norm: Sequence[float | None],
        absmax_raw: Sequence[float | None],
        absmax: Sequence[float | None],
        nan_count: Sequence[int | None],
        inf_count: Sequence[int | None],
        ratio: Sequence[float | None],
    ) -> dict[str, list[Any]]:
        """The same aggregates from the snapshot's per-parameter lists (None: no value), in Python on
        the host: under FSDP2, whose per-tensor values are combined across ranks on the host, and
        where a float32 norm that overflowed was taken again in float64 there (rare)."""
        out: dict[str, list[Any]] = {k: [] for k in AGG_KEYS}
        for members in self.members:
            rn = [v for i in members if (v := raw_norm[i]) is not None]
            fn = [v for i in members if (v := norm[i]) is not None]
            out["norm_raw"].append(_norm(rn))
            out["norm"].append(_norm(fn))
            out["absmax_raw"].append(_top([v for i in members if (v := absmax_raw[i]) is not None]))
            out["absmax"].append(_top([v for i in members if (v := absmax[i]) is not None]))
            with_grad = [i for i in members if raw_norm[i] is not None]
            nans = [c for i in with_grad if (c := nan_count[i]) is not None]
            infs = [c for i in with_grad if (c := inf_count[i]) is not None]
            out["nan_count"].append(sum(nans) if nans else None)
            out["inf_count"].append(sum(infs) if infs else None)
            for key, vals in (("norm", rn), ("ratio", [v for i in members if (v := ratio[i]) is not None])):
                lo, mid, hi = _spread(vals)
                out[f"{key}_min"].append(lo)
                out[f"{key}_median"].append(mid)
                out[f"{key}_max"].append(hi)
        return out


def _norm(vals: list[float]) -> float | None:
    """``sqrt(sum of squares)`` in float64 (scaled: no overflow); None for no values."""
    if not vals:
        return None
    if any(math.isnan(v) for v in vals):
        return math.nan
    top = max(abs(v) for v in vals)
    if top == 0 or not math.isfinite(top):
        return top
    return top * math.sqrt(sum((v / top) ** 2 for v in vals))


def _top(vals: list[float]) -> float | None:
    if not vals:
        return None
    return math.nan if any(math.isnan(v) for v in vals) else max(vals)


def _spread(vals: list[float]) -> tuple[float | None, float | None, float | None]:
    """Minimum, lower median and maximum (all NaN if a value is NaN; None for no values)."""
    if not vals:
        return None, None, None
    if any(math.isnan(v) for v in vals):
        return math.nan, math.nan, math.nan
    s = sorted(vals)
    return s[0], s[(len(s) - 1) // 2], s[-1]


def _to(t: Tensor, device: torch.device) -> Tensor:
    """A host tensor on ``device``; to a GPU through pinned memory, a copy that does not synchronise."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _group_norm(vals: Tensor, ok: Tensor, of: Tensor, g: int) -> Tensor:
    """``sqrt(sum of squares)`` of each group's members with a value, scaled by the group's largest
    magnitude first (no overflow of float32 squares); a NaN member makes it NaN, an infinite one inf."""
    v = torch.where(ok, vals.float(), torch.zeros((), device=vals.device)).abs()
    top = _group_max(v, ok, of, g)
    scale = torch.where(torch.isfinite(top) & (top > 0), top, torch.ones((), device=v.device))
    s = torch.zeros(g, device=v.device, dtype=torch.float32).index_add_(0, of, (v / scale[of]) ** 2)
    norm = scale * s.sqrt()
    return torch.where(torch.isfinite(top), norm, top)


def _group_max(vals: Tensor, ok: Tensor, of: Tensor, g: int) -> Tensor:
    """Each group's largest value among its members with one (NaN if any is NaN; 0 if none)."""
    v = torch.where(ok, vals.float(), torch.full((), -math.inf, device=vals.device))
    top = torch.full((g,), -math.inf, device=vals.device).scatter_reduce_(0, of, v, "amax")
    nan = torch.zeros(g, device=vals.device).index_add_(0, of, (torch.isnan(vals) & ok).float()) > 0
    top = torch.where(nan, torch.full((), math.nan, device=vals.device), top)
    return torch.where(top == -math.inf, torch.zeros((), device=vals.device), top)


def _min_median_max(vals: Tensor, ok: Tensor, table: Tensor, pad: Tensor) -> list[Tensor]:
    """Minimum, lower median and maximum of each group's members with a value: one sort of the
    padded ``[G, M]`` table (padding and members without a value sort last as +inf). A NaN member
    makes all three NaN, as ``torch.min``/``median``/``max`` would."""
    dev = vals.device
    inf = torch.full((1,), math.inf, device=dev)
    v = torch.cat([torch.where(ok, vals.float(), inf), inf])[table]
    valid = torch.cat([ok, torch.zeros(1, dtype=torch.bool, device=dev)])[table] & ~pad
    nan = (torch.isnan(v) & valid).any(dim=1)
    v = torch.where(torch.isnan(v), inf, v)  # (only NaN members, made NaN again below)
    s = v.sort(dim=1).values
    k = valid.sum(dim=1)
    last = (k - 1).clamp(min=0)
    picks = [
        s[:, 0],
        s.gather(1, (last // 2).unsqueeze(1)).squeeze(1),
        s.gather(1, last.unsqueeze(1)).squeeze(1),
    ]
    nanv = torch.full((), math.nan, device=dev)
    return [torch.where(nan, nanv, p) for p in picks]
