"""Benchmark: FusedAdamWMP vs the PyTorch mixed-precision optimizer recipes, in one run.

All three do a loss-scaled (inv_scale 1/1024), clipped (max_norm 1.0) AdamW step:
(a) AMP recipe, fp32 params + grads: _amp_foreach_non_finite_check_and_unscale_ + clip_grad_norm_
    + AdamW(fused=True): 48 B/param
(b) bf16 params with hand-kept fp32 masters around (a): 52 B/param
(c) mpkern: bf16 params, mpkern.unscale_(opt, inv, max_norm) + FusedAdamWMP.step(): 30 B/param
Each peer row shows mpkern's speedup over it beside the byte-model limit (48/30, 52/30). The code
is mpkern.bench.bench_adamw, the same that `mpkern bench adamw` runs.

    python benchmarks/bench_adamw.py [--params 32e6] [--tensors 200] [--device cpu|cuda] [--quick]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

if __name__ == "__main__":
    raise SystemExit(common.script_main("adamw", out_dir=common.OUT_DIR, doc=__doc__))
