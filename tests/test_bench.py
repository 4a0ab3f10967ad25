"""mpkern.bench: what it says it runs, and peers that do what a real user would do (issue 13 item 12)."""

from __future__ import annotations

import inspect

import torch

from conftest import requires_cuda
from mpkern import bench


def test_run_docstring_gives_the_sizes_the_code_uses():
    doc = " ".join(bench.run.__doc__.split())
    for mode, size in (("full", bench.FULL), ("quick", bench.QUICK)):
        said = f"{size['params'] // 10**6}M params in {size['tensors']} tensors, {size['reps']} repetitions"
        assert said in doc, (mode, said)
    probe = inspect.signature(bench.measure_bandwidth).parameters["nbytes"].default
    assert f"probe is {probe >> 20} MiB in both" in doc
    for m, k, n in bench.CPU_SHAPES.values():
        assert f"{m}x{k}x{n}" in doc
    assert f"{bench.GPU_SQUARE[0][0]}^3 square (quick" in doc and f"{bench.GPU_LLM[0]}." in doc


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
