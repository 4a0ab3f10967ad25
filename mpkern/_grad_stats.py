"""The statistics stages shared by :func:`mpkern.unscale_` and the optimizer step's own clip.

Stage 2 (:func:`device_stats`): one fused statistics pass per device -- each gradient's sum of
squares and max |g|, which also flags inf/NaN -- gathered in the caller's order. Stage 3, after the
global reduction of :mod:`mpkern.distributed` (:func:`finish_stats`): per-tensor norms, the total
norm, ``found_inf``, the clip coefficient and the factor ``inv * coef``, in a few tiny device ops.
Both callers go through these two functions, so ``unscale_`` and a step that clips itself reach the
same bits. Nothing here waits for the device.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from . import _backend, _ops, reference
from ._grads import is_flat as _flat, to_device as _to_device

Tensor = torch.Tensor


def check_max_norm(max_norm: Any) -> float | None:
    if max_norm is None:
        return None
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
        raise TypeError(f"unscale_: max_norm must be a positive float or None, got {type(max_norm).__name__}")
    if not (max_norm > 0 and math.isfinite(max_norm)):
        raise ValueError(f"unscale_: max_norm must be a positive finite float or None, got {max_norm!r}")
    return float(max_norm)


class DeviceStats(NamedTuple):
    """Stage 2's result: per-tensor statistics in the caller's order, and how the grads split by device."""

    sumsq: Tensor
    amax: Tensor
    by_dev: dict[torch.device, list[int]]
    flat: list[bool]
    backend: dict[torch.device, str]


def device_stats(grads: list[Tensor], inv: Tensor | float, out_device: torch.device,
                  backends: dict[torch.device, str] | None = None) -> DeviceStats:
    """Stage 2: one statistics pass per device (in order within each), gathered on ``out_device``.
    The backend is chosen (and a forced one checked) for every device before any work, unless the
    caller chose them (``backends``: the optimizer step's buckets)."""
    by_dev: dict[torch.device, list[int]] = {}
    flat: list[bool] = []
    for i, g in enumerate(grads):
        by_dev.setdefault(g.device, []).append(i)
        flat.append(g.is_contiguous() or _flat(g))
    backend = backends if backends is not None else {dev: _backend.select(dev) for dev in by_dev}
    one_block = all(flat) and len(by_dev) == 1
    sums, maxs, order = [], [], []
    for dev, idx in by_dev.items():
        gs = grads if one_block else [grads[i] if flat[i] else grads[i].contiguous() for i in idx]
        s, m = _ops.grad_stats(gs, _ops.scalar_on(inv, dev), backend[dev])
        sums.append(s if dev == out_device else _to_device(s, out_device))
        maxs.append(m if dev == out_device else _to_device(m, out_device))
        order.extend(idx)
    if not sums:
        empty = torch.zeros(0, dtype=torch.float32, device=out_device)
        return DeviceStats(empty, empty.clone(), by_dev, flat, backend)
    sumsq = torch.cat(sums) if len(sums) > 1 else sums[0]
    amax = torch.cat(maxs) if len(maxs) > 1 else maxs[0]
    if len(by_dev) > 1:  # back to the caller's order
        perm = torch.empty(len(order), dtype=torch.int64)
        perm[torch.tensor(order, dtype=torch.int64)] = torch.arange(len(order))
        perm = _to_device(perm, out_device)
        sumsq, amax = sumsq[perm], amax[perm]
    return DeviceStats(sumsq, amax, by_dev, flat, backend)


class Finished(NamedTuple):
    nonfinite: Tensor
    tensor_norm: Tensor
    total_norm: Tensor
    found_inf: Tensor
    clip_coef: Tensor
    factor: Tensor


def finish_stats(sumsq: Tensor, amax: Tensor, inv_out: Tensor, inf_norm: bool, max_norm_f: float | None,
                  out_device: torch.device) -> Finished:
    """Stage 3 (after the global reduction): nonfinite flags, per-tensor norms, total norm,
    found_inf, clip coefficient, factor ``inv * coef`` -- a few tiny device ops, no sync."""
    nonfinite = (~torch.isfinite(amax)).to(torch.float32)
    if inf_norm:
        tensor_norm = amax * inv_out
        total_norm = tensor_norm.amax() if tensor_norm.numel() else torch.zeros((), device=out_device)
    else:
        tensor_norm = sumsq.sqrt()
        total_norm = reference.total_sumsq(sumsq).sqrt()
    found_inf = nonfinite.amax() if nonfinite.numel() else torch.zeros((), device=out_device)
    one = torch.ones((), dtype=torch.float32, device=out_device)
    if max_norm_f is None:
        clip_coef = one
    else:
        clip_coef = torch.clamp(max_norm_f / (total_norm + 1e-6), max=1.0)
        clip_coef = torch.where(found_inf > 0, one, clip_coef)
    return Finished(nonfinite, tensor_norm, total_norm, found_inf, clip_coef, inv_out * clip_coef)
