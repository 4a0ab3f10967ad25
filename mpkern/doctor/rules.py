"""From numbers to findings: what counts as a problem, where it is introduced, and the fix.

Each rule reads :class:`LayerStats` / :class:`GradStats` only. Attribution: a problem is reported at
the module that introduces it -- overflow at the module whose own op made the inf/NaN from finite
inputs; underflow at the module whose output is tiny while its input was not; precision at the
innermost module whose own error (alone, on the fp32 input) is large and none of whose submodules
already explains it. Values lost to range are ``underflow`` / ``overflow``, never ``precision``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .result import Finding, GradStats, LayerStats
from .stats import unit_roundoff

PRECISION_FACTOR = 16.0  # own error above 16 unit roundoffs: far past what rounding a layer's
#                          inputs and output costs (~1-2 u for a well-conditioned one)
UNDERFLOW_FRACTION = 0.01  # 1 % of the nonzero values below the smallest normal
GRAD_UNDERFLOW_FRACTION = 0.01
GRADSCALER_DEFAULT_EXP = 16  # torch.amp.GradScaler(init_scale=2.0**16)


@dataclass
class Context:
    """What the rules need besides the records."""

    dtype: torch.dtype
    scale: float | None
    scale_given: bool
    scale_range: tuple[int, int] | None
    fp16_underflow: dict[str, float]  # bf16 runs: each module's output fraction below fp16's normal
    input_underflow: dict[str, float]  # each module's fp32 input fraction below the dtype's normal


def _island(name: str) -> str:
    return f"mpkern.nn.keep_fp32(model, names=[{name!r}])"


def thresholds(dtype: torch.dtype) -> dict[str, float]:
    return {"precision": PRECISION_FACTOR * unit_roundoff(dtype), "underflow": UNDERFLOW_FRACTION,
            "grad_underflow": GRAD_UNDERFLOW_FRACTION, "unit_roundoff": unit_roundoff(dtype)}


def overflow(layers: list[LayerStats], ctx: Context, order: dict[str, int]) -> list[Finding]:
    out = []
    fp16 = ctx.dtype == torch.float16
    for x in sorted((x for x in layers if x.overflow_count), key=lambda x: order.get(x.name, 0)):
        big = x.max_abs if x.max_abs is not None else math.nan
        msg = (f"{x.overflow_count} values became inf/NaN in {torch.finfo(ctx.dtype).bits}-bit "
               f"({_d(ctx.dtype)}, max {torch.finfo(ctx.dtype).max:.4g}) inside {x.type}")
        if math.isfinite(big) and big > 0:
            msg += f"; computed in fp32 the largest is {big:.3g} ({x.headroom_bits:+.1f} bits of headroom)"
        if not math.isfinite(big):
            fix = ("it overflows fp32 too: compute it stably (e.g. torch.logsumexp / softmax instead of "
                   f"exp then sum), then keep it in fp32 with {_island(x.name)} if needed")
        elif fp16 and big < torch.finfo(torch.bfloat16).max:
            fix = (f"use bf16 (torch.autocast(..., dtype=torch.bfloat16): range to 3.4e38, {big:.3g} fits) -- "
                   f"or keep this module in fp32: {_island(x.name)}")
        else:
            fix = f"keep this module in fp32: {_island(x.name)} (or rescale what it computes)"
        out.append(Finding(x.name, "overflow", msg, fix, {
            "overflow_count": x.overflow_count, "max_abs": x.max_abs, "headroom_bits": x.headroom_bits}))
    return out


def underflow(layers: list[LayerStats], ctx: Context) -> list[Finding]:
    out = []
    tiny = torch.finfo(ctx.dtype).tiny
    for x in layers:
        f = x.underflow_frac
        if f is None or x.passthrough or f < UNDERFLOW_FRACTION:
            continue
        inherited = ctx.input_underflow.get(x.name, 0.0)
        if inherited >= f / 2:
            continue  # its input was already that small: the module before made the values
        fix = (f"use bf16 (smallest normal 1.2e-38) or keep this module in fp32: {_island(x.name)}"
               if ctx.dtype == torch.float16 else
               f"keep this module in fp32: {_island(x.name)} (or rescale what it computes)")
        out.append(Finding(x.name, "underflow",
                           f"{100 * f:.1f}% of the nonzero values {x.type} outputs are below {_d(ctx.dtype)}'s "
                           f"smallest normal {tiny:.3g}: subnormal or flushed to zero (lost to range)",
                           fix, {"underflow_frac": f, "input_underflow_frac": inherited, "smallest_normal": tiny}))
    return out


def precision(layers: list[LayerStats], ctx: Context, explained: set[str]) -> list[Finding]:
    thr = PRECISION_FACTOR * unit_roundoff(ctx.dtype)
    bad = {x.name for x in layers if x.rel_err is not None and math.isfinite(x.rel_err) and x.rel_err > thr}
    blocked = bad | explained
    out = []
    for x in sorted((x for x in layers if x.name in bad and x.name not in explained),
                    key=lambda x: -(x.rel_err or 0.0)):
        prefix = x.name + "." if x.name else ""
        if any(n != x.name and n.startswith(prefix) for n in blocked):
            continue  # a submodule introduces it
        assert x.rel_err is not None  # it is in `bad`: measured, and above the threshold
        u = unit_roundoff(ctx.dtype)
        fix = f"keep this module in fp32: {_island(x.name)}"
        fits_fp16 = x.max_abs is not None and x.max_abs < 2 ** -2 * torch.finfo(torch.float16).max
        if ctx.dtype == torch.bfloat16 and fits_fp16 \
                and ctx.fp16_underflow.get(x.name, 0.0) < UNDERFLOW_FRACTION:
            fix += (" -- or fp16 with GradScaler (3 more mantissa bits; this module's values, up to "
                    f"{x.max_abs:.3g}, fit its range)")
        out.append(Finding(x.name, "precision",
                           f"{x.type} alone, on the fp32 run's input, is off by {x.rel_err:.3g} (relative) in "
                           f"{_d(ctx.dtype)} -- {x.rel_err / u:.0f}x the unit roundoff {u:.3g}: it loses digits "
                           "to rounding (cancellation or an ill-conditioned sum), not to range",
                           fix, {"rel_err": x.rel_err, "acc_rel_err": x.acc_rel_err, "threshold": thr,
                                 "unit_roundoff": u}))
    return out


def gradients(grads: list[GradStats], ctx: Context) -> list[Finding]:
    """Per module owning parameters: gradients lost below the normal range or rounding to inf."""
    if not grads or ctx.scale is None:
        return []
    by_mod: dict[str, list[GradStats]] = {}
    for g in grads:
        by_mod.setdefault(g.module, []).append(g)
    lo_hi = ctx.scale_range
    fits = lo_hi is not None and lo_hi[0] <= lo_hi[1]
    if lo_hi is not None and fits:
        k: int | None = min(lo_hi[1], max(lo_hi[0], GRADSCALER_DEFAULT_EXP))
        scale_fix = (f"start GradScaler at 2^{k}: torch.amp.GradScaler(init_scale=2.0**{k}) -- scales "
                     f"2^{lo_hi[0]} .. 2^{lo_hi[1]} keep these gradients in {_d(ctx.dtype)}")
    else:
        k = None
        scale_fix = ("no single loss scale holds these gradients in " + _d(ctx.dtype) + ": " +
                     ("use bf16" if ctx.dtype == torch.float16 else
                      "keep the gradients in fp32 (mpkern.nn.convert(model, fp32_main_grad=True))"))
    over, under = [], []
    for mod, gs in by_mod.items():
        nz = sum(g.nonzero for g in gs)
        above = sum(g.overflow_count for g in gs)
        seen_bad = sum(g.observed_nonfinite for g in gs)
        frac = sum(g.underflow_frac * g.nonzero for g in gs) / nz if nz else 0.0
        names = [g.param for g in gs]
        if (above or seen_bad) and (ctx.scale_given or not fits):
            over.append(Finding(mod, "grad_overflow",
                                f"at loss scale {ctx.scale:g}, {above} gradient elements of {', '.join(names)} round "
                                f"to inf in {_d(ctx.dtype)} ({seen_bad} inf/NaN seen in the scaled backward)",
                                scale_fix,
                                {"overflow_count": above, "observed_nonfinite": seen_bad, "scale": ctx.scale,
                                 "scale_range": list(lo_hi) if lo_hi else None}))
        if frac >= GRAD_UNDERFLOW_FRACTION:
            under.append(Finding(mod, "grad_underflow",
                                 f"at loss scale {ctx.scale:g}, {100 * frac:.1f}% of the nonzero gradient elements of "
                                 f"{', '.join(names)} fall below {_d(ctx.dtype)}'s smallest normal "
                                 f"{torch.finfo(ctx.dtype).tiny:.3g} (lost or rounded coarsely)",
                                 scale_fix, {"underflow_frac": frac, "scale": ctx.scale,
                                             "scale_range": list(lo_hi) if lo_hi else None,
                                             "recommended_scale_exp": k}))
    under.sort(key=lambda f: -f.numbers["underflow_frac"])
    return over + under


def all_findings(layers: list[LayerStats], grads: list[GradStats], ctx: Context,
                 order: dict[str, int]) -> list[Finding]:
    """Every rule, in the order a user should read them: overflow, gradient overflow, underflow,
    gradient underflow, precision."""
    ov = overflow(layers, ctx, order)
    un = underflow(layers, ctx)
    gr = gradients(grads, ctx)
    explained = {f.module for f in ov + un}
    pr = precision(layers, ctx, explained)
    return ov + [f for f in gr if f.kind == "grad_overflow"] + un + [f for f in gr if f.kind == "grad_underflow"] + pr


def _d(dtype: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, str(dtype))
