"""mpkern.unscale_(opt, scaler=...) behaves exactly like scaler.unscale_ + clip_grad_norm_."""

from __future__ import annotations

import copy

import pytest
import torch

import mpkern
from conftest import DEVICE


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(DEVICE)


def _run(model, use_mpkern, steps, overflow_at, max_norm=1.0):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=2.0**10, growth_interval=2)
    g = torch.Generator().manual_seed(123)
    norms, scales = [], []
    for step in range(steps):
        x = torch.randn(8, 16, generator=g).to(DEVICE)
        y = torch.randn(8, 4, generator=g).to(DEVICE)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        if step in overflow_at:
            model[0].weight.grad[0, 0] = float("inf")
        if use_mpkern:
            res = mpkern.unscale_(opt, scaler=scaler, max_norm=max_norm)
            norms.append(float(res.total_norm))
        else:
            scaler.unscale_(opt)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        scaler.step(opt)
        scaler.update()
        scales.append(float(scaler.get_scale()))
    return norms, scales


@pytest.mark.parametrize("overflow_at", [(), (2,), (0, 3, 4)])
def test_gradscaler_recipe_equivalence(backend, overflow_at):
    base = _model(0)
    m_ref, m_ours = copy.deepcopy(base), copy.deepcopy(base)
    params_before = [p.detach().clone() for p in base.parameters()]
    n_ref, s_ref = _run(m_ref, False, 6, overflow_at)
    n_ours, s_ours = _run(m_ours, True, 6, overflow_at)
    assert s_ours == s_ref  # same growth and back-off decisions
    for a, b in zip(n_ours, n_ref):
        if b == b and abs(b) != float("inf"):
            assert a == pytest.approx(b, rel=1e-5)
        else:
            assert not (abs(a) < float("inf"))  # both non-finite on overflow steps
    for p, q in zip(m_ours.parameters(), m_ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    if overflow_at == (0, 3, 4):
        # the skipped steps changed nothing: the model did move on the other steps only
        assert any(not torch.equal(p, q) for p, q in zip(m_ours.parameters(), params_before))


def test_overflow_skips_step_and_backs_off(backend):
    model = _model(1)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=2.0**8)
    loss = model(torch.randn(4, 16, device=DEVICE)).sum()
    scaler.scale(loss).backward()
    model[2].bias.grad[1] = float("nan")
    res = mpkern.unscale_(opt, scaler=scaler, max_norm=1.0)
    assert float(res.found_inf) == 1.0 and float(res.clip_coef) == 1.0
    scaler.step(opt)
    scaler.update()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    assert scaler.get_scale() == 2.0**7
    with pytest.raises(RuntimeError, match="after step"):
        scaler.scale(loss)  # fresh iteration is fine ...
        opt2_state = scaler._per_optimizer_states[id(opt)]
        opt2_state["stage"] = torch.amp.grad_scaler.OptState.STEPPED
        mpkern.unscale_(opt, scaler=scaler)


def test_double_unscale_rejected():
    model = _model(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=4.0)
    scaler.scale(model(torch.randn(2, 16, device=DEVICE)).sum()).backward()
    mpkern.unscale_(opt, scaler=scaler)
    with pytest.raises(RuntimeError, match="already been called"):
        mpkern.unscale_(opt, scaler=scaler)


def test_disabled_scaler_means_inv_scale_one():
    model = _model(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(DEVICE.type, enabled=False)
    model(torch.randn(2, 16, device=DEVICE)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    res = mpkern.unscale_(opt, scaler=scaler)
    expected = torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads]))
    assert float(res.total_norm) == pytest.approx(float(expected), rel=1e-5)
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g)
