"""The matmul routes: the contract probe, forcing, the timed choice and its cache (memory and disk).

The numbers of every route against float64 are in tests/test_matmul.py (parametrized by route);
here: which route runs, when timing happens, and that the disk cache is plain, tolerant data.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import mpkern
from conftest import DEVICE
from mpkern import matmul_routes, route_cache
from mpkern.matmul import linear, matmul, matmul_accumulate_, routes, use_route

CPU_ONLY = pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU routes (aten / upcast) are tested on CPU")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh cache folder and nothing remembered in memory, before and after."""
    monkeypatch.setenv("MPKERN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MPKERN_MATMUL_ROUTE", raising=False)
    monkeypatch.delenv("MPKERN_MATMUL_ROUTE_CACHE", raising=False)
    matmul_routes.forget()
    yield tmp_path
    matmul_routes.forget()


@pytest.fixture
def fake_timer(monkeypatch):
    """Route timings without a clock: ``times[route]`` seconds; ``calls`` counts the timings. ATen's
    16-bit GEMM counts as keeping the contract here whatever this CPU's probe says (an AVX2-only CPU
    may emulate bf16): these tests are about the choice, not the numbers."""
    monkeypatch.setattr(matmul_routes, "aten_accumulates_in_fp32", lambda dtype, bias: True)
    state = {"times": {"aten": 2.0, "upcast": 1.0, "triton": 3.0, "cublas": 0.5}, "calls": []}

    def seconds(fn, device, reps):
        fn()
        route = next(r for r, f in matmul_routes._RUNS.items() if f is fn.func)
        state["calls"].append(route)
        return state["times"][route]

    monkeypatch.setattr(route_cache, "_seconds", seconds)
    return state


def _bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _blocked_bf16_matmul(a, b, block=256):
    """A GEMM that rounds its running sum to bf16 after every K block: what the probe must reject."""
    acc = torch.zeros(a.shape[0], b.shape[1], dtype=torch.bfloat16)
    for i in range(0, a.shape[1], block):
        acc = (acc.float() + a[:, i:i + block].float() @ b[i:i + block].float()).to(torch.bfloat16)
    return acc


def test_contract_check_accepts_fp32_accumulation_and_rejects_16_bit_partial_sums():
    a, b = _bf16(32, 3072, seed=1), _bf16(3072, 48, seed=2)
    exact = (a.double() @ b.double()).float().to(torch.bfloat16)  # fp32-accumulated, rounded once
    assert matmul_routes.rounds_once_from_fp32(exact, a, b)
    assert not matmul_routes.rounds_once_from_fp32(_blocked_bf16_matmul(a, b), a, b)
    bias = _bf16(48, seed=3)
    with_bias = (a.double() @ b.double() + bias.double()).float().to(torch.bfloat16)
    assert matmul_routes.rounds_once_from_fp32(with_bias, a, b, bias)
    assert not matmul_routes.rounds_once_from_fp32(exact, a, b, bias * 64)  # the bias left out


@CPU_ONLY
def test_aten_is_no_candidate_where_its_16_bit_gemm_breaks_the_contract(cache_dir, monkeypatch):
    monkeypatch.setattr(matmul_routes, "aten_accumulates_in_fp32", lambda dtype, bias: False)
    why = routes("cpu", torch.bfloat16)
    assert "does not keep fp32 accumulation" in why["aten"] and why["upcast"] == ""
    # an fp32 C does not use ATen's 16-bit GEMM: still a candidate when the extension is there
    assert routes("cpu", torch.bfloat16, epilogue="accumulate")["aten"] in ("", "the native extension "
                                                                            "(mpkern::mm_f32_) is not loaded")
    with use_route("aten"), pytest.raises(ValueError, match="MPKERN_MATMUL_ROUTE=aten cannot run this GEMM"):
        matmul(_bf16(8, 8), _bf16(8, 8))
    with use_route("auto"):  # auto never takes it
        a, b = _bf16(8, 16), _bf16(16, 4)
        assert matmul_routes.route_for(a, b, None, torch.bfloat16) == "upcast"


@CPU_ONLY
def test_forced_routes_and_their_names(cache_dir, fake_timer):
    a, b = _bf16(16, 32), _bf16(32, 8)
    for name, want in (("upcast", "upcast"), ("aten", "aten"), ("cublas", "aten"), (" Upcast ", "upcast")):
        with use_route(name):
            assert matmul_routes.route_for(a, b, None, torch.bfloat16) == want
    assert fake_timer["calls"] == []  # forcing never times
    with pytest.raises(ValueError, match="not a route"):
        use_route("cudnn")
    with pytest.raises(TypeError, match="str or None"):
        use_route(3)  # type: ignore[arg-type]
    os.environ["MPKERN_MATMUL_ROUTE"] = "fastest"
    try:
        with pytest.raises(ValueError, match="'fastest' is not a route"):
            matmul(a, b)
    finally:
        del os.environ["MPKERN_MATMUL_ROUTE"]
    with use_route("triton"), pytest.raises(ValueError, match="cannot run this GEMM"):
        matmul(a, b)  # no GPU and no MPKERN_BACKEND=triton: Triton is no CPU route


@CPU_ONLY
def test_auto_times_once_remembers_and_persists(cache_dir, fake_timer):
    a, b = _bf16(100, 64), _bf16(64, 48)
    y = matmul(a, b)
    assert fake_timer["calls"] == ["aten", "upcast"]  # each candidate timed once, on the first call
    ref = a.double() @ b.double()
    assert (y.double() - ref).abs().max() <= 2 ** -7 * ref.abs().max()
    matmul(_bf16(120, 64), b)  # same power-of-two bucket: no timing
    matmul(a, b)
    assert fake_timer["calls"] == ["aten", "upcast"]
    data = json.loads((cache_dir / route_cache.FILE_NAME).read_text())
    (key, entry), = data["entries"].items()
    assert data["format"] == route_cache.FORMAT and entry["route"] == "upcast"  # the faster by the fake clock
    assert entry["ms"] == {"aten": 2000.0, "upcast": 1000.0} and "|bfloat16|bfloat16|none|nn|128|64|64" in key
    assert entry["fingerprint"] == route_cache.fingerprint("cpu")
    # a new process (memory forgotten) reads the file: no timing
    matmul_routes.forget()
    matmul(a, b)
    assert fake_timer["calls"] == ["aten", "upcast"]
    assert route_cache.entries("cpu")[0]["route"] == "upcast"


@CPU_ONLY
def test_stale_and_corrupt_cache_files_are_ignored_and_replaced(cache_dir, fake_timer, monkeypatch):
    path = cache_dir / route_cache.FILE_NAME
    a, b = _bf16(40, 24), _bf16(24, 16)
    matmul(a, b)
    assert len(fake_timer["calls"]) == 2
    # another torch (or triton / driver / CPU ISA cap): the entry is stale, measured again, and dropped
    monkeypatch.setattr(route_cache, "fingerprint", lambda device_type: "torch 9.9")
    matmul_routes.forget()
    fake_timer["times"]["aten"] = 0.1
    matmul(a, b)
    assert len(fake_timer["calls"]) == 4
    entries = json.loads(path.read_text())["entries"]
    assert [e["fingerprint"] for e in entries.values()] == ["torch 9.9"]
    assert next(iter(entries.values()))["route"] == "aten"
    for junk in ("{not json", json.dumps({"format": 999, "entries": {}}), json.dumps([1, 2]),
                 json.dumps({"format": route_cache.FORMAT, "entries": {next(iter(entries)): {"route": 5}}})):
        path.write_text(junk)
        matmul_routes.forget()
        before = len(fake_timer["calls"])
        matmul(a, b)  # ignored: measured again, and the file is whole JSON again
        assert len(fake_timer["calls"]) == before + 2
        assert json.loads(path.read_text())["format"] == route_cache.FORMAT
    # the disk cache off: memory only, no file written
    monkeypatch.setenv("MPKERN_MATMUL_ROUTE_CACHE", "0")
    path.unlink()
    matmul_routes.forget()
    matmul(a, b)
    assert not path.exists()


@CPU_ONLY
def test_no_timing_under_compile_or_capture(cache_dir, fake_timer, monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    a, b = _bf16(30, 20), _bf16(20, 10)
    assert matmul_routes.route_for(a, b, None, torch.bfloat16) == "aten"  # the platform GEMM, untimed
    assert fake_timer["calls"] == [] and not (cache_dir / route_cache.FILE_NAME).exists()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert matmul_routes.route_for(a, b, None, torch.bfloat16) == "upcast"  # the next eager call measures
    assert fake_timer["calls"] == ["aten", "upcast"]


@CPU_ONLY
def test_timing_an_accumulation_leaves_main_grad_accumulated_once(cache_dir, fake_timer):
    a, b = _bf16(50, 30, seed=4), _bf16(30, 20, seed=5)
    mg = torch.randn(50, 20, generator=torch.Generator().manual_seed(6))
    want = mg.double() + a.double() @ b.double()
    matmul_accumulate_(a, b, mg)
    assert fake_timer["calls"] == ["aten", "upcast"]
    assert (mg.double() - want).abs().max() <= 1e-5 * (1 + want.abs().max())


@CPU_ONLY
def test_linear_main_grad_on_the_aten_route_has_no_product_temporary(cache_dir, monkeypatch):
    """The aten route accumulates into main_grad in ATen's 16-bit -> fp32 GEMM (beta = 1): the only
    temporary is the row-major copy of the transposed output gradient, never an fp32 product."""
    if routes("cpu", torch.bfloat16, epilogue="accumulate")["aten"]:
        pytest.skip("the native extension is not loaded")
    # the forward and dX GEMMs on ATen's bf16 GEMM too, whatever this CPU's probe says (no temporaries)
    monkeypatch.setattr(matmul_routes, "aten_accumulates_in_fp32", lambda dtype, bias: True)
    seen = []
    lin = mpkern.nn.Linear(64, 96, bias=False, dtype=torch.bfloat16, fp32_main_grad=True)
    x = _bf16(128, 64, seed=7).requires_grad_()
    gy = _bf16(128, 96, seed=8)
    with use_route("aten"), matmul_routes.temp_meter(seen.append):
        lin(x).backward(gy)
    assert seen == [128 * 96 * 2]  # gy^T made row-major (bf16), nothing of fp32 size
    ref = gy.double().t() @ x.detach().double()
    assert (lin.weight.main_grad.double() - ref).abs().max() <= 1e-5 * (gy.double().abs().t() @ x.double().abs()).max()


_WRITER = textwrap.dedent("""
    import sys, torch
    from mpkern import route_cache
    who = int(sys.argv[1])
    for i in range(60):
        p = route_cache.Problem("cpu:test", "bfloat16", "bfloat16", "none", "nn", 2 ** (i % 12), who, i)
        route_cache._write_entry(p, "aten" if who else "upcast", {"aten": 1.0, "upcast": 2.0})
        assert isinstance(route_cache._read_file(), dict)
    print("ok")
""")


def test_two_processes_writing_at_once_leave_a_whole_file(tmp_path):
    env = dict(os.environ, MPKERN_CACHE_DIR=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(w)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for w in (0, 1)]
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0 and out.strip() == "ok", err[-2000:]
    data = json.loads((tmp_path / route_cache.FILE_NAME).read_text())  # whole JSON, whoever wrote last
    assert data["format"] == route_cache.FORMAT and data["entries"]
    assert all(e["route"] in ("aten", "upcast") for e in data["entries"].values())
    assert not list(tmp_path.glob(".matmul_routes.*.tmp"))  # no temporary file left behind


@CPU_ONLY
def test_bad_operands_get_the_same_errors_on_every_route(cache_dir):
    bad = [(lambda: matmul(_bf16(3, 4), _bf16(5, 6)), ValueError, "inner dimensions"),
           (lambda: linear(_bf16(3, 4), _bf16(5, 4).half()), TypeError, "same dtype"),
           (lambda: matmul_accumulate_(_bf16(3, 4), _bf16(4, 5), torch.zeros(3, 5).bfloat16()), ValueError,
            "must be float32")]
    for route in ("aten", "upcast"):
        with use_route(route):
            for call, exc, words in bad:
                with pytest.raises(exc, match=words):
                    call()


@CPU_ONLY
def test_a_near_tie_keeps_the_platform_gemm(cache_dir, fake_timer):
    """Another route must beat the default (the platform GEMM) by route_cache.MARGIN to replace it."""
    fake_timer["times"].update(aten=1.0, upcast=1.0 / (route_cache.MARGIN - 0.01))
    a, b = _bf16(70, 33), _bf16(33, 17)
    assert matmul_routes.route_for(a, b, None, torch.bfloat16) == "aten"
    matmul_routes.forget()
    (cache_dir / route_cache.FILE_NAME).unlink()
    fake_timer["times"].update(upcast=1.0 / (route_cache.MARGIN + 0.01))
    assert matmul_routes.route_for(a, b, None, torch.bfloat16) == "upcast"


def test_exact_cuda_math_switches_reduced_precision_off_and_restores_it():
    m = torch.backends.cuda.matmul
    old = (m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction)
    m.allow_bf16_reduced_precision_reduction = m.allow_fp16_reduced_precision_reduction = True
    try:
        with pytest.raises(RuntimeError, match="inside"), matmul_routes.exact_cuda_math():
            assert not m.allow_bf16_reduced_precision_reduction and not m.allow_fp16_reduced_precision_reduction
            raise RuntimeError("inside")
        assert m.allow_bf16_reduced_precision_reduction and m.allow_fp16_reduced_precision_reduction
    finally:
        m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction = old


@CPU_ONLY
def test_the_decision_memo_stays_bounded_with_ever_new_shapes(cache_dir, monkeypatch):
    monkeypatch.setattr(matmul_routes, "_DECIDED_MAX", 3)
    with use_route("upcast"):
        for m in range(1, 9):
            assert matmul_routes.route_for(_bf16(m, 8), _bf16(8, 4), None, torch.bfloat16) == "upcast"
            assert len(matmul_routes._decided) <= 3
