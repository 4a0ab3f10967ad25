"""beta^t of the bias corrections (math.h pow_int): binary exponentiation in fp64 in one fixed order
on every backend, not the libm/device ``pow`` (whose last bit differs between glibc and CUDA).

* ``reference.pow_int`` and the Triton ``beta_pows`` equal the rule written here with Python floats
  (IEEE doubles), and differ from ``math.pow`` for some (beta, t) -- the rule is not a no-op;
* the kernels (C++ CPU AVX2 / AVX-512 / scalar, Triton, CUDA when present) and the reference
  update with constants from pow_int, bit for bit, at a (beta, step) where libm's pow would give
  another fp32 step size or 1 / sqrt(bias correction) -- so a kernel that used pow fails here.
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest
import torch

from conftest import DEVICE, available_backends, call_adamw_op, fma_np, kernel_path
from mpkern import _ops, reference

F32 = np.float32


def _pow_int(b: float, n: int) -> float:
    r, x = 1.0, b
    while n:
        if n & 1:
            r = r * x
        x = x * x
        n >>= 1
    return r


STEPS = [1, 2, 3, 7, 100, 353, 1000, 1330, 4095, 12345, 999999, 2**24]


@pytest.mark.parametrize("beta", [0.9, 0.999, 0.9999999, 0.0, 0.5])
def test_reference_pow_int_is_the_rule(beta):
    n = torch.tensor(STEPS, dtype=torch.int64)
    got = reference.pow_int(beta, n)
    want = torch.tensor([_pow_int(beta, t) for t in STEPS], dtype=torch.float64)
    assert torch.equal(got, want)


def test_pow_int_differs_from_libm_pow():
    diff = sum(_pow_int(0.9999999, t) != math.pow(0.9999999, t) for t in range(1, 2000))
    assert diff > 100  # the fixed order matters in the last fp64 bits


def test_triton_beta_pows_is_the_rule():
    if "triton" not in available_backends():
        pytest.skip("no Triton backend here")
    from mpkern.triton_kernels.adamw import beta_pows

    t = torch.tensor(STEPS, dtype=torch.float64, device=DEVICE)
    p1, p2 = beta_pows(t, 0.9999999, 0.999)
    assert torch.equal(p1.cpu(), torch.tensor([_pow_int(0.9999999, s) for s in STEPS], dtype=torch.float64))
    assert torch.equal(p2.cpu(), torch.tensor([_pow_int(0.999, s) for s in STEPS], dtype=torch.float64))


def _paths():
    bs = [b for b in ("cpu", "cpu-scalar", "triton", "cuda", "torch") if b in available_backends()]
    if "cpu" in bs:
        bs.insert(bs.index("cpu") + 1, "cpu-avx2")
    return bs


def _run(path, p, g, step, b1, b2, lr):
    """One fp32 AdamW step (params are their own masters, fp32 moments from 0) on one path."""
    state = [[p.clone()], [g.clone()], [torch.zeros_like(p)], [torch.zeros_like(p)], [], [],
             [torch.full((), float(step - 1), device=DEVICE)]]
    args = (*state, torch.tensor(1.0, device=DEVICE), torch.tensor(0.0, device=DEVICE), None,
            lr, b1, b2, 1e-8, 0.0, False, 0, False, 7, [0], [0])
    if path == "torch":
        call_adamw_op(_ops._reference_adamw_step_, *args)
    else:
        with kernel_path(path) as backend:
            call_adamw_op(partial(_ops.adamw_step_, backend), *args)
    return state[0][0].cpu()


def _expected(g, step, b1, b2, lr, pw):
    """p = 0 after one step from zero moments, in fp32 as math.h adamw_update (its fmas by the C library's
    fmaf), constants from pw."""
    ss = F32(lr / (1.0 - pw(b1, step)))
    ib = F32(1.0 / math.sqrt(1.0 - pw(b2, step)))
    g = g.numpy().astype(F32)
    m = fma_np(F32(1.0 - b1), g - F32(0), F32(0))
    v = fma_np(F32(1.0 - b2) * g, g, F32(0) * F32(b2))
    denom = fma_np(np.sqrt(v), ib, F32(1e-8))
    return torch.from_numpy(fma_np(F32(0), F32(1), -(ss * m / denom)))


@pytest.mark.parametrize("b1,b2,step,lr", [(0.9999999, 0.999, 1330, 1.0),   # fp32 step size differs
                                           (0.9, 0.9999999, 353, 1e-3)])    # fp32 1 / sqrt(bc2) differs
def test_kernels_use_pow_int(b1, b2, step, lr):
    lib_pow = (F32(lr / (1 - math.pow(b1, step))), F32(1 / math.sqrt(1 - math.pow(b2, step))))
    own_pow = (F32(lr / (1 - _pow_int(b1, step))), F32(1 / math.sqrt(1 - _pow_int(b2, step))))
    assert lib_pow != own_pow  # the case tells the two apart
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(1000, generator=gen) * 0.1
    want = _expected(g, step, b1, b2, lr, _pow_int)
    assert not torch.equal(want, _expected(g, step, b1, b2, lr, math.pow))
    p0 = torch.zeros(1000, device=DEVICE)
    for path in _paths():
        got = _run(path, p0, g.to(DEVICE), step, b1, b2, lr)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), path
