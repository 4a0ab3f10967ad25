"""The codecs of mpkern's kernels in pure PyTorch, mirroring ``csrc/include/mpkern/math.h`` function by
function: the per-element random word and its fields, bf16 stochastic rounding, the 8-bit master
correction of a 16-bit param, the 8-bit companded moments (``exp_avg`` int8 and ``exp_avg_sq`` uint8
codes, a bf16 scale per 32 elements) and the packed 4-bit ``exp_avg``. :mod:`mpkern.reference` (the
``torch`` backend) decodes and encodes the optimizer state through these; tests check every backend's
codes against them and their own float64 computations.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Tensor = torch.Tensor

# Purposes of the random bits (math.h RandPurpose): which field of the element's one 32-bit word.
RAND_PARAM, RAND_EXP_AVG, RAND_EXP_AVG_SQ, RAND_MASTER8 = 0, 1, 2, 3
# (lowest bit, width) of each purpose's field (math.h rand_shift / rand_width).
RAND_FIELDS = {RAND_PARAM: (0, 10), RAND_MASTER8: (0, 10), RAND_EXP_AVG: (10, 11), RAND_EXP_AVG_SQ: (21, 11)}

_M32 = 0xFFFFFFFF


def sqrt32(x: Tensor) -> Tensor:
    """Correctly rounded float32 sqrt, as the kernels' ``sqrtf``: via fp64 (53 >= 2*24 + 2 bits, so
    rounding the fp64 root to float32 is the correctly rounded float32 root). torch 2.14's
    vectorised CPU float32 ``sqrt`` is off by one ulp on some inputs (e.g. 0.004358131904155016)."""
    return x.double().sqrt().float()


def fma32(x: Tensor | float, y: Tensor | float, z: Tensor | float) -> Tensor:
    """float32 fma(x, y, z) in one rounding, as the kernels' ``fmaf``: the product of two float32 values
    is exact in float64; the sum is rounded to odd there (a two-sum gives its error; an inexact sum with
    an even last bit moves one float64 ulp towards the exact value), and rounding that to float32 is
    the correctly rounded result (53 >= 24 + 2 bits). Non-finite sums are left as float64 made them.
    Operands are rounded to float32 first (a Python float as the kernels' float argument)."""
    x, y, z = (torch.as_tensor(a, dtype=torch.float32).double() for a in (x, y, z))
    p = x * y
    s = p + z
    bb = s - p
    err = (p - (s - bb)) + (z - bb)
    bits = s.view(torch.int64)
    odd = (err != 0) & (err == err) & ((bits & 1) == 0)  # err is NaN where s is not finite
    bits = torch.where(odd, bits + torch.where((err > 0) == (s > 0), 1, -1), bits)
    return bits.view(torch.float64).float()


def _mul32(x, c: int):
    """(x * c) mod 2^32 for x in [0, 2^32) (int64 tensor or int), without int64 overflow."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def mix32(x):
    """mix32 of math.h on int64 tensors (or ints) holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def rand_word(seed: int, stream: int, elem: Tensor, step) -> Tensor:
    """The element's one random word of a step (math.h ``rng_key`` / ``rng_bits``): int64 tensor of
    values in [0, 2^32). ``elem``: int64 tensor of global element indices (elem_offset + i);
    ``step``: the step after the increment (an int or an int64 tensor). A pure function of
    (seed, stream, element, step), identical on every backend."""
    h = mix32((int(seed) & _M32) ^ mix32((_mul32(int(stream) & _M32, 0x9E3779B9) + step) & _M32))
    key = mix32(h ^ mix32((_mul32(elem >> 32, 0x85EBCA6B) + 0x632BE5AB) & _M32))
    return mix32(key ^ (elem & _M32))


def rand_field16(word: Tensor, purpose: int) -> Tensor:
    """math.h ``rand_field16``: the purpose's w-bit field f of the word as the 16-bit value
    (f << (16 - w)) | (1 << (15 - w)) the codecs take (the centre of the f-th of 2^w cells)."""
    shift, width = RAND_FIELDS[purpose]
    return (((word >> shift) & ((1 << width) - 1)) << (16 - width)) | (1 << (15 - width))


def rand16(seed: int, stream: int, elem: Tensor, step, purpose: int) -> Tensor:
    """The 16-bit codec input of math.h's ``rand16``: int64 tensor of values in [0, 2^16), the
    purpose's field of :func:`rand_word` (see :func:`rand_field16`)."""
    return rand_field16(rand_word(seed, stream, elem, step), purpose)


def bf16_sr(x: Tensor, r16: Tensor) -> Tensor:
    """f32_to_bf16_sr of math.h: add 16 random bits below the kept half, truncate (unbiased)."""
    u = x.view(torch.int32).to(torch.int64) & _M32
    bits = ((u + r16) >> 16).to(torch.int16)  # int64 -> int16 keeps the low bits
    return torch.where(torch.isfinite(x), bits.view(torch.bfloat16), x.to(torch.bfloat16))


def _pow2n(k: Tensor) -> Tensor:
    """pow2n of math.h: 2^k (int32 k in [-126, 127]) as float32."""
    return ((k + 127) << 23).view(torch.float32)


def _f16_binade(bits: Tensor) -> Tensor:
    """max(e, 1) of fp16 param bit patterns (int32 tensor of values in [0, 2^16))."""
    return ((bits >> 10) & 0x1F).clamp(min=1)


def _bits16(p: Tensor) -> Tensor:
    """The 16-bit patterns of a bf16/fp16 tensor as int64 values in [0, 2^16)."""
    return p.view(torch.int16).to(torch.int64) & 0xFFFF


def master8_decode(p: Tensor, c: Tensor) -> Tensor:
    """The fp32 master of a bf16/fp16 param and its int8 correction (math.h ``master8_decode``):
    bf16: the bit pattern (bits(p) << 16) + 256 c; fp16: p + c * ulp(p) / 256."""
    if p.dtype == torch.bfloat16:
        bits = (_bits16(p) << 16) + c.to(torch.int64) * 256
        return _as_f32(bits)
    b = _f16_binade(_bits16(p).to(torch.int32))
    return p.float() + c.float() * _pow2n(b - 33)


def _as_f32(bits: Tensor) -> Tensor:
    """float32 of int64 tensors holding bit patterns (taken mod 2^32)."""
    return (bits & _M32).to(torch.int32).view(torch.float32)  # int64 -> int32 keeps the low bits


def master8_encode(w: Tensor, dtype: torch.dtype, word: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(param, int8 correction) of fp32 master ``w`` (math.h ``master8_encode``). ``word``: the
    elements' random words (int tensor of values in [0, 2^32)); ``None`` rounds to nearest.

    bf16: t = bits(w) + (word & 0xff); param = (t + 0x8000) >> 16 (a NaN keeps its quiet NaN),
    correction = the signed byte of t's bits 8..15 -- the master's bits rounded stochastically to a
    multiple of 256. fp16: param = w rounded to nearest even; correction = floor(x + r16 / 2^16)
    clamped to [-128, 127], x the remaining error in 1/256 of the param's ulp, r16 = rand_a16(word);
    0 for a non-finite param."""
    if dtype == torch.bfloat16:
        u = w.view(torch.int32).to(torch.int64) & _M32
        u8 = torch.full_like(u, 0x80) if word is None else word.to(torch.int64) & 0xFF
        t = (u + u8) & _M32
        h = (((t + 0x8000) & _M32) >> 16).to(torch.int32).to(torch.int16)  # int32 -> int16 keeps the low bits
        h = torch.where(torch.isnan(w), ((u >> 16) | 0x40).to(torch.int32).to(torch.int16), h)
        c = ((t >> 8) & 0xFF).to(torch.uint8).view(torch.int8)
        return h.view(torch.bfloat16), c
    p = w.to(dtype)
    pf = p.float()
    r16 = (torch.full(w.shape, 0x8000, dtype=torch.int64) if word is None
           else rand_field16(word.to(torch.int64), RAND_MASTER8))
    x = (w - pf) * _pow2n(33 - _f16_binade(_bits16(p).to(torch.int32)))
    c = torch.floor(x + r16.to(device=w.device, dtype=torch.float32) * (1.0 / 65536.0)).clamp(-128.0, 127.0)
    c = torch.where(torch.isfinite(pf), c, torch.zeros_like(c))
    return p, c.to(torch.int8)


# ---- 8-bit moments and the 4-bit exp_avg: ladder codes (math.h Ladder, ladder_*, mom8_*, mom4_*) ----------
MOM8_GROUP = 32
MOM8_NAN_SCALE = 0x7FC0
#: (mantissa bits b, floor(log2 u_max), u_max's 23 mantissa bits) of math.h's ladders
LADDER_M8 = (4, 7, 0x770000)  # exp_avg, 8-bit: u_max = 247
LADDER_V8 = (4, 15, 0x77FF00)  # exp_avg_sq, 8-bit: u_max = 63487
LADDER_M4 = (1, 3, 0x300000)  # exp_avg, 4-bit: u_max = 11
_ONE_BITS = 0x3F800000


def moment8_groups(numel: int) -> int:
    """Number of scales of an 8-bit moment of ``numel`` elements: ceil(numel / 32)."""
    return (int(numel) + MOM8_GROUP - 1) // MOM8_GROUP


def grouped(x: Tensor) -> Tensor:
    """Flat ``x`` as ``[groups, 32]`` (the moments' scale groups), the last group padded with zeros."""
    x = x.reshape(-1)
    pad = (-x.numel()) % MOM8_GROUP
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.reshape(-1, MOM8_GROUP)


def _bits(x: Tensor) -> Tensor:
    """fp32 bit patterns as int64 values in [0, 2^32)."""
    return x.view(torch.int32).to(torch.int64) & _M32


def ladder_scale_bits(x: Tensor, ladder: tuple[int, int, int]) -> Tensor:
    """math.h ``ladder_scale_bits`` of grouped fp32 ``x`` [G, 32]: int64 bf16 bits of each group's
    scale, the smallest power of two 2^e (e >= -126) with amax / 2^e <= u_max; 0 for a group of zeros,
    NaN (0x7fc0) for a group holding a non-finite value."""
    _, uexp, umant = ladder
    amax = (_bits(x) & 0x7FFFFFFF).amax(dim=1)  # NaN > inf > finite, as bits
    e = ((amax + (0x7FFFFF - umant)) >> 23) - uexp
    b = torch.where(amax == 0, torch.zeros_like(e), e.clamp(min=1) << 7)  # a group of zeros: scale 0
    return torch.where(amax >= 0x7F800000, torch.full_like(b, MOM8_NAN_SCALE), b)


def _bits_to_bf16(b: Tensor) -> Tensor:
    return b.to(torch.int32).to(torch.int16).view(torch.bfloat16)  # int32 -> int16 keeps the low bits


def ladder_inv_scale(b: Tensor) -> Tensor:
    """math.h ``ladder_inv_scale``: 1 / s (exact) of int64 bf16 scale bits; 0 for the NaN scale."""
    inv = _as_f32((254 - (b >> 7)).clamp(min=0) << 23)
    return torch.where(b == MOM8_NAN_SCALE, torch.zeros_like(inv), inv)


def ladder_value(q: Tensor, mbits: int) -> Tensor:
    """u(q) = F(q) - 1 of int64 magnitude codes (fp32, exact; math.h ``ladder_value_scaled`` before the scale)."""
    return _as_f32(_ONE_BITS + (q << (23 - mbits))) - 1.0


def ladder_encode(ax: Tensor, inv: Tensor, r16: Tensor, mbits: int) -> Tensor:
    """math.h ``ladder_encode``: int64 magnitude codes of |x| (``ax``) given 1 / s and 16 random bits
    per element (int64): the dither added below the kept mantissa bits of fp32(|x| / s + 1)."""
    z = ax * inv + 1.0  # the product is exact (a power of two), the sum one fp32 rounding
    return (_bits(z) + (r16 << (7 - mbits)) - _ONE_BITS) >> (23 - mbits)


def _r16_grouped(r16: Tensor | int | None, like: Tensor) -> Tensor:
    """The encoders' 16 random bits per element as int64 ``[G, 32]`` (None: 0x8000, round to nearest)."""
    if r16 is None or isinstance(r16, int):
        return torch.full(like.shape, 0x8000 if r16 is None else int(r16) & 0xFFFF, dtype=torch.int64,
                          device=like.device)
    return grouped(r16.reshape(-1).to(torch.int64))


def _encode_group(x: Tensor, r: Tensor, ladder: tuple[int, int, int], sign_at: int | None,
                  at_least_one: bool = False) -> tuple[Tensor, Tensor]:
    """(int64 codes [G, 32], int64 scale bits [G]) of grouped fp32 ``x``: magnitude codes of the ladder,
    the sign bit at ``sign_at`` (None: unsigned), the codes of a NaN-scale group 0."""
    b = ladder_scale_bits(x, ladder)
    q = ladder_encode(x.abs(), ladder_inv_scale(b)[:, None], r, ladder[0])
    if at_least_one:
        q = torch.where((q == 0) & (x > 0), torch.ones_like(q), q)
    if sign_at is not None:
        q = q | ((_bits(x) >> 31) << sign_at)
    return torch.where((b == MOM8_NAN_SCALE)[:, None], torch.zeros_like(q), q), b


def _decode_group(q: Tensor, s: Tensor, ladder: tuple[int, int, int], sign_at: int | None) -> Tensor:
    """fp32 values of grouped int64 codes ``q`` [G, 32] with fp32 scales ``s`` [G, 1]."""
    mag = q if sign_at is None else q & ((1 << sign_at) - 1)
    x = ladder_value(mag, ladder[0]) * s
    if sign_at is None:
        return x
    return _as_f32(_bits(x) | (((q >> sign_at) & 1) << 31))


def moment8_decode(codes: Tensor, scales: Tensor) -> Tensor:
    """The fp32 moment of 8-bit codes and their bf16 scales (one per 32 consecutive elements of the
    flattened codes, from element 0): float32 tensor of ``codes.shape`` on ``codes``' device.

    * ``codes.dtype == torch.int8`` (exp_avg): sign-magnitude byte, ``+-u(c & 0x7f) * s``;
    * ``codes.dtype == torch.uint8`` (exp_avg_sq): ``u(c) * s``;
    with ``u`` the 4-mantissa-bit ladder (math.h ``ladder_value_scaled``). A group whose scale is NaN decodes as NaN."""
    if codes.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"moment8_decode: codes must be int8 (exp_avg) or uint8 (exp_avg_sq), got {codes.dtype}")
    if scales.dtype != torch.bfloat16 or scales.numel() != moment8_groups(codes.numel()):
        raise ValueError(f"moment8_decode: scales must be bfloat16 with ceil(numel / 32) = "
                         f"{moment8_groups(codes.numel())} elements, got {scales.dtype} with {scales.numel()}")
    n = codes.numel()
    q = grouped(codes.reshape(-1).view(torch.uint8).to(torch.int64))
    x = (_decode_group(q, scales.reshape(-1, 1).float(), LADDER_M8, 7) if codes.dtype == torch.int8
         else _decode_group(q, scales.reshape(-1, 1).float(), LADDER_V8, None))
    return x.reshape(-1)[:n].reshape(codes.shape)


def moment8_encode(values: Tensor, kind: str, r16: Tensor | int | None = None) -> tuple[Tensor, Tensor]:
    """Quantize an fp32 moment to 8-bit codes and bf16 scales, exactly as the kernels store it.

    ``kind``: ``"exp_avg"`` (int8 sign-magnitude codes) or ``"exp_avg_sq"`` (uint8 codes, values >= 0;
    a positive value gets at least code 1). ``r16``: the 16 random bits per element (an int64 tensor
    of ``values.shape`` with values in [0, 2^16), or one int for all); None = 0x8000, which rounds to
    the nearest code value (ties up) -- the deterministic choice for checkpoint conversion. Random
    bits give the kernels' unbiased stochastic rounding. Returns ``(codes of values.shape, scales
    [ceil(numel / 32)])``."""
    if kind not in ("exp_avg", "exp_avg_sq"):
        raise ValueError(f"moment8_encode: kind must be 'exp_avg' or 'exp_avg_sq', got {kind!r}")
    n = values.numel()
    x = grouped(values.detach().reshape(-1).to(torch.float32))
    r = _r16_grouped(r16, x)
    if kind == "exp_avg":
        q, b = _encode_group(x, r, LADDER_M8, 7)
        codes = q.to(torch.uint8).view(torch.int8)
    else:
        q, b = _encode_group(x, r, LADDER_V8, None, at_least_one=True)
        codes = q.to(torch.uint8)
    return codes.reshape(-1)[:n].reshape(values.shape), _bits_to_bf16(b)


def moment4_decode(packed: Tensor, scales: Tensor, numel: int) -> Tensor:
    """The fp32 ``exp_avg`` of ``numel`` elements from 4-bit codes (uint8 ``packed``, two per byte:
    element 2j in the low nibble of byte j, 2j + 1 in the high one, each a sign-magnitude nibble: bit 3
    the sign, bits 0-2 the code of the 1-mantissa-bit ladder, values 0, 1/2, 1, 2, 3, 5, 7, 11) and their
    bf16 scales (one per 32 elements): ``+-u(c) * s`` (exact in fp32), 1-D."""
    numel = int(numel)
    if packed.dtype != torch.uint8 or packed.numel() != (numel + 1) // 2:
        raise ValueError(f"moment4_decode: packed must be uint8 with ceil(numel / 2) = {(numel + 1) // 2} bytes, "
                         f"got {packed.dtype} with {packed.numel()}")
    if scales.dtype != torch.bfloat16 or scales.numel() != moment8_groups(numel):
        raise ValueError(f"moment4_decode: scales must be bfloat16 with ceil(numel / 32) = {moment8_groups(numel)} "
                         f"elements, got {scales.dtype} with {scales.numel()}")
    b = packed.reshape(-1).to(torch.int64)
    nib = torch.stack([b & 0xF, b >> 4], dim=1).reshape(-1)[:numel]
    x = _decode_group(grouped(nib), scales.reshape(-1, 1).float(), LADDER_M4, 3)
    return x.reshape(-1)[:numel]


def moment4_encode(values: Tensor, r16: Tensor | int | None = None) -> tuple[Tensor, Tensor]:
    """4-bit ``exp_avg`` codes of fp32 ``values`` exactly as the kernels store them: ``(packed uint8
    [ceil(numel / 2)], bf16 scales [ceil(numel / 32)])``; the scale the smallest power of two that
    puts the group's maximum at or below the top value 11, each code rounded stochastically between
    neighbouring values from ``r16`` (as :func:`moment8_encode`; None rounds to the nearest value)."""
    n = values.numel()
    x = grouped(values.detach().reshape(-1).to(torch.float32))
    q, b = _encode_group(x, _r16_grouped(r16, x), LADDER_M4, 3)
    c = q.reshape(-1)[:n]
    if n % 2:
        c = torch.cat([c, c.new_zeros(1)])
    pairs = c.reshape(-1, 2)
    return (pairs[:, 0] | (pairs[:, 1] << 4)).to(torch.uint8), _bits_to_bf16(b)


# ---- each moment codec of mpkern/codecs.def as the torch backend runs it ---------------------------
# (decode exp_avg, decode exp_avg_sq, encode exp_avg, encode exp_avg_sq) by codec name; mpkern.codecs
# attaches them to the table's rows. Decoders: (codes, scales or None, numel) -> 1-D fp32 of numel;
# encoders: (fp32 values, int64 random 16 bits of their shape) -> (codes as stored, 1-D bf16 scales or None).
def _dense_decode(codes: Tensor, scales: Tensor | None, numel: int) -> Tensor:
    return codes.reshape(-1).float()


def _f32_encode(x: Tensor, r16: Tensor) -> tuple[Tensor, None]:
    return x, None


def _bf16_encode(x: Tensor, r16: Tensor) -> tuple[Tensor, None]:
    return bf16_sr(x, r16), None  # stochastic rounding: unbiased small changes


def _m8_decode(codes: Tensor, scales: Tensor | None, numel: int) -> Tensor:
    assert scales is not None
    return moment8_decode(codes, scales).reshape(-1)


def _m4_decode(codes: Tensor, scales: Tensor | None, numel: int) -> Tensor:
    assert scales is not None
    return moment4_decode(codes, scales, numel)


def _m8_encode(x: Tensor, r16: Tensor) -> tuple[Tensor, Tensor]:
    return moment8_encode(x, "exp_avg", r16)


def _v8_encode(x: Tensor, r16: Tensor) -> tuple[Tensor, Tensor]:
    return moment8_encode(x, "exp_avg_sq", r16)


#: a moment codec's (decode exp_avg, decode exp_avg_sq, encode exp_avg, encode exp_avg_sq)
#: (mpkern.codecs' Decoder / Encoder; that module imports this one)
_Decoder = Callable[[Tensor, "Tensor | None", int], Tensor]
_Encoder = Callable[[Tensor, Tensor], "tuple[Tensor, Tensor | None]"]

REFERENCE_MOMENT_CODECS: dict[str, tuple[_Decoder, _Decoder, _Encoder, _Encoder]] = {
    "float32": (_dense_decode, _dense_decode, _f32_encode, _f32_encode),
    "bfloat16": (_dense_decode, _dense_decode, _bf16_encode, _bf16_encode),
    "8bit": (_m8_decode, _m8_decode, _m8_encode, _v8_encode),
    "4bit_m": (_m4_decode, _m8_decode, moment4_encode, _v8_encode),
}
