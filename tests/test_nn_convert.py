"""Layers converted by ``mpkern.nn.convert``: ``fp32_main_grad`` kept under autocast over bf16 weights, a
one-time warning (and a plain ``.grad``) over fp32 weights, and what the report says of a layer it
cannot convert (transformers' ``Conv1D``).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import mpkern
from conftest import DEVICE


def test_autocast_over_bf16_weights_keeps_main_grad():
    torch.manual_seed(15)
    lin = mpkern.nn.convert(torch.nn.Linear(8, 4).to(DEVICE).to(torch.bfloat16), fp32_main_grad=True)
    x = torch.randn(6, 8, device=DEVICE)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert lin.weight.grad is None and lin.weight.main_grad is not None
    want = torch.ones(6, 4, dtype=torch.float64).t() @ x.to(torch.bfloat16).double()  # dW = dY^T X
    torch.testing.assert_close(lin.weight.main_grad.double(), want, rtol=1e-5, atol=1e-5)


def test_main_grad_layer_over_fp32_weights_warns_once():
    lin = mpkern.nn.convert(torch.nn.Linear(8, 4).to(DEVICE), fp32_main_grad=True)
    x = torch.randn(3, 8, device=DEVICE)
    with pytest.warns(UserWarning, match="not main_grad"), torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        lin(x).float().sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            lin(x)
    assert lin.weight.grad is not None and getattr(lin.weight, "main_grad", None) is None


def test_convert_reports_transformers_conv1d():
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Conv1D(8, 4))
    _, rep = mpkern.nn.convert(model, report=True)
    assert rep.converted == ["0"] and "Conv1D" in rep.skipped["1"]
