"""mpkern.unscale_(opt, scaler=...) behaves exactly like scaler.unscale_ + clip_grad_norm_."""

from __future__ import annotations

import copy
import re

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


# ---- the GradScaler layout mpkern relies on (issue 29, item 6) -----------------------------------
def test_grad_scaler_layout_mpkern_relies_on():
    """Pins what ``mpkern._scaler_internals.scaler_internals`` reads of GradScaler's private layout, checked against
    GradScaler's public behaviour: a torch upgrade that changes it fails here, not in a training run."""
    from torch.amp.grad_scaler import OptState

    from mpkern._scaler_internals import record_found_inf, scaler_internals

    assert {"READY", "UNSCALED", "STEPPED"} <= {s.name for s in OptState}
    model = _model(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=2.0**6, growth_interval=1000)

    fresh = scaler_internals(scaler)
    assert fresh.scale is None and fresh.init_scale == 64.0 and fresh.optimizer_state is None
    with pytest.raises(AssertionError, match="unscale_"):  # GradScaler's own check, naming the caller
        scaler_internals(scaler, needs_scale="unscale_")

    scaler.scale(model(torch.randn(4, 16, device=DEVICE)).sum()).backward()
    live = scaler_internals(scaler, opt, needs_scale="unscale_")
    assert live.scale.numel() == 1 and live.scale.dtype == torch.float32 and live.scale.device.type == DEVICE.type
    assert float(live.scale) == scaler.get_scale() == 64.0
    assert live.optimizer_state == {"stage": OptState.READY, "found_inf_per_device": {}}

    scaler.unscale_(opt)  # GradScaler fills the record it keeps for opt: the same dict
    rec = scaler_internals(scaler, opt).optimizer_state
    assert rec is live.optimizer_state and rec["stage"] is OptState.UNSCALED
    ((dev, flag),) = rec["found_inf_per_device"].items()
    assert dev == live.scale.device and flag.dtype == torch.float32 and float(flag) == 0.0

    # what mpkern writes there is what GradScaler's step and update act on: an overflow recorded
    # for opt skips its step and backs the scale off
    before = [p.detach().clone() for p in model.parameters()]
    record_found_inf(scaler, opt, torch.ones((), device=DEVICE), unscaled=True)
    scaler.step(opt)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert scaler_internals(scaler, opt).optimizer_state["stage"] is OptState.STEPPED
    scaler.update()
    assert scaler.get_scale() == 32.0 and float(scaler_internals(scaler).scale) == 32.0
    assert scaler_internals(scaler, opt).optimizer_state["stage"] is OptState.READY  # records reset by update()


def test_grad_scaler_layout_change_is_a_clear_error():
    """A GradScaler without the attributes mpkern reads: a RuntimeError naming the torch version, no AttributeError
    from deep inside a step."""
    from mpkern._scaler_internals import scaler_internals

    class Changed(torch.amp.GradScaler):
        def __init__(self):
            super().__init__(DEVICE.type)
            del self._per_optimizer_states  # as if torch had renamed it

    with pytest.raises(RuntimeError, match=re.escape(f"torch {torch.__version__}") + ".*_per_optimizer_states"):
        scaler_internals(Changed(), object())


def test_grad_scaler_privates_are_touched_in_one_function():
    """Every attribute access to a private name of GradScaler anywhere in mpkern/ is inside
    ``mpkern._scaler_internals.scaler_internals`` (parsed with ``ast``, nothing imported)."""
    import ast
    import pathlib

    scaler = torch.amp.GradScaler(DEVICE.type)
    privates = {n for n in set(dir(type(scaler))) | set(vars(scaler)) if n.startswith("_") and not n.startswith("__")}
    privates -= {"_device", "_enabled"}  # too generic to tell GradScaler's from another object's
    assert {"_scale", "_per_optimizer_states", "_check_scale_growth_tracker", "_init_scale"} <= privates

    root = pathlib.Path(mpkern.__file__).parent
    found = []

    def visit(node, where, file):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            where = f"{where}.{node.name}" if where else node.name
        if isinstance(node, ast.Attribute) and node.attr in privates:
            found.append((file, where, node.attr))
        for child in ast.iter_child_nodes(node):
            visit(child, where, file)

    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        visit(tree, "", str(path.relative_to(root.parent)))
    places = {(f, w) for f, w, _ in found}
    assert places == {("mpkern/_scaler_internals.py", "scaler_internals")}, sorted(found)
