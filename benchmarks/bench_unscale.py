"""Benchmark: mpkern.unscale_ vs the PyTorch AMP recipe on the same bf16 gradients, in one run.

Recipe (what a user runs today):
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
    torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
mpkern:
    mpkern.unscale_(params, inv_scale, max_norm=max_norm)

Byte model per bf16 parameter (mpkern.bytemodel): mpkern 6 B, recipe 10 B; limit 10/6 = 1.67x.
Grads are restored (untimed) before every timed call. The code is mpkern.bench.bench_unscale,
the same that `mpkern bench unscale` runs.

    python benchmarks/bench_unscale.py [--params 32e6] [--tensors 200] [--device cpu|cuda] [--quick]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

if __name__ == "__main__":
    raise SystemExit(common.script_main("unscale", out_dir=common.OUT_DIR, doc=__doc__))
