"""The plan of one optimizer step: the factor its kernels apply and whether it is skipped.

:func:`plan_step` turns what ``mpkern.unscale_`` / ``clip_grad_norm_`` left pending, the step's own
``max_grad_norm`` and what ``GradScaler`` handed over into a :class:`StepPlan` -- through the same
final stage as ``unscale_`` (:func:`mpkern._grad_stats.finish_stats`), so a step that clips itself
reaches the bits ``unscale_`` would. :func:`stats_pass` is that step's statistics pass;
:func:`check_step_scaler` and :func:`step_inverse` are the GradScaler rules of a step. The full
step, the cached step and gradient release all plan through here. Nothing here waits for the device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .. import _ops, distributed
from .._grad_stats import check_max_norm, device_stats, finish_stats

Tensor = torch.Tensor


class StepPlan(NamedTuple):
    """What one optimizer step applies: ``factor`` (the grads' multiplier, inv_scale * clip_coef),
    ``found_inf`` (skip the step when set) and ``norm`` (the step's ``last_grad_norm``; None when
    no norm was computed). 0-dim float32 device tensors."""

    factor: Tensor
    found_inf: Tensor
    norm: Tensor | None


def stats_pass(grads: list[Tensor], params: list[Tensor], process_group: Any,
               backends: dict[torch.device, str] | None = None) -> Callable[[Tensor], tuple[Tensor, Tensor]]:
    """``inv -> (sumsq, amax)``: the statistics stages of :func:`mpkern.unscale_` (per device, then the
    global reduction over ``process_group`` / the DTensors' meshes) over ``grads``, validated
    already, in their order -- what :func:`plan_step` runs for a step's own clip."""
    rp = (distributed.plan(grads, process_group, params)
          if process_group is not None or set(map(type, grads)) - {Tensor} else None)
    if rp is not None:
        grads = [distributed.local(g) for g in grads]
    out_device = grads[0].device if grads else torch.device("cpu")

    def stats(inv: Tensor) -> tuple[Tensor, Tensor]:
        st = device_stats(grads, inv, out_device, backends)
        if rp is None:
            return st.sumsq, st.amax
        return distributed.reduce_stats(st.sumsq, st.amax, False, rp, False)

    return stats


def check_step_scaler(pending: Any, grad_scale: Tensor | None, found_inf: Tensor | None, uses_main: bool) -> bool:
    """Before a step changes anything: ValueError for ``scaler.unscale_(opt)`` with ``main_grad``
    (it unscaled ``.grad`` only); True when the step must check the grads itself because GradScaler
    did not see a ``main_grad`` (its scale handed over, nothing pending)."""
    if uses_main and pending is None and grad_scale is None and found_inf is not None:
        raise ValueError("FusedAdamWMP.step: GradScaler.unscale_(optimizer) was called, which unscales .grad only; "
                         "the main_grad buffers (mpkern.nn fp32_main_grad=True) are still scaled -- call "
                         "mpkern.unscale_(optimizer, scaler=scaler) instead of scaler.unscale_(optimizer)")
    return pending is None and grad_scale is not None and uses_main


def step_inverse(grad_scale: Tensor | None, device: torch.device) -> Tensor:
    """The step's unscale factor ``1 / grad_scale``: the reciprocal taken in fp64, as GradScaler does,
    as a 0-dim float32 tensor on the scale's device; 1 on ``device`` without a scale. Gradient release
    computes its pass-1 statistics with these bits, so its plan equals the regular step's."""
    if grad_scale is None:
        return _ops.scalar_on(1.0, device)
    return grad_scale.double().reciprocal().float().reshape(())


def plan_step(pending: Any, *, max_norm: float | None, grad_scale: Tensor | None, found_inf: Tensor | None,
              device: torch.device, stats: Callable[[Tensor], tuple[Tensor, Tensor]] | None) -> StepPlan:
    """The plan of one optimizer step, computed and returned (nothing is left anywhere).

    ``pending``: what :func:`mpkern.unscale_` / ``clip_grad_norm_`` left (a :class:`mpkern._fused_unscale.Pending`,
    or None); ``max_norm``: the step's own clip threshold; ``grad_scale`` / ``found_inf``: what
    GradScaler handed over (its scale's reciprocal is taken in fp64, as GradScaler does);
    ``stats``: the step's statistics pass (:func:`stats_pass`), run when the step needs a norm
    nothing pending gave it (its own clip, or its own inf check), through the same final stage as
    :func:`mpkern.unscale_` (:func:`mpkern._grad_stats.finish_stats`). With something pending,
    ``max_norm`` also applies to it: the smaller clip coefficient wins. GradScaler's ``found_inf`` is folded in last."""
    mnorm = check_max_norm(max_norm)
    if pending is None:
        inv = step_inverse(grad_scale, device)
        if stats is None:
            plan = StepPlan(inv, torch.zeros((), dtype=torch.float32, device=inv.device), None)
        else:
            inv = _ops.scalar_on(inv, device)
            fin = finish_stats(*stats(inv), inv, False, mnorm, device)
            plan = StepPlan(fin.factor, fin.found_inf, fin.total_norm)
    else:
        coef, found = pending.coef, pending.found
        if mnorm is not None and pending.inf_norm:  # the pending norm is the inf-norm: the clip needs L2
            assert stats is not None, "plan_step: a max_norm needs the step's statistics pass"
            fin = finish_stats(*stats(pending.inv), pending.inv, False, mnorm, device)
            coef, found = torch.minimum(coef, fin.clip_coef), torch.maximum(found, fin.found_inf)
        elif mnorm is not None:
            one = torch.ones_like(coef)
            coef = torch.minimum(coef, torch.where(found > 0, one, torch.clamp(mnorm / (pending.norm + 1e-6), max=1.0)))
        plan = StepPlan(pending.inv * coef, found, pending.reported)
    if found_inf is not None:
        plan = plan._replace(found_inf=torch.maximum(plan.found_inf, _ops.scalar_on(found_inf, plan.found_inf.device)))
    return plan
