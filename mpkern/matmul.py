"""FP16/BF16 matrix multiply with FP32 accumulation: ``mpkern.matmul`` and ``mpkern.linear``.

    matmul(a, b, *, bias=None, out_dtype=None)       a (*, K) @ b (K, N)        -> (*, N)
    linear(x, weight, bias=None, *, out_dtype=None)  x (*, K) @ weight(N, K).T  -> (*, N)

Operands are both float16 or both bfloat16; products are accumulated in fp32, ``bias`` (shape
(N,), any float dtype) is added in fp32, and the result is rounded once to ``out_dtype`` (default:
the operand dtype; float16, bfloat16 or float32).

Ops (``torch.library.custom_op``, fake kernels, ``register_autograd``), in the ``mpkern``
namespace:

* ``mpkern::matmul(a, b, bias?, out_dtype?)`` and ``mpkern::linear(x, weight, bias?, out_dtype?)``.
  Backward: dA and dB are the same op (same kernel, fp32 accumulation) on transposed views -- no
  copies; the output gradient is rounded to the operand dtype first when the output is fp32.
  dbias is an fp32-accumulated column sum of the output gradient.
* ``mpkern::matmul_accumulate_(a, b, out!)``: ``out (fp32) += a @ b`` in the GEMM epilogue -- the
  weight-gradient accumulation into ``main_grad`` used by :mod:`mpkern.nn`.

Routes (:mod:`mpkern.matmul_routes`): the same contract runs on the platform's GEMM (``cublas`` on
CUDA, ``aten`` on CPU: oneDNN with AMX / AVX512-BF16 where the CPU has them), on mpkern's Triton
kernel (``triton``), or on an fp32 GEMM of upcast copies (``upcast``); each problem (device, dtypes,
epilogue, layout, size bucket) takes the fastest that keeps the contract, timed once and cached in
memory and on disk (:mod:`mpkern.route_cache`). ``MPKERN_MATMUL_ROUTE=triton|cublas|aten|upcast``
forces one (:func:`use_route` within a block); :func:`routes` says which a problem may take and why not.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from . import _backend, matmul_routes
from .matmul_routes import BIAS_DTYPES, IN_DTYPES, NOTES, OUT_DTYPES, temp_meter

Tensor = torch.Tensor

__all__ = ["matmul", "linear", "matmul_accumulate_", "routes", "route_summary", "use_route", "fold_rows", "temp_meter",
           "IN_DTYPES", "NOTES"]


def routes(device: torch.device | str, dtype: torch.dtype = torch.bfloat16, out_dtype: torch.dtype | None = None,
           epilogue: str = "none") -> dict[str, str]:
    """``{route: ""}`` for each route that may run a GEMM of ``dtype`` operands into ``out_dtype``
    (default ``dtype``) on ``device`` -- ``epilogue``: ``"none"``, ``"bias"`` (a bias of ``dtype``) or
    ``"accumulate"`` (fp32 ``+=``) -- and ``{route: why not}`` for the others (``mpkern info``)."""
    if epilogue not in ("none", "bias", "accumulate"):
        raise ValueError(f"routes: epilogue must be 'none', 'bias' or 'accumulate', got {epilogue!r}")
    out_dtype = torch.float32 if epilogue == "accumulate" else out_dtype or dtype
    return matmul_routes.candidates(torch.device(device), dtype, out_dtype, epilogue,
                                    dtype if epilogue == "bias" else None)


def route_summary(device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> str:
    """The routes a ``dtype`` GEMM may take on ``device``, in words: ``"aten or upcast, the faster per
    shape"``, or the one route (``mpkern compare``'s and ``bench``'s labels)."""
    ok = [r for r, why in routes(device, dtype).items() if not why]
    return ok[0] if len(ok) == 1 else " or ".join(ok) + ", the faster per shape"


def use_route(name: str | None) -> contextlib.AbstractContextManager[None]:
    """Within the block, every GEMM of these ops runs on route ``name`` (``"triton"``, ``"cublas"``,
    ``"aten"``, ``"upcast"``; ``"auto"`` or None: the measured choice), as
    ``MPKERN_MATMUL_ROUTE=name`` would; the previous setting is restored after. A route that cannot
    keep the contract for a GEMM is refused by that GEMM with the reason."""
    if name is not None and not isinstance(name, str):
        raise TypeError(f"use_route: name must be a str or None, got {type(name).__name__}")
    value = None if name is None else name.strip().lower()
    if value is not None and value not in (*matmul_routes.ROUTES, "auto"):
        raise ValueError(f"use_route: {name!r} is not a route; expected auto, {', '.join(matmul_routes.ROUTES)} "
                         "or None")
    return _backend.env_setting(matmul_routes.ENV, value)


# ---- validation ---------------------------------------------------------------------------------
def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _validate(op: str, a: Tensor, b: Tensor, bias: Tensor | None, out_dtype: torch.dtype | None,
              weight: bool) -> None:
    """Raise TypeError/ValueError naming the shapes. ``weight``: b is (N, K) (linear) not (K, N)."""
    an, bn = ("x", "weight") if weight else ("a", "b")
    for name, t in ((an, a), (bn, b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if a.dtype not in IN_DTYPES:
        raise TypeError(f"{op}: {an} must be float16 or bfloat16, got {an} {a.dtype} of shape {_shape(a)}")
    if b.dtype != a.dtype:
        raise TypeError(f"{op}: {an} and {bn} must have the same dtype, got {an} {a.dtype} {_shape(a)} and "
                        f"{bn} {b.dtype} {_shape(b)}")
    if a.dim() < 1:
        raise ValueError(f"{op}: {an} must have at least 1 dimension, got shape {_shape(a)}")
    if b.dim() != 2:
        want = "(N, K)" if weight else "(K, N)"
        raise ValueError(f"{op}: {bn} must be 2-D {want}, got shape {_shape(b)}")
    k_b, n = (b.shape[1], b.shape[0]) if weight else (b.shape[0], b.shape[1])
    if a.shape[-1] != k_b:
        rel = f"{an}.shape[-1] = {a.shape[-1]} != {bn}.shape[{1 if weight else 0}] = {k_b}"
        raise ValueError(f"{op}: inner dimensions differ: {an} {_shape(a)}, {bn} {_shape(b)} ({rel})")
    if a.device != b.device:
        raise ValueError(f"{op}: {an} {_shape(a)} is on {a.device} but {bn} {_shape(b)} is on {b.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"{op}: bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if bias.dtype not in BIAS_DTYPES:
            raise TypeError(f"{op}: bias must be float16, bfloat16 or float32, got {bias.dtype}")
        if _shape(bias) != (n,):
            raise ValueError(f"{op}: bias must have shape ({n},) for {an} {_shape(a)} and {bn} {_shape(b)}, "
                             f"got {_shape(bias)}")
        if bias.device != a.device:
            raise ValueError(f"{op}: bias {_shape(bias)} is on {bias.device} but {an} {_shape(a)} is on {a.device}")
    if out_dtype is not None and out_dtype not in OUT_DTYPES:
        raise TypeError(f"{op}: out_dtype must be None, float16, bfloat16 or float32, got {out_dtype}")


# ---- compute --------------------------------------------------------------------------------------
def _mm2d(a: Tensor, b: Tensor, bias: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    """2-D ``a (M, K) @ b (K, N) (+ bias)`` in a new (M, N) tensor of ``out_dtype``, on the chosen route."""
    if a.shape[0] == 0 or b.shape[1] == 0:
        return torch.empty(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    return matmul_routes.run(a, b, bias, out_dtype)


def fold_rows(a: Tensor) -> Tensor:
    """(*, K) -> (M, K) with M the product of the batch dims: a view when they can be folded (a copy
    otherwise) -- how these ops treat batch dimensions."""
    if a.dim() == 2:
        return a
    m = 1
    for d in a.shape[:-1]:
        m = m * d
    return a.reshape(m, a.shape[-1])


def _out_shape(a: Tensor, n: int) -> list[int]:
    return list(a.shape[:-1]) + [n]


# ---- implementations (the ops' bodies; the eager path calls them directly) ------------------------
def _matmul_impl(a: Tensor, b: Tensor, bias: Tensor | None, out_dtype: torch.dtype | None) -> Tensor:
    out = _mm2d(fold_rows(a), b, bias, out_dtype or a.dtype)
    return out if a.dim() == 2 else out.view(_out_shape(a, b.shape[1]))


def _linear_impl(x: Tensor, weight: Tensor, bias: Tensor | None, out_dtype: torch.dtype | None) -> Tensor:
    out = _mm2d(fold_rows(x), weight.t(), bias, out_dtype or x.dtype)
    return out if x.dim() == 2 else out.view(_out_shape(x, weight.shape[0]))


def _validate_accumulate(a: Tensor, b: Tensor, out: Tensor) -> None:
    _validate("matmul_accumulate_", a, b, None, None, weight=False)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"matmul_accumulate_: out must be a torch.Tensor, got {type(out).__name__}")
    if a.dim() != 2 or out.dtype != torch.float32 or _shape(out) != (a.shape[0], b.shape[1]):
        raise ValueError(f"matmul_accumulate_: out must be float32 of shape ({a.shape[0]}, {b.shape[1]}) for "
                         f"a {_shape(a)} @ b {_shape(b)}, got {out.dtype} {_shape(out)}")
    if out.device != a.device:
        raise ValueError(f"matmul_accumulate_: out is on {out.device} but a {_shape(a)} is on {a.device}")


def _accumulate_impl(a: Tensor, b: Tensor, out: Tensor) -> None:
    if out.numel():
        matmul_routes.run(a, b, None, torch.float32, out)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _direct(*tensors: Tensor | None) -> bool:
    """Whether a call may run its implementation straight away instead of through the dispatcher (a
    round trip through torch.library's Python wrappers: 60-80 us a call on a CPU, 6 % of a 1 ms GEMM):
    in eager mode, on plain tensors (no subclass -- FakeTensor, DTensor, FunctionalTensor -- needs the
    op), with no TorchDispatchMode watching (a memory or FLOP meter sees the op as one). The same
    implementation and backward run either way."""
    return (not torch.compiler.is_compiling() and not is_in_torch_dispatch_mode()
            and all(t is None or type(t) in _PLAIN for t in tensors))


def _needs_grad(*tensors: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# ---- ops ------------------------------------------------------------------------------------------
@torch.library.custom_op("mpkern::matmul", mutates_args=())
def _matmul_op(a: Tensor, b: Tensor, bias: Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> Tensor:
    _validate("matmul", a, b, bias, out_dtype, weight=False)
    return _matmul_impl(a, b, bias, out_dtype)


@torch.library.custom_op("mpkern::linear", mutates_args=())
def _linear_op(x: Tensor, weight: Tensor, bias: Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> Tensor:
    _validate("linear", x, weight, bias, out_dtype, weight=True)
    return _linear_impl(x, weight, bias, out_dtype)


@torch.library.custom_op("mpkern::matmul_accumulate_", mutates_args=("out",))
def _matmul_accumulate_op(a: Tensor, b: Tensor, out: Tensor) -> None:
    _validate_accumulate(a, b, out)
    _accumulate_impl(a, b, out)


@_matmul_op.register_fake
def _matmul_fake(a, b, bias=None, out_dtype=None):
    _validate("matmul", a, b, bias, out_dtype, weight=False)
    return a.new_empty(_out_shape(a, b.shape[1]), dtype=out_dtype or a.dtype)


@_linear_op.register_fake
def _linear_fake(x, weight, bias=None, out_dtype=None):
    _validate("linear", x, weight, bias, out_dtype, weight=True)
    return x.new_empty(_out_shape(x, weight.shape[0]), dtype=out_dtype or x.dtype)


@_matmul_accumulate_op.register_fake
def _matmul_accumulate_fake(a, b, out):
    torch._check(out.dtype == torch.float32, lambda: f"matmul_accumulate_: out must be float32, got {out.dtype}")
    return None


# ---- autograd -------------------------------------------------------------------------------------
def _setup_context(ctx, inputs, output):
    a, b, bias, _ = inputs
    ctx.save_for_backward(a, b)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _grad_operand(gy: Tensor, dtype: torch.dtype) -> Tensor:
    """The output gradient as a GEMM operand: rounded to the operand dtype when it is fp32."""
    return gy if gy.dtype == dtype else gy.to(dtype)


def _dbias(ctx, gy: Tensor, needs: tuple[bool, ...]) -> Tensor | None:
    if ctx.bias_dtype is None or not needs[2]:
        return None
    return gy.reshape(-1, gy.shape[-1]).sum(0, dtype=torch.float32).to(ctx.bias_dtype)


def _matmul_backward(ctx, gy, needs: tuple[bool, ...] | None = None):
    """dA, dB, dbias of ``matmul`` (``needs``: which inputs need one; default ``ctx.needs_input_grad``)."""
    needs = ctx.needs_input_grad if needs is None else needs
    a, b = ctx.saved_tensors
    g = _grad_operand(gy, a.dtype)
    da = db = None
    if needs[0]:
        da = _call_matmul(g, b.t(), None, a.dtype)  # (*, N) @ (N, K)
    if needs[1]:
        db = _call_matmul(fold_rows(a).t(), fold_rows(g), None, b.dtype)  # (K, M) @ (M, N)
    return da, db, _dbias(ctx, gy, needs), None


def _linear_backward(ctx, gy, needs: tuple[bool, ...] | None = None):
    """dX, dW, dbias of ``linear`` (``needs`` as in :func:`_matmul_backward`)."""
    needs = ctx.needs_input_grad if needs is None else needs
    x, w = ctx.saved_tensors
    g = _grad_operand(gy, x.dtype)
    dx = dw = None
    if needs[0]:
        dx = _call_matmul(g, w, None, x.dtype)  # (*, N) @ (N, K)
    if needs[1]:
        dw = _call_matmul(fold_rows(g).t(), fold_rows(x), None, w.dtype)  # (N, M) @ (M, K)
    return dx, dw, _dbias(ctx, gy, needs), None


torch.library.register_autograd("mpkern::matmul", _matmul_backward, setup_context=_setup_context)
torch.library.register_autograd("mpkern::linear", _linear_backward, setup_context=_setup_context)


#: (implementation, backward) of each op, for the eager path's autograd
_EAGER = {"matmul": (_matmul_impl, _matmul_backward), "linear": (_linear_impl, _linear_backward)}


class _EagerFunction(torch.autograd.Function):
    """The eager path's autograd: op ``name``'s implementation, context setup and backward (the same
    the registered op uses), without the dispatcher."""

    @staticmethod
    def forward(ctx, name, a, b, bias, out_dtype):
        _setup_context(ctx, (a, b, bias, out_dtype), None)
        ctx.op = name
        return _EAGER[name][0](a, b, bias, out_dtype)

    @staticmethod
    def backward(ctx, gy):
        # the op's backward reads which inputs need a gradient by the op's own argument positions
        # (ctx is left as it is: a retained graph runs this backward again)
        return (None, *_EAGER[ctx.op][1](ctx, gy, ctx.needs_input_grad[1:]))


def _call_matmul(a: Tensor, b: Tensor, bias: Tensor | None, out_dtype: torch.dtype | None) -> Tensor:
    """``mpkern::matmul`` on validated operands: straight to the implementation when :func:`_direct`
    allows (through :class:`_EagerFunction` when a gradient is needed), else through the op."""
    if not _direct(a, b, bias):
        return torch.ops.mpkern.matmul(a, b, bias, out_dtype)
    if _needs_grad(a, b, bias):
        return _EagerFunction.apply("matmul", a, b, bias, out_dtype)
    return _matmul_impl(a, b, bias, out_dtype)


# ---- public API -----------------------------------------------------------------------------------
def matmul(a: Tensor, b: Tensor, *, bias: Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> Tensor:
    """``a @ b (+ bias)`` with fp32 accumulation.

    Args:
        a: (*, K), float16 or bfloat16, any strides (batch dims are folded into M).
        b: (K, N), same dtype as ``a``, any strides (a transposed view is not copied).
        bias: optional (N,), float16/bfloat16/float32; added in fp32 before the final rounding.
        out_dtype: None (``a.dtype``), or float16/bfloat16/float32.

    Returns (*, N) in ``out_dtype``. Differentiable in ``a``, ``b`` and ``bias``.
    Raises TypeError (dtypes) or ValueError (shapes, devices) with the shapes in the message.
    """
    _validate("matmul", a, b, bias, out_dtype, weight=False)
    return _call_matmul(a, b, bias, out_dtype)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *,
           out_dtype: torch.dtype | None = None) -> Tensor:
    """``x @ weight.T (+ bias)`` like ``torch.nn.functional.linear``, with fp32 accumulation.

    ``x`` (*, K) and ``weight`` (N, K): both float16 or both bfloat16; ``bias`` (N,); output
    (*, N) in ``out_dtype`` (default ``x.dtype``). See :func:`matmul`.
    """
    _validate("linear", x, weight, bias, out_dtype, weight=True)
    if not _direct(x, weight, bias):
        return torch.ops.mpkern.linear(x, weight, bias, out_dtype)
    if _needs_grad(x, weight, bias):
        return _EagerFunction.apply("linear", x, weight, bias, out_dtype)
    return _linear_impl(x, weight, bias, out_dtype)


def matmul_accumulate_(a: Tensor, b: Tensor, out: Tensor) -> Tensor:
    """``out += a @ b`` for 2-D fp16/bf16 ``a`` (M, K), ``b`` (K, N) and fp32 ``out`` (M, N).

    The addition happens in the GEMM epilogue (no temporary product). Not differentiable.
    Returns ``out``.
    """
    _validate_accumulate(a, b, out)
    if _direct(a, b, out):
        _accumulate_impl(a, b, out)
    else:
        torch.ops.mpkern.matmul_accumulate_(a, b, out)
    return out
