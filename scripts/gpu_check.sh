#!/usr/bin/env bash
# The one GPU check: what only a GPU can show, on one lent GPU (H100/H200, torch and triton already
# installed, no network), in two profiles of at most 7 minutes of stage limits each, so that one short
# booking runs one profile and a second booking the other; the summary always last.
#
#   bash scripts/gpu_check.sh [--profile proof|scale] [OUTDIR]   run it (default: proof, OUTDIR gpu_out);
#                                                   exit status 0 only when every stage ended ok
#   bash scripts/gpu_check.sh --dry-run [--profile P] [OUTDIR]   list the stages, limits and total; run nothing
#
# Profiles (each stage's limit and what it runs: `--dry-run`), the most valuable evidence first:
#   proof  build -> device -> the GPU tests (crash-proof: a crash costs one test) -> the unscale and
#          AdamW kernels -> the lessons' GPT-2 challenge -> the memory checker
#   scale  build -> the seeds' 7B sentence on one card -> `mpkern compare --device cuda` -> the GPT-2
#          batch-size scaling -> the GEMM routes -> the Triton AdamW -> gradient release
# Every stage runs under its own `timeout` (SIGINT first, so pytest writes its XML and the Python stages
# mark their JSON "interrupted"; SIGKILL a few seconds later, inside the stage's limit; a Python stage
# dumps its stacks 3 s before the SIGINT), and under the profile's deadline. A stage whose limit is
# marked "+" also gets the time the stages before it left unused (a cached build gives the tests
# ~2 minutes more). The summary (python -m tools.gpu_check.summary, standard library only) runs from
# an EXIT trap: it is printed whatever failed, timed out or was interrupted, with what failed and where
# to look at its top. The build is cached across runs on a machine still warm (build/gpu_check/stamp:
# the sources, the arch, torch); Triton's cache is one folder shared by every stage (build/gpu_check/
# triton_cache) and so is mpkern's route cache. It never changes GPU settings (no clocks, persistence
# mode, MIG or resets) and needs no network. How each number is made: benchmarks/GPU_CHECK.md.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

usage() { sed -n '6,8p' "$0" | sed 's/^# \{0,1\}//'; }
DRY=0
OUT=""
PROFILE=proof
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --profile) shift; PROFILE=${1:-} ;;
    --profile=*) PROFILE=${1#--profile=} ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) [[ -n "$OUT" ]] && { echo "gpu_check.sh: one OUTDIR only" >&2; exit 2; }; OUT=$1 ;;
  esac
  shift
done
OUT=${OUT:-gpu_out}

MAX_TOTAL=420    # 7 min: the sum of a profile's stage limits may not exceed it
TOTAL=$MAX_TOTAL
# GPU_CHECK_TOTAL=SECONDS: a shorter total for a lease with less time left (with GPU_CHECK_LIMITS
# setting some stages to 0 = not run, so that the others fit)
if [[ -n "${GPU_CHECK_TOTAL:-}" ]]; then
  if [[ ! $GPU_CHECK_TOTAL =~ ^[0-9]+$ ]] || (( GPU_CHECK_TOTAL > MAX_TOTAL )); then
    echo "gpu_check.sh: GPU_CHECK_TOTAL must be whole seconds <= $MAX_TOTAL, got '$GPU_CHECK_TOTAL'" >&2
    exit 2
  fi
  TOTAL=$GPU_CHECK_TOTAL
fi
SUMMARY_LIMIT=10
# name|limit (s; "+": also what earlier stages left)|what it runs
case $PROFILE in
  proof) STAGES=(
    "precheck|10|ninja, torch CUDA vs nvcc --version, GPU capability (tools/gpu_check/precheck.py)"
    "build|120|MPKERN_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST=<this GPU> pip install --no-build-isolation --no-deps -e . (cached when unchanged)"
    "device|10|CUDA kernels built + selected, mpkern info, copy bandwidth (1 GiB copy_, CUDA events)"
    "tests_gpu|120+|pytest over every GPU-relevant test file (list below), crash-proof (pytest-xdist), value order"
    "unscale|15|mpkern.unscale_ on cuda and triton vs the torch recipe, 128M bf16 grads"
    "adamw_cuda|25|FusedAdamWMP, every storage mode with a cuda kernel, 32M params; + the torch AMP recipe"
    "e2e_gpt2|80|the lessons' challenge: GPT-2 small, 8 x 1024, FP32 / AMP bf16 / fp16+GradScaler / mpkern x2, one process each"
    "sanitizer|30|compute-sanitizer memcheck (+ racecheck on the shared-memory kernels) over small calls of every CUDA kernel"
    "summary|$SUMMARY_LIMIT|$OUT/summary.txt (tools/gpu_check/summary.py)"
  ) ;;
  scale) STAGES=(
    "precheck|10|ninja, torch CUDA vs nvcc --version, GPU capability (tools/gpu_check/precheck.py)"
    "build|120|MPKERN_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST=<this GPU> pip install --no-build-isolation --no-deps -e . (cached when unchanged)"
    "device|10|CUDA kernels built + selected, mpkern info, copy bandwidth (1 GiB copy_, CUDA events)"
    "sweep_adamw|30|the CUDA AdamW kernel's launch shape (block x grid/SM x chunk x load stages, 32 shapes), fp32 + 8-bit modes, 32M and GPT-2 layouts; the best -> kArchConfigs row"
    "e2e_llama7b|70+|the seeds' 7B sentence: Llama-7B shape, bf16 init on the GPU, checkpointing, 1 x 2048; 5 recipes, OOM rows with mpkern plan's bytes"
    "compare|50|mpkern compare --device cuda at its built-in default"
    "e2e_batch|50|GPT-2 small: the largest batch AMP and mpkern 8-bit + 4-bit m + release fit under 12 GB, from batch 1"
    "matmul_routes|25|every route of mpkern.matmul beside torch.matmul (cuBLAS): 4096^3, GPT-2 and Llama-7B layer GEMMs"
    "adamw_triton|25|FusedAdamWMP, every storage mode with a triton kernel (headline modes first)"
    "release|20|gradient release: opt.backward(loss) vs loss.backward(); opt.step(), 100M bf16 params"
    "summary|$SUMMARY_LIMIT|$OUT/summary.txt (tools/gpu_check/summary.py)"
  ) ;;
  *) echo "gpu_check.sh: --profile must be proof or scale, got '$PROFILE'" >&2; exit 2 ;;
esac
declare -A LIMIT WHAT PLUS
ORDER=()
for s in "${STAGES[@]}"; do
  IFS='|' read -r name limit what <<< "$s"
  ORDER+=("$name")
  WHAT[$name]=$what
  PLUS[$name]=0
  [[ $limit == *+ ]] && { PLUS[$name]=1; limit=${limit%+}; }
  LIMIT[$name]=$limit
done
# GPU_CHECK_LIMITS="build=6,tests_gpu=4": other limits for some stages (the script's own tests use it)
if [[ -n "${GPU_CHECK_LIMITS:-}" ]]; then
  IFS=',' read -ra pairs <<< "$GPU_CHECK_LIMITS"
  for kv in "${pairs[@]}"; do
    k=${kv%%=*} v=${kv#*=}
    if [[ -z "${WHAT[$k]+x}" || $k == summary || ! $v =~ ^[0-9]+$ ]]; then
      echo "gpu_check.sh: GPU_CHECK_LIMITS: '$kv' is not STAGE=SECONDS for a stage of the $PROFILE profile" >&2
      exit 2
    fi
    LIMIT[$k]=$v
  done
fi
sum=0
for name in "${ORDER[@]}"; do sum=$((sum + LIMIT[$name])); done
if (( sum > TOTAL )); then
  echo "gpu_check.sh: the $PROFILE profile's stage limits add up to $sum s, over the total of $TOTAL s" >&2
  exit 1
fi

# The GPU-relevant test files, in the order they run -- the most valuable evidence first: bit-identity
# of the CUDA/Triton kernels with the CPU ones and CUDA-graph capture, then sync-freedom, then the rest.
# "all" runs every test of the file (on a GPU its tests run on cuda: conftest's DEVICE), "k" only its
# cuda/triton variants (its cpu and torch-reference variants add nothing on a GPU).
GPU_TESTS=(test_gpu_paths:all test_compact_kernels:all test_compact_kernels_4bit:all test_norm_identity:all
           test_compact_moments:all test_ops:all test_capture:all test_capture_recipe:all
           test_nosync:all test_streams:all test_gpu_launches:all
           test_unscale:k test_release:all test_backend:all test_grad_offsets:all test_step_cache:all
           test_optim:k test_optim_generic:k test_math:k test_compact_master:k test_dropin:k test_matmul:k
           test_matmul_routes:all test_scaler:k test_shared_params:k test_param_changes:k test_clip_and_scaler:k
           test_compact_remainder:k test_nn_convert:all test_bias_correction:all test_step_cache_dispatch:all
           test_op_schema:all test_step_plan:all test_bench:k
           test_gpu_check:k test_compact_legacy_checkpoints:all test_adamw_shapes:all test_codecs:all)
# the test files that mention cuda but stay off the GPU check, and why (CI runs them on every change)
NOT_ON_GPU=("test_distributed: its NCCL variants need >= 2 GPUs; gloo on CPU runs in CI"
            "test_compare: the compare stage (scale profile) runs mpkern compare on the GPU itself"
            "test_matmul_sass: ahead-of-time SASS, no GPU involved"
            "test_cuda_sass_count: the SASS counter's loop arithmetic on written listings, no GPU involved"
            "test_triton_aot: ahead-of-time Triton compiles, no GPU involved"
            "test_gpu_sanitizer: the sanitizer stage's own CPU test; the stage runs the workload on the GPU itself"
            "test_gpu_xdist: the crash-proof test runner's own CPU test; tests_gpu runs under it"
            "test_results_page: benchmarks/RESULTS.md's length and the paths it names, no GPU involved")
KEXPR="cuda or triton"
GPU_FILES=()
for entry in "${GPU_TESTS[@]}"; do
  f=${entry%%:*}
  [[ -f tests/$f.py ]] || continue
  GPU_FILES+=("tests/$f.py")
  [[ ${entry##*:} == all ]] && KEXPR="$KEXPR or $f.py"
done

if [[ $DRY -eq 1 ]]; then
  echo "gpu_check.sh --profile $PROFILE: stages (time limit in seconds), output under $OUT:"
  for name in "${ORDER[@]}"; do
    extra=""
    (( ${PLUS[$name]} )) && extra=" (+ what earlier stages leave unused)"
    printf '  %-13s %4d s  %s%s\n' "$name" "${LIMIT[$name]}" "${WHAT[$name]}" "$extra"
    if [[ $name == tests_gpu ]]; then
      printf '  %-13s %6s  -k "%s"\n' "" "" "$KEXPR"
      for f in "${GPU_FILES[@]}"; do printf '  %-13s %6s    %s\n' "" "" "$f"; done
      for n in "${NOT_ON_GPU[@]}"; do printf '  %-13s %6s    not run: tests/%s\n' "" "" "${n/: /.py: }"; done
    fi
  done
  echo "total: $sum s ($((sum / 60)) min $((sum % 60)) s; at most $TOTAL s)"
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
CACHE=${GPU_CHECK_CACHE:-$PWD/build/gpu_check}   # kept between runs on a warm machine (build/ is ignored by git)
mkdir -p "$CACHE/triton_cache" "$CACHE/mpkern_cache"
export PYTHONUNBUFFERED=1 MPKERN_MATMUL_CONFIG=fixed
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$CACHE/triton_cache} MPKERN_CACHE_DIR=${MPKERN_CACHE_DIR:-$CACHE/mpkern_cache}
unset MPKERN_BACKEND TRITON_INTERPRET
CORES=$(nproc 2>/dev/null || echo 8)
: > "$OUT/stages.tsv"
echo "$PROFILE" > "$OUT/profile.txt"
for name in "${ORDER[@]}"; do printf '%s\t%s\t%s\n' "$name" "${LIMIT[$name]}" "${WHAT[$name]}"; done > "$OUT/plan.tsv"
printf '%s\n' "${GPU_FILES[@]}" > "$OUT/tests_gpu.list"
echo "$KEXPR" > "$OUT/tests_gpu.k"

log() { echo "[gpu_check $(date +%H:%M:%S) +$(( $(date +%s) - START ))s] $*"; }
record() { printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" >> "$OUT/stages.tsv"; }
skip() { record "$1" "${LIMIT[$1]}" - - "not run ($2)"; log "$1: not run ($2)"; }

# the planned start of each stage (the sum of the limits before it): a "+" stage may use the time by
# which the run is ahead of that plan
declare -A PLANNED_AT
acc=0
for name in "${ORDER[@]}"; do PLANNED_AT[$name]=$acc; acc=$((acc + ${LIMIT[$name]})); done

CUR="" CUR_NAME="" CUR_T0=0
stage() {  # stage NAME COMMAND... : run under min(its limit, what is left before the deadline)
  local name=$1
  shift
  local now
  now=$(date +%s)
  local left=$((DEADLINE - now - SUMMARY_LIMIT))
  local limit=${LIMIT[$name]}
  if (( limit == 0 )); then skip "$name" "limit 0 (GPU_CHECK_LIMITS)"; return 0; fi
  local ahead=$((START + PLANNED_AT[$name] - now))
  (( ${PLUS[$name]} && ahead > 0 )) && limit=$((limit + ahead))
  (( limit > left )) && limit=$left
  if (( limit < 5 )); then skip "$name" "no time left"; return 0; fi
  local grace=8
  (( limit < 4 * grace )) && grace=$((limit / 4))
  log "$name: started (limit ${limit} s): $*"
  # a Python stage still running 3 s before its SIGINT dumps every thread's stack to its log (a stage
  # stuck in native code -- a compiler, a kernel -- never reaches Python's KeyboardInterrupt); a stage
  # that plans its own work by time reads its budget from MPKERN_STAGE_LIMIT
  MPKERN_STAGE_DUMP_AFTER=$((limit - grace - 3)) MPKERN_STAGE_LIMIT=$((limit - grace)) \
    timeout -s INT -k "$grace" "$((limit - grace))" "$@" > "$OUT/$name.log" 2>&1 &
  CUR=$! CUR_NAME=$name CUR_T0=$now
  wait "$CUR"
  local rc=$?
  CUR=""
  local dt=$(( $(date +%s) - now ))
  local status
  case $rc in
    0) status="ok" ;;
    124) status="TIMEOUT after ${dt} s (limit ${limit} s)" ;;
    137) status="KILLED after ${dt} s (limit ${limit} s; did not stop on SIGINT)" ;;
    *) status="failed rc=$rc after ${dt} s" ;;
  esac
  [[ $rc -eq 0 && -s "$OUT/$name.note" ]] && status="ok ($(head -c 200 "$OUT/$name.note"))"
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

# ---- the stages -------------------------------------------------------------------------------------
# Without an install mpkern.triton_kernels cannot even be imported (the install maps it), so a CUDA
# build that fails is followed, inside the same limit, by one without the CUDA kernels: the Triton
# paths and the tests still run (the stage then ends with rc=3 and says so at the end of build.log).
# An unchanged tree on a machine still warm from an earlier run reuses that build: the stamp is the
# hash of the native sources, setup.py, the arch and the torch version, written after a build that
# ended ok and checked together with an import of the built module.
build_stage() {
  local pip_e="$PY -m pip install --no-build-isolation --no-deps --no-index --disable-pip-version-check -v -e ."
  local stamp
  stamp=$( { find csrc -type f | LC_ALL=C sort | xargs cat; cat setup.py pyproject.toml; echo "$ARCH";
             "$PY" -c 'import torch; print(torch.__version__)'; } 2>/dev/null | sha256sum | cut -c1-16)
  if [[ $PRE -ne 4 && -f "$CACHE/stamp" && "$(cat "$CACHE/stamp")" == "$stamp" ]] &&
     "$PY" -c 'import mpkern._C as C, sys; sys.exit(0 if C.cuda_built else 1)' 2>/dev/null; then
    echo "cached: the build of an earlier run ($stamp), sources unchanged" > "$OUT/build.note"
    stage build bash -c "cat '$OUT/build.note'"
    return $?
  fi
  rm -f "$CACHE/stamp"
  export TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS="$CORES"
  if [[ $PRE -eq 4 ]]; then
    stage build bash -c "echo '[gpu_check] the toolchain cannot build CUDA (precheck.log): building without it'; \
      MPKERN_BUILD_CUDA=0 $pip_e"
    return $?
  fi
  stage build bash -c "MPKERN_BUILD_CUDA=1 $pip_e && exit 0; \
    echo '[gpu_check] the CUDA build failed: building without the CUDA kernels'; \
    MPKERN_BUILD_CUDA=0 $pip_e; rc=\$?; \
    echo \"[gpu_check] the CUDA build failed; the build without CUDA kernels ended with rc=\$rc\"; exit 3"
  local rc=$?
  [[ $rc -eq 0 ]] && echo "$stamp" > "$CACHE/stamp"
  return $rc
}

tests_stage() {  # the GPU-relevant tests, crash-proof under pytest-xdist (found, or installed offline from
  # tools/gpu_check/wheels: plugins.json says which); without it one plain process (a crash ends that run)
  stage tests_gpu bash -c 'py=$1 out=$2; shift 2; mode=
    "$py" -m tools.gpu_check.plugins ensure --python "$py" --out "$out/plugins.json" >&2 || mode=--plain
    mapfile -t xa < <("$py" -m tools.gpu_check.plugins args $mode --collected-out "$out/tests_gpu.collected")
    exec "$py" -m pytest "${xa[@]}" "$@"' tests_gpu "$PY" "$OUT" \
    -p no:cacheprovider -v --tb=short -rfE --durations=25 -o junit_family=xunit1 -o faulthandler_timeout=45 \
    --junitxml="$OUT/tests_gpu.xml" -k "$KEXPR" "${GPU_FILES[@]}"
}

run_stage() {  # run_stage NAME: the command of each stage
  case $1 in
    build) build_stage ;;
    device) stage device "$PY" -m tools.gpu_check.stages_kernels device --out "$OUT" ;;
    tests_gpu) tests_stage ;;
    unscale) stage unscale "$PY" -m tools.gpu_check.stages_kernels unscale --out "$OUT" ;;
    adamw_cuda) stage adamw_cuda "$PY" -m tools.gpu_check.stages_kernels adamw --backend cuda --peer --out "$OUT" ;;
    adamw_triton) stage adamw_triton "$PY" -m tools.gpu_check.stages_kernels adamw --backend triton --out "$OUT" ;;
    release) stage release "$PY" -m tools.gpu_check.release --out "$OUT" ;;
    matmul_routes) stage matmul_routes "$PY" -m tools.gpu_check.stages_matmul matmul_routes --out "$OUT" ;;
    e2e_gpt2) stage e2e_gpt2 "$PY" -m tools.gpu_check.e2e gpt2 --device cuda --out "$OUT" ;;
    e2e_batch) stage e2e_batch "$PY" -m tools.gpu_check.e2e gpt2 --find-batch --batch 1 --memory-cap 12GB \
      --recipes amp-bf16,mpkern-8bit-4bitm-release --device cuda --out "$OUT" ;;
    e2e_llama7b) stage e2e_llama7b "$PY" -m tools.gpu_check.e2e llama7b --device cuda --out "$OUT" ;;
    sweep_adamw) stage sweep_adamw "$PY" -m tools.gpu_check.sweep --out "$OUT" ;;
    compare) stage compare "$PY" -m mpkern compare --device cuda --no-progress --out "$OUT/compare" ;;
    sanitizer) stage sanitizer "$PY" -m tools.gpu_check.sanitizer --out "$OUT" ;;
    *) echo "gpu_check.sh: no command for stage $1" >&2; return 2 ;;
  esac
}

stage precheck "$PY" -m tools.gpu_check.precheck "$OUT"
PRE=$?
ARCH=$(cat "$OUT/arch.txt" 2>/dev/null || true)
for name in "${ORDER[@]}"; do
  [[ $name == precheck || $name == summary ]] && continue
  if [[ $PRE -eq 3 || -z "$ARCH" ]]; then skip "$name" "no CUDA GPU visible to torch"; continue; fi
  run_stage "$name"
done
# exit status: 0 when every stage ended "ok", else 1 (the summary says which did not)
[[ -z "$(awk -F'\t' '$5 !~ /^ok/' "$OUT/stages.tsv")" ]] && exit 0
exit 1
