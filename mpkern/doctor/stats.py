"""The numbers behind a diagnosis, computed in float64 from the fp32 run and the 16-bit run.

Pure functions on tensors (no module, no hooks): relative errors, headroom to a dtype's largest
finite value, fractions below its smallest normal, and the loss-scale range a set of gradients
fits in. Every rule about what counts as "out of range" lives here once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

Tensor = torch.Tensor

LOW_DTYPES = (torch.float16, torch.bfloat16)


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the spacing of ``dtype`` at 1: 2^-11 for fp16, 2^-8 for bf16 (round-to-nearest)."""
    return torch.finfo(dtype).eps / 2


def floats(x: object) -> list[Tensor]:
    """The floating-point tensors in ``x`` (a tensor, or nested tuples/lists/dicts), in order."""
    if isinstance(x, Tensor):
        return [x] if x.is_floating_point() else []
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in floats(v)]
    return []


def rel_err(low: Sequence[Tensor], ref: Sequence[Tensor]) -> float | None:
    """Norm-wise relative error ``||low - ref|| / ||ref||`` over all tensors together, in float64.

    ``inf`` when ``low`` holds a non-finite value where ``ref`` is finite; ``None`` when the two
    do not line up (different count or shapes) or ``ref`` has no finite nonzero value.
    """
    if len(low) != len(ref) or not ref or any(a.shape != b.shape for a, b in zip(low, ref)):
        return None
    num = den = 0.0
    for a, b in zip(low, ref):
        b64 = b.detach().to(torch.float64)
        a64 = a.detach().to(device=b.device, dtype=torch.float64)
        fin = torch.isfinite(b64)
        if bool((~torch.isfinite(a64) & fin).any()):
            return math.inf
        d = torch.where(fin, a64 - b64, 0.0)
        num += float((d * d).sum())
        den += float(torch.where(fin, b64 * b64, 0.0).sum())
    if den == 0.0:
        return 0.0 if num == 0.0 else None
    return math.sqrt(num / den)


def new_nonfinite(low: Sequence[Tensor], ref: Sequence[Tensor]) -> int:
    """How many elements are inf/NaN in ``low`` where ``ref`` is finite (inf/NaN *appearing*)."""
    n = 0
    for a, b in zip(low, ref):
        if a.shape == b.shape:
            n += int((~torch.isfinite(a.detach()) & torch.isfinite(b.detach().to(a.device))).sum())
    return n


def abs_max(ts: Iterable[Tensor], dtype: torch.dtype | None = None) -> float:
    """Largest finite |value| over ``ts`` (0.0 if none). With ``dtype``, values of exactly
    ``finfo(dtype).max`` are left out: masks written as ``finfo.min`` are sentinels, not data."""
    m = 0.0
    lim = torch.finfo(dtype).max if dtype is not None else math.inf
    for t in ts:
        if t.numel() == 0:
            continue
        a = t.detach().abs()
        if a.dtype in LOW_DTYPES:
            a = a.float()  # exact: every fp16/bf16 value is an fp32 value
        a = torch.where(torch.isfinite(a) & (a != lim), a, 0.0)
        m = max(m, float(a.max()))
    return m


def headroom_bits(max_abs: float | None, dtype: torch.dtype) -> float | None:
    """``log2(finfo(dtype).max / max_abs)``: how many doublings the largest value can take before
    it overflows ``dtype`` (negative: it already does). ``None`` for no value or only zeros."""
    if max_abs is None or max_abs == 0.0:
        return None
    if not math.isfinite(max_abs):
        return -math.inf
    return math.log2(torch.finfo(dtype).max / max_abs)


def below_normal_fraction(ts: Sequence[Tensor], dtype: torch.dtype, scale: float = 1.0) -> tuple[float, int]:
    """Of the nonzero finite values of ``ts`` (times ``scale``), the fraction whose magnitude is
    below ``dtype``'s smallest normal -- lost to *range* (subnormal or flushed to zero) -- and
    the count of nonzero values. Values a 16-bit format rounds but keeps (normal ones) are not
    counted: that is a precision effect, measured by :func:`rel_err`."""
    tiny = torch.finfo(dtype).tiny
    below = nonzero = 0
    for t in ts:
        a = (t.detach().to(torch.float64) * scale).abs()
        ok = torch.isfinite(a) & (a > 0)
        nonzero += int(ok.sum())
        below += int((ok & (a < tiny)).sum())
    return (below / nonzero if nonzero else 0.0), nonzero


_EXP_OFFSET = 1100  # frexp exponents of float64 values lie in [-1073, 1024]
_EXP_BINS = 2200


@dataclass
class GradSummary:
    """One gradient's range, as the loss-scale rules need it: binary exponents, no copies.

    ``hist[e + _EXP_OFFSET]`` counts the nonzero finite values with ``2**e <= |g| < 2**(e+1)``;
    ``below`` / ``above``: how many are lost to range at the scale asked for (below the 16-bit
    dtype's smallest normal, or rounding to inf); ``nonfinite``: inf/NaN already in ``g``.
    """

    numel: int
    nonzero: int
    max_abs: float
    below: int
    above: int
    nonfinite: int
    hist: Tensor


def grad_summary(g: Tensor, dtype: torch.dtype, scale: float) -> GradSummary:
    """Summarise the true (fp32) gradient ``g`` for a 16-bit ``dtype`` at loss ``scale``.

    Comparisons only (``|g| < tiny / scale``, ``|g| >= limit / scale`` in float64 thresholds on
    ``g``'s own values), so nothing is rounded on the way.
    """
    fi = torch.finfo(dtype)
    limit = fi.max + fi.eps * 2.0 ** (math.frexp(fi.max)[1] - 1) / 2  # max + half an ulp at max
    a = g.detach().abs().reshape(-1)
    if a.dtype not in (torch.float32, torch.float64):
        a = a.float()
    fin = torch.isfinite(a)
    ok = fin & (a > 0)
    a64_thresholds = (fi.tiny / scale, limit / scale)
    below = int((ok & (a.double() < a64_thresholds[0])).sum()) if a.numel() else 0
    above = int((fin & (a.double() >= a64_thresholds[1])).sum()) if a.numel() else 0
    _, e = torch.frexp(a[ok])
    hist = torch.bincount((e.to(torch.int64) - 1 + _EXP_OFFSET).clamp_(0, _EXP_BINS - 1),
                          minlength=_EXP_BINS).cpu()
    amax = float(torch.where(fin, a, 0).max()) if a.numel() else 0.0
    return GradSummary(numel=a.numel(), nonzero=int(ok.sum()), max_abs=amax, below=below, above=above,
                       nonfinite=int((~fin).sum()), hist=hist)


def scale_range(summaries: Sequence[GradSummary], dtype: torch.dtype, *,
                lost: float = 1e-3) -> tuple[int, int] | None:
    """``(lo, hi)`` exponents: the loss scales ``2**k`` with ``lo <= k <= hi`` keep the gradients in range.

    ``hi``: the largest ``k`` with ``max|g| * 2**k`` still finite in ``dtype`` (no overflow);
    ``lo``: the smallest ``k`` with at most a ``lost`` fraction of the nonzero values below the
    smallest normal (exact from the exponent histogram: the smallest normal is a power of two).
    ``lo > hi`` means no single scale holds them. None without a nonzero value.
    """
    fi = torch.finfo(dtype)
    gmax = max((s.max_abs for s in summaries), default=0.0)
    if gmax == 0.0:
        return None
    hist = torch.stack([s.hist for s in summaries]).sum(0)
    total = int(hist.sum())
    if total == 0:
        return None
    hi = math.floor(math.log2(fi.max / gmax))
    if fi.max / gmax < 2.0 ** hi:  # guard the floor against log2 rounding
        hi -= 1
    e_tiny = int(math.log2(fi.tiny))  # values with exponent e < e_tiny - k fall below normal at 2**k
    cum = torch.cumsum(hist, 0)  # cum[i] = count with exponent <= i - OFFSET
    allowed = lost * total
    # smallest k with count(e < e_tiny - k) <= allowed, i.e. count(e <= e_tiny - k - 1) <= allowed
    idx = int(torch.searchsorted(cum, torch.tensor(allowed, dtype=cum.dtype), right=True))
    # cum[idx - 1] <= allowed < cum[idx]: exponents <= idx - 1 - OFFSET may fall below normal
    e_ok = idx - 1 - _EXP_OFFSET  # largest exponent that may be lost
    lo = e_tiny - 1 - e_ok
    return lo, hi
