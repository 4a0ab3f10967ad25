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
