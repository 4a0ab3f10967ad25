"""mpkern.compare: the synthetic task, the report's schema and numbers, divergence, errors.

Runs are tiny (a few steps of a 1-layer model) -- this checks what the report says, not speed.
"""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

import mpkern
from mpkern import compare

TINY = dict(steps=6, warmup=1, log_every=3, batch_size=4, seq_len=8, d_model=16, heads=2, layers=1, classes=5,
            noise_vocab=7, val_size=40)


def _run(precisions, **kw):
    return compare.run(precisions, device="cpu", progress=False, plot=False, **(TINY | kw))


def test_task_labels_follow_the_query():
    """Decode every sequence by hand: the label is the class of the token whose colour is asked."""
    cfg = compare.Config(**(TINY | {"steps": 10}), precisions=("fp32",))
    task = compare.make_task(cfg)
    c = cfg.classes
    assert task.vocab == 2 * c + 2 + cfg.noise_vocab
    for x, y in zip(torch.cat([task.x_train, task.x_val]).tolist(), torch.cat([task.y_train, task.y_val]).tolist()):
        reds = [t for t in x if t < c]
        blues = [t - c for t in x if c <= t < 2 * c]
        queries = [t for t in x if t in (2 * c, 2 * c + 1)]
        assert len(reds) == len(blues) == len(queries) == 1
        assert y == (reds[0] if queries[0] == 2 * c else blues[0])
    assert len(task.y_train) == cfg.steps * cfg.batch_size and len(task.y_val) == cfg.val_size


def test_validation_split_is_held_out():
    cfg = compare.Config(**(TINY | {"steps": 50, "seq_len": 12}), precisions=("fp32",))
    task = compare.make_task(cfg)
    train = {tuple(r) for r in task.x_train.tolist()}
    assert not any(tuple(r) in train for r in task.x_val.tolist())


def test_report_schema_and_state_bytes(tmp_path):
    res = _run("fp32,bf16-naive,mpkern-bf16", out=str(tmp_path))
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["schema"] == "mpkern.compare/1"
    assert (tmp_path / "results.md").read_text().count("| fp32 | float32 | float32 |") == 1
    for key in ("timestamp", "versions", "device", "config", "task", "memory_note", "runs", "plan", "wall_s"):
        assert key in on_disk, key
    assert on_disk["versions"]["torch"] == torch.__version__
    assert on_disk["config"]["steps"] == TINY["steps"] and on_disk["config"]["lr"] == res["config"]["lr"]
    assert [r["name"] for r in on_disk["runs"]] == ["fp32", "bf16-naive", "mpkern-bf16"]
    # the model's parameter count, counted here from an independently built copy
    ref = compare.Classifier(res["task"]["vocab"], TINY["seq_len"], TINY["d_model"], TINY["layers"], TINY["heads"],
                             TINY["classes"])
    n = sum(p.numel() for p in ref.parameters())
    # bytes per parameter from the dtype sizes: fp32 AdamW 4+4+8; bf16 + torch AdamW (bf16 moments)
    # 2+2+2+2; FusedAdamWMP on bf16: 2 param + 2 grad + 4 master + 8 moments
    want = {"fp32": 16, "bf16-naive": 8, "mpkern-bf16": 16}
    for r in on_disk["runs"]:
        assert r["status"] == "ok" and r["diverged_at_step"] is None
        assert r["params"] == n
        assert r["state_bytes_per_param"]["total"] == pytest.approx(want[r["name"]])
        assert r["state_bytes"]["total"] == want[r["name"]] * n
        assert 0.0 <= r["val_acc"] <= 1.0
        assert r["tokens_per_s"] > 0 and r["timed_steps"] == TINY["steps"] - TINY["warmup"]
        assert len(r["losses"]) == TINY["steps"] and all(math.isfinite(v) for v in r["losses"])
        assert r["final_loss"] == pytest.approx(sum(r["losses"][-TINY["log_every"]:]) / TINY["log_every"], rel=1e-4)
        assert r["activation_bytes_saved_for_backward"] > 0
        assert r["skipped_steps"] == 0 and r["loss_scale_history"] is None
    fp32 = on_disk["runs"][0]
    assert fp32["speedup_vs_fp32"] == pytest.approx(1.0)
    for r in on_disk["runs"][1:]:
        assert r["speedup_vs_fp32"] == pytest.approx(r["tokens_per_s"] / fp32["tokens_per_s"])
    # same init and same first batch: the first losses agree to within a few bf16 roundings
    # (bf16 forward vs fp32 forward of a tiny random model: measured spread < 1 %)
    first = [r["losses"][0] for r in on_disk["runs"]]
    assert max(first) - min(first) < 0.02 * abs(first[0])
    # the memory plan for the trained model is included
    assert on_disk["plan"] and all(row["per_rank_GB"] == pytest.approx(row["total_B"] * n / 1e9)
                                   for row in on_disk["plan"])


def test_optimizer_state_variants_change_bytes_per_param():
    res = _run("mpkern-bf16", optimizer_state="remainder")
    assert res["runs"][0]["state_bytes_per_param"]["total"] == pytest.approx(2 + 2 + 2 + 8)
    assert "remainder" in res["runs"][0]["optimizer"]
    res = _run("mpkern-bf16", optimizer_state="bf16-moments")
    assert res["runs"][0]["state_bytes_per_param"]["total"] == pytest.approx(2 + 2 + 4 + 4)


def test_remainder_applies_to_bf16_and_fp16_keeps_fp32_masters():
    res = _run("mpkern-bf16,mpkern-fp16", optimizer_state="remainder")
    bf16, fp16 = res["runs"]
    assert bf16["state_bytes_per_param"]["masters"] == pytest.approx(2)
    assert fp16["state_bytes_per_param"]["masters"] == pytest.approx(4) and "master_weights=True" in fp16["optimizer"]


def test_fp16_runs_report_loss_scale():
    res = _run("mpkern-fp16")
    r = res["runs"][0]
    assert r["status"] == "ok"
    hist = r["loss_scale_history"]
    assert hist[0] == [0, 65536.0]  # GradScaler's default initial scale
    assert r["state_bytes_per_param"]["total"] == pytest.approx(2 + 2 + 4 + 8)


def test_fp16_skipped_steps_match_what_gradscaler_saw(monkeypatch):
    """Start the scale at 2**20 so the first steps overflow: the report's skipped steps must equal
    the overflows GradScaler itself recorded (read from its per-optimizer state in update())."""
    seen: list[bool] = []

    class Recording(torch.amp.GradScaler):
        def __init__(self, *a, **k):
            k.setdefault("init_scale", 2.0**20)
            super().__init__(*a, **k)

        def update(self, new_scale=None):
            found = sum(float(v) for st in self._per_optimizer_states.values()
                        for v in st["found_inf_per_device"].values())
            seen.append(found > 0)
            super().update(new_scale)

    monkeypatch.setattr(torch.amp, "GradScaler", Recording)
    r = _run("mpkern-fp16", steps=10)["runs"][0]
    assert len(seen) == 10 and 0 < sum(seen) < 10  # some steps skipped, some taken
    assert r["skipped_steps"] == sum(seen)
    assert r["loss_scale_history"][0] == [0, 2.0**20]


def test_divergence_is_reported_and_other_runs_complete():
    """At lr 100 the fp16 run's activations overflow (fp16 max 65504) after one step and its loss is
    NaN from then on; fp32 has the range to go on (with a large but finite loss)."""
    res = _run("mpkern-fp16,fp32", lr=100.0, steps=8, log_every=2)
    fp16, fp32 = res["runs"]
    assert fp16["status"] == "diverged"
    step = fp16["diverged_at_step"]
    assert isinstance(step, int) and 0 < step < 8
    assert fp16["losses"][step] is None and all(v is not None for v in fp16["losses"][:step])
    assert fp16["val_acc"] is None
    assert fp32["status"] == "ok" and fp32["steps_done"] == 8 and fp32["val_acc"] is not None


@pytest.mark.parametrize("kw, name", [({"steps": 0}, "steps"), ({"d_model": 30, "heads": 4}, "d_model"),
                                      ({"lr": float("nan")}, "lr"), ({"optimizer_state": "int8"}, "optimizer_state"),
                                      ({"seq_len": 2}, "seq_len")])
def test_bad_settings_name_the_setting(kw, name):
    with pytest.raises(ValueError, match=name):
        _run("fp32", **kw)


def test_bad_precision_and_unknown_setting():
    with pytest.raises(ValueError, match="precisions"):
        _run("fp32,fp8")
    with pytest.raises(TypeError, match="stepz"):
        _run("fp32", stepz=3)


def test_bf16_without_support_names_capability(monkeypatch):
    monkeypatch.setattr(mpkern, "bf16_supported", lambda device=None: False)
    with pytest.raises(ValueError, match="capability.*fp16"):
        _run("fp32,bf16")
    chosen, skipped = compare.default_precisions("cpu")
    assert not any("bf16" in p for p in chosen) and "mpkern-bf16" in skipped


def test_plot_without_matplotlib_is_a_notice(monkeypatch, tmp_path, capsys):
    res = _run("fp32")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    paths = compare.write_outputs(res, str(tmp_path))
    assert "png" not in paths and (tmp_path / "results.json").exists()
    assert "matplotlib" in capsys.readouterr().out


def test_plot_with_matplotlib(tmp_path):
    pytest.importorskip("matplotlib")
    res = _run("fp32,mpkern-bf16")
    paths = compare.write_outputs(res, str(tmp_path))
    assert (tmp_path / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "png" in paths


def test_hf_model_from_a_local_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=2, vocab_size=100,
                             max_position_embeddings=16).save_pretrained(tmp_path)
    res = _run("fp32,mpkern-fp16", hf_model=str(tmp_path), steps=4, log_every=2)
    assert res["model"]["class"] == "LlamaForSequenceClassification"
    # the same model built here: the task's vocabulary (+1 padding id) and classes
    cfg = transformers.AutoConfig.from_pretrained(tmp_path)
    cfg.vocab_size, cfg.pad_token_id, cfg.num_labels = res["task"]["vocab"] + 1, res["task"]["vocab"], TINY["classes"]
    want = sum(p.numel() for p in transformers.AutoModelForSequenceClassification.from_config(cfg).parameters())
    assert res["model"]["params"] == want and all(r["params"] == want for r in res["runs"])
    assert all(r["status"] == "ok" for r in res["runs"])
    # Llama's projections are nn.Linear: the fp16 run swapped them for mpkern.nn.Linear (4 attn + 3 MLP + head)
    assert "mpkern.nn.Linear" in res["runs"][1]["linear"] and "8 layers" in res["runs"][1]["linear"]
    with pytest.raises(ValueError, match="hf_model"):
        _run("fp32", hf_model=str(tmp_path / "nope"))


def test_progress_without_tqdm_prints_plain_lines(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    compare.run("fp32", device="cpu", progress=True, plot=False, **TINY)
    err = capsys.readouterr().err
    assert f"fp32        : {TINY['steps']}/{TINY['steps']} steps" in err and "tok/s" in err
