"""The pointer-load Triton GEMM kernel (``_matmul_kernel``): one program per C tile (the math, the
kernel choice and the launcher: :mod:`.matmul`).

Rows/columns past M/N are wrapped with ``% M`` / ``% N`` on load (valid memory; masked on store), only
the K tail is masked. Software-pipelined by Triton (``cp.async`` + ``mma.sync`` on sm_80, wgmma on
sm_90). It is the interpreter's kernel, the Ampere (sm_80/86/89) kernel, and the fallback for operands a
TMA descriptor cannot describe.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .matmul_tiles import epilogue, tile_coords


@triton.jit(do_not_specialize=["M_BUCKET", "N_BUCKET", "K_BUCKET", "LAYOUT"])
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr,
    M, N, K,
    M_BUCKET, N_BUCKET, K_BUCKET, LAYOUT,  # m_bucket(M/N/K), layout_code(strides): the autotuning key (unused)
    stride_am, stride_ak,
    stride_bk, stride_bn,
    stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr,     # bias_ptr: fp32 [N], contiguous
    ACCUMULATE: tl.constexpr,   # C (fp32) += A @ B (+ bias)
    OUT_BF16: tl.constexpr,     # c_ptr is bf16 storage viewed as int16: store rounded bits
    UPCAST: tl.constexpr,       # interpreter only: fp32 operands for tl.dot (triton #11584)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """The pointer kernel: one program per C tile (see the module docstring)."""
    pid = tl.program_id(0).to(tl.int64)
    pid_m, pid_n = tile_coords(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # int64
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # int64
    rk = tl.arange(0, BLOCK_K).to(tl.int64)
    # Out-of-range rows/columns read valid memory (wrapped) and are masked on store.
    ram = rm % M
    rbn = rn % N
    a_ptrs = a_ptr + ram[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + rk[:, None] * stride_bk + rbn[None, :] * stride_bn
    # K steps in int64, so BLOCK_K * stride never overflows int32 (strides may be specialised).
    a_step = tl.cast(stride_ak, tl.int64) * BLOCK_K
    b_step = tl.cast(stride_bk, tl.int64) * BLOCK_K

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=rk[:, None] < k_left, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        a_ptrs += a_step
        b_ptrs += b_step

    epilogue(acc, c_ptr, bias_ptr, rm, rn, M, N, stride_cm, stride_cn, HAS_BIAS, ACCUMULATE, OUT_BF16)


# The public handle of the raw JIT function (benchmarks/matmul_sass.py, the launcher in matmul.py).
pointer_kernel = _matmul_kernel
