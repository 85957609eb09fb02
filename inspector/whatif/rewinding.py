"""The Inspector's checkpoint API: ``checkpoint()``, ``rewind()``, ``checkpoints`` (see
:mod:`inspector.whatif.checkpoints` for what is saved and when requests are carried out)."""

from __future__ import annotations

from typing import Any

from .checkpoints import Checkpoints

__all__ = ["Rewinding"]


class Rewinding:
    """The Inspector's checkpoint API (a base class: the state it uses is the Inspector's)."""

    _branches: Checkpoints
    _under_way: bool

    def checkpoint(self, label: str | None = None) -> str:
        """Save the model's, the optimizer's (and scaler's) and the inspector's state to host memory.

        Taken at the next step boundary, or at once when called from the training thread between
        steps, while training is held at a boundary (paused), or after training finished. Only the
        newest ``checkpoints`` (an ``attach`` option, default 3) are kept.

        Returns:
            The checkpoint's id (``"c1"``, ``"c2"``, ...), for :meth:`rewind`.

        Raises:
            CheckpointError: checkpoints cannot be right here (the message says why: under
                torch.distributed, without a torch optimizer, ``checkpoints=0`` ...).
        """
        return self._branches.checkpoint(label)

    def rewind(self, checkpoint: str) -> dict[str, Any]:
        """Go back to a checkpoint: state, step counter and hook config become the checkpoint's.

        Carried out by the training thread at the next step boundary (at once from the training
        thread between steps, or while held at a boundary). Your data loader goes on: the next
        batches are not those that followed the checkpoint the first time. Subscribers get a
        ``rewind`` event (the server keeps the abandoned steps as a branch run of their own).

        Returns:
            ``{"checkpoint", "step", "done"}``: ``done`` is true when it was carried out already.

        Raises:
            CheckpointNotFound: no such checkpoint kept. CheckpointError: refused (see checkpoint()).
        """
        return self._branches.rewind(checkpoint)

    @property
    def checkpoints(self) -> Checkpoints:
        """The checkpoints: ``.list()``, ``.summary()``, ``.bytes``, ``.keep``, ``.add_state(...)``."""
        return self._branches

    def _drain_locked(self, *, torch_ok: bool) -> None:
        branches = self._branches
        if branches._queue and branches.holds_changes:
            # an automatic checkpoint (before a change from the dashboard) is taken before the
            # change applies: until then the change waits for a safe point
            if not torch_ok or self._under_way:
                return
            branches.service()
        super()._drain_locked(torch_ok=torch_ok)  # type: ignore[misc]
        # where edits apply with torch hooks in reach and no step under way, requests do too
        if torch_ok and branches._queue and not self._under_way:
            branches.service()
