"""The tile order and the epilogue that both Triton GEMM kernels share (:mod:`.matmul_pointer`,
:mod:`.matmul_tma`; the math and the choice between them: :mod:`.matmul`).

Tiles are numbered in groups of GROUP_M tile-rows, swept column by column, so that tiles computed at the
same time share A rows and B columns in L2. The epilogue: fp32 bias, the fp32 C tile (ACCUMULATE), the
rounding (bf16 with integer bit math, ``f32_to_bf16_bits``: the interpreter's cast truncates), a masked
store through C's strides with int64 element offsets.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import f32_to_bf16_bits


@triton.jit
def tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of tile number ``tile_id`` in the grouped order: GROUP_M tile-rows swept column by
    column, so neighbouring tiles share A rows and B columns in L2."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((tile_id % num_pid_in_group) % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def epilogue(acc, c_ptr, bias_ptr, rm, rn, M, N, stride_cm, stride_cn,
             HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, OUT_BF16: tl.constexpr):
    """C[rm, rn] = round(acc + bias[rn] (+ C[rm, rn] if ACCUMULATE)); rm, rn int64, masked to M x N."""
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
