"""``mpkern.diagnose``: run a model in fp32 and in a 16-bit recipe on the same inputs, layer by layer."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from .. import nn as mpnn
from . import capture, rules, stats
from .result import Diagnosis, GradStats, LayerStats

Tensor = torch.Tensor

RECIPES = ("autocast", "params")
_DTYPES = {"fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
           "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def _dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    if dtype in (torch.float16, torch.bfloat16):
        return dtype
    raise ValueError(f"diagnose: dtype must be torch.float16 or torch.bfloat16 (or 'fp16' / 'bf16'), got {dtype!r}")


def _loss_scale(loss_scale: Any, dtype: torch.dtype) -> tuple[float, bool]:
    """The scale the gradients are judged at, and whether the caller chose it."""
    if loss_scale is None:
        return (2.0 ** rules.GRADSCALER_DEFAULT_EXP if dtype == torch.float16 else 1.0), False
    if hasattr(loss_scale, "get_scale"):  # a torch.amp.GradScaler
        return float(loss_scale.get_scale()), True
    if isinstance(loss_scale, Tensor):
        if loss_scale.numel() != 1:
            raise ValueError(f"diagnose: loss_scale must be a number, got a tensor of shape {tuple(loss_scale.shape)}")
        loss_scale = float(loss_scale)
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)):
        raise TypeError(f"diagnose: loss_scale must be a positive number or a GradScaler, "
                        f"got {type(loss_scale).__name__}")
    if not (math.isfinite(loss_scale) and loss_scale > 0):
        raise ValueError(f"diagnose: loss_scale must be a positive finite number, got {loss_scale!r}")
    return float(loss_scale), True


def _call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _device(model: nn.Module, inputs: Any) -> torch.device:
    for p in model.parameters():
        return p.device
    for t in stats.floats(inputs) or ([inputs] if isinstance(inputs, Tensor) else []):
        return t.device
    return torch.device("cpu")


class _Rng:
    """One RNG state replayed before every run, so that any randomness left is the same in each."""

    def __init__(self, device: torch.device) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.device = device

    def reset(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


def _loss(loss_fn: Callable[[Any], Tensor], out: Any) -> Tensor:
    loss = loss_fn(out)
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise ValueError("diagnose: loss_fn(output) must return a scalar tensor, got "
                         + (f"shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__name__))
    return loss.reshape(())


def diagnose(model: nn.Module, inputs: Any, *, dtype: torch.dtype | str = torch.float16,
             loss_fn: Callable[[Any], Tensor] | None = None, loss_scale: Any = None,
             recipe: str = "autocast") -> Diagnosis:
    """Find the layers where fp16/bf16 makes ``model`` depart from its fp32 self, say why, and how to fix it.

    Runs ``model`` once in fp32 and once in the recipe on the same ``inputs`` (a tensor: ``model(x)``;
    a tuple/list: ``model(*inputs)``; a dict: ``model(**inputs)``) and measures every module (names as
    in ``named_modules()``; see :class:`~mpkern.doctor.LayerStats`): its **own** error -- the module
    alone in the recipe on the fp32 run's input -- so an error is reported where it is introduced,
    not where it is inherited; the error accumulated by the run at its output; the range of the
    16-bit values made inside it (headroom to the dtype's max in bits, inf/NaN appearing, fp32
    values below the smallest normal).

    ``recipe``: ``"autocast"`` (fp32 parameters, ``torch.autocast(dtype=dtype)`` -- the lessons'
    recipe) or ``"params"`` (a 16-bit copy of the model, floating inputs cast: ``model.half()``).
    ``loss_fn(output) -> scalar``: also back-propagate (the recipe's backward scaled by the loss
    scale, as GradScaler does) and judge every parameter's gradient at ``loss_scale`` -- a number or
    a ``GradScaler`` (its current scale); default GradScaler's first scale 2^16 for fp16, 1 for bf16.

    Dropout modules are switched off (p = 0) during the runs so that both see the same network;
    other randomness replays one RNG state. The model is left as it was: parameters, dtypes,
    modes, buffers (BatchNorm statistics), hooks, ``.grad`` / ``main_grad``, RNG state. Modules
    made fp32 islands with :func:`mpkern.nn.keep_fp32` stay islands and are reported as such.
    Diagnose the plain module, not a DDP/FSDP wrapper (its backward would communicate).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"diagnose: model must be a torch.nn.Module, got {type(model).__name__}")
    dt = _dtype(dtype)
    if recipe not in RECIPES:
        raise ValueError(f"diagnose: recipe must be one of {RECIPES}, got {recipe!r}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"diagnose: loss_fn must be callable (output -> scalar loss), got {type(loss_fn).__name__}")
    scale, scale_given = _loss_scale(loss_scale, dt)
    t0 = time.perf_counter()
    dev = _device(model, inputs)
    kept = mpnn.kept_fp32(model)
    all_fp32 = all(p.dtype == torch.float32 for p in model.parameters() if p.is_floating_point())
    keep = capture.preserve(model)
    try:
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            rng = _Rng(dev)
            ref_model = model if all_fp32 else copy.deepcopy(model).float()
            # the fp32 run gets fp32 inputs: a half model's half inputs, upcast (exactly)
            ref_inputs = capture.map_floats(inputs, lambda t: t.float() if t.dtype in stats.LOW_DTYPES else t)
            if recipe == "params":
                low_model = copy.deepcopy(ref_model).to(dt)
                mods = dict(low_model.named_modules())
                for n in kept:
                    mods[n].float()
                low_inputs = capture.map_floats(
                    inputs, lambda t: t.to(dt) if t.dtype in (torch.float32, *stats.LOW_DTYPES) else t)
                ctx: Callable[[], Any] = nullcontext
            else:
                low_model, low_inputs = ref_model, inputs
                ctx = lambda: torch.autocast(dev.type, dtype=dt)  # noqa: E731 -- a def would redefine the annotated ctx
            result = _diagnose(ref_model, low_model, ref_inputs, low_inputs, ctx, rng, dt, loss_fn, scale, dev)
    finally:
        capture.restore(keep)
    layers, grads, order, first_overflow, ctx_rules = result
    for x in layers:
        x.kept_fp32 = x.name in kept
    rctx = rules.Context(dtype=dt, scale=scale if loss_fn is not None else None, scale_given=scale_given,
                         scale_range=ctx_rules["scale_range"], fp16_underflow=ctx_rules["fp16_underflow"],
                         input_underflow=ctx_rules["input_underflow"])
    findings = rules.all_findings(layers, grads, rctx, order)
    return Diagnosis(dtype=dt, recipe=recipe, loss_scale=scale if loss_fn is not None else None, layers=layers,
                     findings=findings, first_overflow=first_overflow, grads=grads,
                     scale_range=ctx_rules["scale_range"], kept_fp32=kept, thresholds=rules.thresholds(dt),
                     seconds=time.perf_counter() - t0)


def _diagnose(ref_model: nn.Module, low_model: nn.Module, inputs: Any, low_inputs: Any, ctx: Callable[[], Any],
              rng: _Rng, dt: torch.dtype, loss_fn: Callable | None, scale: float, dev: torch.device) -> tuple:
    want_grad = loss_fn is not None
    # ---- the fp32 run: every module's inputs and outputs kept (clones shared along the way)
    ref = capture.Recorder(ref_model)
    rng.reset()
    with ref, torch.set_grad_enabled(want_grad):
        out = _call(ref_model, inputs)
        ref.enabled = False
        loss = _loss(loss_fn, out) if loss_fn is not None else None
    ref_grads: dict[str, Tensor] = {}
    if loss is not None:
        with torch.enable_grad():  # diagnose called under torch.no_grad(): the forwards built graphs anyway
            loss.float().backward()
        for n, p in ref_model.named_parameters():
            g = _take_grad(p)
            if g is not None:
                ref_grads[n] = g
    del out, loss
    # ---- the 16-bit run: each call compared with its fp32 twin as it finishes; ops measured
    low = capture.Recorder(low_model, ref=ref)
    ops = capture.OpWatch(low, dt)
    rng.reset()
    with low, torch.set_grad_enabled(want_grad), ctx(), ops:
        out = _call(low_model, low_inputs)
        low.enabled = False
        loss = _loss(loss_fn, out) if loss_fn is not None else None
    low_grads: dict[str, Tensor] = {}
    if loss is not None:
        with torch.enable_grad():  # the scaling op too is recorded, whatever the caller's grad mode
            (loss.float() * scale).backward()
        for n, p in low_model.named_parameters():
            g = _take_grad(p)
            if g is not None:
                low_grads[n] = g
    del out, loss
    # ---- each module alone on its fp32 input
    modules = dict(low_model.named_modules())
    types = {n: type(m).__name__ for n, m in modules.items()}
    layers, input_uf, fp16_uf = [], {}, {}
    for name in modules:
        rcalls, lcalls = ref.calls.get(name, []), low.low.get(name, [])
        if not lcalls:
            continue
        own, notes = [], []
        for k, lc in enumerate(lcalls[:len(rcalls)]):
            if name == "" or lc.same_inputs:
                own.append(lc.acc_err)  # it got the fp32 run's input: what the run made of it is its own error
                continue
            r = capture.rerun(modules[name], rcalls[k], lc, ctx, rng.reset)
            own.append(r.rel_err)
            if r.error:
                notes.append(f"could not run alone: {r.error}")
        out16 = [t for k, lc in enumerate(lcalls[:len(rcalls)]) for t, d in zip(rcalls[k].outs, lc.out_dtypes)
                 if d == dt]
        uf = stats.below_normal_fraction(out16, dt)[0] if out16 else None
        if uf is not None:
            input_uf[name] = max((stats.below_normal_fraction(rc.ins, dt)[0] for rc in rcalls), default=0.0)
            fp16_uf[name] = stats.below_normal_fraction(out16, torch.float16)[0]
        sub = [s for n, s in ops.ops.items() if n == name or (name == "" or n.startswith(name + "."))]
        vals = [s.max_abs for s in sub if s.any16] + [s.overflow_fp32_max for s in sub if s.overflow]
        if out16:
            vals.append(stats.abs_max(out16, dt))
        max_abs = max(vals) if vals else None
        direct = ops.ops.get(name)
        layers.append(LayerStats(
            name=name, type=types[name], calls=len(lcalls),
            out_dtype=str(lcalls[0].out_dtypes[0]).replace("torch.", "") if lcalls[0].out_dtypes else None,
            kept_fp32=False, rel_err=_worst(own), acc_rel_err=_worst([lc.acc_err for lc in lcalls]),
            max_abs=max_abs, headroom_bits=stats.headroom_bits(max_abs, dt),
            overflow_count=direct.overflow if direct else 0, underflow_frac=uf,
            passthrough=all(lc.passthrough for lc in lcalls), note="; ".join(dict.fromkeys(notes)) or None))
    order = {n: s.first_overflow_seq for n, s in ops.ops.items() if s.first_overflow_seq is not None}
    first = ops.first_overflow
    if first is None:  # an inf made outside any torch function the mode sees: the first module showing it
        first = next((n for n in low.order if any(lc.new_nonfinite and not lc.passthrough for lc in low.low[n])),
                     None)
    grads, summaries = [], []
    for n, g in ref_grads.items():
        s = stats.grad_summary(g, dt, scale)
        summaries.append(s)
        lg = low_grads.get(n)
        seen_bad = int((~torch.isfinite(lg)).sum()) if lg is not None else 0
        zero = None
        if lg is not None and s.nonzero:
            zero = int(((lg == 0) & (g != 0)).sum()) / s.nonzero
        grads.append(GradStats(param=n, module=n.rpartition(".")[0], numel=s.numel, nonzero=s.nonzero,
                               max_abs=s.max_abs, underflow_frac=s.below / s.nonzero if s.nonzero else 0.0,
                               overflow_count=s.above, observed_nonfinite=seen_bad, observed_zero_frac=zero))
    srange = stats.scale_range(summaries, dt) if summaries else None
    return layers, grads, order, first, {"scale_range": srange, "fp16_underflow": fp16_uf,
                                         "input_underflow": input_uf}


def _take_grad(p: Tensor) -> Tensor | None:
    """``p``'s gradient of the backward just run (``.grad`` plus an mpkern ``main_grad``), and clear both."""
    g = None if p.grad is None else p.grad.detach().clone()
    p.grad = None
    mg = getattr(p, "main_grad", None)
    if isinstance(mg, Tensor) and bool((mg != 0).any()):
        g = mg.detach().clone() if g is None else g.float() + mg
        with torch.no_grad():
            mg.zero_()
    return g


def _worst(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return max(vals) if vals else None
