"""FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters and gradients that are DTensors.

Under FSDP2 each parameter is a ``DTensor`` sharded over a 1-D device mesh (``Shard(dim)``), and
so is its gradient once FSDP's reduce-scatter has run: ``g.to_local()`` is this rank's shard
(possibly empty), a view whose in-place edits are edits of the gradient. :class:`Layout` says, per
parameter, whether it is such a sharded DTensor, and combines per-parameter partial results of the
local shards across the mesh with :func:`Layout.combine`: **one** ``all_gather`` of a small vector
on the mesh's own process group (the training's group: on GPUs it rides NCCL), each column then
summed (sums of squares or ``p``-th powers, sums, element and NaN/Inf counts, histogram counts) or
maxed (abs-max, a histogram's range): a max and a sum in one collective, which one ``all_reduce``
cannot do. A parameter that is not sharded (a plain tensor FSDP does not manage,
``ignored_params``) is the same on every rank once the user has reduced it; its columns are maxed,
so its statistics are its own.

:func:`layout_of` detects FSDP2 at ``attach`` and refuses what is not handled, with a message: a
2-D mesh (HSDP), a mesh that is not the whole job, and a DTensor parameter that FSDP2 does not
manage (tensor parallel).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..wire.errors import AttachError
from .tensor_stats import device_constant

__all__ = ["Layout", "backward_sources", "layout_of", "local", "is_dtensor"]

try:  # torch >= 2.4
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover - an older torch has no public DTensor (and no FSDP2)
    DTensor = None  # type: ignore[assignment,misc]
    Replicate = Shard = None  # type: ignore[assignment,misc]


def is_dtensor(t: Any) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: Tensor) -> Tensor:
    """This rank's part of ``t``: the local shard of a DTensor (a view: in-place edits reach ``t``),
    ``t`` itself otherwise."""
    return t.to_local() if is_dtensor(t) else t


class Layout:
    """Which parameters are sharded, and the collective that combines their local partial results."""

    def __init__(
        self, sharded: list[bool], group: Any, world: int, rank: int, device: torch.device | None = None
    ) -> None:
        self.sharded = sharded
        self.group = group
        self.world = world
        self.rank = rank
        # the device the group's collectives take (the mesh's: CUDA under NCCL, even where the
        # shards live on the CPU, as with FSDP2's CPU offload)
        self.device = device

    def is_sharded(self, i: int) -> bool:
        return self.sharded[i]

    def combine(self, values: Tensor, summed: tuple[bool, ...]) -> Tensor:
        """One collective: ``values`` (1-D float32, every rank the same length) gathered from every
        rank, then per column the sum over ranks where ``summed`` else the max (NaN propagates).
        ``summed`` is host data: its device mask is built once (``stats.device_constant``)."""
        return self.combine_rows(values, summed)[0]

    def combine_rows(self, values: Tensor, summed: tuple[bool, ...]) -> tuple[Tensor, Tensor]:
        """:meth:`combine`, and the gathered rows themselves (``world x len``): for what a sum or a
        max cannot combine (a mean and a spread). One collective."""
        home = values.device
        values = values.reshape(-1).float().contiguous()
        if len(summed) != values.numel():
            raise ValueError(f"combine: {len(summed)} flags for {values.numel()} values")
        if self.world == 1:
            return values, values.reshape(1, -1)
        if self.device is not None and values.device != self.device:
            values = values.to(self.device)
        out = torch.empty(self.world * values.numel(), dtype=values.dtype, device=values.device)
        _all_gather(out, values, group=self.group)
        rows = out.reshape(self.world, -1)
        mask = device_constant(summed, torch.bool, values.device)
        return torch.where(mask, rows.sum(0), rows.amax(0)).to(home), rows.to(home)


# torch 2.13 names it all_gather_single (all_gather_into_tensor, deprecated there, is the older name)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _fsdp_params(model: nn.Module) -> dict[int, Any]:
    """FSDP2's own record of each parameter it manages (``FSDPParam``), by the id of its sharded
    parameter, from every FSDP module."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return {}
    out: dict[int, Any] = {}
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        state = m._get_fsdp_state()
        group = getattr(state, "_fsdp_param_group", None)
        for fp in getattr(group, "fsdp_params", ()) if group is not None else ():
            out[id(fp.sharded_param)] = fp
    return out


def _fsdp_managed(model: nn.Module) -> set[int]:
    """The ids of the parameters FSDP2 manages (its sharded parameters), from every FSDP module."""
    return set(_fsdp_params(model))


def backward_sources(model: nn.Module, tensors: list[Tensor]) -> Callable[[int], Tensor | None]:
    """Where each parameter's gradient of one backward pass can be seen, on this rank, before any
    collective: a function of the parameter index giving the tensor whose tensor hooks receive it,
    or None where there is none yet.

    FSDP2 computes a sharded parameter's gradient on its **unsharded** parameter (a plain
    ``nn.Parameter`` of the full shape that its all-gather fills; FSDP2 keeps that object from the
    module's first all-gather on), then reduce-scatters it into the shard's ``.grad``; the sharded
    parameter's own tensor hooks never run. So a hook on the unsharded parameter sees this rank's
    gradient of one backward, the full tensor, as DDP's local gradient before its all-reduce. It
    exists only once its module has been gathered (after the first forward); until then: None. A
    parameter FSDP2 does not manage is its own source."""
    fsdp = _fsdp_params(model)

    def source(i: int) -> Tensor | None:
        t = tensors[i]
        fp = fsdp.get(id(t))
        if fp is None:
            return t
        u = getattr(fp, "_unsharded_param", None)
        return u if isinstance(u, Tensor) and not is_dtensor(u) else None

    return source


def layout_of(model: Any, names: list[str], tensors: Iterable[Tensor]) -> Layout | None:
    """The FSDP2 layout of the model's parameters, or None when none is a DTensor.

    Raises:
        AttachError: a DTensor layout this inspector does not handle (see the module docstring).
    """
    tensors = list(tensors)
    dts = [(n, t) for n, t in zip(names, tensors, strict=True) if is_dtensor(t)]
    if not dts:
        return None
    managed = _fsdp_managed(model) if isinstance(model, nn.Module) else set()
    mesh = None
    for name, t in dts:
        if id(t) not in managed:
            raise AttachError(
                f"parameter {name!r} is a DTensor that FSDP2 (fully_shard) does not manage (tensor "
                "parallel, or a DTensor made by hand): its placements "
                f"{tuple(t.placements)} are not supported; the inspector handles FSDP2 on a 1-D mesh"
            )
        if t.device_mesh.ndim != 1:
            raise AttachError(
                f"parameter {name!r} lives on a {t.device_mesh.ndim}-D device mesh (HSDP, or FSDP2 with "
                "tensor parallel): not supported; the inspector handles FSDP2 on a 1-D mesh"
            )
        if not all(isinstance(p, Shard | Replicate) for p in t.placements):
            raise AttachError(f"parameter {name!r}: placements {tuple(t.placements)} are not supported")
        if mesh is None:
            mesh = t.device_mesh
        elif t.device_mesh != mesh:
            raise AttachError(
                f"parameter {name!r} is on another device mesh than the others: the inspector handles "
                "one FSDP2 mesh"
            )
    assert mesh is not None
    world = dist.get_world_size() if dist.is_initialized() else 1
    if mesh.size() != world:
        raise AttachError(
            f"the FSDP2 mesh spans {mesh.size()} of the job's {world} ranks (HSDP or another layout "
            "built by hand): not supported; the inspector handles FSDP2 over the whole job"
        )
    sharded = [is_dtensor(t) and any(isinstance(p, Shard) for p in t.placements) for t in tensors]
    device = torch.device(mesh.device_type) if mesh.device_type != "cpu" else torch.device("cpu")
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    return Layout(sharded, mesh.get_group(), world, mesh.get_local_rank(), device)
