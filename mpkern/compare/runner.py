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

from ..measure import device_info
from . import budget as _budget
from . import probe as _probe
from .config import SCHEMA, Config, _check, _no_bf16_message, default_config, default_precisions
from .memory import _OthersCpu
from .report import _MEMORY_NOTE, _jsonable, lessons, write_outputs
from .task import Classifier, HFClassifier, make_task
from .train import train_one



# ---- the comparison -----------------------------------------------------------------------------
def run(precisions: Sequence[str] | str | None = None, *, device: str | torch.device | None = None,
        out: str | None = None, progress: bool = True, plot: bool = True, **overrides: Any) -> dict[str, Any]:
    """Train every run in ``precisions`` and return the report (also written to ``out``).

    Args:
        precisions: names from :data:`PRECISIONS` (a list or a comma-separated string); ``None``:
            every run the device supports (see :func:`default_precisions`).
        device: ``"cpu"``, ``"cuda"``, ... (default: CUDA if available, else CPU).
        out: directory for ``results.json``, ``results.md`` and ``compare.png`` (None: write nothing).
        progress: show a progress bar per run.
        plot: write ``compare.png`` (needs matplotlib; without it a one-line notice is printed).
        **overrides: any field of :class:`Config` (``steps``, ``lr``, ``batch_size``, ``seq_len``,
            ``d_model``, ``layers``, ``heads``, ``seed``, ``optimizer_state``, ``linear``, ...).

    Raises ValueError (naming the setting) for bad settings and for bf16 on a GPU without it.
    """
    from .. import __version__, bf16_supported

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: CUDA was asked for but torch.cuda.is_available() is False")
    cfg = default_config(dev)
    unknown = set(overrides) - set(Config.__dataclass_fields__) - {"precisions", "device", "skipped_precisions"}
    if unknown:
        raise TypeError(f"run() got unknown settings {sorted(unknown)}")
    if "steps" in overrides and "time_budget" not in overrides:
        overrides = dict(overrides, time_budget=None)  # steps asked for: take them as given
    cfg = replace(cfg, **overrides)
    if precisions is None:
        chosen, skipped = default_precisions(dev)
    else:
        chosen = tuple(p.strip() for p in precisions.split(",")) if isinstance(precisions, str) else tuple(precisions)
        skipped = {}
        for p in chosen:
            if "bf16" in p and not bf16_supported(dev):
                raise ValueError(f"precision {p}: {_no_bf16_message(dev)}")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    cfg = replace(cfg, precisions=chosen, skipped_precisions=skipped, device=str(dev),
                  threads=torch.get_num_threads())
    _check(cfg)
    t_all = time.perf_counter()
    dev_info = device_info(dev)
    vocab = 2 * cfg.classes + 2 + cfg.noise_vocab  # as make_task builds it
    torch.manual_seed(cfg.seed)
    if cfg.hf_model:
        base: nn.Module = HFClassifier(cfg.hf_model, vocab, cfg.seq_len, cfg.classes)
    else:
        base = Classifier(vocab, cfg.seq_len, cfg.d_model, cfg.layers, cfg.heads, cfg.classes)
    for p, why in skipped.items():
        print(f"[compare] skipping {p}: {why}", flush=True)
    support, linear_choice = _probe.measure_device(cfg, base)
    for info in linear_choice.values():
        print(f"[compare] --linear auto, {info['dtype']}: {info['chosen']} ({info['why']})", flush=True)
    cfg, budget = _budget.fit_budget(cfg, base, linear_choice)
    if cfg.time_budget is not None:
        print(f"[compare] time budget: {budget['why']}", flush=True)
    task = make_task(cfg)
    others = _OthersCpu()
    runs = [train_one(name, cfg, task, base, progress=progress, linear_choice=linear_choice)
            for name in cfg.precisions]
    if dev.type == "cpu":
        dev_info["other_processes_cores"] = others.cores()
    ref = next((r for r in runs if r["name"] == "fp32" and r["tokens_per_s"]), None)
    for r in runs:
        if ref and r["tokens_per_s"]:
            r["speedup_vs_fp32"] = r["tokens_per_s"] / ref["tokens_per_s"]
    from ..plan import plan_table

    results = {
        "schema": SCHEMA,
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": {"mpkern": __version__, "torch": torch.__version__, "python": platform.python_version(),
                     "cuda": torch.version.cuda},
        "device": dev_info,
        "native_compute": support,
        "linear_choice": linear_choice,
        "budget": budget,
        "config": _jsonable(asdict(cfg)),
        "task": {"name": "query-selected colour class", "vocab": task.vocab, "classes": task.classes,
                 "train_sequences": len(task.y_train), "val_sequences": len(task.y_val),
                 "chance_acc": 1.0 / task.classes, "ignore_query_ceiling_acc": 0.5,
                 "tokens_per_step": cfg.batch_size * cfg.seq_len},
        "model": {"class": base.model.__class__.__name__ if isinstance(base, HFClassifier) else "Classifier",
                  "params": sum(p.numel() for p in base.parameters())},
        "memory_note": _MEMORY_NOTE[dev.type == "cuda"],
        "runs": runs,
        "plan": plan_table(runs[0]["params"]) if runs else [],
    }
    results["lessons"] = lessons(results)
    results["wall_s"] = time.perf_counter() - t_all
    if out is not None:
        write_outputs(results, out, plot=plot)
    return results
