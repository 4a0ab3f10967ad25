"""The shared per-element math (csrc/include/mpkern/math.h and its Triton mirror), exhaustively.

Every fp16 and bf16 bit pattern goes through scale_ with factors that land on subnormals, exact
ties, the overflow boundary, inf and NaN; the result must equal PyTorch's own
``(x.float() * s).to(dtype)`` bit for bit (any NaN equals any NaN).
"""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE
from mpkern import _backend, _ops

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
def _fma32(x, y, z):
    """float32 fma(x, y, z), one rounding: the exact product in float64, the sum rounded to odd in float64
    (two-sum), then to nearest float32 -- exact for float32 operands and results in the normal range."""
    x, y, z = x.double(), y.double(), z.double()
    p = x * y
    s = p + z
    bb = s - p
    err = (p - (s - bb)) + (z - bb)
    bits = s.view(torch.int64)
    sticky = (err != 0) & ((bits & 1) == 0)
    bits = torch.where(sticky, bits + torch.where((err > 0) == (s > 0), 1, -1), bits)
    return bits.view(torch.float64).float()


def _div_in_range(a, b, r):
    """div_in_range's operations with the reciprocal estimate r (MUFU.RCP's on a GPU)."""
    r = _fma32(r, _fma32(-b, r, torch.ones_like(b)), r)
    q = (a.double() * r.double()).float()
    return _fma32(r, _fma32(-b, q, a), q)


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
