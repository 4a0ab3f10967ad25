"""Triton kernels of the unscale_ ops (``grad_stats`` and ``scale_``).

Multi-tensor: a device table with one row per (tensor, range) work item --
``(address, begin, end, slot)`` -- and one program per row, built once per layout of the tensor
list and cached on the device (``tables.py``): no per-call host work beyond the cache key. One
table holds the rows of both kernels (one cached entry per tensor list):

* ``scale_``: one launch per element dtype. Its first ``n_aligned`` rows are *aligned*: they start
  at a 16-byte-aligned address, at a multiple of CHUNK, and end at a multiple of 8 elements (the
  compiler is told so and uses 16-byte accesses); the others hold the few head elements before a
  tensor's first aligned address and its last ``numel % 8``.
* ``grad_stats``: one row per norm chunk (16384 elements from the tensor's first element, as the
  reduction order needs -- see below), one launch per element dtype, the rows of a 16-byte-aligned
  tensor aligned (all but a last chunk that ends off a multiple of 8 elements) and first. Each row
  writes its fp64 chunk partial at a slot that keeps each tensor's partials contiguous and in chunk
  order, and a second kernel combines each tensor's partials.

Aligned or not is a run-time choice (``program_id < n_aligned``, a uniform branch at the start of a
program, not a constexpr): both loops are in one compiled kernel, so a dtype costs one compile and
one launch, not two (``benchmarks/triton_aot.py`` counts the compiles).

The sum of squares follows ``csrc/include/mpkern/norm.h`` bit for bit, as the CPU kernel and
``mpkern.reference.grad_stats`` do: squares exact in fp64; per chunk 64 blocks x 16 rows x 16
lanes, each lane summed over its rows in row order, a halves-tree over the 16 lanes of a block and
one over the 64 blocks; per tensor 128 lanes of chunk partials (chunk c into lane c % 128, in
chunk order) and a halves-tree over them; ``sumsq = float32(S * inv_scale**2)`` in fp64. The
halves-trees are explicit (reshape to ``[..., 2, N/2]``, move the 2 last, ``tl.split``, add):
``tl.sum``'s combining order is not specified.
This works on GPUs and under ``TRITON_INTERPRET=1`` on CPU tensors.

Math (mirrors ``csrc/include/mpkern/math.h`` / ``norm.h``):
  sumsq[t] = sum_i (x_i * inv_scale)^2, as float32(S * inv_scale^2), S the fp64 sum above
  amax[t]  = max_i (bits(x_i) & 0x7fffffff) as float   -- NaN > inf > any finite, so it doubles
                                                         as the non-finite flag
  scale_:  x_i <- round_to_dtype(x_i * s); nothing is written when s == 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import VEC, block_index, device_guard, load_f32, store_f32, typed_ptr
from .tables import TABLES, common_head, layout, to_device, work_ranges

CHUNK = 16384
BLOCK = 1024
ROW = 4  # address, begin, end, slot
# The norm reduction's shape (csrc/include/mpkern/norm.h; mpkern.reference.NORM_*).
NORM_LANES, NORM_ROWS, NORM_BLOCKS, NORM_TENSOR_LANES = 16, 16, 64, 128
NORM_BLOCK = NORM_LANES * NORM_ROWS
NORM_CHUNK = NORM_BLOCK * NORM_BLOCKS

_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@triton.jit
def _work_item(table_ptr, DT: tl.constexpr, ALIGNED: tl.constexpr):
    """Row ``program_id`` of a (address, begin, end, slot) work table: typed pointer, begin, end, slot.
    ALIGNED rows: the address is 16-byte aligned, begin a multiple of 16, end of 8 elements."""
    item = tl.program_id(0).to(tl.int64)
    addr = tl.load(table_ptr + item * 4)
    begin = tl.load(table_ptr + item * 4 + 1)
    end = tl.load(table_ptr + item * 4 + 2)
    slot = tl.load(table_ptr + item * 4 + 3)
    if ALIGNED:
        begin = tl.multiple_of(begin, 16)
        end = tl.multiple_of(end, 8)
    return typed_ptr(addr, DT, ALIGNED), begin, end, slot


@triton.jit
def _halves(v, M: tl.constexpr, N: tl.constexpr):
    """One level of a halves-tree over the last dimension of ``v`` [M, N]: [M, N/2] with
    ``v[:, i] + v[:, i + N/2]``: the reshape puts the two halves on an axis of size 2, and a sum
    over two elements is their one addition (commutative: the same bits whatever the order)."""
    return tl.sum(tl.reshape(v, [M, 2, N // 2]), axis=1)


@triton.jit
def _halves_1d(v, N: tl.constexpr):
    """One level of a halves-tree over ``v`` [N]: [N/2] with ``v[i] + v[i + N/2]``."""
    return tl.sum(tl.reshape(v, [2, N // 2]), axis=0)


@triton.jit
def _tree_1d(v, N: tl.constexpr):
    """The halves-tree over ``v`` [N] (N a power of two): a [1] tensor."""
    if N >= 2:
        v = _halves_1d(v, N)
    if N >= 4:
        v = _halves_1d(v, N // 2)
    if N >= 8:
        v = _halves_1d(v, N // 4)
    if N >= 16:
        v = _halves_1d(v, N // 8)
    if N >= 32:
        v = _halves_1d(v, N // 16)
    if N >= 64:
        v = _halves_1d(v, N // 32)
    if N >= 128:
        v = _halves_1d(v, N // 64)
    tl.static_assert(N <= 128)
    return v


@triton.jit
def _grad_stats_row(table_ptr, part_sum_ptr, part_max_ptr, DT: tl.constexpr, ALIGNED: tl.constexpr,
                    BLOCKS: tl.constexpr, ROWS: tl.constexpr, LANES: tl.constexpr):
    """One norm chunk (elements [begin, end), begin a multiple of 16384, zero-padded) -> its fp64
    partial: the [BLOCKS, LANES] lane sums accumulated row by row (element
    begin + k*256 + r*16 + l goes to lane (k, l) at step r), then the halves-trees over the 16
    lanes of each block and over the 64 blocks."""
    ptr, begin, end, slot = _work_item(table_ptr, DT, ALIGNED)
    offs = (tl.arange(0, BLOCKS).to(tl.int64) * (ROWS * LANES))[:, None] + tl.arange(0, LANES)[None, :]
    acc = tl.zeros([BLOCKS, LANES], dtype=tl.float64)
    mx = tl.zeros([BLOCKS, LANES], dtype=tl.int32)
    for r in range(ROWS):
        idx = begin + r * LANES + offs
        x = load_f32(ptr, idx, idx < end, DT)  # 0 past the end: +0 adds nothing
        # |x| bits: non-negative as int32, ordered like |x| with inf and NaN on top.
        mx = tl.maximum(mx, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
        xd = x.to(tl.float64)
        acc = acc + xd * xd  # exact square (a contraction into an fma gives the same bits)
    v = _halves(acc, BLOCKS, LANES)
    v = _halves(v, BLOCKS, LANES // 2)
    v = _halves(v, BLOCKS, LANES // 4)
    v = _halves(v, BLOCKS, LANES // 8)  # [BLOCKS, 1]: the block partials
    p = _tree_1d(tl.reshape(v, [BLOCKS]), BLOCKS)  # [1]
    one = tl.arange(0, 1)
    tl.store(part_sum_ptr + slot + one, p)
    tl.store(part_max_ptr + slot, tl.max(tl.max(mx, axis=1), axis=0))


@triton.jit(do_not_specialize=["n_aligned"])  # a count: never a constant, nor a divisibility variant
def _grad_stats_kernel(
    table_ptr,  # int64 [items, 4]: address, begin, end, slot -- one norm chunk per row
    part_sum_ptr,  # float64 [slots]: the chunk partials P[c]
    part_max_ptr,  # int32 [slots] (float bits of max |x|)
    n_aligned,  # rows [0, n_aligned) are aligned (see _work_item)
    DT: tl.constexpr,
    BLOCKS: tl.constexpr,  # 64 blocks of
    ROWS: tl.constexpr,  # 16 rows of
    LANES: tl.constexpr,  # 16 lanes
):
    if tl.program_id(0) < n_aligned:
        _grad_stats_row(table_ptr, part_sum_ptr, part_max_ptr, DT, True, BLOCKS, ROWS, LANES)
    else:
        _grad_stats_row(table_ptr, part_sum_ptr, part_max_ptr, DT, False, BLOCKS, ROWS, LANES)


# inv_scale_ptr: the caller's scalar, read once: its alignment must not make a variant of its own
@triton.jit(do_not_specialize=["inv_scale_ptr"])
def _grad_stats_finalize_kernel(
    offsets_ptr,  # int64 [tensors + 1]: tensor t owns slots [offsets[t], offsets[t + 1]), in chunk order
    part_sum_ptr,  # float64 [slots]
    part_max_ptr,  # int32 [slots]
    inv_scale_ptr,  # float32 [1]
    sumsq_ptr,  # float32 [tensors]
    amax_ptr,  # int32 [tensors]
    TLANES: tl.constexpr,  # 128
):
    """One program per tensor: chunk partial c into lane c % 128 (in chunk order), the
    halves-tree over the lanes, then sumsq = float32(S * inv^2) (norm.h steps 3-4)."""
    t = tl.program_id(0).to(tl.int64)
    lo = tl.load(offsets_ptr + t)
    hi = tl.load(offsets_ptr + t + 1)
    acc = tl.zeros([TLANES], dtype=tl.float64)
    mx = tl.zeros([TLANES], dtype=tl.int32)
    for s in range(lo, hi, TLANES):
        i = s + tl.arange(0, TLANES).to(tl.int64)
        m = i < hi
        acc = acc + tl.load(part_sum_ptr + i, mask=m, other=0.0)
        mx = tl.maximum(mx, tl.load(part_max_ptr + i, mask=m, other=0))
    S = _tree_1d(acc, TLANES)  # [1]
    inv = tl.load(inv_scale_ptr).to(tl.float64)
    res = (S * (inv * inv)).to(tl.float32)
    res = tl.where(hi > lo, res, 0.0)  # an empty tensor: 0 (not 0 * inv^2, NaN for an infinite inv)
    one = tl.arange(0, 1)
    tl.store(sumsq_ptr + t + one, res)
    tl.store(amax_ptr + t, tl.max(mx, axis=0))


@triton.jit
def _scale_row(table_ptr, s, DT: tl.constexpr, ALIGNED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    ptr, begin, end, _ = _work_item(table_ptr, DT, ALIGNED)
    for off in range(0, CHUNK, BLOCK):
        idx = block_index(begin, off, ALIGNED, BLOCK)
        mask = idx < end
        x = load_f32(ptr, idx, mask, DT)
        store_f32(ptr, idx, x * s, mask, DT)


@triton.jit(do_not_specialize=["scale_ptr", "n_aligned"])  # scale_ptr: a scalar, as inv_scale_ptr above
def _scale_kernel(
    table_ptr,  # int64 [items, 4]: address, begin, end, slot
    scale_ptr,  # float32 [1]
    n_aligned,  # rows [0, n_aligned) are aligned (see _work_item)
    DT: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    s = tl.load(scale_ptr)
    if s != 1.0:
        if tl.program_id(0) < n_aligned:
            _scale_row(table_ptr, s, DT, True, CHUNK, BLOCK)
        else:
            _scale_row(table_ptr, s, DT, False, CHUNK, BLOCK)


_ELEM_BYTES = {0: 4, 1: 2, 2: 2}


@dataclass
class _Plan:
    """The cached launch plan of one tensor list: one device table (the rows of both kernels)
    and the launches of each kernel over it."""

    table: torch.Tensor  # int64 [rows, ROW] on the device
    launches: list[tuple[int, int, int, int]]  # scale_: (dtype code, first row, rows, aligned rows)
    stats_launches: list[tuple[int, int, int, int]]  # grad_stats: the same, one row per norm chunk
    offsets: torch.Tensor  # int64 [tensors + 1] on the device: grad_stats slot range of each tensor
    slots: int


def _launches(groups: dict[tuple[int, bool], list[list[int]]], table_rows: list[list[int]]
              ) -> list[tuple[int, int, int, int]]:
    """Append the rows of each dtype to ``table_rows``, its aligned group first; one launch per dtype:
    (dtype, first row, rows, aligned rows)."""
    launches = []
    for dt in sorted({dt for dt, _ in groups}):
        aligned, other = groups.get((dt, True), []), groups.get((dt, False), [])
        launches.append((dt, len(table_rows), len(aligned) + len(other), len(aligned)))
        table_rows += aligned + other
    return launches


def _build_plan(tensors: Sequence[torch.Tensor], device: torch.device) -> _Plan:
    groups: dict[tuple[int, bool], list[list[int]]] = {}
    stats: dict[tuple[int, bool], list[list[int]]] = {}
    offsets = [0]
    slot = 0
    for t in tensors:
        n = t.numel()
        if n:
            dt = _CODES[t.dtype]
            es = _ELEM_BYTES[dt]
            addr = t.data_ptr()
            head = common_head([(addr, es)])
            for b, e, al in work_ranges(n, head, CHUNK, VEC):
                groups.setdefault((dt, al), []).append([addr + head * es if al else addr, b, e, 0])
            # grad_stats: norm chunks from element 0 (chunk c at slot offsets[t] + c); aligned when
            # the tensor starts on 16 bytes and the chunk ends on a multiple of VEC elements
            for b in range(0, n, NORM_CHUNK):
                e = min(n, b + NORM_CHUNK)
                al = addr % 16 == 0 and e % VEC == 0
                stats.setdefault((dt, al), []).append([addr, b, e, slot])
                slot += 1
        offsets.append(slot)
    table_rows: list[list[int]] = []
    launches = _launches(groups, table_rows)
    stats_launches = _launches(stats, table_rows)
    return _Plan(to_device(table_rows, ROW, device), launches, stats_launches,
                 to_device([offsets], len(offsets), device).reshape(-1), slot)


def _plan(tensors: Sequence[torch.Tensor], device: torch.device) -> _Plan:
    return TABLES.get(("unscale", device, layout(tensors)), device, lambda: _build_plan(tensors, device))


def grad_stats(grads: Sequence[torch.Tensor], inv_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`mpkern.reference.grad_stats` (same contract, same bits)."""
    device = inv_scale.device
    n = len(grads)
    sumsq = torch.zeros(n, dtype=torch.float32, device=device)
    amax_bits = torch.zeros(n, dtype=torch.int32, device=device)
    if n == 0:
        return sumsq, amax_bits.view(torch.float32)
    plan = _plan(grads, device)
    part_sum = torch.zeros(max(plan.slots, 1), dtype=torch.float64, device=device)
    part_max = torch.zeros(max(plan.slots, 1), dtype=torch.int32, device=device)
    with device_guard(device):
        for dt, first, rows, n_aligned in plan.stats_launches:
            _grad_stats_kernel[(rows,)](plan.table[first:], part_sum, part_max, n_aligned, DT=dt,
                                        BLOCKS=NORM_BLOCKS, ROWS=NORM_ROWS, LANES=NORM_LANES,
                                        enable_fp_fusion=False)
        _grad_stats_finalize_kernel[(n,)](plan.offsets, part_sum, part_max, inv_scale, sumsq, amax_bits,
                                          TLANES=NORM_TENSOR_LANES, enable_fp_fusion=False)
    return sumsq, amax_bits.view(torch.float32)


def scale_(tensors: Sequence[torch.Tensor], scale: torch.Tensor) -> None:
    """Triton version of :func:`mpkern.reference.scale_` (same contract)."""
    if not tensors:
        return
    plan = _plan(tensors, scale.device)
    with device_guard(scale.device):
        for dt, first, rows, n_aligned in plan.launches:
            _scale_kernel[(rows,)](plan.table[first:], scale, n_aligned, DT=dt, CHUNK=CHUNK, BLOCK=BLOCK,
                                   enable_fp_fusion=False)
