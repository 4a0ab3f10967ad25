"""mpkern.matmul / mpkern.linear / mpkern.nn against float64 references computed here.

Backends: ``torch`` (ATen, fp32 accumulation) and ``triton`` (the Triton kernel; on a CPU-only
machine it runs under TRITON_INTERPRET=1, set by conftest). Tolerance rule: a 16-bit result's
largest error against float64 is at most 2x the largest error of PyTorch's own same-dtype
computation (plus a tiny floor); an fp32 result is within 1e-4 of the sum of |products|.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

import mpkern.nn
from conftest import DEVICE
from mpkern import _backend
from mpkern.matmul import linear, matmul, matmul_accumulate_, routes, use_route

# every route this device has: the platform GEMM (aten on CPU, cublas on CUDA), upcast, and Triton
# (on CPU through MPKERN_BACKEND=triton and the interpreter)
MM_ROUTES = [r for r, why in routes(DEVICE).items() if not why or (r == "triton" and not _backend.runs_on(r, DEVICE))]
DTYPES = [torch.bfloat16, torch.float16]
HSET = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])




@contextlib.contextmanager
def forced(route):
    """Every GEMM of the block on ``route`` (Triton on CPU: MPKERN_BACKEND=triton, the interpreter)."""
    backend = "triton" if route == "triton" and DEVICE.type == "cpu" else None
    with mpkern.use_backend(backend), use_route(None if backend else route):
        yield


def rand(shape, dtype, gen, layout="contig", scale=1.0):
    """Fresh random tensor (never zeros) of ``shape`` with the given memory layout.

    contig: contiguous; transposed: the last two dims are stored swapped (a .transpose view);
    strided: every other element of a bigger tensor along the last dim.
    """
    shape = list(shape)
    if layout == "transposed" and len(shape) >= 2:
        store = shape[:-2] + [shape[-1], shape[-2]]
        x = _fill(store, gen, scale).to(dtype).to(DEVICE).transpose(-1, -2)
    elif layout == "strided":
        x = _fill(shape[:-1] + [2 * shape[-1]], gen, scale).to(dtype).to(DEVICE)[..., ::2]
    else:
        x = _fill(shape, gen, scale).to(dtype).to(DEVICE)
    assert list(x.shape) == shape
    return x


def _fill(shape, gen, scale):
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
    return torch.where(x == 0, torch.full_like(x, scale), x)


def d(t):
    return t.detach().to("cpu", torch.float64)


def check_16bit(actual, ref64, torch_same, what, mag):
    """max|actual - ref| <= 2 * max|torch_same - ref| + tiny floor (both 16-bit results)."""
    err = (d(actual) - ref64).abs().max().item() if ref64.numel() else 0.0
    terr = (d(torch_same) - ref64).abs().max().item() if ref64.numel() else 0.0
    floor = 1e-6 * (mag.max().item() if mag.numel() else 0.0) + 1e-30
    assert err <= 2 * terr + floor, f"{what}: error {err:.3g} > 2 x PyTorch's {terr:.3g} (+{floor:.2g})"


def check_fp32(actual, ref64, mag, what):
    """|actual - ref| <= 1e-4 * sum |products| (relative to the magnitude of the dot product)."""
    assert actual.dtype == torch.float32, what
    err = (d(actual) - ref64).abs()
    ok = err <= 1e-4 * mag + 1e-30
    assert bool(ok.all()), f"{what}: {int((~ok).sum())} of {ok.numel()} off, worst {err.max().item():.3g}"


def check(actual, ref64, torch_same, mag, what):
    if actual.dtype == torch.float32:
        check_fp32(actual, ref64, mag, what)
    else:
        check_16bit(actual, ref64, torch_same, what, mag)


LAYOUTS = st.sampled_from(["contig", "transposed", "strided"])
DIM = st.integers(1, 70)


def _case(backend, op, batch, m, n, k, dtype, out_dtype, with_bias, la, lb, seed):
    gen = torch.Generator().manual_seed(seed)
    a_shape = ([batch] if batch else []) + [m, k]
    a = rand(a_shape, dtype, gen, la).requires_grad_()
    if op == "matmul":
        b = rand([k, n], dtype, gen, lb).requires_grad_()
        b_kn = b  # (K, N) view for the references
    else:
        b = rand([n, k], dtype, gen, lb).requires_grad_()
        b_kn = b.t()
    bias = rand([n], dtype, gen).requires_grad_() if with_bias else None
    gy = rand(a_shape[:-1] + [n], out_dtype or dtype, gen)

    with forced(backend):
        y = matmul(a, b, bias=bias, out_dtype=out_dtype) if op == "matmul" else linear(a, b, bias, out_dtype=out_dtype)
        y.backward(gy)
    assert y.dtype == (out_dtype or dtype) and list(y.shape) == a_shape[:-1] + [n]
    assert a.grad.dtype == dtype and b.grad.dtype == dtype and list(a.grad.shape) == a_shape
    assert b.grad.shape == b.shape

    # float64 references
    a64, b64 = d(a), d(b_kn)
    ref = a64 @ b64 + (d(bias) if with_bias else 0.0)
    mag = a64.abs() @ b64.abs() + (d(bias).abs() if with_bias else 0.0)
    with torch.no_grad():
        t_same = a @ b_kn + (bias if with_bias else 0)  # PyTorch, same dtype
    check(y, ref, t_same, mag, f"{backend} {op} forward")

    g64 = d(gy)
    gq = gy.to(dtype)  # the 16-bit gradient PyTorch's same-dtype backward would use
    a2 = a.detach().reshape(-1, k)
    g2q = gq.reshape(-1, n)
    with torch.no_grad():
        da_same = gq @ b_kn.detach().t()
        db_same = (a2.t() @ g2q)
    da_ref = g64 @ b64.t()
    db_ref = a64.reshape(-1, k).t() @ g64.reshape(-1, n)
    check_16bit(a.grad, da_ref, da_same, f"{backend} {op} grad a", d(gq).abs() @ b64.abs().t())
    if op == "linear":
        db_ref, db_same = db_ref.t(), db_same.t()
    check_16bit(b.grad, db_ref, db_same, f"{backend} {op} grad b", db_ref.abs())
    if with_bias:
        dbias_ref = g64.reshape(-1, n).sum(0)
        dbias_same = gq.reshape(-1, n).float().sum(0).to(dtype)
        check_16bit(bias.grad, dbias_ref, dbias_same, f"{backend} {op} grad bias", g64.abs().reshape(-1, n).sum(0))


@pytest.mark.parametrize("backend", MM_ROUTES)
@HSET
@given(op=st.sampled_from(["matmul", "linear"]), batch=st.sampled_from([0, 0, 1, 3]), m=DIM, n=DIM, k=DIM,
       dtype=st.sampled_from(DTYPES), out_dtype=st.sampled_from([None, torch.float32]),
       with_bias=st.booleans(), la=LAYOUTS, lb=LAYOUTS, seed=st.integers(0, 2**31 - 1))
@example(op="matmul", batch=0, m=1, n=1, k=1, dtype=torch.bfloat16, out_dtype=None, with_bias=True,
         la="contig", lb="contig", seed=1)
@example(op="linear", batch=3, m=33, n=65, k=67, dtype=torch.bfloat16, out_dtype=torch.float32, with_bias=True,
         la="transposed", lb="transposed", seed=2)
@example(op="matmul", batch=0, m=70, n=37, k=70, dtype=torch.float16, out_dtype=None, with_bias=False,
         la="strided", lb="transposed", seed=3)
def test_forward_backward(backend, op, batch, m, n, k, dtype, out_dtype, with_bias, la, lb, seed):
    _case(backend, op, batch, m, n, k, dtype, out_dtype, with_bias, la, lb, seed)


@pytest.mark.parametrize("backend", MM_ROUTES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_large_values_and_1d_input(backend, dtype):
    """Magnitudes far from 1 (fp16 close to its range) and a 1-D ``a``."""
    gen = torch.Generator().manual_seed(7)
    scale = 16.0 if dtype == torch.float16 else 1e20
    a = rand([40], dtype, gen, scale=scale)
    b = rand([40, 9], dtype, gen, scale=1.0)
    with forced(backend):
        y = matmul(a, b)
        y32 = matmul(a, b, out_dtype=torch.float32)
    assert y.shape == (9,)
    ref = d(a) @ d(b)
    check(y, ref, a @ b, d(a).abs() @ d(b).abs(), "1-D")
    check(y32, ref, None, d(a).abs() @ d(b).abs(), "1-D fp32")


@pytest.mark.parametrize("backend", MM_ROUTES)
def test_empty_dims(backend):
    gen = torch.Generator().manual_seed(0)
    with forced(backend):
        y = matmul(rand([0, 5], torch.bfloat16, gen), rand([5, 3], torch.bfloat16, gen))
        assert y.shape == (0, 3)
        bias = rand([3], torch.float32, gen)
        y = matmul(torch.empty(4, 0, dtype=torch.bfloat16, device=DEVICE),
                   torch.empty(0, 3, dtype=torch.bfloat16, device=DEVICE), bias=bias, out_dtype=torch.float32)
        assert torch.equal(y.cpu(), bias.cpu().expand(4, 3))


@pytest.mark.parametrize("backend", MM_ROUTES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_accumulate_into_fp32(backend, dtype):
    gen = torch.Generator().manual_seed(11)
    a = rand([45, 70], dtype, gen, "transposed")
    b = rand([70, 33], dtype, gen)
    out = rand([45, 33], torch.float32, gen)
    ref = d(out) + d(a) @ d(b)
    ptr = out.data_ptr()
    with forced(backend):
        matmul_accumulate_(a, b, out)
    assert out.data_ptr() == ptr
    check_fp32(out, ref, d(out).abs() + d(a).abs() @ d(b).abs(), "accumulate")


@pytest.mark.parametrize("backend", MM_ROUTES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_main_grad_accumulation(backend, dtype):
    """Three micro-batches: weight.main_grad (fp32, one buffer) == float64 sum of dY^T X."""
    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(3)
    lin = mpkern.nn.Linear(37, 19, device=DEVICE, dtype=dtype, fp32_main_grad=True)
    expect = torch.zeros(19, 37, dtype=torch.float64)
    mag = torch.zeros(19, 37, dtype=torch.float64)
    bias_expect = torch.zeros(19, dtype=torch.float64)
    buf = None
    with forced(backend):
        for step in range(3):
            x = rand([2, 5 + step, 37], dtype, gen).requires_grad_()
            gy = rand([2, 5 + step, 19], dtype, gen)
            y = lin(x)
            y.backward(gy)
            g2, x2 = d(gy).reshape(-1, 19), d(x).reshape(-1, 37)
            expect += g2.t() @ x2
            mag += g2.abs().t() @ x2.abs()
            bias_expect += g2.sum(0)
            assert lin.weight.grad is None
            assert lin.weight.main_grad.dtype == torch.float32
            if buf is None:
                buf = lin.weight.main_grad.data_ptr()
            assert lin.weight.main_grad.data_ptr() == buf  # allocated once, accumulated in place
            # input grad as with the plain op
            da_ref = d(gy) @ d(lin.weight)
            check_16bit(x.grad, da_ref, gy @ lin.weight.detach(), "main_grad dx", d(gy).abs() @ d(lin.weight).abs())
    check_fp32(lin.weight.main_grad, expect, mag, "main_grad")
    assert lin.bias.grad is not None and lin.bias.grad.shape == (19,)


def test_linear_module_matches_nn_linear():
    """Same init, parameters and state_dict keys as torch.nn.Linear; fp32 weights fall back."""
    torch.manual_seed(5)
    ref = torch.nn.Linear(12, 7)
    torch.manual_seed(5)
    ours = mpkern.nn.Linear(12, 7)
    assert isinstance(ours, torch.nn.Linear)
    assert list(ours.state_dict()) == list(ref.state_dict()) == ["weight", "bias"]
    for k, v in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v)
    x = torch.randn(3, 12)
    assert torch.equal(ours(x), ref(x))  # fp32 -> F.linear
    assert mpkern.nn.Linear(4, 2, bias=False).bias is None


@pytest.mark.parametrize("backend", MM_ROUTES)
def test_convert_keeps_state_dict(backend):
    torch.manual_seed(0)
    dtype = torch.bfloat16
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.GELU(),
                                torch.nn.Sequential(torch.nn.Linear(24, 8, bias=False))).to(DEVICE, dtype)
    plain = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.GELU(),
                                torch.nn.Sequential(torch.nn.Linear(24, 8, bias=False))).to(DEVICE, dtype)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    x = rand([5, 16], dtype, torch.Generator().manual_seed(1))
    with torch.no_grad():
        y0 = model(x)
    out = mpkern.nn.convert(model)
    assert out is model
    assert isinstance(model[0], mpkern.nn.Linear) and isinstance(model[2][0], mpkern.nn.Linear)
    assert all(p is q for p, q in zip(model.parameters(), params))
    assert list(model.state_dict()) == list(sd)
    for k, v in model.state_dict().items():
        assert torch.equal(v, sd[k])
    with forced(backend), torch.no_grad():
        y1 = model(x)
    assert (d(y1) - d(y0)).abs().max().item() <= 0.1 * d(y0).abs().max().item()
    plain.load_state_dict(model.state_dict())  # both directions
    model.load_state_dict(plain.state_dict())
    # a converted root Linear, and fp32_main_grad set on already-converted modules
    lin = torch.nn.Linear(3, 2)
    assert mpkern.nn.convert(lin, fp32_main_grad=True) is lin and lin.fp32_main_grad
    mpkern.nn.convert(model, fp32_main_grad=True)
    assert model[0].fp32_main_grad


@pytest.mark.parametrize("backend", MM_ROUTES)
def test_converted_model_trains(backend):
    """A converted bf16 model with fp32 main_grad learns (loss falls) with FusedAdamWMP, which reads
    main_grad and whose zero_grad clears it."""
    import mpkern

    torch.manual_seed(0)
    dtype = torch.bfloat16
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).to(DEVICE, dtype)
    mpkern.nn.convert(model, fp32_main_grad=True)
    gen = torch.Generator().manual_seed(0)
    x = rand([64, 8], dtype, gen)
    target = (d(x)[:, :1] * 0.5 - d(x)[:, 1:2]).to(dtype).to(DEVICE)
    opt = mpkern.FusedAdamWMP(model.parameters(), lr=1e-2)
    losses = []
    with forced(backend):
        for _ in range(25):
            loss = ((model(x).float() - target.float()) ** 2).mean()
            loss.backward()
            assert model[0].weight.grad is None and model[0].weight.main_grad.dtype == torch.float32
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("backend", MM_ROUTES)
def test_opcheck(backend):
    gen = torch.Generator().manual_seed(0)
    dt = torch.bfloat16
    with forced(backend):
        a = rand([2, 5, 19], dt, gen).requires_grad_()
        b = rand([19, 7], dt, gen, "transposed").requires_grad_()
        w = rand([7, 19], dt, gen).requires_grad_()
        bias = rand([7], torch.float32, gen).requires_grad_()
        torch.library.opcheck(torch.ops.mpkern.matmul.default, (a, b, bias, None))
        torch.library.opcheck(torch.ops.mpkern.matmul.default, (a, b, None, torch.float32))
        torch.library.opcheck(torch.ops.mpkern.linear.default, (a, w, bias, None))
        torch.library.opcheck(torch.ops.mpkern.linear.default, (a.detach(), w.detach(), None, torch.float32))
        out = rand([5, 7], torch.float32, gen)
        torch.library.opcheck(torch.ops.mpkern.matmul_accumulate_.default, (a.detach()[0], b.detach(), out))


@pytest.mark.parametrize("backend", MM_ROUTES)
def test_torch_compile_fullgraph(backend):
    gen = torch.Generator().manual_seed(0)
    dt = torch.bfloat16
    x = rand([4, 16], dt, gen).requires_grad_()
    w = rand([8, 16], dt, gen).requires_grad_()
    bias = rand([8], dt, gen).requires_grad_()

    def f(x, w, bias):
        return linear(x, w, bias, out_dtype=torch.float32)

    torch._dynamo.reset()
    with forced(backend):
        cf = torch.compile(f, fullgraph=True)
        y = cf(x, w, bias)
        y.sum().backward()
        y_eager = f(x.detach(), w.detach(), bias.detach())
    assert y.dtype == torch.float32
    assert torch.allclose(y.detach(), y_eager, rtol=1e-5, atol=1e-5)
    assert x.grad is not None and w.grad is not None and bias.grad is not None
    assert torch.allclose(bias.grad.float().cpu(), torch.full((8,), 4.0))


def _bf(*shape, dtype=torch.bfloat16, device=DEVICE):
    return torch.ones(shape, dtype=dtype, device=device)


@pytest.mark.parametrize("call, exc, words", [
    (lambda: matmul(_bf(3, 4), _bf(5, 6)), ValueError, ["(3, 4)", "(5, 6)", "inner"]),
    (lambda: linear(_bf(2, 3, 4), _bf(6, 5)), ValueError, ["(2, 3, 4)", "(6, 5)"]),
    (lambda: matmul(_bf(3, 4), _bf(4)), ValueError, ["(4,)", "2-D"]),
    (lambda: matmul(_bf(3, 4, dtype=torch.float32), _bf(4, 5, dtype=torch.float32)), TypeError, ["float32"]),
    (lambda: matmul(_bf(3, 4, dtype=torch.int32), _bf(4, 5, dtype=torch.int32)), TypeError, ["int32"]),
    (lambda: matmul(_bf(3, 4), _bf(4, 5, dtype=torch.float16)), TypeError, ["(3, 4)", "(4, 5)", "float16"]),
    (lambda: matmul(_bf(3, 4), _bf(4, 5), bias=_bf(4)), ValueError, ["(5,)", "(4,)"]),
    (lambda: linear(_bf(3, 4), _bf(5, 4), _bf(5, 1)), ValueError, ["(5,)", "(5, 1)"]),
    (lambda: linear(_bf(3, 4), _bf(5, 4), _bf(5, dtype=torch.int64)), TypeError, ["int64"]),
    (lambda: matmul(_bf(3, 4), _bf(4, 5), out_dtype=torch.int8), TypeError, ["int8"]),
    (lambda: matmul(_bf(3, 4), _bf(4, 5, device="meta")), ValueError, ["meta", "(3, 4)"]),
    (lambda: matmul_accumulate_(_bf(3, 4), _bf(4, 5), _bf(3, 5)), ValueError, ["float32", "(3, 5)"]),
])
def test_bad_inputs(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def _tuning_key(a, b, c, accumulate=False):
    """The GPU autotuner's cache key for ``a @ b -> c``, computed the way triton's Autotuner.run does
    (the values of its ``keys`` among the launch arguments, then the dtypes of the tensors)."""
    tk = pytest.importorskip("mpkern.triton_kernels.matmul")
    tuner = tk._matmul_kernel_tuned
    args = dict(zip(tuner.arg_names, tk.kernel_args(a, b, c, None)))
    args.update(HAS_BIAS=False, ACCUMULATE=accumulate, OUT_BF16=c.dtype == torch.bfloat16, UPCAST=False)
    key = [args[k] for k in tuner.keys if k in args]
    return tuple(key + [str(v.dtype) for v in args.values() if hasattr(v, "dtype")])


def _wgrad(tokens, n_out=256, k_in=512):
    """nn.Linear's weight-gradient GEMM: grad_out.t() (n_out, tokens) @ x (tokens, k_in) += main_grad."""
    meta = dict(device="meta", dtype=torch.bfloat16)
    return (torch.empty(tokens, n_out, **meta).t(), torch.empty(tokens, k_in, **meta),
            torch.empty(n_out, k_in, device="meta", dtype=torch.float32))


def test_autotune_key_buckets_the_token_count_in_every_gemm():
    """issue 13 item 9: in the weight-gradient GEMM the token count is K (and in a plain contiguous
    (tokens, K) @ (K, N) product with a varying K, also A's row stride): two token counts in one
    power-of-two bucket share one tuning; a count in another bucket gets its own."""
    assert _tuning_key(*_wgrad(3000), accumulate=True) == _tuning_key(*_wgrad(4000), accumulate=True)
    assert _tuning_key(*_wgrad(3000), accumulate=True) != _tuning_key(*_wgrad(1000), accumulate=True)
    meta = dict(device="meta", dtype=torch.float16)

    def plain(m, k, n):
        return torch.empty(m, k, **meta), torch.empty(k, n, **meta), torch.empty(m, n, **meta)

    # K and A's row stride, N and B's row stride (a stride's class -- 1, a multiple of 16 -- stays in the key)
    assert _tuning_key(*plain(64, 3008, 96)) == _tuning_key(*plain(64, 4000, 96))
    assert _tuning_key(*plain(64, 96, 3008)) == _tuning_key(*plain(64, 96, 4000))
    assert _tuning_key(*plain(64, 96, 3008)) != _tuning_key(*plain(64, 96, 5008))
    # the layout still tells a transposed operand apart (a different kernel specialisation)
    a, b, c = plain(64, 96, 128)
    assert _tuning_key(a, b, c) != _tuning_key(a, b.t().contiguous().t(), c)


def test_eager_path_equals_the_op_and_dispatch_modes_still_see_the_op():
    """Eager calls on plain tensors skip the dispatcher (same implementation, same backward); under a
    TorchDispatchMode the op is what the mode sees, and both give the same bits and gradients."""
    from conftest import OpsSeen as Seen

    gen = torch.Generator().manual_seed(9)
    x = rand([6, 5, 24], torch.bfloat16, gen).requires_grad_()
    w = torch.nn.Parameter(rand([12, 24], torch.bfloat16, gen))
    bias = torch.nn.Parameter(rand([12], torch.float32, gen))
    gy = rand([6, 5, 12], torch.bfloat16, gen)
    y = linear(x, w, bias)
    y.backward(gy)
    grads = [t.grad.clone() for t in (x, w, bias)]
    for t in (x, w, bias):
        t.grad = None
    with Seen() as mode:
        y2 = linear(x, w, bias)
    assert "mpkern.linear.default" in mode.ops and "aten.mm.out" not in mode.ops
    y2.backward(gy)
    assert torch.equal(y, y2)
    for g, t in zip(grads, (x, w, bias)):
        assert torch.equal(g, t.grad)
    mg, mg2 = torch.zeros(12, 24), torch.zeros(12, 24)
    matmul_accumulate_(gy.reshape(-1, 12).t(), x.detach().reshape(-1, 24), mg)
    with Seen() as mode:
        matmul_accumulate_(gy.reshape(-1, 12).t(), x.detach().reshape(-1, 24), mg2)
    assert "mpkern.matmul_accumulate_.default" in mode.ops and torch.equal(mg, mg2)


def test_eager_backward_runs_twice_on_a_retained_graph():
    """A retained graph's backward (gradient release's statistics pass, then its step pass) gives the same
    gradients both times: twice the one-pass gradient, for every input of both ops."""
    gen = torch.Generator().manual_seed(12)
    for op in (linear, matmul):
        x = rand([7, 16], torch.bfloat16, gen).requires_grad_()
        w = torch.nn.Parameter(rand([16, 16], torch.bfloat16, gen))
        bias = torch.nn.Parameter(rand([16], torch.float32, gen))
        y = op(x, w, bias) if op is linear else op(x, w, bias=bias)
        gy = rand([7, 16], torch.bfloat16, gen)
        y.backward(gy, retain_graph=True)
        once = [t.grad.clone() for t in (x, w, bias)]
        y.backward(gy)
        for g1, t in zip(once, (x, w, bias)):
            assert torch.equal(t.grad.float(), (g1.float() * 2).to(t.grad.dtype).float()), op.__name__
