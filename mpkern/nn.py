"""``mpkern.nn``: ``Linear`` on the fp32-accumulating GEMM, with optional fp32 ``main_grad``.

* :class:`Linear` -- a subclass of ``torch.nn.Linear`` (same parameters, state_dict keys, init and
  ``isinstance``) whose forward is :func:`mpkern.linear` for fp16/bf16 weights and inputs of the
  same dtype -- and under autocast for a weight of the autocast dtype (the input is cast to it,
  as ``F.linear`` under autocast would); any other combination (fp32 weights, mixed dtypes) runs
  ``torch.nn.functional.linear`` unchanged, and with ``fp32_main_grad=True`` says so once (the
  weight gradient then goes to ``.grad``).
* ``fp32_main_grad=True``: the weight gradient ``dW = dY^T X`` is accumulated straight into
  ``weight.main_grad`` (fp32, allocated at the first backward, then reused) in the GEMM epilogue
  -- ``main_grad += dY^T X`` with no 16-bit ``weight.grad`` and no separate add -- across any
  number of backward calls (micro-batches) until the optimizer clears it. ``weight.grad`` stays
  None; ``FusedAdamWMP`` reads ``main_grad`` first. The bias gradient goes to ``bias.grad``.
* :func:`convert` swaps every ``torch.nn.Linear`` of a module for :class:`Linear` in place.

What works with ``main_grad``: :class:`mpkern.FusedAdamWMP` (reads it, and consumes it in
``step()`` so it cannot accumulate across steps whatever zero_grad the loop calls),
:func:`mpkern.unscale_`, ``FusedAdamWMP(max_grad_norm=...)``, ``FusedAdamWMP.clip_grad_norm_`` and
:func:`mpkern.clip_grad_norm_` (a drop-in for torch's). What does not: ``torch.optim`` optimizers
and ``torch.nn.utils.clip_grad_norm_`` only see ``.grad`` -- they would skip the weights. Hugging Face ``Trainer`` clips with the latter, so with
``main_grad`` use ``TrainingArguments(max_grad_norm=0)`` and ``FusedAdamWMP(max_grad_norm=1.0)``.
Once a model was converted with ``fp32_main_grad=True``, a ``torch.optim`` optimizer stepping
over params that hold a ``main_grad`` but no ``.grad`` warns.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .matmul import _IN_DTYPES, _fold, linear, matmul, matmul_accumulate_

Tensor = torch.Tensor

__all__ = ["ConvertReport", "Linear", "convert"]


def _main_grad(weight: Tensor) -> Tensor:
    """``weight.main_grad``: fp32, same shape/device; zero-filled on first use (or after None)."""
    mg = getattr(weight, "main_grad", None)
    if mg is None:
        mg = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        weight.main_grad = mg
    return mg


class _LinearMainGrad(torch.autograd.Function):
    """y = x W^T + b; backward accumulates dW into ``W.main_grad`` (fp32) and returns no dW."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, out_dtype: torch.dtype | None):
        ctx.save_for_backward(x)
        ctx.weight = weight  # the Parameter itself: main_grad lives on it
        ctx.bias_dtype = None if bias is None else bias.dtype
        return linear(x, weight, bias, out_dtype=out_dtype)

    @staticmethod
    def backward(ctx, gy: Tensor):
        (x,) = ctx.saved_tensors
        w = ctx.weight
        g = gy if gy.dtype == x.dtype else gy.to(x.dtype)
        dx = dbias = None
        if ctx.needs_input_grad[0]:
            dx = matmul(g, w, out_dtype=x.dtype)  # (*, N) @ (N, K)
        if ctx.needs_input_grad[1]:
            matmul_accumulate_(_fold(g).t(), _fold(x), _main_grad(w))  # main_grad (N, K) += dY^T X
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            dbias = gy.reshape(-1, gy.shape[-1]).sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return dx, None, dbias, None


class Linear(nn.Linear):
    """``torch.nn.Linear`` computed with :func:`mpkern.linear` (fp32 accumulation).

    Args: as ``torch.nn.Linear``, plus ``fp32_main_grad`` (keyword): accumulate the weight
    gradient into ``weight.main_grad`` (fp32) instead of ``weight.grad``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 fp32_main_grad: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.fp32_main_grad = bool(fp32_main_grad)

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if x.device == w.device and w.dtype in _IN_DTYPES and torch.is_autocast_enabled(x.device.type):
            # autocast: a 16-bit weight of the autocast dtype runs the fused path on x cast to it
            # (what F.linear under autocast would compute from); other weights fall back below
            if w.dtype == torch.get_autocast_dtype(x.device.type):
                x = x.to(w.dtype)
            else:
                return self._fallback(x)
        if not (x.dtype in _IN_DTYPES and w.dtype == x.dtype and x.device == w.device):
            return self._fallback(x)
        if self.fp32_main_grad and w.requires_grad and torch.is_grad_enabled():
            return _LinearMainGrad.apply(x, w, self.bias, None)
        return linear(x, w, self.bias)

    def _fallback(self, x: Tensor) -> Tensor:
        """``F.linear`` for inputs the fused GEMM does not take (fp32 weights, mixed dtypes, autocast
        with fp32 weights); with ``fp32_main_grad`` it says once that main_grad is not used."""
        if self.fp32_main_grad and not getattr(self, "_mpkern_fallback_warned", False) and torch.is_grad_enabled():
            self._mpkern_fallback_warned = True
            why = ("autocast is on and the weight is " + str(self.weight.dtype)
                   if torch.is_autocast_enabled(x.device.type) else
                   f"the weight is {self.weight.dtype} and the input {x.dtype} on {x.device}")
            warnings.warn(f"mpkern.nn.Linear(fp32_main_grad=True): {why}, so this layer runs F.linear and its weight "
                          "gradient goes to .grad, not main_grad (with fp32 weights it is fp32 already; for main_grad "
                          "keep bf16/fp16 weights, e.g. model.to(torch.bfloat16) or autocast over 16-bit weights)",
                          UserWarning, stacklevel=3)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + (", fp32_main_grad=True" if self.fp32_main_grad else "")


@dataclass
class ConvertReport:
    """What :func:`convert` did: qualified names of converted modules and of skipped linear-like ones."""

    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # name -> why


_hook_handle: Any = None


def _warn_torch_optimizer_over_main_grad(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global optimizer step pre-hook (installed by ``convert(fp32_main_grad=True)``)."""
    if getattr(optimizer, "_mpkern_fuses_unscale", False):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None and getattr(p, "main_grad", None) is not None:
                warnings.warn(
                    f"{type(optimizer).__name__}.step(): some params hold their gradient in .main_grad "
                    "(mpkern.nn fp32_main_grad=True) and have no .grad, so this optimizer skips them; use "
                    "mpkern.FusedAdamWMP (and mpkern.unscale_ / FusedAdamWMP.clip_grad_norm_ for clipping)",
                    UserWarning, stacklevel=3)
                return


def _install_main_grad_guard() -> None:
    global _hook_handle
    if _hook_handle is None:
        _hook_handle = register_optimizer_step_pre_hook(_warn_torch_optimizer_over_main_grad)


def _refuse_fsdp(module: nn.Module) -> None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        FSDPModule = ()
    from .distributed import is_dtensor

    for name, m in module.named_modules():
        if isinstance(m, FSDPModule) or any(is_dtensor(p) for p in m.parameters(recurse=False)):
            raise ValueError(f"mpkern.nn.convert(fp32_main_grad=True): module {name or '<root>'!r} is sharded "
                             "(FSDP2 fully_shard / DTensor params); FSDP2 reduces .grad, so a main_grad on its "
                             "unsharded params would never reach the optimizer -- convert without fp32_main_grad "
                             "(use fully_shard(mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32)))")


def convert(module: nn.Module, *, fp32_main_grad: bool = False, report: bool = False) -> Any:
    """Turn every ``torch.nn.Linear`` in ``module`` (itself included) into :class:`Linear`, in place.

    The modules keep their identity, parameters (the same ``Parameter`` objects, so an existing
    optimizer still holds them), buffers, hooks and state_dict keys; only the class changes.
    Existing :class:`Linear` modules get ``fp32_main_grad`` set. Linear-like layers that are not
    plain ``nn.Linear`` are skipped: subclasses with their own forward (other libraries' layers)
    and ``nn.MultiheadAttention`` (its fused ``in_proj_weight`` and its ``out_proj`` are used by
    ``F.multi_head_attention_forward`` directly). With ``fp32_main_grad=True`` a warning names the
    skipped ones (their gradients stay in ``.grad``; FusedAdamWMP handles the mix).

    Tied weights (GPT-2's ``lm_head`` sharing ``wte.weight``): the linear layer's part of the gradient
    goes to ``main_grad``, the other use's to ``.grad``; every mpkern consumer (``FusedAdamWMP``,
    ``unscale_``, ``clip_grad_norm_``) adds ``.grad`` into ``main_grad`` first, so the gradient is the sum.

    ``fp32_main_grad=True`` is refused for FSDP2 (``fully_shard``) models: FSDP2 reduce-scatters
    ``.grad`` of the unsharded params, and a ``main_grad`` on them would never reach the sharded
    params the optimizer holds (use ``MixedPrecisionPolicy(reduce_dtype=torch.float32)`` for fp32
    gradient reduction). Convert before ``fully_shard`` without ``fp32_main_grad``, or not at all.

    Returns ``module``, or ``(module, ConvertReport)`` when ``report=True``.
    """
    if fp32_main_grad:
        _refuse_fsdp(module)
    rep = ConvertReport()
    mha_children: set[int] = set()
    for name, m in module.named_modules():
        if isinstance(m, nn.MultiheadAttention):
            rep.skipped[name] = "nn.MultiheadAttention (in_proj_weight and out_proj used by its fused functional)"
            mha_children.update(id(c) for c in m.modules() if c is not m)
            continue
        if id(m) in mha_children:
            continue
        if type(m) is nn.Linear:
            m.__class__ = Linear
        if isinstance(m, Linear):
            m.fp32_main_grad = bool(fp32_main_grad)
            rep.converted.append(name)
        elif isinstance(m, nn.Linear):
            rep.skipped[name] = f"{type(m).__qualname__} (a subclass of nn.Linear with its own forward)"
        elif type(m).__name__ == "Conv1D" and type(m).__module__.startswith("transformers"):
            rep.skipped[name] = "transformers Conv1D (GPT-2's linear with a transposed weight; not an nn.Linear)"
    if fp32_main_grad:
        _install_main_grad_guard()
        if rep.skipped:
            warnings.warn("mpkern.nn.convert: left these linear-like layers as they are (their grads stay in .grad): "
                          + "; ".join(f"{n or '<root>'}: {why}" for n, why in rep.skipped.items()),
                          UserWarning, stacklevel=2)
    return (module, rep) if report else module
