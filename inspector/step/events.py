"""The event log: each event's sequence number, and the events of the step under way.

:meth:`EventLog.emit` numbers an event, keeps it for the step under way (its snapshot carries the
step's events) and publishes it to subscribers at once. Any thread may emit; the sequence is
taken under the Inspector's lock.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ..feed import Feed
from ..wire.records import event_fields

__all__ = ["EventLog"]


class EventLog:
    """Numbers events, keeps the step's, and hands them to the feed."""

    def __init__(self, lock: threading.RLock, feed: Feed) -> None:
        self._lock = lock
        self._feed = feed
        self._seq = 0  # the last event's seq
        self._step: list[dict[str, Any]] = []  # events of the step under way

    @property
    def seq(self) -> int:
        """The last event's sequence number (0: none yet)."""
        return self._seq

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Record and publish an event ``{"seq", "kind", "time", **fields}``; returns it."""
        with self._lock:
            self._seq += 1
            ev = {"seq": self._seq, "kind": kind, "time": time.time(), **event_fields(fields)}
            self._step.append(ev)
        self._feed.publish("event", ev)
        return ev

    def take_step(self) -> list[dict[str, Any]]:
        """The events of the step under way, for its snapshot; the next step starts with none."""
        with self._lock:
            events, self._step = self._step, []
            return events
