"""Which gradients overflowed: :func:`nonfinite_report` reads an :func:`mpkern.unscale_` result's
per-tensor flags back to the host and names the parameters, likeliest culprit first. A diagnosis,
called when ``found_inf`` says something went wrong (``mpkern.nonfinite_report``), not every step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import torch

from ..amp import UnscaleResult

Tensor = torch.Tensor


class NonfiniteEntry(NamedTuple):
    """One gradient that held inf/NaN: its parameter's name, its norm and which kind it held."""

    name: str
    norm: float
    kind: str  # "inf" (inf values, no NaN) or "nan"


class NonfiniteReport(list):
    """A list of :class:`NonfiniteEntry`, likeliest culprit first, with a one-line ``summary``."""

    summary: str = ""

    def __str__(self) -> str:
        lines = [self.summary]
        lines += [f"  {'->' if i == 0 else '  '} {e.name}: {e.kind} (norm {e.norm})" for i, e in enumerate(self)]
        return "\n".join(lines)


def nonfinite_report(
    model_or_named_params: torch.nn.Module | Mapping[str, Tensor] | Iterable[tuple[str, Tensor]] | None,
    result: UnscaleResult,
    *,
    order: str = "backward",
) -> NonfiniteReport:
    """Name the parameters whose gradients held inf/NaN in an :func:`unscale_` result.

    Args:
        model_or_named_params: the model, or ``named_parameters()``-style pairs / a name->param dict;
            None when ``unscale_`` was given ``named_parameters()`` (the names are in the result).
        result: the value :func:`unscale_` returned, computed with ``per_tensor=True``.
        order: ``"backward"`` (default): reverse parameter order, the order in which a backward
            pass through a sequential model produces the gradients -- an overflow that starts in
            one layer's backward spreads to every layer before it, so the *first* entry is the
            likeliest culprit. ``"param"``: the order the gradients were processed in.

    Returns:
        A :class:`NonfiniteReport` (a list of ``(name, norm, kind)``) with ``kind`` "inf" or "nan"
        told apart, and a ``summary``: when every gradient is non-finite the overflow happened in
        the loss or the forward pass, not in one layer's backward, and the summary says so.
        This reads the flags back to the host -- call it when ``found_inf`` says something went
        wrong, not every step.
    """
    if result.per_tensor_nonfinite is None or result.per_tensor_norm is None:
        raise ValueError("nonfinite_report: the result has no per-tensor data; call unscale_(..., per_tensor=True)")
    if order not in ("backward", "param"):
        raise ValueError(f"nonfinite_report: order must be 'backward' or 'param', got {order!r}")
    params: Sequence[Tensor] = getattr(result, "params", ())
    if model_or_named_params is None:
        given = getattr(result, "names", None)
        if given is None:
            raise ValueError("nonfinite_report: pass the model (or named parameters); unscale_ was not given names")
        names = {id(p): n for n, p in zip(given, params)}
    else:
        if isinstance(model_or_named_params, torch.nn.Module):
            pairs: Iterable[tuple[str, Tensor]] = model_or_named_params.named_parameters()
        elif isinstance(model_or_named_params, Mapping):
            pairs = model_or_named_params.items()
        else:
            pairs = model_or_named_params
        names = {id(p): n for n, p in pairs}
    flags = result.per_tensor_nonfinite.tolist()
    norms = result.per_tensor_norm.tolist()
    idx = [i for i, bad in enumerate(flags) if bad]
    if order == "backward":
        idx.reverse()
    out = NonfiniteReport()
    for i in idx:
        name = names.get(id(params[i]), f"<param {i}>") if i < len(params) else f"<param {i}>"
        out.append(NonfiniteEntry(name, norms[i], "nan" if math.isnan(norms[i]) else "inf"))
    n_inf = sum(e.kind == "inf" for e in out)
    if not out:
        out.summary = f"no non-finite gradient among {len(flags)}"
    elif len(out) == len(flags) and len(flags) > 1:
        out.summary = (f"all {len(flags)} gradients are non-finite ({n_inf} inf, {len(out) - n_inf} nan): the loss "
                       "or the forward pass overflowed, not one layer's backward (check the loss and activations)")
    else:
        out.summary = (f"{len(out)} of {len(flags)} gradients non-finite ({n_inf} inf, {len(out) - n_inf} nan); "
                       f"likeliest culprit ({order} order): {out[0].name}")
    return out
