"""mpkern.diagnose / mpkern.nn.keep_fp32 / mpkern doctor: models with known fp16/bf16 failures.

Every expected number is computed here independently of the doctor (float64 references, plain
torch arithmetic); the doctor's findings must name the module that introduces the problem.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from torch import nn

import mpkern
from mpkern.doctor import stats


class NaiveLSE(nn.Module):
    """log(sum(exp(x))) written the naive way: exp overflows fp16 past x = 11.09."""

    def forward(self, x):
        return x.exp().sum(-1, keepdim=True).log()


class Shift(nn.Module):
    """(x + c) - c: exact in fp32 for |x| << c, cancels every digit of x in bf16 (spacing 2 at 300)."""

    def forward(self, x):
        return (x + 300.0) - 300.0


def _overflow_model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), NaiveLSE(), nn.Linear(1, 4))
    with torch.no_grad():
        m[0].weight.mul_(20)
    return m, torch.randn(8, 16)


def _cancel_model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(16, 32), Shift(), nn.Linear(32, 4)), torch.randn(8, 16)


def _underflow_model():
    torch.manual_seed(2)
    m = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32, bias=False), nn.ReLU(), nn.Linear(32, 4))
    with torch.no_grad():
        m[1].weight.mul_(1e-5)  # outputs ~1e-5: below fp16's smallest normal 6.1e-5
    return m, torch.randn(8, 16)


def _fine_model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4)), torch.randn(8, 16)


def _kinds(d, module=None):
    return [f.kind for f in d.findings if module is None or f.module == module]


# ---- the four failures ----------------------------------------------------------------------------
def test_fp16_overflow_found_where_it_is_made():
    m, x = _overflow_model()
    d = mpkern.diagnose(m, x, dtype=torch.float16)
    assert d.first_overflow == "1"
    assert d.findings[0].kind == "overflow" and d.findings[0].module == "1"
    assert "bf16" in d.findings[0].fix and "keep_fp32" in d.findings[0].fix
    assert _kinds(d, "2") == []  # the Linear after it only inherits the inf
    # the true magnitude of what overflowed: exp of the fp16 input the op got, in float64
    with torch.no_grad():
        h = m[0](x)
    e = h.to(torch.float16).double().exp()
    true_max = e.max().item()
    lay = d.layer("1")
    assert lay.max_abs == pytest.approx(true_max, rel=1e-3)
    assert lay.headroom_bits == pytest.approx(math.log2(65504.0 / true_max), abs=1e-2)
    assert lay.headroom_bits < 0
    # inf appears where exp rounds past fp16's max (>= 65520); the sum and log only inherit it
    assert lay.overflow_count == int((e >= 65520).sum()) > 0
    row = next(r for r in d.to_dict()["layers"] if r["name"] == "1")
    assert row["headroom_bits"] < 0 and row["overflow_count"] > 0


def test_bf16_has_the_range_fp16_lacks():
    m, x = _overflow_model()
    d = mpkern.diagnose(m, x, dtype=torch.bfloat16)
    assert d.first_overflow is None
    assert "overflow" not in _kinds(d)
    assert d.layer("1").headroom_bits > 70


def test_bf16_cancellation_is_a_precision_finding_at_the_module():
    m, x = _cancel_model()
    d = mpkern.diagnose(m, x, dtype=torch.bfloat16)
    assert [(f.module, f.kind) for f in d.findings] == [("1", "precision")]
    assert "keep_fp32(model, names=['1'])" in d.findings[0].fix
    # own error of the shift, independently: its fp32 input rounded to bf16 (as the bf16 Linear hands it),
    # then (x + 300) - 300 in bf16, against the fp32 result, norm-wise in float64
    with torch.no_grad():
        h = m[0](x)
    low = ((h.to(torch.bfloat16) + 300.0) - 300.0).double()
    ref = ((h + 300.0) - 300.0).double()
    expected = ((low - ref).norm() / ref.norm()).item()
    assert d.layer("1").rel_err == pytest.approx(expected, rel=1e-6)
    # the next Linear is fine on its own (own error ~ unit roundoff) though the run is off after it
    last = d.layer("2")
    assert last.rel_err < 4 * 2 ** -8 < 0.1 < last.acc_rel_err
    assert d.layer("0").rel_err < 4 * 2 ** -8


def test_fp16_loses_8x_less_in_the_same_shift():
    m, x = _cancel_model()
    d16 = mpkern.diagnose(m, x, dtype=torch.float16)
    db = mpkern.diagnose(m, x, dtype=torch.bfloat16)
    # fp16's spacing at 300 is 0.25, bf16's is 2: the error of the shift scales with it
    assert 4 < db.layer("1").rel_err / d16.layer("1").rel_err < 16


def test_fp16_underflow_is_range_not_rounding():
    m, x = _underflow_model()
    d = mpkern.diagnose(m, x, dtype=torch.float16)
    assert [(f.module, f.kind) for f in d.findings] == [("1", "underflow")]
    assert "bf16" in d.findings[0].fix
    with torch.no_grad():
        y = m[1](m[0](x)).double()
    nz = y[y != 0]
    expected = (nz.abs() < 2.0 ** -14).double().mean().item()
    assert expected > 0.9
    assert d.layer("1").underflow_frac == pytest.approx(expected)
    assert d.layer("2").underflow_frac == pytest.approx(1.0)  # ReLU passes the tiny values on: not flagged
    d16 = mpkern.diagnose(m, x, dtype=torch.bfloat16)
    assert "underflow" not in _kinds(d16)


def _grads64(m, x, loss_fn):
    m64 = copy.deepcopy(m).double()
    loss_fn(m64(x.double())).backward()
    return {n: p.grad for n, p in m64.named_parameters()}


def test_gradients_underflowing_at_a_small_loss_scale():
    m, x = _fine_model()

    def loss_fn(out):
        return out.float().pow(2).mean() * 1e-7

    d = mpkern.diagnose(m, x, dtype=torch.float16, loss_fn=loss_fn, loss_scale=1.0)
    g64 = _grads64(m, x, lambda o: o.pow(2).mean() * 1e-7)
    kinds = {(f.module, f.kind) for f in d.findings}
    assert ("0", "grad_underflow") in kinds and ("3", "grad_underflow") in kinds
    for g in d.grads:
        ref = g64[g.param]
        nz = ref[ref != 0]
        assert g.underflow_frac == pytest.approx((nz.abs() < 2.0 ** -14).double().mean().item(), abs=2e-3)
    # the scale range, from the float64 gradients: no overflow up to hi, <= 0.1 % below normal from lo
    allg = torch.cat([g.reshape(-1) for g in g64.values()])
    allg = allg[allg != 0].abs()
    lo, hi = d.scale_range
    assert allg.max() * 2.0 ** hi <= 65504 < allg.max() * 2.0 ** (hi + 1) * 1.001
    assert (allg * 2.0 ** lo < 2.0 ** -14).double().mean() <= 1e-3 + 1e-6
    assert (allg * 2.0 ** (lo - 1) < 2.0 ** -14).double().mean() > 1e-3 - 1e-4
    fix = next(f.fix for f in d.findings if f.kind == "grad_underflow")
    k = min(hi, max(lo, 16))
    assert f"init_scale=2.0**{k}" in fix
    # at a scale inside the range there is nothing to report
    d2 = mpkern.diagnose(m, x, dtype=torch.float16, loss_fn=loss_fn, loss_scale=2.0 ** k)
    assert not [f for f in d2.findings if f.kind.startswith("grad")]


def test_gradients_overflowing_at_a_large_loss_scale():
    m, x = _fine_model()
    d = mpkern.diagnose(m, x, dtype=torch.float16, loss_fn=lambda o: o.float().pow(2).sum() * 100, loss_scale=2.0 ** 24)
    assert "grad_overflow" in _kinds(d)
    assert any(g.overflow_count > 0 for g in d.grads)


def test_a_fine_model_has_no_findings():
    m, x = _fine_model()
    for dt in (torch.float16, torch.bfloat16):
        d = mpkern.diagnose(m, x, dtype=dt, loss_fn=lambda o: o.float().pow(2).mean())
        assert d.findings == [] and d.ok and d.first_overflow is None, str(d)
        assert "findings: none" in str(d)
        names = [r["name"] for r in d.to_dict()["layers"]]
        assert names == ["", "0", "1", "2", "3"]


# ---- the model is left as it was ------------------------------------------------------------------
def test_model_left_untouched():
    torch.manual_seed(4)
    m = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Dropout(0.5), nn.LayerNorm(32), nn.Linear(32, 2))
    m[0].weight.main_grad = torch.full_like(m[0].weight, 7.0)
    for p in m.parameters():
        p.grad = torch.full_like(p, 3.0)
    grads = {n: p.grad for n, p in m.named_parameters()}
    sd = copy.deepcopy(m.state_dict())
    hooks = [(len(x._forward_hooks), len(x._forward_pre_hooks), len(x._backward_hooks)) for x in m.modules()]
    torch.manual_seed(123)
    x = torch.randn(8, 16)
    rng = torch.get_rng_state()
    for recipe in ("autocast", "params"):
        d = mpkern.diagnose(m, x, dtype=torch.bfloat16, loss_fn=lambda o: o.float().sum(), recipe=recipe)
        assert d.grads
        assert torch.equal(torch.get_rng_state(), rng)
        assert all(torch.equal(sd[k], v) for k, v in m.state_dict().items())  # BN statistics included
        assert all(p.dtype == torch.float32 for p in m.parameters())
        assert all(p.grad is grads[n] and bool((p.grad == 3.0).all()) for n, p in m.named_parameters())
        assert bool((m[0].weight.main_grad == 7.0).all())
        assert not hasattr(m[1].weight, "main_grad")
        assert m.training and m[2].p == 0.5
        assert hooks == [(len(x._forward_hooks), len(x._forward_pre_hooks), len(x._backward_hooks))
                         for x in m.modules()]
    m.eval()
    mpkern.diagnose(m, x, dtype=torch.float16)
    assert not any(x.training for x in m.modules())


def test_params_recipe_matches_a_half_model():
    m, x = _underflow_model()
    d = mpkern.diagnose(m, x, dtype=torch.float16, recipe="params")
    assert [(f.module, f.kind) for f in d.findings] == [("1", "underflow")]
    assert all(p.dtype == torch.float32 for p in m.parameters())
    # accumulated error at the output, independently: the model in fp16 against fp32, float64 norms
    h = copy.deepcopy(m).half()
    with torch.no_grad():
        low, ref = h(x.half()).double(), m(x).double()
    assert d.layer("").acc_rel_err == pytest.approx(((low - ref).norm() / ref.norm()).item(), rel=1e-6)


def test_half_model_given_half_inputs_and_diagnose_under_no_grad():
    # a model that was .half()-ed is called with half inputs: the fp32 run upcasts them (exactly)
    m, x = _overflow_model()
    h = copy.deepcopy(m).half()
    sd = {k: v.clone() for k, v in h.state_dict().items()}
    xh = x.half()
    for recipe in ("autocast", "params"):
        d = mpkern.diagnose(h, xh, dtype=torch.float16, recipe=recipe)
        assert d.first_overflow == "1" and ("1", "overflow") in [(f.module, f.kind) for f in d.findings]
    assert all(torch.equal(sd[k], v) and sd[k].dtype == v.dtype for k, v in h.state_dict().items())
    # the run error at the output, independently: the half model itself against a float64 copy on the same input
    f, xf = _fine_model()
    fh, xfh = copy.deepcopy(f).half(), xf.half()
    with torch.no_grad():
        low, ref = fh(xfh).double(), copy.deepcopy(fh).double()(xfh.double())
    d = mpkern.diagnose(fh, xfh, dtype=torch.float16, recipe="params")
    assert d.layer("").acc_rel_err == pytest.approx(((low - ref).norm() / ref.norm()).item(), rel=1e-2)
    # with a loss, under torch.no_grad(): both backwards still run
    m2, x2 = _fine_model()
    with torch.no_grad():
        d = mpkern.diagnose(m2, x2, loss_fn=lambda o: o.float().pow(2).mean(), loss_scale=1.0)
    assert {g.param for g in d.grads} == {n for n, _ in m2.named_parameters()}
    assert all(p.grad is None for p in m2.parameters())


# ---- fp32 islands ---------------------------------------------------------------------------------
def test_keep_fp32_fixes_the_overflow_and_is_reversible():
    m, x = _overflow_model()
    islands = mpkern.nn.keep_fp32(m, names=["1"])
    assert islands.names == ["1"] and mpkern.nn.kept_fp32(m) == ["1"]
    with torch.autocast("cpu", dtype=torch.float16):
        y = m(x)
    assert bool(torch.isfinite(y).all())
    with torch.no_grad():
        ref = m(x).double()
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-2
    d = mpkern.diagnose(m, x, dtype=torch.float16)
    assert d.first_overflow is None and "overflow" not in _kinds(d)
    assert d.layer("1").kept_fp32 and d.kept_fp32 == ["1"]
    assert next(r for r in d.to_dict()["layers"] if r["name"] == "1")["kept_fp32"] is True
    islands.remove()
    assert mpkern.nn.kept_fp32(m) == []
    with torch.autocast("cpu", dtype=torch.float16):
        assert not bool(torch.isfinite(m(x)).all())


def test_keep_fp32_by_type_and_in_a_half_model():
    torch.manual_seed(5)
    m = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.LayerNorm(8)).half()
    with mpkern.nn.keep_fp32(m, types=[nn.LayerNorm]) as isl:
        assert isl.names == ["1", "3"]
        assert m[1].weight.dtype == torch.float32 and m[0].weight.dtype == torch.float16
        seen = []
        h = m[1].register_forward_hook(lambda mod, a, out: seen.append((a[0].dtype, out.dtype)), prepend=True)
        y = m(torch.randn(2, 8).half())
        h.remove()
        assert seen == [(torch.float32, torch.float32)]  # inside: fp32 in, fp32 out
        assert y.dtype == torch.float16  # handed back in the dtype it came in
    assert m[1].weight.dtype == torch.float16 and mpkern.nn.kept_fp32(m) == []


def test_keep_fp32_restores_autocast_when_forward_raises():
    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    m = nn.Sequential(nn.Linear(4, 4), Boom())
    mpkern.nn.keep_fp32(m, names="1")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="boom"):
            m(torch.randn(2, 4))
        assert torch.is_autocast_enabled("cpu")


def test_keep_fp32_errors():
    m, _ = _fine_model()
    with pytest.raises(ValueError, match=r"names=.*types="):
        mpkern.nn.keep_fp32(m)
    with pytest.raises(ValueError, match="no module named '9'"):
        mpkern.nn.keep_fp32(m, names=["9"])
    with pytest.raises(TypeError, match="types"):
        mpkern.nn.keep_fp32(m, types=int)
    with pytest.raises(ValueError, match="no module of types"):
        mpkern.nn.keep_fp32(m, types=nn.BatchNorm1d)
    with pytest.raises(TypeError, match=r"nn\.Module"):
        mpkern.nn.keep_fp32("model", names=["0"])


# ---- input checks, outputs ------------------------------------------------------------------------
def test_diagnose_argument_errors():
    m, x = _fine_model()
    with pytest.raises(ValueError, match="dtype"):
        mpkern.diagnose(m, x, dtype=torch.float32)
    with pytest.raises(ValueError, match="recipe"):
        mpkern.diagnose(m, x, recipe="amp")
    with pytest.raises(ValueError, match="loss_scale"):
        mpkern.diagnose(m, x, loss_fn=lambda o: o.sum(), loss_scale=-1.0)
    with pytest.raises(TypeError, match="loss_scale"):
        mpkern.diagnose(m, x, loss_fn=lambda o: o.sum(), loss_scale="big")
    with pytest.raises(ValueError, match="scalar"):
        mpkern.diagnose(m, x, loss_fn=lambda o: o)
    with pytest.raises(TypeError, match="model"):
        mpkern.diagnose(lambda t: t, x)
    sd = copy.deepcopy(m.state_dict())
    assert all(torch.equal(sd[k], v) for k, v in m.state_dict().items())
    assert all(p.grad is None for p in m.parameters())  # a failing loss_fn left nothing behind


def test_to_dict_str_and_plot(tmp_path):
    m, x = _overflow_model()
    d = mpkern.diagnose(m, x, dtype="fp16", loss_fn=lambda o: o.float().mean())
    js = json.loads(json.dumps(d.to_dict()))
    assert js["first_overflow"] == "1" and js["dtype"] == "float16"
    assert {"name", "type", "headroom_bits", "rel_err", "acc_rel_err", "overflow_count",
            "underflow_frac"} <= set(js["layers"][0])
    assert js["findings"][0]["module"] == "1" and js["findings"][0]["kind"] == "overflow"
    assert d.findings[0]["fix"] == d.findings[0].fix
    text = str(d)
    assert "NaiveLSE" in text and "[overflow] 1:" in text and "fix:" in text
    pytest.importorskip("matplotlib")
    path = tmp_path / "d.png"
    d.plot(str(path))
    assert path.stat().st_size > 1000


# ---- stats rules against brute force ------------------------------------------------------------
def test_scale_range_against_brute_force():
    torch.manual_seed(6)
    gs = [torch.randn(1000) * 10.0 ** torch.empty(1000).uniform_(-12, 1), torch.randn(37) * 1e-3]
    sums = [stats.grad_summary(g, torch.float16, 1.0) for g in gs]
    lo, hi = stats.scale_range(sums, torch.float16)
    a = torch.cat(gs).double().abs()
    a = a[a > 0]

    def ok_hi(k):
        return bool((a * 2.0 ** k).max() <= 65504)

    def ok_lo(k):
        return (a * 2.0 ** k < 2.0 ** -14).double().mean().item() <= 1e-3

    assert ok_hi(hi) and not ok_hi(hi + 1)
    assert ok_lo(lo) and not ok_lo(lo - 1)
    assert stats.headroom_bits(65504.0 / 8, torch.float16) == pytest.approx(3.0)
    assert stats.headroom_bits(0.0, torch.float16) is None


# ---- models from configs --------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gpt2", "bert"])
@pytest.mark.parametrize("dt", ["fp16", "bf16"])
def test_transformers_from_config(kind, dt):
    pytest.importorskip("transformers")
    from mpkern.doctor import models

    case = models.build(kind)
    before = copy.deepcopy(case.model.state_dict())
    d = mpkern.diagnose(case.model, case.inputs, dtype=dt, loss_fn=case.loss_fn)
    assert d.first_overflow is None and not [f for f in d.findings if f.kind == "overflow"], str(d)
    types = {x.type for x in d.layers}
    assert "LayerNorm" in types and any("Attention" in t for t in types)
    attn = next(x for x in d.layers if "Attention" in x.type)
    assert attn.rel_err is not None and attn.rel_err < 16 * torch.finfo(d.dtype).eps / 2
    assert attn.headroom_bits is not None and attn.headroom_bits > 5  # the finfo.min mask is a sentinel, not data
    assert len(d.grads) == len(list(case.model.parameters()))
    assert all(torch.equal(before[k], v) for k, v in case.model.state_dict().items())


def test_softmax_module_in_fp16_params():
    torch.manual_seed(7)
    m = nn.Sequential(nn.Linear(16, 16), nn.Softmax(-1))
    d = mpkern.diagnose(m, torch.randn(4, 16), dtype=torch.float16, recipe="params")
    assert d.findings == []
    assert d.layer("1").rel_err < 8 * 2 ** -11


# ---- the command --------------------------------------------------------------------------------
def test_doctor_cli_json(capsys, tmp_path):
    from mpkern.cli import main

    assert main(["doctor", "--model", "compare", "--dtype", "fp16", "--json", "--out", str(tmp_path),
                 "--no-plot"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(e["model"], e["dtype"]) for e in out] == [("compare", "fp16")]
    assert out[0]["diagnosis"]["layers"][0]["name"] == ""
    assert json.loads((tmp_path / "doctor.json").read_text())[0]["dtype"] == "fp16"


def test_doctor_cli_rejects_unknown_model(capsys):
    from mpkern.cli import main

    with pytest.raises(SystemExit):
        main(["doctor", "--model", "llama"])
    assert "--model must be a comma list" in capsys.readouterr().err


def test_doctor_command_builds_a_model_it_does_not_know_from_builders(capsys):
    """command.run takes the models outside mpkern.doctor (the CLI's ``compare``) as builders; build refuses them."""
    from mpkern.doctor import command, models
    from mpkern.doctor.case import Case

    with pytest.raises(ValueError, match="unknown model 'compare'"):
        models.build("compare")
    seen = []

    def overflow_case(device, seed):
        seen.append((device, seed))
        m, x = _overflow_model()
        return Case("mine", m, x, lambda out: out.float().sum(), "the exp overflow model")

    out = command.run(["mine"], ["fp16", "bf16"], plot=False, seed=3, builders={"mine": overflow_case})
    assert seen == [("cpu", 3)]  # built once, diagnosed in each dtype
    assert [(e["model"], e["dtype"], e["diagnosis"]["first_overflow"]) for e in out] == [
        ("mine", "fp16", "1"), ("mine", "bf16", None)]
    assert "== the exp overflow model: fp16 ==" in capsys.readouterr().out


# ---- mistakes caught where they happen ----------------------------------------------------------
def test_step_inside_autocast_warns_once_with_the_fix():
    import warnings

    m = nn.Linear(4, 4)
    opt = mpkern.FusedAdamWMP(m.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                m(torch.randn(2, 4)).float().sum().backward()
                opt.step()
            opt.zero_grad()
    mine = [w for w in got if "inside a torch.autocast region" in str(w.message)]
    assert len(mine) == 1 and "outside" in str(mine[0].message)
    assert mine[0].filename == __file__  # points at the caller's step() line
    opt2 = mpkern.FusedAdamWMP(m.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            m(torch.randn(2, 4)).float().sum().backward()
        opt2.step()
    assert not [w for w in got if "autocast" in str(w.message)]


def test_unscale_without_scaler_update_warns_with_the_fix():
    m = nn.Linear(4, 4)
    opt = mpkern.FusedAdamWMP(m.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(m(torch.randn(2, 4)).sum()).backward()
    mpkern.unscale_(opt, scaler=scaler, max_norm=1.0)
    scaler.step(opt)  # ... and no scaler.update()
    opt.zero_grad()
    scaler.scale(m(torch.randn(2, 4)).sum()).backward()
    with (pytest.warns(UserWarning, match=r"call scaler.update\(\) once per iteration"),
          pytest.raises(RuntimeError, match="after step")):
        mpkern.unscale_(opt, scaler=scaler, max_norm=1.0)


def test_compare_doctor_flag(tmp_path):
    from mpkern import compare

    tiny = dict(steps=4, batch_size=8, seq_len=8, d_model=32, layers=1, heads=2, classes=4, noise_vocab=8,
                val_size=16, warmup=1, log_every=2, linear="torch")
    res = compare.run("fp32,fp16,mpkern-bf16", device="cpu", progress=False, plot=False, out=str(tmp_path),
                      doctor=True, **tiny)
    assert [(e["run"], e["dtype"], e["recipe"]) for e in res["doctor"]] == [
        ("fp16", "float16", "autocast"), ("mpkern-bf16", "bfloat16", "params")]
    assert all(e["diagnosis"]["layers"] and "findings" in e["diagnosis"] for e in res["doctor"])
    md = (tmp_path / "results.md").read_text()
    assert "## mpkern doctor: fp16 (float16, autocast)" in md and "first overflow:" in md
    assert json.loads((tmp_path / "results.json").read_text())["doctor"][1]["run"] == "mpkern-bf16"


@pytest.mark.parametrize("kind,dtype,expected,fix", [
    ("lse", torch.float16, ("mid", "overflow"), {"keep_fp32": ["mid"]}),
    ("lse", torch.float16, ("mid", "overflow"), {"dtype": torch.bfloat16}),
    ("cancel", torch.bfloat16, ("mid", "precision"), {"keep_fp32": ["mid"]}),
    ("tiny", torch.float16, ("1", "underflow"), {"dtype": torch.bfloat16}),
    ("gradscale", torch.float16, ("proj", "grad_underflow"), {"loss_scale": 2.0 ** 16}),
])
def test_docs_examples_and_their_fixes(kind, dtype, expected, fix):
    """docs/doctor.md's four cases: the finding it shows, and the fix it names leaving none."""
    from mpkern.doctor.examples import example_case

    case = example_case(kind)
    d = mpkern.diagnose(case.model, case.inputs, dtype=dtype, loss_fn=case.loss_fn, loss_scale=case.loss_scale)
    assert expected == (d.findings[0].module, d.findings[0].kind)
    if "keep_fp32" in fix:
        mpkern.nn.keep_fp32(case.model, names=fix["keep_fp32"])
    d2 = mpkern.diagnose(case.model, case.inputs, dtype=fix.get("dtype", dtype), loss_fn=case.loss_fn,
                         loss_scale=fix.get("loss_scale", case.loss_scale))
    assert d2.findings == [], str(d2)


def test_max_abs_counts_fp32_values_past_the_fp16_max():
    torch.manual_seed(8)
    m = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    with torch.no_grad():
        m[0].weight.mul_(1e5)
    x = torch.randn(4, 16)
    d = mpkern.diagnose(m, x, dtype=torch.float16)
    with torch.no_grad():
        ref = m[0](x).double().abs().max().item()
    assert ref > 65504
    assert d.layer("0").max_abs >= ref * (1 - 1e-6)
    assert d.layer("0").headroom_bits <= math.log2(65504 / ref) + 1e-6
    assert d.first_overflow == "0"
