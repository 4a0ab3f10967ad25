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


def test_use_backend_forces_and_restores(monkeypatch):
    monkeypatch.delenv("MPKERN_BACKEND", raising=False)
    auto = _backend.select("cpu")
    with mpkern.use_backend("torch"):
        assert _backend.select("cpu") == "torch" and _backend.forced() == "torch"
        with mpkern.use_backend(None):  # the automatic choice inside a forced block
            assert _backend.forced() is None and _backend.select("cpu") == auto
        assert _backend.forced() == "torch"
    assert _backend.forced() is None and _backend.select("cpu") == auto
    monkeypatch.setenv("MPKERN_BACKEND", "torch")
    with pytest.raises(KeyError), mpkern.use_backend("cpu" if auto == "cpu" else "torch"):
        raise KeyError("the block fails")
    assert _backend.forced() == "torch"  # the user's setting is back, also after an exception


def test_use_backend_runs_the_ops_on_it(monkeypatch):
    monkeypatch.delenv("MPKERN_BACKEND", raising=False)
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 4.0)
    # the cuda backend cannot run on CPU tensors (on any machine): the op says why
    with mpkern.use_backend("cuda"), pytest.raises(RuntimeError, match="cannot run on"):
        mpkern.unscale_([p], 0.5)
    assert torch.equal(p.grad, torch.full((3,), 4.0))  # refused before anything changed
    with mpkern.use_backend("torch"):
        res = mpkern.unscale_([p], 0.5)
    assert torch.equal(p.grad, torch.full((3,), 2.0)) and float(res.total_norm) == pytest.approx(12.0 ** 0.5)


@pytest.mark.parametrize("bad,err,match", [("opencl", ValueError, "'opencl' is not a backend"),
                                           ("gpu", ValueError, "expected one of cuda, triton, cpu, torch"),
                                           (3, TypeError, "name must be a str or None, got int")])
def test_use_backend_refuses_bad_names_before_changing_anything(monkeypatch, bad, err, match):
    monkeypatch.setenv("MPKERN_BACKEND", "torch")
    with pytest.raises(err, match=match):
        mpkern.use_backend(bad)  # refused by the call itself, not only on entering the block
    assert _backend.forced() == "torch"


def test_use_backend_reads_a_name_like_the_environment_variable(monkeypatch):
    monkeypatch.delenv("MPKERN_BACKEND", raising=False)
    with mpkern.use_backend(" Torch "):
        assert _backend.forced() == "torch" and _backend.select("cpu") == "torch"


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
