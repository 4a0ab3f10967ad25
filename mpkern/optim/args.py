"""The argument checks of :class:`mpkern.optim.FusedAdamWMP`: ``torch.optim.AdamW``'s (with its
messages) and mpkern's own keyword arguments, at construction and for each added param group."""

from __future__ import annotations

import math
from typing import Any

import torch

from . import buckets, release, storage

Tensor = torch.Tensor
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def check_adamw_args(lr: Any, betas: Any, eps: float, weight_decay: float, differentiable: bool) -> None:
    """``torch.optim.AdamW``'s argument checks, with its messages."""
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
    elif not lr >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not eps >= 0.0:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not weight_decay >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if differentiable:
        raise ValueError("FusedAdamWMP: differentiable=True is not supported (the fused step is not "
                         "differentiable); use torch.optim.AdamW(differentiable=True)")


def check_own_args(master_weights: Any, state_dtype: Any, max_grad_norm: Any, stochastic_rounding: Any) -> str:
    """Validate mpkern's own arguments; return ``state_dtype`` as the name kept in the groups."""
    master = storage.check_master_weights(master_weights)
    name = storage.check_state_dtype(state_dtype)
    if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))
                                      or not (max_grad_norm > 0 and math.isfinite(max_grad_norm))):
        raise ValueError(f"max_grad_norm must be a positive finite float or None, got {max_grad_norm!r}")
    if stochastic_rounding and not master.stochastic_rounding:
        raise ValueError("stochastic_rounding applies to 16-bit params without master weights: "
                         "use it with master_weights=False")
    return name


def check_release_args(release_grads: Any, bucket_bytes: Any, process_group: Any) -> release.Release | None:
    """Validate ``release_grads`` / ``release_bucket_bytes``; the optimizer's :class:`~.release.Release` or None."""
    if not isinstance(release_grads, bool):
        raise TypeError(f"release_grads must be a bool, got {type(release_grads).__name__}")
    if not release_grads:
        if bucket_bytes is not None:  # checked, unused: a twin built with release_grads=False may pass it
            release.check_bucket_bytes(bucket_bytes)
        return None
    if process_group is not None:
        raise ValueError("release_grads=True is single-process: it cannot take a process_group (the grads would "
                         "be stepped before they are reduced)")
    return release.Release(release.DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes)


def check_group(group: dict[str, Any], gi: int, first: dict[str, Any]) -> None:
    """Validate a group just added (its mpkern keys, its params' dtypes for its storage kinds)."""
    group["state_dtype"] = check_own_args(group["master_weights"], group["state_dtype"], group["max_grad_norm"],
                                           group["stochastic_rounding"])
    storage.check_amsgrad(group["amsgrad"], group["state_dtype"], f" (group {gi})")
    if group["max_grad_norm"] != first["max_grad_norm"]:
        raise ValueError(f"FusedAdamWMP: max_grad_norm is a global norm threshold; group {gi} has "
                         f"{group['max_grad_norm']!r}, group 0 has {first['max_grad_norm']!r}")
    for i, p in enumerate(group["params"]):
        if p.is_complex():
            raise ValueError(f"FusedAdamWMP: param {i} of group {gi} is complex; complex params are not supported")
        if p.dtype not in _FLOATS:
            raise TypeError(f"FusedAdamWMP: param {i} of group {gi} has dtype {p.dtype}; expected float32, "
                            "float16 or bfloat16")
        buckets.check_param_dtype(group, p.dtype, f"param {i} of group {gi}")
    storage.MASTER_KINDS[group["master_weights"]].check_group([p.dtype for p in group["params"]], f"group {gi}")

