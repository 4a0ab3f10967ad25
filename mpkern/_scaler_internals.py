"""The adapter to ``torch.amp.GradScaler``'s internals: the one module that reads and writes them.

GradScaler has no public way to read its scale without a host sync
(``get_scale()`` calls ``.item()``) or to record an inf check for an optimizer, so mpkern reads a few
of its private attributes. :func:`scaler_internals` is the one function that touches them; everything
else (:func:`record_found_inf`, :mod:`mpkern.amp`, ``mpkern compare``) goes through the
:class:`ScalerInternals` it returns.
``tests/test_scaler.py`` pins the layout it relies on, so that a torch upgrade that changes it fails
there, loudly, and not in a training run.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import torch

from ._grads import to_device

Tensor = torch.Tensor


class ScalerInternals(NamedTuple):
    """What mpkern uses of a ``torch.amp.GradScaler`` beyond its public methods (see :func:`scaler_internals`).

    ``scale``: the live scale tensor (one element, float32, on the scaler's device; GradScaler updates
    it in place), None before the first ``scaler.scale(...)``. ``init_scale``: the scale it started from.
    ``optimizer_state``: GradScaler's live per-optimizer record of the optimizer asked for (``"stage"``:
    an ``OptState``, ``"found_inf_per_device"``: device -> float32 flag tensor), None when none was asked.
    """

    scale: Tensor | None
    init_scale: float
    optimizer_state: dict[str, Any] | None


def scaler_internals(scaler: torch.amp.GradScaler, opt: Any = None, *,
                     needs_scale: str | None = None) -> ScalerInternals:
    """The one function that reads GradScaler's private attributes (``_scale``, ``_init_scale``,
    ``_per_optimizer_states``, ``_check_scale_growth_tracker``).

    ``opt``: also return GradScaler's record of this optimizer (created, as GradScaler itself does, if
    there is none yet). ``needs_scale``: the name of the calling operation; GradScaler's own check (an
    ``AssertionError`` naming it) that ``scaler.scale(loss)`` ran in this iteration.
    Raises ``RuntimeError`` naming the torch version when the layout is not the one mpkern knows.
    """
    # The reads below are this module's job (the module docs): GradScaler has no public form of them.
    try:
        if needs_scale is not None:
            scaler._check_scale_growth_tracker(needs_scale)  # noqa: SLF001 -- GradScaler's own check, see above
        state = None if opt is None else scaler._per_optimizer_states[id(opt)]  # noqa: SLF001 -- see above
        return ScalerInternals(scaler._scale, float(scaler._init_scale), state)  # noqa: SLF001 -- see above
    except AttributeError as e:
        raise RuntimeError(f"mpkern: torch {torch.__version__}'s GradScaler does not have the private layout "
                           f"mpkern relies on ({e}); see mpkern._scaler_internals and the layout test "
                           "in tests/test_scaler.py") from e


def record_found_inf(scaler: torch.amp.GradScaler, opt: Any, found_inf: Tensor, *, unscaled: bool) -> None:
    """Record ``found_inf`` in ``scaler`` for ``opt``, so that ``scaler.step`` / ``scaler.update`` see
    it as their own inf check (``unscaled``: and mark ``opt`` unscaled, as ``scaler.unscale_`` does).
    A copy on the scale's device: GradScaler sums other optimizers' flags into these tensors in place."""
    internals = scaler_internals(scaler, opt)
    scale, state = internals.scale, internals.optimizer_state
    assert scale is not None, "record_found_inf: the scaler has no scale yet (scaler.scale(loss) not called)"
    assert state is not None, "record_found_inf: needs the optimizer"
    dev = scale.device
    state["found_inf_per_device"] = {dev: to_device(found_inf, dev).clone() if found_inf.device == dev
                                     else to_device(found_inf, dev)}
    if unscaled:
        from torch.amp.grad_scaler import OptState

        state["stage"] = OptState.UNSCALED


def check_unscale_stage(scaler: torch.amp.GradScaler, opt: Any) -> None:
    """GradScaler's own errors for ``unscale_`` called twice or after ``step`` in one iteration."""
    from torch.amp.grad_scaler import OptState

    state = scaler_internals(scaler, opt).optimizer_state
    assert state is not None, "check_unscale_stage: needs the optimizer"
    stage = state["stage"]
    if stage is OptState.UNSCALED:
        raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
    if stage is OptState.STEPPED:
        fix = ("scaler.update() was not called after the last scaler.step(optimizer) -- call scaler.update() once "
               "per iteration, after scaler.step(); without it the loss scale never backs off or grows")
        warnings.warn(f"mpkern.unscale_: {fix}", UserWarning, stacklevel=4)
        raise RuntimeError(f"unscale_() is being called after step(): {fix}.")
