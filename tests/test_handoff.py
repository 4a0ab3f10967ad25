"""The GradScaler protocol without stack inspection, and the process-group tokens of pickled optimizers.

An overflow that only ``main_grad`` holds (GradScaler reads ``.grad``) must skip the step and back
off the scale. The optimizer finds the scaler because it was attached -- by
``mpkern.unscale_(opt, scaler=scaler)`` or ``opt.attach_grad_scaler(scaler)`` -- and says so with a
warning when none is.
"""

from __future__ import annotations

import gc
import pathlib
import re
import warnings

import pytest
import torch

import mpkern
from mpkern import FusedAdamWMP
from mpkern.optim import checkpoint


def _setup():
    torch.manual_seed(4)
    lin = torch.nn.Linear(8, 4).to(torch.float16)
    opt = FusedAdamWMP(lin.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scaler.scale(torch.ones(()))  # creates the scale
    for p in lin.parameters():  # warm-up step: state exists
        p.grad = torch.randn_like(p)
    scaler.step(opt)
    scaler.update()
    return lin, opt, scaler


def _overflow_in_main_grad(lin):
    lin.weight.grad = None
    lin.weight.main_grad = torch.randn(lin.weight.shape)
    lin.weight.main_grad[0, 0] = float("inf")
    lin.bias.grad = torch.randn_like(lin.bias)  # finite: GradScaler's own check finds nothing


def _snapshot(lin, opt):
    return [(p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}) for p in lin.parameters()]


def _unchanged(lin, opt, snap):
    return all(torch.equal(p, p0) and all(torch.equal(opt.state[p][k], v) for k, v in st.items())
               for p, (p0, st) in zip(lin.parameters(), snap))


def test_without_an_attached_scaler_the_step_skips_and_warns():
    lin, opt, scaler = _setup()
    snap = _snapshot(lin, opt)
    _overflow_in_main_grad(lin)
    scale = float(scaler.get_scale())
    with pytest.warns(UserWarning, match="attach_grad_scaler"):
        scaler.step(opt)
    scaler.update()
    assert _unchanged(lin, opt, snap)
    assert float(opt.last_found_inf) == 1.0
    assert float(scaler.get_scale()) == scale  # it could not tell the scaler: said by the warning


def test_unscale_with_scaler_attaches_it_for_later_plain_steps():
    lin, opt, scaler = _setup()
    for p in lin.parameters():
        p.grad = torch.randn_like(p)
    mpkern.unscale_(opt, scaler=scaler)  # attaches the scaler (weakly)
    scaler.step(opt)
    scaler.update()
    snap = _snapshot(lin, opt)
    _overflow_in_main_grad(lin)
    scale = float(scaler.get_scale())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler.step(opt)
    scaler.update()
    assert _unchanged(lin, opt, snap)
    assert float(scaler.get_scale()) == scale * 0.5


def test_attached_scaler_is_held_weakly():
    lin, opt, scaler = _setup()
    opt.attach_grad_scaler(scaler)
    other = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    other.scale(torch.ones(()))
    del scaler
    gc.collect()
    _overflow_in_main_grad(lin)
    with pytest.warns(UserWarning, match="none is attached"):
        other.step(opt)
    with pytest.raises(TypeError, match="GradScaler"):
        opt.attach_grad_scaler(object())


def test_no_stack_frame_inspection_in_mpkern():
    root = pathlib.Path(mpkern.__file__).parent
    pattern = re.compile(r"_getframe|inspect\.stack|currentframe|\.f_back|f_locals")
    hits = [str(f) for f in root.rglob("*.py") if pattern.search(f.read_text())]
    assert hits == []


class _Group:
    """A stand-in for a process group (anything weakly referenceable)."""


def test_process_group_tokens_are_released_and_never_reused():
    a, b = _Group(), _Group()
    ta, tb = checkpoint.group_token(a), checkpoint.group_token(b)
    assert ta != tb and checkpoint.group_token(a) == ta
    assert checkpoint.group_of_token(ta) is a
    del a
    gc.collect()
    with pytest.raises(RuntimeError, match="process_group"):
        checkpoint.group_of_token(ta)  # released with its group
    c = _Group()
    assert checkpoint.group_token(c) not in (ta, tb)  # a new group never gets an old token
    with pytest.raises(RuntimeError, match="process_group"):
        checkpoint.group_of_token("another-process:0")
