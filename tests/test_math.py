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
