"""Groups: the partition of the parameters (``Inspector.groups``) and each snapshot's aggregates.

The partition is checked on the shapes it is for (a 48-layer ``nn.TransformerEncoder``, a small
MLP, a Llama-shaped stack too deep to show block by block, 10,000 tiny tensors), on user globs and
on invalid input. The aggregates (``Snapshot.groups``, taken on the device inside the snapshot's one
transfer) are checked against a float64 reference computed from the same snapshot's per-tensor
lists, with a NaN gradient in one group, a frozen group (no gradients) and a hook that makes the
final gradients differ from the raw ones.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
from torch import nn

import inspector
from inspector.stats.groups import AGG_KEYS, MAX_GROUPS, Groups

from .test_host_reads import Reads


def names_of(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters()]


def transformer(layers: int = 48) -> nn.Module:
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0)
    return nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(8), enable_nested_tensor=False)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.mlp_norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attn_norm(x)
        x = x + self.o(self.q(h) * torch.sigmoid(self.k(h)) + self.v(h))
        return x + self.down(torch.relu(self.up(self.mlp_norm(x))))


class Llama(nn.Module):
    def __init__(self, blocks: int, d: int = 4, vocab: int = 11) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(blocks))
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for b in self.layers:
            x = b(x)
        return self.lm_head(self.norm(x))


def check_partition(g: Groups | dict[str, Any], n: int) -> dict[str, Any]:
    d = g.describe() if isinstance(g, Groups) else g
    json.dumps(d, allow_nan=False)  # plain data
    seen = [i for m in d["members"] for i in m]
    assert sorted(seen) == list(range(n)), "every parameter in exactly one group"
    assert all(m == sorted(m) and m for m in d["members"])
    assert [m[0] for m in d["members"]] == sorted(m[0] for m in d["members"]), "ordered by first member"
    assert len(d["names"]) == len(set(d["names"])) == len(d["members"])
    return d


# ---------------------------------------------------------------------------- the partition


def test_a_48_layer_transformer_gets_one_group_per_layer_and_its_stack_kinds() -> None:
    model = transformer()
    names = names_of(model)
    assert len(names) == 578
    d = check_partition(Groups(names), len(names))
    assert d["source"] == "tree"
    assert d["names"] == [f"layers.{i}" for i in range(48)] + ["norm"]
    assert len(d["names"]) <= MAX_GROUPS
    assert all(len(d["members"][i]) == 12 for i in range(48))
    (stack,) = d["stacks"]
    assert stack["name"] == "layers"
    assert stack["groups"] == list(range(48))
    assert stack["blocks"] == [f"layers.{i}" for i in range(48)]
    assert len(stack["kinds"]) == 12
    for kind, per_block in stack["kinds"].items():
        assert per_block == [names.index(f"layers.{b}.{kind}") for b in range(48)]
    assert "self_attn.in_proj_weight" in stack["kinds"]
    assert "linear1.weight" in stack["kinds"]


def test_a_small_mlp_gets_one_group_per_tensor_and_its_sequential_is_a_stack() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    d = check_partition(Groups(names_of(model)), 6)
    assert d["names"] == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    assert d["stacks"] == [
        {
            "name": "",
            "groups": None,
            "blocks": ["0", "2", "4"],
            "kinds": {"weight": [0, 2, 4], "bias": [1, 3, 5]},
        }
    ]


def test_a_block_part_expands_only_with_the_same_part_of_every_block() -> None:
    """Four blocks fit as blocks, and each block's parts fit too: every block is cut the same way."""
    model = Llama(4)
    names = names_of(model)
    d = check_partition(Groups(names), len(names))
    per_block = [[n for n in d["names"] if n.startswith(f"layers.{b}.")] for b in range(4)]
    assert all(len(p) == len(per_block[0]) > 1 for p in per_block)
    assert [n.split(".", 2)[2] for n in per_block[3]] == [n.split(".", 2)[2] for n in per_block[0]]
    assert d["stacks"][0]["groups"] is None  # the blocks are not groups: they were expanded


def test_a_stack_with_more_blocks_than_room_is_cut_into_runs_of_blocks() -> None:
    model = Llama(110)
    names = names_of(model)
    assert len(names) > 1000
    d = check_partition(Groups(names), len(names))
    assert len(d["names"]) <= MAX_GROUPS
    assert d["names"][0] == "embed" and d["names"][-2:] == ["norm", "lm_head"]
    runs = d["names"][1:-2]
    assert len(runs) > 40
    assert runs[0] == "layers.0-1" and runs[-1] == "layers.108-109"
    (stack,) = d["stacks"]
    assert stack["groups"] is None and len(stack["blocks"]) == 110
    assert stack["kinds"]["q.weight"] == [names.index(f"layers.{b}.q.weight") for b in range(110)]


def test_ten_thousand_tiny_tensors_get_at_most_sixty_groups() -> None:
    names = [f"blocks.{i}.{w}" for i in range(5000) for w in ("weight", "bias")]
    d = check_partition(Groups(names), 10_000)
    assert 50 <= len(d["names"]) <= MAX_GROUPS
    flat = check_partition(Groups([str(i) for i in range(10_000)]), 10_000)  # a ParameterList
    assert len(flat["names"]) <= MAX_GROUPS and flat["names"][0].startswith("0-")


def test_parameters_on_the_root_are_groups_of_their_own_or_one_root_group() -> None:
    d = check_partition(Groups(["a", "b", "enc.w", "enc.b"]), 4)
    assert d["names"] == ["a", "b", "enc.w", "enc.b"]
    many = [f"p{i}" for i in range(100)] + ["enc.w"]
    d = check_partition(Groups(many), 101)
    assert d["names"] == ["(root)", "enc"]
    assert d["members"][0] == list(range(100))


def test_user_groups_take_the_first_matching_glob_and_the_rest_is_other() -> None:
    model = transformer(3)
    names = names_of(model)
    g = Groups(
        names,
        inspector.inspector.check_user_groups(
            {"layers.0.*": "first", "*.self_attn.*": "attention", "layers.2.linear*": "first"}
        ),
    )
    d = check_partition(g, len(names))
    assert d["source"] == "user"
    assert d["names"] == ["first", "attention", "other"]
    first = [i for i, n in enumerate(names) if n.startswith("layers.0.") or n.startswith("layers.2.linear")]
    attention = [i for i, n in enumerate(names) if ".self_attn." in n and not n.startswith("layers.0.")]
    assert d["members"][0] == first
    assert d["members"][1] == attention
    assert d["members"][2] == [i for i in range(len(names)) if i not in first + attention]
    assert d["stacks"][0]["name"] == "layers" and d["stacks"][0]["groups"] is None


def test_inspector_groups_from_attach_and_options() -> None:
    model = transformer(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with inspector.attach(model, opt, groups={"layers.1.*": "late"}) as insp:
        assert insp.groups["source"] == "user"
        assert insp.groups["names"] == ["other", "late"]
        insp.groups["names"].append("x")  # a copy: the Inspector's own is untouched
        assert insp.groups["names"] == ["other", "late"]
    assert inspector.Options(groups={"*": "all"}).groups == {"*": "all"}


@pytest.mark.parametrize(
    ("groups", "error", "says"),
    [
        (["layers.*"], TypeError, "mapping"),
        ({"layers.*": 3}, TypeError, "group name"),
        ({3: "x"}, TypeError, "glob"),
        ({"layers.*": " "}, ValueError, "empty"),
        ({"": "x"}, ValueError, "empty glob"),
    ],
)
def test_invalid_groups_are_refused_at_attach_naming_the_problem(groups: Any, error: type, says: str) -> None:
    model = transformer(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(error, match=says):
        inspector.attach(model, opt, groups=groups)
    with pytest.raises(error, match=says):
        inspector.Options(groups=groups)
    inspector.attach(model, opt).close()  # nothing was left attached


# ---------------------------------------------------------------------------- the aggregates


def _norm64(vals: list[float]) -> float:
    if any(math.isnan(v) for v in vals):
        return math.nan
    return math.sqrt(math.fsum(v * v for v in vals))


def _spread64(vals: list[float]) -> tuple[float, float, float]:
    if any(math.isnan(v) for v in vals):
        return math.nan, math.nan, math.nan
    s = sorted(vals)
    return s[0], s[(len(s) - 1) // 2], s[-1]


def reference(snap: dict[str, Any], members: list[list[int]]) -> dict[str, list[Any]]:
    """The group aggregates in float64 from the snapshot's own per-tensor lists."""

    def num(v: Any) -> float | None:
        return None if v is None else float(v)  # "nan"/"inf" strings back to floats

    out: dict[str, list[Any]] = {k: [] for k in AGG_KEYS}
    for m in members:
        raw = [x for i in m if (x := num(snap["grad_norm_raw"][i])) is not None]
        fin = [x for i in m if (x := num(snap["grad_norm"][i])) is not None]
        ram = [x for i in m if (x := num(snap["grad_absmax_raw"][i])) is not None]
        fam = [x for i in m if (x := num(snap["grad_absmax"][i])) is not None]
        ratio = [x for i in m if (x := num(snap["update_ratio"][i])) is not None]
        out["norm_raw"].append(_norm64(raw) if raw else None)
        out["norm"].append(_norm64(fin) if fin else None)
        out["absmax_raw"].append((math.nan if any(map(math.isnan, ram)) else max(ram)) if ram else None)
        out["absmax"].append((math.nan if any(map(math.isnan, fam)) else max(fam)) if fam else None)
        # over the members with a gradient whose counts are known (None: a hook changed it first)
        nans = [c for i in m if (c := snap["nan_count"][i]) is not None]
        infs = [c for i in m if (c := snap["inf_count"][i]) is not None]
        out["nan_count"].append(sum(nans) if nans else None)
        out["inf_count"].append(sum(infs) if infs else None)
        for key, vals in (("norm", raw), ("ratio", ratio)):
            lo, mid, hi = _spread64(vals) if vals else (None, None, None)
            out[f"{key}_min"].append(lo)
            out[f"{key}_median"].append(mid)
            out[f"{key}_max"].append(hi)
    return out


def assert_close(got: dict[str, list[Any]], want: dict[str, list[Any]]) -> None:
    assert list(got) == list(AGG_KEYS)
    for key in AGG_KEYS:
        assert len(got[key]) == len(want[key]), key
        for g, (a, b) in enumerate(zip(got[key], want[key], strict=True)):
            where = f"{key}[{g}]: got {a}, want {b}"
            if b is None:
                assert a is None, where
                continue
            assert a is not None, where
            a = float(a)
            if math.isnan(b):
                assert math.isnan(a), where
            else:
                assert a == pytest.approx(b, rel=2e-6, abs=1e-30), where


def train(
    insp: inspector.Inspector,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: int,
    nan_at: int | None,
    poison: str | None,
) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for s in range(1, steps + 1):
        opt.zero_grad(set_to_none=True)
        idx = torch.randint(0, 11, (4, 5), generator=gen)
        model(idx).logsumexp(-1).mean().backward()
        if s == nan_at and poison is not None:
            p = dict(model.named_parameters())[poison]
            with torch.no_grad():
                p.grad.view(-1)[0] = math.nan
                p.grad.view(-1)[1] = math.inf
        opt.step()
        snap = insp.latest()
        assert snap is not None and snap["step"] == s
        out.append(snap)
    return out


@pytest.mark.parametrize("groups", [None, {"layers.1.*": "nan here", "layers.2.*": "frozen", "embed*": "in"}])
def test_group_aggregates_equal_a_float64_reference_from_the_snapshot_lists(groups: Any) -> None:
    torch.manual_seed(0)
    model = Llama(4)
    for p in model.layers[2].parameters():  # a frozen block: no gradients
        p.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    with inspector.attach(model, opt, every=1, groups=groups) as insp:
        insp.add_hook("clip_norm", target="layers.3.*", max_norm=1e-3, mode="per_tensor")
        snaps = train(insp, model, opt, 4, nan_at=3, poison="layers.1.up.weight")
        d = insp.groups
    for snap in snaps:
        json.dumps(snap, allow_nan=False)
        assert snap["groups"] is not None
        assert_close(snap["groups"], reference(snap, d["members"]))
    names = insp.params
    bad = names.index("layers.1.up.weight")
    g_bad = next(g for g, m in enumerate(d["members"]) if bad in m)
    g_frozen = next(g for g, m in enumerate(d["members"]) if names.index("layers.2.q.weight") in m)
    nan_step = snaps[2]["groups"]
    assert nan_step["nan_count"][g_bad] == 1 and nan_step["inf_count"][g_bad] == 1
    assert nan_step["norm_raw"][g_bad] == "nan" and nan_step["norm_max"][g_bad] == "nan"
    assert all(c in (0, None) for g, c in enumerate(nan_step["nan_count"]) if g != g_bad)
    for snap in snaps:
        agg = snap["groups"]
        assert agg["norm_raw"][g_frozen] is None and agg["nan_count"][g_frozen] is None
        assert agg["ratio_median"][g_frozen] is None
    clipped = [g for g, m in enumerate(d["members"]) if names.index("layers.3.q.weight") in m]
    first = snaps[0]["groups"]
    for g in clipped:  # the hook's group: final below raw
        assert first["norm"][g] < first["norm_raw"][g]


def test_group_aggregates_ride_in_the_snapshots_one_transfer() -> None:
    model = Llama(8)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    reads = Reads()
    reads.install()
    try:
        with inspector.attach(model, opt, every=1) as insp:
            gen = torch.Generator().manual_seed(0)
            for s in range(1, 6):

                def one() -> None:
                    opt.zero_grad(set_to_none=True)
                    model(torch.randint(0, 11, (2, 3), generator=gen)).sum().backward()
                    opt.step()

                got = reads.step(one)
                assert len(got) <= 1, "\n".join(got)
                assert s <= 2 or not reads.made, reads.made
                latest = insp.latest()
                assert (
                    latest is not None and latest["step"] == s and latest["groups"]["norm_raw"][0] is not None
                )
    finally:
        reads.uninstall()


def test_the_device_aggregates_equal_the_host_ones_on_awkward_values() -> None:
    """``Groups.aggregate`` (device, float32) against ``Groups.aggregate_host`` (Python floats):
    NaN, inf, zeros, members without a value, a group with none, huge norms whose squares overflow."""
    names = [f"b.{i}.{k}" for i in range(6) for k in ("w", "v", "u")] + ["head"]
    g = Groups(
        names, (("b.0.*", "a"), ("b.1.*", "nan"), ("b.2.*", "none"), ("b.3.*", "huge"), ("b.4.*", "inf"))
    )
    n = len(names)
    gen = torch.Generator().manual_seed(1)
    raw = torch.rand(n, generator=gen) * 10
    fin = raw / 2
    ram, fam = raw / 3, fin / 3
    ratio = torch.rand(n, generator=gen)
    raw_ok = torch.ones(n, dtype=torch.bool)
    raw_ok[6:9] = False  # "none": no gradients
    raw_ok[0] = False  # one member of "a" without one
    raw[3], ram[3] = math.nan, math.nan
    raw[9:12] = torch.tensor([1e30, 3e30, 2e30])  # squares overflow float32
    raw[12], ram[12], fin[12] = math.inf, math.inf, math.inf
    fin[1] = 0.0
    ratio_ok = raw_ok.clone()
    ratio_ok[1] = False
    fin_ok = raw_ok.clone()
    fin_ok[4] = False
    nan_count: list[int | None] = [0 if ok else None for ok in raw_ok.tolist()]
    inf_count = list(nan_count)
    nan_count[3], inf_count[3] = 5, 0
    inf_count[12] = 2
    nan_count[13] = inf_count[13] = None  # unknown

    def lst(t: torch.Tensor, ok: torch.Tensor) -> list[float | None]:
        return [float(v) if o else None for v, o in zip(t.tolist(), ok.tolist(), strict=True)]

    host = g.aggregate_host(
        lst(raw, raw_ok),
        lst(fin, fin_ok),
        lst(ram, raw_ok),
        lst(fam, fin_ok),
        nan_count,
        inf_count,
        lst(ratio, ratio_ok),
    )
    flat = g.aggregate(raw, ram, raw_ok, fin, fam, fin_ok, ratio, ratio_ok)
    counted = {i: (0, 0) for i in (3, 12, 13)}
    dev = g.unpack(flat.tolist(), nan_count, inf_count, counted)
    assert_close(dev, host)
    assert dev["norm_raw"][g.names.index("huge")] == pytest.approx(math.sqrt(14) * 1e30, rel=1e-6)
    assert dev["norm_raw"][g.names.index("none")] is None
    assert dev["nan_count"][g.names.index("nan")] == 5
    assert dev["inf_count"][g.names.index("inf")] == 2
