"""Issue 15 at the optimizer level: master_weights="8bit", unbiased bf16 moments, unique streams.

The kernels' bit-identity across backends is in test_compact_kernels.py; here the public API:
small-update fidelity against float64 AdamW written in the test, the bitwise overflow skip,
checkpoints (resume bit-identical, conversions), streams per param, errors, bytes.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

import _ladder64
import mpkern
from conftest import DEVICE
from mpkern import FusedAdamWMP
from mpkern.optim import storage

B1, B2, EPS = 0.9, 0.999, 1e-8


def _adamw64_path(w0: float, g: float, lr: float, steps: int) -> float:
    """float64 AdamW (no weight decay) from w0 under a constant grad g: the final weight."""
    w, m, v = w0, 0.0, 0.0
    for t in range(1, steps + 1):
        m = B1 * m + (1 - B1) * g
        v = B2 * v + (1 - B2) * g * g
        w -= lr * (m / (1 - B1**t)) / (math.sqrt(v / (1 - B2**t)) + EPS)
    return w


# The two long runs use the default backend (the kernels agree bit for bit: test_compact_kernels.py).
def test_8bit_master_moves_small_updates_in_expectation():
    # bf16 param at 1.0 (ulp 2^-7), lr 1e-5: every update is ~1e-5, a 1/780 of the ulp and below
    # the correction's resolution (ulp/256 = 3.1e-5). Round-to-nearest would never move it.
    n, steps, lr = 2048, 1000, 1e-5
    p = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16, device=DEVICE))
    opt = FusedAdamWMP([p], lr=lr, weight_decay=0.0, master_weights="8bit", state_dtype=torch.bfloat16, seed=3)
    g = torch.full((n,), 0.3, dtype=torch.bfloat16, device=DEVICE)
    for _ in range(steps):
        p.grad = g
        opt.step()
    moved = 1.0 - opt.master_params()[0].double().mean()
    want = 1.0 - _adamw64_path(1.0, float(g[0]), lr, steps)
    assert abs(float(moved) - want) <= 0.05 * want, (float(moved), want)


def _decode64(st: dict, key: str) -> torch.Tensor:
    """8-bit (and 4-bit exp_avg) moments in their documented format, in float64 (tests/_ladder64.py:
    +-u(q) s on the 4- or 1-mantissa-bit ladder, a bf16 scale per 32 consecutive elements of the
    buffer in memory order); the 4-bit exp_avg (state "exp_avg_q4") two codes per byte, laid out as
    exp_avg_sq."""
    shape = st["exp_avg_sq_q8"]  # laid out like the param
    flat_codes = shape.as_strided((shape.numel(),), (1,), shape.storage_offset())
    if key == "exp_avg" and "exp_avg_q4" in st:
        val = _ladder64.decode64(st["exp_avg_q4"], st["exp_avg_scale"], "m4", shape.numel())
    elif key == "exp_avg":
        q8 = st["exp_avg_q8"]
        val = _ladder64.decode64(q8.as_strided((q8.numel(),), (1,), q8.storage_offset()), st["exp_avg_scale"], "m8")
    else:
        val = _ladder64.decode64(flat_codes, st["exp_avg_sq_scale"], "v8")
    out = torch.empty_like(shape, dtype=torch.float64, device="cpu")
    out.as_strided((out.numel(),), (1,), out.storage_offset()).copy_(val)
    return out


@pytest.mark.parametrize("state_dtype, n", [("bfloat16", 400), ("8bit", 512), ("4bit_m", 512)])
def test_compact_moments_decay_after_a_spike(state_dtype, n):
    # one grad of 10, then N(0, 0.1^2) grads, each element its own noise: fp32 v decays to ~0.0145;
    # round-to-nearest bf16 moments froze at ~0.100 (v * 0.999 rounds back). 3000 steps: the mean is
    # the statistic (each element's own v is noisy); the float64 reference runs the same grads.
    steps = 3000
    p = torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16, device=DEVICE))
    opt = FusedAdamWMP([p], lr=0.0, weight_decay=0.0, master_weights=True, state_dtype=state_dtype,
                       seed=2 if state_dtype in ("8bit", "4bit_m") else 0)
    gen = torch.Generator().manual_seed(0)
    v64 = torch.zeros(n, dtype=torch.float64)
    for t in range(steps):
        g = torch.full((n,), 10.0) if t == 0 else torch.randn(n, generator=gen) * 0.1
        g16 = g.to(torch.bfloat16)
        v64 = B2 * v64 + (1 - B2) * g16.double() ** 2
        p.grad = g16.to(DEVICE)
        opt.step()
    st = opt.state[p]
    compact = state_dtype in ("8bit", "4bit_m")
    got = _decode64(st, "exp_avg_sq") if compact else st["exp_avg_sq"].double().cpu()
    assert abs(float(got.mean()) / float(v64.mean()) - 1) < 0.10, (float(got.mean()), float(v64.mean()))
    if compact:
        assert abs(float((got / v64).median()) - 1) < 0.10


@pytest.mark.parametrize("state_dtype", ["float32", "8bit", "4bit_m"])
def test_8bit_overflow_skip_is_bitwise(backend, state_dtype):
    # every state tensor (8-bit moments: codes and scales too) stays bitwise unchanged
    torch.manual_seed(1)
    lin = torch.nn.Linear(40, 24).to(DEVICE).to(torch.float16)
    opt = FusedAdamWMP(lin.parameters(), lr=1e-3, master_weights="8bit", state_dtype=state_dtype)
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=2.0**8)
    scaler.scale(torch.ones((), device=DEVICE))
    for p in lin.parameters():
        p.grad = torch.randn_like(p)
    scaler.step(opt)
    scaler.update()
    snap = {id(p): (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}) for p in lin.parameters()}
    for p in lin.parameters():
        p.grad = torch.randn_like(p)
    lin.bias.grad[3] = float("inf")
    scaler.step(opt)
    scaler.update()
    for p in lin.parameters():
        p0, st = snap[id(p)]
        assert torch.equal(p, p0)
        for k, v in st.items():
            assert torch.equal(opt.state[p][k], v), k


def _run(opt_kwargs, model_seed, steps, sd=None, model_sd=None):
    torch.manual_seed(model_seed)
    lin = torch.nn.Linear(33, 31).to(DEVICE).to(torch.bfloat16)
    opt = FusedAdamWMP(lin.parameters(), lr=1e-3, **opt_kwargs)
    if model_sd is not None:
        lin.load_state_dict(model_sd)
        opt.load_state_dict(sd)
    gen = torch.Generator().manual_seed(100 + (0 if sd is None else 1))
    for _ in range(steps):
        for p in lin.parameters():
            p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16).to(DEVICE)
        opt.step()
    return lin, opt


def test_8bit_checkpoint_is_compact_and_resumes_bit_identically(backend):
    kw = dict(master_weights="8bit", state_dtype=torch.bfloat16, seed=11)
    lin, opt = _run(kw, 0, 2)
    sd = copy.deepcopy(opt.state_dict())  # state_dict() shares the live tensors
    st = sd["state"][0]
    assert st["master_correction"].dtype == torch.int8 and "master_param" not in st
    assert st["exp_avg"].dtype == torch.bfloat16
    model_sd = {k: v.clone() for k, v in lin.state_dict().items()}
    # continue the original, and a fresh optimizer resumed from the checkpoint, with the same grads
    gen = torch.Generator().manual_seed(101)
    for _ in range(2):
        for p in lin.parameters():
            p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16).to(DEVICE)
        opt.step()
    lin2, opt2 = _run(kw, 5, 2, sd=sd, model_sd=model_sd)
    for a, b in zip(lin.parameters(), lin2.parameters()):
        assert torch.equal(a, b)
        for k in ("exp_avg", "exp_avg_sq", "master_correction", "step"):
            assert torch.equal(opt.state[a][k], opt2.state[b][k]), k


def test_fp32_master_checkpoint_into_8bit_and_back(backend):
    lin, opt = _run({"master_weights": True}, 2, 3)
    exact = [m.clone() for m in opt.master_params()]
    sd, model_sd = opt.state_dict(), {k: v.clone() for k, v in lin.state_dict().items()}
    torch.manual_seed(9)
    lin8 = torch.nn.Linear(33, 31).to(DEVICE).to(torch.bfloat16)
    opt8 = FusedAdamWMP(lin8.parameters(), lr=1e-3, master_weights="8bit")
    lin8.load_state_dict(model_sd)
    with pytest.warns(UserWarning, match="converted"):
        opt8.load_state_dict(sd)
    for m8, m, p in zip(opt8.master_params(), exact, lin8.parameters()):
        # quantized to the nearest 1/256 of the param's ulp (at most one unit at the clamp)
        unit = (m.to(torch.bfloat16).float().abs().clamp(min=2**-126) * 2.0**-15)
        assert ((m8 - m).abs() <= unit * 1.01).all()
        assert torch.equal(p, m.to(torch.bfloat16))
    # and 8-bit -> fp32 master: the decoded value, exactly
    decoded = [m.clone() for m in opt8.master_params()]
    opt32 = FusedAdamWMP(lin8.parameters(), lr=1e-3, master_weights=True)
    with pytest.warns(UserWarning, match="converted"):
        opt32.load_state_dict(opt8.state_dict())
    for a, b in zip(opt32.master_params(), decoded):
        assert torch.equal(a, b)


def test_streams_differ_between_params_of_different_groups(backend):
    # the same values and grads in two groups: stochastic rounding must draw different bits
    a = torch.nn.Parameter(torch.full((4096,), 1.0, dtype=torch.bfloat16, device=DEVICE))
    b = torch.nn.Parameter(a.detach().clone())
    opt = FusedAdamWMP([{"params": [a]}, {"params": [b]}], lr=1e-3, weight_decay=0.0, master_weights=False,
                       stochastic_rounding=True)
    g = torch.full((4096,), 0.5, dtype=torch.bfloat16, device=DEVICE)
    a.grad, b.grad = g, g.clone()
    opt.step()
    assert not torch.equal(a, b)
    # same seed, same step: reproducible
    c = torch.nn.Parameter(torch.full((4096,), 1.0, dtype=torch.bfloat16, device=DEVICE))
    d = torch.nn.Parameter(c.detach().clone())
    opt2 = FusedAdamWMP([{"params": [c]}, {"params": [d]}], lr=1e-3, weight_decay=0.0, master_weights=False,
                        stochastic_rounding=True)
    c.grad, d.grad = g.clone(), g.clone()
    opt2.step()
    assert torch.equal(a, c) and torch.equal(b, d)


def test_8bit_errors_name_the_argument():
    p32 = torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match="not needed"):
        FusedAdamWMP([p32], master_weights="8bit")
    with pytest.raises(ValueError, match="master_weights"):
        FusedAdamWMP([p32], master_weights="int8")
    # a mixed group (bf16 weights, an fp32 norm kept in fp32) is fine: the fp32 param keeps no master
    q = torch.nn.Parameter(torch.randn(4).to(torch.bfloat16))
    opt = FusedAdamWMP([q, p32], master_weights="8bit")
    q.grad, p32.grad = torch.randn_like(q), torch.randn_like(p32)
    opt.step()
    assert "master_correction" in opt.state[q] and "master_correction" not in opt.state[p32]


def test_8bit_bytes_from_the_descriptions_match_the_state():
    p = torch.nn.Parameter(torch.randn(1000).to(torch.bfloat16))
    opt = FusedAdamWMP([p], master_weights="8bit", state_dtype=torch.bfloat16)
    p.grad = torch.randn_like(p)
    opt.step()
    got = sum(t.numel() * t.element_size() for k, t in opt.state[p].items() if k != "step") / p.numel()
    assert got == storage.state_bytes_per_param("8bit", "bfloat16", torch.bfloat16) == 5.0


def test_8bit_adamw_state_dict_and_masters(backend):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lin, opt = _run({"master_weights": "8bit"}, 4, 2)
    masters = opt.master_params()
    for m, p in zip(masters, lin.parameters()):
        # the param is a nearest 16-bit value of its master (a correction of -128 is an exact tie)
        ulp = (p.float().abs().clamp(min=2**-126) * 2.0**-7)
        assert m.dtype == torch.float32 and ((m - p.float()).abs() <= ulp / 2).all()
    sd = opt.adamw_state_dict()
    ref = torch.optim.AdamW([torch.nn.Parameter(m.clone()) for m in masters], lr=1.0)
    ref.load_state_dict(sd)
    assert ref.param_groups[0]["lr"] == 1e-3
    assert mpkern.FusedAdamWMP is FusedAdamWMP


@pytest.mark.parametrize("flags", [{"amsgrad": True}, {"maximize": True}, {"lr": "tensor"}, {"main_grad": True},
                                   {"groups": True}])
def test_8bit_matches_fp32_master_within_one_correction_unit(backend, flags):
    # one step from the same state: the 8-bit master differs from the fp32 master by the
    # correction's stochastic rounding only (< 1/256 of the param's ulp, plus fp32 rounding)
    torch.manual_seed(30)
    w0 = torch.randn(257, 9, device=DEVICE).to(torch.bfloat16)
    g = torch.randn(257, 9, device=DEVICE)
    outs = []
    for mw in (True, "8bit"):
        p = torch.nn.Parameter(w0.clone())
        q = torch.nn.Parameter(torch.randn(5, device=DEVICE).to(torch.bfloat16))
        lr = torch.tensor(1e-2, device=DEVICE) if flags.get("lr") == "tensor" else 1e-2
        kw = {k: v for k, v in flags.items() if k in ("amsgrad", "maximize")}
        groups = [{"params": [p]}, {"params": [q], "master_weights": True}] if flags.get("groups") else [p, q]
        opt = FusedAdamWMP(groups, lr=lr, master_weights=mw, **kw)
        if flags.get("main_grad"):
            p.main_grad = g.clone()
        else:
            p.grad = g.to(torch.bfloat16)
        q.grad = torch.ones_like(q)
        opt.step()
        outs.append(opt.master_params()[0].clone())
    unit = outs[0].abs().clamp(min=2**-126) * 2.0**-15  # >= ulp/256 of the param after the step
    assert ((outs[0] - outs[1]).abs() <= 1.01 * unit + 1e-7).all()
    assert not torch.equal(outs[1], w0.float())  # it moved


@pytest.mark.parametrize("mode", [("remainder", "bfloat16"), ("8bit", "8bit"), ("8bit", "4bit_m")])
def test_eager_step_after_compiled_steps_keeps_the_compact_masters(backend, mode):
    # compiled steps move the params' version counters with their own (functionalized) writes; the
    # next eager step must not take that for an external write (it would reset the remainders /
    # 8-bit corrections): the sequence eager, compiled x2, eager equals four eager steps bitwise
    torch._dynamo.reset()
    master, sdt = mode
    torch.manual_seed(21)
    w = [torch.randn(40, 7).to(torch.bfloat16).to(DEVICE), torch.randn(33).to(torch.bfloat16).to(DEVICE)]
    p1 = [torch.nn.Parameter(t.clone()) for t in w]
    p2 = [torch.nn.Parameter(t.clone()) for t in w]
    kw = dict(lr=1e-3, master_weights=master, state_dtype=sdt, seed=8)
    o1, o2 = FusedAdamWMP(p1, **kw), FusedAdamWMP(p2, **kw)
    compiled = torch.compile(o2.step, fullgraph=True, backend="aot_eager")
    gen = torch.Generator().manual_seed(22)
    for k in range(4):
        for a, b in zip(p1, p2):
            g = torch.randn(a.shape, generator=gen).to(torch.bfloat16).to(DEVICE)
            a.grad, b.grad = g, g.clone()
        o1.step()
        (compiled if k in (1, 2) else o2.step)()
    for a, b in zip(p1, p2):
        assert torch.equal(a, b)
        for key, t in o1.state[a].items():
            assert torch.equal(t, o2.state[b][key]), key


def test_compiled_step_reports_the_norm_and_consumes_the_pending_unscale():
    # attribute stores on the optimizer are not replayed by a compiled call; what a step leaves
    # (last_grad_norm, last_found_inf, the pending unscale_) must still be there after one
    torch._dynamo.reset()
    p = torch.nn.Parameter(torch.randn(100).to(torch.bfloat16))
    opt = FusedAdamWMP([p], lr=1e-3, max_grad_norm=1.0)
    compiled = torch.compile(opt.step, fullgraph=True, backend="aot_eager")
    for k in range(3):
        p.grad = torch.full_like(p, float(k + 1))
        compiled()
        assert opt.last_grad_norm is not None and float(opt.last_grad_norm) == pytest.approx(10.0 * (k + 1))
        assert float(opt.last_found_inf) == 0.0
    p.grad = torch.full_like(p, 1.0)
    mpkern.unscale_(opt, 0.5)
    compiled()
    assert opt.mpkern_runtime.pending is None  # consumed: the next step must not apply 0.5 again
