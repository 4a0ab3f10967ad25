"""The grad factor and skip decision of a ``FusedAdamWMP`` step: pending unscale, clipping, GradScaler.

What ``mpkern.unscale_`` / ``clip_grad_norm_`` left (a :class:`mpkern._handoff.Pending`),
``max_grad_norm``, and GradScaler's ``grad_scale`` / ``found_inf`` (the amp-scaling protocol) are
resolved here into one ``(grad factor, found_inf)`` pair, for the full and the cached step alike.
An overflow only a ``main_grad`` holds is recorded in the attached GradScaler (see
:mod:`mpkern._handoff` for the protocol).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from .. import _handoff, _ops, amp
from .._grads import to_device

Tensor = torch.Tensor


def take_pending(opt: Any) -> _handoff.Pending | None:
    pending = opt._live.get("_pending")
    opt._live["_pending"] = None
    return pending


def own_clip(opt: Any, pend: _handoff.Pending) -> _handoff.Pending:
    """``pend`` with ``max_grad_norm`` applied too: the smaller clip coefficient wins."""
    mgn = opt.max_grad_norm
    if pend.inf_norm:  # the pending norm is the inf-norm: max_grad_norm needs the L2 norm
        amp.unscale_(opt, pend.inv, max_norm=mgn)
        l2 = take_pending(opt)
        assert l2 is not None
        return pend._replace(coef=torch.minimum(pend.coef, l2.coef), found=torch.maximum(pend.found, l2.found))
    one = torch.ones_like(pend.coef)
    coef = torch.where(pend.found > 0, one, torch.clamp(mgn / (pend.norm + 1e-6), max=1.0))
    return pend._replace(coef=torch.minimum(pend.coef, coef))


def clip_grad_norm(opt: Any, max_norm: float, norm_type: float) -> Tensor:
    """``FusedAdamWMP.clip_grad_norm_``: a norm pass whose coefficient composes with what is pending
    (the unscale factor stays; the smallest clip coefficient wins)."""
    prev = opt._live.get("_pending")
    res = amp.unscale_(opt, prev.inv if prev is not None else 1.0, max_norm=max_norm, norm_type=norm_type)
    new = opt._live.get("_pending")
    if prev is not None and new is not None:
        opt._live["_pending"] = new._replace(coef=torch.minimum(prev.coef, new.coef),
                                             found=torch.maximum(prev.found, new.found))
    return res.total_norm


def step_factor(opt: Any, dev: torch.device, stats: Callable[[Tensor], None] | None) -> tuple[Tensor, Tensor]:
    """(grad factor, found_inf) of this step, for the full and the cached path alike.

    Takes the pending unscale/clip (or GradScaler's ``grad_scale``: its reciprocal in fp64 like
    GradScaler; else the cached constant 1 on ``dev``), runs ``stats(inv)`` -- the statistics
    pass that leaves a pending clip -- when there was none and it is given, applies
    ``max_grad_norm`` to a pending one, folds in GradScaler's ``found_inf``; records
    ``last_grad_norm`` / ``last_found_inf``."""
    grad_scale = getattr(opt, "grad_scale", None)  # set by GradScaler.step (amp-scaling protocol)
    found_ext = getattr(opt, "found_inf", None)
    pending = take_pending(opt)
    if pending is None:
        inv = (grad_scale.double().reciprocal().float().reshape(()) if grad_scale is not None
               else _ops.scalar_on(1.0, dev))
        if stats is not None:
            stats(inv)
            pending = take_pending(opt)
    elif opt.max_grad_norm is not None:
        pending = own_clip(opt, pending)
    if pending is not None:
        factor, found = pending.inv * pending.coef, pending.found
        opt.last_grad_norm = pending.reported
    else:
        factor = inv
        found = torch.zeros((), dtype=torch.float32, device=factor.device)
    if found_ext is not None:
        found = torch.maximum(found, to_device(found_ext, found.device, torch.float32).reshape(()))
    opt.last_found_inf = found
    return factor, found


def check_scaler_sequence(opt: Any, uses_main: bool) -> bool:
    """Before a full step: ValueError for ``scaler.unscale_(opt)`` with ``main_grad`` (it unscaled
    ``.grad`` only); True when this step must check the grads itself because GradScaler did not
    see a ``main_grad`` (its scale handed over, nothing pending)."""
    grad_scale = getattr(opt, "grad_scale", None)
    pending = opt._live.get("_pending")
    if uses_main and pending is None and grad_scale is None and getattr(opt, "found_inf", None) is not None:
        raise ValueError("FusedAdamWMP.step: GradScaler.unscale_(optimizer) was called, which unscales .grad only; "
                         "the main_grad buffers (mpkern.nn fp32_main_grad=True) are still scaled -- call "
                         "mpkern.unscale_(optimizer, scaler=scaler) instead of scaler.unscale_(optimizer)")
    return pending is None and grad_scale is not None and uses_main


def tell_scaler(opt: Any, found: Tensor) -> None:
    """Record ``found`` (which includes what GradScaler found in ``.grad``) in the attached
    GradScaler, so that ``scaler.update()`` backs off on an overflow only ``main_grad`` held."""
    scaler = _handoff.attached_scaler(opt)
    if scaler is None:
        warnings.warn("FusedAdamWMP.step: a GradScaler stepped this optimizer with main_grad present, but none is "
                      "attached; an overflow in main_grad skips the step but cannot back off the scale -- call "
                      "opt.attach_grad_scaler(scaler) once, or mpkern.unscale_(opt, scaler=scaler) before "
                      "scaler.step(opt)", UserWarning, stacklevel=4)
        return
    _handoff.record_found_inf(scaler, opt, found, unscaled=False)


__all__ = ["check_scaler_sequence", "clip_grad_norm", "own_clip", "step_factor", "take_pending", "tell_scaler"]
