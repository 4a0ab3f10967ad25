"""The table of runs: model, optimizer and training step of each precision recipe.

Every run starts from a copy of the same base model; :func:`build_recipe` returns its model, optimizer
and one-step function. The 16-bit-param runs differ only in what the optimizer keeps
(``--optimizer-state``, :func:`~.config.optimizer_state_args`) and in the Linear path (:func:`_linear_path`).
A release run (``mpkern-bf16+release``, ``--release``) is its mpkern run with ``release_grads=True``:
the same optimizer settings, its step taken by ``opt.backward(loss[, scaler])`` inside backward.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .config import DTYPE_NAME, DTYPE_SHORT, Config, optimizer_state_args, split_run, state_name

Tensor = torch.Tensor

#: the compact run (``mpkern-8bit``): bf16 params, 8-bit master corrections, 8-bit moments
COMPACT_STATE = "8bit:8bit"


@dataclass
class Recipe:
    """One run's model, optimizer, step function, autocast context and scaler, as :func:`build_recipe` made them."""

    model: nn.Module
    params: list[Tensor]
    opt: torch.optim.Optimizer
    step: Callable[[Tensor, Tensor], Tensor]      # one training step -> loss (detached, device)
    autocast: Any                                 # context factory for forward passes
    scaler: torch.amp.GradScaler | None
    describe: dict[str, str]


def _fused_ok(device: torch.device) -> bool | None:
    # AdamW's ``fused``: a fused kernel exists for CUDA and (torch >= 2.4) CPU; None (its default: foreach) elsewhere
    return True if device.type in ("cuda", "cpu") else None


def param_dtype(name: str) -> torch.dtype:
    """The param dtype of run ``name`` (a release run: its recipe's)."""
    name = split_run(name)[0]
    if name in ("fp32", "bf16", "fp16"):
        return torch.float32
    return torch.float16 if name.endswith("fp16") else torch.bfloat16


def use_mpkern_linear(cfg: Config, dtype: torch.dtype, device: torch.device,
                      linear_choice: dict[str, dict[str, Any]] | None) -> bool:
    """Whether a run with ``dtype`` params uses mpkern.nn.Linear (``--linear``, else the measured choice)."""
    if cfg.linear != "auto":
        return cfg.linear == "mpkern"
    choice = (linear_choice or {}).get(DTYPE_NAME[dtype])
    if choice is not None:
        return choice["chosen"] == "mpkern"
    # no measurement given (a direct call): mpkern.linear on CUDA (the contract whatever cuBLAS's
    # reduced-precision flags say) and for fp16 on CPU (its routes include the fp32 GEMM, which wins
    # without AVX512-FP16); F.linear for bf16 on CPU
    return device.type == "cuda" or dtype == torch.float16


def _linear_path(model: nn.Module, pdt: torch.dtype, cfg: Config, device: torch.device,
                 linear_choice: dict[str, dict[str, Any]] | None) -> tuple[str, str]:
    """Convert ``model``'s Linear layers to mpkern's when chosen; ``(linear note, GEMM column)``."""
    from .. import nn as mpnn
    from ..matmul import route_summary

    layers = "the model's own layers" if cfg.hf_model else "torch.nn.Linear"
    how = "auto: measured faster" if cfg.linear == "auto" and linear_choice else f"--linear {cfg.linear}"
    conv1d = sum(type(m).__name__ == "Conv1D" for m in model.modules())  # transformers' GPT-2 projections
    if conv1d:
        how += f"; {conv1d} Conv1D projections (not torch.nn.Linear) keep ATen's {DTYPE_NAME[pdt]} GEMM"
    if not use_mpkern_linear(cfg, pdt, device, linear_choice):
        return f"{layers} (ATen {DTYPE_NAME[pdt]} GEMM); {how}", f"ATen {DTYPE_SHORT[pdt]}"
    mpnn.convert(model)
    n_conv = sum(isinstance(m, mpnn.Linear) for m in model.modules())
    routes = route_summary(device, pdt)
    return (f"mpkern.nn.Linear -> mpkern.linear (route {routes}), {n_conv} layers; {how}",
            f"mpkern ({routes.split(',')[0]})")


def _torch_optimizer(name: str, cfg: Config, model: nn.Module, device: torch.device) -> dict[str, Any]:
    """The fp32-param runs (fp32, bf16 / fp16 autocast): torch AdamW, autocast, GradScaler."""
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=_fused_ok(device))
    layers = "the model's own layers" if cfg.hf_model else "torch.nn.Linear"
    autocast: Any = nullcontext
    linear, gemm, scaler = f"{layers} (ATen)", "ATen fp32", None
    if name != "fp32":
        adt = torch.bfloat16 if name == "bf16" else torch.float16
        def autocast() -> Any:
            return torch.autocast(device.type, dtype=adt)

        linear, gemm = f"{layers} under autocast ({DTYPE_NAME[adt]} GEMM)", f"ATen {DTYPE_SHORT[adt]} (autocast)"
    if name == "fp16":
        scaler = torch.amp.GradScaler(device.type)
    describe = {"param_dtype": "float32",
                "compute": "float32" if name == "fp32" else f"autocast {DTYPE_NAME[adt]}",
                "optimizer": "torch.optim.AdamW(fused)" + (" + GradScaler" if scaler else ""),
                "clip": "scaler.unscale_ + clip_grad_norm_" if scaler else "clip_grad_norm_",
                "linear": linear, "gemm": gemm}
    return {"params": params, "opt": opt, "autocast": autocast, "scaler": scaler, "describe": describe}


def mpkern_state(name: str, cfg: Config) -> dict[str, Any]:
    """FusedAdamWMP's ``master_weights`` / ``state_dtype`` arguments of the mpkern run ``name``."""
    state = optimizer_state_args(COMPACT_STATE if name == "mpkern-8bit" else cfg.optimizer_state)
    if name == "mpkern-fp16" and state.get("master_weights") == "remainder":
        del state["master_weights"]  # an int16 remainder completes a bf16 param only: fp16 keeps fp32 masters
    return state


def _mp_optimizer(name: str, cfg: Config, model: nn.Module, device: torch.device,
                  release: bool = False) -> dict[str, Any]:
    """The 16-bit-param runs: plain AdamW (bf16-naive) or FusedAdamWMP (mpkern-*), with ``release``
    its gradient-release variant (the clip always fused: ``opt.backward`` takes no ``unscale_``)."""
    from .. import FusedAdamWMP

    pdt = param_dtype(name)
    params = list(model.parameters())
    scaler = None
    if name == "bf16-naive":
        opt: torch.optim.Optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                                       fused=_fused_ok(device))
        describe = {"param_dtype": "bfloat16", "compute": "bfloat16",
                    "optimizer": "torch.optim.AdamW(fused), no master weights", "clip": "clip_grad_norm_"}
        return {"params": params, "opt": opt, "autocast": nullcontext, "scaler": None, "describe": describe}
    state = mpkern_state(name, cfg)
    fused_clip = name != "mpkern-fp16" or release
    if release:
        state = dict(state, release_grads=True, release_bucket_bytes=cfg.release_bucket_bytes)
    opt = FusedAdamWMP(params, lr=cfg.lr, weight_decay=cfg.weight_decay,
                       max_grad_norm=cfg.max_grad_norm if fused_clip else None, **state)
    if name == "mpkern-fp16":
        scaler = torch.amp.GradScaler(device.type)
    args = [f"master_weights={state.get('master_weights', True)!r}",
            f"state_dtype={state_name(state.get('state_dtype', torch.float32))}"]
    if release:  # a clip (always set here) needs the global norm first: two passes
        args.append(f"release_grads=True, release_bucket_bytes={opt.release_bucket_bytes}")
        clip = f"max_grad_norm fused into the step inside opt.backward({'loss, scaler' if scaler else 'loss'}): " \
               "two backward passes"
    else:
        clip = "max_grad_norm fused into step" if fused_clip else "mpkern.unscale_(opt, scaler=scaler, max_norm)"
    describe = {"param_dtype": DTYPE_NAME[pdt], "compute": DTYPE_NAME[pdt],
                "optimizer": "mpkern.FusedAdamWMP(" + ", ".join(args) + ")" + (" + GradScaler" if scaler else ""),
                "clip": clip}
    return {"params": params, "opt": opt, "autocast": nullcontext, "scaler": scaler, "describe": describe}


def _step_fn(name: str, model: nn.Module, parts: dict[str, Any], clip: float,
             release: bool = False) -> Callable[[Tensor, Tensor], Tensor]:
    """One training step of run ``name`` -> the detached loss (no host sync); with ``release`` the
    step inside ``opt.backward(loss[, scaler])`` (then ``scaler.update()``)."""
    from .. import unscale_

    params, opt, scaler, autocast = parts["params"], parts["opt"], parts["scaler"], parts["autocast"]

    def forward_loss(x: Tensor, y: Tensor) -> Tensor:
        with autocast():
            logits = model(x)
        return F.cross_entropy(logits.float(), y)

    def step(x: Tensor, y: Tensor) -> Tensor:
        loss = forward_loss(x, y)
        if release:
            opt.backward(loss, scaler)
            if scaler is not None:
                scaler.update()
        elif scaler is None:
            loss.backward()
            if name in ("fp32", "bf16", "bf16-naive"):  # mpkern-bf16 / -8bit clip inside the step
                torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
            opt.step()
        else:
            scaler.scale(loss).backward()
            if name == "fp16":
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
            else:
                unscale_(opt, scaler=scaler, max_norm=clip)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def build_recipe(name: str, cfg: Config, base: nn.Module, device: torch.device,
                 linear_choice: dict[str, dict[str, Any]] | None = None) -> Recipe:
    """Model, optimizer and step function of run ``name``, from a copy of ``base``.

    ``linear_choice``: :func:`choose_linear`'s result per 16-bit dtype name (``--linear auto``)."""
    recipe, release = split_run(name)
    model = copy.deepcopy(base).to(device)
    pdt = param_dtype(recipe)
    if pdt == torch.float32:
        parts = _torch_optimizer(recipe, cfg, model, device)
    else:
        model = model.to(pdt)
        linear, gemm = _linear_path(model, pdt, cfg, device, linear_choice)
        parts = _mp_optimizer(recipe, cfg, model, device, release)
        parts["describe"].update(linear=linear, gemm=gemm)
    step = _step_fn(recipe, model, parts, cfg.max_grad_norm, release)
    return Recipe(model, parts["params"], parts["opt"], step, parts["autocast"], parts["scaler"], parts["describe"])
