"""GradScaler and gradient clipping around ``FusedAdamWMP``: an overflow only ``main_grad`` holds skips
the step and backs the scale off, torch's ``scaler.unscale_`` over ``main_grad`` is refused, and every
clip that was asked for applies (the optimizer's ``max_grad_norm`` and a pending unscale's factor
both; ``clip_grad_norm_`` after an unscale sees the unscaled gradients).

References are float64 computations written here (or bitwise facts: a step at lr 0 must change
nothing), never numbers produced by the code under test.
"""

from __future__ import annotations

import pytest
import torch

import mpkern
from conftest import DEVICE
from mpkern import FusedAdamWMP

B1 = 0.9


# ---- GradScaler and an overflow in main_grad -----------------------------------------------------
def _scaled_setup(max_grad_norm=None, dtype=torch.float16):
    torch.manual_seed(4)
    lin = torch.nn.Linear(8, 4, bias=True).to(DEVICE).to(dtype)
    opt = FusedAdamWMP(lin.parameters(), lr=1e-2, max_grad_norm=max_grad_norm)
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=2.0**10)
    scaler.scale(torch.ones((), device=DEVICE))  # creates the scale
    return lin, opt, scaler


@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_scaler_step_sees_main_grad_overflow(backend, max_grad_norm):
    lin, opt, scaler = _scaled_setup(max_grad_norm)
    opt.attach_grad_scaler(scaler)  # the protocol that lets the step record a main_grad overflow (issue 19)
    for p in lin.parameters():  # warm-up step: state exists
        p.grad = torch.randn_like(p)
    scaler.step(opt)
    scaler.update()
    before = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in lin.parameters()}
    params = [p.detach().clone() for p in lin.parameters()]
    lin.weight.grad = None
    lin.weight.main_grad = torch.randn(lin.weight.shape, device=DEVICE)
    lin.weight.main_grad[1, 2] = float("inf")
    lin.bias.grad = torch.randn_like(lin.bias)  # finite: GradScaler's own check finds nothing
    scale = float(scaler.get_scale())
    scaler.step(opt)
    scaler.update()
    assert float(scaler.get_scale()) == scale * 0.5  # backed off
    for p, p0 in zip(lin.parameters(), params):
        assert torch.equal(p, p0)
        for k, v in before[id(p)].items():
            assert torch.equal(opt.state[p][k], v)


def test_torch_scaler_unscale_with_main_grad_is_an_error(backend):
    lin, opt, scaler = _scaled_setup(dtype=torch.bfloat16)  # torch's unscale_ refuses fp16 grads
    lin.weight.main_grad = torch.randn(lin.weight.shape, device=DEVICE)
    lin.bias.grad = torch.randn_like(lin.bias)
    scaler.unscale_(opt)  # unscales .grad only: main_grad would be stepped at 1024x
    with pytest.raises(ValueError, match=r"mpkern\.unscale_"):
        scaler.step(opt)


# ---- every clip applies --------------------------------------------------------------------------
def _clip_case(seed: int):
    torch.manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(300, device=DEVICE).to(torch.bfloat16))
    g = (torch.randn(300, device=DEVICE) * 20).to(torch.bfloat16)
    return p, g


@pytest.mark.parametrize("how", ["unscale_scaler", "unscale_inv", "clip_method_larger", "clip_method_smaller"])
def test_max_grad_norm_and_pending_factor_both_apply(backend, how):
    p, g = _clip_case(5)
    scale = 2.0**8
    opt = FusedAdamWMP([p], lr=1e-3, max_grad_norm=1.0)
    p.grad = g
    g64 = g.double()
    if how == "unscale_scaler":
        scaler = torch.amp.GradScaler(DEVICE.type, init_scale=scale)
        scaler.scale(torch.ones((), device=DEVICE))
        p.grad = (g64 * scale).to(torch.bfloat16)
        mpkern.unscale_(opt, scaler=scaler)  # no max_norm: the optimizer's own threshold must still apply
        scaler.step(opt)
        want_coef = min(1.0, 1.0 / (float(g64.norm()) + 1e-6))
    elif how == "unscale_inv":
        p.grad = (g64 * scale).to(torch.bfloat16)
        mpkern.unscale_(opt, 1 / scale, max_norm=5.0)
        opt.step()
        want_coef = min(1.0, 1.0 / (float(g64.norm()) + 1e-6))
    else:
        thr = 5.0 if how == "clip_method_larger" else 0.25
        norm = opt.clip_grad_norm_(thr)
        assert float(norm) == pytest.approx(float(g64.norm()), rel=1e-3)
        opt.step()
        want_coef = min(1.0, min(thr, 1.0) / (float(g64.norm()) + 1e-6))
    torch.testing.assert_close(opt.state[p]["exp_avg"].double(), (1 - B1) * g64 * want_coef, rtol=2e-3, atol=1e-7)


def test_clip_grad_norm_after_scaler_unscale_sees_unscaled_grads(backend):
    p, g = _clip_case(6)
    scale = 2.0**8
    opt = FusedAdamWMP([p], lr=1e-3)
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=scale)
    scaler.scale(torch.ones((), device=DEVICE))
    p.grad = (g.double() * scale).to(torch.bfloat16)
    mpkern.unscale_(opt, scaler=scaler)
    norm = opt.clip_grad_norm_(1.0)  # used to replace the pending unscale with factor 1: grads 256x
    assert float(norm) == pytest.approx(float(g.double().norm()), rel=1e-3)
    scaler.step(opt)
    coef = 1.0 / (float(g.double().norm()) + 1e-6)
    torch.testing.assert_close(opt.state[p]["exp_avg"].double(), (1 - B1) * g.double() * coef, rtol=2e-3,
                               atol=1e-7)
