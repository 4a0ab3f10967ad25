"""The functional AdamW step of ``FusedAdamWMP``: one fused kernel over named lists of one device.

:class:`KernelLists` is what :mod:`.buckets` prepares for one bucket (one group, one device, one
master kind); :func:`group_scalars` turns a param group into the kernel's scalar arguments, for the
full path (:func:`fused_adamw_mp`) and the cached one (:mod:`.runtime`) alike.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .. import _ops
from ..op_args import AdamwArgs

Tensor = torch.Tensor


class KernelLists(NamedTuple):
    """The layout-matched flat lists one kernel call takes (``exp_avg_scales`` / ``exp_avg_sq_scales``:
    None unless the moment kind has scales; ``moment_codec``: how the kernel reads the moments, the
    ``moment_codec`` of ``mpkern::adamw_step_``; ``write_backs``: (moment kind, param, state, fp32
    moments) of kinds without a kernel variant, encoded back after the reference step)."""

    params: list[Tensor]
    grads: list[Tensor]
    exp_avgs: list[Tensor]
    exp_avg_sqs: list[Tensor]
    max_exp_avg_sqs: list[Tensor]
    masters: list[Tensor]
    steps: list[Tensor]
    stream_ids: list[int]
    elem_offsets: list[int]
    exp_avg_scales: list[Tensor] | None
    exp_avg_sq_scales: list[Tensor] | None
    moment_codec: str
    write_backs: list[tuple[Any, Tensor, dict, Any]]


class GroupScalars(NamedTuple):
    """A param group's hyperparameters as the kernels take them (by name: the fields are the op's
    argument names)."""

    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    maximize: bool
    stochastic_rounding: bool
    seed: int


def group_scalars(group: dict[str, Any]) -> GroupScalars:
    """The kernel's scalar arguments of ``group`` (one conversion for the full and the cached step)."""
    beta1, beta2 = group["betas"]
    return GroupScalars(beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                        weight_decay=float(group["weight_decay"]), maximize=bool(group["maximize"]),
                        stochastic_rounding=bool(group["stochastic_rounding"]), seed=int(group["seed"]))


def fused_adamw_mp(backend: str, lists: KernelLists, grad_factor: Tensor, found_inf: Tensor,
                   lr_tensor: Tensor | None, lr: float, group: dict[str, Any], master_codec: str) -> None:
    """One fused AdamW kernel on ``backend`` over ``lists`` (one group, one device, one master kind,
    named by ``master_codec``: "none", "fp32", "remainder" or "8bit"): ``grad * grad_factor`` in
    registers, nothing written when ``found_inf`` is set, the hyperparameters from ``group``. Random
    bits (bf16 moments, 8-bit master corrections, stochastic param rounding) come from the stream of
    each param (``stream_ids``: unique per param of the optimizer; ``elem_offsets``: where a shard
    starts in its whole tensor) at its step: same seed + step = same bits, across resumes and
    reshards. 8-bit moments come with their bf16 group scales, updated in the same kernel. Moments
    of a kind without a kernel variant were decoded to fp32 (``write_backs``) and are encoded back
    here."""
    s = group_scalars(group)
    _ops.run_adamw_step_(backend, AdamwArgs(
        params=lists.params, grads=lists.grads, exp_avgs=lists.exp_avgs, exp_avg_sqs=lists.exp_avg_sqs,
        max_exp_avg_sqs=lists.max_exp_avg_sqs, masters=lists.masters, steps=lists.steps, grad_factor=grad_factor,
        found_inf=found_inf, lr_tensor=lr_tensor, exp_avg_scales=lists.exp_avg_scales,
        exp_avg_sq_scales=lists.exp_avg_sq_scales, lr=lr, beta1=s.beta1, beta2=s.beta2, eps=s.eps,
        weight_decay=s.weight_decay, maximize=s.maximize, master_codec=master_codec, moment_codec=lists.moment_codec,
        stochastic_rounding=s.stochastic_rounding, seed=s.seed, stream_ids=lists.stream_ids,
        elem_offsets=lists.elem_offsets))
    for kind, p, st, moments in lists.write_backs:
        kind.write_back(p, st, moments, found_inf)


__all__ = ["GroupScalars", "KernelLists", "fused_adamw_mp", "group_scalars"]
