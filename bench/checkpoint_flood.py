"""Checkpoint flood: the step rate of `gradient-inspector demo` while a client asks for
checkpoints 40 times a second, against no requests.

    .venv/bin/python bench/checkpoint_flood.py                         # tiny_gpt, ~2 min
    .venv/bin/python bench/checkpoint_flood.py --scenario mlp --seconds 8

Any client allowed to send commands can ask for checkpoints; each one is a copy of the model
and the optimizer state made by the training thread at its next step boundary. Waiting
requests are bounded (at most `keep`, 3, wait; one more is a 429) and the requests carried out
at one boundary share one copy, so the flood should cost at most one copy per step.

The server is `gradient-inspector demo --scenario S --steps-per-second 0` (no cap, history on)
in a process of its own; the flood is a thread here (`POST /api/checkpoints` every 1/rate s,
under the server's per-address command budget of 50 a second). Windows of `--seconds` each,
alternating: quiet, flooded, quiet, ... (`--rounds` flooded windows): each flooded window's
step rate is compared with the mean of its two quiet neighbours (the machine is shared), and
the median of those ratios is the figure. Also reported: the answers (202 and 429 counts),
checkpoints kept and their bytes, and the server's RSS before and after.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.error import HTTPError
from urllib.request import Request, urlopen

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.hardening.tools import rss_bytes  # noqa: E402
from tests.support import start_demo  # noqa: E402


def get_json(url: str) -> dict:
    with urlopen(url, timeout=30) as r:
        return json.load(r)


def post(url: str) -> int:
    req = Request(url, data=b"", method="POST")
    try:
        with urlopen(req, timeout=30) as r:
            return int(r.status)
    except HTTPError as e:
        return int(e.code)


def flood(base: str, rate: float, stop: threading.Event, codes: dict[int, int]) -> None:
    period = 1.0 / rate
    t = time.monotonic()
    while not stop.is_set():
        code = post(f"{base}/api/checkpoints")
        codes[code] = codes.get(code, 0) + 1
        t += period
        stop.wait(max(0.0, t - time.monotonic()))


def window(base: str, seconds: float) -> float:
    """Steps a second over `seconds`, from the server's own step counter."""
    s0, t0 = get_json(f"{base}/api/session")["training"]["step"], time.monotonic()
    time.sleep(seconds)  # a measurement window, not a synchronisation
    s1, t1 = get_json(f"{base}/api/session")["training"]["step"], time.monotonic()
    return (s1 - s0) / (t1 - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default="tiny_gpt")
    ap.add_argument("--seconds", type=float, default=12.0, help="length of each window")
    ap.add_argument("--rounds", type=int, default=4, help="flooded windows")
    ap.add_argument("--rate", type=float, default=40.0, help="checkpoint requests a second")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        db = str(Path(tmp) / "flood.sqlite")
        server = start_demo(Path(tmp), scenario=args.scenario, rate="0", db=db, cwd=REPO, timeout=120)
        with server:
            base = server.base
            window(base, args.seconds)  # warm-up
            rss0 = rss_bytes(server.proc.pid)
            quiet = [window(base, args.seconds)]
            loaded: list[float] = []
            codes: dict[int, int] = {}
            for _ in range(args.rounds):
                stop = threading.Event()
                t = threading.Thread(target=flood, args=(base, args.rate, stop, codes), daemon=True)
                t.start()
                loaded.append(window(base, args.seconds))
                stop.set()
                t.join(30)
                quiet.append(window(base, args.seconds))
            rss1 = rss_bytes(server.proc.pid)
            cps = get_json(f"{base}/api/checkpoints")
        ratios = [w / ((quiet[i] + quiet[i + 1]) / 2) for i, w in enumerate(loaded)]
        print(
            f"scenario {args.scenario}, {args.rate:g} checkpoint requests a second, {args.seconds:g} s windows"
        )
        print("quiet steps/s:   " + " ".join(f"{q:.2f}" for q in quiet))
        print("flooded steps/s: " + " ".join(f"{w:.2f}" for w in loaded))
        print(
            f"flooded / quiet: median {statistics.median(ratios):.3f} ({' '.join(f'{r:.3f}' for r in ratios)})"
        )
        print(f"answers: {dict(sorted(codes.items()))}")
        print(f"checkpoints kept: {len(cps['checkpoints'])}, {cps['bytes'] / 2**20:.1f} MiB")
        print(f"server RSS: {rss0 / 2**20:.0f} -> {rss1 / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
