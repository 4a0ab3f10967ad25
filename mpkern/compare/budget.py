"""Fitting the time budget: a measured probe of each run's step time decides the steps."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..measure import sync
from .config import Config
from .recipes import _build
from .task import make_task



# ---- fitting the time budget --------------------------------------------------------------------
_PROBE_WARM, _PROBE_TIMED = 3, 4


def probe_step_seconds(cfg: Config, base: nn.Module,
                       linear_choice: dict[str, dict[str, Any]] | None = None) -> dict[str, float]:
    """Seconds per training step of every run in ``cfg.precisions``, measured on this device:
    3 untimed and 4 timed steps of a throwaway copy of each recipe (same model, batch, linear path)."""
    device = torch.device(cfg.device)
    task = make_task(replace(cfg, steps=_PROBE_WARM + _PROBE_TIMED, val_size=1))
    x_all, y_all, bsz = task.x_train.to(device), task.y_train.to(device), cfg.batch_size
    out = {}
    for name in cfg.precisions:
        r = _build(name, cfg, base, device, linear_choice)
        t0 = time.perf_counter()
        for i in range(_PROBE_WARM + _PROBE_TIMED):
            if i == _PROBE_WARM:
                sync(device)
                t0 = time.perf_counter()
            r.step(x_all[i * bsz:(i + 1) * bsz], y_all[i * bsz:(i + 1) * bsz])
        sync(device)
        out[name] = (time.perf_counter() - t0) / _PROBE_TIMED
        del r
    return out


#: a run whose probed step takes at least this many times fp32's is time-boxed (see :func:`fit_budget`)
TIME_BOX_SLOWER = 4.0
#: seconds of training a time-boxed run gets (its tokens/s are measured over them)
TIME_BOX_S = 10.0
#: untimed first steps of a time-boxed run (its steps are slow: few are enough to warm up)
TIME_BOX_WARMUP = 3


def steps_that_fit(step_s: dict[str, float], cfg: Config, reserved_s: float = 0.0) -> tuple[int, float]:
    """How many steps (a multiple of ``log_every``) all runs together can take in ``cfg.time_budget``
    seconds (less ``reserved_s``) at the measured seconds per step, and the validation seconds set
    aside for that (forward passes over ``val_size`` sequences: about a third of a step's time per token)."""
    per_step = sum(step_s.values())
    eval_s = per_step * cfg.val_size / cfg.batch_size / 3
    fit = (cfg.time_budget - reserved_s - eval_s) / per_step if per_step > 0 else math.inf
    return max(0, int(min(fit, 1e9) // cfg.log_every * cfg.log_every)), eval_s


def time_boxes(step_s: dict[str, float]) -> dict[str, dict[str, Any]]:
    """The runs this device makes many times slower than fp32 (the fastest run without fp32):
    ``{name: {"window_s", "slower", "why"}}`` for each whose probed step takes >= :data:`TIME_BOX_SLOWER`
    times the reference's."""
    if len(step_s) < 2:
        return {}
    ref_name = "fp32" if "fp32" in step_s else min(step_s, key=step_s.get)
    ref = step_s[ref_name]
    out = {}
    for name, s in step_s.items():
        if name != ref_name and ref > 0 and s >= TIME_BOX_SLOWER * ref:
            out[name] = {"window_s": TIME_BOX_S, "slower": s / ref,
                         "why": (f"the probe measured its step {s / ref:.0f}x slower than {ref_name}'s on this "
                                 f"device ({1e3 * s:.0f} vs {1e3 * ref:.0f} ms): trained for {TIME_BOX_S:g} s only")}
    return out


def fit_budget(cfg: Config, base: nn.Module, linear_choice: dict[str, dict[str, Any]] | None = None, *,
               probe: Callable[..., dict[str, float]] = probe_step_seconds) -> tuple[Config, dict[str, Any]]:
    """Choose the steps so that all runs fit ``cfg.time_budget`` seconds on this device.

    A run the device makes :data:`TIME_BOX_SLOWER` times slower than fp32 or more (e.g. PyTorch's
    bf16 autocast on a CPU whose bf16 GEMM is emulated) is *time-boxed*: it trains for
    :data:`TIME_BOX_S` seconds (``cfg.time_box``), its speed measured over them, its loss and accuracy
    those of the step it reached. The other runs share the rest: ``cfg.steps`` at most; fewer when
    the measured step times say they do not fit, but never fewer than ``cfg.min_steps`` -- the
    master-weight lesson needs steps (Adam moves a weight by about lr per step; the default model
    learns the task in ~800), so a device too slow for the budget takes longer and the report says
    so. Returns the new config and what was measured and decided.
    """
    if cfg.time_budget is None:
        return cfg, {"time_budget_s": None, "why": "no time budget: the configured steps"}
    step_s = probe(cfg, base, linear_choice)
    boxes = time_boxes(step_s)
    full = {k: v for k, v in step_s.items() if k not in boxes}
    reserved = sum(b["window_s"] for b in boxes.values())
    fit, eval_s = steps_that_fit(full, cfg, reserved)
    steps = min(cfg.steps, max(fit, cfg.min_steps))
    per_step = sum(full.values())
    measured = f"measured {per_step * 1e3:.0f} ms per step of all runs together"
    if boxes:
        measured += f" ({', '.join(boxes)} time-boxed: {reserved:g} s)"
    if steps == cfg.steps:
        why = f"{steps} steps fit ({measured})"
    elif steps == fit:
        why = f"{cfg.steps} steps would not fit ({measured}): {steps} steps"
    else:
        why = (f"{cfg.steps} steps would not fit ({measured}): {steps} steps, the fewest that show the lesson "
               f"(predicted {per_step * steps + eval_s + reserved:.0f} s, over the budget)")
    plan = {"time_budget_s": cfg.time_budget, "step_s": step_s, "steps_that_fit": fit, "steps": steps,
            "predicted_s": per_step * steps + eval_s + reserved, "time_boxed": boxes, "why": why}
    return replace(cfg, steps=steps, time_box={k: b["window_s"] for k, b in boxes.items()}), plan
