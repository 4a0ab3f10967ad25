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


def steps_that_fit(step_s: dict[str, float], cfg: Config) -> tuple[int, float]:
    """How many steps (a multiple of ``log_every``) all runs together can take in ``cfg.time_budget``
    seconds at the measured seconds per step, and the validation seconds set aside for that
    (forward passes over ``val_size`` sequences: about a third of a step's time per token)."""
    per_step = sum(step_s.values())
    eval_s = per_step * cfg.val_size / cfg.batch_size / 3
    fit = (cfg.time_budget - eval_s) / per_step if per_step > 0 else math.inf
    return max(0, int(min(fit, 1e9) // cfg.log_every * cfg.log_every)), eval_s


def fit_budget(cfg: Config, base: nn.Module, linear_choice: dict[str, dict[str, Any]] | None = None, *,
               probe: Callable[..., dict[str, float]] = probe_step_seconds) -> tuple[Config, dict[str, Any]]:
    """Choose the steps so that all runs fit ``cfg.time_budget`` seconds on this device.

    ``cfg.steps`` is the most; fewer when the measured step times say they do not fit, but never
    fewer than ``cfg.min_steps`` -- the master-weight lesson needs steps (Adam moves a weight by
    about lr per step; the default model learns the task in ~800), so a device too slow for the
    budget takes longer and the report says so. (A smaller batch would not help: it learns less
    per step.) Returns the new config and what was measured and decided.
    """
    if cfg.time_budget is None:
        return cfg, {"time_budget_s": None, "why": "no time budget: the configured steps"}
    step_s = probe(cfg, base, linear_choice)
    fit, eval_s = steps_that_fit(step_s, cfg)
    steps = min(cfg.steps, max(fit, cfg.min_steps))
    per_step = sum(step_s.values())
    measured = f"measured {per_step * 1e3:.0f} ms per step of all runs together"
    if steps == cfg.steps:
        why = f"{steps} steps fit ({measured})"
    elif steps == fit:
        why = f"{cfg.steps} steps would not fit ({measured}): {steps} steps"
    else:
        why = (f"{cfg.steps} steps would not fit ({measured}): {steps} steps, the fewest that show the lesson "
               f"(predicted {per_step * steps + eval_s:.0f} s, over the budget)")
    plan = {"time_budget_s": cfg.time_budget, "step_s": step_s, "steps_that_fit": fit, "steps": steps,
            "predicted_s": per_step * steps + eval_s, "why": why}
    return replace(cfg, steps=steps), plan
