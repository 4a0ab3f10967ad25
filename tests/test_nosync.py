"""unscale_ never synchronises with the host: no .item()/bool()/.cpu()/.tolist() on the hot path."""

from __future__ import annotations

import pytest
import torch

import mpkern
from conftest import DEVICE, requires_cuda


@pytest.fixture
def forbid_host_reads(monkeypatch):
    def boom(*_a, **_k):
        raise AssertionError("host synchronisation in the hot path")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    yield


def _params(n=5):
    ps = []
    for i in range(n):
        p = torch.nn.Parameter(torch.randn(100 + i, device=DEVICE, dtype=(torch.float32, torch.bfloat16)[i % 2]))
        p.grad = torch.randn_like(p)
        ps.append(p)
    return ps


def test_unscale_makes_no_host_reads(backend, forbid_host_reads):
    ps = _params()
    res = mpkern.unscale_(ps, torch.tensor(0.5, device=DEVICE), max_norm=1.0, per_tensor=True)
    assert res.found_inf.device.type == DEVICE.type


def test_unscale_with_scaler_makes_no_host_reads(backend):
    ps = _params()
    opt = torch.optim.SGD(ps, lr=0.1)
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=8.0)
    scaler.scale(torch.ones((), device=DEVICE))
    with pytest.MonkeyPatch.context() as mp:
        def boom(*_a, **_k):
            raise AssertionError("host synchronisation in the hot path")

        for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__"):
            mp.setattr(torch.Tensor, name, boom)
        mpkern.unscale_(opt, scaler=scaler, max_norm=1.0)


@requires_cuda
def test_cuda_sync_debug_mode():
    ps = _params()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mpkern.unscale_(ps, torch.tensor(0.5, device="cuda"), max_norm=1.0, per_tensor=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
