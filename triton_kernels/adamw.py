"""Triton kernel of the fused master-weight AdamW step (``mpkern_triton::adamw_step_``).

Mirrors ``adamw_update`` / ``split_master`` / ``master8_decode`` / ``master8_encode`` /
``f32_to_bf16_sr`` and the random words (``rng_key``) of ``csrc/include/mpkern/math.h``:
  g  = grad * grad_factor (negated for maximize)
  m  = fma(1-b1, g - m, m);  v = fma((1-b2)*g, g, v*b2);  vm = max(vm, v)
  p  = fma(p, 1 - lr*wd, -step_size * m / fma(sqrt(v or vm), inv_bc2, eps))
(``tl.fma``: one rounding on a GPU, and under the interpreter with :mod:`._interp_compat`'s exact fma).
Per-tensor constants (step_size, inv_bc2, decay) come from the step counters, computed on the
device in fp64 (beta^t by math.h's pow_int, ``_beta_pow_kernel``) with torch ops from the float lr
(a kernel argument, in double) or the lr tensor: no sync, no host-to-device copy. Work items are
(tensor, chunk) rows of a device table that is built once per layout of the tensor lists and cached
(``tables.py``); per (param, grad, state) dtype combination one launch over the rows whose buffers
are all 16-byte aligned (the compiler is told, and uses 16-byte accesses) and one over the few
unaligned head/tail elements. Nothing is written when found_inf != 0. bf16 moments are stored with
stochastic rounding; 8-bit moments and the 4-bit exp_avg are math.h's ladder codes (Ladder,
ladder_*, mom8_*, mom4_*: a power-of-two bf16 scale per 32 elements from the group amax's bits by
integer operations; a code from the fp32 bits of |x| / s + 1 with the dither added below the kept
mantissa bits; sign-magnitude exp_avg codes, bit 7 of the byte / bit 3 of the nibble, two nibbles per
byte; the codes of a group with a non-finite moment, whose scale is NaN, zeroed), processed as
[BLOCK // 32, 32] blocks, the group amax a tl.max along axis 1 of the integer bits; random bits are a
hash of (seed, stream id, elem_offset + element, step, purpose), the keys computed once per row.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from ._common import VEC, block_index, device_guard, f32_to_bf16_bits, load_f32, neg_f32, store_f32, typed_ptr
from .tables import TABLES, common_head, layout, to_device, work_ranges

CHUNK = 16384
BLOCK = 1024
_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# p, g, m, v, vmax, master, begin, end, tensor index, shift (element index of the row's addresses),
# random stream id, global index of the tensor's element 0 in that stream, exp_avg scales,
# exp_avg_sq scales (8-bit moments; else 0)
_ROW = 14
# The master and moment modes: the `mode` of the rows of mpkern/codecs.def (a call brings its modes from
# that table; tests/test_codecs.py checks these numbers against it -- this package may not import mpkern).
# Host ints, and the same values as constexprs for the kernels (a @triton.jit function reads only
# tl.constexpr globals).
MASTER_NONE, MASTER_F32, MASTER_REMAINDER, MASTER_8BIT = 0, 1, 2, 3  # kMasterNone .. kMaster8bit
MOM_F32, MOM_BF16 = 0, 2  # the dense moments (kMomF32, kMomBF16): their dtype codes, which typed_ptr reads
MOM8 = 8  # kMom8: 8-bit ladder codes for both moments
MOM4 = 9  # kMom4: 4-bit exp_avg codes (two nibbles per byte) + 8-bit exp_avg_sq codes
MOMENT_MODES = (MOM_F32, MOM_BF16, MOM8, MOM4)
_MASTER_F32, _MASTER_REMAINDER, _MASTER_8BIT = (tl.constexpr(MASTER_F32), tl.constexpr(MASTER_REMAINDER),
                                                tl.constexpr(MASTER_8BIT))
_MOM_BF16, _MOM8, _MOM4 = tl.constexpr(MOM_BF16), tl.constexpr(MOM8), tl.constexpr(MOM4)
_BF16 = tl.constexpr(2)  # the dtype code of bf16 (typed_ptr's DT): raw uint16 bits
GROUP = 32
# math.h Ladder: mantissa bits of the 8-bit (4) and 4-bit (1) ladders; floor(log2 u_max) and u_max's 23
# mantissa bits of the 8-bit exp_avg (u_max 247), 8-bit exp_avg_sq (63487) and 4-bit exp_avg (11)
_MB8, _MB4 = tl.constexpr(4), tl.constexpr(1)
_M8_EXP, _M8_MANT = tl.constexpr(7), tl.constexpr(0x770000)
_V8_EXP, _V8_MANT = tl.constexpr(15), tl.constexpr(0x77FF00)
_M4_EXP, _M4_MANT = tl.constexpr(3), tl.constexpr(0x300000)
_NAN_SCALE = tl.constexpr(0x7FC0)  # math.h kMom8NaNScale: the scale of a group with a non-finite moment
assert CHUNK % GROUP == 0 and BLOCK % GROUP == 0


@triton.jit
def _mix32(x):
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit
def _rng_key(seed, stream, step, hi):
    """rng_key of math.h (one key: one random word per element)."""
    h = _mix32(seed ^ _mix32(stream * 0x9E3779B9 + step))
    return _mix32(h ^ _mix32(hi * 0x85EBCA6B + 0x632BE5AB))


@triton.jit
def _rand_a16(r):
    """math.h rand_a16: field A (bits 0..9: param SR / 8-bit master) as the codecs' 16-bit value."""
    return ((r << 6) & 0xFFC0) | 0x20


@triton.jit
def _rand_b16(r):
    """math.h rand_b16: field B (bits 10..20: exp_avg)."""
    return ((r >> 5) & 0xFFE0) | 0x10


@triton.jit
def _rand_c16(r):
    """math.h rand_c16: field C (bits 21..31: exp_avg_sq)."""
    return ((r >> 16) & 0xFFE0) | 0x10


@triton.jit
def _rng_word(key_lo, key_hi, hi0, gidx):
    """rng_word of math.h for global element indices gidx (int64): the key of hi0 or hi0 + 1
    (a row never spans more than one multiple of 2^32)."""
    hi = (gidx >> 32).to(tl.uint32)
    lo = (gidx & 0xFFFFFFFF).to(tl.uint32)
    return _mix32(tl.where(hi == hi0, key_lo, key_hi) ^ lo)


@triton.jit
def _bf16_sr(x, r16):
    """f32_to_bf16_sr of math.h: r16 (uint32 < 2^16) added below the kept half, truncated."""
    u = x.to(tl.uint32, bitcast=True)
    nonfinite = (u & 0x7F800000) == 0x7F800000
    return tl.where(nonfinite, f32_to_bf16_bits(x), ((u + r16) >> 16).to(tl.uint16))


@triton.jit
def _pow2n(k):
    """pow2n of math.h: 2^k (int32 k in [-126, 127]) as float32."""
    return ((k + 127) << 23).to(tl.uint32).to(tl.float32, bitcast=True)


@triton.jit
def _master8_decode(h, c, PDT: tl.constexpr):
    """master8_decode of math.h: bf16 (bits(p) << 16) + 256 c; fp16 p + c * 2^(max(e, 1) - 33)."""
    if PDT == _BF16:
        return ((h.to(tl.uint32) << 16) + (c.to(tl.int32) * 256).to(tl.uint32)).to(tl.float32, bitcast=True)
    else:
        b = tl.maximum(((h.to(tl.uint32) >> 10) & 0x1F).to(tl.int32), 1)
        return h.to(tl.float16, bitcast=True).to(tl.float32) + c.to(tl.float32) * _pow2n(b - 33)


@triton.jit
def _master8_encode(w, rw, PDT: tl.constexpr):
    """(param bits uint16, correction int8) of master w from the random words rw: master8_encode of
    math.h (bf16: the master's bits rounded stochastically to a multiple of 256 and split)."""
    if PDT == _BF16:
        u = w.to(tl.uint32, bitcast=True)
        t = u + (rw & 0xFF)
        h = ((t + 0x8000) >> 16).to(tl.uint16)
        h = tl.where((u & 0x7FFFFFFF) > 0x7F800000, ((u >> 16) | 0x40).to(tl.uint16), h)
        c = ((t >> 8) & 0xFF).to(tl.uint8).to(tl.int8, bitcast=True)
        return h, c
    else:
        h = w.to(tl.float16).to(tl.uint16, bitcast=True)
        p = h.to(tl.float16, bitcast=True).to(tl.float32)
        b = tl.maximum(((h.to(tl.uint32) >> 10) & 0x1F).to(tl.int32), 1)
        x = (w - p) * _pow2n(33 - b)
        nonfinite = (p.to(tl.uint32, bitcast=True) & 0x7F800000) == 0x7F800000
        y = tl.floor(x + _rand_a16(rw).to(tl.float32) * (1.0 / 65536.0))
        y = tl.minimum(tl.maximum(y, -128.0), 127.0)
        y = tl.where(nonfinite, 0.0, y)
        return h, y.to(tl.int32).to(tl.int8)


@triton.jit
def _ladder_scale_bits(amax, UEXP: tl.constexpr, UMANT: tl.constexpr):
    """ladder_scale_bits of math.h: bf16 bits (uint32) of the smallest power of two s = 2^e with
    amax / s <= u_max (u_max = 1.UMANT * 2^UEXP), e >= -126, from amax's bits with integer operations
    (the carry into the exponent is 1 exactly when amax's mantissa exceeds u_max's); NaN (0x7fc0) for
    a non-finite group, 0 for a group of zeros (its 1 / s is 2^127: every code 0). amax: int32 max of
    (bits & 0x7fffffff)."""
    a = amax.to(tl.uint32, bitcast=True)
    e = ((a + (0x7FFFFF - UMANT)) >> 23).to(tl.int32) - UEXP
    b = tl.where(a == 0, 0, tl.maximum(e, 1) << 7).to(tl.uint32)
    return tl.where(a >= 0x7F800000, _NAN_SCALE, b).to(tl.uint32)


@triton.jit
def _ladder_inv(b):
    """ladder_inv_scale of math.h: 1 / s of scale bits b (exact, from the exponent; 2^127 for the zero
    scale); 0 for the NaN scale (its group's codes are zeroed)."""
    inv = ((254 - (b >> 7)) << 23).to(tl.float32, bitcast=True)
    return tl.where(b == _NAN_SCALE, 0.0, inv)


@triton.jit
def _ladder_value(q, MB: tl.constexpr):
    """ladder_value of math.h: u(q) = F(q) - 1 of uint32 magnitude codes, F(q) the fp32 number with
    bits bits(1.0) + (q << (23 - MB)) (exact)."""
    return (0x3F800000 + (q << (23 - MB))).to(tl.float32, bitcast=True) - 1.0


@triton.jit
def _ladder_encode(ax, inv, r16, MB: tl.constexpr):
    """ladder_encode of math.h: uint32 magnitude code of |x| (ax) given inv = 1 / s and 16 random bits
    (uint32): z = ax * inv + 1 (the product exact, no fma: enable_fp_fusion=False), the dither added
    below z's MB kept mantissa bits, truncated."""
    z = ax * inv + 1.0
    return (z.to(tl.uint32, bitcast=True) + (r16 << (7 - MB)) - 0x3F800000) >> (23 - MB)


@triton.jit
def _sm_decode(c, s, MB: tl.constexpr, SIGN: tl.constexpr):
    """mom8_decode_m (MB 4, SIGN 7) / mom4_decode_m (MB 1, SIGN 3) of math.h: the sign-magnitude code c
    (uint32 < 2^(SIGN + 1)) as u(c's magnitude) * s with the sign bit OR-ed in."""
    x = _ladder_value(c & ((1 << SIGN) - 1), MB) * s
    return (x.to(tl.uint32, bitcast=True) | ((c >> SIGN) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _sm_encode(m, inv, r16, MB: tl.constexpr, SIGN: tl.constexpr):
    """mom8_encode_m (MB 4, SIGN 7: the byte) / mom4_encode_m (MB 1, SIGN 3: the nibble) of math.h:
    the magnitude code of |m| with m's sign bit at bit SIGN (uint32)."""
    return _ladder_encode(tl.abs(m), inv, r16, MB) | ((m.to(tl.uint32, bitcast=True) >> 31) << SIGN)


@triton.jit
def _mom8_encode_v(v, inv, r16):
    """mom8_encode_v of math.h: uint32 exp_avg_sq code of v >= 0; a positive v gets at least code 1."""
    q = _ladder_encode(v, inv, r16, _MB8)
    return tl.where((q == 0) & (v > 0.0), 1, q).to(tl.uint32)


@triton.jit
def _uint8_ptr(addr, ALIGNED: tl.constexpr):
    ptr = addr.to(tl.pointer_type(tl.uint8))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _int8_ptr(addr, ALIGNED: tl.constexpr):
    ptr = addr.to(tl.pointer_type(tl.int8))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _ptr_at(base, k, DT: tl.constexpr, ALIGNED: tl.constexpr):
    """Typed pointer in column k of a table row (DT as in typed_ptr), marked 16-byte aligned in
    ALIGNED rows."""
    return typed_ptr(tl.load(base + k), DT, ALIGNED)


@triton.jit(do_not_specialize=["seed"])  # seed == 1 would otherwise become a constexpr int
def _adamw_kernel(
    table_ptr,  # int64 [items, _ROW]
    consts_ptr,  # float32 [tensors, 3]: step_size, inv_bc2, decay
    steps_ptr,  # int32 [tensors]: step after the increment (for the random bits)
    factor_ptr,  # float32 [1]
    found_ptr,  # float32 [1]
    one_m_b1, beta2, one_m_b2, eps, seed,
    PDT: tl.constexpr, GDT: tl.constexpr, MOMENT_MODE: tl.constexpr, MASTER_MODE: tl.constexpr, AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr, SR: tl.constexpr, ALIGNED: tl.constexpr, GRAD_ALIGNED: tl.constexpr, ROW: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):
    # GROUPED: codes with a bf16 scale per 32 elements (8-bit moments, or the 4-bit exp_avg's NIBBLES);
    # RANDOM: the step draws random bits (the 8-bit master, the param's SR, bf16 or coded moments)
    NIBBLES: tl.constexpr = MOMENT_MODE == _MOM4
    GROUPED: tl.constexpr = MOMENT_MODE == _MOM8 or NIBBLES
    RANDOM: tl.constexpr = MASTER_MODE == _MASTER_8BIT or SR or MOMENT_MODE == _MOM_BF16 or GROUPED
    item = tl.program_id(0).to(tl.int64)
    found = tl.load(found_ptr)
    if found == 0.0:
        base = table_ptr + item * ROW
        p_ptr = _ptr_at(base, 0, PDT, ALIGNED)
        # a grad view at another alignment (DDP bucket views, flat buffers) is only read: it loses
        # the 16-byte hint, the param and the state keep it
        g_ptr = _ptr_at(base, 1, GDT, ALIGNED and GRAD_ALIGNED)
        m_ptr = _ptr_at(base, 2, MOMENT_MODE, ALIGNED)  # a dense mode is the moments' dtype code
        v_ptr = _ptr_at(base, 3, MOMENT_MODE, ALIGNED)
        begin = tl.load(base + 6)
        end = tl.load(base + 7)
        t = tl.load(base + 8)
        if ALIGNED:
            begin = tl.multiple_of(begin, 16)
            end = tl.multiple_of(end, 8)
        # random keys of this row (math.h rng_keys): one word per element, its fields A (param SR /
        # the 8-bit master), B (exp_avg), C (exp_avg_sq); gbase = global index of idx 0 in the stream
        if RANDOM:
            step = tl.load(steps_ptr + t).to(tl.uint32)
            stream = (tl.load(base + 10) & 0xFFFFFFFF).to(tl.uint32)
            gbase = tl.load(base + 11) + tl.load(base + 9)
            hi0 = ((gbase + begin) >> 32).to(tl.uint32)
            useed = seed.to(tl.uint32)
            ka = _rng_key(useed, stream, step, hi0)
            kb = _rng_key(useed, stream, step, hi0 + 1)
        step_size = tl.load(consts_ptr + t * 3)
        inv_bc2 = tl.load(consts_ptr + t * 3 + 1)
        decay = tl.load(consts_ptr + t * 3 + 2)
        factor = tl.load(factor_ptr)
        if MAXIMIZE:
            factor = neg_f32(factor)
        if GROUPED:  # 8/4-bit moments: codes + one bf16 scale per group of 32 (rows start at a group)
            cm_ptr = _uint8_ptr(tl.load(base + 2), ALIGNED)
            cm4_ptr = _uint8_ptr(tl.load(base + 2), False)
            cv_ptr = _uint8_ptr(tl.load(base + 3), ALIGNED)
            sm_ptr = _ptr_at(base, 12, _BF16, False)
            sv_ptr = _ptr_at(base, 13, _BF16, False)
        # rows are at most CHUNK long; the loop stops at the row's end (short rows: fewer blocks)
        for off in range(0, end - begin, BLOCK):
            if GROUPED:
                # [groups, 32]: row r = group (begin + off) / 32 + r, column = element in the group
                gi = (begin + off) // 32 + tl.arange(0, BLOCK // 32).to(tl.int64)
                gmask = gi * 32 < end
                idx = gi[:, None] * 32 + tl.arange(0, 32)[None, :]
            else:
                idx = block_index(begin, off, ALIGNED, BLOCK)
            mask = idx < end
            g = load_f32(g_ptr, idx, mask, GDT) * factor
            if MASTER_MODE == _MASTER_F32:
                w_ptr = _ptr_at(base, 5, 0, ALIGNED)
                w = tl.load(w_ptr + idx, mask=mask, other=0.0)
            elif MASTER_MODE == _MASTER_REMAINDER:
                r_ptr = _ptr_at(base, 5, 3, ALIGNED)
                hi = tl.load(p_ptr + idx, mask=mask, other=0).to(tl.uint32) << 16
                lo = tl.load(r_ptr + idx, mask=mask, other=0).to(tl.int32).to(tl.uint32, bitcast=True)
                w = (hi + lo).to(tl.float32, bitcast=True)
            elif MASTER_MODE == _MASTER_8BIT:
                h_ptr = _ptr_at(base, 0, _BF16, ALIGNED)  # the param's raw bits
                c_ptr = _int8_ptr(tl.load(base + 5), ALIGNED)
                h = tl.load(h_ptr + idx, mask=mask, other=0)
                c = tl.load(c_ptr + idx, mask=mask, other=0)
                w = _master8_decode(h, c, PDT)
            else:
                w = load_f32(p_ptr, idx, mask, PDT)
            if GROUPED:
                s_m = (tl.load(sm_ptr + gi, mask=gmask, other=0).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
                s_v = (tl.load(sv_ptr + gi, mask=gmask, other=0).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
                if NIBBLES:  # the nibble of element idx in byte idx // 2 (mom4_code), sign-magnitude
                    nib = (tl.load(cm4_ptr + (idx >> 1), mask=mask, other=0).to(tl.int32) >> ((idx & 1) * 4)) & 0xF
                    m = _sm_decode(nib.to(tl.uint32), s_m[:, None], _MB4, 3)
                else:  # a sign-magnitude byte
                    m = _sm_decode(tl.load(cm_ptr + idx, mask=mask, other=0).to(tl.uint32), s_m[:, None], _MB8, 7)
                v = _ladder_value(tl.load(cv_ptr + idx, mask=mask, other=0).to(tl.uint32), _MB8) * s_v[:, None]
            else:
                m = load_f32(m_ptr, idx, mask, MOMENT_MODE)
                v = load_f32(v_ptr, idx, mask, MOMENT_MODE)
            m = tl.fma(one_m_b1, g - m, m)
            v = tl.fma(one_m_b2 * g, g, v * beta2)
            vv = v
            if AMSGRAD:
                vm_ptr = _ptr_at(base, 4, 0, ALIGNED)
                old = tl.load(vm_ptr + idx, mask=mask, other=0.0)
                vv = tl.where(old > v, old, v)
                tl.store(vm_ptr + idx, vv, mask=mask)
            # IEEE-rounded division (plain "/" is approximate on GPUs), math.h's fmas and no other
            # contraction (enable_fp_fusion=False at launch): the same rounding on every backend
            w = tl.fma(w, decay, neg_f32(tl.div_rn(step_size * m, tl.fma(tl.sqrt_rn(vv), inv_bc2, eps))))
            if RANDOM:
                rw = _rng_word(ka, kb, hi0, gbase + idx)  # the element's one random word
            if GROUPED:
                am = tl.max(tl.where(mask, m.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0), axis=1)
                av = tl.max(tl.where(mask, v.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0), axis=1)
                bm = _ladder_scale_bits(am, _M4_EXP, _M4_MANT) if NIBBLES else _ladder_scale_bits(am, _M8_EXP, _M8_MANT)
                bv = _ladder_scale_bits(av, _V8_EXP, _V8_MANT)
                okm = (bm != _NAN_SCALE)[:, None]  # a NaN-scale group's codes are 0
                okv = (bv != _NAN_SCALE)[:, None]
                if NIBBLES:
                    # codes of masked (past-the-end) elements are 0: an odd tail's high nibble is 0
                    cm = tl.where(mask & okm, _sm_encode(m, _ladder_inv(bm)[:, None], _rand_b16(rw), _MB4, 3), 0)
                    cm = cm.to(tl.int32)
                    pairs = tl.reshape(cm, (BLOCK // 32, 16, 2))
                    byte = tl.sum(pairs * tl.where(tl.arange(0, 2) == 0, 1, 16)[None, None, :], axis=2)
                    bidx = gi[:, None] * 16 + tl.arange(0, 16)[None, :]
                    tl.store(cm4_ptr + bidx, byte.to(tl.uint8), mask=bidx * 2 < end)
                else:
                    cm = tl.where(okm, _sm_encode(m, _ladder_inv(bm)[:, None], _rand_b16(rw), _MB8, 7), 0)
                    tl.store(cm_ptr + idx, cm.to(tl.uint8), mask=mask)
                cv = tl.where(okv, _mom8_encode_v(v, _ladder_inv(bv)[:, None], _rand_c16(rw)), 0)
                tl.store(cv_ptr + idx, cv.to(tl.uint8), mask=mask)
                tl.store(sm_ptr + gi, bm.to(tl.uint16), mask=gmask)
                tl.store(sv_ptr + gi, bv.to(tl.uint16), mask=gmask)
            elif MOMENT_MODE == _MOM_BF16:
                tl.store(m_ptr + idx, _bf16_sr(m, _rand_b16(rw)), mask=mask)
                tl.store(v_ptr + idx, _bf16_sr(v, _rand_c16(rw)), mask=mask)
            else:
                store_f32(m_ptr, idx, m, mask, MOMENT_MODE)
                store_f32(v_ptr, idx, v, mask, MOMENT_MODE)
            if MASTER_MODE == _MASTER_F32:
                tl.store(w_ptr + idx, w, mask=mask)
                store_f32(p_ptr, idx, w, mask, PDT)
            elif MASTER_MODE == _MASTER_REMAINDER:
                u = w.to(tl.uint32, bitcast=True)
                tl.store(p_ptr + idx, ((u + 0x8000) >> 16).to(tl.uint16), mask=mask)
                tl.store(r_ptr + idx, (u & 0xFFFF).to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
            elif MASTER_MODE == _MASTER_8BIT:
                h, c = _master8_encode(w, rw, PDT)
                tl.store(h_ptr + idx, h, mask=mask)
                tl.store(c_ptr + idx, c, mask=mask)
            elif SR:
                tl.store(p_ptr + idx, _bf16_sr(w, _rand_a16(rw)), mask=mask)
            else:
                store_f32(p_ptr, idx, w, mask, PDT)


@triton.jit(do_not_specialize=["b1_bits", "b2_bits"])
def _beta_pow_kernel(step_ptr, out_ptr, n, b1_bits, b2_bits, BLOCK: tl.constexpr):
    """math.h pow_int: beta1^t and beta2^t of each tensor's step t (fp64 [n], an integer < 2^32) by
    binary exponentiation in its order (the running square multiplies the result where bit k of t is
    set): fp64 multiplies only. The betas come as their fp64 bit patterns (a float argument would be
    fp32)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    t = tl.load(step_ptr + offs, mask=mask, other=0.0).to(tl.int64)
    x1 = tl.full([BLOCK], 0, tl.int64) + b1_bits.to(tl.int64)
    x2 = tl.full([BLOCK], 0, tl.int64) + b2_bits.to(tl.int64)
    x1 = x1.to(tl.float64, bitcast=True)
    x2 = x2.to(tl.float64, bitcast=True)
    r1 = tl.full([BLOCK], 1.0, tl.float64)
    r2 = tl.full([BLOCK], 1.0, tl.float64)
    for k in tl.static_range(32):
        bit = ((t >> k) & 1) != 0
        r1 = tl.where(bit, r1 * x1, r1)
        r2 = tl.where(bit, r2 * x2, r2)
        x1 = x1 * x1
        x2 = x2 * x2
    tl.store(out_ptr + offs, r1, mask=mask)
    tl.store(out_ptr + n + offs, r2, mask=mask)


def _f64_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def beta_pows(step_new: torch.Tensor, beta1: float, beta2: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(beta1^t, beta2^t) in fp64 for the fp64 step counts ``step_new`` (after the increment), one launch."""
    n = step_new.numel()
    out = torch.empty(2 * n, dtype=torch.float64, device=step_new.device)
    _beta_pow_kernel[(triton.cdiv(n, 128),)](step_new, out, n, _f64_bits(beta1), _f64_bits(beta2), BLOCK=128)
    return out[:n], out[n:]


def _addr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class _ParamBuffers(NamedTuple):
    """The buffers of one param that its table rows address (columns 0-5, then 12-13)."""

    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    max_exp_avg_sq: torch.Tensor | None  # amsgrad
    master: torch.Tensor | None  # as the master mode says
    exp_avg_scale: torch.Tensor | None  # a grouped moment mode's bf16 scales
    exp_avg_sq_scale: torch.Tensor | None


def _param_buffers(a: Any) -> list[_ParamBuffers]:
    """The buffers of each param of the call ``a`` (an ``mpkern.op_args.AdamwArgs``, read by name)."""
    vmax, w = a.max_exp_avg_sqs, a.masters
    sm, sv = a.exp_avg_scales or (), a.exp_avg_sq_scales or ()
    return [_ParamBuffers(p, a.grads[i], a.exp_avgs[i], a.exp_avg_sqs[i], vmax[i] if vmax else None,
                          w[i] if w else None, sm[i] if sm else None, sv[i] if sv else None)
            for i, p in enumerate(a.params)]


def _build_plan(bufs: list[_ParamBuffers], stream_ids: tuple[int, ...], elem_offsets: tuple[int, ...],
                moment_mode: int, device: torch.device) -> tuple[torch.Tensor, list[tuple]]:
    """(device table, launches) for one layout; launches: (pdt, gdt, moment mode, aligned, grad aligned,
    first row, rows). The aligned body starts where the param and its state are 16-byte aligned; the
    grad, read only, may sit at another alignment (its rows say so). Grouped moment codes (MOM8, MOM4):
    rows start at element 0 (no head shift) and at multiples of 32, so a group of 32 never straddles two
    rows; the aligned rows end at the last multiple of 32."""
    grouped = moment_mode in (MOM8, MOM4)  # codes with a scale per 32 (MOM4: the 4-bit exp_avg's nibbles)
    groups: dict[tuple[int, int, int, bool, bool], list[list[int]]] = {}
    for i, b in enumerate(bufs):
        n = b.param.numel()
        if not n:
            continue
        cols = b[:6]  # param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, master
        addrs = [_addr(t) for t in cols]
        sizes = [4 if t is None else t.element_size() for t in cols]
        head = common_head([(a, es) for k, (a, es) in enumerate(zip(addrs, sizes)) if k != 1], VEC)
        grad_al = head >= 0 and (addrs[1] + head * sizes[1]) % 16 == 0
        key = (_CODES[b.param.dtype], _CODES[b.grad.dtype], moment_mode)
        scales = [_addr(b.exp_avg_scale), _addr(b.exp_avg_sq_scale)] if grouped else [0, 0]
        if grouped:
            body = n // GROUP * GROUP if head == 0 else 0
            ranges = [(r, min(body, r + CHUNK), True) for r in range(0, body, CHUNK)]
            ranges += [(r, min(n, r + CHUNK), False) for r in range(body, n, CHUNK)]
        else:
            ranges = work_ranges(n, head, CHUNK, VEC)
        for r, e, al in ranges:
            shift = head if al else 0
            stream = stream_ids[i] if stream_ids else i
            offset = elem_offsets[i] if elem_offsets else 0
            row = [a + shift * es if a else 0 for a, es in zip(addrs, sizes)] + [r, e, i, shift, stream, offset]
            row += scales
            groups.setdefault(key + (al, al and grad_al), []).append(row)
    rows: list[list[int]] = []
    launches = []
    for launch, grp in sorted(groups.items()):
        launches.append(launch + (len(rows), len(grp)))
        rows += grp
    return to_device(rows, _ROW, device), launches


def adamw_step_(args: Any) -> None:
    """Triton version of ``mpkern::adamw_step_`` (same contract) over one call's arguments: ``args`` is an
    ``mpkern.op_args.AdamwArgs``, its fields read by name (this package imports nothing of mpkern), its
    codecs as their modes (``args.master_mode``, ``args.moment_mode``: the ``mode`` of their rows in
    ``mpkern/codecs.def``) -- the moment mode one of :data:`MOMENT_MODES`."""
    moment_mode = args.moment_mode
    if moment_mode not in MOMENT_MODES:
        raise ValueError(f"triton adamw_step_: moment_mode must be {MOM_F32}, {MOM_BF16}, {MOM8} or {MOM4}, got "
                         f"{moment_mode!r}")
    if len(args.params) == 0:
        return
    device = args.params[0].device
    with device_guard(device):
        _adamw_step(args, device, int(args.master_mode), int(moment_mode))


def _adamw_step(a: Any, device: torch.device, master_mode: int, moment_mode: int) -> None:
    n = len(a.params)
    bufs = _param_buffers(a)
    stream_ids, elem_offsets = tuple(int(x) for x in a.stream_ids), tuple(int(x) for x in a.elem_offsets)
    key = ("adamw", device, moment_mode, stream_ids, elem_offsets, tuple(layout(b) for b in bufs))
    table, launches = TABLES.get(key, device, lambda: _build_plan(bufs, stream_ids, elem_offsets, moment_mode,
                                                                  device))
    ok = (a.found_inf.reshape(()) == 0).to(torch.float32)
    step_new = torch.stack([s.reshape(()) for s in a.steps]).double() + 1.0
    # lr: the tensor (read on the device) or the Python float, a kernel argument in double
    lr_d = a.lr_tensor.reshape(()).double() if a.lr_tensor is not None else float(a.lr)
    beta1, beta2 = a.beta1, a.beta2
    pow1, pow2 = beta_pows(step_new, beta1, beta2)  # math.h pow_int, not the device's pow
    step_size = lr_d / (1.0 - pow1)
    inv_bc2 = 1.0 / torch.sqrt(1.0 - pow2)
    decay = 1.0 - lr_d * a.weight_decay
    decay = decay.expand(n) if isinstance(decay, torch.Tensor) else torch.full_like(step_new, decay)
    consts = torch.stack([step_size, inv_bc2, decay], dim=1).to(torch.float32).contiguous()
    step_i32 = step_new.to(torch.int32)
    for pdt, gdt, mom, al, gal, first, rows in launches:
        _adamw_kernel[(rows,)](
            table[first:], consts, step_i32, a.grad_factor, a.found_inf,
            1.0 - beta1, beta2, 1.0 - beta2, a.eps, int(a.seed) & 0xFFFFFFFF,
            PDT=pdt, GDT=gdt, MOMENT_MODE=mom, MASTER_MODE=master_mode, AMSGRAD=bool(a.max_exp_avg_sqs),
            MAXIMIZE=bool(a.maximize),
            SR=bool(a.stochastic_rounding) and pdt == _CODES[torch.bfloat16] and master_mode == MASTER_NONE,
            ALIGNED=al, GRAD_ALIGNED=gal, ROW=_ROW, CHUNK=CHUNK,
            BLOCK=BLOCK, enable_fp_fusion=False)
    torch._foreach_add_(list(a.steps), ok)
