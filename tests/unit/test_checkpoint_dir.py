"""Checkpoints on disk (``attach(..., checkpoint_dir=...)``) and ``insp.rewind(path)`` to a
torch.distributed.checkpoint directory the loop wrote itself: one process, no process group."""

from __future__ import annotations

import copy
import errno
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from inspector.wire.errors import CheckpointError
from tests.support import wait_until
from tests.unit.test_whatif import Loop, same_tensors

# the loop's own dcp.save/dcp.load without a process group: DCP warns that it assumes one process
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is .*single process:UserWarning")


def state(loop: Loop):
    return copy.deepcopy(loop.model.state_dict()), copy.deepcopy(loop.opt.state_dict())


def dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir())


def kinds(insp, kind: str) -> list[dict]:
    return [e for e in insp.events() if e["kind"] == kind]


def test_checkpoints_are_dcp_directories_the_newest_k_kept_and_a_rewind_reads_one_back_bitwise(tmp_path):
    (tmp_path / "theirs").mkdir()  # not ours: never deleted
    loop = Loop(checkpoint_dir=tmp_path, checkpoints=2)
    insp = loop.insp
    taken = {}
    for k in range(3):
        loop.run(range(5 * k, 5 * k + 5))
        cp = insp.checkpoint()
        taken[cp] = (insp.step, *state(loop))
    ids = list(taken)
    listed = insp.checkpoints.list()
    assert [c["id"] for c in listed] == ids[1:]
    assert dirs(tmp_path) == sorted(["theirs", "step-00000010-c2", "step-00000015-c3"])
    for c in listed:
        assert c["path"] == str(tmp_path / f"step-{c['step']:08d}-{c['id']}")
        wait_until(lambda c=c: (Path(c["path"]) / ".metadata").is_file(), what="the write")
    model_bytes = sum(t.numel() * t.element_size() for t in loop.model.state_dict().values())
    assert insp.checkpoints.bytes < model_bytes  # the state is on disk, not in host memory
    first_pass = dict(loop.losses)
    loop.run(range(15, 25))
    step, ref_model, ref_opt = taken["c2"]
    out = insp.rewind("c2")
    assert out == {"checkpoint": "c2", "step": 10, "done": True}
    assert insp.step == step == 10
    assert same_tensors(loop.model.state_dict(), ref_model)
    assert same_tensors(loop.opt.state_dict(), ref_opt)
    assert all(p.grad is None for p in loop.model.parameters())
    # replayed on the same batches: the same losses as the first time, bitwise
    loop.run(range(10, 15))
    assert {s: loop.losses[s] for s in range(11, 16)} == {s: first_pass[s] for s in range(11, 16)}
    # c3 was taken on the abandoned branch: dropped, and its directory deleted
    assert [c["id"] for c in insp.checkpoints.list()] == ["c2"]
    wait_until(lambda: dirs(tmp_path) == ["step-00000010-c2", "theirs"], what="c3's directory deleted")
    insp.close()


def own_save(loop: Loop, path: Path, layout: str) -> None:
    """The loop's own checkpoint: the plain layout, or DCP's tutorial's (state keyed by name)."""
    if layout == "plain":
        dcp.save({"model": loop.model.state_dict(), "optimizer": loop.opt.state_dict()}, checkpoint_id=path)
    else:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(loop.model, loop.opt)
        dcp.save({"app": {"model": model_sd, "optim": optim_sd}}, checkpoint_id=path)


@pytest.mark.parametrize("layout", ["plain", "tutorial"])
def test_a_rewind_to_the_loops_own_dcp_directory_with_the_step_it_names(tmp_path, layout):
    loop = Loop()
    insp = loop.insp
    loop.run(range(12))
    own = tmp_path / "own"
    own_save(loop, own, layout)
    ref_model, ref_opt = state(loop)
    loop.run(range(12, 20))
    with pytest.raises(CheckpointError, match="step of .* is unknown"):
        insp.rewind(own)  # nothing recorded beside it, and no step= given
    assert insp.step == 20
    out = insp.rewind(str(own), step=12)
    assert out == {"checkpoint": None, "path": str(own), "step": 12, "done": True}
    assert insp.step == 12
    assert same_tensors(loop.model.state_dict(), ref_model)
    assert same_tensors(loop.opt.state_dict(), ref_opt)
    (ev,) = kinds(insp, "rewind")
    assert ev["step"] == 12 and ev["from_step"] == 20
    loop.run(range(12, 14))  # training goes on from there
    assert insp.step == 14
    insp.close()


def test_a_directory_written_by_checkpoint_dir_names_its_step(tmp_path):
    loop = Loop(checkpoint_dir=tmp_path / "cks")
    insp = loop.insp
    loop.run(range(7))
    insp.checkpoint()
    ref_model, ref_opt = state(loop)
    (path,) = [c["path"] for c in insp.checkpoints.list()]
    wait_until(lambda: (Path(path) / ".metadata").is_file(), what="the write")
    loop.run(range(7, 12))
    assert insp.rewind(Path(path))["step"] == 7 and insp.step == 7
    assert same_tensors(loop.model.state_dict(), ref_model)
    assert same_tensors(loop.opt.state_dict(), ref_opt)
    insp.close()


def refused(loop: Loop, path, match: str, **kw) -> None:
    """A rewind to ``path`` is refused with the reason and nothing changes."""
    insp = loop.insp
    before_step, (model, opt) = insp.step, state(loop)
    before_events = len(insp.events())
    with pytest.raises(CheckpointError, match=match):
        insp.rewind(path, **kw)
    assert insp.step == before_step
    assert same_tensors(loop.model.state_dict(), model)
    assert same_tensors(loop.opt.state_dict(), opt)
    assert len(insp.events()) == before_events  # no rewind, no event


def test_a_missing_partial_or_foreign_directory_is_refused_and_nothing_changes(tmp_path):
    loop = Loop()
    loop.run(range(6))
    good = tmp_path / "good"
    own_save(loop, good, "plain")
    loop.run(range(6, 10))
    refused(loop, tmp_path / "nowhere", "no checkpoint directory at", step=6)
    # partial: a save that never wrote its .metadata
    no_md = tmp_path / "no_md"
    own_save(loop, no_md, "plain")
    (no_md / ".metadata").unlink()
    refused(loop, no_md, "no .metadata", step=6)
    # partial: a rank's data file missing (two writer threads: two files, one deleted)
    half = tmp_path / "half"
    dcp.save(
        {"model": loop.model.state_dict(), "optimizer": loop.opt.state_dict()},
        storage_writer=dcp.FileSystemWriter(half, thread_count=2),
    )
    data = sorted(half.glob("*.distcp"))
    assert len(data) >= 2
    data[-1].unlink()
    refused(loop, half, f"partial checkpoint: its data file {data[-1].name} is missing", step=6)
    # partial: a data file cut short
    short = tmp_path / "short"
    own_save(loop, short, "plain")
    f = next(short.glob("*.distcp"))
    f.write_bytes(f.read_bytes()[:100])
    refused(loop, short, "partial checkpoint: its data file .* holds 100 bytes", step=6)
    # another model's: other shapes, other keys, another optimizer layout
    for name, other in [
        ("wider", nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))),
        ("other", nn.Sequential(nn.Linear(8, 1))),
    ]:
        opt = torch.optim.Adam(other.parameters())
        other(torch.randn(4, 8)).sum().backward()
        opt.step()
        dcp.save({"model": other.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=tmp_path / name)
    shapes = [tuple(t.shape) for t in loop.model.state_dict().values()]
    assert shapes[0] != (64, 8)  # (the test's premise: the wider model's first layer differs)
    refused(loop, tmp_path / "wider", "another model's checkpoint: 0.weight is", step=6)
    refused(loop, tmp_path / "other", "another model's checkpoint", step=6)
    # and a good one still works after all that
    assert loop.insp.rewind(good, step=6)["done"] and loop.insp.step == 6
    loop.insp.close()


def test_a_checkpoint_of_checkpoint_dir_made_partial_is_refused_by_id(tmp_path):
    loop = Loop(checkpoint_dir=tmp_path)
    insp = loop.insp
    loop.run(range(4))
    cp = insp.checkpoint()
    (path,) = [c["path"] for c in insp.checkpoints.list()]
    wait_until(lambda: (Path(path) / ".metadata").is_file() and insp.checkpoints.get(cp).pending.done())
    loop.run(range(4, 8))
    for f in Path(path).glob("*.distcp"):
        f.unlink()
    refused(loop, cp, "partial checkpoint")
    insp.close()


class FullDisk(dcp.FileSystemWriter):
    """A writer on a full disk: every write fails with ENOSPC."""

    def write_data(self, plan, planner):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_is_a_checkpoint_error_event_and_training_goes_on(tmp_path, monkeypatch):
    loop = Loop(checkpoint_dir=tmp_path)
    insp = loop.insp
    loop.run(range(5))
    monkeypatch.setattr(dcp, "FileSystemWriter", FullDisk)
    cp = insp.checkpoint()
    loop.run(range(5, 10))  # the write fails on DCP's thread; the loop goes on
    (err,) = wait_until(lambda: kinds(insp, "checkpoint_error"), what="a checkpoint_error event")
    assert err["checkpoint"] == cp and err["step"] == 5
    assert "No space left on device" in err["message"] and "training goes on" in err["message"]
    assert insp.checkpoints.list() == []  # not kept
    wait_until(lambda: dirs(tmp_path) == [], what="the half directory removed")
    with pytest.raises(Exception, match=cp):
        insp.rewind(cp)
    monkeypatch.undo()
    loop.run(range(10, 15))
    assert insp.step == 15 and all(torch.isfinite(p).all() for p in loop.model.parameters())
    cp2 = insp.checkpoint()  # the disk has room again: checkpoints work again
    loop.run(range(15, 17))
    assert insp.rewind(cp2)["done"] and insp.step == 15
    insp.close()


class NoRoom(dcp.FileSystemWriter):
    """A full disk met before the write starts (the writer's set-up)."""

    def __init__(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_when_the_write_starts_is_a_checkpoint_error_event_too(tmp_path, monkeypatch):
    loop = Loop(checkpoint_dir=tmp_path)
    insp = loop.insp
    loop.run(range(3))
    monkeypatch.setattr(dcp, "FileSystemWriter", NoRoom)
    cp = insp.checkpoint()
    (err,) = kinds(insp, "checkpoint_error")
    assert err["checkpoint"] == cp and "No space left on device" in err["message"]
    assert insp.checkpoints.list() == [] and dirs(tmp_path) == []
    loop.run(range(3, 6))
    assert insp.step == 6
    insp.close()
