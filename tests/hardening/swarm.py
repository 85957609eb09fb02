"""A swarm of websocket clients in a process of its own, for the load tests and bench/load.py.

    python -m tests.hardening.swarm --url ws://127.0.0.1:PORT/ws --readers 8 --slow 4 --stalled 4 --reconnect 4

Kinds of client (all on one asyncio loop):

- reader: reads every message as soon as it arrives;
- slow: waits `--slow-delay` seconds after each message it reads (the server coalesces for it);
- stalled: completes the handshake on a raw socket with a tiny receive buffer, then never reads
  again, not even at the TCP level;
- reconnect: connects, reads hello and three snapshots, closes, waits `--reconnect-delay`
  seconds (the dashboard's shortest backoff is 0.5 s; 0 for a storm), again, until told to stop.

Prints `READY` once every client has had its first hello, then runs until a line `stop` (or
end of input) arrives on stdin, and prints one JSON line: per kind, the snapshots seen, the
order violations (a snapshot step not above the previous one on that connection, hello's
history included; a `hooks` config_version below the previous one), close codes, cycles.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import socket
import sys
import time
from typing import Any
from urllib.parse import urlsplit


class Stats:
    def __init__(self, kind: str, index: int) -> None:
        self.kind, self.index = kind, index
        self.snapshots = 0
        self.messages = 0
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.violations: list[str] = []
        self.hooks_versions: list[int] = []
        self.close_codes: list[int | None] = []
        self.cycles = 0
        self.hello_s: list[float] = []
        self.errors: list[str] = []

    def report(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items()}


class Stream:
    """Order checks for one connection."""

    def __init__(self, stats: Stats) -> None:
        self.stats = stats
        self.last = -1
        self.version = -1

    def hello(self, msg: dict[str, Any]) -> None:
        if msg.get("type") != "hello":
            self.stats.violations.append(f"first message is {msg.get('type')!r}, not hello")
            return
        for snap in msg["history"]:
            self.snapshot(snap["step"], count=False)
        self.version = msg["session"]["config_version"]

    def snapshot(self, step: int, count: bool = True) -> None:
        s = self.stats
        if step <= self.last:
            s.violations.append(f"step {step} after {self.last}")
        self.last = step
        if count:
            s.snapshots += 1
            s.first_step = step if s.first_step is None else s.first_step
            s.last_step = step

    def message(self, msg: dict[str, Any]) -> None:
        self.stats.messages += 1
        if msg["type"] == "snapshot":
            self.snapshot(msg["data"]["step"])
        elif msg["type"] == "hooks":
            v = msg["config_version"]
            if v < self.version:
                self.stats.violations.append(f"config_version {v} after {self.version}")
            self.version = v
            self.stats.hooks_versions.append(v)


async def reader(url: str, stats: Stats, ready: asyncio.Event, stop: asyncio.Event, delay: float) -> None:
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    try:
        async with connect(url, max_size=None, proxy=None, open_timeout=30) as ws:
            t0 = time.monotonic()
            stream = Stream(stats)
            stream.hello(json.loads(await ws.recv()))
            stats.hello_s.append(time.monotonic() - t0)
            ready.set()
            while not stop.is_set():
                try:
                    text = await asyncio.wait_for(ws.recv(), 0.5)
                except TimeoutError:
                    continue
                stream.message(json.loads(text))
                if delay:
                    await asyncio.sleep(delay)  # a slow consumer, on purpose
    except ConnectionClosed as e:
        stats.close_codes.append(e.rcvd.code if e.rcvd else None)
    except Exception as e:  # noqa: BLE001 - reported
        stats.errors.append(f"{type(e).__name__}: {e}")
    finally:
        ready.set()


async def reconnecting(
    url: str, stats: Stats, ready: asyncio.Event, stop: asyncio.Event, delay: float
) -> None:
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    while not stop.is_set():
        try:
            async with connect(url, max_size=None, proxy=None, open_timeout=30) as ws:
                t0 = time.monotonic()
                stream = Stream(stats)
                stream.hello(json.loads(await ws.recv()))
                stats.hello_s.append(time.monotonic() - t0)
                ready.set()
                seen = 0
                while seen < 3 and not stop.is_set():
                    try:
                        msg = json.loads(await asyncio.wait_for(ws.recv(), 0.5))
                    except TimeoutError:
                        continue
                    stream.message(msg)
                    seen += msg["type"] == "snapshot"
            stats.cycles += 1
            if delay:
                try:  # the client's backoff before it connects again; a stop ends it early
                    await asyncio.wait_for(stop.wait(), delay)
                except TimeoutError:
                    pass
        except ConnectionClosed as e:
            stats.close_codes.append(e.rcvd.code if e.rcvd else None)
        except Exception as e:  # noqa: BLE001 - reported
            stats.errors.append(f"{type(e).__name__}: {e}")
            ready.set()
            return


def stalled_socket(url: str) -> socket.socket:
    """A websocket whose owner never reads: a raw socket with a tiny receive buffer."""
    parts = urlsplit(url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(30)
    sock.connect((parts.hostname, parts.port))
    key = base64.b64encode(os.urandom(16)).decode()
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    sock.sendall(
        (
            f"GET {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        byte = sock.recv(1)  # byte by byte: the response head and nothing after it
        if not byte:
            raise ConnectionError("closed during the handshake")
        head += byte
    if not head.startswith(b"HTTP/1.1 101"):
        raise ConnectionError(head.decode(errors="replace"))
    return sock


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    stats: list[Stats] = []
    tasks = []
    readies: list[asyncio.Event] = []
    plan = [("reader", args.readers), ("slow", args.slow), ("reconnect", args.reconnect)]
    for kind, n in plan:
        for i in range(n):
            st = Stats(kind, i)
            stats.append(st)
            ready = asyncio.Event()
            readies.append(ready)
            if kind == "reconnect":
                tasks.append(
                    asyncio.create_task(reconnecting(args.url, st, ready, stop, args.reconnect_delay))
                )
            else:
                delay = args.slow_delay if kind == "slow" else 0.0
                tasks.append(asyncio.create_task(reader(args.url, st, ready, stop, delay)))
    stalled = []
    for _ in range(args.stalled):
        stalled.append(await asyncio.to_thread(stalled_socket, args.url))
    await asyncio.wait_for(asyncio.gather(*(r.wait() for r in readies)), 60)
    print("READY", flush=True)
    t0 = time.monotonic()
    await loop.run_in_executor(None, _wait_for_stop)
    stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
    for sock in stalled:
        sock.close()
    return {"seconds": time.monotonic() - t0, "stalled": len(stalled), "clients": [s.report() for s in stats]}


def _wait_for_stop() -> None:
    for line in sys.stdin:
        if line.strip() == "stop":
            return


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--readers", type=int, default=8)
    p.add_argument("--slow", type=int, default=4)
    p.add_argument("--stalled", type=int, default=4)
    p.add_argument("--reconnect", type=int, default=4)
    p.add_argument("--slow-delay", type=float, default=0.2)
    p.add_argument("--reconnect-delay", type=float, default=0.5)
    args = p.parse_args(argv)
    report = asyncio.run(main_async(args))
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
