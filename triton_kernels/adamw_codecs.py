"""The ``@triton.jit`` helpers of the AdamW kernel (:mod:`.adamw`) that mirror ``csrc/include/mpkern/math.h``:
the random words (``rng_key`` / ``rng_word`` and the 16-bit fields A, B, C of a word), stochastic rounding
to bf16 (``f32_to_bf16_sr``), the 8-bit master (``master8_decode`` / ``master8_encode``) and the ladder codes
of the 8-bit and 4-bit moments (``ladder_*``, ``mom8_*``, ``mom4_*``: a power-of-two bf16 scale per 32
elements, sign-magnitude exp_avg codes), with the ladders' constants as constexprs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import f32_to_bf16_bits

BF16 = tl.constexpr(2)  # the dtype code of bf16 (typed_ptr's DT): raw uint16 bits
# math.h Ladder: mantissa bits of the 8-bit (4) and 4-bit (1) ladders; floor(log2 u_max) and u_max's 23
# mantissa bits of the 8-bit exp_avg (u_max 247), 8-bit exp_avg_sq (63487) and 4-bit exp_avg (11)
MB8, MB4 = tl.constexpr(4), tl.constexpr(1)
M8_EXP, M8_MANT = tl.constexpr(7), tl.constexpr(0x770000)
V8_EXP, V8_MANT = tl.constexpr(15), tl.constexpr(0x77FF00)
M4_EXP, M4_MANT = tl.constexpr(3), tl.constexpr(0x300000)
NAN_SCALE = tl.constexpr(0x7FC0)  # math.h kMom8NaNScale: the scale of a group with a non-finite moment


@triton.jit
def _mix32(x):
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit
def rng_key(seed, stream, step, hi):
    """rng_key of math.h (one key: one random word per element)."""
    h = _mix32(seed ^ _mix32(stream * 0x9E3779B9 + step))
    return _mix32(h ^ _mix32(hi * 0x85EBCA6B + 0x632BE5AB))


@triton.jit
def rand_a16(r):
    """math.h rand_a16: field A (bits 0..9: param SR / 8-bit master) as the codecs' 16-bit value."""
    return ((r << 6) & 0xFFC0) | 0x20


@triton.jit
def rand_b16(r):
    """math.h rand_b16: field B (bits 10..20: exp_avg)."""
    return ((r >> 5) & 0xFFE0) | 0x10


@triton.jit
def rand_c16(r):
    """math.h rand_c16: field C (bits 21..31: exp_avg_sq)."""
    return ((r >> 16) & 0xFFE0) | 0x10


@triton.jit
def rng_word(key_lo, key_hi, hi0, gidx):
    """rng_word of math.h for global element indices gidx (int64): the key of hi0 or hi0 + 1
    (a row never spans more than one multiple of 2^32)."""
    hi = (gidx >> 32).to(tl.uint32)
    lo = (gidx & 0xFFFFFFFF).to(tl.uint32)
    return _mix32(tl.where(hi == hi0, key_lo, key_hi) ^ lo)


@triton.jit
def bf16_sr(x, r16):
    """f32_to_bf16_sr of math.h: r16 (uint32 < 2^16) added below the kept half, truncated."""
    u = x.to(tl.uint32, bitcast=True)
    nonfinite = (u & 0x7F800000) == 0x7F800000
    return tl.where(nonfinite, f32_to_bf16_bits(x), ((u + r16) >> 16).to(tl.uint16))


@triton.jit
def _pow2n(k):
    """pow2n of math.h: 2^k (int32 k in [-126, 127]) as float32."""
    return ((k + 127) << 23).to(tl.uint32).to(tl.float32, bitcast=True)


@triton.jit
def master8_decode(h, c, PDT: tl.constexpr):
    """master8_decode of math.h: bf16 (bits(p) << 16) + 256 c; fp16 p + c * 2^(max(e, 1) - 33)."""
    if PDT == BF16:
        return ((h.to(tl.uint32) << 16) + (c.to(tl.int32) * 256).to(tl.uint32)).to(tl.float32, bitcast=True)
    else:
        b = tl.maximum(((h.to(tl.uint32) >> 10) & 0x1F).to(tl.int32), 1)
        return h.to(tl.float16, bitcast=True).to(tl.float32) + c.to(tl.float32) * _pow2n(b - 33)


@triton.jit
def master8_encode(w, rw, PDT: tl.constexpr):
    """(param bits uint16, correction int8) of master w from the random words rw: master8_encode of
    math.h (bf16: the master's bits rounded stochastically to a multiple of 256 and split)."""
    if PDT == BF16:
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
        y = tl.floor(x + rand_a16(rw).to(tl.float32) * (1.0 / 65536.0))
        y = tl.minimum(tl.maximum(y, -128.0), 127.0)
        y = tl.where(nonfinite, 0.0, y)
        return h, y.to(tl.int32).to(tl.int8)


@triton.jit
def ladder_scale_bits(amax, UEXP: tl.constexpr, UMANT: tl.constexpr):
    """ladder_scale_bits of math.h: bf16 bits (uint32) of the smallest power of two s = 2^e with
    amax / s <= u_max (u_max = 1.UMANT * 2^UEXP), e >= -126, from amax's bits with integer operations
    (the carry into the exponent is 1 exactly when amax's mantissa exceeds u_max's); NaN (0x7fc0) for
    a non-finite group, 0 for a group of zeros (its 1 / s is 2^127: every code 0). amax: int32 max of
    (bits & 0x7fffffff)."""
    a = amax.to(tl.uint32, bitcast=True)
    e = ((a + (0x7FFFFF - UMANT)) >> 23).to(tl.int32) - UEXP
    b = tl.where(a == 0, 0, tl.maximum(e, 1) << 7).to(tl.uint32)
    return tl.where(a >= 0x7F800000, NAN_SCALE, b).to(tl.uint32)


@triton.jit
def ladder_inv(b):
    """ladder_inv_scale of math.h: 1 / s of scale bits b (exact, from the exponent; 2^127 for the zero
    scale); 0 for the NaN scale (its group's codes are zeroed)."""
    inv = ((254 - (b >> 7)) << 23).to(tl.float32, bitcast=True)
    return tl.where(b == NAN_SCALE, 0.0, inv)


@triton.jit
def ladder_value(q, MB: tl.constexpr):
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
def sm_decode(c, s, MB: tl.constexpr, SIGN: tl.constexpr):
    """mom8_decode_m (MB 4, SIGN 7) / mom4_decode_m (MB 1, SIGN 3) of math.h: the sign-magnitude code c
    (uint32 < 2^(SIGN + 1)) as u(c's magnitude) * s with the sign bit OR-ed in."""
    x = ladder_value(c & ((1 << SIGN) - 1), MB) * s
    return (x.to(tl.uint32, bitcast=True) | ((c >> SIGN) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def sm_encode(m, inv, r16, MB: tl.constexpr, SIGN: tl.constexpr):
    """mom8_encode_m (MB 4, SIGN 7: the byte) / mom4_encode_m (MB 1, SIGN 3: the nibble) of math.h:
    the magnitude code of |m| with m's sign bit at bit SIGN (uint32)."""
    return _ladder_encode(tl.abs(m), inv, r16, MB) | ((m.to(tl.uint32, bitcast=True) >> 31) << SIGN)


@triton.jit
def mom8_encode_v(v, inv, r16):
    """mom8_encode_v of math.h: uint32 exp_avg_sq code of v >= 0; a positive v gets at least code 1."""
    q = _ladder_encode(v, inv, r16, MB8)
    return tl.where((q == 0) & (v > 0.0), 1, q).to(tl.uint32)
