"""``FusedAdamWMP``: a drop-in ``torch.optim.AdamW`` for fp16/bf16 models with fp32 master weights.

One fused multi-tensor kernel per (param group, device, master kind) reads the 16-bit grad (or the
fp32 ``main_grad``), multiplies it by ``inv_scale * clip_coef`` in registers, updates the fp32
master (or bf16 param + int16 remainder), ``exp_avg``, ``exp_avg_sq`` and writes the rounded
16-bit param -- 28 B/param for bf16 params with fp32 master and moments. Grads are never
written. Loss-scale, clip coefficient, found_inf, step counters (and lr when it is a tensor) stay
on the device: ``step()`` never synchronises with the host.

The package has the shape of ``torch/optim/adamw.py`` (docs/design.md draws the whole picture):

* :mod:`.adamw_mp`: the optimizer class -- arguments, param groups, lazy state, ``step()``;
* :mod:`.runtime`: what the optimizer keeps between steps (one :class:`~.runtime.Runtime`: stamps,
  offsets, the pending unscale, the step cache) and the cached eager step (re-validated in C++);
* :mod:`.functional`: the fused step over named lists (:func:`~.functional.fused_adamw_mp`);
* :mod:`.buckets`: grads collected and validated, params sorted into kernel buckets, lists prepared;
* :mod:`.storage`: the registry of storage kinds (masters, moments);
* :mod:`.writes`: external writes to params and how the state follows them;
* :mod:`.checkpoint`: load / convert / export, ``adamw_state_dict``, ``master_params``, pickling.
"""

from __future__ import annotations

from . import storage
from .adamw_mp import FusedAdamWMP, step_parts
from .functional import fused_adamw_mp

__all__ = ["FusedAdamWMP", "fused_adamw_mp", "step_parts", "storage"]
