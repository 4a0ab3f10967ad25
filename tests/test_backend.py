"""Backend discovery, forcing, info() and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import mpkern
from conftest import DEVICE
from mpkern import _backend


def test_info_reports_every_backend_with_a_reason():
    data = mpkern.info()
    assert set(data["backends"]) == {"cuda", "triton", "cpu", "torch"}
    for st in data["backends"].values():
        assert isinstance(st["available"], bool) and st["reason"]
    assert data["backends"]["torch"]["available"]
    assert data["version"] == mpkern.__version__
    if not torch.cuda.is_available():
        assert not data["backends"]["cuda"]["available"]
        assert data["capability"] is None


def test_bf16_supported():
    assert mpkern.bf16_supported("cpu") is True
    if not torch.cuda.is_available():
        assert mpkern.bf16_supported("cuda") is False
    else:
        assert mpkern.bf16_supported() == (torch.cuda.get_device_capability()[0] >= 8)


def test_forced_backend_unknown(monkeypatch):
    monkeypatch.setenv("MPKERN_BACKEND", "opencl")
    with pytest.raises(ValueError, match="not a backend"):
        _backend.select("cpu")


def test_forced_backend_wrong_device_is_clear(monkeypatch):
    monkeypatch.setenv("MPKERN_BACKEND", "cuda")
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match="MPKERN_BACKEND=cuda cannot run on cpu"):
        mpkern.unscale_([p], 0.5)
    assert torch.equal(p.grad, torch.ones(3))  # untouched


def test_default_selection():
    b = _backend.select(DEVICE)
    if DEVICE.type == "cpu":
        assert b == ("cpu" if _backend.native() is not None else "torch")
    else:
        assert b in ("cuda", "triton", "torch")


def test_cli_info_json():
    out = subprocess.run([sys.executable, "-m", "mpkern", "info", "--json"], capture_output=True, text=True,
                         check=True)
    data = json.loads(out.stdout)
    assert set(data["backends"]) == {"cuda", "triton", "cpu", "torch"}


def test_cli_info_text():
    out = subprocess.run([sys.executable, "-m", "mpkern", "info"], capture_output=True, text=True, check=True)
    assert "backends:" in out.stdout and "torch" in out.stdout
