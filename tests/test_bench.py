"""mpkern.bench: what it says it runs, and peers that do what a real user would do (issue 13 item 12)."""

from __future__ import annotations

import inspect
import itertools
import os

import pytest
import torch

from conftest import requires_cuda
from mpkern import bench, bytemodel
from mpkern.bench.common import backward_step


def test_run_docstring_gives_the_sizes_the_code_uses():
    doc = " ".join(bench.run.__doc__.split())
    for mode, size in (("full", bench.FULL), ("quick", bench.QUICK)):
        said = f"{size['params'] // 10**6}M params in {size['tensors']} tensors, {size['reps']} repetitions"
        assert said in doc, (mode, said)
    probe = inspect.signature(bench.measure_bandwidth).parameters["nbytes"].default
    assert f"probe is {probe >> 20} MiB in both" in doc
    cpu_quick, cpu_full = bench.matmul.TOKENS["cpu"]
    gpu_quick, gpu_full = bench.matmul.TOKENS["cuda"]
    assert f"with {cpu_quick} tokens (quick, CPU; the large ones left out) or {cpu_full} (CPU), {gpu_quick} or " \
           f"{gpu_full} (CUDA" in doc


def test_matmul_problems_are_the_linear_layers_gemms():
    """Each model layer gives its three GEMMs in nn.Linear's layouts, with shapes that multiply."""
    probs = {name: (m, n, k, make) for name, m, n, k, make in bench.matmul_problems("cpu", quick=False)}
    t = bench.matmul.TOKENS["cpu"][1]
    for model, layer, k_in, n_out in bench.MODEL_LAYERS:
        tag = f"{model} {layer} T={t}"
        assert probs[f"{tag} fwd"][:3] == (t, n_out, k_in)
        assert probs[f"{tag} dgrad"][:3] == (t, k_in, n_out)
        assert probs[f"{tag} wgrad"][:3] == (n_out, k_in, t)
    m, n, k, make = probs[f"gpt2-small attn.c_proj T={t} wgrad"]
    a, b = make(torch.bfloat16, torch.device("cpu"))
    assert a.shape == (m, k) and b.shape == (k, n) and a.stride(0) == 1  # dY.T: a transposed view, no copy


def _wgrad_problem(device, tokens=4096, n_out=24, k_in=20, seed=0):
    """nn.Linear's weight-gradient GEMM in its layouts: grad_out.t() @ x, and a random fp32 main_grad."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(tokens, n_out, generator=g).to(torch.bfloat16).to(device).t()
    b = torch.randn(tokens, k_in, generator=g).to(torch.bfloat16).to(device)
    mg = torch.randn(n_out, k_in, generator=g).to(device)
    return a, b, mg


def _check_peer_accumulates_in_fp32(device):
    a, b, mg = _wgrad_problem(device)
    want = mg.double() + a.double() @ b.double()
    mag = mg.double().abs() + a.double().abs() @ b.double().abs()
    name, fn = bench.wgrad_accumulate_peer(device)
    out = fn(a, b, mg)
    assert out.data_ptr() == mg.data_ptr() and mg.dtype == torch.float32  # accumulated in place
    err = float(((mg.double() - want).abs() / mag).max())
    # fp32 accumulation: ~K * 2^-24 at worst; a product rounded to bf16 first would be ~2^-9
    assert err < 1e-5, (name, err)
    return name


def test_wgrad_peer_accumulates_in_fp32_on_cpu():
    assert _check_peer_accumulates_in_fp32("cpu")


@requires_cuda
def test_wgrad_peer_accumulates_in_fp32_on_cuda():
    _check_peer_accumulates_in_fp32("cuda")


def test_the_fp32_check_catches_a_bf16_rounded_product():
    """The check above tells the old peer apart: main_grad.add_(a @ b) rounds a @ b to bf16 first."""
    a, b, mg = _wgrad_problem("cpu")
    want = mg.double() + a.double() @ b.double()
    mag = mg.double().abs() + a.double().abs() @ b.double().abs()
    rounded = mg.clone().add_(torch.matmul(a, b))
    assert float(((rounded.double() - want).abs() / mag).max()) > 1e-4


# ---- AdamW: compact storage modes, torchao, host time (issue 15) ---------------------------------
def test_adamw_modes_default_all_and_lists():
    from mpkern.optim import storage

    moments = storage.MOMENT_KINDS
    default = bench.adamw_modes("default")
    assert default == [m for m in bench.DEFAULT_ADAMW_MODES if m[1] in moments]
    assert default[:3] == [(True, "float32"), ("remainder", "bfloat16"), ("8bit", "bfloat16")]
    assert (("8bit", "8bit") in default) == ("8bit" in moments)  # present exactly when the kind is
    assert bench.adamw_modes("all") == [(mw, sd) for mw in storage.MASTER_KINDS for sd in moments]
    assert bench.adamw_modes("none") == []
    assert bench.adamw_modes("remainder:bf16, false:fp32,fp32:bfloat16") == [
        ("remainder", "bfloat16"), (False, "float32"), (True, "bfloat16")]
    for bad in ("remainder", "8bits:bf16", "true:int4"):
        with pytest.raises(ValueError, match="master:moments"):
            bench.adamw_modes(bad)


def test_step_bytes_come_from_the_storage_descriptions():
    """One count: grad read by the pre-pass and the step, state read + written, param written (and
    read unless an fp32 master holds the value) -- and it agrees with bytemodel and DESIGN.md."""
    from mpkern.optim import storage

    assert bench.step_bytes_per_param(True, "float32") == bytemodel.STEP_TRAFFIC["mpkern"] == 30
    for mw, sd in bench.adamw_modes("all"):
        state = storage.state_bytes_per_param(mw, sd, torch.bfloat16)
        param_rw = 2 if mw is True else 4
        assert bench.step_bytes_per_param(mw, sd) == 2 + 2 + param_rw + 2 * state, (mw, sd)
        assert bench.step_bytes_per_param(mw, sd, clip=False) == 2 + param_rw + 2 * state
    if "8bit" in storage.MOMENT_KINDS:  # DESIGN.md's compact-state traffic
        assert bench.step_bytes_per_param("8bit", "8bit") == pytest.approx(14.25)
        assert bench.step_bytes_per_param("remainder", "8bit") == pytest.approx(16.25)


def test_adamw_mode_rows_carry_the_byte_model_and_the_baseline_ratio():
    from mpkern.optim import storage

    rows = bench.bench_adamw_modes("cpu", params=6000, tensors=3, reps=1, modes="default",
                                   bandwidth={"inplace_GBps": 1.0, "copy_GBps": 2.0}, baseline_s=0.05,
                                   log=lambda s: None)
    assert [(r["master_weights"], r["state_dtype"]) for r in rows] == bench.adamw_modes("default")
    for r in rows:
        mw, sd = r["master_weights"], r["state_dtype"]
        assert r["kernel"] == "adamw" and bench.mode_label(mw, sd) in r["method"]
        assert r["bytes_per_param"] == bench.step_bytes_per_param(mw, sd)
        assert r["state_bytes_per_param"] == storage.state_bytes_per_param(mw, sd, torch.bfloat16)
        if r["ms"] is None:  # a mode this build's kernels cannot run yet: said, not raised
            assert r["note"].startswith("failed:")
            continue
        assert r["byte_model_limit"] == pytest.approx(bytemodel.STEP_TRAFFIC["amp_fp32"] / r["bytes_per_param"])
        assert r["mpkern_speedup"] == pytest.approx(50.0 / r["ms"]) and r["vs"] == bench.BASELINE
        assert r["rate"] == pytest.approx(r["bytes_per_param"] * 6000 / (r["ms"] / 1e3) / 1e9)
        assert r["pct_of_bound"] == pytest.approx(100 * r["rate"] / 1.0) and r["bound"] == "in-place bandwidth"
        # the allocated state agrees with the descriptions (8-bit moments: a short last group of
        # scales costs its whole scale)
        assert r["state_bytes_measured"] == pytest.approx(r["state_bytes_per_param"], abs=0.02)
    assert rows[0]["ms"] is not None  # fp32 + fp32 always runs
    table = bench.format_table(rows)
    assert "state B/param" in table and f"vs {bench.BASELINE}" in table


def test_time_alternating_runs_each_setup_before_its_fn_in_rounds(monkeypatch):
    from mpkern import measure

    clock = iter(range(1000))  # perf_counter: 0, 1, 2, ... -> every timed call lasts exactly 1 "second"
    monkeypatch.setattr(measure.time, "perf_counter", lambda: float(next(clock)))
    calls: list[str] = []
    fns = [(lambda: calls.append("a"), lambda: calls.append("sa")), (lambda: calls.append("b"), None)]
    out = measure.time_alternating(fns, torch.device("cpu"), reps=2, warmup=1)
    assert calls == ["sa", "a", "b"] * 3 and out == [1.0, 1.0]
    with pytest.raises(ValueError, match="reps"):
        measure.time_alternating(fns, torch.device("cpu"), reps=0)
    with pytest.raises(ValueError, match="fns"):
        measure.time_alternating([], torch.device("cpu"))


def test_adamw_mode_rows_time_their_baseline_in_alternation():
    rows = bench.bench_adamw_modes("cpu", params=6000, tensors=3, reps=2, modes=[(True, "float32")],
                                   bandwidth={"inplace_GBps": 1.0, "copy_GBps": 2.0}, log=lambda s: None)
    (r,) = rows
    assert r["baseline_ms"] > 0 and r["mpkern_speedup"] == pytest.approx(r["baseline_ms"] / r["ms"])
    assert "timed in alternation" in r["vs"]


def test_state_nbytes_counts_inner_tensors_of_subclasses_once():
    from types import SimpleNamespace

    a = torch.zeros(1000)
    opt = SimpleNamespace(state=None)  # only .state is read
    opt.state = {0: {"step": torch.tensor(3.0), "exp_avg": a, "alias": a[:10]}, 1: {"exp_avg_sq": torch.zeros(
        7, dtype=torch.bfloat16)}}
    assert bench.state_nbytes(opt) == 4000 + 14  # 0-dim step not counted, the alias once
    sub8 = pytest.importorskip("torchao.optim.subclass_8bit")
    q = sub8.OptimState8bit.zeros((8192,), True, 256, "cpu")
    opt.state = {0: {"exp_avg": q}}
    assert bench.state_nbytes(opt) == 8192 + 4 * 8192 // 256 + 4 * 256  # codes, scales, qmap


def test_torchao_rows_say_not_installed(monkeypatch):
    monkeypatch.setattr(bench.torchao_peers, "torchao_optim", lambda: (None, "", "not installed (pip install torchao)"))
    rows = bench.bench_torchao("cpu", params=8192, tensors=1, reps=1, log=lambda s: None)
    assert len(rows) == len(bench.TORCHAO_CASES)
    assert all(r["ms"] is None and "not installed" in r["method"] for r in rows)
    assert "not installed" in bench.format_table(rows)


def test_torchao_rows_measure_state_from_the_tensors():
    pytest.importorskip("torchao")
    mod, version, why = bench.torchao_optim()
    if mod is None:
        pytest.skip(why)
    # the bf16 stochastic-rounding AdamW only: it compiles in ~1 s (AdamW8bit takes longer cold)
    case = next(c for c in bench.TORCHAO_CASES if c[1] == "_AdamW")
    rows = bench.bench_torchao("cpu", params=8192, tensors=2, reps=1, baseline_s=0.01, baseline_params=10000,
                               cases=(case,), log=lambda s: None)
    (r,) = rows
    if r["ms"] is None:  # e.g. inductor lacks a compiler here: said in the row
        pytest.skip(r["note"])
    assert r["api"].endswith("._AdamW") and r["kwargs"] == {"bf16_stochastic_round": True}
    assert r["params"] == 8192 and r["torchao_version"] == version
    assert r["state_bytes_per_param"] == 4.0  # bf16 exp_avg + exp_avg_sq, no master
    assert r["mpkern_speedup"] == pytest.approx((0.01 / 10000) / (r["ms"] / 1e3 / 8192))


def test_host_time_rows_are_us_per_tensor():
    modes = bench.adamw_modes("default")
    rows = bench.bench_host_time("cpu", tensors=20, numel=16, reps=2, log=lambda s: None)
    assert len(rows) == len(modes) + 1 and "torch fused AdamW" in rows[-1]["method"]
    t_ref = rows[-1]["ms"]
    for r, (mw, sd) in zip(rows, modes):
        assert bench.mode_label(mw, sd) in r["method"]
        if r["ms"] is None:
            assert r["note"].startswith("failed:")
            continue
        assert r["unit"] == "us/tensor" and r["rate"] == pytest.approx(r["ms"] * 1e3 / 20)
        assert r["mpkern_speedup"] == pytest.approx(t_ref / r["ms"]) and r["byte_model_limit"] is None
    assert rows[0]["ms"] is not None
    assert "us/tensor" in bench.format_table(rows)


def test_host_time_script_is_a_wrapper_of_bench():
    assert "FusedAdamWMP" in inspect.getsource(bench.host_time)
    with open(os.path.join(os.path.dirname(__file__), "..", "benchmarks", "host_time.py")) as f:
        text = f.read()
    assert "bench.host_time(" in text and "FusedAdamWMP(" not in text  # no second implementation


def test_adamw_options_reach_run():
    import argparse

    ap = argparse.ArgumentParser()
    bench.add_adamw_arguments(ap)
    kw = bench.adamw_run_kwargs(ap.parse_args(["--modes", "all", "--torchao-params", "1e6", "--no-host-time"]))
    assert kw == {"modes": "all", "torchao": True, "torchao_params": 1_000_000, "host": False}
    assert bench.adamw_run_kwargs(argparse.Namespace()) == {"modes": "default", "torchao": True,
                                                            "torchao_params": None, "host": True}
    with pytest.raises(ValueError, match="master:moments"):  # before anything is timed
        bench.run("adamw", device="cpu", modes="bogus", log=lambda s: None)
    with pytest.raises(ValueError, match="torchao_params"):
        bench.run("adamw", device="cpu", torchao_params=0, log=lambda s: None)


# ---- gradient release beside the regular step (issue 30 item 5) ----------------------------------
TINY_RELEASE = {"d_model": 32, "layers": 1, "heads": 2, "seq_len": 8, "batch": 2, "bucket_bytes": 4096}


def test_release_rows_time_every_variant_and_check_the_bits():
    rows = bench.bench_release("cpu", quick=True, reps=1, size=TINY_RELEASE, linear="torch", log=lambda s: None)
    by = {r["variant"]: r for r in rows}
    assert list(by) == ["a", "b", "c", "bound", "d", "e", "f"]
    tokens = TINY_RELEASE["batch"] * TINY_RELEASE["seq_len"]
    for r in rows:
        assert r["kernel"] == "release" and r["ms"] > 0 and r["unit"] == "tokens/s"
        assert r["rate"] == pytest.approx(tokens / (r["ms"] / 1e3))
    # (c) plus the extra backward pass (f) - (e), which is floored at 0 where the timings cannot resolve it
    assert by["bound"]["ms"] == pytest.approx(by["c"]["ms"] + max(by["f"]["ms"] - by["e"]["ms"], 0.0))
    assert by["b"]["mpkern_speedup"] == pytest.approx(by["a"]["ms"] / by["b"]["ms"]) and by["b"]["vs"] == "(a)"
    assert by["d"]["mpkern_speedup"] == pytest.approx(by["bound"]["ms"] / by["d"]["ms"])
    assert by["b"]["backward_passes"] == 1 and by["d"]["backward_passes"] == 2
    assert by["b"]["bit_identical"] and by["d"]["bit_identical"]  # release steps the same bits as step()
    assert "bit-identical to (a)" in by["b"]["method"] and by["b"]["bucket_bytes"] == 4096
    table = bench.format_table(rows)
    assert "goal: >= 0.952x" in table and "(d) release, two passes" in table
    with pytest.raises(ValueError, match="linear"):
        bench.bench_release("cpu", quick=True, reps=1, size=TINY_RELEASE, linear="cublas", log=lambda s: None)


def test_release_sizes_are_the_ones_run_documents():
    from mpkern.compare import Classifier

    doc = " ".join(bench.run.__doc__.split())
    for key, size in bench.RELEASE_SIZES.items():
        with torch.device("meta"):
            n = sum(p.numel() for p in Classifier(512, size["seq_len"], size["d_model"], size["layers"],
                                                  size["heads"], 32).parameters())
        assert f"{key} {n / 1e6:.1f}M params" in doc, (key, n)


def _release_memory_script():
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "release_memory.py")
    spec = importlib.util.spec_from_file_location("release_memory", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("release", [False, True])
def test_release_memory_meter_follows_each_grad_until_freed(release):
    """benchmarks/release_memory.py's meter: the regular step holds every grad at once; release holds
    what the optimizer's buckets held (its own count), and no grad outlives either step."""
    import mpkern

    rm = _release_memory_script()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)]).to(torch.bfloat16)
    params = list(model.parameters())
    meter = rm.GradMeter(params)
    extra = {"release_grads": True, "release_bucket_bytes": 3 * 64 * 64 * 2} if release else {}
    opt = mpkern.FusedAdamWMP(params, lr=1e-3, max_grad_norm=1.0, **extra)
    x = torch.randn(4, 64).to(torch.bfloat16)
    for _ in range(2):
        meter.reset()
        backward_step(opt, model(x).float().square().mean())
    every = sum(p.numel() * 2 for p in params)
    if release:
        assert meter.peak == opt.mpkern_runtime.release.peak_bytes < every
    else:
        assert meter.peak == every
    assert meter.live == 0


def test_linear_e2e_times_three_models_side_by_side():
    """bench_linear_e2e runs a transformers model with torch's Linear, converted, and converted with
    fp32 main_grad, and reports the converted ones against the first (a smoke run: tiny sequence)."""
    pytest.importorskip("transformers")
    lines = []
    rows = bench.bench_linear_e2e("cpu", model="llama", seq=16, reps=1, log=lines.append)
    assert [r["method"].split(":")[0] for r in rows] == ["torch.nn.Linear", "mpkern.nn.convert",
                                                         "mpkern.nn.convert(fp32_main_grad)"]
    assert all(r["ms"] > 0 for r in rows) and rows[0]["mpkern_speedup"] is None
    assert all(r["mpkern_speedup"] > 0 for r in rows[1:]) and "29 Linear converted" in rows[1]["method"]
    with pytest.raises(ValueError, match="model must be"):
        bench.bench_linear_e2e("cpu", model="bert")


def test_time_alternating_rotates_the_order_so_each_call_follows_each_other():
    from mpkern.measure import time_alternating

    order = []
    fns = [(lambda k=k: order.append(k), None) for k in range(3)]
    time_alternating(fns, torch.device("cpu"), reps=6, warmup=0, rotate=True)
    follows = set(itertools.pairwise(order))
    assert order[:3] == [0, 1, 2] and order[3:6] == [1, 2, 0] and order[6:9] == [2, 0, 1]
    assert {(a, b) for a in range(3) for b in range(3) if a != b} <= follows
    order.clear()
    time_alternating(fns, torch.device("cpu"), reps=2, warmup=0)
    assert order == [0, 1, 2, 0, 1, 2]
