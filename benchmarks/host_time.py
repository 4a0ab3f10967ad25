"""Host time per tensor of one optimizer step (issue 15's goal: <= 1 us per tensor), not a test.

Many tiny bf16 tensors (default 1000 x 256 elements) so that the step is host-bound: the time is
Python, dispatch and per-tensor setup, not memory traffic. Prints FusedAdamWMP (clipping fused)
beside torch's fused AdamW + foreach clip_grad_norm_ on fp32 copies, fastest of ``--reps``, and a
breakdown of mpkern's step (collect, prepare, kernel call incl. the dispatcher's list unpacking).

    python benchmarks/host_time.py [--tensors 1000] [--numel 256] [--reps 30] [--no-clip]
"""

from __future__ import annotations

import argparse
import time

import torch

import mpkern
from mpkern.optim.functional import fused_adamw_mp


def _best(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--numel", type=int, default=256)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--no-clip", action="store_true")
    a = ap.parse_args()
    n, clip = a.tensors, None if a.no_clip else 1.0
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(a.numel).to(torch.bfloat16)) for _ in range(n)]
    for p in ps:
        p.grad = torch.randn(a.numel).to(torch.bfloat16)
    opt = mpkern.FusedAdamWMP(ps, lr=1e-3, max_grad_norm=clip)
    for _ in range(3):
        opt.step()
    ours = _best(opt.step, a.reps)
    ref_ps = [torch.nn.Parameter(p.detach().float()) for p in ps]
    for q, p in zip(ref_ps, ps):
        q.grad = p.grad.float()
    ref = torch.optim.AdamW(ref_ps, lr=1e-3, fused=True)

    def torch_step() -> None:
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref_ps, clip, foreach=True)
        ref.step()

    theirs = _best(torch_step, a.reps)
    work, _ = opt._collect()
    group, _dev, kind, pairs = work[0]
    lists, _ = opt._prepare(group, kind, pairs, True)
    *tensors, sids, offs = lists
    one, zero = torch.ones(()), torch.zeros(())
    parts = {"collect": _best(opt._collect, a.reps),
             "prepare": _best(lambda: opt._prepare(group, kind, pairs, True), a.reps),
             "kernel call": _best(lambda: fused_adamw_mp("cpu", *tensors, one, zero, None, 1e-3, group, kind.mode,
                                                         sids, offs), a.reps)}
    print(f"{n} bf16 tensors of {a.numel}, clip {'on' if clip else 'off'}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"  mpkern FusedAdamWMP.step       {ours * 1e3:7.2f} ms = {ours / n * 1e6:5.2f} us per tensor")
    print(f"  torch fused AdamW + foreach clip {theirs * 1e3:5.2f} ms = {theirs / n * 1e6:5.2f} us per tensor")
    print("  mpkern breakdown: " + ", ".join(f"{k} {v / n * 1e6:.2f} us" for k, v in parts.items()))


if __name__ == "__main__":
    main()
