"""The page on a large run (more than 64 parameter tensors): group views by default.

A real server in a subprocess (`serve_large`: a stack of 30 tiny Llama-shaped blocks, 273
tensors, trained in a loop and served by ``insp.serve``) and Debian's Chromium. The heatmap
has one row per group and a click expands a group into its modules and tensors; a flow bar
drills into its group and "all groups" goes back; "by depth" shows one kind over the blocks;
a worst-now name opens that tensor in the parameter statistics, the histogram, the heatmap and
the flow chart; a pin survives a reload; the search finds one tensor among hundreds. No
console errors. Every wait is on a condition.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import expect

from tests import support

pytestmark = pytest.mark.e2e

BLOCKS = 30
TENSORS = 1 + 9 * BLOCKS + 2  # embed, 9 per block, final norm and head


def serve_large(port: int, blocks: int = BLOCKS) -> None:
    """Train a stack of tiny Llama-shaped blocks forever, served on 127.0.0.1:port (a subprocess)."""
    import time

    import torch
    from torch import nn
    from torch.nn import functional as F

    import inspector

    width = 8

    class RMSNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(width))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
                nn.Linear(width, width, bias=False) for _ in range(4)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            return self.o_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj = nn.Linear(width, 2 * width, bias=False)
            self.up_proj = nn.Linear(width, 2 * width, bias=False)
            self.down_proj = nn.Linear(2 * width, width, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.input_layernorm = RMSNorm()
            self.self_attn = Attention()
            self.post_attention_layernorm = RMSNorm()
            self.mlp = MLP()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.self_attn(self.input_layernorm(x))
            return x + self.mlp(self.post_attention_layernorm(x))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(32, width)
            self.layers = nn.ModuleList(Block() for _ in range(blocks))
            self.norm = RMSNorm()
            self.lm_head = nn.Linear(width, 32, bias=False)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.embed(tokens)
            for block in self.layers:
                x = block(x)
            return self.lm_head(self.norm(x))

    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    insp = inspector.attach(model, opt)
    insp.serve(port=port, db=False)
    while True:
        start = time.monotonic()
        tokens = torch.randint(0, 32, (4, 16))
        opt.zero_grad()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 32), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        insp.record(loss=loss)
        time.sleep(max(0.0, 0.1 - (time.monotonic() - start)))  # the pace of training: 10 steps/s at most


@pytest.fixture(scope="module")
def large(tmp_path_factory: pytest.TempPathFactory) -> Iterator[support.ServerProcess]:
    tmp = tmp_path_factory.mktemp("scale")
    port = support.free_port()
    code = f"from tests.e2e.test_scale import serve_large; serve_large({port})"
    with support.ServerProcess(
        [sys.executable, "-c", code], port=port, log_dir=tmp, cwd=support.REPO, timeout=120
    ) as server:
        yield server


@pytest.fixture(autouse=True)
def patient_expect() -> Iterator[None]:
    """Generous waits: the machine running the suite may be busy (the default is 5 s)."""
    expect.set_options(timeout=30_000)
    yield
    expect.set_options(timeout=5_000)


def open_page(large: support.ServerProcess, new_page: Any) -> tuple[Any, Any]:
    page, log = new_page()
    page.goto(large.url + "#all")
    expect(page.get_by_test_id("connection-status")).to_have_attribute("data-state", "live", timeout=60_000)
    return page, log


def heat_rows(page: Any) -> list[str]:
    """The heatmap's row categories (full names), top to bottom."""
    return page.evaluate(
        """() => { const gd = document.querySelector('[data-testid="chart-heatmap"]');
                   return gd && gd.data && gd.data[0] ? Array.from(gd.data[0].y) : []; }"""
    )


def click_heat_row(page: Any, name: str) -> None:
    """A mouse click on the heatmap's row `name`, on the newest step's cell, once the pointer is
    seen over that row (Plotly's hover names it): the page may still move under the pointer
    between measuring and clicking (a card above gaining its height as its data arrives)."""

    def aim() -> tuple[float, float] | None:
        page.get_by_test_id("chart-heatmap").scroll_into_view_if_needed()
        rows = heat_rows(page)
        # the newest column's x on the page: its step through the axis's range
        x = page.evaluate(
            """() => { const gd = document.querySelector('[data-testid="chart-heatmap"]');
                       const xs = gd.data[0].x, ax = gd._fullLayout.xaxis;
                       return ax.l2p(xs[xs.length - 1]) + ax._offset; }"""
        )
        box = page.locator('[data-testid="chart-heatmap"]').bounding_box()
        plot = page.locator('[data-testid="chart-heatmap"] .nsewdrag').first.bounding_box()
        at = (box["x"] + x, plot["y"] + (rows.index(name) + 0.5) / len(rows) * plot["height"])
        page.mouse.move(*at)
        over = page.evaluate(
            """() => { const h = document.querySelector('[data-testid="chart-heatmap"]')._hoverdata;
                       return h && h.length ? h[0].y : null; }"""
        )
        return at if over == name else None

    page.mouse.click(*support.wait_until(aim, 30, f"the pointer over the heatmap row {name}"))


def flow_bars(page: Any) -> list[str]:
    return page.evaluate(
        """() => { const gd = document.querySelector('[data-testid="chart-flow"]');
                   return gd && gd.data && gd.data[0] ? Array.from(gd.data[0].x) : []; }"""
    )


def click_flow_bar(page: Any, name: str) -> None:
    page.get_by_test_id("chart-flow").scroll_into_view_if_needed()
    bars = flow_bars(page)
    k = bars.index(name)
    box = page.locator('[data-testid="chart-flow"] .nsewdrag').first.bounding_box()
    page.mouse.click(box["x"] + (k + 0.5) / len(bars) * box["width"], box["y"] + box["height"] - 3)


def test_the_heatmap_shows_groups_and_a_click_expands_one_in_place(large, new_page) -> None:
    page, log = open_page(large, new_page)
    groups = large.get("/api/session")["groups"]["names"]
    page.get_by_test_id("chart-heatmap").scroll_into_view_if_needed()
    support.wait_until(lambda: heat_rows(page) == groups, 60, "one heatmap row per group")
    page.wait_for_function(
        "() => document.querySelector('[data-testid=\"chart-heatmap\"]').data[0].x.length >= 3"
    )
    assert 1 < len(groups) <= 60 and "embed" in groups and "lm_head" in groups
    expect(page.get_by_test_id("heatmap-crumbs")).to_contain_text(f"all {len(groups)} groups")

    group = next(g for g in groups if g.startswith("layers.3"))
    click_heat_row(page, group)
    rows = support.wait_until(lambda: (r := heat_rows(page)) != groups and r, 30, "the group expanded")
    inside = rows[rows.index(group) + 1 : rows.index(group) + 1 + len(rows) - len(groups)]
    assert inside and all(r.startswith("layers.3") for r in inside), inside
    assert any(r.endswith("self_attn") for r in inside), inside  # its modules first
    expect(page.get_by_test_id("heatmap-crumbs")).to_contain_text(group)

    click_heat_row(page, group)
    support.wait_until(lambda: heat_rows(page) == groups, 30, "the group collapsed")
    assert log.errors == []


def test_a_flow_bar_drills_into_its_group_and_all_groups_goes_back(large, new_page) -> None:
    page, log = open_page(large, new_page)
    groups = large.get("/api/session")["groups"]["names"]
    page.get_by_test_id("chart-flow").scroll_into_view_if_needed()
    support.wait_until(lambda: flow_bars(page) == groups, 60, "one flow bar per group")

    group = next(g for g in groups if g.startswith("layers.5"))
    click_flow_bar(page, group)
    members = support.wait_until(lambda: (b := flow_bars(page)) != groups and b, 30, "the drilled bars")
    assert len(members) >= 9 and all(m.startswith("layers.5") for m in members), members
    expect(page.get_by_test_id("flow-crumb")).to_have_text(group)
    # The members' detail is subscribed: their bars get values.
    page.wait_for_function(
        """() => { const gd = document.querySelector('[data-testid="chart-flow"]');
                   return gd.data[0].y.some((v) => v !== null && v > 0); }"""
    )

    page.get_by_test_id("flow-all-groups").click()
    support.wait_until(lambda: flow_bars(page) == groups, 30, "back to the groups")

    # By depth: one kind over the blocks.
    page.get_by_test_id("flow-depth").select_option(label="layers.*.self_attn.q_proj.weight")
    blocks = support.wait_until(lambda: len(b := flow_bars(page)) == BLOCKS and b, 30, "the blocks")
    assert blocks[0] == "layers.0" and blocks[-1] == f"layers.{BLOCKS - 1}", blocks
    assert log.errors == []


def test_a_worst_now_click_opens_the_tensor_everywhere(large, new_page) -> None:
    page, log = open_page(large, new_page)
    item = page.get_by_test_id("worst-item").first
    expect(item).to_be_visible(timeout=90_000)  # a tensor is ranked after 8 sampled steps
    # The list re-ranks every sampled step; with the pointer over it, it holds still, so the
    # tensor read here is still the one clicked after newer steps have arrived.
    page.get_by_test_id("worst-list").hover()
    name = item.get_attribute("data-param")
    note = page.get_by_test_id("worst-note")
    expect(note).to_have_attribute("data-held", "true", timeout=30_000)
    expect(note).to_contain_text("held while the pointer is over the list")
    assert item.get_attribute("data-param") == name
    item.click()
    expect(page.get_by_test_id("param-picked").locator(f'[data-param="{name}"]')).to_have_count(1)
    expect(page.get_by_test_id("hist-param")).to_have_value(name)
    page.get_by_test_id("chart-heatmap").scroll_into_view_if_needed()
    support.wait_until(lambda: name in heat_rows(page), 30, "the heatmap expanded down to the tensor")
    page.get_by_test_id("chart-flow").scroll_into_view_if_needed()
    support.wait_until(lambda: name in flow_bars(page), 30, "the flow chart drilled into its group")
    # The parameter table lists it, with its statistics.
    page.get_by_test_id("param-table").scroll_into_view_if_needed()
    expect(
        page.get_by_test_id("param-table").locator(f'[data-testid="param-row"][data-param="{name}"]')
    ).to_have_count(1)
    # Once the pointer leaves, the list shows the newest step again.
    page.mouse.move(0, 0)
    expect(note).not_to_have_attribute("data-held", "true")
    expect(note).to_contain_text("furthest from their own last 32 sampled values")
    assert log.errors == []


def test_search_finds_one_tensor_among_hundreds_and_a_pin_survives_a_reload(large, new_page) -> None:
    page, log = open_page(large, new_page)
    search = page.get_by_test_id("name-search")
    search.fill("layers.17.self_attn.k")
    results = page.get_by_test_id("search-result")
    expect(results).to_have_count(1)
    expect(results.first).to_have_attribute("data-param", "layers.17.self_attn.k_proj.weight")
    search.fill("layers.2?.mlp.up_proj.weight")  # a glob
    expect(results).to_have_count(10)
    search.fill("q_proj")
    expect(page.get_by_test_id("search-count")).to_contain_text(f"{BLOCKS} matches")

    name = "layers.17.mlp.down_proj.weight"
    search.fill(name)
    page.get_by_test_id("search-pin").first.click()
    chip = page.get_by_test_id("pin-list").locator(f'[data-testid="pin-chip"][data-param="{name}"]')
    expect(chip).to_have_count(1)
    page.reload()
    expect(page.get_by_test_id("connection-status")).to_have_attribute("data-state", "live", timeout=60_000)
    expect(chip).to_have_count(1)
    # A pinned tensor is followed: the parameter table lists it once its detail arrives (drawn
    # while on screen).
    page.get_by_test_id("param-table").scroll_into_view_if_needed()
    expect(
        page.get_by_test_id("param-table").locator(f'[data-testid="param-row"][data-param="{name}"]')
    ).to_have_count(1)
    chip.locator(".chip-x").click()
    expect(chip).to_have_count(0)
    assert log.errors == []


def test_representative_layers_pins_five_blocks_of_each_stack(large, new_page) -> None:
    page, log = open_page(large, new_page)
    page.evaluate("() => window.localStorage.clear()")
    page.get_by_test_id("pin-representative").click()
    pins = page.get_by_test_id("pin-chip")
    expect(pins).to_have_count(5 * 9)
    blocks = {p.split(".")[1] for p in pins.evaluate_all("(els) => els.map((e) => e.dataset.param)")}
    assert blocks == {"0", "1", str((BLOCKS - 1) // 2), str(BLOCKS - 2), str(BLOCKS - 1)}, blocks
    page.evaluate("() => window.localStorage.clear()")
    assert log.errors == []


def test_a_small_run_shows_the_worst_list_and_no_group_navigation(demo, new_page) -> None:
    page, log = new_page()
    page.goto(demo.url + "#all")
    expect(page.get_by_test_id("connection-status")).to_have_attribute("data-state", "live")
    expect(page.get_by_test_id("worst-list")).to_be_attached()
    expect(page.get_by_test_id("heatmap-crumbs")).to_be_hidden()
    expect(page.get_by_test_id("flow-nav")).to_be_hidden()
    params = [p if isinstance(p, str) else p["name"] for p in demo.get("/api/session")["params"]]
    page.get_by_test_id("chart-heatmap").scroll_into_view_if_needed()
    support.wait_until(lambda: heat_rows(page) == params, 30, "one heatmap row per parameter")
    expect(page.get_by_test_id("worst-note")).not_to_have_text("")
    assert log.errors == []


def test_a_tensors_fetched_history_redraws_only_the_charts_that_show_it(large, new_page) -> None:
    """Following a tensor fetches its held steps (GET /api/detail); the heatmap, showing groups,
    is not redrawn from scratch for it (a whole redraw of every row and column), while the
    parameter statistics, which show it, are."""
    page, log = open_page(large, new_page)
    groups = large.get("/api/session")["groups"]["names"]
    page.get_by_test_id("chart-heatmap").scroll_into_view_if_needed()
    support.wait_until(lambda: heat_rows(page) == groups, 60, "one heatmap row per group")
    page.evaluate(
        """() => { const sc = window.__dashboard.scheduler; const draw = sc.draw.bind(sc);
                   const some = sc.resetSome.bind(sc);
                   window.__resets = []; window.__asked = [];
                   sc.draw = (slot, reset, now, pending) => { if (reset) window.__resets.push(slot.name);
                                                               draw(slot, reset, now, pending); };
                   sc.resetSome = (charts) => {
                     window.__asked.push(...sc.slots.filter((s) => charts.includes(s.chart)).map((s) => s.name));
                     some(charts); }; }"""
    )
    fetched = """() => performance.getEntriesByType("resource").map((e) => decodeURIComponent(e.name))
                          .filter((u) => u.includes("/api/detail"))"""
    params = [p if isinstance(p, str) else p["name"] for p in large.get("/api/session")["params"]]
    name = next(p for p in params if p.startswith("layers.17.mlp.up_proj"))
    page.evaluate("(name) => window.__dashboard.pickParam(name)", name)
    support.wait_until(lambda: any(name in u for u in page.evaluate(fetched)), 30, "its history fetched")
    asked = support.wait_until(
        lambda: (r := page.evaluate("() => window.__asked")) and r, 30, "charts to redraw asked for"
    )
    assert "paramStats" in asked and "heatmap" not in asked, asked
    start = page.evaluate("() => window.__dashboard.live.step")
    support.wait_until(
        lambda: page.evaluate("() => window.__dashboard.live.step") >= start + 5, 30, "5 more steps"
    )
    assert "heatmap" not in page.evaluate("() => window.__resets")
    assert heat_rows(page) == groups
    assert log.errors == []
