"""Triton helpers shared by mpkern's kernels (unscale, AdamW, matmul), imported by name.

Typed pointers from raw addresses with the 16-byte alignment hint, fp32 loads/stores of fp32,
fp16 and bf16 data (bf16 as raw uint16 bits, rounded to nearest even by :func:`f32_to_bf16_bits`
-- ``f32_to_bf16_rne`` of ``csrc/include/mpkern/math.h``, bit for bit, in the interpreter too),
block indices with the alignment known to the compiler, and the device guard of a launch.
Importing this module also installs the interpreter fixes of :mod:`._interp_compat` where needed.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ._interp_compat import apply as _fix_interpreter_index, apply_exact_fma as _fix_interpreter_fma

_fix_interpreter_index()  # Triton 3.6's interpreter with NumPy >= 2.4 (see _interp_compat.py)
_fix_interpreter_fma()  # the interpreter's tl.fma rounds twice (see _interp_compat.py)

VEC = 8  # aligned rows end at a multiple of this many elements (16 bytes of a 16-bit dtype)


@triton.jit
def typed_ptr(addr, DT: tl.constexpr, ALIGNED: tl.constexpr = False):
    """Pointer of the element type (DT: 0 f32, 1 f16, 2 bf16 as raw uint16 bits -- see load_f32/store_f32
    -- 3 int16), marked 16-byte aligned when ALIGNED. The hint must be put on the pointer in the
    function that converts the address (on the integer, or in a caller, it is lost and every
    access stays scalar)."""
    if DT == 0:
        ptr = addr.to(tl.pointer_type(tl.float32))
    elif DT == 1:
        ptr = addr.to(tl.pointer_type(tl.float16))
    elif DT == 2:
        ptr = addr.to(tl.pointer_type(tl.uint16))
    else:
        ptr = addr.to(tl.pointer_type(tl.int16))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def load_f32(ptr, idx, mask, DT: tl.constexpr):
    if DT == 2:
        bits = tl.load(ptr + idx, mask=mask, other=0).to(tl.uint32) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + idx, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def neg_f32(x):
    """-x for float32, the sign bit flipped: what a GPU's negation does, for NaN and zero too. Triton
    3.6 lowers unary minus to 0 - x (3.8 to a negation), which keeps a NaN's sign and gives +0 for
    -(+0); mpkern's kernels must give the same bits on every Triton (tests/test_triton_source.py)."""
    return (x.to(tl.uint32, bitcast=True) ^ 0x80000000).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_bf16_bits(x):
    """Round to nearest even, NaN kept quiet -- f32_to_bf16_rne of math.h, bit for bit (the
    interpreter's own fp32->bf16 cast truncates, the GPU's rounds; this is the same on both)."""
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = tl.where(nan, (u >> 16) | 0x40, r)
    return r.to(tl.uint16)


@triton.jit
def store_f32(ptr, idx, x, mask, DT: tl.constexpr):
    if DT == 2:
        tl.store(ptr + idx, f32_to_bf16_bits(x), mask=mask)
    else:
        tl.store(ptr + idx, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def block_index(begin, off, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """Element indices begin + off + [0, BLOCK), with the alignment known to the compiler."""
    idx = begin + off + tl.arange(0, BLOCK).to(tl.int64)
    if ALIGNED:
        idx = tl.max_contiguous(tl.multiple_of(idx, 16), BLOCK)
    return idx


def device_guard(device: torch.device):
    """Triton launches on the current CUDA device: make it the tensors' device."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
