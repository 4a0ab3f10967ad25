#!/usr/bin/env bash
# Set up mpkern from scratch on a fresh machine: a virtual environment in .venv, PyTorch, the test
# tools, the optional extras (matplotlib, tqdm, transformers, accelerate, lightning, peft --
# MPKERN_EXTRAS=0 skips them; torch stays pinned while they install) and the native extension
# built in place (CPU kernels always; CUDA kernels compiled and linked when nvcc is found --
# MPKERN_BUILD_CUDA=1 makes that mandatory). Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1

echo "[setup] installing torch and tools (torch 2.14.1 is ~80 s from a local wheel, minutes from PyPI)"
# the test tools and linters: pyproject.toml's `test` extra (one list, read here, never copied; an
# assignment, so that a failure to read it stops the script under set -e)
deps=$(python - <<'PY'
import ast, re
text = open("pyproject.toml", encoding="utf-8").read()
print("\n".join(ast.literal_eval(re.search(r"^test = (\[.*\])$", text, re.M).group(1))))
PY
)
mapfile -t TEST_DEPS <<< "$deps"
python -m pip install -q "torch==2.14.1" numpy "${TEST_DEPS[@]}" ninja "setuptools>=64" wheel

if [ "${MPKERN_EXTRAS:-1}" != "0" ]; then
  echo "[setup] installing the optional extras: matplotlib tqdm transformers accelerate lightning peft torchao" \
       "(torch stays pinned)"
  echo "torch==2.14.1" > .venv/torch-pin.txt
  python -m pip install -q -c .venv/torch-pin.txt matplotlib tqdm "transformers>=4.40" "accelerate>=0.26" \
    "lightning>=2.2" "peft>=0.10"
  # torchao: its low-bit AdamWs run beside mpkern's in `mpkern bench adamw` (torchao declares no
  # dependencies, so it cannot replace torch; the pin guards that anyway)
  python -m pip install -q -c .venv/torch-pin.txt torchao
fi

echo "[setup] building the native extension (MPKERN_BUILD_CUDA=${MPKERN_BUILD_CUDA:-auto})"
python -m pip install -q --no-build-isolation --no-deps -e .
python -m mpkern info
