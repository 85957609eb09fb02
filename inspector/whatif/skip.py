"""The data position, and skipping batches after a rewind: ``insp.batches(loader)``,
``insp.take_batch()``, ``insp.rewind(checkpoint, skip=...)``.

The recovery published for large runs after a loss spike: go back to a checkpoint taken some steps
before it, and skip the batches that led to it. :class:`BatchCursor` is the part that knows where
the run is in its data:

- ``for batch in insp.batches(loader):`` wraps any iterable (a ``DataLoader``, a generator, a
  list). Every batch the loop receives gets the next **batch index**: its position in the data
  order, counted from 0 over the run, across epochs (call ``insp.batches(loader)`` once per
  epoch: the count goes on). The cursor notes which step consumed each batch (the step under way
  when it was handed out; several batches for one step under gradient accumulation).
- A checkpoint records the **data position**: the index of the next batch the loop will receive.
- ``insp.rewind(cp, skip=...)`` rewinds and names a **window** of batch indices that no step
  of the new branch receives. ``skip``:

  - ``"since_checkpoint"``: the batches handed out since the checkpoint (its position up to the
    newest one received): the batches that led to the incident;
  - ``N`` (an int >= 1): the N batches from the checkpoint's position; those not received yet
    are drawn from the loader and dropped;
  - ``(first, last)``: an explicit window of batch indices (inclusive).

  ``None`` skips nothing. A rewind replaces the window a rewind before it left pending (that
  window was the abandoned branch's): after ``rewind(cp2)`` without ``skip`` no batch is dropped.
  A window that leaves more than ``MAX_SKIP`` batches (or, where the iterable has a ``len()``,
  more than that) to draw and drop is refused: the training thread reads them one by one.
  The window is recorded: a ``batches_skipped`` event (``first``, ``last``, ``count``, ``steps``:
  the first and last step of the abandoned branch that had received some of them, ``ahead``:
  those still to be drawn and dropped, ``seek``, ``checkpoint``, ``reason``).

Two kinds of data source:

- **A loader that goes on** (the default; any iterable): the batches are never read twice.
  After a rewind the loop gets the batches that come after those already received, so the
  batches from the checkpoint's position to the newest received are not seen again whether or
  not ``skip`` is given (as without this module); ``skip`` records them as the window, and a
  window reaching past them has the rest drawn and dropped. A window must therefore start at the
  checkpoint's position and reach at least the newest batch received (else refused: the loader
  cannot give batches back).
- **A seekable stream**: a data state registered with ``checkpoints.add_state(key, save, load,
  data=True)`` (the demo's scenarios: a generator's state). A rewind loads it, so the data goes
  back to the checkpoint's position too: without ``skip`` the same batches come again; with it,
  the window's batches are drawn and dropped as the loop reaches them, and any window at or after
  the checkpoint's position is possible.

A loop that someone else owns (the Lightning and Hugging Face callbacks: the trainer draws the
batches) cannot be handed a wrapped loader. It calls ``insp.take_batch()`` once per batch the
trainer hands it (per micro-batch under accumulation); the batch is counted as above, and a batch in
a window cannot be left undrawn, so the caller makes it have no effect instead (Lightning: its
``training_step`` is not called; the Hugging Face Trainer: its outputs are replaced so that its
backward gives every parameter an exact zero), and a step whose batches were all dropped makes no
update: the lifecycle sets every gradient of the optimizer to None, as a ``nan_guard`` ``skip``
does (a ``step_skipped`` event, reason ``batches_skipped``). Such a loader goes on, as above.

A ``DataLoader`` with workers: the cursor counts what the loop receives, not what the workers
have prefetched, so the window lands on the right batches; a dropped batch is still loaded (by a
worker). No sampler-level wrapper is offered: a sampler runs ahead of the loop by
``num_workers * prefetch_factor`` batches, so a skip applied there would hit the wrong ones.

Threads: the wrapper runs on the training thread; a rewind is carried out by the training thread
at a boundary (``Checkpoints``), which holds the Inspector's lock; the cursor's state is read and
written under that lock, never while the loader is being read. Between two dropped batches the
wrapper calls ``between`` (``StepLifecycle.between_batches``): a window is reached between two
steps, so a pause holds there and requests are carried out there as at a boundary, and once the
Inspector is closed the window is abandoned (the rest come as they are). No tensor is read: the cursor
costs a lock and a few integers per batch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ..wire.errors import HookError, shown

__all__ = ["BatchCursor", "SINCE_CHECKPOINT", "check_skip", "MAX_SKIP"]

SINCE_CHECKPOINT = "since_checkpoint"
MAX_STEPS = 10_000  # steps whose batch range is kept (for the window's steps)
MAX_WINDOWS = 100  # skipped windows kept (the events carry every one)
# At most this many batches are drawn and dropped for one window: the training thread reads them
# one by one, and a window past the data would have it read forever (a count is refused above it)
MAX_SKIP = 100_000


def check_skip(skip: Any) -> tuple[Any, ...] | None:
    """``skip`` as given to ``rewind``, checked for its form: None (no skip), ``("since",)``,
    ``("count", n)`` or ``("range", first, last)``. Raises HookError (``loc`` ``("skip",)``)."""
    if skip is None or skip is False:
        return None
    if isinstance(skip, str):
        if skip == SINCE_CHECKPOINT:
            return ("since",)
        raise HookError(
            ("skip",), f'must be "{SINCE_CHECKPOINT}", a count or [first, last] (got {shown(skip)})'
        )
    if isinstance(skip, int) and not isinstance(skip, bool):
        if skip < 1:
            raise HookError(("skip",), f"a count of batches must be >= 1 (got {skip})")
        if skip > MAX_SKIP:
            raise HookError(
                ("skip",),
                f"a count of batches must be <= {MAX_SKIP} (MAX_SKIP; got {skip}): the batches not "
                "received yet are drawn and dropped one by one by the training thread",
            )
        return ("count", skip)
    if isinstance(skip, list | tuple | range):
        if isinstance(skip, range):
            if skip.step != 1 or len(skip) == 0:
                raise HookError(("skip",), f"a range of batches must be non-empty, step 1 (got {skip!r})")
            return ("range", skip.start, skip.stop - 1)
        if len(skip) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in skip):
            raise HookError(("skip",), f"a window must be [first, last], two integers (got {shown(skip)})")
        first, last = skip
        if first < 0 or last < first:
            raise HookError(
                ("skip",), f"a window [first, last] needs 0 <= first <= last (got [{first}, {last}])"
            )
        return ("range", first, last)
    raise HookError(("skip",), f'must be "{SINCE_CHECKPOINT}", a count or [first, last] (got {shown(skip)})')


class BatchCursor:
    """The run's data position and the skipped windows; see the module docstring.

    Args:
        lock: the Inspector's lock (the cursor's state is under it).
        step_under_way: the number of the step the next batch goes to (the clock's step + 1).
        between: called (lock held) after each batch :meth:`wrap` drops: the training thread
            between two steps, where a pause holds and requests are carried out; False once the
            Inspector is closed (the window is then abandoned: the rest come as they are).
    """

    def __init__(
        self,
        lock: Any,
        step_under_way: Callable[[], int],
        between: Callable[[], bool] | None = None,
    ) -> None:
        self._lock = lock
        self._step = step_under_way
        self._between = between
        self.position = 0  # the index of the next batch the loop receives
        self.used = False  # batches were counted: the position is known
        self.epochs = 0  # insp.batches(...) calls
        self.length: int | None = None  # len() of the newest iterable wrap() was given, when it has one
        self._steps: deque[list[int]] = deque(maxlen=MAX_STEPS)  # [step, first, last] of the batches received
        self._skip: tuple[int, int] | None = None  # the window still to drop as the loop reaches it
        self.windows: deque[dict[str, Any]] = deque(maxlen=MAX_WINDOWS)
        self.dropped = 0  # batches drawn and dropped so far
        self._mine: list[int] | None = None  # [step, kept, dropped] of take()'s newest step

    # ------------------------------------------------------------ the training thread
    def wrap(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """``insp.batches(iterable)``: the batches of ``iterable``, counted, with a skipped
        window's batches drawn and dropped. Raises TypeError at once for a non-iterable."""
        it = iter(iterable)
        try:
            length: int | None = len(iterable)  # type: ignore[arg-type]
        except Exception:  # no len() (a generator, an IterableDataset's loader)
            length = None
        with self._lock:
            self.epochs += 1
            self.used = True
            self.length = length if isinstance(length, int) and length >= 0 else None
        return self._batches(it)

    def _batches(self, it: Iterator[Any]) -> Iterator[Any]:
        while True:
            try:
                batch = next(it)  # never under the lock: a loader may block
            except StopIteration:
                return
            with self._lock:
                drop = self._count()
                if drop and self._between is not None and not self._between():
                    self._skip = None  # closed: nothing of ours filters the data any more
            if not drop:
                yield batch

    def take(self) -> bool:
        """``insp.take_batch()``: count one batch that a loop the caller does not own (a trainer's)
        received; True when it falls in a skipped window: the caller must let it have no effect
        (the callbacks do: Lightning's ``training_step`` is not called, the Hugging Face Trainer's
        backward gives zeros), and a step whose batches were all dropped makes no update
        (:meth:`step_dropped`)."""
        with self._lock:
            self.used = True
            drop = self._count()
            step = self._step()
            mine = self._mine
            if mine is None or mine[0] != step:
                self._mine = mine = [step, 0, 0]
            mine[2 if drop else 1] += 1
            return drop

    def step_dropped(self, step: int) -> bool:
        """Whether step ``step`` received batches through :meth:`take` and every one was dropped."""
        mine = self._mine
        return mine is not None and mine[0] == step and mine[2] > 0 and mine[1] == 0

    def _count(self) -> bool:
        """The next batch: its index counted, and whether it falls in the window (lock held)."""
        p = self.position
        self.position += 1
        skip = self._skip
        if skip is not None and skip[0] <= p <= skip[1]:
            self.dropped += 1
            if p >= skip[1]:
                self._skip = None
            return True
        if skip is not None and p > skip[1]:
            self._skip = None
        step = self._step()
        last = self._steps[-1] if self._steps else None
        if last is not None and last[0] == step and last[2] == p - 1:
            last[2] = p
        else:
            self._steps.append([step, p, p])
        return False

    # ------------------------------------------------------------ rewinds (lock held, Checkpoints)
    def plan(
        self, cp_position: int, skip: tuple[Any, ...] | None, *, seekable: bool
    ) -> tuple[int, int] | None:
        """The window ``(first, last)`` of ``skip`` (from :func:`check_skip`) for a rewind to a
        checkpoint at data position ``cp_position``, or None. Raises HookError (``skip``), changing
        nothing, when it cannot be honoured."""
        if skip is None:
            return None
        if not self.used:
            raise HookError(
                ("skip",),
                "the data position is unknown: iterate your batches through insp.batches(loader) "
                "(a trainer's loop: call insp.take_batch() for each batch) so that a rewind can skip some",
            )
        now = self.position  # the next batch; those before it were received (or dropped)
        if skip[0] == "since":
            if now <= cp_position:
                raise HookError(
                    ("skip",),
                    f"no batch was received since the checkpoint (data position {cp_position}): nothing to skip",
                )
            return (cp_position, now - 1)
        first, last = (cp_position, cp_position + skip[1] - 1) if skip[0] == "count" else (skip[1], skip[2])
        if first < cp_position:
            raise HookError(
                ("skip",),
                f"the window [{first}, {last}] starts before the checkpoint's data position {cp_position}: "
                "those batches came before the step the run goes back to",
            )
        if not seekable:
            if first != cp_position:
                raise HookError(
                    ("skip",),
                    f"your loader goes on (it is not read twice): the batches {cp_position}-{now - 1} "
                    f"received since the checkpoint are not seen again, so a window must start at the "
                    f"checkpoint's data position {cp_position} (got {first})",
                )
            if last < now - 1:
                raise HookError(
                    ("skip",),
                    f"your loader goes on (it is not read twice): the {now - cp_position} batches "
                    f"{cp_position}-{now - 1} received since the checkpoint are not seen again, so a "
                    f"window must reach batch {now - 1} at least (got [{first}, {last}]): skip at least "
                    f"{now - cp_position}",
                )
        # the batches still to draw and drop: from the window's start, or from the next batch when
        # the loader goes on (those received since the checkpoint are not read again)
        ahead = last - max(first, cp_position if seekable else now) + 1
        if ahead > MAX_SKIP:
            raise HookError(
                ("skip",),
                f"the window [{first}, {last}] leaves {ahead} batches to draw and drop, more than "
                f"{MAX_SKIP} (MAX_SKIP): the training thread would read them one by one before its next step",
            )
        if self.length is not None and ahead > self.length:
            raise HookError(
                ("skip",),
                f"the window [{first}, {last}] leaves {ahead} batches to draw and drop, more than your "
                f"loader holds ({self.length} batches, its len()): it would drop the data whole",
            )
        return (first, last)

    def rewound(
        self,
        *,
        cp_id: str,
        cp_step: int,
        cp_position: int,
        from_step: int,
        window: tuple[int, int] | None,
        seekable: bool,
        asked: Any,
    ) -> dict[str, Any] | None:
        """After a rewind (lock held): the position goes back with a seekable stream (the data was
        loaded back) and the window is set, replacing any still pending (``window`` None: none is
        pending, a rewind without skip skips nothing); returns the ``batches_skipped`` event's
        fields, or None."""
        before = self.position
        self._mine = None  # (the step numbers of the new branch come again)
        first, last = window if window is not None else (0, -1)
        # the steps of the abandoned branch that had received some of the window's batches
        steps = [s for s, a, b in self._steps if s > cp_step and a <= last and b >= first]
        if seekable:
            # the data went back: the steps of the new branch are counted again
            self.position = cp_position
            while self._steps and self._steps[-1][0] > cp_step:
                self._steps.pop()
        # the window of this rewind, or none: one still pending was the abandoned branch's
        self._skip = window
        if window is None:
            return None
        received = max(0, min(last, before - 1) - first + 1)
        ahead = last - max(first, self.position) + 1
        count = last - first + 1
        fields = {
            "checkpoint": cp_id,
            "step": cp_step,
            "from_step": from_step,
            "first": first,
            "last": last,
            "count": count,
            "received": received,
            "ahead": max(0, ahead),
            "steps": [min(steps), max(steps)] if steps else None,
            "seek": seekable,
            "reason": f"rewind to {cp_id} with skip={asked!r}",
        }
        where = f" (received by steps {fields['steps'][0]}-{fields['steps'][1]})" if steps else ""
        fields["message"] = (
            f"batches {first}-{last} skipped ({count}){where} after the rewind to {cp_id} (step {cp_step}); "
            f"the next batch is {last + 1 if self.position >= first else self.position}"
        )
        self.windows.append({k: v for k, v in fields.items() if k != "message"})
        return fields

    def state(self) -> dict[str, Any]:
        """``{"position", "used", "epochs", "dropped", "pending", "windows"}`` (a copy, lock held by the caller or not)."""
        with self._lock:
            return {
                "position": self.position,
                "used": self.used,
                "epochs": self.epochs,
                "dropped": self.dropped,
                "pending": list(self._skip) if self._skip is not None else None,
                "windows": [dict(w) for w in self.windows],
            }
