"""The fused-unscale protocol: where ``mpkern.unscale_`` (:mod:`mpkern.amp`) and a fusing optimizer
(``FusedAdamWMP``) meet.

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
warning says that the scale cannot back off. GradScaler's own state is read and written by
:mod:`mpkern._scaler_internals` only.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

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
