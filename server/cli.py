"""`gradient-inspector`: demo, replay, export (docs/cli.md; README.md "The two commands", docs/history.md)."""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
from collections.abc import Sequence
from functools import cached_property
from typing import Any

from .history.storage import DEFAULT_DB, StoreError
from .settings import DEFAULT_HOST, DEFAULT_PORT, DETAIL_WINDOW


class _ScenarioNames(Sequence[str]):
    """The names of `inspector.scenarios.SCENARIOS` (the core's list), read on first use.

    The core imports torch (about a second), so the names are looked up only when argparse
    needs them: `demo --help` and `demo --scenario NAME` (which trains, so imports torch anyway).
    `--help`, `--version` and the other subcommands do without.
    """

    @cached_property
    def _names(self) -> tuple[str, ...]:
        from inspector.scenarios import SCENARIOS

        return tuple(SCENARIOS)

    def __getitem__(self, i: Any) -> Any:  # an index gives a name, a slice a tuple of names
        return self._names[i]

    def __len__(self) -> int:
        return len(self._names)


SCENARIOS: Sequence[str] = _ScenarioNames()

DESCRIPTION = """\
A live, browser-based inspector for PyTorch gradients.

  gradient-inspector demo                 train a built-in scenario, open http://127.0.0.1:8000
  gradient-inspector replay [FILE]        browse a recorded run (read-only)
  gradient-inspector export [FILE] ...    write a recorded run as CSV, JSON Lines or an HTML report

In your own script:  insp = inspector.attach(model, optimizer); insp.serve()
"""

SECURITY = """\
security: the server binds 127.0.0.1 by default. Any other --host requires a token:
one is generated when --token is not given, and printed once in the URL
(http://HOST:PORT/#token=T). The page keeps it for its own origin (no cookie).
Scripts send 'Authorization: Bearer T' (or ?token=T).
agent interface: MCP (streamable HTTP) at http://HOST:PORT/mcp, behind the same
guards and token; its write tools refuse on a --read-only server. It needs the
mcp package: pip install gradient-inspector[agent].
"""


def _rate(text: str) -> float | None:
    if text.lower() in ("0", "none", "max", "unlimited"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= 10_000:
        raise argparse.ArgumentTypeError(f"must be in (0, 10000], or 0 for no cap: {text!r}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0..65535: {text!r}")
    return value


def _add_server_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help=f"bind address (default {DEFAULT_HOST}; anything else requires a token)",
    )
    p.add_argument(
        "--port", type=_port, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT}; 0: any free)"
    )
    p.add_argument(
        "--token",
        default=os.environ.get("GRADIENT_INSPECTOR_TOKEN") or None,
        help="access token (default: $GRADIENT_INSPECTOR_TOKEN if set; else none on loopback, "
        "generated for any other --host)",
    )
    p.add_argument(
        "--trusted-proxy",
        metavar="ADDR",
        default=None,
        help="believe X-Forwarded-For from this reverse proxy's address (comma-separated, or '*'); "
        "by default the header is ignored",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradient-inspector",
        description=DESCRIPTION,
        epilog=SECURITY,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="{demo,replay,export}")

    demo = sub.add_parser(
        "demo",
        help="train a built-in scenario and serve the dashboard",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=SECURITY,
        description=(
            "Train a built-in scenario in a background thread and serve the dashboard.\n\n"
            "Scenarios: mlp (a small MLP, nothing wrong), exploding (gradients blow up: try clip_norm),\n"
            "nan (a bad batch poisons the weights: try nan_guard), tiny_gpt (a small transformer),\n"
            "deep (993 tensors, one block goes unstable: find it from the worst-now list, try scale).\n\n"
            "Training starts when the first page connects (--no-wait: at once), so the scenario can\n"
            "be followed from step 0, and runs until Ctrl-C, at most --steps-per-second steps a second\n"
            "(changeable from the page). Every step is sampled (every=1). A scenario whose loss stays\n"
            "non-finite for 30 steps is reset in place: same run, same hooks, the step count goes on,\n"
            "and a scenario_reset event marks it. Each start is a new run in the database.\n\n"
            "Checkpoints: every 10 steps (nan 8, tiny_gpt 25), the newest few kept in memory, so a hint's\n"
            "'rewind to before step N' finds one. A scenario whose hint names a step (exploding 40,\n"
            "nan 30, deep 60) pauses 5 steps before it, once, with the reason on the page, until you\n"
            "resume (--no-pause-before-hint: it does not)."
        ),
    )
    # a metavar, so that argparse lists the choices (and imports the core) only when help is printed
    demo.add_argument(
        "--scenario",
        choices=SCENARIOS,
        default="mlp",
        metavar="NAME",
        help="which scenario: %(choices)s (default mlp)",
    )
    _add_server_options(demo)
    demo.add_argument(
        "--db",
        default=DEFAULT_DB,
        metavar="FILE",
        help=f"history database, a new run in it per start (default ./{DEFAULT_DB})",
    )
    demo.add_argument("--no-db", action="store_true", help="keep no history on disk")
    demo.add_argument(
        "--detail-window",
        type=int,
        default=DETAIL_WINDOW,
        metavar="N",
        help="recorded snapshots whose per-tensor statistics the history keeps for every step; older"
        f" steps keep them on every 8th (default {DETAIL_WINDOW})",
    )
    demo.add_argument(
        "--read-only",
        action="store_true",
        help="serve the dashboard and the stream, answer every command with 403",
    )
    demo.add_argument(
        "--steps-per-second",
        type=_rate,
        default=10.0,
        metavar="X",
        help="cap on training speed (default 10; 0 for none); the page can change it",
    )
    demo.add_argument(
        "--hooks",
        metavar="PRESET.json",
        help="start with these hooks (a preset, as GET /api/hooks/export writes it)",
    )
    demo.add_argument(
        "--rules",
        metavar="RULES.json",
        help="start with these rules (a JSON file as insp.save_rules() writes it, or a preset's name: "
        '"safe overnight", "clip on spike"); see docs/rules-and-agents.md',
    )
    demo.add_argument(
        "--no-wait",
        action="store_true",
        help="start training at once instead of waiting for the first page to connect",
    )
    demo.add_argument(
        "--no-shadow",
        action="store_true",
        help="do not start a shadow comparison at each hook change from the page (the page's "
        "'compare from here' still does; a shadow costs a second training step per step)",
    )
    demo.add_argument(
        "--no-pause-before-hint",
        action="store_true",
        help="train straight through the step a scenario's hint names (by default exploding, nan "
        "and deep pause 5 steps before it, once, saying why, until you resume)",
    )
    demo.add_argument("--seed", type=int, default=0, help="the scenario's random seed (default 0)")
    demo.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="torch CPU threads (default: 1 for mlp, exploding and nan, whose layers are too small "
        "to gain from more; torch's default for tiny_gpt)",
    )

    replay = sub.add_parser(
        "replay",
        help="serve a recorded run, read-only",
        epilog=SECURITY,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve a recorded run from a database, read-only: the page can browse every run in "
        "the file. Nothing is added to the file.",
    )
    replay.add_argument(
        "file", nargs="?", default=DEFAULT_DB, metavar="FILE", help=f"the database (default ./{DEFAULT_DB})"
    )
    replay.add_argument(
        "--run", type=int, default=None, metavar="ID", help="the run to open (default: the latest)"
    )
    _add_server_options(replay)

    export = sub.add_parser(
        "export",
        help="write a recorded run as CSV, JSON Lines or an HTML report",
        description="Write a recorded run. csv: one row per (step, parameter). jsonl: one JSON object a "
        "line: the run, its hook changes, its events, its snapshots. html: one self-contained "
        "report to share (about 5 MB: plotly.js is inlined; opens offline in any browser) with "
        "the run's charts (loss, global grad norm, per-parameter norms, abs-max and update "
        "ratios, at most 2000 steps, evenly spaced), its hook-change log and its events.",
    )
    export.add_argument(
        "file", nargs="?", default=DEFAULT_DB, metavar="FILE", help=f"the database (default ./{DEFAULT_DB})"
    )
    export.add_argument("--run", type=int, default=None, metavar="ID", help="the run (default: the latest)")
    export.add_argument("--format", choices=("csv", "jsonl", "html"), required=True, help="output format")
    export.add_argument(
        "-o",
        "--output",
        metavar="OUT",
        help="output file (default: standard output for csv and jsonl; run-ID.html in the "
        "current directory for html; '-' for standard output)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from .app import version

        print(f"gradient-inspector {version()}")
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return {"demo": run_demo, "replay": run_replay, "export": run_export}[args.command](args)
    except KeyboardInterrupt:
        return 130
    except _Fail as e:
        print(f"gradient-inspector: {e}", file=sys.stderr)
        return 2


class _Fail(Exception):
    pass


def _serve(app: Any, settings: Any, lines: list[str]) -> int:
    import uvicorn

    from .serving import PortInUse, bind, uvicorn_config

    try:
        sock = bind(settings.host, settings.port)
    except PortInUse as e:
        raise _Fail(e.strerror) from None
    port = sock.getsockname()[1]
    print(f"gradient-inspector: open {settings.url(port)}", flush=True)
    if settings.host.strip("[]") in ("0.0.0.0", "::"):
        print(
            "gradient-inspector: listening on every interface; from another machine use this host's address",
            flush=True,
        )
    for line in lines:
        print(f"gradient-inspector: {line}", flush=True)
    uvicorn.Server(uvicorn_config(app, settings, quiet=False)).run(sockets=[sock])
    return 0


def run_demo(args: argparse.Namespace) -> int:
    import inspector
    from inspector import scenarios

    from .app import create_app
    from .history.storage import HistoryStore
    from .live.demo import Trainer
    from .live.source import LiveSource
    from .settings import Settings

    try:
        settings = Settings(
            host=args.host,
            port=args.port,
            token=args.token,
            read_only=args.read_only,
            trusted_proxy=args.trusted_proxy,
            detail_window=args.detail_window,
        )
    except ValueError as e:
        raise _Fail(str(e)) from None
    preset = None
    if args.hooks:
        try:
            with open(args.hooks, encoding="utf-8") as f:
                preset = json.load(f)
        except (OSError, ValueError) as e:
            raise _Fail(f"--hooks {args.hooks}: {e}") from None
    import torch

    threads = args.threads if args.threads is not None else (None if args.scenario == "tiny_gpt" else 1)
    if threads is not None:
        if threads < 1:
            raise _Fail(f"--threads must be at least 1, got {threads}")
        torch.set_num_threads(threads)
    sc = scenarios.make(args.scenario, seed=args.seed)
    # the demo shows the flight recorder and spike detection (off by default: a fixed cost a step)
    insp = inspector.attach(
        sc.model,
        sc.optimizer,
        every=1,
        flight=256,
        checkpoint_every=sc.checkpoint_every,
        checkpoints=sc.checkpoints,
    )
    if preset is not None:
        try:
            insp.import_hooks(preset)
        except inspector.HookError as e:
            insp.close()
            raise _Fail(f"--hooks {args.hooks}: {e}") from None
    if args.rules:
        try:
            insp.load_rules(args.rules)
        except inspector.HookError as e:
            insp.close()
            raise _Fail(f"--rules {args.rules}: {e}") from None
    try:
        store = None if args.no_db else HistoryStore(args.db, detail_window=settings.detail_window)
    except StoreError as e:
        insp.close()
        raise _Fail(str(e)) from None
    scenario = {
        "name": sc.name,
        "description": sc.description,
        "try_this": getattr(sc, "try_this", None),
        "hint_step": getattr(sc, "hint_step", None),
    }
    trainer = Trainer(
        sc,
        insp,
        steps_per_second=args.steps_per_second,
        wait_for_client=not args.no_wait,
        auto_shadow=not args.no_shadow,
        pause_before_hint=None if args.no_pause_before_hint else 5,
    )
    source = LiveSource(
        insp,
        mode="demo",
        store=store,
        read_only=args.read_only,
        trainer=trainer,
        scenario=scenario,
        owns_inspector=True,
    )
    lines = [f"scenario {sc.name}: {sc.description}"]
    if not args.no_wait:
        lines.append("training starts when the first page connects (--no-wait: at once)")
    lines.append(f"history in {os.path.abspath(args.db)}" if store is not None else "no history (--no-db)")
    try:
        return _serve(create_app(source, settings), settings, lines)
    except _Fail:
        source.stop()  # never started: close the inspector and the database
        raise


def _open_store(path: str) -> Any:
    from .history.storage import HistoryStore

    try:
        return HistoryStore(path, read_only=True)
    except StoreError as e:
        raise _Fail(str(e)) from None


def run_replay(args: argparse.Namespace) -> int:
    from .app import create_app
    from .settings import Settings
    from .sources import ApiError, ReplaySource

    try:
        settings = Settings(
            host=args.host, port=args.port, token=args.token, read_only=True, trusted_proxy=args.trusted_proxy
        )
    except ValueError as e:
        raise _Fail(str(e)) from None
    store = _open_store(args.file)
    try:
        source = ReplaySource(store, args.run)
    except (ApiError, sqlite3.DatabaseError) as e:
        store.close()
        raise _Fail(
            str(e.detail) if isinstance(e, ApiError) else f"{args.file} cannot be read: {e}"
        ) from None
    try:
        return _serve(
            create_app(source, settings),
            settings,
            [f"replaying run {source.run_id} of {os.path.abspath(args.file)} (read-only)"],
        )
    except _Fail:
        store.close()
        raise


def run_export(args: argparse.Namespace) -> int:
    store = _open_store(args.file)
    try:
        _export(args, store)
    except (StoreError, sqlite3.DatabaseError) as e:  # nothing of the run can be read: one line
        raise _Fail(str(e) if isinstance(e, StoreError) else f"{args.file} cannot be read: {e}") from None
    finally:
        store.close()
    return 0


def _export(args: argparse.Namespace, store: Any) -> None:
    """`export`'s work. A row that cannot be read is skipped with a warning (history.py)."""
    from .history.export import write_csv, write_jsonl
    from .history.report import ReportError, page_source, plotly_source, write_html

    run = args.run if args.run is not None else store.latest_run_id()
    if run is None or store.run(run) is None:
        raise _Fail(
            f"{args.file}: no run {args.run}" if args.run is not None else f"{args.file} holds no run"
        )
    write = {"csv": write_csv, "jsonl": write_jsonl, "html": write_html}[args.format]
    if args.format == "html" and not args.output:
        args.output = f"run-{run}.html"  # a 5 MB page on a terminal helps nobody
    if args.output == "-":
        args.output = None
    if args.format == "html":
        try:
            plotly_source()  # fail before the output file is created
            page_source()
        except ReportError as e:
            raise _Fail(str(e)) from None
    if args.output:
        with open(args.output, "w", encoding="utf-8", newline="") as out:
            n = write(store, run, out)
        print(f"gradient-inspector: wrote {n} snapshots of run {run} to {args.output}", file=sys.stderr)
    else:
        write(store, run, sys.stdout)
