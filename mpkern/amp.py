"""Fused gradient unscale + inf/NaN check + global-norm clipping.

``mpkern.unscale_`` replaces ``scaler.unscale_(opt); clip_grad_norm_(params, max_norm)``: one
read-only statistics pass over all gradients (sum of squares and max |g| per tensor, which also
flags inf/NaN), a few tiny device ops that finish the norm and the clip coefficient, then one
in-place multiply by ``inv_scale * clip_coef``. Nothing in it waits for the device.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

from . import _fused_unscale, _ops, _scaler_internals, distributed
from ._grad_stats import DeviceStats, Finished, check_max_norm, device_stats, finish_stats
from ._grads import (
    FLOATS as _FLOAT_DTYPES,
    main_grad_of as _main_grad_of,
    raise_bad_grad,
    to_device as _to_device,
)

Tensor = torch.Tensor


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
            :func:`mpkern.nonfinite_report`).
        names: their names when ``unscale_`` was given ``named_parameters()`` pairs, else None.
    """

    params: tuple[Tensor, ...]
    names: tuple[str, ...] | None


def _items(params_or_optimizer: Any) -> tuple[torch.optim.Optimizer | None, Iterable[Any]]:
    """(optimizer or None, the items to walk): an optimizer's params (a param listed twice is
    processed once: scaled once, counted once), or the given tensors / (name, tensor) pairs."""
    if isinstance(params_or_optimizer, torch.optim.Optimizer):
        seen: set[int] = set()
        params = []
        for group in params_or_optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        return params_or_optimizer, params
    if isinstance(params_or_optimizer, torch.nn.Module):
        raise TypeError("unscale_: got a torch.nn.Module; pass model.parameters() (or model.named_parameters(), "
                        "or the optimizer)")
    if isinstance(params_or_optimizer, Tensor):
        return None, [params_or_optimizer]
    if isinstance(params_or_optimizer, Iterable):
        return None, params_or_optimizer
    raise TypeError("unscale_: params_or_optimizer must be an iterable of tensors or a torch.optim.Optimizer, "
                    f"got {type(params_or_optimizer).__name__}")


def _collect(
    params_or_optimizer: Any,
) -> tuple[torch.optim.Optimizer | None, list[Tensor], list[Tensor], list[str] | None, int]:
    """(optimizer or None, params with a grad, their grads, their names if given as
    ``named_parameters()`` pairs, number of items seen), validated; raises before any work."""
    optimizer, items = _items(params_or_optimizer)
    params: list[Tensor] = []
    grads: list[Tensor] = []
    names: list[str] | None = None
    strided, floats = torch.strided, _FLOAT_DTYPES
    i = -1
    for i, p in enumerate(items):
        if not isinstance(p, Tensor):
            if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], Tensor):
                if names is None:  # named_parameters() pairs: keep the names for nonfinite_report
                    if params:
                        raise TypeError("unscale_: mix of tensors and (name, tensor) pairs")
                    names = []
                name, p = p
            else:
                raise TypeError(f"unscale_: parameter {i} must be a torch.Tensor or a (name, tensor) pair, "
                                f"got {type(p).__name__}")
        elif names is not None:
            raise TypeError("unscale_: mix of tensors and (name, tensor) pairs")
        g = getattr(p, "main_grad", None)  # _grads.grad_of, inlined: this loop runs per param
        if g is None:
            g = p.grad
            if g is None:
                continue
        elif p.grad is not None:
            g = _main_grad_of(p, g)
        # one combined test per grad (the hot path); the precise message only on failure
        if not (isinstance(g, Tensor) and g.layout == strided and g.dtype in floats):
            raise_bad_grad("unscale_", f"parameter {i}", g)
        params.append(p)
        grads.append(g)
        if names is not None:
            names.append(name)
    return optimizer, params, grads, names, i + 1


def _check_norm_type(norm_type: Any) -> bool:
    """True for the inf-norm, False for L2; ValueError otherwise."""
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
        raise ValueError(f"unscale_: norm_type must be 2.0 or inf, got {norm_type!r}")
    if float(norm_type) == 2.0:
        return False
    if math.isinf(norm_type) and norm_type > 0:
        return True
    raise ValueError(f"unscale_: norm_type must be 2.0 or inf, got {norm_type!r}")


def _inv_scale_tensor(inv_scale: Any, scaler: Any) -> Tensor | float:
    if scaler is not None:
        if not (isinstance(inv_scale, (int, float)) and inv_scale == 1.0):
            raise ValueError("unscale_: pass either inv_scale or scaler, not both (the scaler's scale is used)")
        if not scaler.is_enabled():
            return 1.0
        scale = _scaler_internals.scaler_internals(scaler, needs_scale="unscale_").scale
        assert scale is not None  # needs_scale: GradScaler's own check that scale() ran has passed
        # like GradScaler.unscale_: the reciprocal in fp64, on the scale's device, no sync
        return scale.double().reciprocal().float()
    if isinstance(inv_scale, Tensor):
        if inv_scale.numel() != 1 or not inv_scale.is_floating_point():
            raise ValueError(f"unscale_: inv_scale tensor must hold one floating-point value, got shape "
                             f"{tuple(inv_scale.shape)} and dtype {inv_scale.dtype}")
        return inv_scale
    if isinstance(inv_scale, bool) or not isinstance(inv_scale, (int, float)):
        raise TypeError(f"unscale_: inv_scale must be a float or a one-element tensor, got {type(inv_scale).__name__}")
    if not (inv_scale > 0 and math.isfinite(inv_scale)):
        raise ValueError(f"unscale_: inv_scale must be a positive finite float, got {inv_scale!r}")
    if inv_scale > 1.0:
        warnings.warn(f"unscale_: inv_scale={inv_scale!r} is > 1, so the gradients are scaled *up*; inv_scale is "
                      "1 / loss_scale (or pass scaler=)", UserWarning, stacklevel=4)
    return float(inv_scale)


class _Request(NamedTuple):
    """A validated :func:`unscale_` call (stage 1's result)."""

    optimizer: torch.optim.Optimizer | None
    params: list[Tensor]
    grads: list[Tensor]
    names: list[str] | None
    inv: Tensor | float
    scaler: torch.amp.GradScaler | None  # None when absent or disabled
    defer: bool  # the optimizer applies the factor in its step
    fuses: bool
    inf_norm: bool
    max_norm: float | None
    reduce_plan: Any
    out_device: torch.device


def _validate(params_or_optimizer: Any, inv_scale: Any, max_norm: Any, norm_type: Any, scaler: Any, apply: Any,
              process_group: Any) -> _Request:
    """Stage 1: check the arguments and collect the grads; raises before any grad is touched."""
    inf_norm = _check_norm_type(norm_type)
    max_norm_f = check_max_norm(max_norm)
    if not isinstance(apply, bool):
        raise TypeError(f"unscale_: apply must be a bool, got {type(apply).__name__}")
    optimizer, params, grads, names, n_items = _collect(params_or_optimizer)
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"unscale_: scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
    if scaler is not None and optimizer is None:
        raise ValueError("unscale_: scaler= needs the optimizer as first argument (its inf check is recorded "
                         "per optimizer)")
    fuses = _fused_unscale.fuses_unscale(optimizer)
    defer = fuses and not apply
    enabled = scaler if scaler is not None and scaler.is_enabled() else None
    if enabled is not None and not defer and any(g.dtype == torch.float16 for g in grads):
        # GradScaler's own guard: unscaled fp16 grads lose their small values (keep fp32 params and
        # autocast, or let FusedAdamWMP apply the factor in fp32 inside its step)
        raise ValueError("Attempting to unscale FP16 gradients.")
    inv = _inv_scale_tensor(inv_scale, scaler)
    if process_group is None and optimizer is not None:
        process_group = _fused_unscale.process_group(optimizer)
    reduce_plan = distributed.plan(grads, process_group, params)
    if reduce_plan is not None:
        grads = [distributed.local(g) for g in grads]  # the kernels work on local shards
    if not grads and reduce_plan is None:
        what = ("an empty iterable (an exhausted generator?)" if n_items == 0
                else f"{n_items} parameters, none with a grad")
        warnings.warn(f"unscale_: no gradient was processed ({what}); found_inf and total_norm are 0",
                      UserWarning, stacklevel=3)
    if enabled is not None:
        _scaler_internals.check_unscale_stage(enabled, optimizer)
        scale = _scaler_internals.scaler_internals(enabled).scale
        assert scale is not None  # checked by _inv_scale_tensor (needs_scale)
        out_device = scale.device
    else:
        out_device = grads[0].device if grads else inv.device if isinstance(inv, Tensor) else torch.device("cpu")
    return _Request(optimizer, params, grads, names, inv, enabled, defer, fuses, inf_norm, max_norm_f, reduce_plan,
                    out_device)


def _apply_or_defer(req: _Request, st: DeviceStats, fin: Finished, inv_out: Tensor) -> None:
    """Stage 4: leave the factor to a fusing optimizer's step, or multiply the grads now."""
    if req.fuses:  # apply=True: the grads are final now; the step still needs the skip decision
        _fused_unscale.leave_unscale(req.optimizer, fin.factor, fin.found_inf, fin.total_norm, inv=inv_out,
                               coef=fin.clip_coef, applied=not req.defer, inf_norm=req.inf_norm)
    if req.defer:
        return
    grads, out_device = req.grads, req.out_device
    for dev, idx in st.by_dev.items():
        f = fin.factor if dev == out_device else _to_device(fin.factor, dev)
        if all(st.flat) and len(st.by_dev) == 1:
            _ops.scale_(grads, f, st.backend[dev])
            continue
        _ops.scale_([grads[i] for i in idx if st.flat[i]], f, st.backend[dev])
        for i in idx:  # rare: grads that are not one dense block (e.g. strided views)
            if not st.flat[i]:
                grads[i].mul_(f)


def unscale_(
    params_or_optimizer: Iterable[Tensor] | torch.optim.Optimizer,
    inv_scale: float | Tensor = 1.0,
    *,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    per_tensor: bool = False,
    scaler: torch.amp.GradScaler | None = None,
    apply: bool = False,
    process_group: Any = None,
) -> UnscaleResult:
    """Unscale gradients in place, detect inf/NaN and clip by global norm, in one fused pass.

    Args:
        params_or_optimizer: parameters (their ``.main_grad`` if present, else ``.grad``; ``None``
            grads are skipped), ``named_parameters()`` pairs (the names then reach
            :func:`mpkern.nonfinite_report`), or an optimizer (all its parameters). Grads may mix float32,
            float16 and bfloat16 and live on several devices. A warning says when no gradient
            at all was processed (e.g. an exhausted generator).
        inv_scale: ``1 / loss_scale`` as a float or one-element tensor.
        max_norm: clip the unscaled gradients to this global norm (None: no clipping).
        norm_type: 2.0 or ``inf``.
        per_tensor: also return each gradient's norm and non-finite flag.
        scaler: a ``torch.amp.GradScaler`` (then the first argument must be its optimizer). Its
            scale is used, and the inf check is recorded in it, so ``scaler.step(opt)`` skips the
            step on overflow and ``scaler.update()`` backs off the scale -- exactly like
            ``scaler.unscale_(opt); clip_grad_norm_(params, max_norm)``. With ``FusedAdamWMP`` the
            scaler is also attached to the optimizer (see :mod:`mpkern._fused_unscale`). Like GradScaler,
            fp16 gradients are refused here ("Attempting to unscale FP16 gradients") unless the
            optimizer is an mpkern one that applies the factor in fp32 inside its step.
        apply: with a ``FusedAdamWMP`` first argument, write the unscaled, clipped grads now
            instead of deferring the multiply into the step (for code that inspects or edits the
            grads between unscale_ and step; costs one read+write pass over the grads).
        process_group: combine the statistics over this ``torch.distributed`` group: every plain
            gradient is taken as this rank's shard (ZeRO-style flat shards, Megatron tensor
            parallel). Default: the optimizer's ``process_group`` if it has one. DTensor gradients
            (FSDP2, tensor parallel) need no argument: their mesh says how to combine them.
            Either way the kernels run on local shards and **one** all-reduce of the packed
            partials makes every rank reach the same norm, clip coefficient and skip decision
            (see :mod:`mpkern.distributed`); every rank of the group must make the call.

    Grads are multiplied in place by ``inv_scale * clip_coef`` -- except when the first argument
    is an optimizer that fuses the multiply into its step (``mpkern.FusedAdamWMP``) and
    ``apply=False``: then the grads are only read, **they stay scaled until the step**, and the
    factor is applied in fp32 registers in the next ``step()``.

    Stages: validate and collect (:func:`_validate`), per-device statistics
    (:func:`device_stats`), global reduction (:func:`mpkern.distributed.reduce_stats`), norm and
    coefficient (:func:`finish_stats`), apply or defer (:func:`_apply_or_defer`), record in the
    scaler (:func:`mpkern._scaler_internals.record_found_inf`).

    Returns:
        :class:`UnscaleResult` of device tensors (no host synchronisation happens).

    Raises:
        ValueError / TypeError for bad arguments, before any gradient is touched.
    """
    req = _validate(params_or_optimizer, inv_scale, max_norm, norm_type, scaler, apply, process_group)
    st = device_stats(req.grads, req.inv, req.out_device)
    sumsq, amax = st.sumsq, st.amax
    if req.reduce_plan is not None:  # one all-reduce: global statistics on every rank
        sumsq, amax = distributed.reduce_stats(sumsq, amax, req.inf_norm, req.reduce_plan, per_tensor)
    inv_out = _ops.scalar_on(req.inv, req.out_device)
    fin = finish_stats(sumsq, amax, inv_out, req.inf_norm, req.max_norm, req.out_device)
    _apply_or_defer(req, st, fin, inv_out)
    if req.scaler is not None:
        _scaler_internals.record_found_inf(req.scaler, req.optimizer, fin.found_inf, unscaled=True)
        _fused_unscale.attach_scaler(req.optimizer, req.scaler)
    res = UnscaleResult(fin.found_inf, fin.total_norm.to(torch.float32), fin.clip_coef,
                        fin.tensor_norm if per_tensor else None, fin.nonfinite if per_tensor else None)
    res.params = tuple(req.params)
    res.names = tuple(req.names) if req.names is not None else None
    return res


def clip_grad_norm_(
    parameters: Iterable[Tensor] | Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    """Drop-in for ``torch.nn.utils.clip_grad_norm_`` that also sees ``main_grad``.

    Same arguments and return value (the total norm, a 0-dim tensor); the grads (``main_grad``
    where present, else ``.grad``) are scaled in place by ``min(1, max_norm / (norm + 1e-6))`` in
    one fused statistics pass and one multiply (:func:`unscale_` with ``inv_scale=1``).
    Differences: ``norm_type`` is 2 or inf only (``ValueError`` otherwise); ``foreach`` is ignored
    (always fused); with inf/NaN grads the grads are left as they are (torch multiplies them by a
    NaN coefficient). ``error_if_nonfinite=True`` reads the flag back to the host (a sync, as in
    torch).
    """
    res = unscale_([parameters] if isinstance(parameters, Tensor) else parameters, 1.0, max_norm=max_norm,
                   norm_type=norm_type)
    if error_if_nonfinite and bool(res.found_inf):
        raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                           "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
                           "by the non-finite norm anyway, set `error_if_nonfinite=False`")
    return res.total_norm


