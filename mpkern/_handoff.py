"""Where ``mpkern.unscale_`` (:mod:`mpkern.amp`) and a fused optimizer (``FusedAdamWMP``) meet.

The one package-internal interface between the two, so that neither reaches into the other. An
optimizer takes part by having a ``mpkern_runtime`` attribute (a :class:`mpkern.optim.runtime.Runtime`):
it applies an unscale/clip factor inside its step, so ``unscale_`` may leave the factor to it
(:meth:`~mpkern.optim.runtime.Runtime.leave`, a :class:`Pending`) instead of writing the grads, and
the runtime keeps the attached ``GradScaler`` (weakly) and the optimizer's ``process_group``.

**GradScaler protocol.** ``GradScaler.step(opt)`` hands an amp-scaling optimizer its scale and the
inf check of ``.grad`` (``opt.grad_scale`` / ``opt.found_inf``), but not itself. An overflow that
only a ``main_grad`` holds (fp32 grads of ``mpkern.nn`` layers, which GradScaler does not read) is
found by the optimizer's own check, and must be recorded in the scaler so that ``scaler.update()``
backs off. The scaler is known to the optimizer when it was *attached*: by
``mpkern.unscale_(opt, scaler=scaler)`` (every step that uses it), or once by
``opt.attach_grad_scaler(scaler)``. Without an attached scaler the step is still skipped, and a
warning says that the scale cannot back off. :func:`record_found_inf` is the one place that writes
a GradScaler's per-optimizer state.

**GradScaler's private layout.** GradScaler has no public way to read its scale without a host sync
(``get_scale()`` calls ``.item()``) or to record an inf check for an optimizer, so mpkern reads a few
of its private attributes. :func:`scaler_internals` is the one function that touches them; everything
else (here, :mod:`mpkern.amp`, ``mpkern compare``) goes through the :class:`ScalerInternals` it returns.
``tests/test_scaler.py`` pins the layout it relies on, so that a torch upgrade that changes it fails
there, loudly, and not in a training run.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import torch

from ._grads import to_device

Tensor = torch.Tensor


class Pending(NamedTuple):
    """What :func:`mpkern.unscale_` / ``clip_grad_norm_`` left for the next ``step()``.

    ``inv`` and ``coef`` are still to be applied to the grads (both 1 when ``apply=True`` wrote
    them already); ``norm`` is the norm of ``grads * inv`` (what the step sees before ``coef``),
    ``reported`` the norm the caller got back (``last_grad_norm``), ``inf_norm`` which norm it is.
    """

    inv: Tensor
    coef: Tensor
    found: Tensor
    norm: Tensor
    reported: Tensor
    inf_norm: bool

    def tightened(self, other: Pending) -> Pending:
        """This one with ``other``'s clip too: the smaller coefficient wins, either found flag counts."""
        return self._replace(coef=torch.minimum(other.coef, self.coef), found=torch.maximum(other.found, self.found))


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
    try:
        if needs_scale is not None:
            scaler._check_scale_growth_tracker(needs_scale)
        state = None if opt is None else scaler._per_optimizer_states[id(opt)]
        return ScalerInternals(scaler._scale, float(scaler._init_scale), state)
    except AttributeError as e:
        raise RuntimeError(f"mpkern: torch {torch.__version__}'s GradScaler does not have the private layout "
                           f"mpkern relies on ({e}); see mpkern._handoff.scaler_internals and the layout test "
                           "in tests/test_scaler.py") from e


def runtime(opt: Any) -> Any:
    """The runtime of an optimizer that fuses the unscale into its step (None: not one)."""
    return None if opt is None else getattr(opt, "mpkern_runtime", None)


def fuses_unscale(opt: Any) -> bool:
    """True if ``opt`` applies a pending unscale/clip factor inside its step."""
    return runtime(opt) is not None


def leave_unscale(opt: Any, factor: Tensor, found_inf: Tensor, total_norm: Tensor, *, inv: Tensor,
                  coef: Tensor, applied: bool, inf_norm: bool) -> None:
    """Leave an unscale/clip for ``opt``'s next step: apply ``inv * coef`` (= ``factor``) then, or, with
    ``applied=True`` (the grads were already multiplied), only the skip decision and the norm."""
    if applied:
        one = torch.ones_like(factor)
        runtime(opt).leave(Pending(one, one, found_inf, total_norm * coef, total_norm, inf_norm))
    else:
        runtime(opt).leave(Pending(inv, coef, found_inf, total_norm, total_norm, inf_norm))


def pending(opt: Any) -> Pending | None:
    """The unscale/clip left for ``opt``'s next step (None: none)."""
    rt = runtime(opt)
    return None if rt is None else rt.pending


def process_group(opt: Any) -> Any:
    """The ``process_group`` an optimizer was built with (None: none, or not an mpkern optimizer)."""
    rt = runtime(opt)
    return None if rt is None else rt.process_group


def attach_scaler(opt: Any, scaler: torch.amp.GradScaler) -> None:
    """Remember ``scaler`` (weakly) as the GradScaler that steps ``opt`` (see the module docs)."""
    if not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"attach_grad_scaler: scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
    rt = runtime(opt)
    if rt is not None:
        rt.attach_scaler(scaler)


def record_found_inf(scaler: torch.amp.GradScaler, opt: Any, found_inf: Tensor, *, unscaled: bool) -> None:
    """Record ``found_inf`` in ``scaler`` for ``opt``, so that ``scaler.step`` / ``scaler.update`` see
    it as their own inf check (``unscaled``: and mark ``opt`` unscaled, as ``scaler.unscale_`` does).
    A copy on the scale's device: GradScaler sums other optimizers' flags into these tensors in place."""
    internals = scaler_internals(scaler, opt)
    dev, state = internals.scale.device, internals.optimizer_state
    state["found_inf_per_device"] = {dev: to_device(found_inf, dev).clone() if found_inf.device == dev
                                     else to_device(found_inf, dev)}
    if unscaled:
        from torch.amp.grad_scaler import OptState

        state["stage"] = OptState.UNSCALED


def check_unscale_stage(scaler: torch.amp.GradScaler, opt: Any) -> None:
    """GradScaler's own errors for ``unscale_`` called twice or after ``step`` in one iteration."""
    from torch.amp.grad_scaler import OptState

    stage = scaler_internals(scaler, opt).optimizer_state["stage"]
    if stage is OptState.UNSCALED:
        raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
    if stage is OptState.STEPPED:
        fix = ("scaler.update() was not called after the last scaler.step(optimizer) -- call scaler.update() once "
               "per iteration, after scaler.step(); without it the loss scale never backs off or grows")
        warnings.warn(f"mpkern.unscale_: {fix}", UserWarning, stacklevel=4)
        raise RuntimeError(f"unscale_() is being called after step(): {fix}.")
