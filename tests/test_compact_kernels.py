"""Kernel layer of the compact optimizer state (issue 15): unique random streams, stochastically
rounded bf16 moments, the 8-bit master correction (master_mode 3).

* bit-identity of every C++/Triton kernel path (CPU AVX2, CPU scalar, Triton, CUDA when present)
  on sizes that are not multiples of any block (1, 31, 33, 1000, 65537), an offset view and a
  stream offset that crosses a multiple of 2^32; the pure-PyTorch reference within fp32 rounding;
* statistics against float64 AdamW written here: unbiased 8-bit masters and bf16 moments in the
  two small-update cases of the issue;
* stream identity: different stream ids draw different bits, a tensor split with elem_offsets
  draws the bits of the whole one (shard equivalence);
* found_inf is a bitwise no-op in mode 3; mode 3 on fp32 params is refused alike everywhere;
* 8-bit companded moments (int8 exp_avg / uint8 exp_avg_sq, a bf16 scale per 32 elements): the
  same bit-identity in every master mode, the codec unbiased against float64 over six decades,
  zero and NaN groups, the spike-then-decay and small-update cases, found_inf, argument checks.
"""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

import _ladder64
from conftest import DEVICE, HAS_CUDA, available_backends, call_adamw_op, kernel_path
from mpkern import _backend, _ops, reference, reference_codecs

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
SIZES = (1, 31, 33, 1000, 65537)
LR, B1, B2, EPS, WD = 1e-3, 0.9, 0.999, 1e-8, 0.01


def _kernel_backends():
    """The kernel paths to compare bit for bit (names of _run)."""
    bs = available_backends()
    out = [b for b in ("cpu", "cpu-scalar", "triton", "cuda") if b in bs]
    if "cpu" in out:  # "cpu" is the AVX-512 path where the CPU has it; this one forces AVX2
        out.insert(out.index("cpu") + 1, "cpu-avx2")
    return out


def _rand(n, dtype, gen, scale=1.0):
    return (torch.randn(n, generator=gen) * scale).to(dtype).to(DEVICE)


def _master_state(mode, p, gen):
    """A random master state of ``p`` for ``mode`` (fp32 master near p, any remainder / correction)."""
    n = p.numel()
    if mode == reference.MASTER_F32:
        return p.float() + _rand(n, F32, gen, 1e-4)
    if mode == reference.MASTER_REMAINDER:
        return torch.randint(-2**15, 2**15, (n,), generator=gen, dtype=torch.int16).to(DEVICE)
    return torch.randint(-128, 128, (n,), generator=gen, dtype=torch.int8).to(DEVICE)


def _case(mode, pdt, seed=0):
    """Fresh state for one multi-tensor call: the SIZES, plus an offset view (element 1 of a
    buffer: misaligned against the other buffers) of 300 elements."""
    gen = torch.Generator().manual_seed(seed)
    params, grads, ms, vs, masters, steps = [], [], [], [], [], []
    sizes = SIZES + (300,)
    for k, n in enumerate(sizes):
        if k == len(SIZES):
            base = _rand(n + 5, pdt, gen)
            p = base[1:1 + n]
        else:
            p = _rand(n, pdt, gen)
        params.append(p)
        grads.append(_rand(n, (F32, BF16, F16)[k % 3], gen, 0.1))
        ms.append(_rand(n, BF16, gen, 0.01))
        vs.append((_rand(n, F32, gen, 0.01) ** 2).to(BF16))
        if mode != reference.MASTER_NONE:
            masters.append(_master_state(mode, p, gen))
        steps.append(torch.full((), float(k + 3), device=DEVICE))
    # one stream offset crossing 2^32 inside the 65537-element tensor, the rest ordinary
    streams = [11 * k + 5 for k in range(len(sizes))]
    offsets = [0, 7, 2**20, 3, 2**32 - 40000, 12345][:len(sizes)]
    return [params, grads, ms, vs, [], masters, steps], streams, offsets


def _args(state, mode, sr, streams, offsets, found_inf=0.0):
    params, grads, ms, vs, vmax, masters, steps = state
    return (params, grads, ms, vs, vmax, masters, steps, torch.tensor(0.5, device=DEVICE),
            torch.tensor(found_inf, device=DEVICE), None, LR, B1, B2, EPS, WD, False, mode, sr, 1234,
            streams, offsets)


def _clone(state):
    return [[t.clone() for t in lst] for lst in state]


def _run(backend, state, *args, **kw):
    """One step on a kernel path; "cpu-scalar" / "cpu-avx2" are the C++ CPU kernel without SIMD /
    with AVX2 only."""
    with kernel_path(backend) as name:
        call_adamw_op(partial(_ops.adamw_step_, name), *_args(state, *args, **kw))
    return state


def _bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32) if t.element_size() == 4 else t


MODES = [(0, BF16, True), (1, BF16, False), (2, BF16, False), (3, BF16, False), (3, F16, False)]


@pytest.mark.parametrize("mode,pdt,sr", MODES, ids=lambda x: str(x).replace("torch.", ""))
def test_kernel_paths_bit_identical(mode, pdt, sr):
    bs = _kernel_backends()
    if len(bs) < 2:
        pytest.skip("needs two kernel paths")
    state0, streams, offsets = _case(mode, pdt, seed=mode)
    out = {b: _run(b, _clone(state0), mode, sr, streams, offsets) for b in bs}
    ref = out[bs[0]]
    names = ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "masters", "steps")
    for b in bs[1:]:
        for name, lst_a, lst_b in zip(names, ref, out[b]):
            for i, (a, c) in enumerate(zip(lst_a, lst_b)):
                assert torch.equal(_bits(a), _bits(c)), f"{b} vs {bs[0]}: {name}[{i}] differs"
    # something happened: params and stochastically rounded moments moved
    assert not torch.equal(ref[0][3], state0[0][3])
    assert not torch.equal(ref[2][3], state0[2][3])


def _master_of(state, mode):
    params, masters = state[0], state[5]
    if mode == reference.MASTER_8BIT:
        return [reference_codecs.master8_decode(p, c) for p, c in zip(params, masters)]
    if mode == reference.MASTER_F32:
        return list(masters)
    if mode == reference.MASTER_REMAINDER:
        return [(((p.view(torch.int16).to(torch.int32) & 0xFFFF) << 16) + r.to(torch.int32)).view(torch.float32)
                for p, r in zip(params, masters)]
    return [p.float() for p in params]


@pytest.mark.parametrize("mode,pdt,sr", MODES, ids=lambda x: str(x).replace("torch.", ""))
def test_reference_within_fp32_rounding(mode, pdt, sr):
    """The pure-PyTorch reference draws the same bits: the same results, up to where one fp32
    rounding difference flips a stochastic rounding decision (then one storage step)."""
    bs = _kernel_backends()
    if not bs:
        pytest.skip("no kernel backend")
    state0, streams, offsets = _case(mode, pdt, seed=10 + mode)
    k = _run(bs[0], _clone(state0), mode, sr, streams, offsets)
    r = _clone(state0)
    a = _args(r, mode, sr, streams, offsets)
    call_adamw_op(_ops._reference_adamw_step_, *a)
    for lst_k, lst_r in ((k[2], r[2]), (k[3], r[3])):  # bf16 moments: equal but for rare 1-ulp flips
        for a, b in zip(lst_k, lst_r):
            diff = (a.float() - b.float()).abs()
            ulp = a.float().abs() * 2.0**-7 + 1e-30
            assert bool((diff <= ulp * 1.01).all())
            assert int((diff > 0).sum()) <= max(2, a.numel() // 100)
    for a, b in zip(_master_of(k, mode), _master_of(r, mode)):
        # masters: the 8-bit correction's resolution is 2^-16 (bf16) of the param's magnitude
        torch.testing.assert_close(a.double(), b.double(), rtol=2**-14, atol=1e-30)
    assert all(torch.equal(a, b) for a, b in zip(k[6], r[6]))


# ---- statistics against float64 AdamW ------------------------------------------------------------
def _adamw64_constant_grad(w0, g, lr, steps, b1=B1, b2=B2, eps=EPS):
    w, m, v = w0, 0.0, 0.0
    for t in range(1, steps + 1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        w -= lr / (1 - b1**t) * m / (math.sqrt(v) / math.sqrt(1 - b2**t) + eps)
    return w


def _cpu_only():
    if "cpu" not in available_backends():
        pytest.skip("the statistical tests run on the C++ CPU kernel (bit-identical to the others)")


def test_master8_small_updates_unbiased():
    """bf16 param at 1.0, constant grad, lr 1e-5, 1000 steps: the 8-bit master moves like float64
    AdamW (within 5 %). The update (1e-5) is a third of the correction's resolution at 1.0
    (ulp 2^-7 / 256 = 3.1e-5): a round-to-nearest correction never moves. Each step adds a zero-mean
    rounding error of std <= 2e-5 to an element's master (a martingale): after 1000 steps ~6e-4 per
    element against a 1e-2 movement, so 2048 independent elements give the mean to ~0.2 %."""
    _cpu_only()
    n, steps_n, lr, gval = 2048, 1000, 1e-5, 0.1
    p = torch.ones(n, dtype=BF16)
    c = torch.zeros(n, dtype=torch.int8)
    m, v = torch.zeros(n), torch.zeros(n)
    step = torch.zeros(())
    g = torch.full((n,), gval)
    one, zero = torch.tensor(1.0), torch.tensor(0.0)
    for _ in range(steps_n):
        call_adamw_op(torch.ops.mpkern.adamw_step_, [p], [g], [m], [v], [], [c], [step], one, zero, None, lr, B1, B2,
                      EPS, 0.0, False, 3, False, 99)
    moved = 1.0 - reference_codecs.master8_decode(p, c).double().mean().item()
    exact = 1.0 - _adamw64_constant_grad(1.0, gval, lr, steps_n)
    assert exact == pytest.approx(1e-2, rel=1e-3)
    assert moved == pytest.approx(exact, rel=0.05), (moved, exact)


def test_bf16_moments_spike_then_decay():
    """One grad of 10, then 3000 steps of N(0, 0.1^2) grads: fp32 v ends at ~0.0145, bf16 v with
    round-to-nearest stays at 0.100 (0.999 * v rounds back). With stochastic rounding the bf16 v
    matches the float64 v of the same grads within 10 %. The statistic is the mean over 1024
    independent elements (each an unbiased random walk around the float64 v with a relative spread
    of a few %), so 3000 steps of 1024 elements keep it to < 1 %; the test takes ~1 s."""
    _cpu_only()
    n, steps_n = 1024, 3000
    gen = torch.Generator().manual_seed(5)
    p = torch.randn(n, generator=gen).to(BF16)
    w = p.float().clone()
    m, v = torch.zeros(n, dtype=BF16), torch.zeros(n, dtype=BF16)
    step = torch.zeros(())
    one, zero = torch.tensor(1.0), torch.tensor(0.0)
    v64 = torch.zeros(n, dtype=torch.float64)
    noise = torch.randn(steps_n, n, generator=gen) * 0.1
    for t in range(steps_n + 1):
        g = torch.full((n,), 10.0) if t == 0 else noise[t - 1]
        v64 = B2 * v64 + (1 - B2) * g.double() ** 2
        call_adamw_op(torch.ops.mpkern.adamw_step_, [p], [g], [m], [v], [], [w], [step], one, zero, None, 1e-4, B1, B2,
                      EPS, 0.0, False, 1, False, 3)
    expected = v64.mean().item()
    assert expected == pytest.approx(0.0145, rel=0.05)
    assert v.double().mean().item() == pytest.approx(expected, rel=0.10)


# ---- streams --------------------------------------------------------------------------------------
def _sr_state(n, gen):
    p = _rand(n, BF16, gen)
    return [[p], [_rand(n, F32, gen, 0.1)], [_rand(n, BF16, gen, 0.01)], [(_rand(n, F32, gen, 0.01) ** 2).to(BF16)],
            [], [torch.zeros(n, dtype=torch.int8, device=DEVICE)], [torch.zeros((), device=DEVICE)]]


def _masters(state, mode):
    """The masters list a call in mode ``mode`` passes for an _sr_state: its state[5] in mode 3, none otherwise."""
    return state[5] if mode == 3 else []


def _concat_state(a, b):
    return [[torch.cat([x, y]) if x.dim() else x.clone() for x, y in zip(la, lb)] for la, lb in zip(a, b)]


def test_streams_differ_and_shards_agree(backend):
    name = {"cpu-scalar": "cpu"}.get(backend, backend)
    gen = torch.Generator().manual_seed(8)
    n1, n2 = 333, 700
    half1, half2 = _sr_state(n1, gen), _sr_state(n2, gen)
    for mode, sr in ((3, False), (0, True)):
        masters = partial(_masters, mode=mode)
        # the whole tensor in stream 9 ...
        whole = _concat_state(half1, half2)
        w = [whole[0], whole[1], whole[2], whole[3], [], masters(whole), whole[6]]
        call_adamw_op(partial(_ops.adamw_step_, name), *_args(w, mode, sr, [9], [0]))
        # ... equals its two shards (same stream, global offsets) in one call
        s1, s2 = _clone(half1), _clone(half2)
        parts = [s1[0] + s2[0], s1[1] + s2[1], s1[2] + s2[2], s1[3] + s2[3], [], masters(s1) + masters(s2),
                 [torch.zeros((), device=DEVICE), torch.zeros((), device=DEVICE)]]
        call_adamw_op(partial(_ops.adamw_step_, name), *_args(parts, mode, sr, [9, 9], [0, n1]))
        for k in (0, 2, 3, 5):
            if w[k]:
                assert torch.equal(_bits(w[k][0]), _bits(torch.cat(parts[k]))), (mode, k)
        # two copies of one tensor in different streams draw different bits
        a, b = _clone(half2), _clone(half2)
        both = [a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3], [], masters(a) + masters(b),
                [torch.zeros((), device=DEVICE), torch.zeros((), device=DEVICE)]]
        call_adamw_op(partial(_ops.adamw_step_, name), *_args(both, mode, sr, [1, 2], [0, 0]))
        # (in mode 3 the param is the master rounded to nearest: the random part is the correction)
        for k in ((5, 2, 3) if mode == 3 else (0, 2, 3)):
            # identical bits would give 0; independent streams give E[2 q (1 - q)] over the
            # elements' round-up probabilities q (about 0.19-0.3 for these updates)
            differ = (_bits(both[k][0]) != _bits(both[k][1])).float().mean().item()
            assert differ > 0.1, (mode, k, differ)
        # the defaults are stream = index in the list, offset 0
        c1, c2 = _clone(half2), _clone(half2)
        l1 = [c1[0] * 2, c1[1] * 2, c1[2] * 2, c1[3] * 2, [], masters(c1) * 2,
              [torch.zeros((), device=DEVICE), torch.zeros((), device=DEVICE)]]
        l2 = [c2[0] * 2, c2[1] * 2, c2[2] * 2, c2[3] * 2, [], masters(c2) * 2,
              [torch.zeros((), device=DEVICE), torch.zeros((), device=DEVICE)]]
        l1 = [[t.clone() for t in lst] for lst in l1]
        l2 = [[t.clone() for t in lst] for lst in l2]
        call_adamw_op(partial(_ops.adamw_step_, name), *_args(l1, mode, sr, [], []))
        call_adamw_op(partial(_ops.adamw_step_, name), *_args(l2, mode, sr, [0, 1], [0, 0]))
        for k in (0, 2, 3, 5):
            for x, y in zip(l1[k], l2[k]):
                assert torch.equal(_bits(x), _bits(y))


def test_master8_found_inf_is_a_bitwise_noop(backend):
    name = {"cpu-scalar": "cpu"}.get(backend, backend)
    for pdt in (BF16, F16):
        state, streams, offsets = _case(3, pdt, seed=21)
        state = [lst[:3] for lst in state]  # sizes 1, 31, 33: every path, fast
        before = _clone(state)
        call_adamw_op(partial(_ops.adamw_step_, name),
                      *_args(state, 3, False, streams[:3], offsets[:3], found_inf=float("inf")))
        for la, lb in zip(state, before):
            for a, b in zip(la, lb):
                assert torch.equal(_bits(a), _bits(b))


CPU_PATHS = ("cpu", "cpu-avx2", "cpu-scalar")


@pytest.mark.parametrize("mode,pdt,sdt,sr", [(1, BF16, F32, False), (1, F32, F32, False), (1, F16, BF16, False),
                                             (0, BF16, BF16, True), (0, F32, F32, False), (2, BF16, F32, False),
                                             (3, BF16, F32, False), (3, F16, BF16, False)],
                         ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.parametrize("amsgrad", [False, True])
def test_cpu_simd_paths_bit_identical(mode, pdt, sdt, sr, amsgrad):
    """The CPU kernel's AVX-512 (where the CPU has it), AVX2 and scalar paths: equal bits on sizes
    around the 8- and 16-lane widths, fp32 and bf16 moments, amsgrad, maximize, huge/tiny/non-finite
    values."""
    if "cpu" not in available_backends():
        pytest.skip("no C++ CPU kernels")
    gen = torch.Generator().manual_seed(100 + mode)
    sizes = (7, 8, 15, 16, 17, 40, 255, 4099)
    special = torch.tensor([0.0, -0.0, 1e-40, 3e38, -3e38, float("inf"), float("nan"), 1e-30], dtype=F32)
    state0 = [[] for _ in range(7)]
    for k, n in enumerate(sizes):
        p = torch.randn(n, generator=gen) * 3
        if n > 40:
            p[5:13] = special
        g = torch.randn(n, generator=gen) * 0.1
        if n == 4099:  # NaN grads too: with maximize, every path computes -(g * factor), NaN sign included
            g[100:108] = special
        p = p.to(pdt)
        state0[0].append(p)
        state0[1].append(g.to((F32, BF16, F16)[k % 3]))
        state0[2].append((torch.randn(n, generator=gen) * 0.01).to(sdt))
        state0[3].append((torch.randn(n, generator=gen) * 0.01).pow(2).to(sdt))
        if amsgrad:
            state0[4].append((torch.randn(n, generator=gen) * 0.01).pow(2))
        if mode == 1:
            state0[5].append(p.float() + torch.randn(n, generator=gen) * 1e-4)
        elif mode == 2:
            state0[5].append(torch.randint(-2**15, 2**15, (n,), generator=gen, dtype=torch.int16))
        elif mode == 3:
            state0[5].append(torch.randint(-128, 128, (n,), generator=gen, dtype=torch.int8))
        state0[6].append(torch.full((), float(k + 1)))
    if mode in (2, 3) and pdt == F32:
        pytest.skip("compact masters need 16-bit params")
    if mode == 2 and pdt != BF16:
        pytest.skip("remainder masters need bf16 params")
    streams = [3 * k + 1 for k in range(len(sizes))]
    offsets = [0, 2**32 - 9, 5, 2**33 + 1, 0, 77, 2**32 - 100, 1]
    out = {}
    for b in CPU_PATHS:
        st = [[t.clone() for t in lst] for lst in state0]
        with kernel_path(b) as name:
            args = list(_args(st, mode, sr, streams, offsets))
            args[15] = mode == 1  # maximize
            call_adamw_op(partial(_ops.adamw_step_, name), *args)
        out[b] = st
    for b in CPU_PATHS[1:]:
        for li, (la, lb) in enumerate(zip(out["cpu"], out[b])):
            for i, (x, y) in enumerate(zip(la, lb)):
                assert torch.equal(_bits(x), _bits(y)), f"{b} vs cpu: list {li}[{i}] (size {sizes[i]}) differs"


def test_master8_edge_values_all_paths():
    """Subnormal, huge, overflowing and non-finite masters on every kernel path: equal bits, and
    the decoded master is finite where the param is."""
    bs = _kernel_backends()
    vals = torch.tensor([0.0, -0.0, 1e-40, -3e-39, 2.0**-130, 1e-5, 6e-8, 65000.0, 65519.0, 70000.0, 3e38, -3.3e38,
                         float("inf"), float("nan"), 1.0, -1.0, 0.1, 1e4], dtype=F32)
    for pdt in (BF16, F16):
        outs = []
        for b in bs:
            p = vals.to(pdt).to(DEVICE)
            c = torch.tensor([5, -7, 127, -128, 1, 0, 64, -1, 3, 0, 17, -90, 0, 0, 100, -100, 1, 2],
                             dtype=torch.int8, device=DEVICE)
            state = [[p], [torch.full_like(vals, 1e-3).to(DEVICE)], [torch.zeros(vals.shape, device=DEVICE)],
                     [torch.zeros(vals.shape, device=DEVICE)], [], [c], [torch.zeros((), device=DEVICE)]]
            _run(b, state, 3, False, [], [])
            outs.append((p.clone(), c.clone()))
            finite = torch.isfinite(p.float())
            dec = reference_codecs.master8_decode(p, c)
            assert bool(torch.isfinite(dec[finite]).all())
            assert bool(torch.isnan(dec[torch.isnan(p.float())]).all())  # a NaN param decodes to NaN
            inf = torch.isinf(p.float())
            if pdt == F16:
                assert bool((c[~finite] == 0).all())
            else:  # bf16: an inf param holds inf, or the finite master beyond bf16's range that rounds to it
                assert bool(((dec[inf] == p.float()[inf]) | (dec[inf].abs() >= float.fromhex("0x1.ffp127"))).all())
        for p, c in outs[1:]:
            assert torch.equal(_bits(p), _bits(outs[0][0])) and torch.equal(c, outs[0][1])


def test_master8_encode_decode_roundtrip_exact():
    """Without an update, encode(decode(p, c)) gives back p and c: bf16 masters are multiples of
    256 in the bit domain (adding fewer than 256 random units never crosses the next one); fp16
    scaling is exact and floor(x + u) of an integer x is x for every u."""
    gen = torch.Generator().manual_seed(4)
    for pdt in (BF16, F16):
        p = (torch.randn(4000, generator=gen) * 3).to(pdt)
        c = torch.randint(-128, 128, (4000,), generator=gen, dtype=torch.int8)
        w = reference_codecs.master8_decode(p, c)
        r = reference_codecs.rand_word(1, 2, torch.arange(4000), 3)
        p2, c2 = reference_codecs.master8_encode(w, pdt, r)
        w2 = reference_codecs.master8_decode(p2, c2)
        if pdt == BF16:
            assert torch.equal(p2.view(torch.int16), p.view(torch.int16)) and torch.equal(c2, c)
            continue
        # fp16: c = -128 is an exact tie (master = p - ulp/2): nearest-even may pick the neighbour
        # below, whose correction would be +128, clamped to 127 (1/256 ulp off). Everything else is exact.
        tie = c == -128
        assert torch.equal(w2[~tie], w[~tie])
        ulp256 = (reference_codecs.master8_decode(p, torch.ones_like(c)) - p.float()).abs()
        assert bool(((w2 - w)[tie].abs() <= ulp256[tie]).all())
        # a correction at a power of two decodes into the binade below; elsewhere the bits come back
        same = (p2.view(torch.int16) == p.view(torch.int16)) & ~tie
        assert bool((c2[same] == c[same]).all())


def test_master8_bf16_rounding_is_exactly_unbiased():
    """bf16 8-bit master: over all 256 values of its 8 random bits, the decoded masters average to
    the fp32 master exactly (float64 sums), also just below and above powers of two, for negative,
    subnormal, zero and huge masters; every decoded master is within one code unit (256 fp32 ulps
    of its binade) of the master, the param is the bf16 nearest to the decoded master, and without
    randomness (to nearest) the error is at most half a code unit."""
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(3000, generator=gen, dtype=torch.float64) * torch.logspace(-38, 37, 3000, dtype=torch.float64)
    pow2 = torch.tensor([2.0**k for k in (-120, -3, 0, 1, 7, 100)], dtype=torch.float64)
    below = pow2 * (1 - 2.0**-20)  # rounds up to the power of two
    extremes = torch.tensor([1e-40, -2e-39, 0.0, 3.3e38])
    w = torch.cat([base, below, pow2, pow2 * (1 + 2.0**-12), -below, extremes]).float()
    wd = w.double()
    ulp32 = (torch.nextafter(w.abs(), torch.full(w.shape, float("inf"))) - w.abs()).double()
    acc = torch.zeros(w.shape, dtype=torch.float64)
    for u8 in range(256):
        p, c = reference_codecs.master8_encode(w, BF16, torch.full(w.shape, u8))
        dec = reference_codecs.master8_decode(p, c).double()
        assert bool(((dec - wd).abs() <= 256 * ulp32).all())
        # the param: the bf16 nearest to the stored master (float64 distances; ties either way)
        pb = p.view(torch.int16)
        nz = (pb != 0) & (pb != -32768)  # the neighbours by bit pattern (of a zero: a NaN)
        up, dn = (pb + 1).view(BF16).double(), (pb - 1).view(BF16).double()
        near = (dec - p.double()).abs() <= torch.minimum((dec - up).abs(), (dec - dn).abs())
        assert bool(near[nz].all())
        acc += dec
    assert torch.equal(acc / 256, wd)
    p, c = reference_codecs.master8_encode(w, BF16)
    assert bool(((reference_codecs.master8_decode(p, c).double() - wd).abs() <= 128 * ulp32).all())


def test_master8_on_fp32_params_refused_everywhere():
    names = [b for b in available_backends() if b != "cpu-scalar"]
    errors = {}
    for b in names:
        p = torch.randn(6, device=DEVICE)
        args = ([p], [torch.randn(6, device=DEVICE)], [torch.zeros(6, device=DEVICE)], [torch.zeros(6, device=DEVICE)],
                [], [torch.zeros(6, dtype=torch.int8, device=DEVICE)], [torch.zeros((), device=DEVICE)],
                torch.tensor(1.0, device=DEVICE), torch.tensor(0.0, device=DEVICE), None, 1e-3, 0.9, 0.999, 1e-8,
                0.0, False, 3, False, 0)
        before = p.clone()
        with pytest.raises(TypeError) as info:
            call_adamw_op(partial(_ops.adamw_step_, b), *args)
        errors[b] = str(info.value).splitlines()[0]
        assert torch.equal(p, before)
    assert len(set(errors.values())) == 1, errors
    assert "master_codec '8bit'" in next(iter(errors.values())) and "float16" in next(iter(errors.values()))


def test_stream_args_checked():
    if _backend.native() is None:
        pytest.skip("native extension not built")
    state, _, _ = _case(1, BF16)
    state = [lst[:2] for lst in state]
    with pytest.raises(ValueError, match="stream_ids must be empty or one per param"):
        call_adamw_op(torch.ops.mpkern.adamw_step_, *_args(state, 1, False, [1], []))
    with pytest.raises(ValueError, match=r"elem_offsets\[1\] = -5 is negative"):
        call_adamw_op(torch.ops.mpkern.adamw_step_, *_args(state, 1, False, [], [0, -5]))


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_and_triton_on_gpu_bit_identical():
    """On a GPU the CUDA kernel and the Triton kernel agree bit for bit (covered by
    test_kernel_paths_bit_identical when both run; kept explicit for the GPU check script)."""
    assert {"cuda", "triton"} <= set(_kernel_backends())


# ---- 8-bit ladder moments (int8 exp_avg, uint8 exp_avg_sq, a bf16 scale per 32 elements) ---------
G32 = 32
UM8, UV8 = _ladder64.umax("m8"), _ladder64.umax("v8")  # the top values in scale units (247, 63487)


def _ngroups(n):
    return (n + G32 - 1) // G32


def _decode64(codes, scales):
    """float64 decode (tests/_ladder64.py): +-u(c & 0x7f) s (int8) or u(c) s (uint8), per group of 32."""
    return _ladder64.decode64(codes, scales, "m8" if codes.dtype == torch.int8 else "v8")


def _mom8_state(n, gen, zero=False):
    """Codes and scales of a random 8-bit moment pair (m ~ 1e-2, v ~ 1e-4 in magnitude); the scales are
    arbitrary bf16 values (the kernels decode any, and store powers of two)."""
    g = _ngroups(n)
    if zero:
        return (torch.zeros(n, dtype=torch.int8, device=DEVICE), torch.zeros(n, dtype=torch.uint8, device=DEVICE),
                torch.zeros(g, dtype=BF16, device=DEVICE), torch.zeros(g, dtype=BF16, device=DEVICE))
    cm = torch.randint(0, 256, (n,), generator=gen).to(torch.uint8).view(torch.int8)
    cv = torch.randint(0, 256, (n,), generator=gen).to(torch.uint8)
    sm = (torch.rand(g, generator=gen) * 0.02 / UM8).to(BF16)
    sv = (torch.rand(g, generator=gen) * 2e-4 / UV8 + 1e-20).to(BF16)
    return cm.to(DEVICE), cv.to(DEVICE), sm.to(DEVICE), sv.to(DEVICE)


def _mom4_state(n, gen, zero=False):
    """Packed 4-bit exp_avg codes, 8-bit exp_avg_sq codes and both scales (m ~ 1e-2, v ~ 1e-4)."""
    g = (n + G32 - 1) // G32
    nb = (n + 1) // 2
    if zero:
        return (torch.zeros(nb, dtype=torch.uint8, device=DEVICE), torch.zeros(n, dtype=torch.uint8, device=DEVICE),
                torch.zeros(g, dtype=BF16, device=DEVICE), torch.zeros(g, dtype=BF16, device=DEVICE))
    cm = torch.randint(0, 256, (nb,), generator=gen).to(torch.uint8)
    if n % 2:
        cm[-1] &= 0xF  # the documented layout: an odd tail's high nibble is 0
    cv = torch.randint(0, 256, (n,), generator=gen).to(torch.uint8)
    sm = (torch.rand(g, generator=gen) * 0.02 / _ladder64.umax("m4")).to(BF16)
    sv = (torch.rand(g, generator=gen) * 2e-4 / UV8 + 1e-20).to(BF16)
    return cm.to(DEVICE), cv.to(DEVICE), sm.to(DEVICE), sv.to(DEVICE)


def _case8(mode, pdt, seed=0, sizes=SIZES + (300,), moments=None):
    """8-bit moment state for one call: the SIZES and an offset view (element 1 of a buffer);
    the stream offset of the 1000-element tensor crosses 2^32 inside a group of 32. ``moments(n,
    gen)``: the codes and scales of another grouped kind (default: the 8-bit ones)."""
    moments = moments or _mom8_state
    gen = torch.Generator().manual_seed(seed)
    params, grads, ms, vs, masters, steps, sms, svs = [], [], [], [], [], [], [], []
    for k, n in enumerate(sizes):
        p = _rand(n + 5, pdt, gen)[1:1 + n] if n == 300 else _rand(n, pdt, gen)
        params.append(p)
        grads.append(_rand(n, (F32, BF16, F16)[k % 3], gen, 0.1))
        cm, cv, sm, sv = moments(n, gen)
        ms.append(cm), vs.append(cv), sms.append(sm), svs.append(sv)
        if mode != reference.MASTER_NONE:
            masters.append(_master_state(mode, p, gen))
        steps.append(torch.full((), float(k + 3), device=DEVICE))
    streams = [11 * k + 5 for k in range(len(sizes))]
    offsets = [0, 7, 2**20, 2**32 - 510, 2**33 + 3, 12345][:len(sizes)]
    return [params, grads, ms, vs, [], masters, steps, sms, svs], streams, offsets


def _args8(state, mode, sr, streams, offsets, found_inf=0.0, maximize=False, lr=LR):
    params, grads, ms, vs, vmax, masters, steps, sms, svs = state
    return (params, grads, ms, vs, vmax, masters, steps, torch.tensor(0.5, device=DEVICE),
            torch.tensor(found_inf, device=DEVICE), None, lr, B1, B2, EPS, WD, maximize, mode, sr, 1234,
            streams, offsets, sms, svs)


def _run8(backend, state, *args, **kw):
    with kernel_path(backend) as name:
        call_adamw_op(partial(_ops.adamw_step_, name), *_args8(state, *args, **kw))
    return state


MODES8 = [(0, BF16, True), (0, F32, False), (1, BF16, False), (1, F16, False), (2, BF16, False), (3, BF16, False),
          (3, F16, False)]
NAMES8 = ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "masters", "steps", "exp_avg_scales",
          "exp_avg_sq_scales")


@pytest.mark.parametrize("mode,pdt,sr", MODES8, ids=lambda x: str(x).replace("torch.", ""))
def test_mom8_kernel_paths_bit_identical(mode, pdt, sr):
    bs = _kernel_backends()
    if len(bs) < 2:
        pytest.skip("needs two kernel paths")
    maximize = mode == 1
    state0, streams, offsets = _case8(mode, pdt, seed=30 + mode)
    out = {b: _run8(b, _clone(state0), mode, sr, streams, offsets, maximize=maximize) for b in bs}
    ref = out[bs[0]]
    for b in bs[1:]:
        for name, lst_a, lst_b in zip(NAMES8, ref, out[b]):
            for i, (a, c) in enumerate(zip(lst_a, lst_b)):
                assert torch.equal(_bits(a), _bits(c)), f"{b} vs {bs[0]}: {name}[{i}] differs"
    for k in (0, 2, 3, 7, 8):  # params, codes and scales moved
        assert not torch.equal(_bits(ref[k][3]), _bits(state0[k][3])), NAMES8[k]


def _step_range_case(mode, pdt, moments):
    """One compact tensor of 17 warp passes (256 elements each, the last one partial) whose passes put
    values inside and outside the CUDA main loop's ranges (math.h, adamw_step_in_range_ok): pass 1 all
    zero (v = 0), pass 2 one m of ~1e-31 (its step below 2^-80), pass 3 one grad of 2^40 (v above 2^54),
    pass 4 a NaN grad, pass 5 a -0 param with a -0 grad and a -0 m, pass 6 every m zero with v > 0 (the
    main loop's zero numerators), pass 7 grads from 2^-45 to 2^30, the others ordinary."""
    n, span = 16 * 256 + 40, 256
    gen = torch.Generator().manual_seed(91)
    p = torch.randn(n, generator=gen).to(pdt)
    g = torch.randn(n, generator=gen) * 0.1
    cm, cv, sm, sv = (t.cpu() for t in moments(n, gen))
    m4 = cm.numel() != n

    def zero_m(lo, hi):  # the exp_avg codes of elements [lo, hi) (kMom4: their bytes; lo, hi even)
        if m4:
            cm[lo // 2:hi // 2] = 0
        else:
            cm[lo:hi] = 0

    g[span:2 * span] = 0.0
    zero_m(span, 2 * span), cv[span:2 * span].zero_(), sm[8:16].zero_(), sv[8:16].zero_()
    g[2 * span + 3] = 1e-30
    zero_m(2 * span + 2, 2 * span + 4)
    g[3 * span + 7] = 2.0**40
    g[4 * span + 9] = float("nan")
    p[5 * span + 4] = -0.0
    g[5 * span + 4] = -0.0
    if not m4:
        cm[5 * span + 4] = -128  # code 0x80: -0
    g[6 * span:7 * span] = 0.0
    zero_m(6 * span, 7 * span)
    e = torch.rand(span, generator=gen) * 75.0 - 45.0  # pass 7: |g| from 2^-45 to 2^30, both ranges' ends
    g[7 * span:8 * span] = torch.exp2(e) * torch.sign(torch.randn(span, generator=gen))
    master = _master_state(mode, p.to(DEVICE), gen) if mode != reference.MASTER_NONE else None
    state = [[p.to(DEVICE)], [g.to(BF16).to(DEVICE)], [cm.to(DEVICE)], [cv.to(DEVICE)], [],
             [master] if master is not None else [], [torch.full((), 4.0, device=DEVICE)], [sm.to(DEVICE)],
             [sv.to(DEVICE)]]
    return state


@pytest.mark.parametrize("mode,pdt", [(3, BF16), (2, BF16), (0, F32), (3, F16)], ids=str)
@pytest.mark.parametrize("kind", ["8bit", "4bit_m"])
@pytest.mark.parametrize("lr", [1e-3, 0.0])
def test_compact_step_ranges_bit_identical(mode, pdt, kind, lr):
    """The CUDA compact kernels step a pass without the IEEE square root's and division's rare cases
    when all its values are inside adamw_step_in_range's ranges, and with the IEEE operations otherwise
    (zero or tiny v, tiny or huge steps, NaN, lr = 0): the same bits either way, on every kernel path."""
    bs = _kernel_backends()
    if len(bs) < 2:
        pytest.skip("needs two kernel paths")
    state0 = _step_range_case(mode, pdt, _mom8_state if kind == "8bit" else _mom4_state)
    out = {b: _run8(b, _clone(state0), mode, False, [3], [0], lr=lr) for b in bs}
    ref = out[bs[0]]
    for b in bs[1:]:
        for name, lst_a, lst_b in zip(NAMES8, ref, out[b]):
            for i, (a, c) in enumerate(zip(lst_a, lst_b)):
                assert torch.equal(_bits(a), _bits(c)), f"{b} vs {bs[0]}: {name}[{i}] differs"
    p0, p1 = state0[0][0].cpu(), ref[0][0].cpu()
    if lr:
        assert not torch.equal(_bits(p0), _bits(p1))
    assert bool(p1.float().isnan().any())  # the NaN grad's element


@pytest.mark.parametrize("mode,pdt,sr", MODES8, ids=lambda x: str(x).replace("torch.", ""))
def test_mom8_cpu_simd_paths_bit_identical(mode, pdt, sr):
    """8-bit moments on the CPU kernel's AVX-512 (where the CPU has it), AVX2 and scalar paths, with
    maximize and huge / non-finite grads in some groups (NaN and top-code scales, NaN signs)."""
    if "cpu" not in available_backends():
        pytest.skip("no C++ CPU kernels")
    state0, streams, offsets = _case8(mode, pdt, seed=70 + mode, sizes=SIZES + (300, 4096 + 64 + 40))
    g = state0[1][-1]
    g[100:104] = torch.tensor([float("nan"), float("inf"), -float("inf"), 6e4]).to(g.dtype)
    g[2000] = 3e4
    out = {b: _run8(b, _clone(state0), mode, sr, streams, offsets + [2**32 - 2000], maximize=True)
           for b in CPU_PATHS}
    for b in CPU_PATHS[1:]:
        for name, lst_a, lst_b in zip(NAMES8, out["cpu"], out[b]):
            for i, (a, c) in enumerate(zip(lst_a, lst_b)):
                assert torch.equal(_bits(a), _bits(c)), f"{b} vs cpu: {name}[{i}] differs"


@pytest.mark.parametrize("mode,pdt,sr", MODES8[::2], ids=lambda x: str(x).replace("torch.", ""))
def test_mom8_reference_matches_kernels(mode, pdt, sr):
    """The pure-PyTorch reference computes the same fp32 operations in the same order: the same
    codes and scales, up to rare one-code flips where an fp32 rounding differs."""
    bs = _kernel_backends()
    if not bs:
        pytest.skip("no kernel backend")
    state0, streams, offsets = _case8(mode, pdt, seed=40 + mode, sizes=(1, 31, 33, 1000, 300))
    k = _run8(bs[0], _clone(state0), mode, sr, streams, offsets)
    r = _clone(state0)
    a = _args8(r, mode, sr, streams, offsets)
    call_adamw_op(_ops._reference_adamw_step_, *a)
    reference_close(k, r, mode)


def _signed8(c):
    """+-q of sign-magnitude int8 exp_avg codes (bit 7 the sign)."""
    b = c.view(torch.uint8).int()
    return torch.where(b >= 128, -(b - 128), b)


def reference_close(k, r, mode, m_codes=lambda c, p: _signed8(c)):
    """A kernel's grouped-moment state ``k`` against the reference's ``r`` after the same step: codes
    (``m_codes(codes, param)``: the exp_avg codes as integers per element) differ by at most one
    code in at most 1 % of the elements (an fp32 rounding that differs), scales within bf16 rounding,
    masters within fp32 rounding, steps equal."""
    for idx, codes in ((2, m_codes), (3, lambda c, p: c.int())):
        for a, b, p in zip(k[idx], r[idx], k[0]):
            diff = (codes(a, p) - codes(b, p)).abs()
            assert int(diff.max()) <= 1 and int((diff > 0).sum()) <= max(2, p.numel() // 100)
    for idx in (7, 8):
        for a, b in zip(k[idx], r[idx]):
            torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=0)
    for a, b in zip(_master_of(k, mode), _master_of(r, mode)):
        torch.testing.assert_close(a.double(), b.double(), rtol=2**-14, atol=1e-30)
    assert all(torch.equal(a, b) for a, b in zip(k[6], r[6]))


def _encode_with_kernel(x, draws, backend="cpu"):
    """Encode x (fp32, flat) `draws` times with fresh random bits through the kernel: zero state,
    beta1 = beta2 = 0 makes the updated moments exactly m = g and v = g * g. Returns the codes and
    scales of every draw."""
    n = x.numel()
    cms, cvs, sms, svs = [], [], [], []
    step = torch.zeros((), device=DEVICE)
    one, zero = torch.tensor(1.0, device=DEVICE), torch.tensor(0.0, device=DEVICE)
    for _ in range(draws):
        cm, cv, sm, sv = _mom8_state(n, None, zero=True)
        p = torch.zeros(n, device=DEVICE)
        call_adamw_op(partial(_ops.adamw_step_, backend), [p], [x], [cm], [cv], [], [], [step], one, zero, None, 0.0,
                      0.0, 0.0, EPS, 0.0, False, 0, False, 77, [], [], [sm], [sv])
        cms.append(cm), cvs.append(cv), sms.append(sm), svs.append(sv)
    return cms, cvs, sms, svs


def _magnitudes(groups, gen, decades):
    """Per group of 32: element 0 is the group max (1.0 times a group factor), the others
    10^(-decades * u) of it with random signs; returns (x, log10 of |x| / group max)."""
    u = torch.rand(groups, G32, generator=gen, dtype=torch.float64)
    u[:, 0] = 0.0
    rel = 10.0 ** (-decades * u)
    sign = torch.where(torch.rand(groups, G32, generator=gen) < 0.5, -1.0, 1.0).double()
    fac = 10.0 ** (torch.rand(groups, 1, generator=gen, dtype=torch.float64) * 8 - 6)
    return (rel * sign * fac).reshape(-1), (-decades * u).reshape(-1)


def test_mom8_codec_unbiased_and_scaled():
    """decode(encode(x)) is unbiased for m over 1e-6..1 of the group max and for v over 1e-6..1
    (in v) of its group max: per magnitude decade the summed error over 400 draws is within 5
    standard deviations of the rounding noise (the binomial variance p(1-p) step^2, computed here in
    float64 from the ladder's neighbouring values). The scales are the smallest powers of two that put
    the group max at or below the top value (247 for m, 63487 for v); no code exceeds the top code."""
    _cpu_only()
    gen = torch.Generator().manual_seed(12)
    groups, draws = 48, 400
    xm, lm = _magnitudes(groups, gen, 6.0)
    xv, lv = _magnitudes(groups, gen, 3.0)  # v = x^2 spans 6 decades
    for which, x64, logrel in (("m", xm, lm), ("v", xv, 2 * lv)):
        ladder = "m8" if which == "m" else "v8"
        mbits, qmax, _ = _ladder64.LADDERS[ladder]
        x = x64.float()
        cms, cvs, sms, svs = _encode_with_kernel(x, draws)
        target = x.double() if which == "m" else (x * x).double()  # the fp32 values the kernel encodes
        codes, scales = (cms, sms) if which == "m" else (cvs, svs)
        amax = target.abs().reshape(groups, G32).amax(dim=1)
        s = scales[0].double()
        assert torch.equal(s, _ladder64.scale64(amax, ladder))
        mags = torch.stack([c.cpu().view(torch.uint8).int() & (0x7F if which == "m" else 0xFF) for c in codes])
        assert int(mags.max()) <= qmax
        dec = torch.stack([_decode64(c, sc) for c, sc in zip(codes, scales)])  # [draws, n]
        mean = dec.mean(dim=0)
        # the rounding noise of one draw: the step between neighbouring code values around |x| / s
        sg = s.repeat_interleave(G32)
        y = target.abs() / sg
        lo, hi = _ladder64.neighbours64(y, mbits)
        pfrac = ((y - lo) / (hi - lo)).clamp(0, 1)
        var = pfrac * (1 - pfrac) * ((hi - lo) * sg) ** 2 / draws
        err = mean.abs() - target.abs() if which == "m" else mean - target
        for d in range(6):
            sel = (logrel <= -d) & (logrel > -d - 1)
            z = err[sel].sum() / var[sel].sum().sqrt().clamp(min=1e-300)
            assert abs(z.item()) < 5, (which, d, z.item())
            if d <= 2:  # where 400 draws resolve it: the mean itself within a few %
                rel = (err[sel].sum() / target[sel].abs().sum()).item()
                assert abs(rel) < 0.02, (which, d, rel)
        if which == "m":  # signs are kept
            nz = mean != 0
            assert bool((torch.sign(mean[nz]) == torch.sign(target[nz])).all())


# (groups of 32 elements, the all-zero groups, the NaN group): "short" is shorter than one vector block
# (every path's scalar tail), "blocks" puts the NaN and a zero group inside a whole block of 8 / 16
# groups of the AVX2 / AVX-512 paths, with a partial group at the end
NAN_LAYOUTS = {"short": (5, (1, 4, 5), 2), "blocks": (40, (9, 16, 40), 10)}


@pytest.mark.parametrize("layout", sorted(NAN_LAYOUTS))
def test_mom8_zero_groups_and_nan_group(backend, layout):
    """All-zero groups stay exactly zero (codes and scales); a NaN in one group makes only that
    group's scales NaN (codes 0), on every backend and CPU path."""
    name = {"cpu-scalar": "cpu"}.get(backend, backend)
    whole, zeros, nan_group = NAN_LAYOUTS[layout]
    n = whole * G32 + 7
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(n, generator=gen) * 0.1
    for j in zeros:
        g[j * G32:(j + 1) * G32] = 0.0
    g[nan_group * G32 + 5] = float("nan")
    g = g.to(DEVICE)
    # the C++ CPU kernel: its default path (AVX-512 where the CPU has it) and the AVX2 one; "cpu-scalar"
    # is already switched to the scalar path by the fixture
    paths = ["cpu", "cpu-avx2"] if backend == "cpu" else [name]
    for path in paths:
        cm, cv, sm, sv = _mom8_state(n, None, zero=True)
        p = torch.zeros(n, device=DEVICE)
        one, zero = torch.tensor(1.0, device=DEVICE), torch.tensor(0.0, device=DEVICE)
        with kernel_path(path):
            call_adamw_op(partial(_ops.adamw_step_, name), [p], [g], [cm], [cv], [], [],
                          [torch.zeros((), device=DEVICE)], one, zero, None, 1e-3, B1, B2, EPS, 0.0, False, 0, False, 5,
                          [], [], [sm], [sv])
        groups = torch.arange(whole + 1)
        is_zero = torch.isin(groups, torch.tensor(zeros))
        for s in (sm, sv):
            bits = s.view(torch.int16).cpu()
            assert bool((bits[is_zero] == 0).all()), (path, bits)
            assert bits[nan_group] == 0x7FC0, (path, bits[nan_group])
            live = ~is_zero & (groups != nan_group)
            assert bool((bits[live] > 0).all()), (path, bits)
        for c in (cm, cv):
            c = c.cpu()
            dead = torch.repeat_interleave(is_zero | (groups == nan_group), G32)[:n]
            assert bool((c[dead] == 0).all()), path
            assert bool((c[~dead] != 0).any()), path
        dec = _decode64(cm, sm)
        in_nan = torch.zeros(n, dtype=torch.bool)
        in_nan[nan_group * G32:(nan_group + 1) * G32] = True
        assert bool(dec[in_nan].isnan().all()) and not bool(dec[~in_nan].isnan().any()), path


def test_mom8_spike_then_decay():
    """One grad of 10, then 3000 steps of N(0, 0.1^2) grads per element (4096 elements): the 8-bit
    v follows float64 AdamW's v within 10 % -- the mean over elements and the per-element median
    ratio (a round-to-nearest 8-bit v would stay stuck near the spike's level)."""
    _cpu_only()
    n, steps_n = 4096, 3000
    gen = torch.Generator().manual_seed(6)
    p = torch.randn(n, generator=gen).to(BF16)
    w = p.float().clone()
    cm, cv, sm, sv = _mom8_state(n, None, zero=True)
    step = torch.zeros(())
    one, zero = torch.tensor(1.0), torch.tensor(0.0)
    v64 = torch.zeros(n, dtype=torch.float64)
    noise = torch.randn(steps_n, n, generator=gen) * 0.1
    spike = torch.full((n,), 10.0)
    for t in range(steps_n + 1):
        g = spike if t == 0 else noise[t - 1]
        v64 = B2 * v64 + (1 - B2) * g.double() ** 2
        call_adamw_op(torch.ops.mpkern.adamw_step_, [p], [g], [cm], [cv], [], [w], [step], one, zero, None, 1e-4, B1,
                      B2, EPS, 0.0, False, 1, False, 3, [], [], [sm], [sv])
    v8 = _decode64(cv, sv)
    assert v64.mean().item() == pytest.approx(0.0145, rel=0.05)
    assert v8.mean().item() == pytest.approx(v64.mean().item(), rel=0.10)
    assert (v8 / v64).median().item() == pytest.approx(1.0, abs=0.10)


def test_mom8_master8_small_updates():
    """bf16 param at 1.0, constant grad 0.1, lr 1e-5, 1000 steps, 8-bit master correction and
    8-bit moments: the master moves like float64 AdamW (within 5 %)."""
    _cpu_only()
    n, steps_n, lr, gval = 2048, 1000, 1e-5, 0.1
    p = torch.ones(n, dtype=BF16)
    c = torch.zeros(n, dtype=torch.int8)
    cm, cv, sm, sv = _mom8_state(n, None, zero=True)
    step = torch.zeros(())
    g = torch.full((n,), gval)
    one, zero = torch.tensor(1.0), torch.tensor(0.0)
    for _ in range(steps_n):
        call_adamw_op(torch.ops.mpkern.adamw_step_, [p], [g], [cm], [cv], [], [c], [step], one, zero, None, lr, B1, B2,
                      EPS, 0.0, False, 3, False, 99, [], [], [sm], [sv])
    moved = 1.0 - reference_codecs.master8_decode(p, c).double().mean().item()
    exact = 1.0 - _adamw64_constant_grad(1.0, gval, lr, steps_n)
    assert moved == pytest.approx(exact, rel=0.05), (moved, exact)


@pytest.mark.parametrize("kind", ["8bit", "4bit_m"])
def test_mom8_found_inf_is_a_bitwise_noop(backend, kind):
    name = {"cpu-scalar": "cpu"}.get(backend, backend)
    moments = _mom4_state if kind == "4bit_m" else _mom8_state
    for mode, pdt, sr in ((3, BF16, False), (0, BF16, True), (1, F16, False)):
        state, streams, offsets = _case8(mode, pdt, seed=50, sizes=(1, 31, 33), moments=moments)
        before = _clone(state)
        call_adamw_op(partial(_ops.adamw_step_, name),
                      *_args8(state, mode, sr, streams, offsets, found_inf=float("nan")))
        for la, lb in zip(state, before):
            for a, b in zip(la, lb):
                assert torch.equal(_bits(a), _bits(b))


def _bad8_cases():
    def base():
        st, _, _ = _case8(1, BF16, seed=2, sizes=(40, 7))
        return st

    def mod(fn):
        st = base()
        fn(st)
        return st

    def mixed(st):
        st[2][1] = torch.zeros(7, device=DEVICE)
        st[3][1] = torch.zeros(7, device=DEVICE)

    return {
        "v not uint8": (TypeError, lambda: mod(lambda st: st[3].__setitem__(0, st[3][0].to(torch.int8)))),
        "scale numel": (ValueError, lambda: mod(lambda st: st[7].__setitem__(0, st[7][0][:1].clone()))),
        "scale dtype": (TypeError, lambda: mod(lambda st: st[8].__setitem__(1, st[8][1].float()))),
        "scales missing": (ValueError, lambda: mod(lambda st: (st[7].clear(), st[8].clear()))),
        "amsgrad": (ValueError, lambda: mod(lambda st: st[4].extend([torch.zeros(40, device=DEVICE),
                                                                     torch.zeros(7, device=DEVICE)]))),
        "mixed kinds": (TypeError, lambda: mod(mixed)),
        "scales with fp32 moments": (ValueError, lambda: mod(lambda st: (
            st[2].__setitem__(0, torch.zeros(40, device=DEVICE)), st[3].__setitem__(0, torch.zeros(40, device=DEVICE)),
            st[2].__setitem__(1, torch.zeros(7, device=DEVICE)), st[3].__setitem__(1, torch.zeros(7, device=DEVICE))))),
    }


def refused_alike(cases) -> list[str]:
    """Every case of ``{name: (exception type, state maker)}`` raises that exception with the same
    first message line on every backend (the native ones and the Python ones), nothing written.
    Returns the backends tried."""
    if _backend.native() is None:
        pytest.skip("native extension not built")
    names = [b for b in available_backends() if b != "cpu-scalar"]
    for case, (exc, make) in cases.items():
        errors = {}
        for b in names:
            st = make()
            before = _clone(st)
            with pytest.raises(exc) as info:
                call_adamw_op(partial(_ops.adamw_step_, b), *_args8(st, 1, False, [], []))
            errors[b] = str(info.value).splitlines()[0]
            for la, lb in zip(st, before):
                for x, y in zip(la, lb):
                    assert torch.equal(_bits(x), _bits(y)), (case, b)
        assert len(set(errors.values())) == 1, (case, errors)
    return names


def test_mom8_bad_arguments_refused_alike_everywhere():
    names = refused_alike(_bad8_cases())
    # the optional scale lists: None is the same as empty
    st, _, _ = _case(1, BF16)
    st = [lst[:2] for lst in st]
    call_adamw_op(partial(_ops.adamw_step_, names[0]), *_args(st, 1, False, [], []), None, None)


BAD_SCALARS = {"lr": (10, -1e-3), "beta1": (11, 1.0), "beta2": (12, -0.5), "beta2 nan": (12, float("nan")),
               "eps": (13, -1e-8), "weight_decay": (14, -0.01)}


@pytest.mark.parametrize("case", sorted(BAD_SCALARS))
def test_adamw_op_refuses_scalars_outside_adamw_ranges_alike_everywhere(case):
    """The op refuses lr < 0, betas outside [0, 1), eps < 0 and weight_decay < 0 (NaN included) with a
    ValueError naming the scalar, the same first line on every backend, nothing written -- inside those
    ranges only do its paths agree bit for bit (a negative beta2 makes v negative, whose codes the AVX2
    and AVX-512 paths rounded differently). An lr the lr tensor replaces is not checked."""
    if _backend.native() is None:
        pytest.skip("native extension not built")
    at, value = BAD_SCALARS[case]
    errors = {}
    backends = [b for b in available_backends() if b != "cpu-scalar"]
    for b in backends:
        st, _, _ = _case8(3, BF16, seed=4, sizes=(40, 7))
        before = _clone(st)
        args = list(_args8(st, 3, False, [], []))
        args[at] = value
        with pytest.raises(ValueError) as info:
            call_adamw_op(partial(_ops.adamw_step_, b), *args)
        errors[b] = str(info.value).splitlines()[0]
        assert case.split()[0] in errors[b], errors[b]
        for la, lb in zip(st, before):
            for x, y in zip(la, lb):
                assert torch.equal(_bits(x), _bits(y)), (case, b)
    assert len(set(errors.values())) == 1, errors
    if case == "lr":  # with the lr tensor, the scalar lr is not read
        st, _, _ = _case8(3, BF16, seed=4, sizes=(40, 7))
        args = list(_args8(st, 3, False, [], []))
        args[9], args[10] = torch.tensor(1e-3, device=DEVICE), -1.0
        call_adamw_op(partial(_ops.adamw_step_, backends[0]), *args)


def test_mom8_reference_helpers_roundtrip():
    """moment8_encode with the nearest rule (r16 = None) then moment8_decode: every element within
    half a code step of its value (float64 bound here), shapes kept, the last group partial."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(5, 13, generator=gen) * 1e-3
    for kind in ("exp_avg", "exp_avg_sq"):
        vals = x if kind == "exp_avg" else x * x
        codes, scales = reference_codecs.moment8_encode(vals, kind)
        assert codes.shape == vals.shape and scales.shape == (_ngroups(vals.numel()),)
        assert codes.dtype == (torch.int8 if kind == "exp_avg" else torch.uint8) and scales.dtype == BF16
        dec = reference_codecs.moment8_decode(codes, scales)
        assert dec.shape == vals.shape and dec.dtype == F32
        d64 = _decode64(codes, scales).reshape(vals.shape)
        assert torch.equal(dec.double(), d64)  # exact: u(q) has 5 significant bits, s is a power of two
        ladder = "m8" if kind == "exp_avg" else "v8"
        sg = scales.double().repeat_interleave(G32)[:vals.numel()]
        y = vals.reshape(-1).double().abs() / sg
        lo, hi = _ladder64.neighbours64(y, _ladder64.LADDERS[ladder][0])
        err = (dec.reshape(-1).double().abs() - vals.reshape(-1).double().abs()).abs()
        assert bool((err <= 0.5 * (hi - lo) * sg * 1.0001).all())


# ---- the fused ladder forms (math.h ladder_value_scaled / ladder_encode) -----------------------------
@pytest.mark.parametrize("mbits, codes", [(4, 256), (1, 8)])
def test_fused_ladder_decode_and_encode_give_the_unfused_bits(mbits, codes):
    """CUDA and the AVX2 / AVX-512 kernels decode u(q) * s as F * s - s and encode z = ax * inv + 1 with
    one rounding, the scalar path and the reference with two: math.h's argument that both give the same
    bits, checked here for every code and every scale of the format (powers of two 2^-126 .. 2^127, 0,
    NaN) and for magnitudes whose ax * inv falls anywhere from the top code down below 2^-126. The fused
    value is computed in float64, where the product and the sum are exact (or, for a sum below 2^-24,
    round to 1 as float32 would); the unfused one in float32 arithmetic."""
    q = torch.arange(codes, dtype=torch.int64)
    f = ((q << (23 - mbits)) + 0x3F800000).to(torch.int32).view(torch.float32)  # F(q)
    e = torch.arange(-126, 128, dtype=torch.float64)
    s = torch.cat([torch.exp2(e), torch.tensor([0.0, math.nan], dtype=torch.float64)]).float()
    F, S = f[:, None], s[None, :]
    with torch.no_grad():
        unfused = (F - 1.0) * S  # float32: two roundings
        fused = (F.double() * S.double() - S.double()).float()  # one rounding of the exact value
    assert torch.equal(unfused.view(torch.int32)[~unfused.isnan()], fused.view(torch.int32)[~fused.isnan()])
    assert torch.equal(unfused.isnan(), fused.isnan()) and int(fused.isnan().sum()) == codes  # the NaN scale only
    assert bool(torch.isinf(unfused).any())  # the range's top is in the check (a corrupt code x the top scale)

    # encode: ax * inv spans (0, u_max] for inv = 1 / s over the scales, ax from random mantissas
    gen = torch.Generator().manual_seed(5)
    umax = float(f[-1]) - 1.0  # u of the top code
    inv = torch.exp2(-e).float()
    y_target = torch.exp2(-torch.rand(4096, generator=gen, dtype=torch.float64) * 160.0) * umax  # down to 2^-153
    ax = (y_target[:, None] / inv.double()[None, :]).float()  # any float32 magnitude, subnormals included
    INV = inv[None, :].expand_as(ax)
    ok = torch.isfinite(ax) & (ax.double() * INV.double() <= umax)
    a, iv = ax[ok], INV[ok]
    unfused_z = a * iv + 1.0  # float32, two roundings
    fused_z = (a.double() * iv.double() + 1.0).float()
    assert a.numel() > 500_000 and bool((a.double() * iv.double() < 2.0**-126).any())
    assert torch.equal(unfused_z.view(torch.int32), fused_z.view(torch.int32))
