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
from .._scaler_internals import scaler_internals
from ..measure import sync
from ..optim import FusedAdamWMP
from .budget import TIME_BOX_WARMUP
from .config import Config, split_run
from .memory import CpuPeak, LiveBytes, saved_bytes
from .recipes import Recipe, build_recipe
from .task import Task

Tensor = torch.Tensor


def _evaluate(r: Recipe, task: Task, device: torch.device, batch: int = 512) -> float:
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


#: the step whose live tensor bytes are counted (the optimizer state exists from step 0 on)
PROFILED_STEP = 1


class _Loop:
    """The training loop of one run and what it records (losses, loss scales, skips, timing)."""

    def __init__(self, name: str, cfg: Config, r: Recipe, task: Task, device: torch.device,
                 deadline_s: float | None) -> None:
        self.name, self.cfg, self.r, self.device = name, cfg, r, device
        self.steps = cfg.steps
        warmup = min(cfg.warmup, TIME_BOX_WARMUP) if deadline_s is not None else cfg.warmup
        self.warm = min(warmup, self.steps - 1)
        self.deadline_s = deadline_s
        self.losses = torch.full((self.steps,), float("nan"), device=device)
        self.scales = torch.zeros(self.steps, device=device) if r.scaler is not None else None
        self.skipped_fused = torch.zeros((), device=device)
        self.x_all, self.y_all = task.x_train.to(device), task.y_train.to(device)
        self.diverged_at: int | None = None
        self.stopped = self.over_budget = False
        self.act_bytes = self.live_peak = self.gemm_temps = 0
        self.t0: float | None = None
        self.done = self.logged = 0

    def batch(self, i: int) -> tuple[Tensor, Tensor]:
        bsz = self.cfg.batch_size
        return self.x_all[i * bsz:(i + 1) * bsz], self.y_all[i * bsz:(i + 1) * bsz]

    def one(self, i: int) -> Tensor:
        x, y = self.batch(i)
        if i == 0:
            loss, self.act_bytes = saved_bytes(partial(self.r.step, x, y))
        elif i == PROFILED_STEP and self.device.type == "cpu":
            with LiveBytes() as meter:
                loss = self.r.step(x, y)
            self.live_peak, self.gemm_temps = meter.peak, meter.gemm_temp_peak
            budget = self.cfg.memory_budget
            if budget is not None:  # --find-batch: a step over the budget ends the run here
                st = bytemodel.count_state(self.r.params, self.r.opt)
                self.over_budget = st.total - st.bytes["grads"] + self.live_peak > budget
        else:
            loss = self.r.step(x, y)
        return loss

    def run(self, bar: Any) -> None:
        cfg, r = self.cfg, self.r
        start = time.perf_counter()
        for i in range(self.steps):
            if i == self.warm:
                sync(self.device)
                self.t0 = time.perf_counter()
            self.losses[i] = self.one(i)
            if self.scales is not None:
                assert r.scaler is not None  # scales are kept only with a scaler (__init__)
                # after update(): the scale the next step uses (the live tensor: no host sync)
                scale = scaler_internals(r.scaler).scale
                assert scale is not None  # set by the step's scaler.scale(loss)
                self.scales[i] = scale.reshape(())
            elif (split_run(self.name)[0] in ("mpkern-bf16", "mpkern-8bit") and isinstance(r.opt, FusedAdamWMP)
                  and r.opt.last_found_inf is not None):
                self.skipped_fused += r.opt.last_found_inf
            self.done = i + 1
            if self.deadline_s is not None and self.done > self.warm and time.perf_counter() - start >= self.deadline_s:
                self.stopped = self.done < self.steps  # the time box: the clock only, no host sync
            if self.done % cfg.log_every == 0 or self.done == self.steps or self.stopped:
                self._log(bar)
                if self.diverged_at is not None or self.stopped:
                    break
            if self.over_budget:
                break
        sync(self.device)
        self.t1 = time.perf_counter()

    def _log(self, bar: Any) -> None:
        cfg, done = self.cfg, self.done
        last = self.losses[done - 1].item()  # the one host sync per logging window
        tps = ((done - self.warm) * cfg.batch_size * cfg.seq_len / (time.perf_counter() - self.t0)
               if self.t0 and done > self.warm else 0.0)
        bar.set_postfix_str(f"loss {last:.3f}  {tps:,.0f} tok/s")
        bar.update(done - self.logged)
        self.logged = done
        if not math.isfinite(last):
            bad = (~torch.isfinite(self.losses[:done])).cpu()
            j = done - 1  # the first step of the trailing run of non-finite losses
            while j > 0 and bool(bad[j - 1]):
                j -= 1
            self.diverged_at = j

    def skipped(self) -> tuple[int, list[list[float]] | None]:
        """Skipped steps and the compressed loss-scale history."""
        r, done = self.r, self.done
        if self.scales is not None:
            sc = self.scales[:done].cpu()
            assert r.scaler is not None  # scales are kept only with a scaler (__init__)
            init = scaler_internals(r.scaler).init_scale
            prev = torch.cat([torch.tensor([init]), sc[:-1]])
            return int((sc < prev).sum()), _compress_scales(sc.tolist(), init)
        if self.name in ("mpkern-bf16", "mpkern-8bit"):
            return int(self.skipped_fused.item()), None
        return 0, None


def _peak(device: torch.device, cpu_peak: CpuPeak, mem_base: int, loop: _Loop,
          state: bytemodel.StateBytes) -> dict[str, Any]:
    """Peak memory of the run: CUDA max_memory_allocated; CPU the tensor bytes of a steady step
    (persistent state without grads + the peak of the tensors the step created) beside peak RSS."""
    if device.type == "cuda":
        return {"peak_mem_bytes": torch.cuda.max_memory_allocated(device) - mem_base,
                "peak_mem_kind": "cuda.max_memory_allocated - allocated before the run", "rss_peak_bytes": None}
    persistent = state.total - state.bytes["grads"]
    profiled = loop.done > PROFILED_STEP
    return {"peak_mem_bytes": persistent + loop.live_peak if profiled else None,
            "peak_mem_kind": "tensor bytes: weights + masters + moments + peak of the tensors one steady step creates "
                             "(activations, grads, temporaries)",
            "gemm_temp_bytes": loop.gemm_temps if profiled else None,
            "rss_peak_bytes": cpu_peak.peak()}


def train_one(name: str, cfg: Config, task: Task, base: nn.Module, *, progress: bool = True,
              linear_choice: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Train run ``name`` (one of :data:`PRECISIONS`, or an mpkern run + ``"+release"``) for
    ``cfg.steps`` steps (or its time box, ``cfg.time_box[name]`` seconds); return its report."""
    device = torch.device(cfg.device)
    cpu_peak = CpuPeak()
    mem_base = 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        mem_base = torch.cuda.memory_allocated(device)
    else:
        cpu_peak.start()
    t_start = time.perf_counter()
    r = build_recipe(name, cfg, base, device, linear_choice)
    loop = _Loop(name, cfg, r, task, device, cfg.time_box.get(name))
    bar = _progress.bar(cfg.steps, f"{name:<12}", progress)
    loop.run(bar)
    bar.close()
    done, warm = loop.done, loop.warm
    timed_steps = done - warm if loop.t0 is not None else 0
    tokens_per_s = (timed_steps * cfg.batch_size * cfg.seq_len / (loop.t1 - loop.t0)
                    if timed_steps > 0 and loop.t0 is not None else None)  # timed_steps > 0: t0 was set
    rss = cpu_peak.peak() if device.type == "cpu" else None
    # a release run's optimizer is a FusedAdamWMP (recipes._mp_optimizer)
    release = r.opt.mpkern_runtime.release if split_run(name)[1] and isinstance(r.opt, FusedAdamWMP) else None
    state = (_state_with_grads(r, loop.x_all[:cfg.batch_size], loop.y_all[:cfg.batch_size]) if release is None
             else _state_released(r, release))
    hist = loop.losses[:done].cpu()
    finite = hist[torch.isfinite(hist)]
    tail = hist[max(0, done - cfg.log_every):done]
    ok = loop.diverged_at is None
    skipped, scale_hist = loop.skipped()
    status = "diverged" if not ok else "stopped" if loop.stopped else "over_budget" if loop.over_budget else "ok"
    return {
        "name": name, **r.describe, "status": status, "diverged_at_step": loop.diverged_at,
        "stopped_why": (f"time-boxed at step {done} of {cfg.steps} after {cfg.time_box[name]:g} s"
                        if loop.stopped else None),
        "steps_done": done, "timed_steps": timed_steps, "tokens_per_s": tokens_per_s, "speedup_vs_fp32": None,
        **_peak(device, cpu_peak, mem_base, loop, state), **({"rss_peak_bytes": rss} if rss is not None else {}),
        "activation_bytes_saved_for_backward": loop.act_bytes,
        "params": state.params, "state_bytes": dict(state.bytes, total=state.total),
        "state_bytes_per_param": state.per_param(),
        "final_loss": float(tail.mean()) if ok else float("nan"),
        "min_loss": float(finite.min()) if len(finite) else float("nan"),
        "val_acc": _evaluate(r, task, device) if ok and not loop.over_budget else None,
        "skipped_steps": skipped, "loss_scale_history": scale_hist,
        **({"release": _release_entry(name, r, release)} if release is not None else {}),
        "losses": [round(v, 5) if math.isfinite(v) else None for v in hist.tolist()],
        "wall_s": time.perf_counter() - t_start,
    }


def _state_with_grads(r: Recipe, x: Tensor, y: Tensor) -> bytemodel.StateBytes:
    """Training-state bytes with the grads materialised: one extra (untimed, unstepped) backward,
    counted, then cleared -- the real tensors of weights, grads, masters and moments."""
    with r.autocast():
        logits = r.model(x)
    loss = F.cross_entropy(logits.float(), y)
    (r.scaler.scale(loss) if r.scaler is not None else loss).backward()
    state = bytemodel.count_state(r.params, r.opt)
    r.opt.zero_grad(set_to_none=True)
    return state


def _state_released(r: Recipe, release: Any) -> bytemodel.StateBytes:
    """Training-state bytes of a release run: weights, masters and moments from the real tensors
    (no grad outlives a step), grads the most bytes the release buckets held at once in the last
    step (a plain backward here would step the optimizer)."""
    state = bytemodel.count_state(r.params, r.opt)
    state.bytes["grads"] = release.peak_bytes
    return state


def _release_entry(name: str, r: Recipe, release: Any) -> dict[str, Any]:
    """What ``results.json`` says of a release run: its recipe, bucket, passes and grad bytes held."""
    assert isinstance(r.opt, FusedAdamWMP)  # a release run's optimizer (recipes._mp_optimizer)
    return {"of": split_run(name)[0], "bucket_bytes": r.opt.release_bucket_bytes,
            "backward_passes": release.passes, "peak_grad_bytes": release.peak_bytes,
            "grad_bytes_all": sum(p.numel() * p.element_size() for p in r.params if p.requires_grad)}


def _compress_scales(scales: list[float], init: float) -> list[list[float]]:
    """``[[step, scale], ...]`` at the start and at every step where the loss scale changed."""
    out = [[0, init]]
    for i, s in enumerate(scales):
        if s != out[-1][1]:
            out.append([i + 1, s])
    return out
