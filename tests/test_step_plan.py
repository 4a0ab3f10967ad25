"""How an unscale reaches the step: the step's factor is planned by one function (not posted on the
optimizer), the pending unscale is held by the optimizer's runtime (which copies carry), and the
public ``unscale_`` has no private arguments.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import mpkern
from mpkern import _fused_unscale
from mpkern.optim import step_plan


def _traced_opt(**kw):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 64).to(torch.bfloat16)) for _ in range(4)]
    opt = mpkern.FusedAdamWMP(params, lr=1e-3, master_weights="8bit", state_dtype="8bit", max_grad_norm=1.0, **kw)
    for p in params:
        p.grad = torch.randn_like(p)
    return opt, params


def test_unscale_has_no_private_arguments():
    assert not [n for n in inspect.signature(mpkern.unscale_).parameters if n.startswith("_")]


def test_plan_step_is_computed_not_posted():
    """The plan comes back from one function; nothing is left on the optimizer on the way."""
    g = torch.tensor([3.0, 4.0])
    stats = mpkern.optim.step_plan.stats_pass([g], [g], None)
    plan = step_plan.plan_step(None, max_norm=1.0, grad_scale=None, found_inf=None, device=g.device, stats=stats)
    # norm 5 (float64 reference), clip coefficient 1 / (5 + 1e-6)
    assert plan.norm.item() == pytest.approx(5.0, rel=1e-6)
    assert plan.factor.item() == pytest.approx(1.0 / (5.0 + 1e-6), rel=1e-6)
    assert plan.found_inf.item() == 0.0
    scale = torch.tensor(8.0)
    plan = step_plan.plan_step(None, max_norm=None, grad_scale=scale, found_inf=torch.tensor([1.0]), device=g.device,
                         stats=None)
    assert plan.factor.item() == 0.125 and plan.found_inf.item() == 1.0 and plan.norm is None
    # what unscale_ left, with the step's own max_grad_norm on top: the smaller coefficient wins
    one = torch.ones(())
    pend = _fused_unscale.Pending(torch.tensor(0.5), one, torch.zeros(()), torch.tensor(10.0), torch.tensor(10.0),
                                  False)
    plan = step_plan.plan_step(pend, max_norm=2.0, grad_scale=None, found_inf=None, device=g.device, stats=None)
    assert plan.factor.item() == pytest.approx(0.5 * 2.0 / (10.0 + 1e-6), rel=1e-6)
    assert plan.norm is pend.reported


def test_runtime_owns_the_state_and_survives_copies():
    import copy

    opt, params = _traced_opt()
    rt = opt.mpkern_runtime
    assert _fused_unscale.runtime(opt) is rt and _fused_unscale.fuses_unscale(opt)
    mpkern.unscale_(opt, 0.5)
    assert rt.pending is not None
    dup = copy.deepcopy(opt)
    assert dup.mpkern_runtime is not rt and dup.mpkern_runtime.pending is not None
    opt.step()
    assert rt.pending is None and opt.last_found_inf is not None
    assert not _fused_unscale.fuses_unscale(torch.optim.SGD(params, lr=0.1))
