"""Fused gradient unscale + inf/NaN check + global-norm clipping.

``mpkern.unscale_`` replaces ``scaler.unscale_(opt); clip_grad_norm_(params, max_norm)``: one
read-only statistics pass over all gradients (sum of squares and max |g| per tensor, which also
flags inf/NaN), a few tiny device ops that finish the norm and the clip coefficient, then one
in-place multiply by ``inv_scale * clip_coef``. Nothing in it waits for the device.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from . import _backend, _ops

Tensor = torch.Tensor
_FLOAT_DTYPES = frozenset((torch.float32, torch.float16, torch.bfloat16))


class _UnscaleFields(NamedTuple):
    found_inf: Tensor
    total_norm: Tensor
    clip_coef: Tensor
    per_tensor_norm: Tensor | None
    per_tensor_nonfinite: Tensor | None


class UnscaleResult(_UnscaleFields):
    """Result of :func:`unscale_` -- all device tensors, nothing synchronised.

    Attributes:
        found_inf: 0-dim float32, 1.0 iff any gradient element is inf or NaN.
        total_norm: 0-dim float32, norm of the *unscaled* gradients (what ``clip_grad_norm_``
            returns after ``scaler.unscale_``); inf or NaN when a non-finite value was found.
        clip_coef: 0-dim float32, ``min(1, max_norm / (total_norm + 1e-6))``; 1 when ``max_norm``
            is None or a non-finite value was found.
        per_tensor_norm: 1-D float32, one norm per processed gradient (``per_tensor=True``), else None.
        per_tensor_nonfinite: 1-D float32, 1.0 where that gradient holds inf/NaN, else None.
        params: the parameters whose gradients were processed, in order (for
            :func:`nonfinite_report`).
    """

    params: tuple[Tensor, ...]


def _grad_of(p: Tensor) -> Tensor | None:
    """The gradient mpkern uses for ``p``: ``p.main_grad`` (fp32) if present, else ``p.grad``.
    (``_collect`` below inlines the same rule in its hot loop.)"""
    g = getattr(p, "main_grad", None)
    return g if g is not None else p.grad


def _collect(params_or_optimizer: Any) -> tuple[torch.optim.Optimizer | None, list[Tensor], list[Tensor]]:
    """(optimizer or None, params with a grad, their grads), validated; raises before any work."""
    optimizer = params_or_optimizer if isinstance(params_or_optimizer, torch.optim.Optimizer) else None
    if optimizer is not None:
        items: Iterable[Any] = [p for group in optimizer.param_groups for p in group["params"]]
    elif isinstance(params_or_optimizer, Tensor):
        items = [params_or_optimizer]
    elif isinstance(params_or_optimizer, Iterable):
        items = params_or_optimizer
    else:
        raise TypeError("unscale_: params_or_optimizer must be an iterable of tensors or a torch.optim.Optimizer, "
                        f"got {type(params_or_optimizer).__name__}")
    params: list[Tensor] = []
    grads: list[Tensor] = []
    strided, floats = torch.strided, _FLOAT_DTYPES
    for i, p in enumerate(items):
        if not isinstance(p, Tensor):
            raise TypeError(f"unscale_: parameter {i} must be a torch.Tensor, got {type(p).__name__}")
        g = getattr(p, "main_grad", None)
        if g is None:
            g = p.grad
            if g is None:
                continue
        # one combined test per grad (the hot path); the precise message only on failure
        if not (isinstance(g, Tensor) and g.layout == strided and g.dtype in floats):
            _raise_bad_grad(i, g)
        params.append(p)
        grads.append(g)
    return optimizer, params, grads


def _raise_bad_grad(i: int, g: Any) -> None:
    if not isinstance(g, Tensor):
        raise TypeError(f"unscale_: gradient of parameter {i} must be a tensor, got {type(g).__name__}")
    if g.layout != torch.strided:
        raise ValueError(f"unscale_: gradient of parameter {i} is {g.layout}; only dense (strided) gradients "
                         "are supported (sparse gradients are not)")
    raise TypeError(f"unscale_: gradient of parameter {i} has dtype {g.dtype}; expected float32, float16 "
                    "or bfloat16")


def _check_norm_type(norm_type: Any) -> bool:
    """True for the inf-norm, False for L2; ValueError otherwise."""
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
        raise ValueError(f"unscale_: norm_type must be 2.0 or inf, got {norm_type!r}")
    if float(norm_type) == 2.0:
        return False
    if math.isinf(norm_type) and norm_type > 0:
        return True
    raise ValueError(f"unscale_: norm_type must be 2.0 or inf, got {norm_type!r}")


def _check_max_norm(max_norm: Any) -> float | None:
    if max_norm is None:
        return None
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
        raise TypeError(f"unscale_: max_norm must be a positive float or None, got {type(max_norm).__name__}")
    if not (max_norm > 0 and math.isfinite(max_norm)):
        raise ValueError(f"unscale_: max_norm must be a positive finite float or None, got {max_norm!r}")
    return float(max_norm)


def _inv_scale_tensor(inv_scale: Any, scaler: Any) -> Tensor | float:
    if scaler is not None:
        if not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"unscale_: scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        if not (isinstance(inv_scale, (int, float)) and inv_scale == 1.0):
            raise ValueError("unscale_: pass either inv_scale or scaler, not both (the scaler's scale is used)")
        if not scaler.is_enabled():
            return 1.0
        scaler._check_scale_growth_tracker("unscale_")
        # like GradScaler.unscale_: the reciprocal in fp64, on the scale's device, no sync
        return scaler._scale.double().reciprocal().float()
    if isinstance(inv_scale, Tensor):
        if inv_scale.numel() != 1 or not inv_scale.is_floating_point():
            raise ValueError(f"unscale_: inv_scale tensor must hold one floating-point value, got shape "
                             f"{tuple(inv_scale.shape)} and dtype {inv_scale.dtype}")
        return inv_scale
    if isinstance(inv_scale, bool) or not isinstance(inv_scale, (int, float)):
        raise TypeError(f"unscale_: inv_scale must be a float or a one-element tensor, got {type(inv_scale).__name__}")
    if not (inv_scale > 0 and math.isfinite(inv_scale)):
        raise ValueError(f"unscale_: inv_scale must be a positive finite float, got {inv_scale!r}")
    return float(inv_scale)


def _scalar_on(value: Tensor | float, device: torch.device) -> Tensor:
    if isinstance(value, Tensor):
        return value.detach().to(device=device, dtype=torch.float32, non_blocking=True).reshape(())
    return torch.tensor(value, dtype=torch.float32, device=device)


def _flat(g: Tensor) -> bool:
    """True if ``g`` covers one dense block of memory (contiguous up to a permutation of dims)."""
    if g.is_contiguous():
        return True
    expected = 1
    for d in sorted(range(g.dim()), key=g.stride):
        if g.size(d) != 1 and g.stride(d) != expected:
            return False
        expected *= g.size(d)
    return True


def unscale_(
    params_or_optimizer: Iterable[Tensor] | torch.optim.Optimizer,
    inv_scale: float | Tensor = 1.0,
    *,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    per_tensor: bool = False,
    scaler: torch.amp.GradScaler | None = None,
) -> UnscaleResult:
    """Unscale gradients in place, detect inf/NaN and clip by global norm, in one fused pass.

    Args:
        params_or_optimizer: parameters (their ``.main_grad`` if present, else ``.grad``; ``None``
            grads are skipped) or an optimizer (all its parameters). Grads may mix float32,
            float16 and bfloat16 and live on several devices.
        inv_scale: ``1 / loss_scale`` as a float or one-element tensor.
        max_norm: clip the unscaled gradients to this global norm (None: no clipping).
        norm_type: 2.0 or ``inf``.
        per_tensor: also return each gradient's norm and non-finite flag.
        scaler: a ``torch.amp.GradScaler`` (then the first argument must be its optimizer). Its
            scale is used, and the inf check is recorded in it, so ``scaler.step(opt)`` skips the
            step on overflow and ``scaler.update()`` backs off the scale -- exactly like
            ``scaler.unscale_(opt); clip_grad_norm_(params, max_norm)``.

    Grads are multiplied in place by ``inv_scale * clip_coef`` -- except when the first argument
    is an optimizer that fuses the multiply into its step (``mpkern.FusedAdamWMP``): then the
    grads are only read, and the factor is applied in the next ``step()``.

    Returns:
        :class:`UnscaleResult` of device tensors (no host synchronisation happens).

    Raises:
        ValueError / TypeError for bad arguments, before any gradient is touched.
    """
    inf_norm = _check_norm_type(norm_type)
    max_norm_f = _check_max_norm(max_norm)
    optimizer, params, grads = _collect(params_or_optimizer)
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"unscale_: scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
    if scaler is not None and optimizer is None:
        raise ValueError("unscale_: scaler= needs the optimizer as first argument (its inf check is recorded "
                         "per optimizer)")
    inv = _inv_scale_tensor(inv_scale, scaler)
    if scaler is not None and scaler.is_enabled():
        from torch.amp.grad_scaler import OptState

        state = scaler._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")

    if scaler is not None and scaler.is_enabled():
        out_device = scaler._scale.device
    elif grads:
        out_device = grads[0].device
    elif isinstance(inv, Tensor):
        out_device = inv.device
    else:
        out_device = torch.device("cpu")
    # Group by device (keeping order inside each group); one statistics pass per device. The
    # backend is chosen (and a forced one checked) for every device before any work.
    by_dev: dict[torch.device, list[int]] = {}
    flat: list[bool] = []
    for i, g in enumerate(grads):
        by_dev.setdefault(g.device, []).append(i)
        flat.append(g.is_contiguous() or _flat(g))
    backend = {dev: _backend.select(dev) for dev in by_dev}
    all_flat = all(flat)
    sums, maxs, order = [], [], []
    for dev, idx in by_dev.items():
        if all_flat and len(by_dev) == 1:
            gs = grads
        else:
            gs = [grads[i] if flat[i] else grads[i].contiguous() for i in idx]
        s, m = _ops.grad_stats(gs, _scalar_on(inv, dev), backend[dev])
        sums.append(s if dev == out_device else s.to(out_device, non_blocking=True))
        maxs.append(m if dev == out_device else m.to(out_device, non_blocking=True))
        order.extend(idx)
    inv_out = _scalar_on(inv, out_device)
    if sums:
        sumsq = torch.cat(sums) if len(sums) > 1 else sums[0]
        amax = torch.cat(maxs) if len(maxs) > 1 else maxs[0]
        if len(by_dev) > 1:  # back to the caller's order
            perm = torch.empty(len(order), dtype=torch.int64)
            perm[torch.tensor(order, dtype=torch.int64)] = torch.arange(len(order))
            perm = perm.to(out_device, non_blocking=True)
            sumsq, amax = sumsq[perm], amax[perm]
    else:
        sumsq = torch.zeros(0, dtype=torch.float32, device=out_device)
        amax = torch.zeros(0, dtype=torch.float32, device=out_device)

    nonfinite = (~torch.isfinite(amax)).to(torch.float32)
    if inf_norm:
        tensor_norm = amax * inv_out
        total_norm = tensor_norm.amax() if tensor_norm.numel() else torch.zeros((), device=out_device)
    else:
        tensor_norm = sumsq.sqrt()
        total_norm = sumsq.sum().sqrt()
    found_inf = nonfinite.amax() if nonfinite.numel() else torch.zeros((), device=out_device)
    one = torch.ones((), dtype=torch.float32, device=out_device)
    if max_norm_f is None:
        clip_coef = one
    else:
        clip_coef = torch.clamp(max_norm_f / (total_norm + 1e-6), max=1.0)
        clip_coef = torch.where(found_inf > 0, one, clip_coef)
    factor = inv_out * clip_coef

    defer = optimizer is not None and getattr(optimizer, "_mpkern_fuses_unscale", False)
    if defer:
        optimizer._mpkern_set_pending_unscale(factor, found_inf, total_norm)
    else:
        for dev, idx in by_dev.items():
            f = factor if dev == out_device else factor.to(dev, non_blocking=True)
            if all_flat and len(by_dev) == 1:
                _ops.scale_(grads, f, backend[dev])
                continue
            _ops.scale_([grads[i] for i in idx if flat[i]], f, backend[dev])
            for i in idx:  # rare: grads that are not one dense block (e.g. strided views)
                if not flat[i]:
                    grads[i].mul_(f)

    if scaler is not None and scaler.is_enabled():
        from torch.amp.grad_scaler import OptState

        state = scaler._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = {out_device: found_inf}
        state["stage"] = OptState.UNSCALED

    res = UnscaleResult(found_inf, total_norm.to(torch.float32), clip_coef,
                        tensor_norm if per_tensor else None, nonfinite if per_tensor else None)
    res.params = tuple(params)
    return res


def nonfinite_report(
    model_or_named_params: torch.nn.Module | Mapping[str, Tensor] | Iterable[tuple[str, Tensor]],
    result: UnscaleResult,
) -> list[tuple[str, float]]:
    """Name the parameters whose gradients held inf/NaN in an :func:`unscale_` result.

    Args:
        model_or_named_params: the model, or ``named_parameters()``-style pairs / a name->param dict.
        result: the value :func:`unscale_` returned, computed with ``per_tensor=True``.

    Returns:
        ``[(name, per_tensor_norm), ...]`` for every non-finite gradient, in processing order
        (parameters the model does not name are reported as ``"<param i>"``). This reads the
        flags back to the host -- call it when ``found_inf`` says something went wrong, not
        every step.
    """
    if result.per_tensor_nonfinite is None or result.per_tensor_norm is None:
        raise ValueError("nonfinite_report: the result has no per-tensor data; call unscale_(..., per_tensor=True)")
    if isinstance(model_or_named_params, torch.nn.Module):
        pairs: Iterable[tuple[str, Tensor]] = model_or_named_params.named_parameters()
    elif isinstance(model_or_named_params, Mapping):
        pairs = model_or_named_params.items()
    else:
        pairs = model_or_named_params
    names = {id(p): n for n, p in pairs}
    flags = result.per_tensor_nonfinite.tolist()
    norms = result.per_tensor_norm.tolist()
    params: Sequence[Tensor] = getattr(result, "params", ())
    out = []
    for i, bad in enumerate(flags):
        if bad:
            name = names.get(id(params[i]), f"<param {i}>") if i < len(params) else f"<param {i}>"
            out.append((name, norms[i]))
    return out
