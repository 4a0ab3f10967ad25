#!/usr/bin/env bash
# The one GPU check: what only a GPU can show, on one lent GPU (H100/H200, torch and triton already
# installed, no network), in at most 7 min 30 s of stage limits, one command, the summary always last.
#
#   bash scripts/gpu_check.sh [OUTDIR]            run it; logs, JSON and summary.txt under OUTDIR (gpu_out);
#                                                 exit status 0 only when every stage ended ok
#   bash scripts/gpu_check.sh --dry-run [OUTDIR]  list the stages, their limits and the sum; run nothing
#
# Every stage runs under its own `timeout` (SIGINT first, so pytest writes its XML and the Python
# stages mark their JSON "interrupted"; SIGKILL a few seconds later, inside the stage's limit), and
# every stage is also capped by the total deadline, so the run ends within TOTAL seconds plus the
# shell's own overhead. The summary (tools/gpu_check/summary.py, standard library only) runs from
# an EXIT trap: it is printed whatever failed, timed out or was interrupted.
#
# Stages, in order (limits in seconds below; `--dry-run` prints them):
#   precheck      ninja present, torch's CUDA version vs `nvcc --version`, the GPU's compute capability
#   build         the CUDA extension for this GPU's arch alone (TORCH_CUDA_ARCH_LIST from the precheck)
#   device        the CUDA kernels are built, run here and are selected; mpkern info; copy bandwidth
#   tests_gpu     ONE pytest process over the GPU-first files (-k "cuda or triton" in those whose CPU and
#                 reference variants add nothing on a GPU); JUnit XML + -v log, so tests count per file
#   unscale, adamw_cuda, adamw_triton, matmul, matmul_tuned
#                 benchmarks, one process each, each writing its own JSON after every row: kernel time
#                 from CUDA events over back-to-back calls, wall time, CUDA-graph replay
#                 (tools/gpu_check/stages_kernels.py, stages_matmul.py)
#   release       whole training steps, regular beside gradient release (one pass; two passes with the
#                 clip; forward + two backwards), peak memory, bitwise check (tools/gpu_check/release.py)
#   tests_rest    the other test files, in whatever time the stages above left
#   summary       GB/s and % of the measured copy bandwidth per kernel and storage mode (bytes from
#                 mpkern.bytemodel), TFLOP/s against cuBLAS, tests passed/failed/skipped per file
# It never changes GPU settings (no clocks, persistence mode, MIG or resets) and needs no network.
# How each number is made and what the first GPU run must confirm: benchmarks/GPU_CHECK.md.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

usage() { sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; }
DRY=0
OUT=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) [[ -n "$OUT" ]] && { echo "gpu_check.sh: one OUTDIR only" >&2; exit 2; }; OUT=$1 ;;
  esac
  shift
done
OUT=${OUT:-gpu_out}

TOTAL=450        # 7 min 30 s: the sum of the stage limits below may not exceed it
# GPU_CHECK_TOTAL=SECONDS: a shorter total for a lease with less time left (with GPU_CHECK_LIMITS
# setting some stages to 0 = not run, so that the others fit)
if [[ -n "${GPU_CHECK_TOTAL:-}" ]]; then
  if [[ ! $GPU_CHECK_TOTAL =~ ^[0-9]+$ ]] || (( GPU_CHECK_TOTAL > 450 )); then
    echo "gpu_check.sh: GPU_CHECK_TOTAL must be whole seconds <= 450, got '$GPU_CHECK_TOTAL'" >&2
    exit 2
  fi
  TOTAL=$GPU_CHECK_TOTAL
fi
SUMMARY_LIMIT=10
# name|limit (s)|what it runs
STAGES=(
  "precheck|15|ninja, torch CUDA vs nvcc --version, GPU capability (tools/gpu_check/precheck.py)"
  "build|130|MPKERN_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST=<this GPU> pip install --no-build-isolation --no-deps -e ."
  "device|15|CUDA kernels built + selected, mpkern info, copy bandwidth (1 GiB copy_, CUDA events)"
  "tests_gpu|90|one pytest process over the GPU-first files (list below), MPKERN_MATMUL_CONFIG=fixed"
  "unscale|20|mpkern.unscale_ on cuda and triton vs the torch recipe, 128M bf16 grads"
  "adamw_cuda|30|FusedAdamWMP, every storage mode with a cuda kernel, 32M params; + the torch AMP recipe"
  "release|30|gradient release: opt.backward(loss) vs loss.backward(); opt.step(), 100M bf16 params"
  "adamw_triton|45|FusedAdamWMP, every storage mode with a triton kernel (headline modes first)"
  "matmul|25|mpkern.matmul, fixed config (no tuning) vs cuBLAS: 4096^3, LLM fwd, wgrad +=main_grad"
  "matmul_tuned|30|one bf16 shape (LLM fwd 16384x4096x11008) through the autotuner (one tuning) vs cuBLAS"
  "tests_rest|REST|the other test files, one pytest process"
  "summary|$SUMMARY_LIMIT|$OUT/summary.txt (tools/gpu_check/summary.py)"
)
declare -A LIMIT WHAT
ORDER=()
for s in "${STAGES[@]}"; do
  IFS='|' read -r name limit what <<< "$s"
  ORDER+=("$name")
  WHAT[$name]=$what
  [[ $limit != REST ]] && LIMIT[$name]=$limit
done
# GPU_CHECK_LIMITS="build=6,tests_gpu=4": other limits for some stages (the script's own tests use it)
if [[ -n "${GPU_CHECK_LIMITS:-}" ]]; then
  IFS=',' read -ra pairs <<< "$GPU_CHECK_LIMITS"
  for kv in "${pairs[@]}"; do
    k=${kv%%=*} v=${kv#*=}
    if [[ -z "${WHAT[$k]+x}" || $k == tests_rest || ! $v =~ ^[0-9]+$ ]]; then
      echo "gpu_check.sh: GPU_CHECK_LIMITS: '$kv' is not STAGE=SECONDS for a stage other than tests_rest" >&2
      exit 2
    fi
    LIMIT[$k]=$v
  done
fi
fixed_sum=0
for name in "${ORDER[@]}"; do [[ $name != tests_rest ]] && fixed_sum=$((fixed_sum + LIMIT[$name])); done
LIMIT[tests_rest]=$((TOTAL - fixed_sum))   # at least this; more when earlier stages end early
if (( LIMIT[tests_rest] < 0 )); then
  echo "gpu_check.sh: the fixed stage limits add up to $fixed_sum s, over the total of $TOTAL s" >&2
  exit 1
fi

# the GPU-first test files, in the order they run (most GPU-specific first; a CUDA error that breaks
# the process's context shows as the first failure of the list): "all" runs every test of the file,
# "k" only its cuda/triton variants (its cpu and torch-reference variants add nothing on a GPU)
GPU_FIRST=(test_gpu_paths:all test_nosync:all test_capture:all test_capture_recipe:all test_streams:all
           test_release:all test_backend:all test_gpu_check:k test_unscale:k test_ops:all test_kernels_compact:all
           test_kernels_m4:all test_norm_identity:all
           test_optim:k test_matmul:k test_optim_generic:k test_math:k test_compact_state:k test_dropin:k
           test_scaler:k test_review:k test_bench:k test_moments8:all)
KEXPR="cuda or triton"
GPU_FILES=()
for entry in "${GPU_FIRST[@]}"; do
  f=${entry%%:*}
  [[ -f tests/$f.py ]] || continue
  GPU_FILES+=("tests/$f.py")
  [[ ${entry##*:} == all ]] && KEXPR="$KEXPR or $f.py"
done
REST_FILES=()
for f in tests/test_*.py; do
  skip=0
  for g in "${GPU_FILES[@]}"; do [[ $f == "$g" ]] && skip=1; done
  [[ $skip -eq 0 ]] && REST_FILES+=("$f")
done

if [[ $DRY -eq 1 ]]; then
  echo "gpu_check.sh stages (time limit in seconds), output under $OUT:"
  for name in "${ORDER[@]}"; do
    extra=""
    [[ $name == tests_rest ]] && extra=" (+ what earlier stages leave unused)"
    printf '  %-13s %4d s  %s%s\n' "$name" "${LIMIT[$name]}" "${WHAT[$name]}" "$extra"
    if [[ $name == tests_gpu ]]; then
      printf '  %-13s %6s  -k "%s"\n' "" "" "$KEXPR"
      for f in "${GPU_FILES[@]}"; do printf '  %-13s %6s    %s\n' "" "" "$f"; done
    fi
    if [[ $name == tests_rest ]]; then
      for f in "${REST_FILES[@]}"; do printf '  %-13s %6s    %s\n' "" "" "$f"; done
    fi
  done
  sum=0
  for name in "${ORDER[@]}"; do sum=$((sum + LIMIT[$name])); done
  echo "total: $sum s ($((sum / 60)) min $((sum % 60)) s; at most $TOTAL s)"
  [[ $sum -le $TOTAL ]] || { echo "gpu_check.sh: the stage limits exceed $TOTAL s" >&2; exit 1; }
  exit 0
fi

# ---- the run --------------------------------------------------------------------------------------
command -v timeout > /dev/null || { echo "gpu_check.sh: needs coreutils 'timeout'" >&2; exit 2; }
PY=${PYTHON:-python3}
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
START=$(date +%s)
if [[ -e "$OUT/stages.tsv" ]]; then  # a previous run's files would be summarised as this run's: move them
  rm -rf "$OUT/previous_run"
  mkdir -p "$OUT/previous_run"
  for g in "$OUT"/*; do [[ -f "$g" ]] && mv "$g" "$OUT/previous_run/"; done  # every file a stage wrote
  echo "[gpu_check] the previous run's files are in $OUT/previous_run"
fi
DEADLINE=$((START + TOTAL))
PYBIN=$(timeout 20 "$PY" -c 'import os, sys; print(os.path.dirname(sys.executable))' 2>/dev/null || true)
[[ -n "$PYBIN" ]] && export PATH="$PYBIN:$PATH"   # ninja / pip installed next to this python
export PYTHONUNBUFFERED=1 MPKERN_MATMUL_CONFIG=fixed
unset MPKERN_BACKEND TRITON_INTERPRET
CORES=$(nproc 2>/dev/null || echo 8)
: > "$OUT/stages.tsv"
for name in "${ORDER[@]}"; do printf '%s\t%s\t%s\n' "$name" "${LIMIT[$name]}" "${WHAT[$name]}"; done > "$OUT/plan.tsv"
printf '%s\n' "${GPU_FILES[@]}" > "$OUT/tests_gpu.list"
printf '%s\n' "${REST_FILES[@]}" > "$OUT/tests_rest.list"
echo "$KEXPR" > "$OUT/tests_gpu.k"

log() { echo "[gpu_check $(date +%H:%M:%S) +$(( $(date +%s) - START ))s] $*"; }
record() { printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" >> "$OUT/stages.tsv"; }
skip() { record "$1" "${LIMIT[$1]}" - - "not run ($2)"; log "$1: not run ($2)"; }

CUR="" CUR_NAME="" CUR_T0=0
stage() {  # stage NAME COMMAND... : run under min(its limit, what is left before the deadline)
  local name=$1
  shift
  local left=$((DEADLINE - $(date +%s) - SUMMARY_LIMIT))
  local limit=${LIMIT[$name]}
  [[ $name == tests_rest ]] && limit=$left
  (( limit > left )) && limit=$left
  if (( limit < 5 )); then skip "$name" "no time left"; return 0; fi
  local grace=8
  (( limit < 4 * grace )) && grace=$((limit / 4))
  log "$name: started (limit ${limit} s): $*"
  local t0
  t0=$(date +%s)
  # a Python stage still running 3 s before its SIGINT dumps every thread's stack to its log (a stage
  # stuck in native code -- a compiler, a kernel -- never reaches Python's KeyboardInterrupt)
  MPKERN_STAGE_DUMP_AFTER=$((limit - grace - 3)) \
    timeout -s INT -k "$grace" "$((limit - grace))" "$@" > "$OUT/$name.log" 2>&1 &
  CUR=$! CUR_NAME=$name CUR_T0=$t0
  wait "$CUR"
  local rc=$?
  CUR=""
  local dt=$(( $(date +%s) - t0 ))
  local status
  case $rc in
    0) status="ok" ;;
    124) status="TIMEOUT after ${dt} s (limit ${limit} s)" ;;
    137) status="KILLED after ${dt} s (limit ${limit} s; did not stop on SIGINT)" ;;
    *) status="failed rc=$rc after ${dt} s" ;;
  esac
  record "$name" "$limit" "$rc" "$dt" "$status"
  log "$name: $status"
  return $rc
}

DONE=0
finish() {
  [[ $DONE -eq 1 ]] && return
  DONE=1
  if [[ -n "$CUR" ]]; then  # the run was stopped inside a stage: stop it too, and say so
    kill -INT "$CUR" 2>/dev/null
    sleep 2
    kill -KILL "$CUR" 2>/dev/null
    record "$CUR_NAME" "${LIMIT[$CUR_NAME]}" 130 $(( $(date +%s) - CUR_T0 )) "interrupted (the run was stopped)"
  fi
  local t0
  t0=$(date +%s)
  if timeout -k 2 "$SUMMARY_LIMIT" "$PY" -m tools.gpu_check.summary "$OUT" --write > "$OUT/summary.log" 2>&1; then
    record summary "$SUMMARY_LIMIT" 0 $(( $(date +%s) - t0 )) ok
    cat "$OUT/summary.txt"
  else
    echo "=== gpu_check: the summary code failed (see $OUT/summary.log); the stages as recorded: ===" \
      | tee "$OUT/summary.txt"
    tail -5 "$OUT/summary.log" | tee -a "$OUT/summary.txt"
    column -t -s $'\t' "$OUT/stages.tsv" 2>/dev/null | tee -a "$OUT/summary.txt" || cat "$OUT/stages.tsv"
  fi
  log "done in $(( $(date +%s) - START )) s; everything is under $OUT"
}
trap finish EXIT
trap 'log "interrupted"; exit 130' INT TERM

# ---- precheck -------------------------------------------------------------------------------------
stage precheck "$PY" -m tools.gpu_check.precheck "$OUT"
PRE=$?
ARCH=$(cat "$OUT/arch.txt" 2>/dev/null || true)
if [[ $PRE -eq 3 || -z "$ARCH" ]]; then
  for s in build device tests_gpu unscale adamw_cuda release adamw_triton matmul matmul_tuned tests_rest; do
    skip "$s" "no CUDA GPU visible to torch"
  done
  exit 1
fi

# ---- build (this GPU's arch alone) ----------------------------------------------------------------
# Without an install mpkern.triton_kernels cannot even be imported (the install maps it), so a CUDA
# build that fails is followed, inside the same limit, by one without the CUDA kernels: the Triton
# paths and the tests still run (the stage then ends with rc=3 and says so at the end of build.log).
PIP_E="$PY -m pip install --no-build-isolation --no-deps --no-index --disable-pip-version-check -v -e ."
export TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS="$CORES"
if [[ $PRE -eq 4 ]]; then
  stage build bash -c "echo '[gpu_check] the toolchain cannot build CUDA (precheck.log): building without it'; \
    MPKERN_BUILD_CUDA=0 $PIP_E"
else
  stage build bash -c "MPKERN_BUILD_CUDA=1 $PIP_E && exit 0; \
    echo '[gpu_check] the CUDA build failed: building without the CUDA kernels'; \
    MPKERN_BUILD_CUDA=0 $PIP_E; rc=\$?; \
    echo \"[gpu_check] the CUDA build failed; the build without CUDA kernels ended with rc=\$rc\"; exit 3"
fi
stage device "$PY" -m tools.gpu_check.stages_kernels device --out "$OUT"

# ---- the GPU-first tests, one process --------------------------------------------------------------
stage tests_gpu "$PY" -m pytest -p no:cacheprovider -v --tb=short -rfE --durations=25 -o junit_family=xunit1 -o faulthandler_timeout=45 \
  --junitxml="$OUT/tests_gpu.xml" -k "$KEXPR" "${GPU_FILES[@]}"

# ---- benchmarks, one process and one JSON each -------------------------------------------------------
stage unscale "$PY" -m tools.gpu_check.stages_kernels unscale --out "$OUT"
stage adamw_cuda "$PY" -m tools.gpu_check.stages_kernels adamw --backend cuda --peer --out "$OUT"
stage release "$PY" -m tools.gpu_check.release --out "$OUT"
stage adamw_triton "$PY" -m tools.gpu_check.stages_kernels adamw --backend triton --out "$OUT"
stage matmul "$PY" -m tools.gpu_check.stages_matmul matmul --out "$OUT"
stage matmul_tuned "$PY" -m tools.gpu_check.stages_matmul matmul_tuned --out "$OUT"

# ---- the rest of the tests, in what is left -----------------------------------------------------------
stage tests_rest "$PY" -m pytest -p no:cacheprovider -v --tb=short -rfE -o junit_family=xunit1 -o faulthandler_timeout=45 \
  --junitxml="$OUT/tests_rest.xml" "${REST_FILES[@]}"
# exit status: 0 when every stage ended "ok", else 1 (the summary says which did not)
[[ -z "$(awk -F'\t' '$5 != "ok"' "$OUT/stages.tsv")" ]] && exit 0
exit 1
