"""Host time per tensor of one optimizer step (issue 15's goal: <= 1 us per tensor): many tiny bf16
tensors so that the step is host-bound (Python, dispatch, per-tensor setup), ``FusedAdamWMP`` in
each storage mode beside torch's fused AdamW + foreach ``clip_grad_norm_``; the step cache switched
off through the optimizer's public ``step_cache`` switch, and the parts of a full-path step timed
through :func:`mpkern.optim.step_parts` (the optimizer's own hook, so this module never calls its
private methods)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..measure import sync
from .common import ADAMW_MAX_NORM, best_of, failure, fused_flag, row
from .modes import adamw_modes, mode_label, optimizer_kwargs
from .switches import set_switch


def host_time(device: torch.device | str = "cpu", *, tensors: int = 1000, numel: int = 256, reps: int = 30,
              clip: bool = True, modes: str | list[tuple[Any, str]] = "default",
              breakdown: bool = False) -> dict[str, Any]:
    """Host time of one optimizer step on ``tensors`` tiny bf16 tensors (host-bound: Python,
    dispatch and per-tensor setup, not memory traffic), fastest of ``reps``, in seconds.

    Returns ``{"tensors", "numel", "clip", "mpkern": {mode label: s (or why it failed)}, "torch": s, "breakdown"}``:
    ``FusedAdamWMP.step`` (clipping fused via ``max_grad_norm``) in each mode of :func:`adamw_modes`,
    torch's fused AdamW + foreach ``clip_grad_norm_`` on fp32 copies, and with ``breakdown`` the
    parts of the first mode's full-path step (collect, prepare, kernel call incl. the dispatcher's
    list unpacking; through :func:`mpkern.optim.step_parts`, ``{"error": ...}`` where it cannot
    take the step apart). ``full_path``: (label, s) of the first mode with the step cache off -- what a first
    step, or one after an external write, costs; the cached steps are the ``mpkern`` entries.
    """
    import mpkern

    dev = torch.device(device)
    modes = adamw_modes(modes) if isinstance(modes, str) else list(modes)
    max_norm = ADAMW_MAX_NORM if clip else None
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(numel, generator=g).to(torch.bfloat16).to(dev) for _ in range(tensors)]
    grads = [torch.randn(numel, generator=g).to(torch.bfloat16).to(dev) for _ in range(tensors)]
    out: dict[str, Any] = {"tensors": tensors, "numel": numel, "clip": clip, "mpkern": {}, "breakdown": None}
    first = None
    for mw, sd in modes:
        ps = [torch.nn.Parameter(x.clone()) for x in base]
        for p, x in zip(ps, grads):
            p.grad = x
        opt = mpkern.FusedAdamWMP(ps, lr=1e-3, max_grad_norm=max_norm, **optimizer_kwargs(mw, sd))
        try:
            for _ in range(3):
                opt.step()
            sync(dev)
            out["mpkern"][mode_label(mw, sd)] = best_of(opt.step, reps, dev)
        except Exception as e:  # noqa: BLE001 -- as in bench_adamw_modes
            out["mpkern"][mode_label(mw, sd)] = failure(e)
            continue
        if first is None:
            first = opt
            # the full path (first step, or after a write): the step cache switched off
            set_switch(opt, "step_cache", False)
            out["full_path"] = (mode_label(mw, sd), best_of(opt.step, reps, dev))
            set_switch(opt, "step_cache", True)
    ref_ps = [torch.nn.Parameter(x.float()) for x in base]
    for q, x in zip(ref_ps, grads):
        q.grad = x.float()
    ref = torch.optim.AdamW(ref_ps, lr=1e-3, fused=fused_flag(dev))

    def torch_step() -> None:
        if clip:
            torch.nn.utils.clip_grad_norm_(ref_ps, ADAMW_MAX_NORM, foreach=True)
        ref.step()

    torch_step()
    out["torch"] = best_of(torch_step, reps, dev)
    if breakdown and first is not None:
        out["breakdown"] = _host_breakdown(first, reps, dev)
    return out


def _host_breakdown(opt: Any, reps: int, dev: torch.device) -> dict[str, Any]:
    """Seconds of the parts of a full-path ``opt.step()`` (first bucket), each the fastest of ``reps``,
    through the optimizer's documented hook :func:`mpkern.optim.step_parts`."""
    from .. import optim

    try:
        parts = optim.step_parts(opt)
    except Exception as e:  # noqa: BLE001 -- e.g. a group this hook cannot take apart: said, not raised
        return {"error": failure(e)}
    return {name: best_of(fn, reps, dev) for name, fn in parts.items()}


def bench_host_time(device: torch.device | str = "cpu", *, tensors: int = 1000, numel: int = 256, reps: int = 30,
                    modes: str | list[tuple[Any, str]] = "default",
                    log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """:func:`host_time` (clip on) as table rows: ``rate`` is us per tensor; each mpkern row carries
    its speed over torch's fused AdamW + foreach clip (no byte-model limit: the step is host-bound)."""
    res = host_time(device, tensors=tensors, numel=numel, reps=reps, clip=True, modes=modes)
    what = f"{tensors} bf16 x {numel}, clip on"
    peer = "torch fused AdamW + foreach clip_grad_norm_ (fp32 copies)"
    t_ref = res["torch"]
    rows = []
    for label, t in res["mpkern"].items():
        if isinstance(t, str):  # the mode failed: why
            rows.append(row("adamw", f"host time: FusedAdamWMP {label}: {t}", None, note=t))
            continue
        rows.append(_host_row(f"host time: FusedAdamWMP {label} ({what})", t, tensors, t_ref / t, peer))
    rows.append(_host_row(f"host time: {peer} ({what})", t_ref, tensors))
    log("adamw host time: " + ", ".join(f"{k} {v / tensors * 1e6:.2f} us" if not isinstance(v, str) else f"{k} {v}"
                                        for k, v in res["mpkern"].items())
        + f"; torch {t_ref / tensors * 1e6:.2f} us per tensor")
    return rows


def _host_row(method: str, t: float, tensors: int, ratio: float | None = None, vs: str | None = None) -> dict[str, Any]:
    r = row("adamw", method, t, peer_ratio=ratio, vs=vs, note="host-bound: no byte-model limit" if vs else None)
    r.update(unit="us/tensor", rate=t / tensors * 1e6, tensors=tensors)
    return r
