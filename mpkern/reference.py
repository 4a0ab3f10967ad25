"""Pure-PyTorch implementations of the mpkern ops.

They are the ``torch`` backend (any device, always available) and document the exact semantics
the C++/CUDA/Triton kernels implement. Tests compare every backend against their own float64
computations, not against these functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Tensor = torch.Tensor


# The norm reduction (csrc/include/mpkern/norm.h): squares in fp64, lane sums in row order inside
# blocks of 16 rows x 16 lanes, halves-trees over the lanes of a block and the 64 blocks of a
# 16384-element chunk, then 128 row-order lanes of chunk partials and a halves-tree over them.
NORM_LANES, NORM_ROWS, NORM_BLOCKS, NORM_TENSOR_LANES = 16, 16, 64, 128
NORM_CHUNK = NORM_LANES * NORM_ROWS * NORM_BLOCKS
_NORM_SLICE = 256  # chunks squared at once (bounds the fp64 temporary to 32 MB)


def _halves(x: Tensor) -> Tensor:
    """Halves-tree sum over the last dimension (a power of two): x[..., i] + x[..., i + n/2] first.
    (Moved to the front once: first-dimension slices are the cheapest to dispatch, and this runs on
    the optimizer's step path through :func:`total_sumsq`.)"""
    x = x.movedim(-1, 0)
    w = x.shape[0]
    while w > 1:
        w //= 2
        x = x[:w] + x[w:]
    return x[0]


def _rows_then_halves(x: Tensor) -> Tensor:
    """x [rows, ..., lanes]: each lane summed over the rows in order, then the halves-tree over lanes."""
    acc = x[0]
    for r in range(1, x.shape[0]):
        acc = acc + x[r]
    return _halves(acc)


def memory_order(g: Tensor) -> Tensor:
    """The elements of a dense tensor (contiguous up to a permutation of its dims) as a 1-D view in
    memory order, from its first element -- the order the kernels walk (they read data_ptr()
    onwards). Other tensors: their logical order (the kernels refuse them)."""
    if g.is_contiguous():
        return g.reshape(-1)
    perm = sorted(range(g.dim()), key=lambda d: g.stride(d), reverse=True)
    return g.permute(perm).reshape(-1)


def norm_sumsq(x: Tensor) -> Tensor:
    """Sum of squares of the 1-D tensor ``x`` (0-dim float64), in the order of norm.h, on x's device."""
    n = x.numel()
    chunks = -(-n // NORM_CHUNK)
    parts = []
    for c0 in range(0, chunks, _NORM_SLICE):
        c1 = min(chunks, c0 + _NORM_SLICE)
        seg = x[c0 * NORM_CHUNK:min(n, c1 * NORM_CHUNK)].to(torch.float64)
        q = torch.zeros((c1 - c0) * NORM_CHUNK, dtype=torch.float64, device=x.device)
        q[:seg.numel()] = seg * seg  # exact squares; zero padding adds nothing
        q = q.view(c1 - c0, NORM_BLOCKS, NORM_ROWS, NORM_LANES).permute(2, 0, 1, 3)  # [rows, chunk, block, lane]
        parts.append(_halves(_rows_then_halves(q)))  # lanes, then blocks -> [chunk]
    p = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64, device=x.device)
    lanes = torch.zeros(-(-chunks // NORM_TENSOR_LANES) * NORM_TENSOR_LANES, dtype=torch.float64, device=x.device)
    lanes[:chunks] = p
    return _rows_then_halves(lanes.view(-1, NORM_TENSOR_LANES)) if chunks else torch.zeros(
        (), dtype=torch.float64, device=x.device)


def total_sumsq(sumsq: Tensor) -> Tensor:
    """The sum over tensors of their sums of squares (step 5 of norm.h), the same bits on every
    device: fp64, a halves-tree over the tensors in the caller's order (zero-padded to a power of
    two), rounded once to float32 -- not ``torch.sum``, whose order differs between CPU and CUDA.
    Every backend's statistics are combined by this one function (``mpkern.unscale_``, and each
    rank's fold before the all-reduce); ~log2(tensors) tiny device ops, no sync."""
    n = sumsq.numel()
    if n == 0:
        return torch.zeros((), dtype=torch.float32, device=sumsq.device)
    x = sumsq.reshape(-1).double()
    width = 1 << (n - 1).bit_length()
    if width > n:
        x = torch.cat([x, x.new_zeros(width - n)])
    return _halves(x).float()


def grad_stats(grads: Sequence[Tensor], inv_scale: Tensor) -> tuple[Tensor, Tensor]:
    """Per-tensor statistics of a gradient list, in one read of each tensor.

    Returns ``(sumsq, amax)``, float32 tensors of ``len(grads)`` entries on ``inv_scale``'s device:

    * ``sumsq[t] = sum((grads[t] * inv_scale) ** 2)`` -- squared L2 norm of the unscaled grad,
      computed as ``float32(S * inv_scale**2)`` with ``S`` the sum of the squares ``x**2`` (exact in
      float64) in the fixed order of :func:`norm_sumsq` (csrc/include/mpkern/norm.h) over the
      elements in memory order: every backend gives these bits, for any work split;
    * ``amax[t] = max(|grads[t]|)`` (0 for an empty tensor), NaN if the tensor holds a NaN, else
      inf if it holds an inf -- so ``~isfinite(amax)`` is the non-finite flag.
    """
    device = inv_scale.device
    n = len(grads)
    if n == 0:
        z = torch.zeros(0, dtype=torch.float32, device=device)
        return z, z.clone()
    inv = inv_scale.reshape(()).to(torch.float64)
    sums, maxs = [], []
    for g in grads:
        x = memory_order(g)
        if x.numel() == 0:
            sums.append(torch.zeros((), dtype=torch.float32, device=device))
            maxs.append(torch.zeros((), dtype=torch.float32, device=device))
            continue
        sums.append((norm_sumsq(x).to(device) * (inv * inv)).to(torch.float32))
        # amax propagates NaN; an inf without NaN gives inf.
        maxs.append(x.abs().amax().to(device=device, dtype=torch.float32))
    return torch.stack(sums), torch.stack(maxs)


def scale_(tensors: Sequence[Tensor], scale: Tensor) -> None:
    """``t *= scale`` in place for every tensor, computed in fp32 and rounded to ``t.dtype``."""
    s = scale.reshape(()).to(torch.float32)
    for t in tensors:
        if t.numel():
            t.copy_(t.to(torch.float32) * s)


MASTER_NONE, MASTER_F32, MASTER_REMAINDER, MASTER_8BIT = 0, 1, 2, 3

# Purposes of the random bits (math.h RandPurpose): which field of the element's one 32-bit word.
RAND_PARAM, RAND_EXP_AVG, RAND_EXP_AVG_SQ, RAND_MASTER8 = 0, 1, 2, 3
# (lowest bit, width) of each purpose's field (math.h rand_shift / rand_width).
RAND_FIELDS = {RAND_PARAM: (0, 10), RAND_MASTER8: (0, 10), RAND_EXP_AVG: (10, 11), RAND_EXP_AVG_SQ: (21, 11)}

_M32 = 0xFFFFFFFF


def _sqrt32(x: Tensor) -> Tensor:
    """Correctly rounded float32 sqrt, as the kernels' ``sqrtf``: via fp64 (53 >= 2*24 + 2 bits, so
    rounding the fp64 root to float32 is the correctly rounded float32 root). torch 2.14's
    vectorised CPU float32 ``sqrt`` is off by one ulp on some inputs (e.g. 0.004358131904155016)."""
    return x.double().sqrt().float()


def _bf16_rne_bits(x: Tensor) -> Tensor:
    return x.to(torch.bfloat16).view(torch.int16)


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


# ---- 8-bit companded moments (math.h mom8_*) --------------------------------------------------------
MOM8_GROUP = 32
MOM8_KM = float.fromhex("0x1.040c2p-14")  # fp32(1 / 127^2): exp_avg scale per unit of the group max
MOM8_KV = float.fromhex("0x1.040a14p-32")  # fp32(1 / 255^4): exp_avg_sq scale per unit of the group max
MOM8_NAN_SCALE = 0x7FC0
_Q255 = float(torch.tensor(65025.0) * torch.tensor(65025.0))  # fp32(255^4)


def moment8_groups(numel: int) -> int:
    """Number of scales of an 8-bit moment of ``numel`` elements: ceil(numel / 32)."""
    return (int(numel) + MOM8_GROUP - 1) // MOM8_GROUP


def _grouped(x: Tensor) -> Tensor:
    """Flat ``x`` as ``[groups, 32]``, the last group padded with zeros."""
    x = x.reshape(-1)
    pad = (-x.numel()) % MOM8_GROUP
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.reshape(-1, MOM8_GROUP)


def _scale_bits(x: Tensor, k: float) -> Tensor:
    """int32 bf16 bits of the scales of grouped fp32 ``x`` [G, 32] (mom8_scale_bits)."""
    amax = (x.view(torch.int32) & 0x7FFFFFFF).amax(dim=1)  # NaN > inf > finite, as bits
    b = (amax.view(torch.float32) * k).view(torch.int32).to(torch.int64)  # >= 0: no sign bit
    b = torch.where((b & 0xFFFF) != 0, b + 0x10000, b) >> 16
    return torch.where(amax >= 0x7F800000, torch.full_like(b, MOM8_NAN_SCALE), b).to(torch.int32)


def _bits_to_bf16(b: Tensor) -> Tensor:
    return b.to(torch.int16).view(torch.bfloat16)  # int32 -> int16 keeps the low bits


def _inv_scale(b: Tensor) -> Tensor:
    """mom8_inv_scale: 1 / s, or 0 for a zero or NaN scale."""
    s = (b << 16).view(torch.float32)
    inv = torch.div(torch.ones_like(s), s)
    return torch.where((b == 0) | (b == MOM8_NAN_SCALE), torch.zeros_like(s), inv)


def _q4(k: Tensor) -> Tensor:
    k2 = k * k
    return k2 * k2


def _encode_m(m: Tensor, inv: Tensor, r16: Tensor, top: float = 127.0) -> Tensor:
    """mom_encode_sq on grouped m [G, 32], inv [G, 1], r16 int [G, 32] -> int8 codes in [-top, top]
    (top 127: the 8-bit exp_avg, 7: the 4-bit one)."""
    y = m.abs() * inv
    k = torch.floor(torch.sqrt(y))
    k = torch.where(k * k > y, k - 1.0, k)
    kp = k + 1.0
    k = torch.where(kp * kp <= y, k + 1.0, k)
    d = y - k * k
    w = 2.0 * k + 1.0
    c = torch.where(r16.to(torch.float32) * w < d * 65536.0, k + 1.0, k)
    c = torch.where(y >= top * top, torch.full_like(c, top), c)
    c = torch.where(y > 0, c, torch.zeros_like(c))
    c = torch.where(m < 0, -c, c)
    return c.to(torch.int8)


def _encode_v(v: Tensor, inv: Tensor, r16: Tensor) -> Tensor:
    """mom8_encode_v on grouped v [G, 32] -> uint8 codes (a positive v gets at least code 1)."""
    y = v * inv
    k = torch.floor(torch.sqrt(torch.sqrt(y)))
    k = torch.where(_q4(k) > y, k - 1.0, k)
    k = torch.where(_q4(k + 1.0) <= y, k + 1.0, k)
    q = _q4(k)
    d = y - q
    w = _q4(k + 1.0) - q
    c = torch.where(r16.to(torch.float32) * w < d * 65536.0, k + 1.0, k)
    c = torch.clamp(c, min=1.0)
    c = torch.where(y >= _Q255, torch.full_like(c, 255.0), c)
    c = torch.where(y > 0, c, torch.zeros_like(c))
    return c.to(torch.uint8)


def moment8_decode(codes: Tensor, scales: Tensor) -> Tensor:
    """The fp32 moment of 8-bit codes and their bf16 scales (one per 32 consecutive elements of the
    flattened codes, from element 0): float32 tensor of ``codes.shape`` on ``codes``' device.

    * ``codes.dtype == torch.int8`` (exp_avg):   ``sign(c) * s * c^2``  (exact in fp32);
    * ``codes.dtype == torch.uint8`` (exp_avg_sq): ``(s * c^2) * c^2``.
    A group whose scale is NaN decodes as NaN."""
    if codes.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"moment8_decode: codes must be int8 (exp_avg) or uint8 (exp_avg_sq), got {codes.dtype}")
    if scales.dtype != torch.bfloat16 or scales.numel() != moment8_groups(codes.numel()):
        raise ValueError(f"moment8_decode: scales must be bfloat16 with ceil(numel / 32) = "
                         f"{moment8_groups(codes.numel())} elements, got {scales.dtype} with {scales.numel()}")
    n = codes.numel()
    s = scales.reshape(-1, 1).float()
    f = _grouped(codes.reshape(-1).to(torch.float32))
    if codes.dtype == torch.int8:
        x = s * (f * f.abs())
    else:
        f2 = f * f
        x = (s * f2) * f2
    return x.reshape(-1)[:n].reshape(codes.shape)


def moment8_encode(values: Tensor, kind: str, r16: Tensor | int | None = None) -> tuple[Tensor, Tensor]:
    """Quantize an fp32 moment to 8-bit codes and bf16 scales, exactly as the kernels store it.

    ``kind``: ``"exp_avg"`` (int8 codes, signed values) or ``"exp_avg_sq"`` (uint8 codes, values >= 0).
    ``r16``: the 16 random bits per element (an int64 tensor of ``values.shape`` with values in
    [0, 2^16), or one int for all); None = 32768, which rounds to the nearest code value (ties
    down) -- the deterministic choice for checkpoint conversion. Random bits give the kernels'
    unbiased stochastic rounding. Returns ``(codes of values.shape, scales [ceil(numel / 32)])``."""
    if kind not in ("exp_avg", "exp_avg_sq"):
        raise ValueError(f"moment8_encode: kind must be 'exp_avg' or 'exp_avg_sq', got {kind!r}")
    n = values.numel()
    x = _grouped(values.detach().reshape(-1).to(torch.float32))
    r = _r16_grouped(r16, x)
    if kind == "exp_avg":
        b = _scale_bits(x, MOM8_KM)
        codes = _encode_m(x, _inv_scale(b)[:, None], r)
    else:
        b = _scale_bits(x, MOM8_KV)
        codes = _encode_v(x, _inv_scale(b)[:, None], r)
    return codes.reshape(-1)[:n].reshape(values.shape), _bits_to_bf16(b)


MOM4_KM = float.fromhex("0x1.4e5e0ap-6")  # fp32(1 / 49): 4-bit exp_avg scale per unit of the group max


def _r16_grouped(r16: Tensor | int | None, like: Tensor) -> Tensor:
    """The encoders' 16 random bits per element as fp32 ``[G, 32]`` (None: 32768, round to nearest)."""
    if r16 is None or isinstance(r16, int):
        return torch.full_like(like, 32768.0 if r16 is None else float(int(r16) & 0xFFFF))
    return _grouped(r16.reshape(-1).to(torch.float32))


def moment4_decode(packed: Tensor, scales: Tensor, numel: int) -> Tensor:
    """The fp32 ``exp_avg`` of ``numel`` elements from 4-bit codes (uint8 ``packed``, two per byte:
    element 2j in the low nibble of byte j, 2j + 1 in the high one, each a signed 4-bit code c in
    [-7, 7]) and their bf16 scales (one per 32 elements): ``sign(c) * s * c^2`` (exact in fp32), 1-D."""
    numel = int(numel)
    if packed.dtype != torch.uint8 or packed.numel() != (numel + 1) // 2:
        raise ValueError(f"moment4_decode: packed must be uint8 with ceil(numel / 2) = {(numel + 1) // 2} bytes, "
                         f"got {packed.dtype} with {packed.numel()}")
    if scales.dtype != torch.bfloat16 or scales.numel() != moment8_groups(numel):
        raise ValueError(f"moment4_decode: scales must be bfloat16 with ceil(numel / 32) = {moment8_groups(numel)} "
                         f"elements, got {scales.dtype} with {scales.numel()}")
    b = packed.reshape(-1).to(torch.int32)
    nib = torch.stack([b & 0xF, b >> 4], dim=1).reshape(-1)[:numel]
    c = torch.where(nib >= 8, nib - 16, nib).to(torch.float32)
    f = _grouped(c)
    x = scales.reshape(-1, 1).float() * (f * f.abs())
    return x.reshape(-1)[:numel]


def moment4_encode(values: Tensor, r16: Tensor | int | None = None) -> tuple[Tensor, Tensor]:
    """4-bit ``exp_avg`` codes of fp32 ``values`` exactly as the kernels store them: ``(packed uint8
    [ceil(numel / 2)], bf16 scales [ceil(numel / 32)])``; scale ``bf16_round_up(amax / 49)``, the
    code rounded stochastically between neighbouring values from ``r16`` (as :func:`moment8_encode`;
    None rounds to the nearest value)."""
    n = values.numel()
    x = _grouped(values.detach().reshape(-1).to(torch.float32))
    b = _scale_bits(x, MOM4_KM)
    c = _encode_m(x, _inv_scale(b)[:, None], _r16_grouped(r16, x), 7.0).reshape(-1)[:n].to(torch.int32)
    if n % 2:
        c = torch.cat([c, c.new_zeros(1)])
    pairs = (c & 0xF).reshape(-1, 2)
    return (pairs[:, 0] | (pairs[:, 1] << 4)).to(torch.uint8), _bits_to_bf16(b)


def _moments_in(p: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *scales: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 ``exp_avg``, ``exp_avg_sq`` of ``p``'s shape from the stored moments: fp32 / bf16, or codes
    with their two scale tensors (int8 exp_avg: 8-bit; uint8: the 4-bit exp_avg, two codes per byte)."""
    if not scales:
        return exp_avg.float(), exp_avg_sq.float()
    if exp_avg.dtype == torch.uint8:
        m = moment4_decode(exp_avg, scales[0], p.numel())
    else:
        m = moment8_decode(exp_avg, scales[0])
    return m.reshape(p.shape), moment8_decode(exp_avg_sq, scales[1]).reshape(p.shape)


def _moments_out(m: Tensor, v: Tensor, word: Tensor, ok: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor,
                 *scales: Tensor) -> None:
    """Store the updated fp32 moments where ``ok``: codes (and their scales) or bf16, rounded
    stochastically from the elements' random words (fields B and C), fp32 as they are."""
    if exp_avg.dtype == torch.float32:
        r_m = r_v = None
    else:
        r_m, r_v = rand_field16(word, RAND_EXP_AVG), rand_field16(word, RAND_EXP_AVG_SQ)
    if scales:
        m_new, sm = moment4_encode(m, r_m) if exp_avg.dtype == torch.uint8 else moment8_encode(m, "exp_avg", r_m)
        v_new, sv = moment8_encode(v, "exp_avg_sq", r_v)
        for dst, src in zip(scales, (sm, sv)):
            dst.copy_(torch.where(ok, src.reshape(dst.shape), dst))
    elif exp_avg.dtype == torch.bfloat16:  # stochastic rounding: unbiased small changes
        m_new, v_new = bf16_sr(m, r_m), bf16_sr(v, r_v)
    else:
        m_new, v_new = m, v
    exp_avg.copy_(torch.where(ok, m_new, exp_avg))
    exp_avg_sq.copy_(torch.where(ok, v_new, exp_avg_sq))


def pow_int(b: float, n: Tensor) -> Tensor:
    """math.h pow_int: ``b ** n`` in fp64 for an integer tensor ``n`` (0 <= n < 2^32) by binary
    exponentiation in its fixed order -- the running square ``b^(2^k)`` multiplies the result where
    bit k of n is set -- so it agrees bit for bit with every backend (``torch.pow``/libm ``pow`` differ
    from it, and between CPU and GPU, in the last bit)."""
    r = torch.ones(n.shape, dtype=torch.float64, device=n.device)
    x = torch.full(n.shape, float(b), dtype=torch.float64, device=n.device)
    for k in range(32):
        r = torch.where(((n >> k) & 1) == 1, r * x, r)
        x = x * x
    return r


def adamw_step_(
    params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor],
    max_exp_avg_sqs: Sequence[Tensor], masters: Sequence[Tensor], steps: Sequence[Tensor], grad_factor: Tensor,
    found_inf: Tensor, lr_tensor: Tensor | None, lr: float, beta1: float, beta2: float, eps: float,
    weight_decay: float, maximize: bool, master_mode: int, stochastic_rounding: bool, seed: int,
    stream_ids: Sequence[int] = (), elem_offsets: Sequence[int] = (),
    exp_avg_scales: Sequence[Tensor] | None = None, exp_avg_sq_scales: Sequence[Tensor] | None = None,
) -> None:
    """Pure-PyTorch version of the fused AdamW step (same contract as the C++/CUDA kernels).

    Nothing is written when ``found_inf`` is non-zero: every update is computed and then committed
    with ``torch.where(found_inf == 0, new, old)``, so no host sync is needed. The random bits
    (param stochastic rounding, bf16 moments, 8-bit master corrections) are the kernels' own
    stream (one :func:`rand_word` per element, split into fields by :func:`rand_field16`), computed with
    integer tensor ops: element i of tensor t draws the bits of element ``elem_offsets[t] + i`` of stream
    ``stream_ids[t]`` (defaults: t and 0).
    8-bit moments (int8 exp_avgs, uint8 exp_avg_sqs, bf16 scales per 32 elements) are decoded with
    :func:`moment8_decode` and re-encoded as :func:`moment8_encode` with the kernels' random bits.
    """
    ok = found_inf.reshape(()) == 0
    factor = grad_factor.reshape(()).to(torch.float32)
    if maximize:
        factor = -factor
    # a float lr stays a Python float (a kernel argument in double): no host-to-device copy
    lr_d = lr_tensor.reshape(()).double() if lr_tensor is not None else float(lr)
    decay = 1 - lr_d * weight_decay  # fp32 in the multiply below (a Python float is rounded to fp32 there)
    decay = decay.float() if isinstance(decay, Tensor) else decay
    for i, p in enumerate(params):
        step = steps[i].reshape(()).double() + 1
        stream = int(stream_ids[i]) if stream_ids else i
        elem = torch.arange(p.numel(), dtype=torch.int64, device=p.device).reshape(p.shape)
        elem = elem + (int(elem_offsets[i]) if elem_offsets else 0)
        step_i = step.to(torch.int64)

        word = rand_word(seed, stream, elem, step_i)  # one word per element serves every rounding

        def bits(purpose: int, word=word) -> Tensor:
            return rand_field16(word, purpose)

        step_size = (lr_d / (1 - pow_int(beta1, step_i))).float()
        inv_bc2 = (1 / torch.sqrt(1 - pow_int(beta2, step_i))).float()
        g = grads[i].float() * factor
        if master_mode == MASTER_F32:
            w = masters[i].clone()
        elif master_mode == MASTER_REMAINDER:
            hi = p.view(torch.int16).to(torch.int32) & 0xFFFF
            w = ((hi << 16) + masters[i].to(torch.int32)).view(torch.float32)
        elif master_mode == MASTER_8BIT:
            w = master8_decode(p, masters[i])
        else:
            w = p.float()
        grouped = (exp_avgs[i], exp_avg_sqs[i]) + ((exp_avg_scales[i], exp_avg_sq_scales[i])
                                                    if exp_avgs[i].dtype in (torch.int8, torch.uint8) else ())
        m, v = _moments_in(p, *grouped)
        w = w * decay
        m = m + (1 - beta1) * (g - m)
        v = v * beta2 + (1 - beta2) * g * g
        vv = v
        if max_exp_avg_sqs:
            vv = torch.where(max_exp_avg_sqs[i] > v, max_exp_avg_sqs[i], v)
            max_exp_avg_sqs[i].copy_(torch.where(ok, vv, max_exp_avg_sqs[i]))
        denom = _sqrt32(vv) * inv_bc2 + eps
        w = w - step_size * m / denom
        _moments_out(m, v, word, ok, *grouped)
        if master_mode == MASTER_F32:
            masters[i].copy_(torch.where(ok, w, masters[i]))
            new_p = w.to(p.dtype)
        elif master_mode == MASTER_REMAINDER:
            u = w.view(torch.int32)
            hi = ((u + 0x8000) >> 16) & 0xFFFF
            new_p = hi.to(torch.int16).view(torch.bfloat16)  # int32 -> int16 keeps the low bits
            masters[i].copy_(torch.where(ok, (u & 0xFFFF).to(torch.int16), masters[i]))
        elif master_mode == MASTER_8BIT:
            new_p, c = master8_encode(w, p.dtype, word)
            masters[i].copy_(torch.where(ok, c, masters[i]))
        elif stochastic_rounding and p.dtype == torch.bfloat16:
            new_p = bf16_sr(w, bits(RAND_PARAM))
        else:
            new_p = w.to(p.dtype)
        p.copy_(torch.where(ok, new_p, p))
        steps[i].copy_(torch.where(ok, steps[i] + 1, steps[i]))
