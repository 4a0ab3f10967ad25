"""Pure-PyTorch implementations of the mpkern ops.

They are the ``torch`` backend (any device, always available) and document the exact semantics
the C++/CUDA/Triton kernels implement. Tests compare every backend against their own float64
computations, not against these functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import codecs
from .codecs import MomentCodec
from .op_args import AdamwArgs
from .reference_codecs import (
    RAND_EXP_AVG,
    RAND_EXP_AVG_SQ,
    RAND_PARAM,
    bf16_sr,
    fma32,
    master8_decode,
    master8_encode,
    rand_field16,
    rand_word,
    sqrt32,
)

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


#: the master modes (mpkern/codecs.def)
MASTER_NONE, MASTER_F32, MASTER_REMAINDER, MASTER_8BIT = (codecs.MASTER_CODECS[n].mode
                                                          for n in ("none", "fp32", "remainder", "8bit"))


def _moments_in(codec: MomentCodec, p: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, m_scale: Tensor | None,
                v_scale: Tensor | None) -> tuple[Tensor, Tensor]:
    """fp32 ``exp_avg``, ``exp_avg_sq`` of ``p``'s shape from the moments stored as ``codec`` says."""
    n = p.numel()
    return (codec.decode_exp_avg(exp_avg, m_scale, n).reshape(p.shape),
            codec.decode_exp_avg_sq(exp_avg_sq, v_scale, n).reshape(p.shape))


def _moments_out(codec: MomentCodec, m: Tensor, v: Tensor, word: Tensor, ok: Tensor, exp_avg: Tensor,
                 exp_avg_sq: Tensor, m_scale: Tensor | None, v_scale: Tensor | None) -> None:
    """Store the updated fp32 moments where ``ok``, encoded as ``codec`` says from the elements'
    random words (fields B and C: stochastic rounding of codes and bf16 moments)."""
    m_new, sm = codec.encode_exp_avg(m, rand_field16(word, RAND_EXP_AVG))
    v_new, sv = codec.encode_exp_avg_sq(v, rand_field16(word, RAND_EXP_AVG_SQ))
    for dst, src in ((m_scale, sm), (v_scale, sv)):
        if dst is not None and src is not None:
            dst.copy_(torch.where(ok, src.reshape(dst.shape), dst))
    exp_avg.copy_(torch.where(ok, m_new.reshape(exp_avg.shape), exp_avg))
    exp_avg_sq.copy_(torch.where(ok, v_new.reshape(exp_avg_sq.shape), exp_avg_sq))


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


def adamw_step_(a: AdamwArgs) -> None:
    """Pure-PyTorch version of the fused AdamW step (same contract as the C++/CUDA kernels), over the
    arguments of one ``mpkern::adamw_step_`` call (:class:`mpkern.op_args.AdamwArgs`, read by name).

    Nothing is written when ``found_inf`` is non-zero: every update is computed and then committed
    with ``torch.where(found_inf == 0, new, old)``, so no host sync is needed. The random bits
    (param stochastic rounding, bf16 moments, 8-bit master corrections) are the kernels' own
    stream (one :func:`rand_word` per element, split into fields by :func:`rand_field16`), computed with
    integer tensor ops: element i of tensor t draws the bits of element ``elem_offsets[t] + i`` of stream
    ``stream_ids[t]`` (defaults: t and 0).
    The moments are kept as ``moment_codec`` (a row of :data:`mpkern.codecs.MOMENT_CODECS`) says:
    decoded and re-encoded by its torch-backend codec with the kernels' random bits.
    """
    master_mode = a.master_mode  # ValueError naming the codecs, the master's first
    codec = a.moments
    ok = a.found_inf.reshape(()) == 0
    factor = a.grad_factor.reshape(()).to(torch.float32)
    if a.maximize:
        factor = -factor
    # a float lr stays a Python float (a kernel argument in double): no host-to-device copy
    lr_d = a.lr_tensor.reshape(()).double() if a.lr_tensor is not None else float(a.lr)
    decay = 1 - lr_d * a.weight_decay  # fp32 in the multiply below (a Python float is rounded to fp32 there)
    decay = decay.float() if isinstance(decay, Tensor) else decay
    for i, p in enumerate(a.params):
        step = a.steps[i].reshape(()).double() + 1
        stream = int(a.stream_ids[i]) if a.stream_ids else i
        elem = torch.arange(p.numel(), dtype=torch.int64, device=p.device).reshape(p.shape)
        elem = elem + (int(a.elem_offsets[i]) if a.elem_offsets else 0)
        step_i = step.to(torch.int64)

        word = rand_word(a.seed, stream, elem, step_i)  # one word per element serves every rounding

        def bits(purpose: int, word=word) -> Tensor:
            return rand_field16(word, purpose)

        step_size = (lr_d / (1 - pow_int(a.beta1, step_i))).float()
        inv_bc2 = (1 / torch.sqrt(1 - pow_int(a.beta2, step_i))).float()
        g = a.grads[i].float() * factor
        if master_mode == MASTER_F32:
            w = a.masters[i].clone()
        elif master_mode == MASTER_REMAINDER:
            hi = p.view(torch.int16).to(torch.int32) & 0xFFFF
            w = ((hi << 16) + a.masters[i].to(torch.int32)).view(torch.float32)
        elif master_mode == MASTER_8BIT:
            w = master8_decode(p, a.masters[i])
        else:
            w = p.float()
        sm, sv = a.exp_avg_scales, a.exp_avg_sq_scales
        scales = (sm[i], sv[i]) if codec.grouped and sm is not None and sv is not None else (None, None)
        stored = (a.exp_avgs[i], a.exp_avg_sqs[i], *scales)
        m, v = _moments_in(codec, p, *stored)
        m = fma32(1 - a.beta1, g - m, m)
        v = fma32(g * (1 - a.beta2), g, v * a.beta2)
        vv = v
        if a.max_exp_avg_sqs:
            vv = torch.where(a.max_exp_avg_sqs[i] > v, a.max_exp_avg_sqs[i], v)
            a.max_exp_avg_sqs[i].copy_(torch.where(ok, vv, a.max_exp_avg_sqs[i]))
        w = fma32(w, decay, -(step_size * m / fma32(sqrt32(vv), inv_bc2, a.eps)))
        _moments_out(codec, m, v, word, ok, *stored)
        if master_mode == MASTER_F32:
            a.masters[i].copy_(torch.where(ok, w, a.masters[i]))
            new_p = w.to(p.dtype)
        elif master_mode == MASTER_REMAINDER:
            u = w.view(torch.int32)
            hi = ((u + 0x8000) >> 16) & 0xFFFF
            new_p = hi.to(torch.int16).view(torch.bfloat16)  # int32 -> int16 keeps the low bits
            a.masters[i].copy_(torch.where(ok, (u & 0xFFFF).to(torch.int16), a.masters[i]))
        elif master_mode == MASTER_8BIT:
            new_p, c = master8_encode(w, p.dtype, word)
            a.masters[i].copy_(torch.where(ok, c, a.masters[i]))
        elif a.stochastic_rounding and p.dtype == torch.bfloat16:
            new_p = bf16_sr(w, bits(RAND_PARAM))
        else:
            new_p = w.to(p.dtype)
        p.copy_(torch.where(ok, new_p, p))
        a.steps[i].copy_(torch.where(ok, a.steps[i] + 1, a.steps[i]))
