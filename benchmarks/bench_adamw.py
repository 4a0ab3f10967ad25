"""Benchmark: FusedAdamWMP vs the PyTorch mixed-precision optimizer recipes, in one run.

All do a loss-scaled (inv_scale 1/1024), clipped (max_norm 1.0) AdamW step:
(a) AMP recipe, fp32 params + grads: _amp_foreach_non_finite_check_and_unscale_ + clip_grad_norm_
    + AdamW(fused=True): 48 B/param -- the baseline
(b) bf16 params with hand-kept fp32 masters around (a): 52 B/param
(c) mpkern: bf16 params, mpkern.unscale_(opt, inv, max_norm) + FusedAdamWMP.step(): 30 B/param
Each peer row shows mpkern's speedup over it beside the byte-model limit (48/30, 52/30).

Then, on the same problem:
* FusedAdamWMP in the compact storage modes (--modes; default fp32+fp32, remainder+bf16,
  8-bit master+bf16, and 8-bit master+8-bit, remainder+8-bit moments where this build has them):
  the bytes the step moves (from the storage descriptions), GB/s against the measured copy
  bandwidth, the resident state bytes/param, and the speed over (a) beside its limit 48 / bytes;
* torchao's AdamW8bit (fp32 and bf16 params) and bf16 stochastic-rounding _AdamW when torchao
  imports ("not installed" rows otherwise; --torchao-params caps their size, --no-torchao skips):
  time, state bytes/param summed from the real state tensors, speed over (a) per param;
* host time per tensor: one step of 1000 bf16 tensors of 256 elements, clip on, each default mode
  beside torch fused AdamW + foreach clip_grad_norm_ (--no-host-time skips).
The code is mpkern.bench (bench_adamw, bench_adamw_modes, bench_torchao, bench_host_time), the
same that `mpkern bench adamw` runs.

    python benchmarks/bench_adamw.py [--params 32e6] [--tensors 200] [--device cpu|cuda] [--quick]
                                     [--modes default|all|none|MASTER:MOMENTS,...] [--torchao-params N]
                                     [--no-torchao] [--no-host-time]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

if __name__ == "__main__":
    raise SystemExit(common.script_main("adamw", out_dir=common.OUT_DIR, doc=__doc__))
