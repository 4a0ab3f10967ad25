"""How big should ``release_bucket_bytes`` be? One-pass release steps against the regular step, per bucket size.

A bf16 MLP stack (``--layers`` x Linear(width, width) + GELU) takes whole steps (forward, backward, step) in
alternation: the regular ``loss.backward(); opt.step()`` and ``opt.backward(loss)`` with each bucket size, the
same weights and batches. Printed: median ms per step, the ratio to the regular step, and the most grad bytes the
buckets held at once. Small buckets cost a kernel call (and its host work) per bucket; large ones hold more grads.

    python benchmarks/release_bucket.py [--layers 16] [--width 1024] [--rows 256] [--reps 7]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import mpkern
from mpkern.bench.common import backward_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--buckets", default="1,4,16,32,128", help="bucket sizes in MiB")
    args = ap.parse_args()
    torch.manual_seed(0)
    mods = []
    for _ in range(args.layers):
        mods += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
    base = torch.nn.Sequential(*mods).to(torch.bfloat16)
    n = sum(p.numel() for p in base.parameters())
    xs = [torch.randn(args.rows, args.width, dtype=torch.bfloat16) for _ in range(3)]
    variants = {"regular": None} | {f"release {b} MiB": int(float(b) * 2**20) for b in args.buckets.split(",")}
    runs = {}
    for name, bucket in variants.items():
        model = copy.deepcopy(base)
        opt = mpkern.FusedAdamWMP(model.parameters(), lr=1e-4, release_grads=bucket is not None,
                                  release_bucket_bytes=bucket)
        runs[name] = (model, opt, [])
    for rep in range(args.reps + 1):  # alternate: each round runs every variant once
        for model, opt, times in runs.values():
            x = xs[rep % len(xs)]
            t0 = time.perf_counter()
            backward_step(opt, model(x).float().square().mean())
            if rep:  # the first round warms up (state, tables)
                times.append((time.perf_counter() - t0) * 1e3)
    ref = statistics.median(runs["regular"][2])
    print(f"# {args.layers} x Linear({args.width}) bf16 ({n / 1e6:.1f}M params, {2 * n / 2**20:.1f} MiB of grads), "
          f"{args.rows} rows, torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.reps}")
    print("| variant | ms/step | vs regular | grad MiB held at once |")
    print("|---|---|---|---|")
    for name, (_model, opt, times) in runs.items():
        ms = statistics.median(times)
        held = (f"{opt.mpkern_runtime.release.peak_bytes / 2**20:.1f}" if opt.release_grads
                else f"{2 * n / 2**20:.1f} (all)")
        print(f"| {name} | {ms:.2f} | {ms / ref:.3f}x | {held} |")


if __name__ == "__main__":
    main()
