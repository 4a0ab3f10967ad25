"""``mpkern compare``'s side of the doctor: its classifier as a case for ``mpkern doctor --model compare``,
and ``mpkern compare --doctor`` (the compare model diagnosed in each 16-bit run's dtype and recipe)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..doctor import diagnose
from ..doctor.case import Case
from .config import default_config
from .task import Classifier, make_task

Tensor = torch.Tensor


def compare_case(device: str = "cpu", seed: int = 0) -> Case:
    """The built-in ``mpkern compare`` classifier (default CPU size) on a batch of its task."""
    cfg = default_config("cpu")
    cfg.steps, cfg.val_size, cfg.seed = 1, cfg.batch_size, seed
    task = make_task(cfg)
    torch.manual_seed(seed)
    model = Classifier(task.vocab, cfg.seq_len, cfg.d_model, cfg.layers, cfg.heads, task.classes).to(device)
    x, y = task.x_val.to(device), task.y_val.to(device)
    return Case("compare", model, x, lambda out: F.cross_entropy(out.float(), y),
                f"compare classifier: {cfg.layers} blocks, d_model {cfg.d_model}, batch {cfg.batch_size} x "
                f"{cfg.seq_len} tokens")


def run_recipe(name: str) -> tuple[torch.dtype, str] | None:
    """The dtype and :func:`~mpkern.diagnose` recipe of ``mpkern compare`` run ``name`` (None for fp32):
    ``bf16`` / ``fp16`` are autocast over fp32 params; every other run keeps 16-bit params."""
    if name == "fp32":
        return None
    dtype = torch.float16 if "fp16" in name else torch.bfloat16
    return dtype, ("autocast" if name in ("bf16", "fp16") else "params")


def diagnose_compare_runs(model: nn.Module, ids: Tensor, labels: Tensor, names: list[str]) -> list[dict[str, Any]]:
    """``mpkern compare --doctor``: the compare model (its initial weights) diagnosed in each 16-bit run's
    dtype and recipe on one batch of the task, with its cross-entropy loss. Returns one entry per run:
    ``{"run", "dtype", "recipe", "diagnosis" (to_dict), "text" (the table)}``."""
    out = []
    for name in names:
        rr = run_recipe(name)
        if rr is None:
            continue
        d = diagnose(model, ids, dtype=rr[0], recipe=rr[1], loss_fn=lambda o: F.cross_entropy(o.float(), labels))
        out.append({"run": name, "dtype": str(rr[0]).replace("torch.", ""), "recipe": rr[1],
                    "diagnosis": d.to_dict(), "text": str(d)})
    return out
