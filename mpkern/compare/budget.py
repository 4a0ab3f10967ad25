"""Fitting the time budget: a measured probe of each run's step time decides the steps."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..measure import sync
from .config import DTYPE_NAME, Config
from .recipes import build_recipe
from .task import make_task

# ---- fitting the time budget --------------------------------------------------------------------
_PROBE_WARM, _PROBE_TIMED = 3, 5
#: seconds of timed probe steps after which a (slow) run is timed no more
_PROBE_CAP_S = 1.5


def probe_step_seconds(cfg: Config, base: nn.Module,
                       linear_choice: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, float]]:
    """Seconds per training step of every run in ``cfg.precisions`` (``{"median", "min"}``), measured on this device: a
    throwaway copy of each recipe (same model, batch, linear path), 3 untimed steps each, then up to 5
    timed rounds in which every run takes one step in turn (a burst of load on a shared machine hits
    every run alike); the median of each run's timed steps (what the budget plans with) and the
    fastest (what ratios between runs are decided on: a burst of load cannot make a run's fastest
    step slow); a run past 1.5 s of timed steps is timed no more (a slow path needs no precise number)."""
    device = torch.device(cfg.device)
    task = make_task(replace(cfg, steps=_PROBE_WARM + _PROBE_TIMED, val_size=1))
    x_all, y_all, bsz = task.x_train.to(device), task.y_train.to(device), cfg.batch_size
    recipes = {name: build_recipe(name, cfg, base, device, linear_choice) for name in cfg.precisions}
    for i in range(_PROBE_WARM):
        for r in recipes.values():
            r.step(x_all[i * bsz:(i + 1) * bsz], y_all[i * bsz:(i + 1) * bsz])
    times: dict[str, list[float]] = {name: [] for name in recipes}
    for i in range(_PROBE_WARM, _PROBE_WARM + _PROBE_TIMED):
        for name, r in recipes.items():
            if sum(times[name]) > _PROBE_CAP_S:
                continue
            sync(device)
            t0 = time.perf_counter()
            r.step(x_all[i * bsz:(i + 1) * bsz], y_all[i * bsz:(i + 1) * bsz])
            sync(device)
            times[name].append(time.perf_counter() - t0)
    del recipes
    return {name: {"median": statistics.median(ts), "min": min(ts)} for name, ts in times.items()}


#: a run whose probed step takes at least this many times fp32's is time-boxed (see :func:`fit_budget`)
TIME_BOX_SLOWER = 4.0
#: seconds of training a time-boxed run gets (its tokens/s are measured over them)
TIME_BOX_S = 10.0
#: untimed first steps of a time-boxed run (its steps are slow: few are enough to warm up)
TIME_BOX_WARMUP = 3


def emulated_runs(cfg: Config, support: dict[str, Any] | None,
                  linear_choice: dict[str, dict[str, Any]] | None = None) -> dict[str, str]:
    """The runs whose GEMMs are ATen's 16-bit ones on a CPU the native-compute probe found emulating
    that dtype: ``{name: why}``. PyTorch's autocast runs always use ATen's GEMM; a 16-bit-param run
    does unless it took mpkern's fp32-GEMM path (``--linear``). Decided from the probe's ratio
    (emulated 0.02-0.5x of fp32, native >= 1x: far from :data:`.probe.NATIVE_MIN_SPEED`), not from a
    step time that load can disturb."""
    from .recipes import param_dtype, use_mpkern_linear

    dev = torch.device(cfg.device)
    if dev.type != "cpu" or not support:
        return {}
    out = {}
    for name in cfg.precisions:
        if name in ("bf16", "fp16"):
            dt = torch.bfloat16 if name == "bf16" else torch.float16
        elif name != "fp32" and not use_mpkern_linear(cfg, param_dtype(name), dev, linear_choice):
            dt = param_dtype(name)
        else:
            continue
        probe = support.get(DTYPE_NAME[dt]) or {}
        if probe and not probe.get("native", True):
            out[name] = (f"its GEMMs are ATen's {DTYPE_NAME[dt]} ones, which the native-compute probe measured at "
                         f"{probe['speed_vs_fp32']:.2f}x of fp32 on this CPU (emulated)")
    return out


def steps_that_fit(step_s: dict[str, float], cfg: Config, reserved_s: float = 0.0) -> tuple[int, float]:
    """How many steps (a multiple of ``log_every``) all runs together can take in ``cfg.time_budget``
    seconds (less ``reserved_s``) at the measured seconds per step, and the validation seconds set
    aside for that (forward passes over ``val_size`` sequences: about a third of a step's time per token)."""
    per_step = sum(step_s.values())
    eval_s = per_step * cfg.val_size / cfg.batch_size / 3
    budget = cfg.time_budget
    if budget is None:
        raise ValueError("steps_that_fit needs a cfg.time_budget")
    fit = (budget - reserved_s - eval_s) / per_step if per_step > 0 else math.inf
    return max(0, int(min(fit, 1e9) // cfg.log_every * cfg.log_every)), eval_s


def time_boxes(step_s: dict[str, float], emulated: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """The runs to time-box: ``{name: {"window_s", "slower", "why"}}`` for each that ``emulated``
    names (:func:`emulated_runs`) and each whose probed step takes >= :data:`TIME_BOX_SLOWER` times
    the reference's (fp32, else the fastest run)."""
    emulated = emulated or {}
    if len(step_s) < 2 and not emulated:
        return {}
    ref_name = "fp32" if "fp32" in step_s else min(step_s, key=step_s.__getitem__)
    ref = step_s[ref_name]
    out = {}
    for name, s in step_s.items():
        if name == ref_name or ref <= 0:
            continue
        measured = (f"the probe measured its fastest step {s / ref:.1f}x slower than {ref_name}'s ({1e3 * s:.0f} vs "
                    f"{1e3 * ref:.0f} ms)")
        if name in emulated:
            why = f"{emulated[name]}; {measured}"
        elif s >= TIME_BOX_SLOWER * ref:
            why = f"{measured} on this device"
        else:
            continue
        out[name] = {"window_s": TIME_BOX_S, "slower": s / ref, "why": f"{why}: trained for {TIME_BOX_S:g} s only"}
    return out


def fit_budget(cfg: Config, base: nn.Module, linear_choice: dict[str, dict[str, Any]] | None = None, *,
               support: dict[str, Any] | None = None,
               probe: Callable[..., Mapping[str, dict[str, float] | float]] = probe_step_seconds,
               ) -> tuple[Config, dict[str, Any]]:
    """Choose the steps so that all runs fit ``cfg.time_budget`` seconds on this device.

    A run whose GEMMs the native-compute probe (``support``) found emulated on this CPU (e.g.
    PyTorch's bf16 autocast without AVX512-BF16: :func:`emulated_runs`), or that the step probe
    measures :data:`TIME_BOX_SLOWER` times slower than fp32 or more, is *time-boxed*: it trains for
    :data:`TIME_BOX_S` seconds (``cfg.time_box``), its speed measured over them, its loss and accuracy
    those of the step it reached. The other runs share the rest: ``cfg.steps`` at most; fewer when
    the measured step times say they do not fit, but never fewer than ``cfg.min_steps`` -- the
    master-weight lesson needs steps (Adam moves a weight by about lr per step; the default model
    learns the task in ~800), so a device too slow for the budget takes longer and the report says
    so. Returns the new config and what was measured and decided.
    """
    if cfg.time_budget is None:
        return cfg, {"time_budget_s": None, "why": "no time budget: the configured steps"}
    probed = probe(cfg, base, linear_choice)
    step_s = {k: v["median"] if isinstance(v, dict) else v for k, v in probed.items()}
    fastest = {k: v["min"] if isinstance(v, dict) else v for k, v in probed.items()}
    boxes = time_boxes(fastest, emulated_runs(cfg, support, linear_choice))
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
    plan = {"time_budget_s": cfg.time_budget, "step_s": step_s, "fastest_step_s": fastest, "steps_that_fit": fit,
            "steps": steps, "predicted_s": per_step * steps + eval_s + reserved, "time_boxed": boxes, "why": why}
    return replace(cfg, steps=steps, time_box={k: b["window_s"] for k, b in boxes.items()}), plan
