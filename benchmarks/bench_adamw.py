"""Benchmark: FusedAdamWMP vs the PyTorch mixed-precision optimizer recipes, in one run.

All three do a loss-scaled (inv_scale 1/1024), clipped (max_norm 1.0) AdamW step:

(a) AMP recipe, fp32 params + fp32 grads:
      _amp_foreach_non_finite_check_and_unscale_ + clip_grad_norm_(foreach=True) + AdamW(fused=True)
      48 B/param: unscale r/w 8, norm read 4, clip r/w 8, fused AdamW 28
(b) bf16 params, hand-kept fp32 masters: copy bf16 grads to fp32 master grads, (a) on the masters,
    copy masters back to the bf16 params
      52 B/param: grad copy 6, unscale 8, norm 4, clip 8, AdamW 28, param copy 6 -- minus nothing
(c) mpkern: bf16 params, mpkern.unscale_(opt, inv, max_norm) + FusedAdamWMP.step()
      30 B/param: stats read 2, fused step 28 (g 2, master 4+4, m 4+4, v 4+4, bf16 param 2)

Achieved GB/s by each byte model is printed beside the measured in-place memory bandwidth, and the
persistent optimizer-side memory per parameter (params, grads, masters, moments: summed tensor
bytes) of each.

    python benchmarks/bench_adamw.py [--params 32e6] [--tensors 200] [--device cpu|cuda]
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import mpkern  # noqa: E402


def nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def main(argv: list[str] | None = None) -> int:
    args = common.size_args(__doc__, reps=10).parse_args(argv)
    dev = torch.device(args.device)
    total = int(args.params)
    sizes = common.tensor_sizes(total, args.tensors)
    g = torch.Generator().manual_seed(1)
    grads16 = [(torch.randn(n, generator=g) * 64).to(torch.bfloat16).to(dev) for n in sizes]
    init = [(torch.randn(n, generator=g) * 0.02).to(dev) for n in sizes]
    inv = torch.tensor(1.0 / 1024, device=dev)
    max_norm = 1.0
    lr = 1e-4

    # (a) fp32 params, fp32 grads
    pa = [torch.nn.Parameter(w.clone()) for w in init]
    ga = [x.float() for x in grads16]
    for p, x in zip(pa, ga):
        p.grad = x.clone()
    opt_a = torch.optim.AdamW(pa, lr=lr, fused=True)

    def recipe_a():
        found = torch.zeros((), device=dev)
        torch._amp_foreach_non_finite_check_and_unscale_([p.grad for p in pa], found, inv)
        torch.nn.utils.clip_grad_norm_(pa, max_norm, foreach=True)
        opt_a.step()

    def restore_a():
        torch._foreach_copy_([p.grad for p in pa], ga)

    # (b) bf16 params + fp32 masters by hand
    pb = [torch.nn.Parameter(w.to(torch.bfloat16)) for w in init]
    for p, x in zip(pb, grads16):
        p.grad = x.clone()
    masters = [torch.nn.Parameter(p.detach().float()) for p in pb]
    for m in masters:
        m.grad = torch.empty_like(m)
    opt_b = torch.optim.AdamW(masters, lr=lr, fused=True)

    def recipe_b():
        torch._foreach_copy_([m.grad for m in masters], [p.grad for p in pb])
        found = torch.zeros((), device=dev)
        torch._amp_foreach_non_finite_check_and_unscale_([m.grad for m in masters], found, inv)
        torch.nn.utils.clip_grad_norm_(masters, max_norm, foreach=True)
        opt_b.step()
        torch._foreach_copy_([p.data for p in pb], [m.data for m in masters])

    # (c) mpkern
    pc = [torch.nn.Parameter(w.to(torch.bfloat16)) for w in init]
    for p, x in zip(pc, grads16):
        p.grad = x.clone()
    opt_c = mpkern.FusedAdamWMP(pc, lr=lr)

    def fused():
        mpkern.unscale_(opt_c, inv, max_norm=max_norm)
        opt_c.step()

    # same result first (one step from the same state)
    recipe_b()
    fused()
    worst = max((a.float() - b.float()).abs().max().item() for a, b in zip(pb, pc))
    print(f"after one step, max |param (b) - param (c)| = {worst:.3g} (bf16 params, lr {lr})")

    print(f"measuring memory bandwidth on {dev} ...", flush=True)
    bw = common.measure_bandwidth(dev)
    print(f"  in-place fp32 multiply: {bw['inplace_GBps']:.1f} GB/s, copy: {bw['copy_GBps']:.1f} GB/s", flush=True)
    t_a = common.time_fn(recipe_a, dev, reps=args.reps, setup=restore_a)
    t_b = common.time_fn(recipe_b, dev, reps=args.reps)
    t_c = common.time_fn(fused, dev, reps=args.reps)

    def state_bytes(opt, params):
        ts = list(params) + [p.grad for p in params]
        for p in params:
            ts += [v for v in opt.state[p].values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        return nbytes(ts)

    mem = {"a": state_bytes(opt_a, pa),
           "b": nbytes(list(pb) + [p.grad for p in pb]) + state_bytes(opt_b, masters),
           "c": state_bytes(opt_c, pc)}
    rows = []
    for key, name, t, bpp in (("a", "(a) AMP recipe, fp32 params", t_a, 48),
                              ("b", "(b) bf16 params + fp32 masters by hand", t_b, 52),
                              ("c", f"(c) mpkern FusedAdamWMP ({mpkern._backend.select(dev)})", t_c, 30)):
        gbps = bpp * total / t / 1e9
        rows.append({"method": name, "ms": t * 1e3, "B/param": bpp, "GB/s": gbps,
                     "% of in-place BW": 100 * gbps / bw["inplace_GBps"], "mpkern speedup": t / t_c,
                     "state B/param": mem[key] / total})
    meta = common.machine_info(dev) | {"params": total, "tensors": args.tensors, "bandwidth": bw,
                                       "command": "python benchmarks/bench_adamw.py"}
    md = common.write_results(f"adamw_{dev.type}", meta, rows)
    print(f"\n{meta['device']}, {total / 1e6:.0f}M params in {args.tensors} tensors, {meta['threads']} threads\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
