"""Parameters changed between steps: writes through ``.data``, a move to channels_last, the model cast to
another dtype, a parameter of another shape -- each seen by the next step, or refused before anything
is stepped.

References are float64 computations written here (or bitwise facts: a step at lr 0 must change
nothing), never numbers produced by the code under test.
"""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE
from mpkern import FusedAdamWMP

B1, B2, EPS = 0.9, 0.999, 1e-8


# ---- writes through .data ------------------------------------------------------------------------
def _bf16_step_model(seed: int, master=True):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(8, 4).to(DEVICE).to(torch.bfloat16)
    opt = FusedAdamWMP(lin.parameters(), lr=1e-2, weight_decay=0.0, master_weights=master)
    for p in lin.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return lin, opt


@pytest.mark.parametrize("master", [True, "remainder"])
def test_data_assignment_is_seen(backend, master):
    lin, opt = _bf16_step_model(0, master)
    new = torch.full_like(lin.weight, 3.0)
    lin.weight.data = new  # no version bump: only the data pointer tells
    g = torch.randn_like(lin.weight)
    lin.weight.grad = g
    lin.bias.grad = torch.randn_like(lin.bias)
    st = opt.state[lin.weight]
    m0, v0 = st["exp_avg"].double(), st["exp_avg_sq"].double()
    opt.step()
    m = B1 * m0 + (1 - B1) * g.double()
    v = B2 * v0 + (1 - B2) * g.double() ** 2
    want = 3.0 - 1e-2 * (m / (1 - B1**2)) / ((v / (1 - B2**2)).sqrt() + EPS)
    torch.testing.assert_close(opt.master_params()[0].double(), want, rtol=0, atol=1e-5)


def test_data_inplace_write_needs_resync(backend):
    # writes through a .data alias bypass every counter PyTorch keeps; resync_masters() is the way
    lin, opt = _bf16_step_model(1)
    lin.weight.data.fill_(3.0)
    opt.resync_masters()
    assert torch.equal(opt.master_params()[0], torch.full_like(opt.master_params()[0], 3.0))
    lin.weight.grad = torch.randn_like(lin.weight)
    opt.step()
    assert (opt.master_params()[0] - 3.0).abs().max() < 0.05  # one lr-sized step from 3, not the old master


# ---- layout, dtype and shape changes after the first step ----------------------------------------
def test_channels_last_after_first_step_changes_nothing_at_lr0(backend):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 8, 3).to(DEVICE).to(torch.bfloat16)
    opt = FusedAdamWMP(conv.parameters(), lr=1e-2, weight_decay=0.0)
    for p in conv.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    conv.to(memory_format=torch.channels_last)
    assert not conv.weight.is_contiguous()
    before = conv.weight.detach().clone()
    master = opt.state[conv.weight]["master_param"].clone()
    for group in opt.param_groups:
        group["lr"] = 0.0
    for p in conv.parameters():
        p.grad = torch.randn_like(p).contiguous(memory_format=torch.channels_last) if p.dim() == 4 else \
            torch.randn_like(p)
    opt.step()
    assert torch.equal(conv.weight, before)
    assert torch.equal(opt.state[conv.weight]["master_param"], master)


def test_model_to_bf16_after_fp32_steps(backend):
    torch.manual_seed(1)
    lin = torch.nn.Linear(8, 4).to(DEVICE)
    opt = FusedAdamWMP(lin.parameters(), lr=1e-2, weight_decay=0.0)
    for p in lin.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    lin.to(torch.bfloat16)  # was a bare KeyError: 'master_param'
    for p in lin.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    st = opt.state[lin.weight]
    assert st["master_param"].dtype == torch.float32
    assert torch.equal(lin.weight, st["master_param"].to(torch.bfloat16))


def test_model_float_after_bf16_steps_gets_the_masters_back(backend):
    lin, opt = _bf16_step_model(2)
    masters = [m.clone() for m in opt.master_params()]
    lin.float()
    for p, m in zip(lin.parameters(), masters):
        assert not torch.equal(p, m)  # p.float() of bf16: the low bits are gone ...
    for p in lin.parameters():
        p.grad = torch.zeros_like(p)
    for group in opt.param_groups:
        group["lr"] = 0.0
    opt.step()
    for p, m in zip(lin.parameters(), masters):
        assert torch.equal(p, m)  # ... and the optimizer's masters put them back


def test_shape_change_is_a_clear_error_and_nothing_is_stepped(backend):
    torch.manual_seed(3)
    a, b = torch.nn.Linear(4, 4).to(DEVICE), torch.nn.Linear(4, 4).to(DEVICE)
    opt = FusedAdamWMP([{"params": a.parameters()}, {"params": b.parameters(), "lr": 1e-3}], lr=1e-2)
    for p in [*a.parameters(), *b.parameters()]:
        p.grad = torch.randn_like(p)
    opt.step()
    b.weight.data = torch.randn(5, 4, device=DEVICE)
    b.weight.grad = torch.randn(5, 4, device=DEVICE)
    snap = [p.detach().clone() for p in a.parameters()]
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in a.parameters()]
    with pytest.raises(ValueError, match="shape"):
        opt.step()
    # group 0 comes first and must not have been stepped (no half-taken step)
    for p, s, st in zip(a.parameters(), snap, state):
        assert torch.equal(p, s)
        for k, v in st.items():
            assert torch.equal(opt.state[p][k], v)
