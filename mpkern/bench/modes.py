"""``FusedAdamWMP`` in its storage modes (master kind x moment kind) on the AdamW benchmark's problem.

Which modes exist, what they are called, the words a user may type for them, the state they keep
and whether the step reads the param come from the optimizer's storage-kind registry
(:mod:`mpkern.optim.storage`); this module names no kind itself, so a newly registered kind shows
up in ``--modes all`` and its table rows without an edit here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import _backend, bytemodel
from ..measure import measure_bandwidth, time_alternating, time_fn
from ..optim import storage
from .common import (
    ADAMW_INV_SCALE,
    ADAMW_LR,
    ADAMW_MAX_NORM,
    BASELINE,
    FULL,
    adamw_problem,
    amp_fp32_recipe,
    failure,
    row,
    state_nbytes,
    tensor_sizes,
)

#: the headline modes of issue 15, as ``(master_weights, state_dtype)`` values (the registry's
#: list); those whose kinds this build lacks are left out by :func:`adamw_modes`
DEFAULT_ADAMW_MODES: tuple[tuple[Any, str], ...] = tuple(storage.DEFAULT_MODES)


def adamw_modes(which: str | None = "default") -> list[tuple[Any, str]]:
    """The ``(master_weights, state_dtype)`` pairs the compact-mode rows run: ``"default"``
    (:data:`DEFAULT_ADAMW_MODES`), ``"all"`` (every registered master kind x moment kind for bf16
    params), ``"none"``, or a comma list of ``master:moments`` in the words the storage registry
    reads (:func:`mpkern.optim.storage.parse_master` / :func:`~mpkern.optim.storage.parse_moments`:
    e.g. ``remainder:bf16``, ``8bit:8bit``, ``none:fp32``)."""
    if which in (None, "none", ""):
        return []
    every = storage.modes(torch.bfloat16)
    if which == "default":
        return [m for m in DEFAULT_ADAMW_MODES if m in every]
    if which == "all":
        return every
    out = []
    for item in which.split(","):
        try:
            out.append(storage.parse_mode(item))
        except ValueError as e:
            raise ValueError(f"adamw mode {item!r}: want master:moments ({e}), or 'default', 'all', 'none'") from None
    return out


def mode_label(master_weights: Any, state_dtype: str) -> str:
    """The words of the tables for a mode (the registry's :func:`mpkern.optim.storage.label`):
    ``"remainder + bf16 moments"``."""
    return storage.label(master_weights, state_dtype)


def optimizer_kwargs(master_weights: Any, state_dtype: str) -> dict[str, Any]:
    """``FusedAdamWMP`` keywords of a mode: its two values, and stochastic rounding where the master
    kind rounds the params itself (the kind says so: no master, the only way a bf16 param without
    one keeps small updates)."""
    master = storage.check_master_weights(master_weights)
    return {"master_weights": master_weights, "state_dtype": state_dtype,
            "stochastic_rounding": master.stochastic_rounding}


def step_bytes_per_param(master_weights: Any, state_dtype: Any, param_dtype: torch.dtype = torch.bfloat16,
                         grad_dtype: torch.dtype = torch.bfloat16, *, clip: bool = True,
                         amsgrad: bool = False) -> float:
    """Bytes one loss-scaled, clipped ``FusedAdamWMP`` step moves per param in a storage mode.

    :mod:`mpkern.bytemodel` has this only for the fp32 mode (``STEP_TRAFFIC["mpkern"]``, 30), so it
    is computed here -- in this one helper -- from the storage descriptions (the state bytes the
    optimizer allocates, :func:`mpkern.optim.storage.bytes_per_param`, and whether the step reads
    the 16-bit param, ``MasterKind.reads_param``) and the param/grad sizes: the read-only
    clip/unscale pre-pass reads the grad (``clip``), then the fused step reads the grad, reads and
    writes all of the state, writes the param, and reads the param too unless the master holds the
    whole value. fp32 + fp32 gives 30 = ``STEP_TRAFFIC["mpkern"]``; 8-bit master + 8-bit moments
    2 x 7.125 = 14.25 (DESIGN.md).
    """
    kind = storage.master_kind(master_weights, param_dtype)
    state = storage.bytes_per_param(master_weights, state_dtype, param_dtype, amsgrad=amsgrad)
    p, g = param_dtype.itemsize, grad_dtype.itemsize
    param_rw = 2 * p if kind.reads_param else p
    return (g if clip else 0) + g + param_rw + 2 * state


def bench_adamw_modes(device: torch.device | str, *, params: int = FULL["params"], tensors: int = FULL["tensors"],
                      reps: int = 10, modes: str | list[tuple[Any, str]] = "default",
                      bandwidth: dict[str, float] | None = None, baseline_s: float | None = None,
                      log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """``mpkern.unscale_`` + ``FusedAdamWMP.step`` on bf16 params in each compact storage mode
    (:func:`adamw_modes`), the same problem as :func:`bench_adamw`.

    Each row: time, the bytes the step moves (:func:`step_bytes_per_param`), GB/s and its share of
    the measured in-place bandwidth (read + write, like the step; the bound the other AdamW rows
    use), the resident optimizer-state bytes/param (the storage descriptions; the tensors' own
    count is ``state_bytes_measured``), and the speed ratio over the baseline
    (:func:`amp_fp32_recipe`) beside its byte-model limit 48 / bytes moved. Unless ``baseline_s`` is
    given, the baseline is timed in alternation with each mode (:func:`time_alternating`, its median
    in the row as ``baseline_ms``), so the ratio holds on a shared machine whose speed drifts
    between separate runs. A master kind that keeps no master runs with stochastic rounding
    (:func:`optimizer_kwargs`: the only way a bf16 param without a master keeps small updates). As in
    :func:`bench_adamw` the grads are only read (the unscale is deferred into the step), so nothing is restored.
    """
    import mpkern

    dev = torch.device(device)
    modes = adamw_modes(modes) if isinstance(modes, str) else list(modes)
    if not modes:
        return []
    bw = bandwidth or measure_bandwidth(dev)
    inplace_bw = bw.get("inplace_GBps")  # the step updates its state in place, like the baseline's rows
    grads16, init = adamw_problem(dev, tensor_sizes(params, tensors))
    inv = torch.tensor(ADAMW_INV_SCALE, device=dev)
    base_bpp = bytemodel.STEP_TRAFFIC["amp_fp32"]
    step_a = restore_a = None
    if baseline_s is None:
        step_a, restore_a, _ = amp_fp32_recipe(init, grads16, inv)
    rows = []
    for mw, sd in modes:
        ps = [torch.nn.Parameter(w.to(torch.bfloat16)) for w in init]
        for p, x in zip(ps, grads16):
            p.grad = x
        opt = mpkern.FusedAdamWMP(ps, lr=ADAMW_LR, **optimizer_kwargs(mw, sd))

        def fused(opt: torch.optim.Optimizer = opt) -> None:
            mpkern.unscale_(opt, inv, max_norm=ADAMW_MAX_NORM)  # deferred into the step: grads are only read
            opt.step()

        bpp = step_bytes_per_param(mw, sd)
        state_model = storage.bytes_per_param(mw, sd, torch.bfloat16)
        label = mode_label(mw, sd)
        try:
            if baseline_s is not None:
                t, base_t = time_fn(fused, dev, reps=reps), baseline_s
            else:  # the baseline beside this mode, round by round
                assert step_a is not None and restore_a is not None  # built above when no baseline_s is given
                t, base_t = time_alternating([(fused, None), (step_a, restore_a)], dev, reps=reps)
        except Exception as e:  # noqa: BLE001 -- e.g. a Python storage kind ahead of the built kernels
            why = failure(e)
            log(f"adamw {label}: {why}")
            rows.append(row("adamw", f"FusedAdamWMP {label}: {why}", None, bpp=bpp, state_bpp=state_model,
                            note=why) | {"master_weights": mw, "state_dtype": sd})
            del opt, ps, fused
            continue
        vs = BASELINE if baseline_s is not None else f"{BASELINE} ({base_t * 1e3:.1f} ms, timed in alternation)"
        r = row("adamw", f"FusedAdamWMP {label} ({_backend.select(dev)})", t, bpp=bpp, params=params,
                bw=inplace_bw, peer_ratio=base_t / t,
                limit=bytemodel.limit(base_bpp, bpp), state_bpp=state_model, vs=vs)
        r.update(master_weights=mw, state_dtype=sd, state_bytes_measured=state_nbytes(opt) / params,
                 baseline_ms=base_t * 1e3)
        rows.append(r)
        log(f"adamw {label}: {t * 1e3:.2f} ms, {bpp:g} B/param moved, state {state_model:g} B/param, "
            f"{base_t / t:.2f}x the AMP fp32 recipe at {base_t * 1e3:.2f} ms (limit {base_bpp / bpp:.2f}x)")
        del opt, ps, fused
    return rows
