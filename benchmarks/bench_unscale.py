"""Benchmark: mpkern.unscale_ vs the PyTorch AMP recipe on the same bf16 gradients, in one run.

Recipe (what a user runs today):
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
    torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
mpkern:
    mpkern.unscale_(params, inv_scale, max_norm=max_norm)

Byte model per bf16 parameter: mpkern 6 B (stats read 2, scale read 2 + write 2);
recipe 10 B (unscale read+write 4, norm read 2, clip read+write 4).
Achieved GB/s is reported beside the measured in-place memory bandwidth.

    python benchmarks/bench_unscale.py [--params 32e6] [--tensors 200] [--device cpu|cuda]
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import mpkern  # noqa: E402


def make_params(total: int, count: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    params = []
    for n in common.tensor_sizes(total, count, seed):
        p = torch.nn.Parameter(torch.empty(n, dtype=dtype, device=device))
        p.grad = (torch.randn(n, generator=g) * 64.0).to(dtype).to(device)  # "scaled" grads
        params.append(p)
    return params


def main(argv: list[str] | None = None) -> int:
    args = common.size_args(__doc__, reps=15).parse_args(argv)
    device = torch.device(args.device)
    total = int(args.params)
    params = make_params(total, args.tensors, torch.bfloat16, device)
    grads = [p.grad for p in params]
    backup = [g.clone() for g in grads]
    max_norm = 1.0
    inv = torch.tensor(1.0 / 1024.0, device=device)

    def restore():
        for g, b in zip(grads, backup):
            g.copy_(b)

    def recipe():
        found_inf = torch.zeros((), device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv)
        torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)

    def fused():
        mpkern.unscale_(params, inv, max_norm=max_norm)

    # same result first: grads after both paths agree to bf16 rounding
    restore(); recipe(); ref = [g.float().clone() for g in grads]
    restore(); fused()
    worst = max(((g.float() - r).abs() / r.abs().clamp(min=1e-30)).max().item() for g, r in zip(grads, ref))
    print(f"max relative difference of grads, mpkern vs recipe: {worst:.2e} (bf16 eps 7.8e-3)")

    print(f"measuring memory bandwidth on {device} ...", flush=True)
    bw = common.measure_bandwidth(device)
    print(f"  in-place fp32 multiply: {bw['inplace_GBps']:.1f} GB/s, copy: {bw['copy_GBps']:.1f} GB/s")
    t_recipe = common.time_fn(recipe, device, reps=args.reps, setup=restore)
    t_fused = common.time_fn(fused, device, reps=args.reps, setup=restore)
    backend = mpkern._backend.select(device)
    rows = []
    for name, t, bpp in (("torch recipe", t_recipe, 10), (f"mpkern.unscale_ ({backend})", t_fused, 6)):
        gbps = bpp * total / t / 1e9
        rows.append({"method": name, "ms": t * 1e3, "B/param": bpp, "GB/s": gbps,
                     "% of in-place BW": 100 * gbps / bw["inplace_GBps"], "speedup": t_recipe / t})
    meta = common.machine_info(device) | {"params": total, "tensors": args.tensors, "dtype": "bfloat16",
                                          "bandwidth": bw, "command": "python benchmarks/bench_unscale.py"}
    md = common.write_results(f"unscale_{device.type}", meta, rows)
    print(f"\n{meta['device']}, {total / 1e6:.0f}M bf16 params in {args.tensors} tensors, {meta['threads']} threads\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
