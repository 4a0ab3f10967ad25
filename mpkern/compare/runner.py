"""The comparison: :func:`run` trains every run and assembles the report."""

from __future__ import annotations

import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from datetime import datetime, timezone
from typing import Any

import torch
from torch import nn

from ..measure import device_info, parse_size
from . import batch as _batch, budget as _budget, probe as _probe
from .config import (
    BF16_RUNS,
    SCHEMA,
    Config,
    check_config,
    default_config,
    default_precisions,
    no_bf16_message,
    split_run,
    with_release,
)
from .memory import OthersCpu
from .report import MEMORY_NOTE, jsonable, lessons, release_vs_regular, write_outputs
from .task import Classifier, HFClassifier, make_task
from .train import train_one


def _resolve(precisions: Sequence[str] | str | None, device: str | torch.device | None, find_batch: bool,
             overrides: dict[str, Any]) -> Config:
    """The checked :class:`Config` of a call of :func:`run`."""
    from .. import bf16_supported

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: CUDA was asked for but torch.cuda.is_available() is False")
    cfg = default_config(dev)
    unknown = set(overrides) - set(Config.__dataclass_fields__) - {"precisions", "device", "skipped_precisions"}
    if unknown:
        raise TypeError(f"run() got unknown settings {sorted(unknown)}")
    if find_batch:  # every batch size trains --steps steps (default 20); no time budget
        overrides = {"steps": FIND_BATCH_STEPS, **overrides, "time_budget": None}
    if "steps" in overrides and "time_budget" not in overrides:
        overrides = dict(overrides, time_budget=None)  # steps asked for: take them as given
    cfg = replace(cfg, **overrides)
    if precisions is None:
        chosen, skipped = default_precisions(dev)
    else:
        chosen = tuple(p.strip() for p in precisions.split(",")) if isinstance(precisions, str) else tuple(precisions)
        skipped = {}
        for p in chosen:
            if split_run(p)[0] in BF16_RUNS and not bf16_supported(dev):
                raise ValueError(f"precision {p}: {no_bf16_message(dev)}")
    if cfg.release:
        chosen = with_release(chosen)
    cfg = replace(cfg, precisions=chosen, skipped_precisions=skipped, device=str(dev))
    check_config(cfg)
    return cfg


#: steps per batch size of ``--find-batch`` unless ``steps`` is given
FIND_BATCH_STEPS = 20


def _base_model(cfg: Config) -> nn.Module:
    vocab = 2 * cfg.classes + 2 + cfg.noise_vocab  # as make_task builds it
    torch.manual_seed(cfg.seed)
    if cfg.hf_model:
        return HFClassifier(cfg.hf_model, vocab, cfg.seq_len, cfg.classes)
    return Classifier(vocab, cfg.seq_len, cfg.d_model, cfg.layers, cfg.heads, cfg.classes)


def _common(cfg: Config, base: nn.Module, dev_info: dict[str, Any], support: dict[str, Any],
            linear_choice: dict[str, Any]) -> dict[str, Any]:
    """The parts of the report every mode has: versions, device, config, task, model."""
    from .. import __version__

    task = make_task(replace(cfg, steps=1, val_size=cfg.val_size))
    return {
        "schema": SCHEMA,
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": {"mpkern": __version__, "torch": torch.__version__, "python": platform.python_version(),
                     "cuda": torch.version.cuda},
        "device": dev_info, "native_compute": support, "linear_choice": linear_choice,
        "config": jsonable(asdict(cfg)),
        "task": {"name": "query-selected colour class", "vocab": task.vocab, "classes": task.classes,
                 "train_sequences": cfg.steps * cfg.batch_size, "val_sequences": len(task.y_val),
                 "chance_acc": 1.0 / task.classes, "ignore_query_ceiling_acc": 0.5,
                 "tokens_per_step": cfg.batch_size * cfg.seq_len},
        "model": {"class": base.model.__class__.__name__ if isinstance(base, HFClassifier) else "Classifier",
                  "params": sum(p.numel() for p in base.parameters())},
        "memory_note": MEMORY_NOTE[torch.device(cfg.device).type == "cuda"],
    }


def _find_batch(cfg: Config, base: nn.Module, support: dict[str, Any], linear_choice: dict[str, Any],
                memory_budget: Any, explicit: bool) -> tuple[Config, dict[str, Any]]:
    """``--find-batch``: the budget, the runs (on a CPU without native bf16 the default leaves out the
    bf16 autocast run: many times slower there), and the scaling curve of each."""
    dev = torch.device(cfg.device)
    budget = parse_size(memory_budget) if memory_budget is not None else _batch.default_budget(dev)
    if not explicit and dev.type == "cpu" and not support.get("bfloat16", {}).get("native", True) \
            and "bf16" in cfg.precisions:
        skipped = dict(cfg.skipped_precisions, bf16="this CPU emulates bf16 GEMMs (see native 16-bit compute): "
                       "autocast bf16 at large batches would take most of the time; ask with --precision")
        cfg = replace(cfg, precisions=tuple(p for p in cfg.precisions if p != "bf16"), skipped_precisions=skipped)
    if cfg.steps < 2:
        raise ValueError(f"steps: --find-batch needs >= 2 steps per batch size (the second is measured), "
                         f"got {cfg.steps}")
    scaling = _batch.find_batch(cfg, base, budget, linear_choice)
    return cfg, {"memory_budget_bytes": budget, "batch_scaling": scaling, "batch_ratio_vs_fp32": _batch.ratios(scaling)}


def _load(dev_info: dict[str, Any], others: OthersCpu) -> None:
    if dev_info["type"] == "cpu":
        dev_info["other_processes_cores"] = others.cores()


# ---- the comparison -----------------------------------------------------------------------------
def run(precisions: Sequence[str] | str | None = None, *, device: str | torch.device | None = None,
        out: str | None = None, progress: bool = True, plot: bool = True, find_batch: bool = False,
        memory_budget: str | int | None = None, doctor: bool = False, **overrides: Any) -> dict[str, Any]:
    """Train every run in ``precisions`` and return the report (also written to ``out``).

    Args:
        precisions: names from :data:`PRECISIONS` (a list or a comma-separated string); ``None``:
            every run the device supports (see :func:`default_precisions`).
        device: ``"cpu"``, ``"cuda"``, ... (default: CUDA if available, else CPU).
        out: directory for ``results.json``, ``results.md`` and ``compare.png`` (None: write nothing).
        progress: show a progress bar per run.
        plot: write ``compare.png`` (needs matplotlib; without it a one-line notice is printed).
        find_batch: instead of the comparison, the batch-size scaling of each run within
            ``memory_budget`` (:mod:`mpkern.compare.batch`; ``results["batch_scaling"]``).
        memory_budget: bytes or a size such as ``"96MiB"`` / ``"20GB"`` (``find_batch``; required on
            CPU, default on CUDA: the device's free memory).
        doctor: also diagnose the model (its initial weights, one validation batch) in each 16-bit run's
            dtype and recipe with :func:`mpkern.diagnose` (``results["doctor"]``, appended to the report).
        **overrides: any field of :class:`Config` (``steps``, ``lr``, ``batch_size``, ``seq_len``,
            ``d_model``, ``layers``, ``heads``, ``seed``, ``optimizer_state``, ``linear``, ...);
            ``release=True`` adds, right after each mpkern run, the same recipe with gradient release
            (``FusedAdamWMP(release_grads=True)`` stepped by ``opt.backward``; named ``<run>+release``),
            ``release_bucket_bytes`` its bucket size (default: the optimizer's).

    Raises ValueError (naming the setting) for bad settings and for bf16 on a GPU without it.
    """
    cfg = _resolve(precisions, device, find_batch, overrides)
    dev = torch.device(cfg.device)
    if find_batch and memory_budget is None and dev.type == "cpu":
        _batch.default_budget(dev)  # raises: CPU needs a budget
    if memory_budget is not None:
        parse_size(memory_budget)  # a bad size fails before any training
    threads_before = torch.get_num_threads()
    try:
        return _run(cfg, precisions is not None, find_batch, memory_budget, out, progress, plot, doctor)
    finally:
        torch.set_num_threads(threads_before)  # choose_threads / --threads set it for the runs only


def _run(cfg: Config, explicit: bool, find_batch: bool, memory_budget: str | int | None, out: str | None,
         progress: bool, plot: bool, doctor: bool = False) -> dict[str, Any]:
    t_all = time.perf_counter()
    dev = torch.device(cfg.device)
    base = _base_model(cfg)
    for p, why in cfg.skipped_precisions.items():
        print(f"[compare] skipping {p}: {why}", flush=True)
    support, linear_choice = _probe.measure_device(cfg, base)
    cfg = replace(cfg, threads=torch.get_num_threads())
    dev_info = device_info(dev)
    if dev.type == "cpu":
        print(f"[compare] threads: {support['threads']['threads']} ({support['threads']['why']})", flush=True)
    for info in linear_choice.values():
        print(f"[compare] --linear auto, {info['dtype']}: {info['chosen']} ({info['why']})", flush=True)
    others = OthersCpu()
    if find_batch:
        cfg, scaling = _find_batch(cfg, base, support, linear_choice, memory_budget, explicit)
        _load(dev_info, others)
        results = _common(cfg, base, dev_info, support, linear_choice) | scaling | {"runs": []}
    else:
        cfg, budget = _budget.fit_budget(cfg, base, linear_choice, support=support)
        if cfg.time_budget is not None:
            print(f"[compare] time budget: {budget['why']}", flush=True)
        task = make_task(cfg)
        runs = [train_one(name, cfg, task, base, progress=progress, linear_choice=linear_choice)
                for name in cfg.precisions]
        ref = next((r for r in runs if r["name"] == "fp32" and r["tokens_per_s"]), None)
        for r in runs:
            if ref and r["tokens_per_s"]:
                r["speedup_vs_fp32"] = r["tokens_per_s"] / ref["tokens_per_s"]
        release_vs_regular(runs)
        from ..plan import plan_table

        _load(dev_info, others)
        results = _common(cfg, base, dev_info, support, linear_choice) | {
            "budget": budget, "runs": runs, "plan": plan_table(runs[0]["params"]) if runs else []}
        results["lessons"] = lessons(results)
        if doctor:
            from .diagnosis import diagnose_compare_runs

            n = min(cfg.batch_size, len(task.y_val))
            recipes = list(dict.fromkeys(split_run(p)[0] for p in cfg.precisions))  # a release run: its recipe's
            results["doctor"] = diagnose_compare_runs(base.to(dev), task.x_val[:n].to(dev), task.y_val[:n].to(dev),
                                                      recipes)
    results["wall_s"] = time.perf_counter() - t_all
    if out is not None:
        write_outputs(results, out, plot=plot)
    return results
