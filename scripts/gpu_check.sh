#!/usr/bin/env bash
# One prepared run for a GPU machine (e.g. the lent H200: torch 2.11, triton 3.6, no network):
# build for the visible GPU, run the test suite on CUDA, run the three benchmarks, and copy the
# logs and result tables to $OUT (default ./gpu_out). Uses the machine's own torch/triton.
#   bash scripts/gpu_check.sh            (inside the repository root)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MPKERN_BUILD_CUDA=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
{
  nvidia-smi || true
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
  time python3 -m pip install --no-build-isolation --no-deps -e . 2>&1 | tail -5
  python3 -m mpkern info
} > "$OUT/build.log" 2>&1
timeout 900 python3 -m pytest -q -x tests > "$OUT/tests.log" 2>&1; echo "pytest rc=$?" >> "$OUT/tests.log"
for b in unscale adamw matmul; do
  timeout 600 python3 "benchmarks/bench_$b.py" > "$OUT/bench_$b.log" 2>&1; echo "rc=$?" >> "$OUT/bench_$b.log"
done
cp benchmarks/out/*.png "$OUT/" 2>/dev/null || true  # the tables are in the logs; few files come back
tail -3 "$OUT/tests.log"; for b in unscale adamw matmul; do tail -8 "$OUT/bench_$b.log"; done
