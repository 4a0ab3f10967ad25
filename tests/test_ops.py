"""Op-level checks: opcheck for every op and backend namespace, torch.compile(fullgraph=True)."""

from __future__ import annotations

import pytest
import torch

import mpkern
from conftest import DEVICE, adamw_op_args, available_backends
from mpkern import _backend


def _grads():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=g).to(dt).to(DEVICE)
            for n, dt in ((5, torch.float32), (1000, torch.bfloat16), (33, torch.float16), (0, torch.float32))]


def _op_namespaces():
    out = []
    bs = available_backends()
    if "cpu" in bs or "cuda" in bs:
        out.append("mpkern")
    if "triton" in bs:
        out.append("mpkern_triton")
    return out


@pytest.mark.parametrize("ns", _op_namespaces())
def test_opcheck_grad_stats(ns):
    op = getattr(torch.ops, ns).grad_stats.default
    torch.library.opcheck(op, (_grads(), torch.tensor(0.5, device=DEVICE)))


@pytest.mark.parametrize("ns", _op_namespaces())
def test_opcheck_scale(ns):
    op = getattr(torch.ops, ns).scale_.default
    torch.library.opcheck(op, (_grads(), torch.tensor(0.25, device=DEVICE)))


@pytest.mark.parametrize("ns", _op_namespaces())
def test_compile_fullgraph_ops(ns):
    ops = getattr(torch.ops, ns)

    def step(grads, inv):
        sumsq, amax = ops.grad_stats(grads, inv)
        found = (~torch.isfinite(amax)).any().float()
        coef = torch.clamp(1.0 / (sumsq.sum().sqrt() + 1e-6), max=1.0)
        ops.scale_(grads, inv * coef)
        return found, coef

    grads = _grads()
    ref = [g.clone() for g in grads]
    inv = torch.tensor(0.5, device=DEVICE)
    found, coef = torch.compile(step, fullgraph=True, backend="aot_eager")(grads, inv)
    assert float(found) == 0.0
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g.double(), (r.double() * 0.5 * float(coef)).to(g.dtype).double(),
                                   rtol=1e-2, atol=0)


def test_compile_fullgraph_unscale(backend):
    ps = []
    for n in (7, 300):
        p = torch.nn.Parameter(torch.randn(n, device=DEVICE))
        p.grad = torch.randn(n, device=DEVICE)
        ps.append(p)
    ref = [p.grad.double().clone() for p in ps]

    def f(params):
        res = mpkern.unscale_(params, 0.5, max_norm=1.0)
        return res.total_norm, res.clip_coef

    total, coef = torch.compile(f, fullgraph=True, backend="aot_eager")(ps)
    expected = torch.linalg.vector_norm(torch.cat([r * 0.5 for r in ref]))
    assert float(total) == pytest.approx(float(expected), rel=1e-5)
    for p, r in zip(ps, ref):
        torch.testing.assert_close(p.grad.double(), r * 0.5 * float(coef), rtol=1e-6, atol=0)


def test_native_op_kernels_registered():
    """The C++ kernels exist for the device keys the build claims (checked via the dispatcher)."""
    ext = _backend.native()
    if ext is None:
        pytest.skip("native extension not built")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("mpkern::grad_stats", "CPU")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("mpkern::scale_", "CPU")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("mpkern::grad_stats", "CUDA") == ext.cuda_built
    assert torch._C._dispatch_has_kernel_for_dispatch_key("mpkern::scale_", "CUDA") == ext.cuda_built


def test_c_kernels_reject_bad_input():
    if _backend.native() is None:
        pytest.skip("native extension not built")
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        torch.ops.mpkern.grad_stats([torch.ones(3, dtype=torch.int32)], torch.tensor(1.0))
    with pytest.raises(ValueError, match="dense"):
        torch.ops.mpkern.scale_([torch.ones(10)[::2]], torch.tensor(1.0))
    with pytest.raises(ValueError, match="one-element float32"):
        torch.ops.mpkern.scale_([torch.ones(10)], torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("ns", _op_namespaces())
@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_opcheck_adamw(ns, mode):
    params = [torch.randn(n, device=DEVICE).to(torch.bfloat16) for n in (33, 5, 0)]
    masters = {0: [], 1: [p.float() for p in params],
               2: [torch.zeros(p.shape, dtype=torch.int16, device=DEVICE) for p in params],
               3: [torch.randint(-128, 128, p.shape, dtype=torch.int8, device=DEVICE) for p in params]}[mode]
    sdt = torch.bfloat16 if mode == 3 else torch.float32  # bf16 moments (stochastically rounded) too
    args = (params, [torch.randn(p.shape, device=DEVICE).to(p.dtype) for p in params],
            [torch.zeros(p.shape, device=DEVICE, dtype=sdt) for p in params],
            [torch.zeros(p.shape, device=DEVICE, dtype=sdt) for p in params],
            [torch.zeros(p.shape, device=DEVICE) for p in params], masters,
            [torch.zeros((), device=DEVICE) for p in params], torch.tensor(0.5, device=DEVICE),
            torch.tensor(0.0, device=DEVICE), None, 1e-3, 0.9, 0.999, 1e-8, 0.01, False, mode, mode == 0, 0)
    if mode >= 2:  # explicit random streams (stream id, global element offset per tensor)
        args = args + ([4, 4, 9], [0, 33, 2**33])
    args, kwargs = adamw_op_args(*args)
    torch.library.opcheck(getattr(torch.ops, ns).adamw_step_.default, args, kwargs)
