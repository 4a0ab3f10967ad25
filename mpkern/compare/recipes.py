"""The table of runs: model, optimizer and training step of each precision recipe."""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .config import _DTYPE_NAME, _SHORT, Config, _state_name

Tensor = torch.Tensor



# ---- one run ------------------------------------------------------------------------------------
@dataclass
class _Recipe:
    model: nn.Module
    params: list[Tensor]
    opt: torch.optim.Optimizer
    step: Callable[[Tensor, Tensor], Tensor]      # one training step -> loss (detached, device)
    autocast: Any                                 # context factory for forward passes
    scaler: torch.amp.GradScaler | None
    describe: dict[str, str]


def _fused_ok(device: torch.device) -> dict[str, bool]:
    # fused AdamW exists for CUDA and (torch >= 2.4) CPU; fall back to foreach elsewhere
    return {"fused": True} if device.type in ("cuda", "cpu") else {}


def _build(name: str, cfg: Config, base: nn.Module, device: torch.device,
           linear_choice: dict[str, dict[str, Any]] | None = None) -> _Recipe:
    """Model, optimizer and step function of run ``name``, from a copy of ``base``.

    ``linear_choice``: :func:`choose_linear`'s result per 16-bit dtype name (``--linear auto``)."""
    from .. import FusedAdamWMP, unscale_
    from .. import nn as mpnn
    from ..matmul import backend_for

    model = copy.deepcopy(base).to(device)
    lr, wd, clip = cfg.lr, cfg.weight_decay, cfg.max_grad_norm
    dt = device.type
    mp_state = {"fp32": {}, "remainder": {"master_weights": "remainder"},
                "bf16-moments": {"state_dtype": torch.bfloat16},
                "remainder-bf16": {"master_weights": "remainder", "state_dtype": torch.bfloat16},
                "8bit": {"master_weights": "8bit", "state_dtype": torch.bfloat16},
                "remainder-8bit": {"master_weights": "remainder", "state_dtype": "8bit"},
                "8bit-8bit": {"master_weights": "8bit", "state_dtype": "8bit"}}[cfg.optimizer_state]
    scaler = None
    autocast: Any = nullcontext
    layers = "the model's own layers" if cfg.hf_model else "torch.nn.Linear"
    linear_note = f"{layers} (ATen)"
    gemm_short = "ATen fp32"

    def use_mpkern_linear(dtype: torch.dtype) -> bool:
        if cfg.linear != "auto":
            return cfg.linear == "mpkern"
        choice = (linear_choice or {}).get(_DTYPE_NAME[dtype])
        if choice is not None:
            return choice["chosen"] == "mpkern"
        # no measurement given (a direct call): the Triton GEMM on CUDA; on CPU mpkern.linear's fp32
        # GEMM for fp16 (ATen's CPU fp16 GEMM is slow without AVX512-FP16), ATen's for bf16
        return dt == "cuda" or dtype == torch.float16

    if name in ("fp32", "bf16", "fp16"):
        params = list(model.parameters())
        opt: torch.optim.Optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=wd, **_fused_ok(device))
        if name != "fp32":
            adt = torch.bfloat16 if name == "bf16" else torch.float16
            autocast = lambda: torch.autocast(dt, dtype=adt)
            linear_note = f"{layers} under autocast ({_DTYPE_NAME[adt]} GEMM)"
            gemm_short = f"ATen {_SHORT[adt]} (autocast)"
        if name == "fp16":
            scaler = torch.amp.GradScaler(dt)
        describe = {"param_dtype": "float32",
                    "compute": "float32" if name == "fp32" else f"autocast {_DTYPE_NAME[adt]}",
                    "optimizer": "torch.optim.AdamW(fused)" + (" + GradScaler" if scaler else ""),
                    "clip": "scaler.unscale_ + clip_grad_norm_" if scaler else "clip_grad_norm_"}
    else:
        pdt = torch.float16 if name.endswith("fp16") else torch.bfloat16
        model = model.to(pdt)
        how = "auto: measured faster" if cfg.linear == "auto" and linear_choice else f"--linear {cfg.linear}"
        conv1d = sum(type(m).__name__ == "Conv1D" for m in model.modules())  # transformers' GPT-2 projections
        if conv1d:
            how += f"; {conv1d} Conv1D projections (not torch.nn.Linear) keep ATen's {_DTYPE_NAME[pdt]} GEMM"
        if use_mpkern_linear(pdt):
            mpnn.convert(model)
            n_conv = sum(isinstance(m, mpnn.Linear) for m in model.modules())
            gemm = "Triton GEMM" if backend_for(device) == "triton" else "fp32 GEMM of upcast operands"
            linear_note = f"mpkern.nn.Linear -> mpkern.linear ({gemm}), {n_conv} layers; {how}"
            gemm_short = "mpkern (Triton)" if backend_for(device) == "triton" else "mpkern (fp32 GEMM)"
        else:
            linear_note = f"{layers} (ATen {_DTYPE_NAME[pdt]} GEMM); {how}"
            gemm_short = f"ATen {_SHORT[pdt]}"
        params = list(model.parameters())
        if name == "bf16-naive":
            opt = torch.optim.AdamW(params, lr=lr, weight_decay=wd, **_fused_ok(device))
            describe = {"param_dtype": "bfloat16", "compute": "bfloat16",
                        "optimizer": "torch.optim.AdamW(fused), no master weights", "clip": "clip_grad_norm_"}
        else:
            fused_clip = name == "mpkern-bf16"
            if pdt == torch.float16 and mp_state.get("master_weights") == "remainder":
                # an int16 remainder completes a bf16 param only: fp16 keeps fp32 masters
                mp_state = {k: v for k, v in mp_state.items() if k != "master_weights"}
            opt = FusedAdamWMP(params, lr=lr, weight_decay=wd, max_grad_norm=clip if fused_clip else None, **mp_state)
            if name == "mpkern-fp16":
                scaler = torch.amp.GradScaler(dt)
            describe = {"param_dtype": _DTYPE_NAME[pdt], "compute": _DTYPE_NAME[pdt],
                        "optimizer": "mpkern.FusedAdamWMP(" + ", ".join(
                            [f"master_weights={mp_state.get('master_weights', True)!r}",
                             f"state_dtype={_state_name(mp_state.get('state_dtype', torch.float32))}"]) + ")"
                        + (" + GradScaler" if scaler else ""),
                        "clip": "max_grad_norm fused into step" if fused_clip
                        else "mpkern.unscale_(opt, scaler=scaler, max_norm)"}
    describe["linear"] = linear_note
    describe["gemm"] = gemm_short

    def forward_loss(x: Tensor, y: Tensor) -> Tensor:
        with autocast():
            logits = model(x)
        return F.cross_entropy(logits.float(), y)

    if name in ("fp32", "bf16", "bf16-naive"):
        def step(x: Tensor, y: Tensor) -> Tensor:
            loss = forward_loss(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()
    elif name == "fp16":
        def step(x: Tensor, y: Tensor) -> Tensor:
            loss = forward_loss(x, y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            return loss.detach()
    elif name == "mpkern-bf16":
        def step(x: Tensor, y: Tensor) -> Tensor:
            loss = forward_loss(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()
    else:  # mpkern-fp16
        def step(x: Tensor, y: Tensor) -> Tensor:
            loss = forward_loss(x, y)
            scaler.scale(loss).backward()
            unscale_(opt, scaler=scaler, max_norm=clip)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

    return _Recipe(model, params, opt, step, autocast, scaler, describe)
