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
* :func:`keep_fp32` makes chosen modules fp32 islands under autocast (inputs cast to fp32, autocast
  off inside, parameters fp32) -- reversibly; :func:`kept_fp32` lists them.

What works with ``main_grad``: :class:`mpkern.FusedAdamWMP` (reads it, and consumes it in
``step()`` so it cannot accumulate across steps whatever zero_grad the loop calls),
:func:`mpkern.unscale_`, ``FusedAdamWMP(max_grad_norm=...)``, ``FusedAdamWMP.clip_grad_norm_`` and
:func:`mpkern.clip_grad_norm_` (a drop-in for torch's). What does not: ``torch.optim`` optimizers
and ``torch.nn.utils.clip_grad_norm_`` only see ``.grad`` -- they would skip the weights. Hugging Face
``Trainer`` clips with the latter, so with ``main_grad`` use ``TrainingArguments(max_grad_norm=0)`` and
``FusedAdamWMP(max_grad_norm=1.0)``.
Once a model was converted with ``fp32_main_grad=True``, a ``torch.optim`` optimizer stepping
over params that hold a ``main_grad`` but no ``.grad`` warns.
"""

from __future__ import annotations

import difflib
import itertools
import warnings
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import _fused_unscale, _grads
from .matmul import IN_DTYPES, fold_rows, linear, matmul, matmul_accumulate_

Tensor = torch.Tensor

__all__ = ["ConvertReport", "Fp32Islands", "Linear", "convert", "keep_fp32", "kept_fp32"]


def _main_grad(weight: Tensor) -> Tensor:
    """``weight.main_grad``: fp32, same shape/device; zero-filled on first use (or after None)."""
    mg = getattr(weight, "main_grad", None)
    if mg is None:
        mg = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        weight.main_grad = mg  # type: ignore[attr-defined]  # the attribute this module adds to weights
    return mg


class _LinearMainGrad(torch.autograd.Function):
    """y = x W^T + b; backward accumulates dW into ``W.main_grad`` (fp32) and returns no dW."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, out_dtype: torch.dtype | None):
        ctx.save_for_backward(x)
        ctx.weight = weight  # the Parameter itself: main_grad lives on it
        _grads.mark_feeds_main_grad(weight)  # its grad never passes AccumulateGrad (gradient release refuses it)
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
            matmul_accumulate_(fold_rows(g).t(), fold_rows(x), _main_grad(w))  # main_grad (N, K) += dY^T X
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
        if x.device == w.device and w.dtype in IN_DTYPES and torch.is_autocast_enabled(x.device.type):
            # autocast: a 16-bit weight of the autocast dtype runs the fused path on x cast to it
            # (what F.linear under autocast would compute from); other weights fall back below
            if w.dtype == torch.get_autocast_dtype(x.device.type):
                x = x.to(w.dtype)
            else:
                return self._fallback(x)
        if not (x.dtype in IN_DTYPES and w.dtype == x.dtype and x.device == w.device):
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
    if _fused_unscale.fuses_unscale(optimizer):
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
    fsdp_types: tuple[type, ...] = ()
    try:
        from torch.distributed.fsdp import FSDPModule

        fsdp_types = (FSDPModule,)
    except ImportError:  # pragma: no cover - torch without FSDP2
        pass
    from .distributed import is_dtensor

    for name, m in module.named_modules():
        if isinstance(m, fsdp_types) or any(is_dtensor(p) for p in m.parameters(recurse=False)):
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


# ---- fp32 islands ---------------------------------------------------------------------------------
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")
_HALF = (torch.float16, torch.bfloat16)
_kept: weakref.WeakKeyDictionary[nn.Module, Fp32Islands] = weakref.WeakKeyDictionary()
_active: dict[int, list[tuple[list[Any], torch.dtype | None, bool]]] = {}  # id(module) -> entry stack


def _autocast_on() -> list[str]:
    on = []
    for dev in _AUTOCAST_DEVICES:
        try:
            if torch.is_autocast_enabled(dev):
                on.append(dev)
        except (RuntimeError, TypeError, ValueError):  # a device type this torch build does not know
            continue
    return on


def _cast_tree(x: Any, dtype: torch.dtype) -> Any:
    """``x`` with every fp16/bf16 tensor (in tuples, lists, dicts) cast to ``dtype``."""
    if isinstance(x, Tensor):
        return x.to(dtype) if x.dtype in _HALF or (dtype in _HALF and x.dtype == torch.float32) else x
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
        return type(x)(*(_cast_tree(v, dtype) for v in x))
    if isinstance(x, (tuple, list)):
        return type(x)(_cast_tree(v, dtype) for v in x)
    if isinstance(x, dict):
        return type(x)({k: _cast_tree(v, dtype) for k, v in x.items()}) if type(x) is dict else \
            _cast_dict_in_place(x, dtype)
    return x


def _cast_dict_in_place(x: Any, dtype: torch.dtype) -> Any:
    for k in list(x.keys()):  # dict subclasses (HF ModelOutput) keep their type and attributes
        x[k] = _cast_tree(x[k], dtype)
    return x


def _first_float_dtype(x: Any) -> torch.dtype | None:
    if isinstance(x, Tensor):
        return x.dtype if x.is_floating_point() else None
    items = x.values() if isinstance(x, dict) else x if isinstance(x, (tuple, list)) else ()
    for v in items:
        d = _first_float_dtype(v)
        if d is not None:
            return d
    return None


def _island_enter(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    on = _autocast_on()
    ctxs = [torch.autocast(dev, enabled=False) for dev in on]
    for c in ctxs:
        c.__enter__()
    _active.setdefault(id(module), []).append((ctxs, _first_float_dtype((args, kwargs)), bool(on)))
    return _cast_tree(args, torch.float32), _cast_tree(kwargs, torch.float32)


def _island_exit(module: nn.Module, args: tuple, output: Any) -> Any:
    stack = _active.get(id(module))
    if not stack:
        return None
    ctxs, in_dtype, autocast_was_on = stack.pop()
    if not stack:
        del _active[id(module)]
    for c in reversed(ctxs):
        c.__exit__(None, None, None)
    if output is None or autocast_was_on or in_dtype not in _HALF:
        return None  # under autocast the fp32 output flows on (the next autocast op casts as it needs)
    return _cast_tree(output, in_dtype)  # a 16-bit-params model: hand the next layer its own dtype back


class Fp32Islands:
    """What :func:`keep_fp32` did: the modules ``names`` (qualified) of ``model`` made fp32 islands,
    reversible with :meth:`remove` or ``with``."""

    def __init__(self, model: nn.Module, names: list[str]) -> None:
        self.names = names
        self._model = weakref.ref(model)
        self._handles: list[Any] = []
        self._dtypes: dict[Tensor, torch.dtype] = {}  # param/buffer -> the dtype it had before
        for n in names:
            self._add(model.get_submodule(n))

    def _to_fp32(self, module: nn.Module) -> None:
        """``module``'s own floating params and buffers (and its children's) made fp32, old dtypes kept."""
        for t in itertools.chain(module.parameters(), module.buffers()):
            if t.is_floating_point() and t.dtype != torch.float32 and t not in self._dtypes:
                self._dtypes[t] = t.dtype
                t.data = t.data.float()

    def _add(self, module: nn.Module) -> None:
        self._to_fp32(module)
        self._handles.append(module.register_forward_pre_hook(_island_enter, with_kwargs=True))
        self._handles.append(module.register_forward_hook(_island_exit, always_call=True))
        _kept[module] = self

    def remove(self) -> None:
        """Undo: hooks removed, parameters and buffers back to the dtypes they had. Idempotent."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for t, dtype in self._dtypes.items():
            t.data = t.data.to(dtype)
        self._dtypes.clear()
        model = self._model()
        if model is not None:
            for name, m in model.named_modules():
                if name in self.names and _kept.get(m) is self:
                    del _kept[m]

    def __enter__(self) -> Fp32Islands:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"Fp32Islands(names={self.names!r})"


def keep_fp32(model: nn.Module, names: Iterable[str] | str | None = None,
              types: type | Iterable[type] | None = None) -> Fp32Islands:
    """Run the named modules (or every module of the given types) of ``model`` in fp32 -- "fp32 islands".

    The lessons' "force FP32 locally" for a numerically sensitive layer (a log-sum-exp, a norm, a
    custom reduction), without editing the model's code. For each chosen module:

    * its fp16/bf16 inputs are cast to fp32 and autocast is switched off inside its forward (on every
      device where it is on), so all its ops -- children included -- compute in fp32;
    * its own floating parameters and buffers (and its children's: they run inside it) are made fp32
      now (the default recipe, autocast over fp32 parameters, has nothing to cast). With a 16-bit
      parameters recipe call ``keep_fp32`` after ``model.half()``; the island's outputs are then cast
      back to the dtype its input came in, so the next 16-bit layer gets what it expects. Under
      autocast the output stays fp32 (the next autocast op casts as it needs).

    ``names``: qualified names as in ``model.named_modules()`` (a single string is one name);
    ``types``: a module class or tuple of classes (every instance is kept). At least one is needed.
    Returns an :class:`Fp32Islands` handle: ``.names`` lists the kept modules; ``.remove()`` (or
    leaving a ``with keep_fp32(...):`` block) undoes it -- hooks removed, dtypes restored.
    :func:`kept_fp32` lists the islands of a model; :func:`mpkern.diagnose` reports them.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"keep_fp32: model must be a torch.nn.Module, got {type(model).__name__}")
    if names is None and types is None:
        raise ValueError("keep_fp32: give names=[qualified module names] and/or types=(module classes)")
    if isinstance(names, str):
        names = [names]
    wanted = None if names is None else list(names)
    if wanted is not None and not all(isinstance(n, str) for n in wanted):
        raise TypeError("keep_fp32: names must be strings (qualified names as in model.named_modules())")
    if types is not None:
        tup = tuple(types) if isinstance(types, (tuple, list, set, frozenset)) else (types,)
        if not tup or not all(isinstance(t, type) and issubclass(t, nn.Module) for t in tup):
            raise TypeError(f"keep_fp32: types must be an nn.Module subclass or a tuple of them, got {types!r}")
        types = tup
    modules = dict(model.named_modules())
    if wanted is not None:
        missing = [n for n in wanted if n not in modules]
        if missing:
            hints = {n: difflib.get_close_matches(n, list(modules), n=3) for n in missing}
            raise ValueError("keep_fp32: no module named " + "; ".join(
                f"{n!r}" + (f" (did you mean {', '.join(map(repr, h))}?)" if h else "") for n, h in hints.items()))
    chosen = [n for n, m in modules.items()
              if (wanted is not None and n in wanted) or (types is not None and isinstance(m, types))]
    if types is not None and wanted is None and not chosen:
        raise ValueError(f"keep_fp32: model has no module of types {[t.__name__ for t in types]}")
    chosen = [n for n in chosen if modules[n] not in _kept]  # already an island: leave it as it is
    return Fp32Islands(model, chosen)


def kept_fp32(model: nn.Module) -> list[str]:
    """Qualified names of the modules of ``model`` that :func:`keep_fp32` made fp32 islands."""
    return [n for n, m in model.named_modules() if m in _kept]
