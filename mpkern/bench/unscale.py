"""``mpkern.unscale_`` against the PyTorch AMP recipe (``_amp_foreach_non_finite_check_and_unscale_``
+ ``clip_grad_norm_``) on the same bf16 grads; byte model 6 vs 10 B/param (:mod:`mpkern.bytemodel`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import _backend, bytemodel
from ..measure import measure_bandwidth, time_fn
from .common import FULL, grads_of, row, tensor_sizes, torch_unscale_clip, unscale_problem


def bench_unscale(device: torch.device | str, *, params: int = FULL["params"], tensors: int = FULL["tensors"],
                  reps: int = FULL["reps"], bandwidth: dict[str, float] | None = None,
                  log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """``mpkern.unscale_(params, inv_scale, max_norm=1)`` vs the PyTorch AMP recipe, bf16 grads."""
    import mpkern

    dev = torch.device(device)
    bw = bandwidth or measure_bandwidth(dev)
    ps = unscale_problem(dev, tensor_sizes(params, tensors))
    grads = grads_of(ps)
    backup = [x.clone() for x in grads]
    inv = torch.tensor(1.0 / 1024.0, device=dev)

    def restore() -> None:
        torch._foreach_copy_(grads, backup)

    def recipe() -> None:
        torch_unscale_clip(ps, inv, 1.0)

    def fused() -> None:
        mpkern.unscale_(ps, inv, max_norm=1.0)

    restore()
    recipe()
    ref = [x.float().clone() for x in grads]
    restore()
    fused()
    worst = max(((x.float() - r).abs() / r.abs().clamp(min=1e-30)).max().item() for x, r in zip(grads, ref))
    log(f"unscale_: max relative difference of grads, mpkern vs recipe {worst:.2e} (bf16 eps 7.8e-3)")
    t_ref = time_fn(recipe, dev, reps=reps, setup=restore)
    t_ours = time_fn(fused, dev, reps=reps, setup=restore)
    b_ours, b_ref = bytemodel.UNSCALE_TRAFFIC["mpkern"], bytemodel.UNSCALE_TRAFFIC["torch"]
    return [
        row("unscale", f"mpkern.unscale_ ({_backend.select(dev)})", t_ours, bpp=b_ours, params=params,
            bw=bw["inplace_GBps"]),
        row("unscale", "torch: _amp_foreach_non_finite_check_and_unscale_ + clip_grad_norm_", t_ref, bpp=b_ref,
            params=params, bw=bw["inplace_GBps"], peer_ratio=t_ref / t_ours, limit=bytemodel.limit(b_ref, b_ours)),
    ]
