"""mpkern plan: bytes per parameter against the real state tensors of each optimizer, counted here."""

from __future__ import annotations

import os

import pytest
import torch

import mpkern
from mpkern import bytemodel, plan


def _model(dtype):
    # a different shape from the probe model plan measures on: bytes/param must not depend on it
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(40, 72), torch.nn.Tanh(), torch.nn.Linear(72, 9)).to(dtype)


def _counted(params, opt, masters=()):
    """weights, grads, masters, moments per param, summed here from the tensors themselves."""
    n = sum(p.numel() for p in params)
    size = lambda t: t.numel() * t.element_size()
    out = {"weights": sum(size(p) for p in params),
           "grads": sum(size(p.grad) for p in params) + sum(size(m.grad) for m in masters),
           "masters": sum(size(m) for m in masters), "moments": 0}
    for st in opt.state.values():
        for k, v in st.items():
            if k.startswith("master"):
                out["masters"] += size(v)
            elif k.startswith("exp_avg") or k == "max_exp_avg_sq":
                out["moments"] += size(v)
            else:
                assert v.dim() == 0, k  # only step counters are left
    return {k: v / n for k, v in out.items()}


def _step(model, opt):
    x = torch.randn(5, 40).to(next(model.parameters()).dtype)
    model(x).float().pow(2).mean().backward()
    opt.step()


def _build(name):
    if name.startswith(("fp32", "AMP")):
        m = _model(torch.float32)
        opt = torch.optim.AdamW(m.parameters())
        _step(m, opt)
        return list(m.parameters()), opt, []
    m = _model(torch.bfloat16)
    ps = list(m.parameters())
    if name.startswith("bf16 params + fp32 masters"):
        masters = [torch.nn.Parameter(p.detach().float()) for p in ps]
        m(torch.randn(5, 40, dtype=torch.bfloat16)).float().sum().backward()
        for mp, p in zip(masters, ps):
            mp.grad = p.grad.float()
        opt = torch.optim.AdamW(masters)
        opt.step()
        return ps, opt, masters
    if name.startswith("bf16 params, AdamW"):
        opt = torch.optim.AdamW(ps)
    else:
        kw = {}
        if "remainder" in name:
            kw["master_weights"] = "remainder"
        if "bf16 moments" in name:
            kw["state_dtype"] = torch.bfloat16
        opt = mpkern.FusedAdamWMP(ps, **kw)
    _step(m, opt)
    return ps, opt, []


@pytest.fixture(scope="module")
def rows():
    return plan.plan_table(7e9, world_size=1, gpu_mem=80.0)


def test_every_recipe_matches_its_real_state_tensors(rows):
    assert [r["recipe"] for r in rows] == list(bytemodel.RECIPES)
    for r in rows:
        want = _counted(*_build(r["recipe"]))
        for k, v in want.items():
            assert r[f"{k}_B"] == pytest.approx(v), (r["recipe"], k)
        assert r["total_B"] == pytest.approx(sum(want.values()))
        total_gb = sum(want.values()) * 7e9 / 1e9
        assert r["per_rank_GB"] == pytest.approx(total_gb)
        assert r["left_GB"] == pytest.approx(80.0 - total_gb)
        assert r["fits"] == (total_gb < 80.0)


def test_known_footprints(rows):
    """The numbers the lessons quote: fp32 AdamW 16 B/param (7B -> 112 GB), weights alone 28 GB."""
    by = {r["recipe"]: r for r in rows}
    assert by["fp32 AdamW"]["total_B"] == 16 and by["fp32 AdamW"]["weights_GB"] == pytest.approx(28.0)
    assert by["mpkern master_weights=True"]["total_B"] == 16
    assert by["mpkern master_weights='remainder'"]["total_B"] == 14
    assert by["mpkern remainder + bf16 moments"]["total_B"] == 10


def test_sharding_divides_per_rank(rows):
    sharded = plan.plan_table(7e9, world_size=8, measured={r["recipe"]: {k[:-2]: r[k] for k in r if k.endswith("_B")}
                                                            | {"total": r["total_B"]} for r in rows})
    for a, b in zip(rows, sharded):
        assert b["per_rank_GB"] == pytest.approx(a["per_rank_GB"] / 8)


@pytest.mark.parametrize("kw, name", [({"params": 0}, "params"), ({"params": float("inf")}, "params"),
                                      ({"params": 1e6, "world_size": 0}, "world_size"),
                                      ({"params": 1e6, "gpu_mem": -1.0}, "gpu_mem")])
def test_bad_arguments_name_the_argument(kw, name):
    with pytest.raises(ValueError, match=name):
        plan.plan_table(**kw)


def test_hf_config_param_count(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=64)
    cfg.save_pretrained(tmp_path)
    want = sum(p.numel() for p in transformers.GPT2Model(cfg).parameters())
    assert plan.params_from_hf_config(str(tmp_path)) == want
    assert plan.params_from_hf_config(os.path.join(tmp_path, "config.json")) == want
    with pytest.raises(ValueError, match="hf_config"):
        plan.params_from_hf_config(str(tmp_path / "missing.json"))
