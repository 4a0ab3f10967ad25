"""Benchmark: mpkern.matmul (fp32 accumulation) route by route against the platform's GEMM, in one run.

Per GEMM of the GPT-2-small and Llama-7B layers (forward, input gradient, weight gradient, in
nn.Linear's layouts; CUDA adds the square 4096^3 / 8192^3 and LLM 16384x4096x11008 shapes): the
platform GEMM (torch.matmul), every route mpkern.matmul may take there (CUDA: cublas, triton; CPU:
aten, upcast), and its default choice with the route it took; TFLOP/s and ratios; the weight
gradients also accumulated into an fp32 main_grad. The full run adds GPT-2 small forward + backward
with torch.nn.Linear and mpkern.nn.Linear side by side, and on CPU the Triton kernel in the
interpreter checked against float64. The code is mpkern.bench.bench_matmul, what `mpkern bench
matmul` runs.

    python benchmarks/bench_matmul.py [--device cpu|cuda] [--quick] [--reps 20] [--no-plot]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

if __name__ == "__main__":
    raise SystemExit(common.script_main("matmul", out_dir=common.OUT_DIR, doc=__doc__))
