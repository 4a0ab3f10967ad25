"""The Hopper GEMM without a Hopper GPU.

* ``benchmarks/matmul_sass.py --smoke`` compiles one small config of the TMA kernel ahead of time for
  sm_90 (Triton's own ptxas, no GPU): its SASS has wgmma (HGMMA) and TMA loads (UTMALDG) and no spill.
  It runs in a subprocess with TRITON_INTERPRET unset -- conftest sets it on a machine without a GPU,
  and a kernel module imported under it holds interpreter functions, which cannot be compiled.
* The TMA kernel's tiling -- descriptor block shapes, transposed operands as ``tile.T``, the persistent
  tile loop, the epilogue in column slices -- against float64, through ``matmul_into`` with
  ``MPKERN_MATMUL_KERNEL=tma``: in the interpreter on CPU (which runs descriptors too), the real kernel
  on a Hopper GPU (the pointer kernel elsewhere: the results must hold either way).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import DEVICE, triton_cuda_compiler_missing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "matmul_sass.py")


def test_sm90_smoke_config_has_wgmma_and_tma_and_no_spills(tmp_path):
    why = triton_cuda_compiler_missing()
    if why:
        pytest.skip(why)
    out = tmp_path / "sass.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    res = subprocess.run([sys.executable, SCRIPT, "--smoke", "--json", str(out)], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=180, check=False)
    assert out.exists(), f"exit {res.returncode}\n{res.stdout}\n{res.stderr[-3000:]}"
    (row,) = json.loads(out.read_text())["rows"]
    assert row["error"] is None, row["error"]
    assert row["hgmma"] > 0 and row["utmaldg"] > 0, row
    assert row["spill_bytes"] == 0 and row["stl"] == 0, row
    assert row["registers"] and row["shared"], row
    assert res.returncode == 0, res.stderr


def _rand(shape, dtype, gen, transposed=False):
    if transposed:
        return torch.randn(shape[::-1], generator=gen).to(dtype).to(DEVICE).t()
    return torch.randn(shape, generator=gen).to(dtype).to(DEVICE)


@pytest.mark.parametrize("m, n, k, a_t, b_t, out, bias, acc", [
    (72, 88, 40, False, True, "bf16", True, False),     # forward x @ W.t(): K, M and N tails
    (120, 64, 96, False, False, "fp32", True, False),   # input gradient, fp32 out in 4 epilogue slices
    (200, 104, 72, True, False, "fp32", False, True),   # weight gradient into main_grad: more tiles than programs
    (8, 16, 24, True, True, "fp16", False, False),      # both transposed, one partial tile
])
def test_tma_kernel_matches_float64(monkeypatch, m, n, k, a_t, b_t, out, bias, acc):
    from mpkern.triton_kernels import matmul as tk

    monkeypatch.setenv(tk.KERNEL_ENV, "tma")
    monkeypatch.setenv("MPKERN_MATMUL_CONFIG", "fixed")
    gen = torch.Generator().manual_seed(m * n + k)
    dt = torch.float16 if out == "fp16" else torch.bfloat16
    a = _rand((m, k), dt, gen, a_t)
    b = _rand((k, n), dt, gen, b_t)
    od = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[out]
    c = _rand((m, n), torch.float32, gen).to(od)
    bi = _rand((n,), torch.float32, gen) if bias else None
    c0 = c.double().cpu()
    if DEVICE.type == "cpu":
        assert tk.kernel_for(a, b) == ("tma", a_t, b_t)  # the interpreter runs the TMA kernel
    tk.matmul_into(a, b, c, bi, accumulate=acc)
    a64, b64 = a.double().cpu(), b.double().cpu()
    ref = a64 @ b64 + (bi.double().cpu() if bias else 0) + (c0 if acc else 0)
    got = c.double().cpu()
    if od == torch.float32:
        mag = a64.abs() @ b64.abs() + (c0.abs() if acc else 0)
        assert ((got - ref).abs() <= 1e-4 * mag + 1e-30).all()  # the rule of test_matmul.py
    else:  # one rounding of the fp32 sum: at most one ulp from the rounded exact result
        assert torch.allclose(got, ref.to(od).double(), rtol=2 ** -7 if od == torch.bfloat16 else 2 ** -9,
                              atol=1e-3)
