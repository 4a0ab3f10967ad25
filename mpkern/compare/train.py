"""Training one run: the loop, its measurements and its report entry."""

from __future__ import annotations

import math
import time
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import _progress, bytemodel
from ..measure import sync
from .config import Config
from .memory import _CpuPeak, _saved_bytes
from .recipes import _build, _Recipe
from .task import Task

Tensor = torch.Tensor



def _evaluate(r: _Recipe, task: Task, device: torch.device, batch: int = 512) -> float:
    r.model.eval()
    correct = torch.zeros((), dtype=torch.int64, device=device)
    with torch.no_grad():
        for i in range(0, len(task.y_val), batch):
            x = task.x_val[i:i + batch].to(device)
            with r.autocast():
                pred = r.model(x).argmax(dim=-1)
            correct += (pred == task.y_val[i:i + batch].to(device)).sum()
    r.model.train()
    return correct.item() / len(task.y_val)


def train_one(name: str, cfg: Config, task: Task, base: nn.Module, *, progress: bool = True,
              linear_choice: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Train run ``name`` (one of :data:`PRECISIONS`) for ``cfg.steps`` steps; return its report."""
    device = torch.device(cfg.device)
    cpu_peak = _CpuPeak()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        mem_base = torch.cuda.memory_allocated(device)
    else:
        cpu_peak.start()
    t_start = time.perf_counter()
    r = _build(name, cfg, base, device, linear_choice)
    steps, bsz, warm = cfg.steps, cfg.batch_size, min(cfg.warmup, cfg.steps - 1)
    losses = torch.full((steps,), float("nan"), device=device)
    scales = torch.zeros(steps, device=device) if r.scaler is not None else None
    skipped_fused = torch.zeros((), device=device)
    x_all, y_all = task.x_train.to(device), task.y_train.to(device)
    bar = _progress.bar(steps, f"{name:<12}", progress)
    diverged_at: int | None = None
    act_bytes = 0
    t0 = t1 = None
    done = 0
    for i in range(steps):
        if i == warm:
            sync(device)
            t0 = time.perf_counter()
        x, y = x_all[i * bsz:(i + 1) * bsz], y_all[i * bsz:(i + 1) * bsz]
        if i == 0:
            loss, act_bytes = _saved_bytes(partial(r.step, x, y))
        else:
            loss = r.step(x, y)
        losses[i] = loss
        if scales is not None:
            scales[i] = r.scaler._scale.reshape(())  # after update(): the scale the next step uses
        elif name == "mpkern-bf16" and r.opt.last_found_inf is not None:
            skipped_fused += r.opt.last_found_inf
        done = i + 1
        if done % cfg.log_every == 0 or done == steps:
            window = losses[max(0, done - cfg.log_every):done]
            last = window[-1].item()  # the one host sync per logging window
            tps = (done - warm) * bsz * cfg.seq_len / (time.perf_counter() - t0) if t0 and done > warm else 0.0
            bar.set_postfix_str(f"loss {last:.3f}  {tps:,.0f} tok/s")
            bar.update(cfg.log_every if done % cfg.log_every == 0 else done % cfg.log_every)
            if not math.isfinite(last):
                bad = (~torch.isfinite(losses[:done])).cpu()
                # the first step of the trailing run of non-finite losses
                j = done - 1
                while j > 0 and bool(bad[j - 1]):
                    j -= 1
                diverged_at = j
                break
    sync(device)
    t1 = time.perf_counter()
    bar.close()
    timed_steps = done - warm if t0 is not None else 0
    tokens_per_s = timed_steps * bsz * cfg.seq_len / (t1 - t0) if timed_steps > 0 else None
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - mem_base
        peak_kind = "cuda.max_memory_allocated - allocated before the run"
    else:
        peak = cpu_peak.peak()
        peak_kind = "peak RSS growth (VmHWM)" if peak is not None else "unavailable (no /proc/self/clear_refs)"
    state = _state_with_grads(r, x_all[:bsz], y_all[:bsz])
    hist = losses[:done].cpu()
    finite = hist[torch.isfinite(hist)]
    tail = hist[max(0, done - cfg.log_every):done]
    final_loss = float(tail.mean()) if diverged_at is None else float("nan")
    val_acc = _evaluate(r, task, device) if diverged_at is None else None
    if scales is not None:
        sc = scales[:done].cpu()
        prev = torch.cat([torch.tensor([float(r.scaler._init_scale)]), sc[:-1]])
        skipped = int((sc < prev).sum())
        scale_hist = _compress_scales(sc.tolist(), float(r.scaler._init_scale))
    elif name == "mpkern-bf16":
        skipped, scale_hist = int(skipped_fused.item()), None
    else:
        skipped, scale_hist = 0, None
    out = {
        "name": name,
        **r.describe,
        "status": "ok" if diverged_at is None else "diverged",
        "diverged_at_step": diverged_at,
        "steps_done": done,
        "timed_steps": timed_steps,
        "tokens_per_s": tokens_per_s,
        "speedup_vs_fp32": None,
        "peak_mem_bytes": peak,
        "peak_mem_kind": peak_kind,
        "activation_bytes_saved_for_backward": act_bytes,
        "params": state.params,
        "state_bytes": dict(state.bytes, total=state.total),
        "state_bytes_per_param": state.per_param(),
        "final_loss": final_loss,
        "min_loss": float(finite.min()) if len(finite) else float("nan"),
        "val_acc": val_acc,
        "skipped_steps": skipped,
        "loss_scale_history": scale_hist,
        "losses": [round(v, 5) if math.isfinite(v) else None for v in hist.tolist()],
        "wall_s": time.perf_counter() - t_start,
    }
    return out


def _state_with_grads(r: _Recipe, x: Tensor, y: Tensor) -> bytemodel.StateBytes:
    """Training-state bytes with the grads materialised: one extra (untimed, unstepped) backward,
    counted, then cleared -- the real tensors of weights, grads, masters and moments."""
    with r.autocast():
        logits = r.model(x)
    loss = F.cross_entropy(logits.float(), y)
    (r.scaler.scale(loss) if r.scaler is not None else loss).backward()
    state = bytemodel.count_state(r.params, r.opt)
    r.opt.zero_grad(set_to_none=True)
    return state


def _compress_scales(scales: list[float], init: float) -> list[list[float]]:
    """``[[step, scale], ...]`` at the start and at every step where the loss scale changed."""
    out = [[0, init]]
    for i, s in enumerate(scales):
        if s != out[-1][1]:
            out.append([i + 1, s])
    return out
