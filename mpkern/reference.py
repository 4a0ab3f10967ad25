"""Pure-PyTorch implementations of the mpkern ops.

They are the ``torch`` backend (any device, always available) and document the exact semantics
the C++/CUDA/Triton kernels implement. Tests compare every backend against their own float64
computations, not against these functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Tensor = torch.Tensor


def grad_stats(grads: Sequence[Tensor], inv_scale: Tensor) -> tuple[Tensor, Tensor]:
    """Per-tensor statistics of a gradient list, in one read of each tensor.

    Returns ``(sumsq, amax)``, float32 tensors of ``len(grads)`` entries on ``inv_scale``'s device:

    * ``sumsq[t] = sum((grads[t].float() * inv_scale) ** 2)`` -- squared L2 norm of the unscaled grad;
    * ``amax[t] = max(|grads[t]|)`` (0 for an empty tensor), NaN if the tensor holds a NaN, else
      inf if it holds an inf -- so ``~isfinite(amax)`` is the non-finite flag.
    """
    device = inv_scale.device
    n = len(grads)
    if n == 0:
        z = torch.zeros(0, dtype=torch.float32, device=device)
        return z, z.clone()
    inv = inv_scale.reshape(()).to(torch.float32)
    sums, maxs = [], []
    for g in grads:
        x = g.reshape(-1).to(torch.float32)
        if x.numel() == 0:
            sums.append(torch.zeros((), dtype=torch.float32, device=device))
            maxs.append(torch.zeros((), dtype=torch.float32, device=device))
            continue
        y = x * inv
        sums.append(torch.sum(y * y, dtype=torch.float64).to(torch.float32))
        a = x.abs()
        # amax propagates NaN; an inf without NaN gives inf.
        maxs.append(a.amax())
    return torch.stack(sums), torch.stack(maxs)


def scale_(tensors: Sequence[Tensor], scale: Tensor) -> None:
    """``t *= scale`` in place for every tensor, computed in fp32 and rounded to ``t.dtype``."""
    s = scale.reshape(()).to(torch.float32)
    for t in tensors:
        if t.numel():
            t.copy_(t.to(torch.float32) * s)


MASTER_NONE, MASTER_F32, MASTER_REMAINDER = 0, 1, 2


def _bf16_rne_bits(x: Tensor) -> Tensor:
    return x.to(torch.bfloat16).view(torch.int16)


def adamw_step_(
    params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor],
    max_exp_avg_sqs: Sequence[Tensor], masters: Sequence[Tensor], steps: Sequence[Tensor], grad_factor: Tensor,
    found_inf: Tensor, lr_tensor: Tensor | None, lr: float, beta1: float, beta2: float, eps: float,
    weight_decay: float, maximize: bool, master_mode: int, stochastic_rounding: bool, seed: int,
) -> None:
    """Pure-PyTorch version of the fused AdamW step (same contract as the C++/CUDA kernels).

    Nothing is written when ``found_inf`` is non-zero: every update is computed and then committed
    with ``torch.where(found_inf == 0, new, old)``, so no host sync is needed. Stochastic rounding
    uses ``torch.rand`` here (unbiased, but not the kernels' bit stream).
    """
    ok = found_inf.reshape(()) == 0
    factor = grad_factor.reshape(()).to(torch.float32)
    if maximize:
        factor = -factor
    # a float lr stays a Python float (a kernel argument in double): no host-to-device copy
    lr_d = lr_tensor.reshape(()).double() if lr_tensor is not None else float(lr)
    decay = 1 - lr_d * weight_decay  # fp32 in the multiply below (a Python float is rounded to fp32 there)
    decay = decay.float() if isinstance(decay, Tensor) else decay
    for i, p in enumerate(params):
        step = steps[i].reshape(()).double() + 1
        step_size = (lr_d / (1 - beta1**step)).float()
        inv_bc2 = (1 / torch.sqrt(1 - beta2**step)).float()
        g = grads[i].float() * factor
        if master_mode == MASTER_F32:
            w = masters[i].clone()
        elif master_mode == MASTER_REMAINDER:
            hi = p.view(torch.int16).to(torch.int32) & 0xFFFF
            w = ((hi << 16) + masters[i].to(torch.int32)).view(torch.float32)
        else:
            w = p.float()
        m = exp_avgs[i].float()
        v = exp_avg_sqs[i].float()
        w = w * decay
        m = m + (1 - beta1) * (g - m)
        v = v * beta2 + (1 - beta2) * g * g
        vv = v
        if max_exp_avg_sqs:
            vv = torch.where(max_exp_avg_sqs[i] > v, max_exp_avg_sqs[i], v)
            max_exp_avg_sqs[i].copy_(torch.where(ok, vv, max_exp_avg_sqs[i]))
        denom = vv.sqrt() * inv_bc2 + eps
        w = w - step_size * m / denom
        exp_avgs[i].copy_(torch.where(ok, m.to(exp_avgs[i].dtype), exp_avgs[i]))
        exp_avg_sqs[i].copy_(torch.where(ok, v.to(exp_avg_sqs[i].dtype), exp_avg_sqs[i]))
        if master_mode == MASTER_F32:
            masters[i].copy_(torch.where(ok, w, masters[i]))
            new_p = w.to(p.dtype)
        elif master_mode == MASTER_REMAINDER:
            u = w.view(torch.int32)
            hi = ((u + 0x8000) >> 16) & 0xFFFF
            new_p = hi.to(torch.int16).view(torch.bfloat16)  # int32 -> int16 keeps the low bits
            masters[i].copy_(torch.where(ok, (u & 0xFFFF).to(torch.int16), masters[i]))
        elif stochastic_rounding and p.dtype == torch.bfloat16:
            u = w.view(torch.int32)
            r = torch.randint(0, 1 << 16, u.shape, device=u.device, dtype=torch.int32)
            finite = torch.isfinite(w)
            new_p = torch.where(finite, ((u + r) >> 16).to(torch.int16).view(torch.bfloat16), w.to(torch.bfloat16))
        else:
            new_p = w.to(p.dtype)
        p.copy_(torch.where(ok, new_p, p))
        steps[i].copy_(torch.where(ok, steps[i] + 1, steps[i]))
