"""mpkern inside ``torch.distributed``: DTensor (FSDP2, tensor parallel) grads/params and hand sharding.

The kernels always run on local shards (``DTensor.to_local()``); what needs the other ranks is
only the *global* statistics of :func:`mpkern.unscale_` (and so of ``FusedAdamWMP(max_grad_norm=)``):
every rank must reach the same norm, clip coefficient and skip decision. They come from **one**
all-reduce per call of the packed per-tensor partials -- sums of squares and non-finite flags
with SUM for the L2 norm; max-abs values and flags with MAX for the inf-norm -- never a
collective per parameter and never a full-tensor gather.

Who counts a tensor's partial: a ``Shard`` placement is summed over its mesh dimension; on a
``Replicate`` mesh dimension only coordinate 0 contributes (so replicas are not double-counted);
a plain (non-DTensor) tensor among DTensors is treated as replicated and counted on rank 0 of
the reduction group. With ``process_group=`` every plain tensor is the caller's local shard and
is summed over that group (ZeRO-style flat shards, Megatron tensor parallel) -- except params
marked with :func:`mark_replicated` (identical on every rank of the group, like the LayerNorm
weights of a tensor-parallel block), which count once, on rank 0 of the group.

The reduction group: ``process_group`` when given; else the mesh's group for a 1-D mesh; else
the default (world) group -- every rank of it must then make the call. ``Partial`` placements
(unreduced gradients) are refused: their squares cannot be summed.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat
from typing import TYPE_CHECKING, Any

import torch

from . import reference

Tensor = torch.Tensor

try:  # torch >= 2.5 has the public DTensor module; mpkern must import without it
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
except ImportError:  # pragma: no cover - depends on the torch build
    DTensor = Partial = Replicate = Shard = None  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from typing_extensions import TypeIs


def is_dtensor(t: Any) -> TypeIs[DTensor]:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: Tensor) -> Tensor:
    """The tensor a kernel works on: the local shard of a DTensor, else ``t`` itself."""
    # the shard itself, not to_local()'s autograd view of it: the kernels write it in place
    return t._local_tensor if is_dtensor(t) else t  # noqa: SLF001 -- DTensor's shard, as above


def version(t: Tensor) -> Any:
    """A host-side write counter for ``t`` (DTensor: wrapper and local shard both count)."""
    if is_dtensor(t):
        return (t._version, t._local_tensor._version)  # noqa: SLF001 -- torch's write counter: no public accessor
    return t._version  # noqa: SLF001 -- torch's write counter: no public accessor


def check_reduced(g: Tensor, where: str) -> None:
    """Raise if ``g`` is a DTensor with a ``Partial`` placement (its local values are unreduced
    partial sums: using them as the gradient would make the replicas diverge)."""
    if is_dtensor(g) and any(isinstance(pl, Partial) for pl in g.placements):
        raise ValueError(f"{where}: the gradient is a DTensor with a Partial placement {tuple(g.placements)} (not "
                         "reduced across ranks yet); reduce it first (e.g. g.redistribute(placements=[Replicate()]) "
                         "or let FSDP2/DDP reduce it) -- updating from unreduced partial sums would make the "
                         "replicas diverge")


@dataclass(frozen=True)
class ReducePlan:
    """How the per-tensor partial statistics of one ``unscale_`` call are combined across ranks."""

    group: Any  # a ProcessGroup (None: the default group)
    owned: tuple[bool, ...]  # whether this rank's partial of each tensor counts


def _group_rank(group: Any) -> int:
    import torch.distributed as dist

    return dist.get_rank(group)


def _owned(t: Tensor, plain_owned: bool) -> bool:
    if not is_dtensor(t):
        return plain_owned
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:  # this rank is not in the tensor's mesh: it holds nothing of it
        return False
    for dim, pl in enumerate(t.placements):
        if isinstance(pl, Partial):
            raise ValueError("unscale_: a gradient has a Partial placement (not reduced yet); its norm cannot be "
                             "computed from local squares -- reduce it first (FSDP2 and DDP do)")
        if isinstance(pl, Replicate) and coord[dim] != 0:
            return False
    return True


def mark_replicated(*params: Tensor) -> None:
    """Mark plain params that hold the same values on every rank of a ``process_group=`` reduction
    (tensor-parallel replicas: norms, biases of row-parallel layers): their squares are counted
    once, on rank 0 of the group, instead of once per rank. DTensor params need no mark (their
    ``Replicate`` placement says it)."""
    for p in params:
        if not isinstance(p, Tensor):
            raise TypeError(f"mark_replicated: expected tensors, got {type(p).__name__}")
        # mpkern's own mark on the param (not an attribute torch declares), read only by plan() below
        p._mpkern_replicated = True  # type: ignore[attr-defined]  # noqa: SLF001 -- see above


def plan(grads: list[Tensor], process_group: Any = None, params: list[Tensor] | None = None) -> ReducePlan | None:
    """The reduction for ``grads`` (None when nothing needs the other ranks); ``params`` are the
    tensors the grads belong to (for :func:`mark_replicated`)."""
    has_dt = DTensor is not None and any(map(isinstance, grads, repeat(DTensor)))  # C-level loop: hot path
    if process_group is None and not has_dt:
        return None
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        if has_dt:
            raise RuntimeError("unscale_: DTensor gradients need an initialised torch.distributed process group")
        raise RuntimeError("unscale_: process_group= needs an initialised torch.distributed process group")
    group = process_group
    if group is None:
        meshes = {id(g.device_mesh): g.device_mesh for g in grads if is_dtensor(g)}
        only = next(iter(meshes.values())) if len(meshes) == 1 else None
        group = only.get_group() if only is not None and only.ndim == 1 else None
    rank0 = (_group_rank(group) == 0) if group is not None else dist.get_rank() == 0
    if process_group is None:
        return ReducePlan(group, tuple(_owned(g, rank0) for g in grads))
    # the caller's own shards, except params marked replicated (counted once, on rank 0)
    marks = [getattr(p, "_mpkern_replicated", False) for p in params] if params is not None else [False] * len(grads)
    return ReducePlan(group, tuple(_owned(g, rank0 if rep else True) for g, rep in zip(grads, marks)))


_MASKS: dict[tuple[tuple[bool, ...], torch.device], Tensor] = {}


def _mask(owned: tuple[bool, ...], device: torch.device) -> Tensor:
    """Device mask of owned partials, built once per (layout, device) -- no per-step copy."""
    key = (owned, device)
    m = _MASKS.get(key)
    if m is None:
        m = torch.tensor(owned, dtype=torch.bool).to(device)
        _MASKS[key] = m
    return m


def reduce_stats(sumsq: Tensor, amax: Tensor, inf_norm: bool, rp: ReducePlan,
                 per_tensor: bool) -> tuple[Tensor, Tensor]:
    """Global (sum of squares, max-abs) from the local per-tensor ones, with one all-reduce.

    ``per_tensor=False``: the local partials are folded first and two numbers travel (total and
    non-finite flag); the result has one entry. ``per_tensor=True``: one entry per tensor travels,
    so every rank must hold the same tensors in the same order (true for DTensor params).
    The returned ``amax`` is inf wherever a non-finite value was found on any rank (NaN or inf:
    the flag travels beside the values), so ``~isfinite(amax)`` is the global non-finite flag;
    in L2 mode its finite entries are 0 (only the flag is used there).
    """
    import torch.distributed as dist

    nonfinite = (~torch.isfinite(amax)).to(torch.float32)
    vals = amax.nan_to_num(nan=float("inf")) if inf_norm else sumsq
    zero = torch.zeros((), dtype=torch.float32, device=sumsq.device)
    if not all(rp.owned):
        mask = _mask(rp.owned, sumsq.device)
        vals, nonfinite = torch.where(mask, vals, zero), torch.where(mask, nonfinite, zero)
    if not per_tensor:
        total = (vals.amax() if inf_norm else reference.total_sumsq(vals)) if vals.numel() else zero
        vals = total.reshape(1)
        nonfinite = nonfinite.amax().reshape(1) if nonfinite.numel() else zero.reshape(1)
    n = vals.numel()
    packed = torch.cat([vals, nonfinite])
    dist.all_reduce(packed, op=dist.ReduceOp.MAX if inf_norm else dist.ReduceOp.SUM, group=rp.group)
    vals, bad = packed[:n], packed[n:] > 0
    inf = torch.full((), float("inf"), dtype=torch.float32, device=sumsq.device)
    if inf_norm:
        return torch.zeros_like(vals), torch.where(bad, inf, vals)
    return vals, torch.where(bad, inf, zero)


def shard_offset(t: Tensor) -> int:
    """Where the random stream of ``t``'s local shard starts (0 for a plain tensor).

    ``Shard(0)`` (FSDP2) and ``Replicate``: the shard is one block of the whole tensor, so the
    flat index of its first element -- element i of the shard draws the bits of element
    ``offset + i`` of the whole tensor, whatever the number of shards. Other placements
    (``Shard(1)``, tensor parallel): the shard's elements are not one block, so each shard gets a
    disjoint range past the whole tensor's (unique bits, but not the unsharded tensor's)."""
    if not is_dtensor(t):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if all(isinstance(pl, Replicate) or (isinstance(pl, Shard) and pl.dim == 0) for pl in t.placements):
        flat, stride = 0, 1
        for size, off in zip(reversed(tuple(t.shape)), reversed(tuple(offset))):
            flat += int(off) * stride
            stride *= int(size)
        return flat
    numel = max(t.numel(), 1)
    block, index = 1, 0
    for size, off, loc in zip(tuple(t.shape), tuple(offset), tuple(local_shape)):
        block = max(int(loc), 1)
        index = index * (int(size) // block + 1) + int(off) // block
    return numel * (1 + index)


def like_param(p: Tensor, value: Tensor) -> Tensor:
    """``value`` (a full tensor of ``p``'s shape, or a DTensor) in ``p``'s placement, without a
    collective when possible (each rank cuts its own shard from the full tensor it holds)."""
    if not is_dtensor(p) or is_dtensor(value):
        return value
    from torch.distributed.tensor import distribute_tensor

    try:
        return distribute_tensor(value.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
    except TypeError:  # older torch: no src_data_rank (then rank 0's copy is scattered)
        return distribute_tensor(value.to(p.device), p.device_mesh, p.placements)


def wrap_like(p: Tensor, local_value: Tensor) -> Tensor:
    """A tensor laid out like ``p`` whose local shard is ``local_value`` (DTensor if ``p`` is one)."""
    if not is_dtensor(p):
        return local_value
    return DTensor.from_local(local_value, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                              stride=p.stride())


__all__ = [
    "ReducePlan",
    "Replicate",
    "Shard",
    "check_reduced",
    "is_dtensor",
    "like_param",
    "local",
    "mark_replicated",
    "plan",
    "reduce_stats",
    "shard_offset",
    "version",
    "wrap_like",
]
