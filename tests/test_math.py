"""The shared per-element math (csrc/include/mpkern/math.h and its Triton mirror), exhaustively.

Every fp16 and bf16 bit pattern goes through scale_ with factors that land on subnormals, exact
ties, the overflow boundary, inf and NaN; the result must equal PyTorch's own
``(x.float() * s).to(dtype)`` bit for bit (any NaN equals any NaN).
"""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, libm_fmaf
from mpkern import _backend, _ops
from mpkern.reference_codecs import fma32

FACTORS = [0.5, 0.75, 1.5, 3.0, 2.0**-10, 2.0**-14, 1.0 + 2.0**-9, 65504.0 / 65536.0, 2.0**20]


def _all_patterns(dtype):
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    return bits.view(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("factor", FACTORS)
def test_scale_bitwise_all_patterns(backend, dtype, factor):
    x = _all_patterns(dtype).to(DEVICE)
    s = torch.tensor(factor, dtype=torch.float32, device=DEVICE)
    expected = (x.float() * s).to(dtype)
    y = x.clone()
    _ops.scale_([y], s, _backend.select(DEVICE))
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(y), nan)
    same = y.view(torch.int16) == expected.view(torch.int16)
    assert bool((same | nan).all()), f"{int((~same & ~nan).sum())} patterns differ"


def test_stats_amax_exact_all_patterns(backend):
    """max |x| per tensor is exact, and NaN beats inf beats every finite value."""
    for dtype in (torch.float16, torch.bfloat16):
        x = _all_patterns(dtype).to(DEVICE)
        finite = x[torch.isfinite(x)]
        only_inf = torch.cat([finite, torch.tensor([float("-inf")], dtype=dtype, device=DEVICE)])
        sumsq, amax = _ops.grad_stats([finite, only_inf, x], torch.tensor(1.0, device=DEVICE), _backend.select(DEVICE))
        assert float(amax[0]) == float(finite.float().abs().max())
        assert float(amax[1]) == float("inf")
        assert torch.isnan(amax[2])
        assert torch.isnan(sumsq[2]) and float(sumsq[1]) == float("inf")


# ---- the CUDA compact kernels' division without its rare cases (math.h, div_in_range) ----
def _fma_cases(n, gen):
    """Float32 triples where one and two roundings differ: products with bits below float32's, sums
    that cancel, ties, subnormal and huge results, zeros of both signs, inf and NaN."""
    x = _mantissas(n, gen) * torch.pow(2.0, torch.randint(-30, 30, (n,), generator=gen).float())
    y = _mantissas(n, gen) * torch.pow(2.0, torch.randint(-30, 30, (n,), generator=gen).float())
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    # z near -x * y (cancellation: the product's low bits decide), or unrelated
    near = -(x.double() * y.double()).float() * (1 + sign * torch.randint(0, 4, (n,), generator=gen) * 2.0**-23)
    z = torch.where(torch.rand(n, generator=gen) < 0.7, near, sign * _mantissas(n, gen))
    one = torch.tensor([1 + 2.0**-12, 1 + 2.0**-12, 2.0**-149, 3.0e38, -0.0, 0.0, float("inf"), float("nan")])
    other = torch.tensor([1 + 2.0**-12, -(1 + 2.0**-11), 0.5, 2.0, 0.0, -0.0, 0.0, 1.0])
    zs = torch.tensor([-(1 + 2.0**-11), 0.0, 0.0, -3.0e38, -0.0, 0.0, 1.0, 1.0])
    return torch.cat([x, one]), torch.cat([y, other]), torch.cat([z, zs])


def test_fma32_is_the_c_library_fmaf():
    """reference_codecs.fma32 (the torch reference's fma, and the algorithm of the Triton interpreter's
    exact fma) against the C library's fmaf, bit for bit (any NaN equals any NaN), and the interpreter's
    tl.fma, patched by triton_kernels._interp_compat, against it too."""
    fmaf = libm_fmaf()
    gen = torch.Generator().manual_seed(5)
    x, y, z = _fma_cases(4000, gen)
    want = torch.tensor([fmaf(a, b, c) for a, b, c in zip(x.tolist(), y.tolist(), z.tolist())], dtype=torch.float32)
    got = fma32(x, y, z)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))
    # the cases exercise the difference: two roundings would get some of them wrong
    two = (x * y + z)[~nan]
    assert int((two.view(torch.int32) != want[~nan].view(torch.int32)).sum()) > 100

    pytest.importorskip("triton")
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp

    import mpkern.triton_kernels._common  # noqa: F401  (installs the interpreter fixes)

    def handle(t):
        return interp.TensorHandle(t.numpy(), tl.float32)

    out = torch.from_numpy(np.asarray(interp.InterpreterBuilder.create_fma(None, handle(x), handle(y), handle(z)).data))
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out[~nan].view(torch.int32), want[~nan].view(torch.int32))


def _div_in_range(a, b, r):
    """div_in_range's operations with the reciprocal estimate r (MUFU.RCP's on a GPU)."""
    r = fma32(r, fma32(-b, r, torch.ones_like(b)), r)
    q = (a.double() * r.double()).float()
    return fma32(r, fma32(-b, q, a), q)


def _mantissas(n, gen):
    return (torch.randint(0, 1 << 23, (n,), generator=gen, dtype=torch.int32) | 0x3F800000).view(torch.float32)


def test_div_in_range_keeps_to_nearest_over_its_ranges():
    """math.h's ranges for the CUDA compact kernels' division fast path (div_in_range: nvcc's own
    sequence -- one Newton step of MUFU.RCP's reciprocal, the quotient, its FMA remainder, one
    correction): for a in {+0} u [2^-70, 2^40) and b in [2^-51, 2^44) no intermediate leaves the
    normal range, so with a correctly rounded reciprocal the sequence gives a / b rounded to nearest
    even -- at the ranges' ends and for hard cases (2^k / (2 - 2^-23): a quotient 2^-48 above a
    midpoint) too. And why the kernels copy nvcc's sequence instead of relying on an error bound: an
    estimate one ulp off misrounds such a hard case. Float64 emulation, independent of the kernels."""
    gen = torch.Generator().manual_seed(17)
    n = 1 << 20
    a, b = _mantissas(n, gen), _mantissas(n, gen)
    hard_a = torch.tensor([0.0, 1.0, 1.0, 1.5, 2.0 - 2.0**-23])
    hard_b = torch.tensor([1.5, 2.0 - 2.0**-23, 1.0 + 2.0**-23, 2.0 - 2.0**-23, 1.0 + 2.0**-22])
    k = hard_a.numel()
    a[:k], b[:k] = hard_a, hard_b
    ea = torch.randint(-70, 40, (n,), generator=gen).double()
    eb = torch.randint(-51, 44, (n,), generator=gen).double()
    ea[:k], eb[:k] = 0.0, 0.0
    ea[k:1000], eb[k:1000] = -70.0, 43.0  # the least quotients, ~2^-114
    ea[1000:2000], eb[1000:2000] = 39.0, -51.0  # the largest, ~2^91
    a = (a.double() * torch.exp2(ea)).float()
    b = (b.double() * torch.exp2(eb)).float()
    want = (a.double() / b.double()).float()  # correctly rounded: a double quotient, then one rounding
    assert bool(torch.isfinite(want).all()) and bool((want[1:] >= 2.0**-115).all())
    exact = (1.0 / b.double()).float()
    got = _div_in_range(a, b, exact)
    bad = got.view(torch.int32) != want.view(torch.int32)
    assert not bool(bad.any()), f"{int(bad.sum())} quotients misrounded, e.g. {a[bad][:3]} / {b[bad][:3]}"
    assert got[0].item() == 0.0 and not bool(got[0].signbit())  # +0 / b = +0 through the arithmetic
    off = _div_in_range(a[:k], b[:k], (exact[:k].view(torch.int32) + 1).view(torch.float32))
    assert not torch.equal(off.view(torch.int32), want[:k].view(torch.int32))


def test_rng_bits8_split_gives_rng_bits():
    """math.h's rng_bits8_base / rng_bits8_at (the CUDA compact main loop's random words): for lo a
    multiple of 8 and k < 8, mix32_rest((key ^ lo) ^ ((key ^ lo) >> 16) ^ k) == mix32(key ^ (lo + k)),
    for random keys and lo up to 2^32 - 8 (the reference's mix32, computed whole)."""
    from mpkern import reference_codecs as rc

    gen = torch.Generator().manual_seed(8)
    key = torch.randint(0, 2**32, (1 << 16,), generator=gen, dtype=torch.int64)
    lo = torch.randint(0, 2**29, (1 << 16,), generator=gen, dtype=torch.int64) * 8
    lo[:3] = torch.tensor([0, 2**32 - 8, 0xFFF8])
    base = (key ^ lo) ^ ((key ^ lo) >> 16)
    for k in range(8):
        x = base ^ k  # what rng_bits8_at hands mix32_rest
        want = rc.mix32(key ^ (lo + k))
        # mix32_rest(x) == mix32(y) for the y whose first step y ^ (y >> 16) is x: on 32 bits that
        # xorshift is its own inverse, y = x ^ (x >> 16)
        y = x ^ (x >> 16)
        assert bool(((y ^ (y >> 16)) == x).all())
        assert torch.equal(rc.mix32(y), want)
