"""The settings of a comparison: the runs, their defaults per device, and their checks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

PRECISIONS = ("fp32", "bf16", "fp16", "bf16-naive", "mpkern-bf16", "mpkern-8bit", "mpkern-fp16")
#: the runs that need bfloat16 (params or autocast)
BF16_RUNS = ("bf16", "bf16-naive", "mpkern-bf16", "mpkern-8bit")
#: the runs that keep their params in bfloat16 / float16
SIXTEEN_BIT_PARAMS = ("bf16-naive", "mpkern-bf16", "mpkern-8bit", "mpkern-fp16")
#: the runs of ``FusedAdamWMP``: each has a gradient-release variant (``--release``)
MPKERN_RUNS = ("mpkern-bf16", "mpkern-8bit", "mpkern-fp16")
#: the suffix of a run name for the same recipe with ``release_grads=True`` (``mpkern-bf16+release``)
RELEASE = "+release"
#: ``--optimizer-state`` shorthands -> the ``MASTER:MOMENTS`` words of the storage registry; any
#: ``MASTER:MOMENTS`` the registry reads is accepted too (a newly registered kind without an edit here)
STATE_SHORTHANDS: dict[str, str] = {
    "fp32": "fp32:fp32", "remainder": "remainder:fp32", "bf16-moments": "fp32:bf16", "remainder-bf16": "remainder:bf16",
    "8bit": "8bit:bf16", "remainder-8bit": "remainder:8bit", "8bit-8bit": "8bit:8bit",
    "remainder-4bit-m": "remainder:4bit_m", "8bit-4bit-m": "8bit:4bit_m"}
OPTIMIZER_STATES = tuple(STATE_SHORTHANDS)
LINEARS = ("auto", "mpkern", "torch")
SCHEMA = "mpkern.compare/1"

# dtype -> the name the results use (``DTYPE_NAME``) and the short one of the tables (``DTYPE_SHORT``)
DTYPE_NAME = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def state_name(state_dtype: Any) -> str:
    """A ``state_dtype`` as FusedAdamWMP keeps it in its groups ("float32", "bfloat16", "8bit")."""
    return DTYPE_NAME[state_dtype] if isinstance(state_dtype, torch.dtype) else str(state_dtype)
def optimizer_state_args(word: str) -> dict[str, Any]:
    """FusedAdamWMP's ``master_weights`` / ``state_dtype`` for an ``--optimizer-state`` word: a
    shorthand of :data:`STATE_SHORTHANDS` or ``MASTER:MOMENTS`` (:func:`mpkern.optim.storage.parse_mode`)."""
    from ..optim import storage

    try:
        mw, sd = storage.parse_mode(STATE_SHORTHANDS.get(word, word))
    except ValueError as e:
        raise ValueError(f"optimizer_state must be one of {OPTIMIZER_STATES} or MASTER:MOMENTS ({e}), "
                         f"got {word!r}") from None
    return {"master_weights": mw, "state_dtype": sd}


DTYPE_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def split_run(name: str) -> tuple[str, bool]:
    """``(recipe, release)`` of a run name: ``"mpkern-bf16+release"`` -> ``("mpkern-bf16", True)``."""
    return (name.removesuffix(RELEASE), True) if name.endswith(RELEASE) else (name, False)


def known_run(name: str) -> bool:
    """Whether ``name`` is a run: one of :data:`PRECISIONS`, or an mpkern run + :data:`RELEASE`."""
    recipe, release = split_run(name)
    return recipe in (MPKERN_RUNS if release else PRECISIONS)


def with_release(precisions: tuple[str, ...]) -> tuple[str, ...]:
    """``precisions`` with the release variant of each mpkern run right after it (``--release``)."""
    out: list[str] = []
    for p in precisions:
        out.append(p)
        if p in MPKERN_RUNS and p + RELEASE not in precisions:
            out.append(p + RELEASE)
    return tuple(out)


# ---- configuration ------------------------------------------------------------------------------
@dataclass
class Config:
    """Every setting of a comparison (all of it goes into ``results.json``)."""

    precisions: tuple[str, ...] = ()
    device: str = "cpu"
    steps: int = 1000
    lr: float = 1e-4
    batch_size: int = 32
    seq_len: int = 16
    d_model: int = 128
    layers: int = 2
    heads: int = 4
    classes: int = 32
    noise_vocab: int = 64
    val_size: int = 2048
    warmup: int = 20
    log_every: int = 20
    max_grad_norm: float = 1.0
    weight_decay: float = 0.01
    seed: int = 0
    optimizer_state: str = "fp32"
    linear: str = "auto"
    threads: int = 0
    hf_model: str | None = None
    time_budget: float | None = None
    min_steps: int = 800
    skipped_precisions: dict[str, str] = field(default_factory=dict)
    time_box: dict[str, float] = field(default_factory=dict)
    memory_budget: int | None = None
    release: bool = False
    release_bucket_bytes: int | None = None


def default_config(device: str | torch.device = "cpu") -> Config:
    """The built-in default for ``device``: a small model on CPU, up to 1000 steps sized by a measured
    probe to fit 110 s of training for all runs (under 150 s in all on a 2-core CPU, with or without
    native bf16: see :func:`fit_budget`); a GPT-2-small-sized one (768 wide, 12 layers) on CUDA.

    lr 1e-4 is where the lesson shows: Adam moves each weight by about lr per step, less than half
    a bf16 ulp of most weights (|w| > 2^8 * lr = 0.026), so bf16-naive's updates round away while
    the runs with fp32 masters learn. At 3e-4 bf16-naive learns as well."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return Config(device=str(dev), steps=300, batch_size=16, seq_len=256, d_model=768, layers=12, heads=12,
                      classes=32, noise_vocab=4096, warmup=30, log_every=25)
    return Config(device=str(dev), time_budget=110.0)


def default_precisions(device: str | torch.device) -> tuple[tuple[str, ...], dict[str, str]]:
    """The runs the device supports by default, and the reasons for those left out."""
    from .. import bf16_supported

    dev = torch.device(device)
    skipped: dict[str, str] = {}
    chosen = []
    for p in PRECISIONS:
        if p in BF16_RUNS and not bf16_supported(dev):
            skipped[p] = no_bf16_message(dev)
        elif p == "fp16" and dev.type == "cpu":
            skipped[p] = ("PyTorch's CPU fp16 GEMM is not accelerated on most CPUs (autocast fp16 measured ~20x "
                          "slower than fp32 on the 2-core dev machine); ask for it with --precision fp16")
        elif p == "mpkern-fp16" and dev.type == "cpu":
            skipped[p] = ("fp16 params on a CPU show the GradScaler recipe, not fp16 speed (no native fp16 GEMM), and "
                          "the same memory as mpkern-bf16; left out of the CPU default to keep it within 150 s -- ask "
                          "for it with --precision fp32,mpkern-fp16")
        else:
            chosen.append(p)
    return tuple(chosen), skipped


def no_bf16_message(dev: torch.device) -> str:
    """Why the bf16 runs are left out on ``dev`` and what to run instead."""
    cap = torch.cuda.get_device_capability(dev) if dev.type == "cuda" and torch.cuda.is_available() else None
    return (f"bfloat16 needs compute capability >= 8.0 (Ampere or newer); {dev} has {cap}. "
            "Use the fp16 runs instead (--precision fp32,fp16,mpkern-fp16)")


def check_config(cfg: Config) -> None:
    """Raise ValueError naming the setting that is out of range."""
    for name in ("steps", "batch_size", "seq_len", "d_model", "layers", "heads", "classes", "noise_vocab",
                 "val_size", "log_every"):
        v = getattr(cfg, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if cfg.classes < 2:
        raise ValueError(f"classes must be >= 2, got {cfg.classes}")
    if cfg.seq_len < 3:
        raise ValueError(f"seq_len must be >= 3 (query, red and blue tokens), got {cfg.seq_len}")
    if cfg.d_model % cfg.heads:
        raise ValueError(f"d_model ({cfg.d_model}) must be divisible by heads ({cfg.heads})")
    if not (isinstance(cfg.lr, (int, float)) and math.isfinite(cfg.lr) and cfg.lr > 0):
        raise ValueError(f"lr must be a positive finite number, got {cfg.lr!r}")
    if not (cfg.max_grad_norm > 0 and math.isfinite(cfg.max_grad_norm)):
        raise ValueError(f"max_grad_norm must be positive and finite, got {cfg.max_grad_norm!r}")
    if not isinstance(cfg.warmup, int) or cfg.warmup < 0:
        raise ValueError(f"warmup must be a non-negative integer, got {cfg.warmup!r}")
    optimizer_state_args(cfg.optimizer_state)  # ValueError naming the accepted words
    if cfg.linear not in LINEARS:
        raise ValueError(f"linear must be one of {LINEARS}, got {cfg.linear!r}")
    if cfg.time_budget is not None and not (isinstance(cfg.time_budget, (int, float)) and cfg.time_budget > 0):
        raise ValueError(f"time_budget must be a positive number of seconds or None, got {cfg.time_budget!r}")
    if not isinstance(cfg.min_steps, int) or cfg.min_steps < 1:
        raise ValueError(f"min_steps must be a positive integer, got {cfg.min_steps!r}")
    if not cfg.precisions:
        raise ValueError("precisions is empty: nothing to run")
    bad = [p for p in cfg.precisions if not known_run(p)]
    if bad:
        raise ValueError(f"precisions: unknown {bad}; choose from {list(PRECISIONS)} (and "
                         f"{', '.join(r + RELEASE for r in MPKERN_RUNS)})")
    if cfg.release and not any(split_run(p)[1] for p in cfg.precisions):
        raise ValueError(f"release: adds a run with gradient release beside each mpkern run "
                         f"({', '.join(MPKERN_RUNS)}), but precisions has none: {list(cfg.precisions)}")
    rb = cfg.release_bucket_bytes
    if rb is not None and (isinstance(rb, bool) or not isinstance(rb, int) or rb < 1):
        raise ValueError(f"release_bucket_bytes must be a positive number of bytes or None, got {rb!r}")
    if len(set(cfg.precisions)) != len(cfg.precisions):
        raise ValueError(f"precisions lists a run twice: {list(cfg.precisions)}")
