"""Issue 7: what a user switching from AdamW / GradScaler hits -- each test failed before its fix.

The generic torch.optim tests re-expressed for FusedAdamWMP are in test_optim_generic.py; this
file covers the points specific to mpkern: re-seeding masters after external writes, main_grad
lifetime, deferred vs applied unscale, masters out, warnings for silent no-ops, the overflow
report, and the training loop of docs/api.md.
"""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path

import pytest
import torch

import mpkern
from conftest import DEVICE
from mpkern import FusedAdamWMP

ROOT = Path(__file__).resolve().parents[1]


def _bf16_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(DEVICE)


def _grads(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype).to(p.device)


# ---- 5: the result must not alias what GradScaler mutates -----------------------------------------
def test_result_found_inf_survives_scaler_update_with_two_optimizers(backend):
    a, b = _bf16_model(0).float(), _bf16_model(1).float()
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=2.0**4)
    scaler.scale(torch.ones((), device=DEVICE))  # lazily creates the scale
    _grads(a, 1)
    _grads(b, 2)
    next(b.parameters()).grad[0, 0] = float("inf")  # only b overflows
    ra = mpkern.unscale_(oa, scaler=scaler)
    rb = mpkern.unscale_(ob, scaler=scaler)
    scaler.step(oa)
    scaler.step(ob)
    scaler.update()  # sums the per-optimizer flags in place
    assert float(ra.found_inf) == 0.0 and float(rb.found_inf) == 1.0
    assert float(scaler.get_scale()) == 2.0**3  # the scaler still saw the overflow


# ---- 6: writes to the params are kept (master re-seeded) ------------------------------------------
@pytest.mark.parametrize("how", ["fill_", "copy_", "no_grad_mul_", "load_state_dict"])
@pytest.mark.parametrize("master", [True, "remainder"])
def test_external_param_write_reseeds_master(backend, how, master):
    model = _bf16_model(3).to(torch.bfloat16)
    opt = FusedAdamWMP(model.parameters(), lr=1e-2, weight_decay=0.0, master_weights=master)
    _grads(model, 10)
    opt.step()
    w = model[0].weight
    saved = {k: v.clone() for k, v in _bf16_model(4).to(torch.bfloat16).state_dict().items()}
    if how == "fill_":
        with torch.no_grad():
            w.fill_(3.0)
    elif how == "copy_":
        with torch.no_grad():
            w.copy_(saved["0.weight"])
    elif how == "no_grad_mul_":
        with torch.no_grad():
            w.mul_(4.0)
    else:
        model.load_state_dict(saved)
    written = w.detach().clone()
    # the expected next value: float64 AdamW from the *written* param with the optimizer's moments
    st = opt.state[w]
    m0, v0 = st["exp_avg"].double(), st["exp_avg_sq"].double()
    g = torch.Generator().manual_seed(11)
    grads = {id(p): torch.randn(p.shape, generator=g) for p in model.parameters()}
    for p in model.parameters():
        p.grad = grads[id(p)].to(p.dtype).to(p.device)
    opt.step()
    gw = w.grad.double()
    m = 0.9 * m0 + 0.1 * gw
    v = 0.999 * v0 + 0.001 * gw * gw
    expect = written.double() - 1e-2 / (1 - 0.9**2) * m / (v.sqrt() / math.sqrt(1 - 0.999**2) + 1e-8)
    # bf16 result: within one bf16 rounding of the float64 value (the old master is ~3 away for fill_)
    torch.testing.assert_close(w.double(), expect, rtol=2**-8, atol=1e-6)


def test_reseed_keeps_master_low_bits_where_param_unchanged(backend):
    """Writing one element re-seeds that element only; the others keep their fp32 masters."""
    p = torch.nn.Parameter(torch.randn(1000, device=DEVICE).to(torch.bfloat16))
    opt = FusedAdamWMP([p], lr=1e-3)
    p.grad = torch.randn_like(p)
    opt.step()
    before = opt.state[p]["master_param"].clone()
    with torch.no_grad():
        p[7] = 5.0
    p.grad = torch.randn_like(p)
    opt.param_groups[0]["lr"] = 0.0  # no update: only the re-seed can change the master
    opt.step()
    after = opt.state[p]["master_param"]
    assert float(after[7]) == 5.0
    mask = torch.ones(1000, dtype=torch.bool, device=DEVICE)
    mask[7] = False
    assert torch.equal(after[mask], before[mask])
    assert not torch.equal(before[mask], before[mask].to(torch.bfloat16).float())  # low bits were there


def test_own_writes_do_not_trigger_reseed(backend):
    """Steps alone never re-seed: the master keeps its low bits across many steps (== float64 AdamW)."""
    p = torch.nn.Parameter(torch.randn(500, device=DEVICE).to(torch.bfloat16))
    w64 = p.detach().double().clone()
    m = torch.zeros_like(w64)
    v = torch.zeros_like(w64)
    opt = FusedAdamWMP([p], lr=1e-4, weight_decay=0.0)
    g = torch.Generator().manual_seed(5)
    for t in range(1, 21):
        gr = torch.randn(500, generator=g).to(torch.bfloat16)
        p.grad = gr.to(DEVICE)
        opt.step()
        gd = gr.double().to(DEVICE)
        m = 0.9 * m + 0.1 * gd
        v = 0.999 * v + 0.001 * gd * gd
        w64 -= 1e-4 / (1 - 0.9**t) * m / (v.sqrt() / math.sqrt(1 - 0.999**t) + 1e-8)
    # updates are ~1e-4, far below bf16 resolution: only a master that kept its bits follows float64
    torch.testing.assert_close(opt.state[p]["master_param"].double(), w64, rtol=1e-6, atol=1e-6)


# ---- 7: main_grad cannot accumulate across steps, whatever zero_grad the loop calls ---------------
@pytest.mark.parametrize("zero", ["model", "model_keep", "opt", "opt_keep"])
def test_main_grad_consumed_by_step(zero):
    torch.manual_seed(0)
    model = mpkern.nn.convert(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2)).to(DEVICE)
                              .to(torch.bfloat16), fp32_main_grad=True)
    opt = FusedAdamWMP(model.parameters(), lr=0.0, max_grad_norm=1e9)
    x = torch.randn(4, 8, device=DEVICE).to(torch.bfloat16)
    norms = []
    for _ in range(3):
        model(x).float().pow(2).sum().backward()
        opt.step()
        norms.append(float(opt.last_grad_norm))
        if zero == "model":
            model.zero_grad()
        elif zero == "model_keep":
            model.zero_grad(set_to_none=False)
        else:
            opt.zero_grad(set_to_none=zero == "opt")
    # lr=0 and the same batch: every step sees the same gradient (not 1x, 2x, 3x)
    assert norms[0] > 0
    assert norms[1] == pytest.approx(norms[0], rel=1e-6) and norms[2] == pytest.approx(norms[0], rel=1e-6)
    assert all(getattr(p, "main_grad", None) is None for p in model.parameters())


# ---- 8: a torch optimizer over main_grad params is not silent ------------------------------------
def test_torch_optimizer_over_main_grad_warns():
    model = mpkern.nn.convert(torch.nn.Linear(8, 4).to(DEVICE).to(torch.bfloat16), fp32_main_grad=True)
    model(torch.randn(2, 8, device=DEVICE).to(torch.bfloat16)).float().sum().backward()
    assert model.weight.grad is None and model.weight.main_grad is not None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.warns(UserWarning, match="main_grad.*FusedAdamWMP"):
        opt.step()
    # no warning for FusedAdamWMP, which reads main_grad
    opt2 = FusedAdamWMP(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt2.step()


# ---- 9: deferred unscale vs apply=True ----------------------------------------------------------
def test_unscale_apply_writes_grads_and_step_matches_deferred(backend):
    m1, m2 = _bf16_model(5).to(torch.bfloat16), _bf16_model(5).to(torch.bfloat16)
    o1 = FusedAdamWMP(m1.parameters(), lr=1e-2)
    o2 = FusedAdamWMP(m2.parameters(), lr=1e-2)
    _grads(m1, 20)
    _grads(m2, 20)
    scaled = [p.grad.clone() for p in m1.parameters()]
    r1 = mpkern.unscale_(o1, 1 / 64, max_norm=0.1)
    r2 = mpkern.unscale_(o2, 1 / 64, max_norm=0.1, apply=True)
    for p, s in zip(m1.parameters(), scaled):
        assert torch.equal(p.grad, s)  # deferred: grads still scaled (documented)
    coef = float(r2.clip_coef)
    assert coef < 1.0
    for p, s in zip(m2.parameters(), scaled):  # applied: grads unscaled and clipped now
        torch.testing.assert_close(p.grad.double(), s.double() / 64 * coef, rtol=2**-7, atol=0)
    assert float(r1.total_norm) == float(r2.total_norm)
    o1.step()
    o2.step()  # must not apply the factor a second time
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-3)
    # the first moment is scale-dependent (the update m/sqrt(v) is not): both optimizers must have
    # seen exactly the unscaled, clipped grads -- float64 from the scaled grads, computed here
    for p1, p2, s in zip(m1.parameters(), m2.parameters(), scaled):
        expect = 0.1 * s.double() / 64 * coef
        torch.testing.assert_close(o1.state[p1]["exp_avg"].double(), expect, rtol=2**-7, atol=1e-12)
        torch.testing.assert_close(o2.state[p2]["exp_avg"].double(), expect, rtol=2**-7, atol=1e-12)


# ---- 11: masters out ----------------------------------------------------------------------------
@pytest.mark.parametrize("master", [True, "remainder", False])
def test_master_params_and_export(backend, master):
    torch.manual_seed(1)
    fp32 = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)).to(DEVICE)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)).to(DEVICE)
    model.load_state_dict(fp32.state_dict())
    model.to(torch.bfloat16)
    ref = [p.detach().double().clone() for p in model.parameters()]  # masters start from the bf16 params
    opt = FusedAdamWMP(model.parameters(), lr=1e-2, weight_decay=0.0, master_weights=master)
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(p.shape, generator=g) for p in model.parameters()]
    for p, gr in zip(model.parameters(), grads):
        p.grad = gr.to(torch.bfloat16).to(DEVICE)
    opt.step()
    masters = opt.master_params()
    assert [m.dtype for m in masters] == [torch.float32] * 4
    for m, p, r, gr in zip(masters, model.parameters(), ref, grads):
        assert torch.equal(m.to(torch.bfloat16), p.detach())  # the param is the rounded master
        # step 1 of AdamW moves every element by lr * g / (|g| + eps): float64 check
        g64 = gr.to(torch.bfloat16).double().to(DEVICE)
        expect = r - 1e-2 * g64 / (g64.abs() + 1e-8)
        if master is not False:
            torch.testing.assert_close(m.double(), expect, rtol=0, atol=2e-6)
        else:  # no master: the bf16 param itself took the step (within one bf16 rounding)
            torch.testing.assert_close(p.double(), expect, rtol=2**-8, atol=0)
            assert not torch.equal(p.detach().double(), r)
    opt.copy_master_params_to(fp32)
    for m, p in zip(masters, fp32.parameters()):
        assert torch.equal(p.detach(), m)
    with pytest.raises(ValueError, match="target has 1 tensors"):
        opt.copy_master_params_to([torch.zeros(8, 8)])


# ---- 12: silent no-ops and conflicts --------------------------------------------------------------
def test_unscale_warns_when_nothing_processed():
    model = _bf16_model(0)
    _grads(model, 1)
    gen = model.parameters()
    list(gen)
    with pytest.warns(UserWarning, match="exhausted generator"):
        res = mpkern.unscale_(gen, 0.5)
    assert float(res.total_norm) == 0.0


def test_unscale_warns_on_inverse_confusion():
    model = _bf16_model(0)
    _grads(model, 1)
    with pytest.warns(UserWarning, match="inv_scale=65536.*1 / loss_scale"):
        mpkern.unscale_(model.parameters(), 65536.0)


def test_unscale_with_torch_optimizer_refuses_fp16_grads_like_gradscaler():
    model = _bf16_model(0).to(torch.float16)
    _grads(model, 1)
    scaler = torch.amp.GradScaler(DEVICE.type)
    scaler.scale(torch.ones((), device=DEVICE))
    before = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        mpkern.unscale_(torch.optim.AdamW(model.parameters()), scaler=scaler)
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))
    # FusedAdamWMP applies the factor in fp32 inside its step: allowed
    mpkern.unscale_(FusedAdamWMP(model.parameters()), scaler=scaler)


def test_max_grad_norm_in_state_dict_and_mode_kept_on_load(backend):
    model = _bf16_model(0).to(torch.bfloat16)
    o1 = FusedAdamWMP(model.parameters(), lr=1e-2, max_grad_norm=0.7, master_weights="remainder")
    _grads(model, 3)
    o1.step()
    sd = o1.state_dict()
    assert all(g["max_grad_norm"] == 0.7 for g in sd["param_groups"])
    o2 = FusedAdamWMP(model.parameters(), lr=1e-2, master_weights=True)
    with pytest.warns(UserWarning, match="master_weights='remainder' -> True"):
        o2.load_state_dict(sd)
    assert o2.param_groups[0]["master_weights"] is True and o2.max_grad_norm == 0.7
    for p in model.parameters():  # remainder -> fp32 master, exactly
        hi = p.detach().view(torch.int16).to(torch.int32) & 0xFFFF
        exact = ((hi << 16) + o1.state[p]["master_remainder"].to(torch.int32)).view(torch.float32)
        assert torch.equal(o2.state[p]["master_param"], exact)


def test_last_grad_norm_documented_none_without_clipping():
    model = _bf16_model(0).to(torch.bfloat16)
    opt = FusedAdamWMP(model.parameters())
    _grads(model, 1)
    opt.step()
    assert opt.last_grad_norm is None and opt.last_found_inf is not None
    assert "None until" in FusedAdamWMP.__doc__ or "None until" in (FusedAdamWMP.step.__doc__ or "")


# ---- 13: overflow report ------------------------------------------------------------------------
def test_report_localises_overflow_in_backward_order():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).to(DEVICE)
    x = torch.randn(4, 8, device=DEVICE)

    def blow_up(_module, grad_in, grad_out):  # the middle layer's backward overflows
        return (grad_in[0] * float("inf"),) + tuple(grad_in[1:])

    h = model[1].register_full_backward_hook(blow_up)
    model(x).sum().backward()
    h.remove()
    res = mpkern.unscale_(model.parameters(), 1.0, per_tensor=True)
    rep = mpkern.nonfinite_report(model, res)
    assert {e.name for e in rep} == {"0.weight", "0.bias"}  # grads behind the overflow; 1.* and 2.* fine
    model.zero_grad()
    (model(x).sum() * 1e30 * 1e30).backward()  # the loss itself overflows: every grad goes non-finite
    rep = mpkern.nonfinite_report(model, mpkern.unscale_(model.parameters(), 1.0, per_tensor=True))
    assert len(rep) == 6 and "loss or the forward pass" in rep.summary
    assert rep[0].name == "2.bias"  # backward order: the output layer first


# ---- 14: smaller --------------------------------------------------------------------------------
def test_unscale_module_argument_says_what_to_pass():
    with pytest.raises(TypeError, match=r"pass model.parameters\(\)"):
        mpkern.unscale_(_bf16_model(0))


def test_convert_reports_skipped_linear_like_layers():
    mha = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    with pytest.warns(UserWarning, match="self_attn"):
        _, report = mpkern.nn.convert(mha, fp32_main_grad=True, report=True)
    assert "linear1" in report.converted and "linear2" in report.converted
    assert any(name.startswith("self_attn") for name in report.skipped)


def test_api_reference_training_loop_runs_on_cpu():
    """The training loop of docs/api.md (the README's usage block before it moved), executed as written
    (on this machine's device)."""
    text = (ROOT / "docs" / "api.md").read_text()
    block = re.search(r"## A training loop[^\n]*\n.*?```python\n(.*?)```", text, re.DOTALL)
    assert block is not None, "docs/api.md has no training-loop code block"
    ns: dict = {}
    exec(compile(block.group(1), "api-md-training-loop", "exec"), ns)
    res, model, scaler = ns["res"], ns["model"], ns["scaler"]
    # four steps ran through the scaler: finite params, a finite positive unscaled norm, and the
    # scaler's state advanced past the unscale (update() ran)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert float(res.found_inf) == 0.0 and 0.0 < float(res.total_norm) < float("inf")
    assert 0.0 < float(res.clip_coef) <= 1.0 and scaler.get_scale() > 0
    assert all(p.grad is not None for p in model.parameters())


def test_cli_version():
    from mpkern import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0


def test_clip_grad_norm_drop_in_sees_main_grad(backend):
    """mpkern.clip_grad_norm_: torch's signature; with main_grad it clips what the optimizer reads."""
    torch.manual_seed(3)
    model = mpkern.nn.convert(torch.nn.Linear(16, 8).to(DEVICE).to(torch.bfloat16), fp32_main_grad=True)
    model(torch.randn(4, 16, device=DEVICE).to(torch.bfloat16)).float().pow(2).sum().backward()
    w_g, b_g = model.weight.main_grad.double().clone(), model.bias.grad.double().clone()
    ref = torch.sqrt(w_g.pow(2).sum() + b_g.pow(2).sum())  # float64, from the tensors themselves
    assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)) < 0.9 * float(ref)  # torch misses W
    total = mpkern.clip_grad_norm_(model.parameters(), 0.25)
    torch.testing.assert_close(total.double(), ref, rtol=1e-6, atol=0)
    coef = 0.25 / (float(ref) + 1e-6)
    torch.testing.assert_close(model.weight.main_grad.double(), w_g * coef, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(model.bias.grad.double(), b_g * coef, rtol=2**-8, atol=0)
    # plain fp32 grads: same result as torch's own clip_grad_norm_
    a = [torch.nn.Parameter(torch.randn(30, device=DEVICE)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b):
        p.grad = torch.randn_like(p) * 3
        q.grad = p.grad.clone()
    torch.testing.assert_close(mpkern.clip_grad_norm_(a, 1.0), torch.nn.utils.clip_grad_norm_(b, 1.0))
    for p, q in zip(a, b):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
    a[0].grad[0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        mpkern.clip_grad_norm_(a, 1.0, error_if_nonfinite=True)
