"""Packed columns: a snapshot's per-tensor statistics and group aggregates as a compact BLOB.

A stored snapshot (storage.py) keeps its JSON in `snapshots.data` without the ten per-parameter
lists (`PER_PARAM`) and without `groups`; those lists go to two BLOB columns, `detail` (the ten
per-tensor lists; dropped for most steps past the full-resolution window) and `groups` (the group
aggregates, and the per-group lists of `optim` and `noise_scale` as columns `optim.groups.<key>`
and `noise_scale.groups.<key>`; kept for every step), each written by `pack` and read back by
`unpack`.

Format (little-endian): `b"GIP2"`, the number of values per column (uint32), the number of
columns (uint16); per column its name (uint8 length, UTF-8), a mode (uint8) and flags (uint8) and
a reference (uint16); then one zlib stream of the stored columns' values, each column's bytes
shuffled (every value's first byte, then every second byte, ...: the exponents sit together and
compress). A column's values are float32 (4 bytes each), or, flagged `INTEGERS` (every value an
int or None: `nan_count`, `inf_count`), integers stored exactly: uint32 (None as `NONE_U32`), or,
flagged `INTEGERS | WIDE` when one is negative or past `NONE_U32 - 1`, int64 (None as
`NONE_I64`). Modes:

- `STORED`: the column is in the stream;
- `SAME`: equal to the earlier column `ref`, of the same kind (`grad_norm` equals
  `grad_norm_raw` when no hook changes the gradients; not stored twice);
- `ZERO`: every value is 0 (`nan_count`, `inf_count` on a healthy step);
- `NULL`: every value is None.

Values are strict-JSON wire values: numbers, None (no value), and the strings "nan", "inf",
"-inf". Precision is float32's (about 7 significant digits); None is stored as a NaN with a
payload of its own (`NONE_BITS`), so it reads back as None, and a real NaN or infinity reads
back as "nan", "inf" or "-inf". An `INTEGERS` column reads back as the very ints it was given.
A list that holds anything else (a crafted row), or an int past int64's range, is not packed:
`split` leaves it in the JSON. `b"GIP1"` BLOBs (every column float32, `INTEGERS` read back
rounded from float32: exact below 2**24) are still read.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .optim import drop_null_lists, put_optim, take_optim

__all__ = [
    "PER_PARAM",
    "PackError",
    "join",
    "pack",
    "packable",
    "read",
    "short_values",
    "split",
    "unpack",
    "unpack_many",
]

PER_PARAM = (
    "grad_norm_raw",
    "grad_norm",
    "grad_mean",
    "grad_std",
    "grad_absmax_raw",
    "grad_absmax",
    "nan_count",
    "inf_count",
    "param_norm",
    "update_ratio",
)
MAGIC = b"GIP2"
MAGIC_V1 = b"GIP1"  # every column float32 (read only)
STORED, SAME, ZERO, NULL = 0, 1, 2, 3
INTEGERS = 1  # ints or None, stored exactly: uint32 ...
WIDE = 2  # ... or, with this flag too, int64
NONE_BITS = 0x7FC04E4E  # a quiet NaN with a payload of its own: None
NONE_U32 = 0xFFFFFFFF  # None in a uint32 column
NONE_I64 = -(2**63)  # None in an int64 column
# snapshot parts whose per-group lists are packed with the group aggregates
NESTED = ("optim", "noise_scale")
NESTED_AT = ".groups."  # their columns' names: optim.groups.step_ratio, noise_scale.groups.g_sq, ...
_HEAD = struct.Struct("<4sIH")
_COL = struct.Struct("<BBH")


class PackError(ValueError):
    """A BLOB that is not one `pack` wrote."""


_NUMBERS = {int, float, type(None)}
_NONFINITE = {"nan", "inf", "-inf"}


def packable(values: Any) -> bool:
    """Whether `values` is a list of wire numbers (int, float, None, "nan", "inf", "-inf")."""
    if not isinstance(values, list):
        return False
    kinds = set(map(type, values))  # one pass in C: this runs on every list of every snapshot
    if kinds <= _NUMBERS:
        return True
    if not kinds <= _NUMBERS | {str}:
        return False
    return {v for v in values if type(v) is str} <= _NONFINITE


def _bits(values: list[Any]) -> tuple[np.ndarray, int]:
    """`values` as stored, and the column's flags: ints or None exactly (uint32 with None as
    NONE_U32, or int64 with None as NONE_I64, `INTEGERS | WIDE`), anything else as the float32 bit
    patterns (None as NONE_BITS).

    Raises:
        OverflowError: an int past int64's range.
    """
    if set(map(type, values)) <= {int, type(None)}:
        ints = [v for v in values if v is not None]
        if not ints or (min(ints) >= 0 and max(ints) < NONE_U32):
            return np.array([NONE_U32 if v is None else v for v in values], dtype=np.uint32), INTEGERS
        if min(ints) <= NONE_I64:
            raise OverflowError("an int past int64's range")
        arr = np.array(
            [NONE_I64 if v is None else v for v in values], dtype=np.int64
        )  # OverflowError past it
        return arr, INTEGERS | WIDE
    arr = np.array(values, dtype=np.float64)  # None -> nan, "inf" -> inf
    f32 = arr.astype(np.float32)
    bits = f32.view(np.uint32).copy()
    for i in np.flatnonzero(np.isnan(arr)).tolist():
        if values[i] is None:
            bits[i] = NONE_BITS
    return bits, 0


def _none(flags: int) -> int:
    """The stored value of None in a column with these flags."""
    return (NONE_I64 if flags & WIDE else NONE_U32) if flags & INTEGERS else NONE_BITS


def _width(flags: int, version: int) -> int:
    """Bytes a value of a column with these flags takes."""
    return 8 if version >= 2 and flags & INTEGERS and flags & WIDE else 4


def pack(columns: dict[str, list[Any]]) -> bytes:
    """The columns (each `packable`, all of one length) as one BLOB (see the module docstring)."""
    names = list(columns)
    n = len(columns[names[0]]) if names else 0
    head = [_HEAD.pack(MAGIC, n, len(names))]
    stream: list[bytes] = []
    seen: list[tuple[int, np.ndarray]] = []
    for name, values in columns.items():
        if len(values) != n:
            raise PackError(f"column {name!r} has {len(values)} values, not {n}")
        bits, flags = _bits(values)
        mode, ref = STORED, 0
        if n and bool(np.all(bits == _none(flags))):
            mode = NULL
        elif n and not bool(np.any(bits)):
            mode = ZERO  # +0.0 (or 0) everywhere
        else:
            for j, (other_flags, other) in enumerate(seen):
                if other_flags == flags and np.array_equal(other, bits):
                    mode, ref = SAME, j
                    break
        encoded = name.encode("utf-8")[:255]
        head.append(bytes([len(encoded)]) + encoded + _COL.pack(mode, flags, ref))
        seen.append((flags, bits))
        if mode == STORED:
            stream.append(bits.view(np.uint8).reshape(n, bits.itemsize).T.tobytes())
    return b"".join(head) + zlib.compress(b"".join(stream), 1)  # 6 would save 1 % in twice the time


def _short(v: np.ndarray) -> np.ndarray:
    """float32 values as the float64 of their fewest significant digits (6 to 9) that read back as
    the same float32, so that they print short (0.1, not 0.10000000149011612)."""
    want = v.astype(np.float32)
    out = v.copy()
    todo = np.isfinite(v) & (v != 0)
    with np.errstate(all="ignore"):
        exp = np.floor(np.log10(np.abs(np.where(todo, v, 1.0))))
        for digits in (6, 7, 8, 9):
            k = digits - 1 - exp  # decimals to keep; powers of ten up to 1e22 are exact doubles
            up = 10.0 ** np.abs(k)
            r = np.where(k >= 0, np.round(v * up) / up, np.round(v / up) * up)
            ok = todo & np.isfinite(r) & (r.astype(np.float32) == want)
            out[ok] = r[ok]
            todo &= ~ok
    return out


def short_values(values: list[Any]) -> list[Any]:
    """Wire values (`packable`) with each float written with the fewest significant digits that keep
    its float32 value (`_short`): exact for the core's float32 statistics, and about half as long
    in JSON. Ints, None and the
    non-finite strings stay as they are."""
    kinds = set(map(type, values))
    if not values or kinds <= {int, type(None)}:
        return values
    try:
        arr = np.array(values, dtype=np.float64)
    except (ValueError, OverflowError, TypeError):  # an int past float's range: left as it is
        return values
    out: list[Any] = _short(arr).tolist()
    for i in np.flatnonzero(~np.isfinite(arr)).tolist():
        out[i] = values[i]
    if int in kinds:
        for i, v in enumerate(values):
            if type(v) is int:
                out[i] = v
    return out


def _column(bits: np.ndarray, flags: int, index: Sequence[int] | None, version: int) -> list[Any]:
    """An `INTEGERS` column's values (the float32 ones are written by `unpack_many`)."""
    if index is not None:
        bits = bits[np.asarray(index, dtype=np.int64)]
    if version >= 2 and flags & INTEGERS:  # exact ints
        out: list[Any] = bits.tolist()
        none = _none(flags)
        for i in np.flatnonzero(bits == none).tolist():
            out[i] = None
        return out
    f = bits.view(np.float32)  # a GIP1 column: ints rounded from float32
    bad = np.flatnonzero(~np.isfinite(f)).tolist()
    out = np.rint(np.nan_to_num(f)).astype(np.int64).tolist()
    for i in bad:
        b = int(bits[i])
        x = float(f[i])
        out[i] = None if b == NONE_BITS else "nan" if x != x else "inf" if x > 0 else "-inf"
    return out


def unpack(
    blob: bytes, keys: Iterable[str] | None = None, index: Sequence[int] | None = None
) -> dict[str, list[Any]]:
    """The columns of a `pack`ed BLOB (only `keys`, when given; only the values at `index`, when given).

    Raises:
        PackError: not a BLOB `pack` wrote, or a damaged one.
    """
    return unpack_many([read(blob, keys, index)])[0]


Read = tuple[dict[str, list[Any]], list[tuple[str, np.ndarray]]]


def unpack_many(reads: list[Read]) -> list[dict[str, list[Any]]]:
    """The columns of BLOBs that `read` has read, as `unpack` returns them: their float32 columns
    written in one pass of `_short` over all of them (a stored snapshot's columns are short, a
    value per tensor or group, and numpy's cost per call, not per value, is what reading many
    rows of a stored run spends its time on)."""
    floats = [col for _, cols in reads for col in cols]
    if not floats:
        return [out for out, _ in reads]
    bits = np.concatenate([b for _, b in floats])
    f = bits.view(np.float32)
    values = _short(f.astype(np.float64)).tolist()
    for i in np.flatnonzero(~np.isfinite(f)).tolist():
        b = int(bits[i])
        x = float(f[i])
        values[i] = None if b == NONE_BITS else "nan" if x != x else "inf" if x > 0 else "-inf"
    at = 0
    for out, cols in reads:
        for name, b in cols:
            out[name] = values[at : at + len(b)]
            at += len(b)
    return [out for out, _ in reads]


def read(blob: bytes, keys: Iterable[str] | None = None, index: Sequence[int] | None = None) -> Read:
    """A `pack`ed BLOB read (only `keys`, when given; only the values at `index`, when given), its
    float32 columns not yet written as values: `(columns, floats)`, each of `floats` a column's name
    and its bit patterns, its place in `columns` held by an empty list; `unpack_many` fills them.

    Raises:
        PackError: not a BLOB `pack` wrote, or a damaged one.
    """
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise PackError(f"a damaged packed column set: a {type(blob).__name__}, not a BLOB")
    try:
        magic, n, k = _HEAD.unpack_from(blob, 0)
        if magic not in (MAGIC, MAGIC_V1):
            raise PackError("not a packed snapshot column set")
        version = 2 if magic == MAGIC else 1
        pos = _HEAD.size
        cols: list[tuple[str, int, int, int]] = []
        for _ in range(k):
            length = blob[pos]
            name = bytes(blob[pos + 1 : pos + 1 + length]).decode("utf-8")
            pos += 1 + length
            mode, flags, ref = _COL.unpack_from(blob, pos)
            pos += _COL.size
            cols.append((name, mode, flags, ref))
        raw = zlib.decompress(blob[pos:])
    except (struct.error, IndexError, UnicodeDecodeError, zlib.error, TypeError, ValueError) as e:
        if isinstance(e, PackError):
            raise
        raise PackError(f"a damaged packed column set: {e}") from e
    wanted = None if keys is None else set(keys)
    if len(raw) != n * sum(_width(c[2], version) for c in cols if c[1] == STORED):
        raise PackError("a damaged packed column set: its stream has the wrong length")
    bits_of: list[tuple[int, np.ndarray | None]] = []
    out: dict[str, list[Any]] = {}
    floats: list[tuple[str, np.ndarray]] = []  # float32 columns, written by unpack_many
    offset = 0
    size = n if index is None else len(index)
    for name, mode, flags, ref in cols:
        bits: np.ndarray | None = None
        if mode == STORED:
            w = _width(flags, version)
            dtype = np.uint32 if w == 4 else np.int64
            chunk = np.frombuffer(raw, dtype=np.uint8, count=n * w, offset=offset)
            bits = chunk.reshape(w, n).T.copy().view(dtype).reshape(n)
            offset += n * w
        elif mode == SAME:
            if ref >= len(bits_of):
                raise PackError(f"column {name!r} refers to a later column")
            ref_flags, bits = bits_of[ref]
            if bits is None or ref_flags != flags:
                raise PackError(f"column {name!r} refers to a column it cannot equal")
        elif mode not in (ZERO, NULL):
            raise PackError(f"column {name!r} has an unknown mode {mode}")
        bits_of.append((flags, bits))
        if wanted is not None and name not in wanted:
            continue
        if mode == ZERO:
            out[name] = [0 if flags & INTEGERS else 0.0] * size
        elif mode == NULL:
            out[name] = [None] * size
        elif bits is not None and not flags & INTEGERS:
            out[name] = []  # (its place in the order; filled below)
            floats.append((name, bits if index is None else bits[np.asarray(index, dtype=np.int64)]))
        elif bits is not None:
            out[name] = _column(bits, flags, index, version)
    return out, floats


def split(snap: dict[str, Any]) -> tuple[dict[str, Any], bytes | None, bytes | None]:
    """A snapshot as stored: `(rest, detail, groups)`: the snapshot without its packable
    per-parameter lists and group aggregates, and those packed (None when there is none to pack).
    A list that is not `packable`, or not as long as the others, stays in `rest` (so do all of
    them when one holds an int beyond int64's range). `optim`'s six per-parameter lists are packed
    with them, as columns `optim.<key>` (server/history/optim.py); the per-group lists of `optim`
    and `noise_scale` with the group aggregates, as columns `<part>.groups.<key>`."""
    orig_optim = snap.get("optim")
    per = {k: snap[k] for k in PER_PARAM if k in snap and packable(snap[k])}
    n = max((len(v) for v in per.values()), default=0)
    per = {k: v for k, v in per.items() if len(v) == n}
    if per:  # Snapshot.optim's per-parameter lists go with them (server/history/optim.py)
        snap, optim_cols = take_optim(snap, n)
        per.update(optim_cols)
    groups = snap.get("groups")
    grouped: dict[str, list[Any]] = {}
    nested: dict[str, list[Any]] = {}
    if isinstance(groups, dict) and groups:
        lengths = {len(v) for v in groups.values() if isinstance(v, list)}
        if len(lengths) == 1 and all(packable(v) for v in groups.values()):
            snap, nested = _take_nested(snap, lengths.pop())
            grouped = {**groups, **nested}
    detail = groups_blob = None
    try:
        detail = pack(per) if per else None
    except (ValueError, OverflowError):  # an int past int64's range (a crafted row): as JSON
        per = {}
    try:
        groups_blob = pack(grouped) if grouped else None
    except (ValueError, OverflowError):
        grouped = {}
        snap = dict(snap)
        _put_nested(snap, dict(nested))  # (the parts' per-group lists stay in the JSON too)
    rest = {k: v for k, v in snap.items() if k not in per and not (grouped and k == "groups")}
    if "optim" in snap and not per and isinstance(snap["optim"], dict) and isinstance(orig_optim, dict):
        # (no per-parameter list packed after all: its own stay in the JSON, its per-group ones
        # where they went)
        rest["optim"] = dict(orig_optim)
        if "groups" not in snap["optim"]:  # (packed with the group aggregates)
            rest["optim"].pop("groups", None)
    return rest, detail, groups_blob


def join(
    rest: dict[str, Any],
    detail: dict[str, list[Any]] | None,
    groups: dict[str, list[Any]] | None,
    thinned: int | None = None,
) -> dict[str, Any]:
    """A stored snapshot read back whole: `rest` with the per-parameter lists (`detail`, or, for a
    step whose detail was thinned, `thinned` being the run's number of parameters, None for each)
    in their wire place (after `lr`) and `groups`; `optim`'s packed lists back in `optim`, and the
    per-group lists of `optim` and `noise_scale` back in theirs. A row
    that kept its lists in its JSON (a database from before the packed columns) is returned as it
    is."""
    if detail is None and thinned is not None:
        detail = {k: [None] * thinned for k in PER_PARAM}
    if detail is not None:
        detail = dict(detail)
    put_optim(rest, detail, thinned)  # Snapshot.optim's packed lists back in it (server/history/optim.py)
    if detail is None and groups is None:
        return rest
    out: dict[str, Any] = {}
    placed = False
    for k, v in rest.items():
        out[k] = v
        if k == "lr" and detail is not None:
            out.update(detail)
            placed = True
    if detail is not None and not placed:
        out.update(detail)
    if groups is not None:
        groups = dict(groups)
        _put_nested(out, groups)
        out["groups"] = groups
    return out


def _take_nested(snap: dict[str, Any], g: int) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """`snap` without the per-group lists of its `NESTED` parts (each part's `groups`, where
    every list in it is `packable` and `g` long), and those lists as columns named
    `<part>.groups.<key>`."""
    cols: dict[str, list[Any]] = {}
    out = snap
    for part in NESTED:
        d = snap.get(part)
        lists = d.get("groups") if isinstance(d, dict) else None
        if not isinstance(lists, dict) or not lists:
            continue
        if not all(isinstance(v, list) and len(v) == g and packable(v) for v in lists.values()):
            continue
        cols.update({f"{part}{NESTED_AT}{k}": v for k, v in lists.items()})
        out = {**out, part: {k: v for k, v in d.items() if k != "groups"}}
    return out, cols


def _put_nested(out: dict[str, Any], groups: dict[str, list[Any]]) -> None:
    """The `NESTED` parts' per-group lists (columns `<part>.groups.<key>`, popped from `groups`)
    back in `out[part]["groups"]` (in place)."""
    for part in NESTED:
        at = part + NESTED_AT
        names = [k for k in groups if k.startswith(at)]
        if not names:
            continue
        lists = {k[len(at) :]: groups.pop(k) for k in names}
        d = out.get(part)
        if isinstance(d, dict):
            if "index" in d:  # (a snapshot cut for the wire: lists with no value left out, as cut_optim)
                lists = drop_null_lists(lists)
            out[part] = {**d, "groups": lists}
