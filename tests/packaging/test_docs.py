"""The README and the manual in docs/ are accurate and runnable.

Every relative link resolves (a file, and a ``#anchor`` to a heading of it by GitHub's slug
rules); every ```python block parses; the README's quick-start block runs as written around a
model, optimizer, loader and loss the test defines; and docs/cli.md agrees with the CLI's
argparse parser, both ways.
"""

from __future__ import annotations

import argparse
import ast
import re
import textwrap
from pathlib import Path

import httpx
import pytest
import torch
from torch import nn

import inspector
from server import cli
from tests.support import free_port

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "server" / "PROTOCOL.md"]
# a ```python block that is deliberately not a whole program says so on the line before its fence
FRAGMENT = "<!-- fragment -->"

FENCE = re.compile(r"^(\s*)(```+|~~~+)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans (where links are links)."""
    out, fence = [], None
    for line in text.split("\n"):
        m = FENCE.match(line)
        if m:
            if fence is None:
                fence = m.group(2)[0] * 3
            elif m.group(2).startswith(fence):
                fence = None
            out.append("")
            continue
        out.append("" if fence else re.sub(r"`+[^`]*`+", "", line))
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link's text only
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def raw_headings(path: Path) -> list[str]:
    """Headings as written (code spans kept): prose() blanks code spans, so read them here."""
    out, fence = [], False
    for line in path.read_text().split("\n"):
        if FENCE.match(line):
            fence = not fence
        elif not fence and re.match(r"^#{1,6}\s", line):
            out.append(line)
    return out


def heading_anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in raw_headings(path):
        base = slug(re.sub(r"^#{1,6}\s+", "", line).rstrip("# "))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(prose(path.read_text()))]


def broken_links(path: Path) -> list[str]:
    bad = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{target} (no file {dest})")
        elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest):
            bad.append(f"{target} (no heading #{anchor} in {dest})")
    return bad


def python_blocks(path: Path) -> list[tuple[int, str, bool]]:
    """(line, source, marked as a fragment) of each ```python block."""
    lines = path.read_text().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m and lines[i].strip().lstrip("`~").strip().startswith("python"):
            indent, start = len(m.group(1)), i
            body = []
            i += 1
            while i < len(lines) and not FENCE.match(lines[i]):
                body.append(lines[i][indent:] if lines[i][:indent].isspace() else lines[i])
                i += 1
            fragment = start > 0 and lines[start - 1].strip() == FRAGMENT
            out.append((start + 1, "\n".join(body), fragment))
        elif m:  # another language's block: skip to its end
            i += 1
            while i < len(lines) and not FENCE.match(lines[i]):
                i += 1
        i += 1
    return out


def test_the_pages_checked_are_the_manual():
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "docs/README.md", "server/PROTOCOL.md", "docs/your-loop.md"} <= names
    # the index links every page of the manual
    index = {t.partition("#")[0] for t in links(ROOT / "docs" / "README.md")}
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md" and p.name not in index]
    assert not missing, f"docs/README.md does not link {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_the_link_check_can_fail(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other page\n\n## Sharded training (FSDP2, `fully_shard`)\n")
    page.write_text(
        "# Title\n\n[ok](other.md#sharded-training-fsdp2-fully_shard) [self](#title) "
        "[gone](missing.md) [no anchor](other.md#nowhere) `[code](missing.md)`\n"
        "```\n[in a block](missing2.md)\n```\n"
    )
    assert [b.split(" (")[0] for b in broken_links(page)] == ["missing.md", "other.md#nowhere"]


@pytest.mark.parametrize("page", PAGES[:-1], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_python_block_parses(page):
    for line, source, fragment in python_blocks(page):
        if fragment:
            continue
        try:
            ast.parse(source)
        except SyntaxError as e:
            pytest.fail(f"{page.relative_to(ROOT)}:{line + (e.lineno or 0)}: {e.msg}\n{source}")


def quick_start() -> str:
    """The README's first ```python block under "Inspect your own training"."""
    readme = ROOT / "README.md"
    text = readme.read_text()
    heading = text.index("\n## Inspect your own training\n")
    line = text[:heading].count("\n") + 2
    blocks = [src for at, src, _ in python_blocks(readme) if at > line]
    assert blocks, "no python block under the README's quick start"
    return blocks[0]


def test_the_readme_quick_start_runs_as_written(tmp_path, monkeypatch, capsys):
    source = quick_start()
    assert "inspector.attach(" in source and "serve(" in source
    port = free_port()
    # what a user would have around the block: a model, an optimizer, a loader and a loss
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    xs = torch.randn(6, 16, 4)
    loader = [(x, x[:, :1]) for x in xs]
    losses = []  # each step's, as the loop computed it

    def loss_fn(out, y):
        loss = nn.functional.mse_loss(out, y)
        losses.append(loss.item())
        return loss

    # serve()'s default port is this test's free one; the history goes to the test's folder;
    # wait() (Ctrl-C to leave) returns at once and says it was called
    monkeypatch.setattr("inspector.dashboard._DEFAULT_PORT", port)
    monkeypatch.chdir(tmp_path)
    waited = []
    monkeypatch.setattr(inspector.Inspector, "wait", lambda self: waited.append(self))
    scope = {"model": model, "optimizer": optimizer, "loader": loader, "loss_fn": loss_fn}
    try:
        exec(compile(source, "README.md (quick start)", "exec"), scope)
    except BaseException:
        if (left := inspector.attached(model)) is not None:
            left.close()  # and its server with it
        raise
    insp = scope["insp"]
    try:
        printed = capsys.readouterr().out
        assert f"http://127.0.0.1:{port}/" in printed
        assert waited == [insp]
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=10) as c:
            session = c.get("/api/session").json()
            assert session["mode"] == "user" and session["training"]["step"] == len(loader)
            insp.flush()
            snaps = c.get("/api/snapshots").json()
            snaps = snaps["snapshots"] if isinstance(snaps, dict) else snaps
            assert [s["step"] for s in snaps][-1] == len(loader)
            # record()'s losses reach the dashboard (a step's loss may come a few steps later)
            recorded = {s["step"]: s["loss"] for s in snaps if s["loss"] is not None}
            assert recorded and recorded == {k: pytest.approx(losses[k - 1]) for k in recorded}
        assert (tmp_path / "gradient-inspector.sqlite").exists()
    finally:
        insp.close()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/api/health", trust_env=False, timeout=2)


# --- the command line: docs/cli.md and the parser ---------------------------------------


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def parser_options(sp: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each option string (and a positional's metavar) of a subcommand, but -h/--help."""
    out = {}
    for a in sp._actions:
        if isinstance(a, argparse._HelpAction):
            continue
        for name in a.option_strings or [a.metavar or a.dest.upper()]:
            out[name] = a
    return out


def cli_doc_sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## `gradient-inspector (\w+)`\s*$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def documented_options(section: str) -> dict[str, str]:
    """First-column names of the options table -> the row's description."""
    out = {}
    for row in re.findall(r"^\| (.+?) \| (.+) \|$", section, flags=re.M):
        names, desc = row
        if names.strip() in ("option", "---"):
            continue
        for token in re.findall(r"`([^`]+)`", names):
            if token.startswith("-") or token.isupper():
                out.setdefault(token, desc)
    return out


def help_text(a: argparse.Action) -> str:
    h = a.help or ""
    if "%(choices)s" in h:
        h = h.replace("%(choices)s", ", ".join(a.choices))
    return h.replace("|", "\\|")


def cli_disagreements(doc: str) -> list[str]:
    subs = subparsers()
    sections = cli_doc_sections(doc)
    bad = [f"no section for `{name}`" for name in subs if name not in sections]
    bad += [f"section for unknown subcommand `{name}`" for name in sections if name not in subs]
    for name, section in sections.items():
        if name not in subs:
            continue
        have = parser_options(subs[name])
        documented = documented_options(section)
        metavars = {a.metavar for a in have.values() if a.metavar}
        for opt, action in have.items():
            if opt not in documented:
                bad.append(f"{name} {opt}: in --help, not in docs/cli.md")
            elif help_text(action) not in documented[opt]:
                bad.append(f"{name} {opt}: docs/cli.md's text is not --help's ({help_text(action)!r})")
        for opt in documented:
            if opt not in have and opt not in metavars:
                bad.append(f"{name} {opt}: in docs/cli.md, unknown to the parser")
    return bad


def test_cli_doc_and_parser_agree():
    assert cli_disagreements((ROOT / "docs" / "cli.md").read_text()) == []


def test_the_cli_check_can_fail():
    doc = (ROOT / "docs" / "cli.md").read_text()
    dropped = re.sub(r"^\| `--no-shadow` \|.*\n", "", doc, flags=re.M)
    invented = doc.replace("| `--no-wait` |", "| `--no-wait`, `--later` |")
    reworded = doc.replace("keep no history on disk", "keep no history")
    assert cli_disagreements(dropped) == ["demo --no-shadow: in --help, not in docs/cli.md"]
    assert cli_disagreements(invented) == ["demo --later: in docs/cli.md, unknown to the parser"]
    assert [b.split(":")[0] for b in cli_disagreements(reworded)] == ["demo --no-db"]


COMMAND = re.compile(
    r"(?:gradient-inspector|python -m server|scripts/demo\.sh)\s+((?:demo|replay|export)\b)?([^`#\n]*)"
)


def commands_with_unknown_options(text: str) -> list[str]:
    """Options on a `gradient-inspector SUB ...` command line (in prose or a code block) that
    SUB's parser does not know; `scripts/demo.sh` passes its options to `demo`."""
    subs = subparsers()
    top = {o for a in cli.build_parser()._actions for o in a.option_strings}
    bad = []
    for m in COMMAND.finditer(text):
        sub = m.group(1) or ("demo" if "demo.sh" in m.group(0) else None)
        known = set(parser_options(subs[sub])) | {"-h", "--help"} if sub else top
        for opt in re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", m.group(2)):
            if opt not in known:
                bad.append(f"{m.group(0).strip()}: {opt}")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_command_line_in_the_docs_names_an_unknown_option(page):
    assert commands_with_unknown_options(page.read_text()) == []


def test_the_command_line_check_can_fail():
    text = textwrap.dedent(
        """\
        `gradient-inspector demo --scenario deep --fast` and `gradient-inspector --version`
        gradient-inspector export run.sqlite --format csv -x
        `bash scripts/demo.sh --scenario nan`
        """
    )
    assert [b.rsplit(": ", 1)[1] for b in commands_with_unknown_options(text)] == ["--fast", "-x"]
