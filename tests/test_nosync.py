"""The hot path never synchronises with the host.

* no .item()/bool()/.cpu()/.tolist() on device tensors in unscale_ or FusedAdamWMP.step, on every
  backend, with a float or tensor inv_scale and a float or tensor lr;
* no ``torch.tensor(x, device=...)`` (a blocking host-to-device copy from pageable memory) there;
* on CUDA, the same under ``torch.cuda.set_sync_debug_mode("error")`` -- including a CPU-tensor
  lr for a CUDA optimizer and a disabled GradScaler.
"""

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


@pytest.fixture
def forbid_host_to_device_tensor(monkeypatch):
    """torch.tensor / torch.as_tensor with a device: on CUDA a blocking copy from pageable memory."""
    real = torch.tensor

    def checked(*args, **kwargs):
        if kwargs.get("device") is not None:
            raise AssertionError("torch.tensor(..., device=...) in the hot path: a blocking host-to-device copy")
        return real(*args, **kwargs)

    real_as = torch.as_tensor

    def checked_as(*args, **kwargs):
        if kwargs.get("device") is not None:
            raise AssertionError("torch.as_tensor(..., device=...) in the hot path: a blocking host-to-device copy")
        return real_as(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", checked)
    monkeypatch.setattr(torch, "as_tensor", checked_as)
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


def _steps(ps, lr):
    """The hot paths: unscale_ with a float inv_scale, clip_grad_norm_, steps with clipping."""
    mpkern.unscale_(ps, 0.5, max_norm=1.0)
    opt = mpkern.FusedAdamWMP(ps, lr=lr, max_grad_norm=1.0)
    opt.clip_grad_norm_(1.0)
    opt.step()
    opt.step()
    return opt


@pytest.mark.parametrize("lr", ["float", "tensor"])
def test_float_scalars_make_no_host_reads_or_copies(backend, lr, forbid_host_to_device_tensor):
    ps = _params()
    lr_value = 1e-3 if lr == "float" else torch.full((), 1e-3, device=DEVICE)
    _steps(ps, lr_value)  # warm-up: builds state and work tables
    with pytest.MonkeyPatch.context() as mp:
        def boom(*_a, **_k):
            raise AssertionError("host synchronisation in the hot path")

        for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__"):
            mp.setattr(torch.Tensor, name, boom)
        _steps(ps, lr_value)


@requires_cuda
@pytest.mark.parametrize("lr", ["float", "cuda tensor", "cpu tensor"])
def test_cuda_sync_debug_mode_optimizer(lr):
    ps = _params()
    lr_value = {"float": 1e-3, "cuda tensor": torch.full((), 1e-3, device="cuda"),
                "cpu tensor": torch.tensor(1e-3)}[lr]
    _steps(ps, lr_value)  # warm-up
    scaler_off = torch.amp.GradScaler("cuda", enabled=False)
    opt = mpkern.FusedAdamWMP(ps, lr=lr_value)
    opt.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _steps(ps, lr_value)
        mpkern.unscale_(opt, scaler=scaler_off, max_norm=1.0)
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
