"""Triton GEMM for fp16/bf16 operands with fp32 accumulation (the kernel behind ``mpkern.matmul``).

Math, for A (M, K) and B (K, N) in fp16 or bf16 (both the same dtype), any strides:

    acc[m, n] = sum_k float32(A[m, k]) * float32(B[k, n])          (fp32 accumulator, tl.dot)
    acc      += float32(bias[n])                  if a bias is given
    acc      += C[m, n]                           if ACCUMULATE (C is fp32: C += A @ B, main_grad)
    C[m, n]   = round_to_nearest_even(acc, dtype of C)   -- C is fp16, bf16 or fp32

Tiling: one program per BLOCK_M x BLOCK_N output tile, a loop over K in BLOCK_K steps with only
the K tail masked (rows/columns past M/N are wrapped with ``% M`` / ``% N`` on load and masked on
store). Programs are numbered in groups of GROUP_M tile-rows so that consecutive programs reuse
the same A rows and B columns from L2. All offsets are int64. Transposed operands are strides,
never copies. Batch dimensions are folded into M by the caller.

Under ``TRITON_INTERPRET=1`` (CPU tensors):
* the interpreter's ``tl.dot`` multiplies bfloat16 bit patterns as integers (triton-lang/triton
  #11584), so the launcher sets ``UPCAST=True`` there and the operands are converted to fp32
  before ``tl.dot`` (exact: every fp16/bf16 value is an fp32 value; products are exact in fp32);
* its fp32->bf16 cast truncates; bf16 output is therefore always rounded with integer bit math
  (``f32_to_bf16_bits``, the same as ``math.h``) and stored as raw 16-bit words -- identical on
  the GPU, whose cast rounds to nearest even too;
* autotuning is off: one small fixed config keeps the tests fast.

On the GPU the kernel is autotuned. The tuning key buckets M, N and K to the next power of two
and reduces the operand strides to a layout code (per stride: is it 1, is it a multiple of 16 --
the classes Triton specialises on). The token count is M in the forward and input-gradient GEMMs
and K in the weight-gradient GEMMs (N or a stride in other uses); it changes with the batch
shape, and each new exact value would re-run the host-synchronising tuning benchmark for every
layer shape. The fp32 ``main_grad`` accumulate epilogue -- which holds the loaded C tile next to
the accumulator -- only tries configs with at most 64 accumulator values per thread (the larger
tiles spill there). ``MPKERN_MATMUL_CONFIG=fixed`` turns tuning off on the GPU too (one
fixed config: the tests and the GPU check use it, so no test waits on tuning).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import f32_to_bf16_bits

_IN_DTYPES = (torch.float16, torch.bfloat16)
_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# The one config used under the interpreter (tl.dot needs every block dim >= 16).
INTERPRET_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}


# The one config used on the GPU when MPKERN_MATMUL_CONFIG=fixed (64 accumulator values per thread:
# also fine for the accumulate epilogue).
FIXED_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8}
FIXED_LAUNCH = {"num_warps": 8, "num_stages": 3}
_MAX_ACC_PER_THREAD_ACCUMULATE = 64


def _fixed_config() -> bool:
    import os

    return os.environ.get("MPKERN_MATMUL_CONFIG", "").strip().lower() == "fixed"


def m_bucket(m: int) -> int:
    """The autotuning bucket of a GEMM size (M, N or K): the next power of two (3000 and 4000 share
    one tuning)."""
    return 1 << max(0, int(m) - 1).bit_length()


def layout_code(*strides: int) -> int:
    """The autotuning key of the operand strides (A's, then B's): per stride, whether it is 1 and
    whether it is a multiple of 16 -- the classes Triton specialises integer arguments on -- not its
    value: a contiguous (tokens, K) operand's row stride is K, and K is the token count in wgrad."""
    code = 0
    for i, s in enumerate(strides):
        code |= (int(s == 1) | int(s % 16 == 0) << 1) << (2 * i)
    return code


def _acc_per_thread(cfg: triton.Config) -> int:
    return cfg.kwargs["BLOCK_M"] * cfg.kwargs["BLOCK_N"] // (32 * cfg.num_warps)


def prune_configs(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Autotune pruning: for the fp32 accumulate epilogue keep only configs that do not spill
    (<= 64 accumulator values per thread); every config otherwise."""
    accumulate = kwargs.get("ACCUMULATE", named_args.get("ACCUMULATE", False))
    if not accumulate:
        return configs
    kept = [c for c in configs if _acc_per_thread(c) <= _MAX_ACC_PER_THREAD_ACCUMULATE]
    return kept or configs


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _configs() -> list[triton.Config]:
    """Autotune candidates: Hopper (sm_90, 228 KB smem) and Ampere (sm_80, 164 KB) friendly tiles.

    Large 128x256 / 256x128 tiles with 8 warps win on big problems on both; the 4-warp 128x128 and
    64-wide tiles cover skinny shapes (few tiles -> more programs per SM) and smaller GPUs.
    """
    c = triton.Config
    return [
        c({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=3, num_warps=8),
        c({"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=3, num_warps=8),
        c({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=8),
        c({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=8),
        c({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=4),
        c({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 32, "GROUP_M": 8}, num_stages=3, num_warps=8),
        c({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8}, num_stages=4, num_warps=4),
        c({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=4),
        c({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=4),
        c({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=5, num_warps=4),
        c({"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 32, "GROUP_M": 8}, num_stages=4, num_warps=4),
    ]


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
    pid = tl.program_id(0).to(tl.int64)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: GROUP_M tile-rows are swept column by column, so neighbouring programs
    # share A rows and B columns in L2.
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

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

    if HAS_BIAS:
        bias = tl.load(bias_ptr + rn, mask=rn < N, other=0.0)
        acc += bias[None, :]
    c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    c_mask = (rm[:, None] < M) & (rn[None, :] < N)
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=c_mask, other=0.0)
    if OUT_BF16:
        tl.store(c_ptrs, f32_to_bf16_bits(acc).to(tl.int16, bitcast=True), mask=c_mask)
    else:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


# GPU entry point: autotuned per (M, N, K buckets, layout code). restore_value keeps C intact while the
# tuner benchmarks candidates on an accumulating call (C += A @ B would otherwise be applied repeatedly).
TUNING_KEY = ["M_BUCKET", "N_BUCKET", "K_BUCKET", "LAYOUT", "ACCUMULATE", "OUT_BF16"]
_matmul_kernel_tuned = triton.autotune(
    configs=_configs(),
    key=TUNING_KEY,
    prune_configs_by={"early_config_prune": prune_configs},
    restore_value=["c_ptr"],
)(_matmul_kernel)


def _check(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None) -> None:
    if a.dim() != 2 or b.dim() != 2 or c.dim() != 2:
        raise ValueError(f"matmul kernel: expected 2-D a, b, out; got {tuple(a.shape)}, {tuple(b.shape)}, "
                         f"{tuple(c.shape)}")
    M, K = a.shape
    K2, N = b.shape
    if K != K2 or tuple(c.shape) != (M, N):
        raise ValueError(f"matmul kernel: shapes a {tuple(a.shape)} @ b {tuple(b.shape)} -> out {tuple(c.shape)} "
                         "do not fit")
    if a.dtype not in _IN_DTYPES or b.dtype != a.dtype:
        raise TypeError(f"matmul kernel: operands must both be float16 or both bfloat16, got {a.dtype} and {b.dtype}")
    if c.dtype not in _OUT_DTYPES:
        raise TypeError(f"matmul kernel: output must be float16, bfloat16 or float32, got {c.dtype}")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"matmul kernel: bias must have shape ({N},), got {tuple(bias.shape)}")
    if not (a.device == b.device == c.device) or (bias is not None and bias.device != a.device):
        raise ValueError("matmul kernel: all tensors must be on one device")


def kernel_args(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """The positional arguments of ``_matmul_kernel`` (up to the strides of C) for 2-D ``a @ b -> c``."""
    M, K = a.shape
    N = b.shape[1]
    return (a, b, c, bias if bias is not None else c, M, N, K, m_bucket(M), m_bucket(N), m_bucket(K),
            layout_code(a.stride(0), a.stride(1), b.stride(0), b.stride(1)),
            a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))


def matmul_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None = None,
                accumulate: bool = False) -> torch.Tensor:
    """``out = a @ b (+ bias)`` or, with ``accumulate``, ``out += a @ b (+ bias)``; returns ``out``.

    ``a`` (M, K) and ``b`` (K, N): fp16 or bf16, any strides. ``out`` (M, N): fp16/bf16/fp32,
    any strides (fp32 when accumulating). ``bias``: (N,), any float dtype, added in fp32.
    """
    _check(a, b, out, bias)
    if accumulate and out.dtype != torch.float32:
        raise TypeError(f"matmul kernel: accumulating needs an fp32 output, got {out.dtype}")
    M = a.shape[0]
    N = b.shape[1]
    if M == 0 or N == 0:
        return out
    if bias is not None:
        bias = bias.to(torch.float32).contiguous()
    out_bf16 = out.dtype == torch.bfloat16
    c = out.view(torch.int16) if out_bf16 else out
    interp = _interpreting() or a.device.type == "cpu"
    args = kernel_args(a, b, c, bias)
    flags = dict(HAS_BIAS=bias is not None, ACCUMULATE=bool(accumulate), OUT_BF16=out_bf16, UPCAST=interp)
    if interp:
        cfg = INTERPRET_CONFIG
        grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
        _matmul_kernel[grid](*args, **flags, **cfg)
    elif _fixed_config():
        cfg = FIXED_CONFIG
        grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
        with torch.cuda.device(a.device):
            _matmul_kernel[grid](*args, **flags, **cfg, **FIXED_LAUNCH)
    else:
        def grid(meta):
            return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

        with torch.cuda.device(a.device):
            _matmul_kernel_tuned[grid](*args, **flags)
    return out


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``a @ b (+ bias)`` for 2-D ``a`` (M, K), ``b`` (K, N), fp32 accumulation, new output tensor."""
    out = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype or a.dtype, device=a.device)
    return matmul_into(a, b, out, bias)
