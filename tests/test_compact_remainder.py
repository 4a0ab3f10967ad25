"""The ``"remainder"`` master (bf16 param + int16 low half) and the compact masters' low bits: a remainder
checkpoint loads into fp32 masters exactly, in either load order and on exact ties; the remainders of
params that are views of one storage survive a write to another view (and stay finite when one is
zeroed); a move to channels_last keeps the low bits; a param turned fp16 in a remainder group is
refused before any update.

References are float64 computations written here (or bitwise facts: a step at lr 0 must change
nothing), never numbers produced by the code under test.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from conftest import DEVICE
from mpkern import FusedAdamWMP


def _remainder_run(seed: int, shape: tuple[int, int], steps: int):
    """A bf16 Linear stepped ``steps`` times with master_weights="remainder" (random grads)."""
    torch.manual_seed(seed)
    src = torch.nn.Linear(*shape).to(DEVICE).to(torch.bfloat16)
    opt = FusedAdamWMP(src.parameters(), lr=1e-2, master_weights="remainder")
    for _ in range(steps):
        for p in src.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    return src, opt


def _load_into_fp32_master(shape: tuple[int, int], model_sd, opt_sd, optimizer_first: bool) -> FusedAdamWMP:
    """A fresh bf16 Linear + FusedAdamWMP(master_weights=True) loaded from the two state dicts in
    the given order; returns the optimizer."""
    dst = torch.nn.Linear(*shape).to(DEVICE).to(torch.bfloat16)
    new = FusedAdamWMP(dst.parameters(), lr=1e-2, master_weights=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "converted" (layout differs)
        if optimizer_first:
            new.load_state_dict(opt_sd)
            dst.load_state_dict(model_sd)
        else:
            dst.load_state_dict(model_sd)
            new.load_state_dict(opt_sd)
    return new


# ---- a remainder checkpoint into master_weights=True, either load order --------------------------
@pytest.mark.parametrize("optimizer_first", [True, False])
def test_remainder_checkpoint_to_fp32_master_any_order(backend, optimizer_first):
    src, opt = _remainder_run(7, (40, 104), 3)
    model_sd = {k: v.clone() for k, v in src.state_dict().items()}
    opt_sd = opt.state_dict()
    # the exact fp32 masters, rebuilt here from the bits (bf16 high half + int16 low half)
    want = []
    for p in src.parameters():
        hi = p.detach().view(torch.int16).to(torch.int64) & 0xFFFF
        lo = opt.state[p]["master_remainder"].to(torch.int64)
        want.append(((hi << 16) + lo).to(torch.int32).view(torch.float32))
    torch.manual_seed(8)
    new = _load_into_fp32_master((40, 104), model_sd, opt_sd, optimizer_first)
    for m, w in zip(new.master_params(), want):
        assert torch.equal(m, w)


@pytest.mark.parametrize("optimizer_first", [True, False])
def test_remainder_ties_convert_the_same_in_either_order(backend, optimizer_first):
    src, opt = _remainder_run(42, (16, 8), 1)
    w = src.weight
    opt.state[w]["master_remainder"][:, :4] = -32768  # exact ties: the bf16 half was rounded away from zero
    hi = w.detach().view(torch.int16).to(torch.int64) & 0xFFFF
    want = ((hi << 16) + opt.state[w]["master_remainder"].to(torch.int64)).to(torch.int32).view(torch.float32)
    model_sd, opt_sd = {k: v.clone() for k, v in src.state_dict().items()}, copy.deepcopy(opt.state_dict())
    new = _load_into_fp32_master((16, 8), model_sd, opt_sd, optimizer_first)
    assert torch.equal(new.master_params()[0], want)


def test_master_params_between_optimizer_and_model_load_keeps_the_conversion(backend):
    src, opt = _remainder_run(43, (24, 16), 2)
    want = [m.clone() for m in opt.master_params()]
    model_sd, opt_sd = {k: v.clone() for k, v in src.state_dict().items()}, copy.deepcopy(opt.state_dict())
    dst = torch.nn.Linear(24, 16).to(DEVICE).to(torch.bfloat16)
    new = FusedAdamWMP(dst.parameters(), lr=1e-2, master_weights=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        new.load_state_dict(opt_sd)
    new.master_params()  # e.g. an EMA initialised right after the optimizer load
    dst.load_state_dict(model_sd)
    for a, b in zip(new.master_params(), want):
        assert torch.equal(a, b)


# ---- remainders of params that share one storage -------------------------------------------------
def test_remainder_of_views_survives_a_write_to_another_view(backend):
    torch.manual_seed(14)
    flat = torch.randn(64 + 96, device=DEVICE).to(torch.bfloat16)
    a, b = torch.nn.Parameter(flat[:64]), torch.nn.Parameter(flat[64:])
    opt = FusedAdamWMP([a, b], lr=1e-3, weight_decay=0.0, master_weights="remainder")
    for _ in range(3):
        a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
        opt.step()
    want_b = opt.master_params()[1].clone()
    assert torch.count_nonzero(opt.state[b]["master_remainder"]) > 0
    with torch.no_grad():
        a.fill_(0.5)  # bumps the version counter that a and b share
    assert torch.equal(opt.master_params()[1], want_b)  # b's fp32 low bits are kept
    assert (opt.master_params()[0] - 0.5).abs().max() <= 2.0**-9  # a: the written value, within half a bf16 ulp


def test_kept_remainder_of_a_zeroed_view_is_not_nan(backend):
    torch.manual_seed(40)
    buf = torch.randn(64, device=DEVICE).to(torch.bfloat16)
    a, b = torch.nn.Parameter(buf[:32]), torch.nn.Parameter(buf[32:])
    opt = FusedAdamWMP([a, b], lr=1e-3, master_weights="remainder")
    for _ in range(3):
        a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
        opt.step()
    with torch.no_grad():
        a.zero_()  # a view of a shared buffer: its remainders are kept -- but not below +-0
    m = opt.master_params()[0]
    assert torch.isfinite(m).all() and (m.abs() <= 2.0**-133).all()


# ---- layout and dtype changes --------------------------------------------------------------------
@pytest.mark.parametrize("master", ["remainder", "8bit"])
def test_a_move_to_channels_last_keeps_the_low_bits(backend, master):
    torch.manual_seed(41)
    conv = torch.nn.Conv2d(4, 8, 3).to(DEVICE).to(torch.bfloat16)
    opt = FusedAdamWMP(conv.parameters(), lr=1e-2, master_weights=master)
    for _ in range(3):
        for p in conv.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    before = [m.clone() for m in opt.master_params()]
    conv.to(memory_format=torch.channels_last)
    for a, b in zip(opt.master_params(), before):
        assert torch.equal(a, b)


def test_param_turned_fp16_in_a_remainder_group_is_an_error_before_any_update(backend):
    a = torch.nn.Parameter(torch.randn(8, device=DEVICE).to(torch.bfloat16))
    b = torch.nn.Parameter(torch.randn(8, device=DEVICE).to(torch.bfloat16))
    opt = FusedAdamWMP([{"params": [a]}, {"params": [b], "master_weights": "remainder"}], lr=1e-2)
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    opt.step()
    b.data = b.data.half()
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    a0 = a.detach().clone()
    with pytest.raises(ValueError, match="remainder"):
        opt.step()
    assert torch.equal(a, a0)
