"""The paths a GPU takes, tested wherever they can run (issue 9).

* multi-chunk work: the CUDA kernels split tensors into 65536-element chunks (Triton: 16384, CPU:
  32768); sizes on and across those boundaries, an empty and a tiny tensor, mixed dtypes and a
  view at storage_offset=1 (a misaligned base address spanning two chunks) -- for grad_stats,
  scale_ and the AdamW step, on every backend, against float64 computed here;
* one set of argument checks for every backend (same exception, same message);
* Triton grad_stats gives the same bits on every call (fixed-order reduction);
* backend selection: the cuda backend is chosen only for a GPU the build has code for;
* on a GPU: the default selection is ``cuda``, and CUDA AdamW agrees bit for bit with the CPU
  kernels over many steps (lr in double precision).
"""

from __future__ import annotations

import importlib.util
import os
from functools import partial

import pytest
import torch

import mpkern
from conftest import DEVICE, HAS_CUDA, available_backends, call_adamw_op, requires_cuda
from mpkern import _backend, _ops

CHUNK = 65536
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def _rand(n, dtype, gen, scale=1.0):
    """Fresh random values, never zero."""
    x = torch.randn(n, generator=gen, dtype=torch.float64) * scale
    x = torch.where(x == 0, torch.full_like(x, scale), x)
    return x.to(dtype).to(DEVICE)


def _boundary_tensors(gen):
    """(tensors, the base of the offset view): sizes across chunk boundaries, mixed dtypes."""
    ts = [_rand(2 * CHUNK + 5, F32, gen), _rand(CHUNK, BF16, gen), _rand(CHUNK + 1, F16, gen),
          _rand(0, F32, gen), _rand(7, BF16, gen)]
    base = _rand(CHUNK + 300, BF16, gen)
    view = base[1:1 + CHUNK + 200]  # storage_offset=1: 2-byte misaligned, spans two chunks
    assert view.storage_offset() == 1 and view.is_contiguous()
    return ts + [view], base


def test_grad_stats_across_chunks_and_offset_view(backend):
    gen = torch.Generator().manual_seed(9001)
    ts, _ = _boundary_tensors(gen)
    inv = 0.375
    sumsq, amax = _ops.grad_stats(ts, torch.tensor(inv, device=DEVICE), _backend.select(DEVICE))
    assert sumsq.shape == (len(ts),) and amax.shape == (len(ts),)
    for i, t in enumerate(ts):
        x = t.detach().to("cpu", torch.float64)
        want_sum = float(((x * inv) ** 2).sum())
        want_max = float(x.abs().max()) if x.numel() else 0.0
        assert float(sumsq[i]) == pytest.approx(want_sum, rel=2e-6, abs=1e-30), f"tensor {i}"
        assert float(amax[i]) == want_max, f"tensor {i}"


def test_scale_across_chunks_and_offset_view(backend):
    gen = torch.Generator().manual_seed(9002)
    ts, base = _boundary_tensors(gen)
    base_before = base.clone()
    before = [t.clone() for t in ts]
    s = 0.8125
    _ops.scale_(ts, torch.tensor(s, device=DEVICE), _backend.select(DEVICE))
    for i, (t, b) in enumerate(zip(ts, before)):
        # the contract: the product in fp32 (exact here in fp64), rounded once to the dtype
        want = (b.to("cpu", torch.float64) * s).to(torch.float32).to(t.dtype)
        assert torch.equal(t.cpu(), want), f"tensor {i}"
    # the elements of the base outside the view are untouched
    assert torch.equal(base[0], base_before[0]) and torch.equal(base[1 + CHUNK + 200:], base_before[1 + CHUNK + 200:])


def _adamw_reference(p64, g64, m64, v64, lr, b1, b2, eps, wd, step):
    """torch.optim.AdamW's update in float64 (independent of the kernels)."""
    p64 = p64 * (1 - lr * wd)
    m64 = b1 * m64 + (1 - b1) * g64
    v64 = b2 * v64 + (1 - b2) * g64 * g64
    denom = (v64 / (1 - b2**step)).sqrt() + eps
    return p64 - lr / (1 - b1**step) * m64 / denom, m64, v64


def test_adamw_across_chunks_and_offset_view(backend):
    gen = torch.Generator().manual_seed(9003)
    sizes = [(2 * CHUNK + 5, BF16), (CHUNK, BF16), (CHUNK + 1, F16), (0, BF16), (7, F16)]
    params = [_rand(n, dt, gen) for n, dt in sizes]
    pbase = _rand(CHUNK + 300, BF16, gen)
    params.append(pbase[1:1 + CHUNK + 200])  # a param view at storage_offset=1 (misaligned)
    pbase_before = pbase.clone()
    masters = [p.float() for p in params]
    ms = [torch.zeros(p.shape, device=DEVICE) for p in params]
    vs = [torch.zeros(p.shape, device=DEVICE) for p in params]
    steps = [torch.zeros((), device=DEVICE) for _ in params]
    lr, b1, b2, eps, wd = 1e-3, 0.9, 0.999, 1e-8, 0.01
    ref = [(mp.double().cpu(), torch.zeros(mp.shape, dtype=torch.float64), torch.zeros(mp.shape, dtype=torch.float64))
           for mp in masters]
    for step in (1, 2):
        # grads: fp32 for one, offset views for another, the param dtype otherwise
        grads = []
        for i, p in enumerate(params):
            if i == 1:
                grads.append(_rand(p.numel(), F32, gen))
            elif i == 2:
                gbase = _rand(p.numel() + 3, p.dtype, gen)
                grads.append(gbase[1:1 + p.numel()])
            else:
                grads.append(_rand(p.numel(), p.dtype, gen))
        factor = 0.5
        call_adamw_op(partial(_ops.adamw_step_, _backend.select(DEVICE)), params, grads, ms, vs, [], masters, steps,
                         torch.tensor(factor, device=DEVICE), torch.tensor(0.0, device=DEVICE), None, lr, b1, b2, eps,
                         wd, False, 1, False, 0)
        ref = [_adamw_reference(r[0], g.double().cpu() * factor, r[1], r[2], lr, b1, b2, eps, wd, step)
               for r, g in zip(ref, grads)]
    for i, (p, mp, m, v, st, (rp, rm, rv)) in enumerate(zip(params, masters, ms, vs, steps, ref)):
        assert float(st) == 2.0
        # fp32 arithmetic vs float64: a few ulps of the operands' magnitude (m can cancel to ~0)
        torch.testing.assert_close(mp.double().cpu(), rp, rtol=2e-6, atol=1e-7,
                                   msg=lambda m_, i=i: f"master {i}: {m_}")
        torch.testing.assert_close(m.double().cpu(), rm, rtol=1e-5, atol=1e-7,
                                   msg=lambda m_, i=i: f"exp_avg {i}: {m_}")
        torch.testing.assert_close(v.double().cpu(), rv, rtol=1e-5, atol=1e-10,
                                   msg=lambda m_, i=i: f"exp_avg_sq {i}: {m_}")
        assert torch.equal(p, mp.to(p.dtype)), f"param {i} is not its master rounded to nearest even"
    assert torch.equal(pbase[0], pbase_before[0])
    assert torch.equal(pbase[1 + CHUNK + 200:], pbase_before[1 + CHUNK + 200:])


# ---- one set of argument checks for every backend -----------------------------------------------
def _error(fn):
    with pytest.raises((ValueError, TypeError)) as info:
        fn()
    return info.type, str(info.value).splitlines()[0]


def _all_backends():
    return [b for b in available_backends() if b != "cpu-scalar"]


def test_every_backend_rejects_a_strided_view_identically():
    scale_errors, stats_errors = {}, {}
    for b in _all_backends():
        base = _rand(10, F32, torch.Generator().manual_seed(1))
        before = base.clone()
        scale_errors[b] = _error(lambda b=b, base=base: _ops.scale_([base[::2]], torch.tensor(0.5, device=DEVICE), b))
        assert torch.equal(base, before), f"{b} wrote into the tensor before rejecting it"
        stats_errors[b] = _error(
            lambda b=b, base=base: _ops.grad_stats([base[::2]], torch.tensor(0.5, device=DEVICE), b))
    assert set(scale_errors.values()) == {
        (ValueError, "mpkern::scale_: tensors[0] must be dense and non-overlapping (call .contiguous())")}, scale_errors
    assert set(stats_errors.values()) == {
        (ValueError, "mpkern::grad_stats: grads[0] must be dense and non-overlapping (call .contiguous())")
    }, stats_errors


def test_triton_scale_op_rejects_a_strided_view():
    if "triton" not in available_backends():
        pytest.skip("no triton backend here")
    x = _rand(10, F32, torch.Generator().manual_seed(2))
    before = x.clone()
    with pytest.raises(ValueError, match=r"mpkern::scale_: tensors\[0\] must be dense"):
        torch.ops.mpkern_triton.scale_([x[::2]], torch.tensor(0.5, device=DEVICE))
    assert torch.equal(x, before)


def _adamw_args(grad_numel):
    gen = torch.Generator().manual_seed(3)
    p = _rand(6, F32, gen)
    return ([p], [_rand(grad_numel, F32, gen)], [torch.zeros(6, device=DEVICE)], [torch.zeros(6, device=DEVICE)], [],
            [], [torch.zeros((), device=DEVICE)], torch.tensor(1.0, device=DEVICE), torch.tensor(0.0, device=DEVICE),
            None, 1e-3, 0.9, 0.999, 1e-8, 0.0, False, 0, False, 0)


def test_every_backend_rejects_a_grad_of_another_size_identically():
    errors = {}
    for b in _all_backends():
        args = _adamw_args(5)
        before = args[0][0].clone()
        errors[b] = _error(lambda b=b, args=args: call_adamw_op(partial(_ops.adamw_step_, b), *args))
        assert torch.equal(args[0][0], before)
    assert len(set(errors.values())) == 1, errors
    typ, msg = next(iter(errors.values()))
    assert typ is ValueError and "grads[0] has 5 elements, param has 6" in msg
    if "triton" in errors:  # and the op itself, not only the routing function
        with pytest.raises(ValueError, match=r"grads\[0\] has 5 elements"):
            call_adamw_op(torch.ops.mpkern_triton.adamw_step_, *_adamw_args(5))


# ---- Triton grad_stats: the same bits every call ------------------------------------------------
def test_triton_grad_stats_is_deterministic():
    if "triton" not in available_backends():
        pytest.skip("no triton backend here")
    gen = torch.Generator().manual_seed(9004)
    n = 40 * 16384 + 3 if HAS_CUDA else 6 * 16384 + 3  # many partials per tensor
    grads = [_rand(n, F32, gen, scale=1e3), _rand(n // 3, BF16, gen)]
    inv = torch.tensor(0.1, device=DEVICE)
    first = _ops.grad_stats(grads, inv, "triton")
    for _ in range(5 if HAS_CUDA else 2):
        again = _ops.grad_stats(grads, inv, "triton")
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    want = [float((g.double().cpu() * 0.1).pow(2).sum()) for g in grads]
    assert [float(x) for x in first[0]] == pytest.approx(want, rel=2e-6)


# ---- backend selection vs the GPU's architecture -------------------------------------------------
@pytest.mark.parametrize("cap,archs,ok,how", [
    ((9, 0), "8.0;9.0", True, "SASS sm_90"),
    ((8, 6), "8.0;9.0", True, "SASS sm_80"),
    ((8, 0), "9.0", False, "sm_80"),
    ((10, 0), "8.0;9.0", False, "sm_100"),
    ((12, 0), "8.0;9.0", False, "sm_120"),
    ((10, 0), "8.0;9.0+PTX", True, "PTX compute_90"),
    ((12, 0), "9.0a;8.0+PTX", True, "PTX compute_80"),
    ((10, 0), "9.0a", False, "sm_90a"),
])
def test_arch_match(cap, archs, ok, how):
    got, why = _backend.arch_match(cap, archs)
    assert got is ok and how in why


class _FakeExt:
    cuda_built = True

    def __init__(self, archs, image_error=""):
        self.cuda_archs = archs
        self._err = image_error

    def cuda_kernel_image_error(self, index):
        return self._err

    def cpu_simd_level(self):
        return 1


@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend a GPU of a given capability is visible (no CUDA call reaches the driver)."""

    def make(cap, archs, image_error=""):
        ext = _FakeExt(archs, image_error)
        monkeypatch.setattr(_backend, "native", lambda: ext)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: cap)
        monkeypatch.delenv("MPKERN_BACKEND", raising=False)
        _backend.cuda_device_problem.cache_clear()

    yield make
    _backend.cuda_device_problem.cache_clear()


def test_cuda_backend_not_selected_for_a_gpu_without_code(fake_gpu):
    fake_gpu((10, 0), "8.0;9.0")
    st = _backend.status("cuda")
    assert not st.available and "sm_100" in st.reason and "TORCH_CUDA_ARCH_LIST" in st.reason
    why = _backend.runs_on("cuda", torch.device("cuda", 0))
    assert "sm_100" in why
    assert _backend.select(torch.device("cuda", 0)) != "cuda"


def test_cuda_backend_selected_through_ptx(fake_gpu):
    fake_gpu((10, 0), "8.0;9.0+PTX")
    st = _backend.status("cuda")
    assert st.available and "PTX compute_90" in st.reason
    assert _backend.select(torch.device("cuda", 0)) == "cuda"


def test_driver_probe_failure_disables_the_cuda_backend(fake_gpu):
    fake_gpu((9, 0), "9.0", image_error="no kernel image is available for execution on the device")
    assert "no kernel image" in _backend.runs_on("cuda", torch.device("cuda", 0))
    assert _backend.select(torch.device("cuda", 0)) != "cuda"


def test_build_embeds_ptx_for_the_newest_arch():
    spec = importlib.util.spec_from_file_location("mpkern_setup", os.path.join(os.path.dirname(__file__), "..",
                                                                               "setup.py"))
    setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup)
    assert setup._with_ptx("8.0;9.0") == "8.0;9.0+PTX"
    assert setup._with_ptx("9.0;8.0") == "9.0+PTX;8.0"
    assert setup._with_ptx("8.0+PTX;9.0") == "8.0+PTX;9.0"
    ext = _backend.native()
    if ext is not None and ext.cuda_built and ext.cuda_archs:
        assert "+PTX" in ext.cuda_archs.upper(), ext.cuda_archs


# ---- on a GPU ------------------------------------------------------------------------------------
@requires_cuda
def test_default_selection_on_gpu_is_cuda():
    """A silent fall-back to Triton or torch must fail: the build has this GPU's arch."""
    ext = _backend.native()
    assert ext is not None and ext.cuda_built, "the CUDA kernels are not built"
    cap = torch.cuda.get_device_capability()
    ok, why = _backend.arch_match(cap, ext.cuda_archs)
    assert ok, why
    assert _backend.cuda_device_problem(torch.cuda.current_device()) == ""
    assert _backend.select("cuda") == "cuda"


@requires_cuda
def test_cuda_adamw_matches_cpu_bit_for_bit_over_many_steps(monkeypatch):
    """lr in double on CUDA like on CPU: lr / (1 - beta1^t) rounds differently in float on many steps."""
    if "cpu" not in available_backends(torch.device("cpu")):
        pytest.skip("no C++ CPU kernels")
    gen = torch.Generator().manual_seed(9005)
    init = [torch.randn(n, generator=gen).to(BF16) for n in (4096, 77)]
    results = {}
    for dev, name in ((torch.device("cpu"), "cpu"), (torch.device("cuda"), "cuda")):
        monkeypatch.setenv("MPKERN_BACKEND", name)
        params = [torch.nn.Parameter(t.clone().to(dev)) for t in init]
        opt = mpkern.FusedAdamWMP(params, lr=1e-3, weight_decay=0.01)
        g = torch.Generator().manual_seed(17)
        for _ in range(200):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).to(BF16).to(dev)
            opt.step()
        results[name] = [opt.state[p]["master_param"].cpu() for p in params]
    for a, b in zip(results["cpu"], results["cuda"]):
        assert torch.equal(a, b)
