"""The functional AdamW step of ``FusedAdamWMP``: one fused kernel over prepared lists of one device."""

from __future__ import annotations

from typing import Any

import torch

from .. import _ops

Tensor = torch.Tensor


def fused_adamw_mp(backend: str, params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                   exp_avg_sqs: list[Tensor], max_exp_avg_sqs: list[Tensor], masters: list[Tensor],
                   steps: list[Tensor], grad_factor: Tensor, found_inf: Tensor, lr_tensor: Tensor | None,
                   lr: float, group: dict[str, Any], mode: int, stream_ids: list[int],
                   elem_offsets: list[int], exp_avg_scales: list[Tensor] | None = None,
                   exp_avg_sq_scales: list[Tensor] | None = None) -> None:
    """One fused AdamW kernel on ``backend`` over layout-matched flat lists (one group, one device,
    one master kind ``mode``): ``grad * grad_factor`` in registers, nothing written when
    ``found_inf`` is set, the hyperparameters from ``group``. Random bits (bf16 moments, 8-bit
    master corrections, stochastic param rounding) come from the stream of each param
    (``stream_ids``: unique per param of the optimizer; ``elem_offsets``: where a shard starts in
    its whole tensor) at its step: same seed + step = same bits, across resumes and reshards.
    8-bit moments (int8 / uint8 ``exp_avgs`` / ``exp_avg_sqs``) come with their bf16 group scales
    (``exp_avg_scales``, ``exp_avg_sq_scales``), updated in the same kernel."""
    beta1, beta2 = group["betas"]
    _ops.adamw_step_(
        backend, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, steps, grad_factor, found_inf,
        lr_tensor, lr, float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
        bool(group["maximize"]), mode, bool(group["stochastic_rounding"]), int(group["seed"]), stream_ids,
        elem_offsets, *(() if exp_avg_scales is None else (exp_avg_scales, exp_avg_sq_scales)))


__all__ = ["fused_adamw_mp"]
