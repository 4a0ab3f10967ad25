"""The op layer: ``torch.ops.mpkern.*`` schemas, fake kernels, and backend routing.

* ``torch.ops.mpkern.<op>`` -- schema from the native extension's ``TORCH_LIBRARY(mpkern)``
  with its CPU and CUDA kernels. When the extension cannot be loaded, the same schemas are
  defined here and the pure-PyTorch reference is registered for them, so the op always exists.
* ``torch.ops.mpkern_triton.<op>`` -- the Triton kernels behind the same schema (a separate
  namespace, because one dispatch key can hold only one kernel per op).
* Fake (meta) kernels for all of them, so ``torch.compile`` and ``opcheck`` work.

The public API calls :func:`grad_stats` / :func:`scale_` here with the backend chosen by
:mod:`mpkern._backend`; nothing below this module calls back up.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _backend, reference

Tensor = torch.Tensor

_ADAMW_SCHEMA = (
    "adamw_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
    "Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] masters, Tensor(f!)[] steps, Tensor grad_factor, "
    "Tensor found_inf, Tensor? lr_tensor, float lr, float beta1, float beta2, float eps, float weight_decay, "
    "bool maximize, int master_mode, bool stochastic_rounding, int seed) -> ()")
_SCHEMAS = {
    "grad_stats": "grad_stats(Tensor[] grads, Tensor inv_scale) -> (Tensor sumsq, Tensor amax)",
    "scale_": "scale_(Tensor(a!)[] tensors, Tensor scale) -> ()",
    "adamw_step_": _ADAMW_SCHEMA,
}

_libs: list[torch.library.Library] = []  # keep registrations alive


def _define_fallback_schemas() -> None:
    """Without the native extension, define the mpkern schemas here with reference kernels."""
    lib = torch.library.Library("mpkern", "DEF")
    for schema in _SCHEMAS.values():
        lib.define(schema)
    for key in ("CPU", "CUDA"):
        lib.impl("grad_stats", lambda grads, inv_scale: reference.grad_stats(grads, inv_scale), key)
        lib.impl("scale_", lambda tensors, scale: reference.scale_(tensors, scale), key)
        lib.impl("adamw_step_", reference.adamw_step_, key)
    _libs.append(lib)


if _backend.native() is None:
    _define_fallback_schemas()


def _fake_grad_stats(grads: Sequence[Tensor], inv_scale: Tensor) -> tuple[Tensor, Tensor]:
    for g in grads:
        torch._check(g.dtype in (torch.float32, torch.float16, torch.bfloat16),
                     lambda: f"grad_stats: grads must be float32/float16/bfloat16, got {g.dtype}")
    n = len(grads)
    return inv_scale.new_empty(n, dtype=torch.float32), inv_scale.new_empty(n, dtype=torch.float32)


def _fake_scale_(tensors: Sequence[Tensor], scale: Tensor) -> None:
    return None


def _fake_adamw_step_(*args, **kwargs) -> None:
    return None


torch.library.register_fake("mpkern::grad_stats")(_fake_grad_stats)
torch.library.register_fake("mpkern::scale_")(_fake_scale_)
torch.library.register_fake("mpkern::adamw_step_")(_fake_adamw_step_)


# ---- Triton ops ---------------------------------------------------------------------------------
@torch.library.custom_op("mpkern_triton::grad_stats", mutates_args=())
def _triton_grad_stats(grads: list[Tensor], inv_scale: Tensor) -> tuple[Tensor, Tensor]:
    from mpkern.triton_kernels import unscale

    return unscale.grad_stats(grads, inv_scale)


@torch.library.custom_op("mpkern_triton::scale_", mutates_args=("tensors",))
def _triton_scale_(tensors: list[Tensor], scale: Tensor) -> None:
    from mpkern.triton_kernels import unscale

    unscale.scale_(tensors, scale)


_triton_grad_stats.register_fake(_fake_grad_stats)
_triton_scale_.register_fake(_fake_scale_)

_triton_lib = torch.library.Library("mpkern_triton", "FRAGMENT")
_triton_lib.define(_ADAMW_SCHEMA)
_libs.append(_triton_lib)


def _triton_adamw_step_(*args) -> None:
    from mpkern.triton_kernels import adamw

    adamw.adamw_step_(*args)


for _key in ("CPU", "CUDA"):
    _triton_lib.impl("adamw_step_", _triton_adamw_step_, _key)
torch.library.register_fake("mpkern_triton::adamw_step_")(_fake_adamw_step_)


# ---- routing ------------------------------------------------------------------------------------
def grad_stats(grads: Sequence[Tensor], inv_scale: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    """Run the statistics pass on ``backend`` (see :func:`mpkern.reference.grad_stats`)."""
    if backend in ("cpu", "cuda"):
        return torch.ops.mpkern.grad_stats(list(grads), inv_scale)
    if backend == "triton":
        return torch.ops.mpkern_triton.grad_stats(list(grads), inv_scale)
    return reference.grad_stats(grads, inv_scale)


def adamw_step_(backend: str, *args) -> None:
    """Run the fused AdamW step on ``backend``; ``args`` follow the ``adamw_step_`` schema."""
    if backend in ("cpu", "cuda"):
        torch.ops.mpkern.adamw_step_(*args)
    elif backend == "triton":
        torch.ops.mpkern_triton.adamw_step_(*args)
    else:
        reference.adamw_step_(*args)


def scale_(tensors: Sequence[Tensor], scale: Tensor, backend: str) -> None:
    """Multiply every tensor in place by the one-element fp32 ``scale`` on ``backend``."""
    if backend in ("cpu", "cuda"):
        torch.ops.mpkern.scale_(list(tensors), scale)
    elif backend == "triton":
        torch.ops.mpkern_triton.scale_(list(tensors), scale)
    else:
        reference.scale_(tensors, scale)
