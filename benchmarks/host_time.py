"""Host time per tensor of one optimizer step (issue 15's goal: <= 1 us per tensor), not a test.

Many tiny bf16 tensors (default 1000 x 256 elements) so that the step is host-bound: the time is
Python, dispatch and per-tensor setup, not memory traffic. Prints FusedAdamWMP (clipping fused) in
each default compact storage mode beside torch's fused AdamW + foreach clip_grad_norm_ on fp32
copies, fastest of ``--reps``, and a breakdown of mpkern's first-mode step (collect, prepare,
kernel call incl. the dispatcher's list unpacking). The code is :func:`mpkern.bench.host_time`,
the same that ``mpkern bench adamw`` runs for its host-time rows.

    python benchmarks/host_time.py [--tensors 1000] [--numel 256] [--reps 30] [--no-clip] [--modes default]
"""

from __future__ import annotations

import argparse

import torch

from mpkern import bench


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--numel", type=int, default=256)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--no-clip", action="store_true")
    ap.add_argument("--modes", default="default", help="FusedAdamWMP storage modes (see mpkern.bench.adamw_modes)")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    n = a.tensors
    res = bench.host_time(a.device, tensors=n, numel=a.numel, reps=a.reps, clip=not a.no_clip, modes=a.modes,
                          breakdown=True)
    print(f"{n} bf16 tensors of {a.numel}, clip {'off' if a.no_clip else 'on'}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    for label, t in res["mpkern"].items():
        shown = t if isinstance(t, str) else f"{t * 1e3:7.2f} ms = {t / n * 1e6:5.2f} us per tensor"
        print(f"  mpkern FusedAdamWMP.step, {label:32s} {shown}")
    t = res["torch"]
    print(f"  torch fused AdamW + foreach clip {'':24s} {t * 1e3:7.2f} ms = {t / n * 1e6:5.2f} us per tensor")
    if res.get("full_path"):
        label, t = res["full_path"]
        print(f"  mpkern full path (step cache off), {label:24s} {t * 1e3:7.2f} ms = {t / n * 1e6:5.2f} us per tensor")
    parts = res["breakdown"] or {}
    if "error" in parts:
        print(f"  mpkern full-path breakdown unavailable ({parts['error']})")
    elif parts:
        print("  mpkern full-path breakdown (first mode): "
              + ", ".join(f"{k} {v / n * 1e6:.2f} us" for k, v in parts.items()))


if __name__ == "__main__":
    main()
