"""mpkern.unscale_ against float64 references computed here, on every available backend."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import mpkern
from conftest import DEVICE

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [0, 1, 7, 33, 1000, 4099, (1 << 15) + 5]  # 0, 1, odd, > one CPU chunk / Triton program
EPS = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
HSET = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def make_params(specs, seed, device=DEVICE):
    """Parameters whose .grad are fresh random tensors: specs = [(numel, dtype, magnitude, n_inf, n_nan)]."""
    g = torch.Generator().manual_seed(seed)
    params = []
    for numel, dtype, mag, n_inf, n_nan in specs:
        p = torch.nn.Parameter(torch.zeros(numel, dtype=dtype, device=device))
        x = torch.randn(numel, generator=g, dtype=torch.float64) * mag
        # fresh random data, never zeros; values representable in the dtype
        x = torch.where(x == 0, torch.full_like(x, mag), x)
        if numel:
            for k in torch.randint(0, numel, (n_inf,), generator=g).tolist():
                x[k] = float("inf") if k % 2 else float("-inf")
            for k in torch.randint(0, numel, (n_nan,), generator=g).tolist():
                x[k] = float("nan")
        p.grad = x.to(dtype).to(device)
        params.append(p)
    return params


def ref_unscale(grads64, inv, max_norm, inf_norm):
    """Float64 reference of the unscale_ contract (numpy, independent of the kernels)."""
    arrs = [g.cpu().double().numpy().ravel() * inv for g in grads64]
    bad = [bool(np.any(~np.isfinite(a))) for a in arrs]
    if inf_norm:
        per = [float(np.max(np.abs(a))) if a.size else 0.0 for a in arrs]
        total = max(per) if per else 0.0
    else:
        per = [float(np.sqrt(np.sum(a * a))) for a in arrs]
        total = float(np.sqrt(sum(p * p for p in per)))
    found = any(bad)
    clip = 1.0 if (max_norm is None or found) else min(1.0, max_norm / (total + 1e-6))
    return per, bad, total, found, clip


def assert_close_dtype(actual, expected64, dtype, what, ulps=1.0, extra_rel=0.0):
    """|actual - expected| <= ulps * eps(dtype) * |expected| (+ a floor for tiny values), NaN == NaN."""
    a = actual.detach().cpu().double()
    e = expected64.cpu().double()
    both_nan = torch.isnan(a) & torch.isnan(e)
    same_inf = torch.isinf(a) & torch.isinf(e) & (torch.sign(a) == torch.sign(e))
    tiny = torch.finfo(dtype).tiny
    tol = (ulps * EPS[dtype] + extra_rel) * e.abs() + tiny
    ok = both_nan | same_inf | ((a - e).abs() <= tol)
    assert bool(ok.all()), f"{what}: {int((~ok).sum())} of {ok.numel()} elements off, worst {(a - e).abs()[~ok].max()}"


def check_against_reference(params, res, grads_before, inv, max_norm, inf_norm, per_tensor=True):
    per, bad, total, found, clip = ref_unscale(grads_before, inv, max_norm, inf_norm)
    assert res.found_inf.dtype == torch.float32 and res.found_inf.dim() == 0
    assert float(res.found_inf) == (1.0 if found else 0.0)
    if not found:
        # norm: within 2x of PyTorch's own fp32 computation's error against float64, plus a few ulps
        tn = float(res.total_norm)
        ords = math.inf if inf_norm else 2.0
        torch_norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.float() * inv, ords) for g in grads_before if g.numel()]
                        + [torch.zeros((), device=DEVICE)]), ords).item()
        tol = 2 * abs(torch_norm - total) + 8 * EPS[torch.float32] * total + 1e-30
        assert abs(tn - total) <= tol, (tn, total, torch_norm)
        assert float(res.clip_coef) == pytest.approx(clip, rel=1e-5)
    else:
        assert float(res.clip_coef) == 1.0
        assert not math.isfinite(float(res.total_norm))
    if per_tensor:
        assert res.per_tensor_nonfinite.tolist() == [1.0 if b else 0.0 for b in bad]
        for k, (pn, b) in enumerate(zip(per, bad)):
            if not b:
                assert float(res.per_tensor_norm[k]) == pytest.approx(pn, rel=1e-4, abs=1e-30)
    # effect on grads: g * inv * clip rounded once to the grad dtype: 1 ulp, plus the clip
    # coefficient's own tolerance (checked above) when clipping is active
    extra = 1e-5 if clip < 1.0 else 0.0
    for p, g0 in zip([p for p in params if p.grad is not None], grads_before):
        assert_close_dtype(p.grad, g0.double() * inv * clip, p.grad.dtype, "grad", ulps=1.0, extra_rel=extra)


spec_strategy = st.lists(
    st.tuples(st.sampled_from(SIZES), st.sampled_from(DTYPES), st.sampled_from([1e-6, 1e-2, 1.0, 30.0]),
              st.just(0), st.just(0)),
    min_size=1, max_size=5)


@given(specs=spec_strategy, seed=st.integers(0, 2**31 - 1), inv_exp=st.integers(-16, 0),
       max_norm=st.sampled_from([None, 0.5, 1.0, 1e6]), inf_norm=st.booleans())
@HSET
def test_unscale_finite(backend, specs, seed, inv_exp, max_norm, inf_norm):
    params = make_params(specs, seed)
    before = [p.grad.clone() for p in params]
    inv = 2.0**inv_exp
    res = mpkern.unscale_(params, inv, max_norm=max_norm, norm_type=math.inf if inf_norm else 2.0, per_tensor=True)
    check_against_reference(params, res, before, inv, max_norm, inf_norm)


@given(specs=st.lists(st.tuples(st.sampled_from(SIZES[1:]), st.sampled_from(DTYPES), st.sampled_from([1e-3, 1.0]),
                                st.integers(0, 2), st.integers(0, 2)), min_size=1, max_size=4),
       seed=st.integers(0, 2**31 - 1), inf_norm=st.booleans())
@HSET
def test_unscale_nonfinite(backend, specs, seed, inf_norm):
    params = make_params(specs, seed)
    before = [p.grad.clone() for p in params]
    res = mpkern.unscale_(params, 0.25, max_norm=1.0, norm_type=math.inf if inf_norm else 2.0, per_tensor=True)
    check_against_reference(params, res, before, 0.25, 1.0, inf_norm)
    has_nan = any(bool(torch.isnan(g).any()) for g in before)
    if has_nan:
        assert math.isnan(float(res.total_norm))


def test_fp16_limits(backend):
    """Scaled fp16 grads near 65504 with a 2^16 loss scale; tiny fp16 subnormals."""
    g = torch.Generator().manual_seed(1)
    big = (torch.rand(5000, generator=g, dtype=torch.float64) * 2 - 1) * 65504
    small = (torch.rand(3001, generator=g, dtype=torch.float64) * 2 - 1) * 2.0**-20  # subnormal fp16
    params = []
    for x in (big, small):
        p = torch.nn.Parameter(torch.zeros(x.numel(), dtype=torch.float16, device=DEVICE))
        p.grad = x.to(torch.float16).to(DEVICE)
        params.append(p)
    before = [p.grad.clone() for p in params]
    res = mpkern.unscale_(params, 2.0**-16, max_norm=10.0, per_tensor=True)
    check_against_reference(params, res, before, 2.0**-16, 10.0, False)


def test_many_tiny_tensors(backend):
    n = 100 if backend == "triton" and DEVICE.type == "cpu" else 3000
    g = torch.Generator().manual_seed(2)
    sizes = torch.randint(1, 6, (n,), generator=g).tolist()
    specs = [(s, DTYPES[i % 3], 1.0, 0, 0) for i, s in enumerate(sizes)]
    params = make_params(specs, 3)
    before = [p.grad.clone() for p in params]
    res = mpkern.unscale_(params, 0.5, max_norm=2.0, per_tensor=True)
    check_against_reference(params, res, before, 0.5, 2.0, False)


def test_empty_and_none(backend):
    with pytest.warns(UserWarning, match="no gradient was processed"):
        res = mpkern.unscale_([], 0.5, max_norm=1.0, per_tensor=True)
    assert float(res.found_inf) == 0.0 and float(res.total_norm) == 0.0 and float(res.clip_coef) == 1.0
    assert res.per_tensor_norm.numel() == 0
    p_none = torch.nn.Parameter(torch.ones(3, device=DEVICE))  # grad None: skipped
    params = make_params([(10, torch.float32, 1.0, 0, 0)], 4)
    before = [params[0].grad.clone()]
    res = mpkern.unscale_([p_none, params[0]], 0.5, per_tensor=True)
    assert res.per_tensor_norm.numel() == 1
    check_against_reference(params, res, before, 0.5, None, False)


def test_main_grad_and_grad_are_summed(backend):
    # a tied weight: the fp32_main_grad layer's part in main_grad, the other use's part in .grad
    p = torch.nn.Parameter(torch.randn(100, dtype=torch.bfloat16, device=DEVICE))
    p.grad = torch.randn(100, dtype=torch.bfloat16, device=DEVICE)
    p.main_grad = torch.randn(100, dtype=torch.float32, device=DEVICE)
    total = p.grad.double() + p.main_grad.double()
    res = mpkern.unscale_([p], 0.5)
    assert p.grad is None  # folded into main_grad: nothing is counted twice by a later consumer
    assert float(res.total_norm) == pytest.approx(float((total * 0.5).norm()), rel=1e-5)
    assert_close_dtype(p.main_grad, total * 0.5, torch.float32, "main_grad")


def test_main_grad_alone(backend):
    p = torch.nn.Parameter(torch.randn(100, dtype=torch.bfloat16, device=DEVICE))
    p.main_grad = torch.randn(100, dtype=torch.float32, device=DEVICE)
    mg_before = p.main_grad.clone()
    res = mpkern.unscale_([p], 0.5)
    assert p.grad is None
    assert float(res.total_norm) == pytest.approx(float((mg_before.double() * 0.5).norm()), rel=1e-5)
    assert_close_dtype(p.main_grad, mg_before.double() * 0.5, torch.float32, "main_grad")


def test_optimizer_argument_and_noncontiguous(backend):
    w = torch.nn.Parameter(torch.randn(64, 48, device=DEVICE))
    w.grad = torch.randn(48, 64, device=DEVICE).t()  # transposed: dense, not contiguous
    b = torch.nn.Parameter(torch.randn(64, device=DEVICE))
    b.grad = torch.randn(128, device=DEVICE)[::2]  # strided: not one dense block
    opt = torch.optim.SGD([w, b], lr=0.1)
    before = [w.grad.clone(), b.grad.clone()]
    res = mpkern.unscale_(opt, 0.5, max_norm=1.0, per_tensor=True)
    check_against_reference([w, b], res, before, 0.5, 1.0, False)


def test_inv_scale_tensor(backend):
    params = make_params([(1000, torch.float16, 1.0, 0, 0)], 5)
    before = [params[0].grad.clone()]
    res = mpkern.unscale_(params, torch.tensor(0.125, device=DEVICE), max_norm=3.0)
    check_against_reference(params, res, before, 0.125, 3.0, False, per_tensor=False)


@pytest.mark.parametrize("kwargs, exc", [
    (dict(norm_type=1.0), ValueError),
    (dict(norm_type="2"), ValueError),
    (dict(norm_type=True), ValueError),
    (dict(norm_type=-math.inf), ValueError),
    (dict(max_norm=-1.0), ValueError),
    (dict(max_norm=0.0), ValueError),
    (dict(max_norm=float("nan")), ValueError),
    (dict(max_norm="1"), TypeError),
    (dict(inv_scale=-1.0), ValueError),
    (dict(inv_scale=float("inf")), ValueError),
    (dict(inv_scale="x"), TypeError),
    (dict(inv_scale=torch.ones(2)), ValueError),
    (dict(scaler="scaler"), TypeError),
])
def test_bad_arguments_leave_grads_untouched(kwargs, exc):
    params = make_params([(100, torch.float32, 1.0, 0, 0), (50, torch.bfloat16, 1.0, 0, 0)], 6)
    before = [p.grad.clone() for p in params]
    with pytest.raises(exc):
        mpkern.unscale_(params, **kwargs)
    for p, b in zip(params, before):
        assert torch.equal(p.grad, b)


def test_bad_items_leave_grads_untouched():
    params = make_params([(100, torch.float32, 1.0, 0, 0)], 7)
    before = params[0].grad.clone()
    with pytest.raises(TypeError, match="parameter 1"):
        mpkern.unscale_([params[0], 3.0], 0.5)
    sp = torch.nn.Parameter(torch.randn(4, 4, device=DEVICE))
    sp.grad = torch.randn(4, 4, device=DEVICE).to_sparse()
    with pytest.raises(ValueError, match="sparse"):
        mpkern.unscale_([params[0], sp], 0.5)
    ip = torch.nn.Parameter(torch.randn(4, device=DEVICE))
    ip.main_grad = torch.ones(4, dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="dtype"):
        mpkern.unscale_([params[0], ip], 0.5)
    with pytest.raises(TypeError):
        mpkern.unscale_(42)
    assert torch.equal(params[0].grad, before)


def test_scaler_needs_optimizer():
    params = make_params([(10, torch.float32, 1.0, 0, 0)], 8)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    with pytest.raises(ValueError, match="optimizer"):
        mpkern.unscale_(params, scaler=scaler)
    with pytest.raises(ValueError, match="not both"):
        mpkern.unscale_(torch.optim.SGD(params, lr=0.1), 0.5, scaler=scaler)


def test_nonfinite_report(backend):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to(DEVICE)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    model[2].weight.grad[1, 3] = float("nan")
    model[0].bias.grad[0] = float("inf")
    res = mpkern.unscale_(model.parameters(), 1.0, per_tensor=True)
    report = mpkern.nonfinite_report(model, res)
    # backward order: the output layer's grads come first in a backward pass
    assert [e.name for e in report] == ["2.weight", "0.bias"]
    assert [e.kind for e in report] == ["nan", "inf"]
    assert math.isnan(report[0].norm) and math.isinf(report[1].norm)
    assert "2.weight" in report.summary and "1 inf, 1 nan" in report.summary
    assert [e.name for e in mpkern.nonfinite_report(model, res, order="param")] == ["0.bias", "2.weight"]
    # names passed through unscale_ (named_parameters) need no model for the report
    res_named = mpkern.unscale_(model.named_parameters(), 1.0, per_tensor=True)
    assert [e.name for e in mpkern.nonfinite_report(None, res_named)] == ["2.weight", "0.bias"]
    with pytest.raises(ValueError, match="per_tensor"):
        mpkern.nonfinite_report(model, mpkern.unscale_(model.parameters(), 1.0))
