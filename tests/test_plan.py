"""mpkern plan: bytes per parameter against the real state tensors of each optimizer, counted here."""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest
import torch

import mpkern
from mpkern import bytemodel, cli as mpkern_cli, plan
from mpkern.optim.release import DEFAULT_BUCKET_BYTES


def _model(dtype):
    # a different shape from the probe model plan measures on: bytes/param must not depend on it
    # (every numel a multiple of 32: the 8-bit moments' last scale of a tensor covers a short group)
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32)).to(dtype)


def _counted(params, opt, masters=()):
    """weights, grads, masters, moments per param, summed here from the tensors themselves."""
    n = sum(p.numel() for p in params)

    def size(t):
        return t.numel() * t.element_size()

    out = {"weights": sum(size(p) for p in params),
           "grads": sum(size(p.grad) for p in params if p.grad is not None) + sum(size(m.grad) for m in masters),
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
    loss = model(x).float().pow(2).mean()
    if getattr(opt, "release_grads", False):
        opt.backward(loss)  # the step inside backward: every grad freed after its bucket
        assert all(p.grad is None for p in model.parameters())
        return
    loss.backward()
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
        if "8-bit master" in name:
            kw["master_weights"] = "8bit"
        if "bf16 moments" in name:
            kw["state_dtype"] = torch.bfloat16
        if "8-bit moments" in name:
            kw["state_dtype"] = "8bit"
        if "4-bit m + 8-bit v moments" in name:
            kw["state_dtype"] = "4bit_m"
        if name.endswith(" + release"):
            kw["release_grads"] = True
        opt = mpkern.FusedAdamWMP(ps, **kw)
    _step(m, opt)
    return ps, opt, []


@pytest.fixture(scope="module")
def rows():
    return plan.plan_table(7e9, world_size=1, gpu_mem=80.0)


def _release_names():
    return [name + " + release" for name in bytemodel.RECIPES if name.startswith("mpkern")]


def test_every_recipe_matches_its_real_state_tensors(rows):
    assert [r["recipe"] for r in rows] == list(bytemodel.RECIPES) + _release_names()
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
    assert by["mpkern 8-bit master + bf16 moments"]["total_B"] == 9  # 2 + 2 + 1 + 4
    assert by["mpkern 8-bit master + 8-bit moments"]["total_B"] == 7.125  # 2 + 2 + 1 + 2 + 2 * 2 / 32
    assert by["mpkern remainder + 8-bit moments"]["total_B"] == 8.125  # 2 + 2 + 2 + 2.125


def test_sharding_divides_per_rank(rows):
    sharded = plan.plan_table(7e9, world_size=8, measured={r["recipe"]: {k[:-2]: r[k] for k in r if k.endswith("_B")}
                                                            | {"total": r["total_B"]} for r in rows})
    # release_grads=True is single-process: its rows are not offered sharded
    assert [b["recipe"] for b in sharded] == list(bytemodel.RECIPES)
    by = {r["recipe"]: r for r in rows}
    for b in sharded:
        assert b["per_rank_GB"] == pytest.approx(by[b["recipe"]]["per_rank_GB"] / 8)


# ---- gradient release (issue 30 item 5) --------------------------------------------------------
@pytest.fixture(scope="module")
def json_rows():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert mpkern_cli.main(["plan", "--params", "7e9", "--json"]) == 0
    return json.loads(out.getvalue())["rows"]


def test_plan_json_has_a_release_row_for_every_storage_mode(json_rows):
    """Every mpkern master_weights x state_dtype row has a release twin: the same weights, masters and
    moments, no persistent grads, so its total is the regular row's total minus its grads."""
    by = {r["recipe"]: r for r in json_rows}
    modes = [r["recipe"] for r in json_rows if r["recipe"].startswith("mpkern") and "release" not in r["recipe"]]
    assert modes and [r["recipe"] for r in json_rows if "release" in r["recipe"]] == [m + " + release" for m in modes]
    for mode in modes:
        reg, rel = by[mode], by[mode + " + release"]
        assert "release" in rel["recipe"] and "transient_grad_bytes" not in reg
        assert rel["grads_B"] == 0 and reg["grads_B"] == 2
        for k in ("weights_B", "masters_B", "moments_B"):
            assert rel[k] == reg[k], (mode, k)
        assert rel["total_B"] == reg["total_B"] - reg["grads_B"]
        assert rel["per_rank_GB"] == pytest.approx(rel["total_B"] * 7)
        # the bucket is a constant, not per param: in the note and its own key, in no _B column
        assert rel["transient_grad_bytes"] == DEFAULT_BUCKET_BYTES
        assert "32 MiB" in rel["note"] and "largest param" in rel["note"]


def test_release_8bit_master_4bit_m_is_4_625_bytes(json_rows):
    """2 bf16 weights + 0 grads + 1 master correction + 1.625 moments (4-bit m, 8-bit v, bf16 scales per 32)."""
    row = next(r for r in json_rows if r["recipe"] == "mpkern 8-bit master + 4-bit m + 8-bit v moments + release")
    assert row["total_B"] <= 4.625
    assert (row["weights_B"], row["grads_B"], row["masters_B"], row["moments_B"]) == (2, 0, 1, 1.625)


@pytest.mark.parametrize("name", _release_names())
def test_release_leaves_no_grad_alive(name):
    """Built here, not by plan: after opt.backward(loss) every .grad is None and the optimizer has
    stepped (its state is materialised), and bytemodel's own build counts 0 grad bytes."""
    params, opt, _ = _build(name)  # asserts every p.grad is None after opt.backward
    assert opt.release_grads and opt.release_bucket_bytes == DEFAULT_BUCKET_BYTES
    assert all(opt.state[p] for p in params)
    assert _counted(params, opt)["grads"] == 0
    params, opt, masters = bytemodel.build_recipe(name)
    assert all(p.grad is None for p in params)
    assert bytemodel.count_state(params, opt, masters=masters).bytes["grads"] == 0


def test_plan_text_explains_the_transient_bucket():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert mpkern_cli.main(["plan", "--params", "7e9"]) == 0
    text = out.getvalue()
    assert "| mpkern 8-bit master + 4-bit m + 8-bit v moments + release | 2 | 0 | 1 | 1.625 | 4.625 |" in text
    assert "32 MiB (release_bucket_bytes) + the largest param's grad" in text


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


def _llama_config(tmp_path, name, *, tie, architectures):
    cfg = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 160,
           "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 128, "tie_word_embeddings": tie}
    if architectures:
        cfg["architectures"] = ["LlamaForCausalLM"]
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d), cfg


def _llama_count(cfg):
    """Llama's parameter count from its config, by the architecture's formula (no transformers)."""
    v, h, i, n = cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head_dim = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim
    attn = h * h + 2 * h * kv + h * h          # q, k, v, o projections (no biases)
    mlp = 3 * h * i                            # gate, up, down (no biases)
    layer = attn + mlp + 2 * h                 # + input and post-attention RMSNorm weights
    body = v * h + n * layer + h               # embeddings, layers, final norm
    return body + (0 if cfg["tie_word_embeddings"] else v * h)  # the LM head: its own matrix unless tied


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("architectures", [True, False], ids=["architectures", "model_type only"])
def test_hf_config_counts_the_causal_lm_head(tmp_path, tie, architectures):
    """issue 13 item 8: the model a user trains has an LM head (AutoModel has none); tied, it is the
    embedding matrix and counts once."""
    pytest.importorskip("transformers")
    path, cfg = _llama_config(tmp_path, "llama", tie=tie, architectures=architectures)
    want = _llama_count(cfg)
    n, cls = plan.hf_config_count(path)
    assert (n, cls) == (want, "LlamaForCausalLM")
    assert plan.params_from_hf_config(os.path.join(path, "config.json")) == want


def test_hf_config_without_a_causal_lm_class_counts_the_base_model(tmp_path):
    """A config type with no causal-LM class (T5: encoder-decoder) falls back to the bare model."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.T5Config(d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4, vocab_size=120)
    cfg.save_pretrained(tmp_path)
    n, cls = plan.hf_config_count(str(tmp_path))
    assert cls == "T5Model"
    # T5: shared embedding + encoder/decoder blocks; counted here from the module tree by hand
    d, f, inner, v, L = 32, 64, 8 * 4, 120, 2
    attn = 4 * d * inner
    enc_layer = attn + d + 2 * d * f + d        # self-attention + its norm, dense-relu-dense + its norm
    dec_layer = 2 * attn + 2 * d + 2 * d * f + d
    rel_bias = 2 * cfg.relative_attention_num_buckets * 4  # first block of encoder and decoder
    want = v * d + L * enc_layer + d + L * dec_layer + d + rel_bias
    assert n == want


def test_storage_descriptions_match_the_allocated_state():
    # the bytes the optimizer's storage descriptions declare == what it really allocates
    from mpkern import bytemodel
    from mpkern.optim import storage

    for name in list(bytemodel.RECIPES) + _release_names():
        if not name.startswith("mpkern"):
            continue
        mw = "remainder" if "remainder" in name else "8bit" if "8-bit master" in name else True
        sdt = ("bfloat16" if "bf16 moments" in name else "8bit" if "8-bit moments" in name
               else "4bit_m" if "4-bit m + 8-bit v" in name else "float32")
        params, opt, masters = bytemodel.build_recipe(name)
        got = bytemodel.count_state(params, opt, masters=masters).per_param()
        assert got["masters"] + got["moments"] == storage.state_bytes_per_param(mw, sdt, torch.bfloat16), name


# ---- the largest batch for a memory budget ------------------------------------------------------
def test_sizes_parse_with_units():
    from mpkern.measure import parse_size

    assert parse_size("96MiB") == 96 * 2**20 and parse_size("20GB") == 20 * 10**9 and parse_size("1.5KiB") == 1536
    for bad in ("lots", "-1GB", "0", "5 parsecs"):
        with pytest.raises(ValueError, match="memory size"):
            parse_size(bad)


def test_batch_estimate_holds_against_a_measured_peak():
    """plan's estimate for compare's model (a step measured at batch 32 and 64) against the peak
    compare measures when it trains that batch: within the budget, and close to the prediction."""
    from mpkern import batch_plan
    from mpkern.compare import Classifier, Config
    from mpkern.compare.batch import measure_point

    budget = 24 * 2**20
    est = batch_plan.plan_batches(budget)
    assert est["margin"] == batch_plan.SAFETY_MARGIN and est["steps"]["fp32"]["per_sample"] > 0
    cfg = Config(steps=2, warmup=1, log_every=1, val_size=8, linear="torch")
    torch.manual_seed(0)
    base = Classifier(2 * cfg.classes + 2 + cfg.noise_vocab, cfg.seq_len, cfg.d_model, cfg.layers, cfg.heads,
                      cfg.classes)
    rows = est["rows"]
    fp32 = next(r for r in rows if r["compute"] == "fp32")
    compact = min((r for r in rows if r["compute"] == "bf16"), key=lambda r: r["state_B_per_param"])
    for row, run in ((fp32, "fp32"), (compact, "mpkern-8bit")):
        b = row["max_batch_size"]
        assert b > 1
        point = measure_point(run, cfg, base, b, budget)
        assert point["status"] == "ok" and point["peak_mem_bytes"] <= budget, (row, point)
        assert point["peak_mem_bytes"] == pytest.approx(row["predicted_peak_bytes"], rel=0.15), (row, point)
    assert compact["max_batch_size"] > fp32["max_batch_size"]
