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
The math.h helpers (random words, stochastic rounding, the 8-bit master, the ladder codes) and the
ladders' constants are the ``@triton.jit`` functions of :mod:`.adamw_codecs`.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from ._common import VEC, block_index, device_guard, load_f32, neg_f32, store_f32, typed_ptr
from .adamw_codecs import (
    BF16,
    M4_EXP,
    M4_MANT,
    M8_EXP,
    M8_MANT,
    MB4,
    MB8,
    NAN_SCALE,
    V8_EXP,
    V8_MANT,
    bf16_sr,
    ladder_inv,
    ladder_scale_bits,
    ladder_value,
    master8_decode,
    master8_encode,
    mom8_encode_v,
    rand_a16,
    rand_b16,
    rand_c16,
    rng_key,
    rng_word,
    sm_decode,
    sm_encode,
)
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
GROUP = 32
assert CHUNK % GROUP == 0 and BLOCK % GROUP == 0


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
            ka = rng_key(useed, stream, step, hi0)
            kb = rng_key(useed, stream, step, hi0 + 1)
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
            sm_ptr = _ptr_at(base, 12, BF16, False)
            sv_ptr = _ptr_at(base, 13, BF16, False)
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
                h_ptr = _ptr_at(base, 0, BF16, ALIGNED)  # the param's raw bits
                c_ptr = _int8_ptr(tl.load(base + 5), ALIGNED)
                h = tl.load(h_ptr + idx, mask=mask, other=0)
                c = tl.load(c_ptr + idx, mask=mask, other=0)
                w = master8_decode(h, c, PDT)
            else:
                w = load_f32(p_ptr, idx, mask, PDT)
            if GROUPED:
                s_m = (tl.load(sm_ptr + gi, mask=gmask, other=0).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
                s_v = (tl.load(sv_ptr + gi, mask=gmask, other=0).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
                if NIBBLES:  # the nibble of element idx in byte idx // 2 (mom4_code), sign-magnitude
                    nib = (tl.load(cm4_ptr + (idx >> 1), mask=mask, other=0).to(tl.int32) >> ((idx & 1) * 4)) & 0xF
                    m = sm_decode(nib.to(tl.uint32), s_m[:, None], MB4, 3)
                else:  # a sign-magnitude byte
                    m = sm_decode(tl.load(cm_ptr + idx, mask=mask, other=0).to(tl.uint32), s_m[:, None], MB8, 7)
                v = ladder_value(tl.load(cv_ptr + idx, mask=mask, other=0).to(tl.uint32), MB8) * s_v[:, None]
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
                rw = rng_word(ka, kb, hi0, gbase + idx)  # the element's one random word
            if GROUPED:
                am = tl.max(tl.where(mask, m.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0), axis=1)
                av = tl.max(tl.where(mask, v.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0), axis=1)
                bm = ladder_scale_bits(am, M4_EXP, M4_MANT) if NIBBLES else ladder_scale_bits(am, M8_EXP, M8_MANT)
                bv = ladder_scale_bits(av, V8_EXP, V8_MANT)
                okm = (bm != NAN_SCALE)[:, None]  # a NaN-scale group's codes are 0
                okv = (bv != NAN_SCALE)[:, None]
                if NIBBLES:
                    # codes of masked (past-the-end) elements are 0: an odd tail's high nibble is 0
                    cm = tl.where(mask & okm, sm_encode(m, ladder_inv(bm)[:, None], rand_b16(rw), MB4, 3), 0)
                    cm = cm.to(tl.int32)
                    pairs = tl.reshape(cm, (BLOCK // 32, 16, 2))
                    byte = tl.sum(pairs * tl.where(tl.arange(0, 2) == 0, 1, 16)[None, None, :], axis=2)
                    bidx = gi[:, None] * 16 + tl.arange(0, 16)[None, :]
                    tl.store(cm4_ptr + bidx, byte.to(tl.uint8), mask=bidx * 2 < end)
                else:
                    cm = tl.where(okm, sm_encode(m, ladder_inv(bm)[:, None], rand_b16(rw), MB8, 7), 0)
                    tl.store(cm_ptr + idx, cm.to(tl.uint8), mask=mask)
                cv = tl.where(okv, mom8_encode_v(v, ladder_inv(bv)[:, None], rand_c16(rw)), 0)
                tl.store(cv_ptr + idx, cv.to(tl.uint8), mask=mask)
                tl.store(sm_ptr + gi, bm.to(tl.uint16), mask=gmask)
                tl.store(sv_ptr + gi, bv.to(tl.uint16), mask=gmask)
            elif MOMENT_MODE == _MOM_BF16:
                tl.store(m_ptr + idx, bf16_sr(m, rand_b16(rw)), mask=mask)
                tl.store(v_ptr + idx, bf16_sr(v, rand_c16(rw)), mask=mask)
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
                h, c = master8_encode(w, rw, PDT)
                tl.store(h_ptr + idx, h, mask=mask)
                tl.store(c_ptr + idx, c, mask=mask)
            elif SR:
                tl.store(p_ptr + idx, bf16_sr(w, rand_a16(rw)), mask=mask)
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
