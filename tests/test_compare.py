"""mpkern.compare: the synthetic task, the report's schema and numbers, divergence, errors.

Runs are tiny (a few steps of a 1-layer model) -- this checks what the report says, not speed.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import replace
from functools import partial

import pytest
import torch

import mpkern
from mpkern import compare
from mpkern.matmul import route_summary

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
    res = _run("mpkern-bf16", optimizer_state="remainder-bf16")
    assert res["runs"][0]["state_bytes_per_param"]["total"] == pytest.approx(2 + 2 + 2 + 4)


def test_8bit_state_applies_to_bf16_and_fp16():
    res = _run("mpkern-bf16,mpkern-fp16", optimizer_state="8bit")
    for r in res["runs"]:  # 16-bit param + grad, int8 correction, bf16 moments
        assert r["state_bytes_per_param"]["total"] == pytest.approx(2 + 2 + 1 + 4), r["name"]
        assert "'8bit'" in r["optimizer"]


@pytest.mark.parametrize("state, total", [("8bit-8bit", 7.125), ("remainder-8bit", 8.125)])
def test_8bit_moment_states(state, total):
    # 8-bit moments: 2.125 B/param with their scales (a tensor's short last group of 32 costs a
    # whole scale: a little more than 2.125 on the compare model's odd-sized tensors)
    res = _run("mpkern-bf16", optimizer_state=state)
    r = res["runs"][0]
    assert total <= r["state_bytes_per_param"]["total"] <= total + 0.05
    assert "state_dtype=8bit" in r["optimizer"]


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
    with pytest.raises(ValueError, match=r"capability.*fp16"):
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
    res = _run("fp32,mpkern-fp16", hf_model=str(tmp_path), steps=4, log_every=2, linear="mpkern")
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


# ---- native 16-bit compute, --linear auto, the time budget, the lessons (issue 14) -----------------
_X86 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512bw\n\n" \
       "processor\t: 1\nflags\t\t: fpu\n"
_ARM = "processor\t: 0\nFeatures\t: fp asimd fphp asimdhp bf16\n"


def test_cpu_flags_reads_the_first_cpu():
    assert compare.cpu_flags(_X86) == {"fpu", "sse", "avx2", "avx512f", "avx512_bf16", "avx512bw"}
    assert {"bf16", "fphp"} <= compare.cpu_flags(_ARM)
    assert compare.cpu_flags("model name: x\n") == set()


def _fake_timer(ms):
    """A timer that returns fixed milliseconds per candidate (and checks what it was given runs)."""
    def timer(fns, device, reps):
        for f in fns.values():
            f()
        return {k: ms[k] for k in fns}
    return timer


def test_compute_support_probe_gemms_are_the_named_dtypes(monkeypatch):
    """The probe's functions really multiply in fp32 / bf16 / fp16: each result against float64."""
    got = {}

    def timer(fns, device, reps):
        for k, f in fns.items():
            got[k] = f()
        return dict.fromkeys(fns, 1.0)

    compare.compute_support("cpu", 64, 48, 32, flags=set(), timer=timer)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 48, generator=g).double(), torch.randn(48, 32, generator=g).double()
    ref = a @ b
    for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        assert got[name].dtype == dt
        # inputs rounded to dt, fp32 accumulation, one rounding of the output: a few ulps of dt
        eps = torch.finfo(dt).eps
        assert (got[name].double() - ref).abs().max() <= 8 * eps * ref.abs().max(), name


@pytest.mark.parametrize("flags, ms, env, bf16_native, words", [
    ({"avx512_bf16"}, {"float32": 1.0, "bfloat16": 0.4, "float16": 50.0}, None, True, "avx512_bf16"),
    (set(), {"float32": 1.0, "bfloat16": 3.5, "float16": 50.0}, None, False, "emulates"),
    ({"avx512_bf16"}, {"float32": 1.0, "bfloat16": 3.0, "float16": 50.0}, "AVX512_CORE", False, "ONEDNN_MAX_CPU_ISA"),
])
def test_compute_support_decides_by_measurement(monkeypatch, flags, ms, env, bf16_native, words):
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    if env:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", env)
    else:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    s = compare.compute_support("cpu", 16, 16, 16, flags=flags, timer=_fake_timer(ms))
    assert s["bfloat16"]["native"] is bf16_native and words in s["bfloat16"]["why"]
    assert s["bfloat16"]["speed_vs_fp32"] == pytest.approx(1.0 / ms["bfloat16"])
    assert s["float16"]["native"] is False and s["cpu_flags"]["avx512_bf16"] == ("avx512_bf16" in flags)
    assert s["gemm"]["ms"] == ms and s["gemm"]["shape"] == [16, 16, 16]


def test_linear_shapes_of_the_classifier():
    cfg = compare.Config(**TINY, precisions=("fp32",))
    task = compare.make_task(cfg)
    model = compare.Classifier(task.vocab, cfg.seq_len, cfg.d_model, cfg.layers, cfg.heads, cfg.classes)
    shapes = compare.linear_shapes(model, task.x_train[:2])
    d, n = cfg.d_model, 2 * cfg.seq_len  # two sequences: every token goes through the block's layers
    block = [(n, d, 3 * d, True), (n, d, d, True), (n, d, 4 * d, True), (n, 4 * d, d, True)]
    assert shapes == block * cfg.layers + [(2, d, cfg.classes, True)]  # the head sees the pooled rows


@pytest.mark.parametrize("ms, chosen", [
    ({"torch": 2.0, "mpkern": 3.0}, "torch"),
    ({"torch": 3.0, "mpkern": 2.0}, "mpkern"),    # 1.5x faster: past the margin
    ({"torch": 2.2, "mpkern": 2.0}, "torch"),     # 1.1x: within the margin ATen's GEMM stays (no fp32 copies)
])
def test_choose_linear_takes_the_measured_faster_with_a_margin(ms, chosen):
    shapes = [(8, 16, 32, True), (8, 32, 16, False)]
    native = {"native": True, "speed_vs_fp32": 2.0}
    res = compare.choose_linear(shapes, torch.bfloat16, "cpu", native=native, timer=_fake_timer(ms))
    assert res["chosen"] == chosen and res["ms"] == ms and "measured" in res["why"]
    assert compare.choose_linear([], torch.bfloat16, "cpu")["chosen"] == "torch"


def test_choose_linear_follows_the_native_probe_without_timing_an_emulated_gemm():
    """A CPU the probe found emulating bf16 (0.04x fp32) takes mpkern's fp32 GEMM path whatever a
    (possibly load-disturbed) timing would say: the timer is not even called."""
    def timer(fns, device, reps):
        raise AssertionError("timed although the probe decided")

    res = compare.choose_linear([(8, 16, 32, True)], torch.bfloat16, "cpu",
                                native={"native": False, "speed_vs_fp32": 0.04}, timer=timer)
    assert res["chosen"] == "mpkern" and "0.04x" in res["why"] and res["ms"] == {}


def test_probe_timers_run_on_one_thread_and_interleave():
    """The GEMM probe and the Linear timing run on one torch thread (restored after), and the
    interleaved timer calls the candidates in turn."""
    seen, order = [], []

    def timer(fns, device, reps):
        seen.append(torch.get_num_threads())
        return dict.fromkeys(fns, 1.0)

    before = torch.get_num_threads()
    compare.compute_support("cpu", 8, 8, 8, flags=set(), timer=timer)
    compare.choose_linear([(8, 16, 32, True)], torch.bfloat16, "cpu", native={"native": True}, timer=timer)
    assert seen == [1, 1] and torch.get_num_threads() == before
    compare.probe._interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")},
                               torch.device("cpu"), 3)
    assert order == ["a", "b"] * 4  # one untimed call each, then three timed rounds in turn


@pytest.mark.parametrize("ms, threads", [({"1": 1.0, "2": 0.55}, 2), ({"1": 1.0, "2": 0.9}, 1),
                                         ({"1": 0.45, "2": 7.8}, 1)])
def test_choose_threads_keeps_all_threads_only_when_they_help(ms, threads, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    got = []
    monkeypatch.setattr(torch, "set_num_threads", got.append)
    monkeypatch.setattr(compare.probe.os, "cpu_count", lambda: 2)
    res = compare.probe.choose_threads(torch.device("cpu"), 0, 8, 8, 8, load=0.1, timer=_fake_timer(ms))
    assert res["threads"] == threads and got[-1] == threads and f"{ms['1'] / ms['2']:.2f}x" in res["why"]
    assert compare.probe.choose_threads(torch.device("cpu"), 3, 8, 8, 8)["threads"] == 3 and got[-1] == 3
    # another process busy over the last minute on 2 cores: one thread, without timing
    busy = compare.probe.choose_threads(torch.device("cpu"), 0, 8, 8, 8, load=1.2, timer=None)
    assert busy["threads"] == 1 and got[-1] == 1 and "load average is 1.20" in busy["why"]


def test_run_restores_torch_threads():
    before = torch.get_num_threads()
    res = _run("fp32", threads=1)
    assert res["config"]["threads"] == 1 and res["native_compute"]["threads"]["why"] == "--threads 1"
    assert torch.get_num_threads() == before


def test_auto_linear_follows_the_measurement(monkeypatch):
    """The 16-bit-param runs use what choose_linear picked, and the table says which ran."""
    for pick in ("mpkern", "torch"):
        monkeypatch.setattr(compare.probe, "choose_linear", lambda shapes, dt, dev, pick=pick, **kw: {
            "chosen": pick, "dtype": compare.DTYPE_NAME[dt], "why": "test", "ms": {}})
        res = _run("bf16-naive,mpkern-bf16")
        assert set(res["linear_choice"]) == {"bfloat16"}
        for r in res["runs"]:
            want = f"mpkern ({route_summary('cpu', torch.bfloat16).split(',')[0]})"  # e.g. "aten or upcast"
            assert r["gemm"] == (want if pick == "mpkern" else "ATen bf16"), r
            assert ("mpkern.nn.Linear" in r["linear"]) == (pick == "mpkern")
        assert "| bf16-naive | bfloat16 | bfloat16 | " + r["gemm"] + " |" in compare.format_table(res)
    res = _run("mpkern-bf16", linear="torch")
    assert res["linear_choice"] == {} and res["runs"][0]["gemm"] == "ATen bf16"


def test_fit_budget_cuts_steps_down_to_the_lesson_minimum():
    cfg = compare.Config(**(TINY | {"steps": 1000, "log_every": 20, "val_size": 300, "batch_size": 30}),
                         precisions=("fp32", "bf16"), time_budget=50.0, min_steps=400)
    def probe(ms):
        return lambda c, base, choice: {"fp32": ms / 2e3, "bf16": ms / 2e3}

    # 100 ms per step of both runs; validation 0.1 * 300 / 30 / 3 = 0.333 s; (50 - 0.333) / 0.1 = 496 -> 480
    new, plan = compare.fit_budget(cfg, None, probe=probe(100.0))
    assert new.steps == 480 and plan["steps"] == 480 and "would not fit" in plan["why"]
    new, plan = compare.fit_budget(cfg, None, probe=probe(20.0))  # 2483 fit: the configured 1000
    assert new.steps == 1000 and "fit" in plan["why"]
    new, plan = compare.fit_budget(cfg, None, probe=probe(500.0))  # 99 fit: never below min_steps
    assert new.steps == 400 and "over the budget" in plan["why"]
    assert plan["predicted_s"] == pytest.approx(0.5 * 400 + 0.5 * 300 / 30 / 3)
    new, plan = compare.fit_budget(replace(cfg, time_budget=None), None, probe=probe(500.0))
    assert new.steps == 1000 and plan["time_budget_s"] is None


def test_explicit_steps_turn_the_budget_off_and_the_budget_runs_the_probe(monkeypatch):
    res = _run("fp32")
    assert res["budget"]["time_budget_s"] is None and res["config"]["steps"] == TINY["steps"]
    seen = []

    def probe(c, base, choice):
        seen.append(c.precisions)
        return dict.fromkeys(c.precisions, 1e-4)

    monkeypatch.setattr(compare.budget, "probe_step_seconds", probe)
    monkeypatch.setattr(compare.budget, "fit_budget", partial(compare.fit_budget, probe=probe))
    res = _run("fp32,mpkern-bf16", time_budget=30.0, min_steps=3)
    assert seen == [("fp32", "mpkern-bf16")] and res["budget"]["time_budget_s"] == 30.0
    assert res["config"]["steps"] == TINY["steps"]  # the configured steps fit easily


def test_real_probe_times_every_run():
    cfg = compare.Config(**TINY, precisions=("fp32", "mpkern-bf16"))
    base = compare.Classifier(2 * cfg.classes + 2 + cfg.noise_vocab, cfg.seq_len, cfg.d_model, cfg.layers,
                              cfg.heads, cfg.classes)
    before = [p.detach().clone() for p in base.parameters()]
    step_s = compare.probe_step_seconds(cfg, base)
    assert set(step_s) == {"fp32", "mpkern-bf16"}
    assert all(0 < v["min"] <= v["median"] for v in step_s.values())
    assert all(torch.equal(a, b) for a, b in zip(before, base.parameters()))  # the base model is untouched


def _report(native: bool, naive_acc: float, device: str = "cpu"):
    why = "test reason"
    return {"runs": [{"name": "fp32", "val_acc": 1.0, "speedup_vs_fp32": 1.0},
                     {"name": "bf16-naive", "val_acc": naive_acc, "speedup_vs_fp32": 0.3},
                     {"name": "mpkern-bf16", "val_acc": 1.0, "speedup_vs_fp32": 0.4}],
            "config": {"lr": 1e-4}, "task": {"chance_acc": 1 / 32}, "device": {"type": device, "name": "x"},
            "native_compute": {"bfloat16": {"native": native, "why": why},
                               "float16": {"native": False, "why": why}}}


def test_lessons_are_worded_for_the_device():
    text = compare.lessons(_report(False, 0.06))
    assert "bf16-naive" in text[0] and "6.0 %" in text[0] and "mpkern-bf16 100.0 %" in text[0]
    assert "does not compute bf16 natively" in text[1] and "memory" in text[1] and "0.30x" in text[1]
    text = compare.lessons(_report(True, 0.06))
    assert "computes bf16 natively" in text[1] and "fp16" not in text[1]  # no fp16 run: no fp16 sentence
    assert "mpkern-bf16 0.40x" in text[1]
    for native in (True, False):
        assert not any("{" in t for t in compare.lessons(_report(native, 0.06)))  # every f-string formatted
    text = compare.lessons(_report(True, 0.98))
    assert "close to the runs with masters" in text[0]
    low = _report(True, 0.03)
    for r in low["runs"]:
        r["val_acc"] = 0.04
    assert "too few steps" in compare.lessons(low)[0]
    assert not any("caveat" in t for t in text)
    busy = _report(True, 0.06)
    busy["device"].update(other_processes_cores=0.9, cores=2, threads=2)
    assert "other processes used 0.90 of the 2 cores" in compare.lessons(busy)[-1]


def test_other_processes_cpu_is_measured_apart_from_ours(monkeypatch):
    """Others' cores = (all busy CPU seconds - ours) / wall seconds; then a real reading."""
    readings = iter([(10.0, 100.0, 5.0), (12.0, 103.5, 7.0)])  # (wall, all busy, ours) in seconds
    monkeypatch.setattr(compare.OthersCpu, "_now", staticmethod(lambda: next(readings)))
    assert compare.OthersCpu().cores() == pytest.approx((3.5 - 2.0) / 2.0)
    monkeypatch.undo()
    meter = compare.OthersCpu()
    if meter.start is None:
        pytest.skip("no /proc/stat")
    time.sleep(0.3)
    got = meter.cores()  # /proc/stat counts in 10 ms ticks: allow a few ticks over the core count
    assert got is not None and 0.0 <= got <= (os.cpu_count() or 1) + 0.2


# ---- the compact run, the CPU peak, the time box, --find-batch ------------------------------------
def test_default_cpu_runs_show_the_compact_mode():
    chosen, skipped = compare.default_precisions("cpu")
    assert {"fp32", "bf16-naive", "mpkern-bf16", "mpkern-8bit"} <= set(chosen)
    assert "mpkern-fp16" in skipped and "--precision" in skipped["mpkern-fp16"] and "fp16" in skipped


def test_compact_run_keeps_the_fewest_bytes_and_the_lesson_says_what_each_mode_saves():
    res = _run("fp32,mpkern-bf16,mpkern-8bit", linear="torch")
    runs = {r["name"]: r for r in res["runs"]}
    compact = runs["mpkern-8bit"]
    assert "master_weights='8bit'" in compact["optimizer"] and "state_dtype=8bit" in compact["optimizer"]
    # bf16 param + bf16 grad + int8 master correction + two int8 moments = 7 B; + a bf16 scale per 32 per moment
    assert 7.0 < compact["state_bytes_per_param"]["total"] <= 7.2
    line = next(t for t in res["lessons"] if t.startswith("mpkern modes:"))
    assert "mpkern-bf16" in line and "mpkern-8bit" in line and "less training state than fp32" in line
    # CPU peak = persistent state + the tensors of a steady step: the compact bf16 run needs less than fp32
    assert all(r["peak_mem_kind"].startswith("tensor bytes") for r in res["runs"])
    assert compact["peak_mem_bytes"] < runs["mpkern-bf16"]["peak_mem_bytes"] < runs["fp32"]["peak_mem_bytes"]
    for r in res["runs"]:
        persistent = r["state_bytes"]["total"] - r["state_bytes"]["grads"]
        assert r["peak_mem_bytes"] >= persistent + r["state_bytes"]["grads"]  # the grads exist at the step's peak


# ---- --release: each mpkern run again with gradient release (issue 30) -----------------------------
def test_release_run_sits_beside_its_mpkern_run_and_trains_bit_identically(tmp_path):
    res = _run("fp32,mpkern-bf16", release=True, out=str(tmp_path))
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["config"]["release"] is True
    assert [r["name"] for r in on_disk["runs"]] == ["fp32", "mpkern-bf16", "mpkern-bf16+release"]
    _, reg, rel = on_disk["runs"]
    assert "release_grads=True" in rel["optimizer"] and "opt.backward(loss)" in rel["clip"]
    assert rel["status"] == "ok" and rel["tokens_per_s"] > 0 and rel["peak_mem_bytes"] > 0
    # bit-identical training: every step's loss and the final loss are exactly the regular run's
    assert rel["losses"] == reg["losses"] and rel["final_loss"] == reg["final_loss"]
    info = rel["release"]
    assert info["of"] == "mpkern-bf16" and info["same_losses"] is True
    assert info["backward_passes"] == 2  # compare clips: pass 1 the statistics, pass 2 the step
    assert info["tokens_per_s_vs_regular"] == pytest.approx(rel["tokens_per_s"] / reg["tokens_per_s"])
    assert info["peak_mem_vs_regular"] == pytest.approx(rel["peak_mem_bytes"] / reg["peak_mem_bytes"])
    # the default bucket (32 MiB) holds this tiny model's whole gradient at once
    assert info["peak_grad_bytes"] == info["grad_bytes_all"] == rel["state_bytes"]["grads"] > 0
    md = (tmp_path / "results.md").read_text()
    assert "| mpkern-bf16+release | bfloat16 |" in md
    line = next(t for t in res["lessons"] if t.startswith("Gradient release: mpkern-bf16+release"))
    assert "bit-identical" in line and "fits one bucket" in line and "tokens/s" in line and "peak mem" in line


def test_release_with_small_buckets_frees_grads_early_in_every_mpkern_run():
    res = _run("mpkern-8bit,mpkern-fp16", release=True, release_bucket_bytes=2048)
    runs = {r["name"]: r for r in res["runs"]}
    assert list(runs) == ["mpkern-8bit", "mpkern-8bit+release", "mpkern-fp16", "mpkern-fp16+release"]
    for name in ("mpkern-8bit", "mpkern-fp16"):
        reg, rel = runs[name], runs[name + "+release"]
        assert rel["losses"] == reg["losses"] and rel["final_loss"] == reg["final_loss"], name
        assert rel["release"]["bucket_bytes"] == 2048
        assert 0 < rel["release"]["peak_grad_bytes"] < rel["release"]["grad_bytes_all"]
        assert rel["state_bytes_per_param"]["total"] < reg["state_bytes_per_param"]["total"]
    assert runs["mpkern-fp16+release"]["loss_scale_history"] == runs["mpkern-fp16"]["loss_scale_history"]


def test_release_settings_are_checked():
    with pytest.raises(ValueError, match="release"):
        _run("fp32", release=True)  # no mpkern run to release
    with pytest.raises(ValueError, match="precisions"):
        _run("bf16-naive+release")
    with pytest.raises(ValueError, match="release_bucket_bytes"):
        _run("mpkern-bf16", release=True, release_bucket_bytes=0)


def test_live_bytes_counts_each_tensor_from_creation_to_free():
    from mpkern.compare.memory import live_peak

    def step():
        a = torch.empty(1000)                       # 4000 B
        b = torch.empty(500, dtype=torch.float64)   # 4000 B: 8000 live
        del a
        c = torch.empty(250)                        # 1000 B: 5000 live
        return b, c

    assert live_peak(step)[1] == 8000


@pytest.mark.parametrize("rows, block_bytes", [(24, 1 << 30), (200, 64 * 4 * (24 + 40))])
def test_live_bytes_counts_mpkern_linear_cpu_temporaries(monkeypatch, rows, block_bytes):
    """The fp32 temporaries inside mpkern.linear's upcast route (which a dispatch mode cannot see) are in
    the peak: one shot -- x and w copies, the fp32 product and the output made before it; in row blocks
    (64 rows here) -- the w copy, the output and one block. The blocked result matches float64 within
    bf16 rounding."""
    from mpkern import matmul_routes

    monkeypatch.setattr(matmul_routes, "CPU_BLOCK_BYTES", block_bytes)
    monkeypatch.setenv("MPKERN_MATMUL_ROUTE", "upcast")
    g = torch.Generator().manual_seed(3)
    k, n = 24, 40
    x = (torch.randn(rows, k, generator=g) + 0.5).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) - 0.25).to(torch.bfloat16)
    from mpkern.compare.memory import LiveBytes

    with LiveBytes() as meter:
        out = mpkern.linear(x, w)
    if block_bytes >= 1 << 30:
        temps = 4 * rows * k + 4 * n * k + 4 * rows * n + 2 * rows * n  # x32, w32, fp32 product, the output
    else:
        temps = 4 * n * k + 2 * rows * n + 64 * 4 * (k + n)  # w32, output, one 64-row block (copy + product)
    assert meter.gemm_temp_peak == temps and meter.peak == temps
    ref = x.double() @ w.double().t()
    assert (out.double() - ref).abs().max() <= 2 * torch.finfo(torch.bfloat16).eps * ref.abs().max()


def test_time_boxes_pick_the_runs_many_times_slower_than_fp32():
    boxes = compare.budget.time_boxes({"fp32": 0.01, "bf16": 0.039, "mpkern-bf16": 0.04})
    assert set(boxes) == {"mpkern-bf16"} and boxes["mpkern-bf16"]["slower"] == pytest.approx(4.0)
    assert compare.budget.time_boxes({"fp32": 0.01}) == {}
    # a run the native probe found emulated is boxed even when load made its probed step look fast
    boxes = compare.budget.time_boxes({"fp32": 0.01, "bf16": 0.012}, {"bf16": "emulated here"})
    assert set(boxes) == {"bf16"} and boxes["bf16"]["why"].startswith("emulated here; the probe measured")


@pytest.mark.parametrize("native, linear, boxed", [
    (False, "mpkern", {"bf16"}),                                  # AVX2-only CPU: autocast bf16 boxed
    (False, "torch", {"bf16", "bf16-naive", "mpkern-bf16"}),      # forced ATen bf16 GEMMs: all boxed
    (True, "torch", set()),                                       # native bf16: nothing boxed
])
def test_emulated_runs_come_from_the_native_probe(native, linear, boxed):
    cfg = compare.Config(**TINY, precisions=("fp32", "bf16", "bf16-naive", "mpkern-bf16"), linear=linear)
    support = {"bfloat16": {"native": native, "speed_vs_fp32": 2.0 if native else 0.05},
               "float16": {"native": False, "speed_vs_fp32": 0.02}}
    got = compare.budget.emulated_runs(cfg, support)
    assert set(got) == boxed and all("0.05x" in why for why in got.values())
    assert compare.budget.emulated_runs(replace(cfg, device="cuda"), support) == {}


def test_a_slow_run_is_time_boxed_and_the_report_says_so(monkeypatch):
    def probe(c, base, choice):
        return {"fp32": 1e-3, "mpkern-bf16": 1e-2}

    monkeypatch.setattr(compare.budget, "TIME_BOX_S", 0.0)
    monkeypatch.setattr(compare.budget, "fit_budget", partial(compare.budget.fit_budget, probe=probe))
    res = _run("fp32,mpkern-bf16", time_budget=30.0, min_steps=3)
    fp32, boxed = res["runs"]
    assert fp32["status"] == "ok" and fp32["steps_done"] == TINY["steps"]
    assert boxed["status"] == "stopped" and boxed["steps_done"] == TINY["warmup"] + 1 < TINY["steps"]
    assert boxed["tokens_per_s"] > 0 and boxed["val_acc"] is not None and math.isfinite(boxed["final_loss"])
    assert res["budget"]["time_boxed"]["mpkern-bf16"]["slower"] == pytest.approx(10.0)
    assert "time-boxed: stopped at step 2" in compare.format_table(res)
    assert any(t.startswith("Time box: mpkern-bf16 stopped at step 2 of 6") for t in res["lessons"])


def test_find_batch_grows_each_run_until_it_no_longer_fits(tmp_path):
    budget = 640 * 1024
    compare.run("fp32,mpkern-8bit", device="cpu", progress=False, plot=False, out=str(tmp_path), find_batch=True,
                memory_budget=budget, linear="torch", **(TINY | {"steps": 2, "batch_size": 8}))
    with open(tmp_path / "results.json") as f:
        data = json.load(f)
    assert data["memory_budget_bytes"] == budget
    for name in ("fp32", "mpkern-8bit"):
        s = data["batch_scaling"][name]
        pts = {p["batch_size"]: p for p in s["points"]}
        for p in s["points"]:
            assert {"batch_size", "tokens_per_s", "peak_mem_bytes", "status", "val_acc"} <= set(p)
            assert p["status"] in ("ok", "over_budget"), p
            if p["status"] == "ok":
                assert p["peak_mem_bytes"] <= budget and p["tokens_per_s"] > 0 and p["val_acc"] is not None
            else:
                assert p["peak_mem_bytes"] > budget
        best = s["max_batch_size"]
        assert pts[best]["status"] == "ok"
        next_up = min(b for b in pts if b > best)
        assert pts[next_up]["status"] == "over_budget"
        assert next_up - best <= max(1, best // 8)  # bisected close to the limit
    scaling = data["batch_scaling"]
    assert scaling["mpkern-8bit"]["max_batch_size"] > scaling["fp32"]["max_batch_size"]
    assert data["batch_ratio_vs_fp32"]["mpkern-8bit"] > 1.0
    with pytest.raises(ValueError, match="memory-budget"):
        compare.run("fp32", device="cpu", progress=False, plot=False, find_batch=True, **TINY)


def test_batch_search_doubles_then_bisects():
    tried = []

    def fits(b):
        tried.append(b)
        return b <= 100

    assert compare.batch.search(fits, 8) == (96, 104)
    assert tried[:5] == [8, 16, 32, 64, 128]
    tried.clear()
    assert compare.batch.search(fits, 512)[0] == 96 and tried[:4] == [512, 256, 128, 64]
    assert compare.batch.search(lambda b: False, 4) == (0, 1)


def test_find_batch_counts_an_out_of_memory_error_as_not_fitting(monkeypatch):
    """The CUDA path: an OutOfMemoryError at a batch size is caught and that size does not fit (faked
    here -- no GPU needed to check that the search stops below it)."""
    def train_one(name, c, task, base, **kw):
        if c.batch_size > 24:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return {"status": "ok", "peak_mem_bytes": 1000 * c.batch_size, "tokens_per_s": 1.0, "val_acc": 0.5,
                "skipped_steps": 0, "final_loss": 1.0}

    monkeypatch.setattr(compare.batch, "train_one", train_one)
    cfg = compare.Config(**TINY, precisions=("fp32",))
    res = compare.batch.find_batch(cfg, None, 10**9, log=lambda s: None)["fp32"]
    pts = {p["batch_size"]: p for p in res["points"]}
    assert res["max_batch_size"] == 24 and pts[24]["status"] == "ok"
    assert res["first_not_fitting"] == 26 and pts[26]["status"] == "oom" and pts[26]["peak_mem_bytes"] is None
    assert all(p["status"] == "oom" for b, p in pts.items() if b > 24)
