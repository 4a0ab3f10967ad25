"""Triton kernels of the unscale_ ops (``grad_stats`` and ``scale_``).

Multi-tensor: the host packs a device table with one row per (tensor, chunk) work item --
``(address, begin, end)`` -- and launches one program per row, one launch per element dtype.
This works on GPUs and under ``TRITON_INTERPRET=1`` on CPU tensors.

Math (mirrors ``csrc/include/mpkern/math.h``):
  sumsq[t] = sum_i (x_i * inv_scale)^2
  amax[t]  = max_i (bits(x_i) & 0x7fffffff) as float   -- NaN > inf > any finite, so it doubles
                                                         as the non-finite flag
  scale_:  x_i <- round_to_dtype(x_i * s); nothing is written when s == 1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

CHUNK = 16384
BLOCK = 1024

_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@triton.jit
def _typed_ptr(addr, DT: tl.constexpr):
    """Pointer of the element type; bfloat16 is handled as raw uint16 bits (see _load/_store)."""
    if DT == 0:
        return addr.to(tl.pointer_type(tl.float32))
    elif DT == 1:
        return addr.to(tl.pointer_type(tl.float16))
    else:
        return addr.to(tl.pointer_type(tl.uint16))


@triton.jit
def _load_f32(ptr, idx, mask, DT: tl.constexpr):
    if DT == 2:
        bits = tl.load(ptr + idx, mask=mask, other=0).to(tl.uint32) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + idx, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _f32_to_bf16_bits(x):
    """Round to nearest even, NaN kept quiet -- f32_to_bf16_rne of math.h, bit for bit (the
    interpreter's own fp32->bf16 cast truncates, the GPU's rounds; this is the same on both)."""
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = tl.where(nan, (u >> 16) | 0x40, r)
    return r.to(tl.uint16)


@triton.jit
def _store_f32(ptr, idx, x, mask, DT: tl.constexpr):
    if DT == 2:
        tl.store(ptr + idx, _f32_to_bf16_bits(x), mask=mask)
    else:
        tl.store(ptr + idx, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _work_item(table_ptr, DT: tl.constexpr):
    """Row ``program_id`` of a (address, begin, end) work table: typed pointer, begin, end."""
    item = tl.program_id(0).to(tl.int64)
    addr = tl.load(table_ptr + item * 3)
    begin = tl.load(table_ptr + item * 3 + 1)
    end = tl.load(table_ptr + item * 3 + 2)
    return _typed_ptr(addr, DT), begin, end, item


@triton.jit
def _grad_stats_kernel(
    table_ptr,  # int64 [items, 3]: address, begin, end
    inv_scale_ptr,  # float32 [1]
    part_sum_ptr,  # float32 [items]
    part_max_ptr,  # int32 [items] (float bits of max |x|)
    DT: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    ptr, begin, end, item = _work_item(table_ptr, DT)
    inv = tl.load(inv_scale_ptr)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    mx = tl.zeros([BLOCK], dtype=tl.int32)
    for off in range(0, CHUNK, BLOCK):
        idx = begin + off + tl.arange(0, BLOCK).to(tl.int64)
        mask = idx < end
        x = _load_f32(ptr, idx, mask, DT)
        # |x| bits: non-negative as int32, ordered like |x| with inf and NaN on top.
        mx = tl.maximum(mx, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
        y = x * inv
        acc += y * y
    tl.store(part_sum_ptr + item, tl.sum(acc, axis=0))
    tl.store(part_max_ptr + item, tl.max(mx, axis=0))


@triton.jit
def _scale_kernel(
    table_ptr,  # int64 [items, 3]: address, begin, end
    scale_ptr,  # float32 [1]
    DT: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    ptr, begin, end, _ = _work_item(table_ptr, DT)
    s = tl.load(scale_ptr)
    if s != 1.0:
        for off in range(0, CHUNK, BLOCK):
            idx = begin + off + tl.arange(0, BLOCK).to(tl.int64)
            mask = idx < end
            x = _load_f32(ptr, idx, mask, DT)
            _store_f32(ptr, idx, x * s, mask, DT)


def device_guard(device: torch.device):
    """Triton launches on the current CUDA device: make it the tensors' device."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _work_table(tensors: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(device int64 table [items, 3], CPU int64 owner index [items]) for non-empty tensors."""
    rows: list[tuple[int, int, int]] = []
    owner: list[int] = []
    for i, t in enumerate(tensors):
        n = t.numel()
        addr = t.data_ptr()
        for b in range(0, n, CHUNK):
            rows.append((addr, b, min(n, b + CHUNK)))
            owner.append(i)
    host = torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True), torch.tensor(owner, dtype=torch.int64)


def _groups(tensors: Sequence[torch.Tensor]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel():
            groups.setdefault(_CODES[t.dtype], []).append(i)
    return groups


def grad_stats(grads: Sequence[torch.Tensor], inv_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`mpkern.reference.grad_stats` (same contract)."""
    device = inv_scale.device
    n = len(grads)
    sumsq = torch.zeros(n, dtype=torch.float64, device=device)
    amax_bits = torch.zeros(n, dtype=torch.int32, device=device)
    for dt, idx in _groups(grads).items():
        table, owner = _work_table([grads[i] for i in idx], device)
        items = table.shape[0]
        part_sum = torch.empty(items, dtype=torch.float32, device=device)
        part_max = torch.empty(items, dtype=torch.int32, device=device)
        with device_guard(device):
            _grad_stats_kernel[(items,)](table, inv_scale, part_sum, part_max, DT=dt, CHUNK=CHUNK, BLOCK=BLOCK,
                                         enable_fp_fusion=False)
        dest = torch.tensor(idx, dtype=torch.int64)[owner].to(device, non_blocking=True)
        sumsq.index_add_(0, dest, part_sum.to(torch.float64))
        amax_bits.scatter_reduce_(0, dest, part_max, reduce="amax")
    return sumsq.to(torch.float32), amax_bits.view(torch.float32)


def scale_(tensors: Sequence[torch.Tensor], scale: torch.Tensor) -> None:
    """Triton version of :func:`mpkern.reference.scale_` (same contract)."""
    for dt, idx in _groups(tensors).items():
        table, _ = _work_table([tensors[i] for i in idx], scale.device)
        with device_guard(scale.device):
            _scale_kernel[(table.shape[0],)](table, scale, DT=dt, CHUNK=CHUNK, BLOCK=BLOCK, enable_fp_fusion=False)
