"""The persistent TMA Triton GEMM kernel (``_matmul_tma_kernel``) of Hopper (sm_90) and datacenter
Blackwell (sm_100), with its column-sliced epilogue (the math, the kernel choice and the launcher:
:mod:`.matmul`, whose docstring describes this kernel's TMA reads, persistence and epilogue slices).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .matmul_tiles import epilogue, tile_coords


@triton.jit
def _halves(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """The left and right column halves of ``x`` (ROWS, COLS): a register split, no data movement."""
    return tl.split(tl.permute(tl.reshape(x, (ROWS, 2, COLS // 2)), (0, 2, 1)))


@triton.jit
def _epilogue_cols(acc, part, c_ptr, bias_ptr, rm, off_n, M, N, stride_cm, stride_cn,
                   HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, OUT_BF16: tl.constexpr, WIDTH: tl.constexpr):
    """The epilogue of column slice ``part`` (WIDTH columns) of the tile whose first column is ``off_n``."""
    rn = off_n + part * WIDTH + tl.arange(0, WIDTH)
    epilogue(acc, c_ptr, bias_ptr, rm, rn, M, N, stride_cm, stride_cn, HAS_BIAS, ACCUMULATE, OUT_BF16)


# M and K: not specialised (their divisibility by 16, M == 1): TMA zero-fills past the edges, so neither
# changes this kernel's code (the same SASS, benchmarks/triton_aot.py) -- only the number of compiles, as
# the token count (M in fwd/dgrad, K in wgrad) changes with the batch. N keeps it: C's column mask.
@triton.jit(do_not_specialize=["M", "K", "M_BUCKET", "N_BUCKET", "K_BUCKET", "LAYOUT", "NUM_SMS"])
def _matmul_tma_kernel(
    a_desc, b_desc, c_ptr, bias_ptr,
    M, N, K,
    M_BUCKET, N_BUCKET, K_BUCKET, LAYOUT,  # the autotuning key (unused), as in _matmul_kernel
    stride_cm, stride_cn,
    NUM_SMS,                    # programs launched (<= number of SMs): the persistent loop's stride
    HAS_BIAS: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    OUT_BF16: tl.constexpr,
    UPCAST: tl.constexpr,
    A_T: tl.constexpr,          # a_desc describes A^T (K, M) with block [BLOCK_K, BLOCK_M]; else A, [BLOCK_M, BLOCK_K]
    B_T: tl.constexpr,          # b_desc describes B^T (N, K) with block [BLOCK_N, BLOCK_K]; else B, [BLOCK_K, BLOCK_N]
    EPI_SLICE_BYTES: tl.constexpr,  # the epilogue's column slices hold at most this many bytes of C (1, 2 or 4 slices)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """The persistent TMA kernel (see the docstring of :mod:`.matmul`). Program p computes tiles p, p + NUM_SMS, ...
    of the grouped order; the tile loop and the K loop are flattened into one pipelined loop."""
    TILE_BYTES: tl.constexpr = BLOCK_M * BLOCK_N * (c_ptr.dtype.element_ty.primitive_bitwidth // 8)
    SPLIT: tl.constexpr = 1 if TILE_BYTES <= EPI_SLICE_BYTES else (2 if TILE_BYTES <= 2 * EPI_SLICE_BYTES else 4)
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    # The epilogue finds its tile from its own counter (not the loads' tile_id): a value used both at
    # the top (loads) and the bottom (stores) of the flattened, pipelined loop would have to be carried
    # across its stages.
    tile_c = start - NUM_SMS
    for tile_id in tl.range(start, num_tiles, NUM_SMS, flatten=True):
        pid_m, pid_n = tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            # (constexpr conditions: only the chosen load is compiled)
            a = a_desc.load([off_k, off_m]).T if A_T else a_desc.load([off_m, off_k])
            b = b_desc.load([off_n, off_k]).T if B_T else b_desc.load([off_k, off_n])
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)

        tile_c += NUM_SMS
        pid_m, pid_n = tile_coords(tile_c, num_pid_m, num_pid_n, GROUP_M)
        rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        off_n = pid_n.to(tl.int64) * BLOCK_N
        # The epilogue in 1, 2 or 4 column slices of at most EPI_SLICE_BYTES of output each (4 at most: the
        # sm_90 tiles need no more): its layout conversion goes through a shared-memory scratch that cannot
        # reuse the pipeline's buffers (the next tile's loads are in flight), and an ACCUMULATE slice of C
        # is loaded next to the accumulator (registers).
        if SPLIT == 1:
            epilogue(acc, c_ptr, bias_ptr, rm, off_n + tl.arange(0, BLOCK_N), M, N, stride_cm, stride_cn,
                     HAS_BIAS, ACCUMULATE, OUT_BF16)
        elif SPLIT == 2:
            lo, hi = _halves(acc, BLOCK_M, BLOCK_N)
            _epilogue_cols(lo, 0, c_ptr, bias_ptr, rm, off_n, M, N, stride_cm, stride_cn,
                           HAS_BIAS, ACCUMULATE, OUT_BF16, BLOCK_N // 2)
            _epilogue_cols(hi, 1, c_ptr, bias_ptr, rm, off_n, M, N, stride_cm, stride_cn,
                           HAS_BIAS, ACCUMULATE, OUT_BF16, BLOCK_N // 2)
        else:
            lo, hi = _halves(acc, BLOCK_M, BLOCK_N)
            q0, q1 = _halves(lo, BLOCK_M, BLOCK_N // 2)
            _epilogue_cols(q0, 0, c_ptr, bias_ptr, rm, off_n, M, N, stride_cm, stride_cn,
                           HAS_BIAS, ACCUMULATE, OUT_BF16, BLOCK_N // 4)
            _epilogue_cols(q1, 1, c_ptr, bias_ptr, rm, off_n, M, N, stride_cm, stride_cn,
                           HAS_BIAS, ACCUMULATE, OUT_BF16, BLOCK_N // 4)
            q2, q3 = _halves(hi, BLOCK_M, BLOCK_N // 2)
            _epilogue_cols(q2, 2, c_ptr, bias_ptr, rm, off_n, M, N, stride_cm, stride_cn,
                           HAS_BIAS, ACCUMULATE, OUT_BF16, BLOCK_N // 4)
            _epilogue_cols(q3, 3, c_ptr, bias_ptr, rm, off_n, M, N, stride_cm, stride_cn,
                           HAS_BIAS, ACCUMULATE, OUT_BF16, BLOCK_N // 4)


# The public handle of the raw JIT function (benchmarks/matmul_sass.py, the launcher in matmul.py).
tma_kernel = _matmul_tma_kernel
