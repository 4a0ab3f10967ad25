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

Backends (:func:`backend_for`): ``triton`` runs ``mpkern.triton_kernels.matmul`` (CUDA tensors, or
CPU tensors under ``TRITON_INTERPRET=1`` when ``MPKERN_BACKEND=triton``); every other backend
(``cpu``, ``torch``, and ``cuda`` -- there is no C++ GEMM) computes ``a.float() @ b.float()``
through ATen, i.e. also with fp32 accumulation, then casts.
"""

from __future__ import annotations

import torch

from . import _backend

Tensor = torch.Tensor

_IN_DTYPES = (torch.float16, torch.bfloat16)
_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BIAS_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

__all__ = ["matmul", "linear", "matmul_accumulate_", "backend_for", "BACKEND_NOTES"]

#: What each backend does for these ops (for ``mpkern info``).
BACKEND_NOTES = {
    "triton": "Triton tiled GEMM, fp32 accumulator, fused bias / fp32 accumulate / cast epilogue",
    "cuda": "no C++ GEMM: Triton when available, else ATen a.float() @ b.float() (fp32 accumulation)",
    "cpu": "ATen a.float() @ b.float() (fp32 accumulation), then cast",
    "torch": "ATen a.float() @ b.float() (fp32 accumulation), then cast",
}


def backend_for(device: torch.device | str) -> str:
    """``'triton'`` or ``'torch'`` (ATen, fp32 accumulation): what the matmul ops run on ``device``.

    Follows :func:`mpkern._backend.select` (so ``MPKERN_BACKEND`` is honoured and a forced backend
    that cannot run is an error); the ``cuda`` backend has no C++ GEMM and uses Triton when it can.
    """
    device = torch.device(device)
    name = _backend.select(device)
    if name == "triton":
        return "triton"
    if name == "cuda" and _backend.forced() is None and not _backend.runs_on("triton", device):
        return "triton"
    return "torch"


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
    if a.dtype not in _IN_DTYPES:
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
        if bias.dtype not in _BIAS_DTYPES:
            raise TypeError(f"{op}: bias must be float16, bfloat16 or float32, got {bias.dtype}")
        if _shape(bias) != (n,):
            raise ValueError(f"{op}: bias must have shape ({n},) for {an} {_shape(a)} and {bn} {_shape(b)}, "
                             f"got {_shape(bias)}")
        if bias.device != a.device:
            raise ValueError(f"{op}: bias {_shape(bias)} is on {bias.device} but {an} {_shape(a)} is on {a.device}")
    if out_dtype is not None and out_dtype not in _OUT_DTYPES:
        raise TypeError(f"{op}: out_dtype must be None, float16, bfloat16 or float32, got {out_dtype}")


# ---- compute --------------------------------------------------------------------------------------
#: Callables told, at every CPU (ATen fp32) GEMM of these ops, the peak bytes of the fp32 temporaries
#: the call held at once (operand copies, fp32 product, and the rounded output while the product is
#: alive). A ``TorchDispatchMode`` sees these ops but not the tensors inside them, so a memory meter
#: (``mpkern.compare``'s ``LiveBytes``) adds them here.
_temp_meters: list = []


def _note_temps(*groups: int) -> None:
    peak = max(groups)
    for meter in _temp_meters:
        meter(peak)


def _mm2d(a: Tensor, b: Tensor, bias: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    """2-D ``a (M, K) @ b (K, N) (+ bias)`` in a new (M, N) tensor of ``out_dtype``."""
    if backend_for(a.device) == "triton":
        from mpkern.triton_kernels import matmul as tk

        return tk.matmul(a, b, bias, out_dtype)
    return _mm2d_fp32(a, b, bias, out_dtype)


#: The ATen path upcasts row blocks of ``a`` of about this many bytes (fp32 copy + fp32 product) at a
#: time, so its temporaries do not grow with the batch: the fp32 copy of ``b`` (a weight) and one block.
_CPU_BLOCK_BYTES = 4 << 20


def _mm2d_fp32(a: Tensor, b: Tensor, bias: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    """``_mm2d`` through ATen: an fp32 GEMM of the upcast operands in row blocks, one rounding each."""
    m, k = a.shape
    n = b.shape[1]
    b32 = b.float()
    bias32 = None if bias is None else bias.float()
    rows = max(64, _CPU_BLOCK_BYTES // (4 * (k + n)))
    if rows >= m:
        a32 = a.float()
        r = a32 @ b32
        copies = (a32.nbytes if a32 is not a else 0) + (b32.nbytes if b32 is not b else 0)
        del a32, b32
        if bias32 is not None:
            r += bias32
        out = r.to(out_dtype)
        if _temp_meters:
            _note_temps(copies + r.nbytes, r.nbytes + (out.nbytes if out is not r else 0))
        return out
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    block = 0
    for i in range(0, m, rows):
        a32 = a[i:i + rows].float()
        r = a32 @ b32
        if bias32 is not None:
            r += bias32
        out[i:i + rows].copy_(r)  # the one rounding of this block
        block = max(block, a32.nbytes + r.nbytes)
    if _temp_meters:
        _note_temps((b32.nbytes if b32 is not b else 0) + out.nbytes + block)
    return out


def _fold(a: Tensor) -> Tensor:
    """(*, K) -> (M, K), a view when the batch dims can be folded (a copy otherwise)."""
    m = 1
    for d in a.shape[:-1]:
        m = m * d
    return a.reshape(m, a.shape[-1])


def _out_shape(a: Tensor, n: int) -> list[int]:
    return list(a.shape[:-1]) + [n]


# ---- ops ------------------------------------------------------------------------------------------
@torch.library.custom_op("mpkern::matmul", mutates_args=())
def _matmul_op(a: Tensor, b: Tensor, bias: Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> Tensor:
    _validate("matmul", a, b, bias, out_dtype, weight=False)
    out = _mm2d(_fold(a), b, bias, out_dtype or a.dtype)
    return out.view(_out_shape(a, b.shape[1]))


@torch.library.custom_op("mpkern::linear", mutates_args=())
def _linear_op(x: Tensor, weight: Tensor, bias: Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> Tensor:
    _validate("linear", x, weight, bias, out_dtype, weight=True)
    out = _mm2d(_fold(x), weight.t(), bias, out_dtype or x.dtype)
    return out.view(_out_shape(x, weight.shape[0]))


@torch.library.custom_op("mpkern::matmul_accumulate_", mutates_args=("out",))
def _matmul_accumulate_op(a: Tensor, b: Tensor, out: Tensor) -> None:
    _validate("matmul_accumulate_", a, b, None, None, weight=False)
    if a.dim() != 2 or out.dtype != torch.float32 or _shape(out) != (a.shape[0], b.shape[1]):
        raise ValueError(f"matmul_accumulate_: out must be float32 of shape ({a.shape[0]}, {b.shape[1]}) for "
                         f"a {_shape(a)} @ b {_shape(b)}, got {out.dtype} {_shape(out)}")
    if out.device != a.device:
        raise ValueError(f"matmul_accumulate_: out is on {out.device} but a {_shape(a)} is on {a.device}")
    if backend_for(a.device) == "triton":
        from mpkern.triton_kernels import matmul as tk

        tk.matmul_into(a, b, out, accumulate=True)
    else:
        a32, b32 = a.float(), b.float()
        r = a32 @ b32
        if _temp_meters:
            _note_temps(a32.nbytes + b32.nbytes + r.nbytes)
        del a32, b32
        out.add_(r)


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


def _dbias(ctx, gy: Tensor) -> Tensor | None:
    if ctx.bias_dtype is None or not ctx.needs_input_grad[2]:
        return None
    return gy.reshape(-1, gy.shape[-1]).sum(0, dtype=torch.float32).to(ctx.bias_dtype)


def _matmul_backward(ctx, gy):
    a, b = ctx.saved_tensors
    g = _grad_operand(gy, a.dtype)
    da = db = None
    if ctx.needs_input_grad[0]:
        da = torch.ops.mpkern.matmul(g, b.t(), None, a.dtype)  # (*, N) @ (N, K)
    if ctx.needs_input_grad[1]:
        db = torch.ops.mpkern.matmul(_fold(a).t(), _fold(g), None, b.dtype)  # (K, M) @ (M, N)
    return da, db, _dbias(ctx, gy), None


def _linear_backward(ctx, gy):
    x, w = ctx.saved_tensors
    g = _grad_operand(gy, x.dtype)
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = torch.ops.mpkern.matmul(g, w, None, x.dtype)  # (*, N) @ (N, K)
    if ctx.needs_input_grad[1]:
        dw = torch.ops.mpkern.matmul(_fold(g).t(), _fold(x), None, w.dtype)  # (N, M) @ (M, K)
    return dx, dw, _dbias(ctx, gy), None


torch.library.register_autograd("mpkern::matmul", _matmul_backward, setup_context=_setup_context)
torch.library.register_autograd("mpkern::linear", _linear_backward, setup_context=_setup_context)


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
    return torch.ops.mpkern.matmul(a, b, bias, out_dtype)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *,
           out_dtype: torch.dtype | None = None) -> Tensor:
    """``x @ weight.T (+ bias)`` like ``torch.nn.functional.linear``, with fp32 accumulation.

    ``x`` (*, K) and ``weight`` (N, K): both float16 or both bfloat16; ``bias`` (N,); output
    (*, N) in ``out_dtype`` (default ``x.dtype``). See :func:`matmul`.
    """
    _validate("linear", x, weight, bias, out_dtype, weight=True)
    return torch.ops.mpkern.linear(x, weight, bias, out_dtype)


def matmul_accumulate_(a: Tensor, b: Tensor, out: Tensor) -> Tensor:
    """``out += a @ b`` for 2-D fp16/bf16 ``a`` (M, K), ``b`` (K, N) and fp32 ``out`` (M, N).

    The addition happens in the GEMM epilogue (no temporary product). Not differentiable.
    Returns ``out``.
    """
    torch.ops.mpkern.matmul_accumulate_(a, b, out)
    return out
