"""Which gradient mpkern uses for a param, and what makes it acceptable: one place for both.

``mpkern.unscale_`` / ``clip_grad_norm_`` (:mod:`mpkern.amp`) and ``FusedAdamWMP`` (its buckets)
walk their params differently, but each grad is looked up by :func:`grad_of` (``main_grad`` when
present, folded with ``.grad``) and refused by :func:`raise_bad_grad`.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _ops

Tensor = torch.Tensor
FLOATS = frozenset((torch.float32, torch.float16, torch.bfloat16))


def grad_of(p: Tensor) -> tuple[Tensor | None, bool]:
    """(the grad mpkern uses for ``p``, whether it is a ``main_grad``): ``p.main_grad`` (fp32) if
    present, else ``p.grad``; with both (a tied weight) their sum in ``main_grad`` (:func:`main_grad_of`)."""
    g = getattr(p, "main_grad", None)
    if g is None:
        return p.grad, False
    return (g if p.grad is None else main_grad_of(p, g)), True


def main_grad_of(p: Tensor, main_grad: Tensor) -> Tensor:
    """``main_grad`` -- with ``p.grad`` added into it first when ``p`` has both.

    A weight shared by an ``fp32_main_grad`` layer (which accumulates into ``main_grad``) and
    another use (an embedding, a plain ``F.linear``) gets the other part of its gradient in
    ``.grad``; the gradient is the sum. It is folded in place (``main_grad += grad``, then
    ``p.grad = None``; zeroed instead inside a CUDA graph capture), so every consumer --
    ``FusedAdamWMP``, ``unscale_``, ``clip_grad_norm_`` -- sees the same, whole gradient and a
    second consumer does not add it twice.
    """
    g16 = p.grad
    if g16 is None:
        return main_grad
    if g16.shape != main_grad.shape or g16.layout != torch.strided:
        raise ValueError(f"a parameter of shape {tuple(p.shape)} has both .main_grad {tuple(main_grad.shape)} and "
                         f".grad {tuple(g16.shape)} ({g16.layout}); they cannot be summed")
    with torch.no_grad():
        main_grad.add_(g16)
        if _ops.capturing():
            g16.zero_()
        else:
            p.grad = None
    return main_grad


def mark_feeds_main_grad(p: Tensor) -> None:
    """Mark ``p`` as a weight whose gradient is accumulated into ``p.main_grad`` by a layer's own
    backward (``mpkern.nn`` with ``fp32_main_grad=True``), not by autograd's AccumulateGrad."""
    if not getattr(p, "_mpkern_feeds_main_grad", False):
        # mpkern's own mark (not an attribute torch declares), read only by feeds_main_grad
        p._mpkern_feeds_main_grad = True  # type: ignore[attr-defined]  # noqa: SLF001 -- see above


def feeds_main_grad(p: Tensor) -> bool:
    """Whether ``p``'s gradient has gone to ``main_grad`` (see :func:`mark_feeds_main_grad`): no
    post-accumulate-grad hook ever fires for it."""
    return bool(getattr(p, "_mpkern_feeds_main_grad", False))


def acceptable(g: Any) -> bool:
    """The cheap combined test of the hot loops: a dense floating-point tensor."""
    return isinstance(g, Tensor) and g.layout == torch.strided and g.dtype in FLOATS


def raise_bad_grad(who: str, where: str, g: Any, p: Tensor | None = None) -> None:
    """Raise the precise error for a grad that failed :func:`acceptable` (or, with ``p``, does not
    match its param). ``who``: ``"FusedAdamWMP"`` (torch.optim's RuntimeError for sparse/complex,
    shape and device checked) or ``"unscale_"``."""
    opt = who == "FusedAdamWMP"
    if not isinstance(g, Tensor):
        raise TypeError(f"{who}: gradient of {where} must be a tensor, got {type(g).__name__}")
    if g.is_sparse or g.layout != torch.strided:
        raise (RuntimeError if opt else ValueError)(
            f"{who}: gradient of {where} is {g.layout}; only dense (strided) gradients are supported "
            "(sparse gradients are not)")
    if opt and g.is_complex():
        raise RuntimeError(f"{who} does not support complex gradients ({where})")
    if g.dtype not in FLOATS:
        raise TypeError(f"{who}: gradient of {where} has dtype {g.dtype}; expected float32, float16 or bfloat16")
    if p is not None and g.shape != p.shape:
        raise ValueError(f"{who}: gradient of {where} has shape {tuple(g.shape)}, param has {tuple(p.shape)}")
    if p is not None:
        raise ValueError(f"{who}: gradient of {where} is on {g.device}, param on {p.device}")


def is_flat(g: Tensor) -> bool:
    """True if ``g`` covers one dense block of memory (contiguous up to a permutation of dims)."""
    if g.is_contiguous():
        return True
    expected = 1
    for d in sorted(range(g.dim()), key=g.stride):
        if g.size(d) != 1 and g.stride(d) != expected:
            return False
        expected *= g.size(d)
    return True


def to_device(t: Tensor, device: torch.device, dtype: torch.dtype | None = None) -> Tensor:
    """``t`` on ``device``, asynchronous only where that is safe (:func:`mpkern._ops.non_blocking_to`:
    never into CPU memory)."""
    return t.to(device=device, dtype=dtype, non_blocking=_ops.non_blocking_to(device))
