"""The headline AdamW benchmark: ``mpkern.unscale_`` + ``FusedAdamWMP.step`` on bf16 params against
(a) the AMP recipe on fp32 params (the baseline of every AdamW-side row) and (b) bf16 params with
hand-kept fp32 masters, one loss-scaled, clipped step; and the host cost of the optimizer's
external-write check (switched through its public ``check_external_writes`` attribute)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from .. import _backend, bytemodel
from ..measure import measure_bandwidth, sync, time_fn
from .common import (
    ADAMW_INV_SCALE,
    ADAMW_LR,
    ADAMW_MAX_NORM,
    FULL,
    adamw_problem,
    amp_fp32_recipe,
    fused_flag,
    grads_of,
    row,
    tensor_sizes,
    unscale_clip,
)
from .switches import set_switch


def bench_adamw(device: torch.device | str, *, params: int = FULL["params"], tensors: int = FULL["tensors"],
                reps: int = 10, bandwidth: dict[str, float] | None = None,
                log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Loss-scaled (1/1024), clipped (1.0) AdamW step: FusedAdamWMP vs the two PyTorch recipes."""
    import mpkern

    dev = torch.device(device)
    bw = bandwidth or measure_bandwidth(dev)
    grads16, init = adamw_problem(dev, tensor_sizes(params, tensors))
    inv = torch.tensor(ADAMW_INV_SCALE, device=dev)
    lr = ADAMW_LR
    recipe_a, restore_a, _ = amp_fp32_recipe(init, grads16, inv, lr)  # (a) fp32 params and grads

    pb = [torch.nn.Parameter(w.to(torch.bfloat16)) for w in init]  # (b) bf16 params, fp32 masters by hand
    for p, x in zip(pb, grads16):
        p.grad = x.clone()
    masters = [torch.nn.Parameter(p.detach().float()) for p in pb]
    for m in masters:
        m.grad = torch.empty_like(m)
    opt_b = torch.optim.AdamW(masters, lr=lr, fused=fused_flag(dev))

    def recipe_b() -> None:
        torch._foreach_copy_(grads_of(masters), grads_of(pb))
        unscale_clip(masters, inv)
        opt_b.step()
        torch._foreach_copy_([p.data for p in pb], [m.data for m in masters])

    pc = [torch.nn.Parameter(w.to(torch.bfloat16)) for w in init]  # (c) mpkern
    for p, x in zip(pc, grads16):
        p.grad = x.clone()
    opt_c = mpkern.FusedAdamWMP(pc, lr=lr)

    def fused() -> None:
        mpkern.unscale_(opt_c, inv, max_norm=ADAMW_MAX_NORM)  # deferred into the step: grads are only read
        opt_c.step()

    recipe_b()
    fused()
    worst = max((a.float() - b.float()).abs().max().item() for a, b in zip(pb, pc))
    log(f"adamw: after one step, max |param (b) - param (c)| = {worst:.3g} (bf16 params, lr {lr})")
    t_a = time_fn(recipe_a, dev, reps=reps, setup=restore_a)
    t_b = time_fn(recipe_b, dev, reps=reps)  # reads the bf16 grads, never writes them
    t_c = time_fn(fused, dev, reps=reps)     # reads the bf16 grads, never writes them
    # the host-side check that re-seeds masters after external writes to the params (issue 7):
    # timed with it off, then on again, so drift between the two timings shows as noise
    set_switch(opt_c, "check_external_writes", False)
    t_off = time_fn(fused, dev, reps=reps)
    set_switch(opt_c, "check_external_writes", True)
    t_on = time_fn(fused, dev, reps=reps)
    log(f"adamw: external-write check ({tensors} tensors): on {1e3 * t_c:.3f} / {1e3 * t_on:.3f} ms, "
        f"off {1e3 * t_off:.3f} ms -> {1e6 * (min(t_c, t_on) - t_off):+.0f} us per step")
    on_us, off_us = write_check_host_cost(dev, tensors)
    log(f"adamw: external-write check, host cost alone ({tensors} tensors of 64 elements, interleaved): "
        f"on {on_us:.0f} us, off {off_us:.0f} us -> {on_us - off_us:+.1f} us per step")
    tr = bytemodel.STEP_TRAFFIC
    bwi = bw["inplace_GBps"]
    return [
        row("adamw", f"mpkern unscale_ + FusedAdamWMP ({_backend.select(dev)})", t_c, bpp=tr["mpkern"],
            params=params, bw=bwi),
        row("adamw", "torch AMP recipe, fp32 params (unscale + clip + fused AdamW)", t_a, bpp=tr["amp_fp32"],
            params=params, bw=bwi, peer_ratio=t_a / t_c, limit=bytemodel.limit(tr["amp_fp32"], tr["mpkern"])),
        row("adamw", "torch bf16 params + hand-kept fp32 masters", t_b, bpp=tr["bf16_masters"], params=params,
            bw=bwi, peer_ratio=t_b / t_c, limit=bytemodel.limit(tr["bf16_masters"], tr["mpkern"])),
        row("adamw", "mpkern, external-write check off (its cost: the difference)", t_off, bpp=tr["mpkern"],
            params=params, bw=bwi),
    ]


def write_check_host_cost(device: torch.device, tensors: int = 200, rounds: int = 40,
                          steps: int = 20) -> tuple[float, float]:
    """Median step time (us) of FusedAdamWMP on ``tensors`` tiny bf16 params with the external-write
    check on and off, interleaved ``rounds`` times -- the step is host-bound there, so the
    difference is the check's host cost."""
    import mpkern

    g = torch.Generator().manual_seed(3)
    ps = [torch.nn.Parameter(torch.randn(64, generator=g).to(torch.bfloat16).to(device)) for _ in range(tensors)]
    for p in ps:
        p.grad = torch.randn(64, generator=g).to(torch.bfloat16).to(device)
    opt = mpkern.FusedAdamWMP(ps, lr=1e-3)
    for _ in range(3):
        opt.step()
    res: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for check in (True, False):
            set_switch(opt, "check_external_writes", check)
            sync(device)
            t = time.perf_counter()
            for _ in range(steps):
                opt.step()
            sync(device)
            res[check].append((time.perf_counter() - t) / steps * 1e6)
    return statistics.median(res[True]), statistics.median(res[False])

