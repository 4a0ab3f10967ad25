"""Benchmark: mpkern.matmul (fp32 accumulation) vs torch, TFLOP/s = 2MNK / time, in one run.

CUDA: the Triton GEMM vs cuBLAS on square 4096^3/8192^3 and LLM-shaped (M=16384, K=4096, N=11008)
forward, dgrad and wgrad problems (weight stored (N, K) like nn.Linear, transposed views, no
copies), bf16 and fp16, 16-bit and fp32 outputs, and wgrad accumulated into an fp32 main_grad
(mpkern: in the epilogue; torch: GEMM + add).
CPU: what mpkern.matmul runs there (ATen in fp32, then a cast) vs ATen's own 16-bit GEMM, plus
(without --quick) the Triton kernel in the interpreter checked against float64 on small shapes.
The code is mpkern.bench.bench_matmul, the same that `mpkern bench matmul` runs.

    python benchmarks/bench_matmul.py [--device cpu|cuda] [--quick] [--reps 20] [--no-plot]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

if __name__ == "__main__":
    raise SystemExit(common.script_main("matmul", out_dir=common.OUT_DIR, doc=__doc__))
