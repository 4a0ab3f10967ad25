"""``mpkern compare``: train the same small model several ways and report them side by side.

The classic mixed-precision exercise -- train a text classifier in FP32 and in mixed precision,
compare tokens/s, memory and validation accuracy -- as one function (:func:`run`) and one command.
Every run gets the same initial weights, the same data in the same order and the same
hyperparameters; only the precision recipe differs:

==============  ===================================================================================
``fp32``        fp32 params, ``torch.optim.AdamW`` (fused where PyTorch has it), ``clip_grad_norm_``
``bf16``        PyTorch's recipe: fp32 params, ``torch.autocast(bfloat16)``, AdamW, ``clip_grad_norm_``
``fp16``        ``torch.autocast(float16)`` + ``GradScaler`` (``unscale_`` + ``clip_grad_norm_``)
``bf16-naive``  bf16 params, plain AdamW, no master weights (its small updates round away)
``mpkern-bf16`` bf16 params, :class:`mpkern.FusedAdamWMP` (fp32 masters) with ``max_grad_norm`` fused
``mpkern-fp16`` fp16 params (:func:`mpkern.nn.convert`), FusedAdamWMP + ``GradScaler`` +
                ``mpkern.unscale_(opt, scaler=scaler, max_norm=...)``
==============  ===================================================================================

The task (generated in code from ``seed``; no download): each sequence is noise tokens with one
*red* class token, one *blue* class token and one *query* token ("red?" or "blue?") at three
random positions; the label is the class of the token whose colour the query names. The model
(token + position embeddings, pre-LN transformer blocks, mean pooling, linear head) has only
per-token MLPs before the pooling, so combining the query with the right class token *needs*
attention; a model that ignores the query is capped at 50 % accuracy, chance is ``1/classes``.
The validation split is held out (never trained on).

Measurements: tokens/s over the steps after ``warmup`` (the device is synchronised at the timing
boundaries and when the progress bar shows a loss, every ``log_every`` steps -- never inside a
step); peak memory (CUDA: ``torch.cuda.max_memory_allocated`` above what was allocated before
the run; CPU: growth of the process's peak resident set size during the run -- Linux ``VmHWM``,
reset per run through ``/proc/self/clear_refs`` after ``malloc_trim`` -- plus the bytes of the
tensors autograd saved for backward in one step, counted exactly); training-state bytes per
parameter counted from the real tensors (:func:`mpkern.bytemodel.count_state`); final train loss
(mean of the last ``log_every`` steps); validation accuracy; skipped steps and the loss scale.
"""

from __future__ import annotations

import copy
import ctypes
import json
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import _progress, bytemodel
from .measure import cpu_flags, device_info, pyplot, sync

Tensor = torch.Tensor

PRECISIONS = ("fp32", "bf16", "fp16", "bf16-naive", "mpkern-bf16", "mpkern-fp16")
OPTIMIZER_STATES = ("fp32", "remainder", "bf16-moments", "remainder-bf16", "8bit", "remainder-8bit", "8bit-8bit")
LINEARS = ("auto", "mpkern", "torch")
SCHEMA = "mpkern.compare/1"

_DTYPE_NAME = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _state_name(state_dtype: Any) -> str:
    """A ``state_dtype`` as FusedAdamWMP keeps it in its groups ("float32", "bfloat16", "8bit")."""
    return _DTYPE_NAME[state_dtype] if isinstance(state_dtype, torch.dtype) else str(state_dtype)
_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


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
    from . import bf16_supported

    dev = torch.device(device)
    skipped: dict[str, str] = {}
    chosen = []
    for p in PRECISIONS:
        if "bf16" in p and not bf16_supported(dev):
            skipped[p] = _no_bf16_message(dev)
        elif p == "fp16" and dev.type == "cpu":
            skipped[p] = ("PyTorch's CPU fp16 GEMM is not accelerated on most CPUs (autocast fp16 measured ~20x "
                          "slower than fp32 on the 2-core dev machine); ask for it with --precision fp16")
        else:
            chosen.append(p)
    return tuple(chosen), skipped


def _no_bf16_message(dev: torch.device) -> str:
    cap = torch.cuda.get_device_capability(dev) if dev.type == "cuda" and torch.cuda.is_available() else None
    return (f"bfloat16 needs compute capability >= 8.0 (Ampere or newer); {dev} has {cap}. "
            "Use the fp16 runs instead (--precision fp32,fp16,mpkern-fp16)")


def _check(cfg: Config) -> None:
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
    if cfg.optimizer_state not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer_state must be one of {OPTIMIZER_STATES}, got {cfg.optimizer_state!r}")
    if cfg.linear not in LINEARS:
        raise ValueError(f"linear must be one of {LINEARS}, got {cfg.linear!r}")
    if cfg.time_budget is not None and not (isinstance(cfg.time_budget, (int, float)) and cfg.time_budget > 0):
        raise ValueError(f"time_budget must be a positive number of seconds or None, got {cfg.time_budget!r}")
    if not isinstance(cfg.min_steps, int) or cfg.min_steps < 1:
        raise ValueError(f"min_steps must be a positive integer, got {cfg.min_steps!r}")
    if not cfg.precisions:
        raise ValueError("precisions is empty: nothing to run")
    bad = [p for p in cfg.precisions if p not in PRECISIONS]
    if bad:
        raise ValueError(f"precisions: unknown {bad}; choose from {list(PRECISIONS)}")
    if len(set(cfg.precisions)) != len(cfg.precisions):
        raise ValueError(f"precisions lists a run twice: {list(cfg.precisions)}")


# ---- data ---------------------------------------------------------------------------------------
@dataclass
class Task:
    """Token ids and labels of the synthetic task (train in training order, held-out validation)."""

    x_train: Tensor
    y_train: Tensor
    x_val: Tensor
    y_val: Tensor
    vocab: int
    classes: int


def make_task(cfg: Config) -> Task:
    """Generate ``steps * batch_size`` training and ``val_size`` validation sequences from ``seed``.

    Vocabulary: ``[0, C)`` red class tokens, ``[C, 2C)`` blue class tokens, ``2C`` = "red?",
    ``2C + 1`` = "blue?", then ``noise_vocab`` noise tokens. Both splits come from one stream
    and are disjoint slices of it.
    """
    c, n_train, length = cfg.classes, cfg.steps * cfg.batch_size, cfg.seq_len
    n = n_train + cfg.val_size
    g = torch.Generator().manual_seed(cfg.seed)
    vocab = 2 * c + 2 + cfg.noise_vocab
    x = torch.randint(2 * c + 2, vocab, (n, length), generator=g)
    pos = torch.rand(n, length, generator=g).argsort(dim=1)[:, :3]
    red = torch.randint(0, c, (n,), generator=g)
    blue = torch.randint(0, c, (n,), generator=g)
    ask_blue = torch.randint(0, 2, (n,), generator=g)
    rows = torch.arange(n)
    x[rows, pos[:, 0]] = 2 * c + ask_blue
    x[rows, pos[:, 1]] = red
    x[rows, pos[:, 2]] = c + blue
    y = torch.where(ask_blue.bool(), blue, red)
    return Task(x[:n_train], y[:n_train], x[n_train:], y[n_train:], vocab, c)


# ---- model --------------------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-LN transformer block: self-attention (``scaled_dot_product_attention``) and a GELU MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Classifier(nn.Module):
    """Token + learned position embeddings, ``layers`` blocks, final LayerNorm, mean pool, head."""

    def __init__(self, vocab: int, seq_len: int, d_model: int, layers: int, heads: int, classes: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq_len, d_model) * 0.02)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, classes)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.tok(ids) + self.pos
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.ln(h).mean(dim=1))


class HFClassifier(nn.Module):
    """A ``transformers`` sequence classifier built from a local config (random init, no download).

    The config's vocabulary, positions and labels are set to the task's (``vocab_size`` = task
    vocabulary + 1 for a padding id that never occurs, ``num_labels`` = classes); ``forward``
    returns the logits. Needs ``transformers``.
    """

    def __init__(self, config_path: str, vocab: int, seq_len: int, classes: int) -> None:
        super().__init__()
        try:
            from transformers import AutoConfig, AutoModelForSequenceClassification
        except ImportError as e:
            raise ValueError(f"hf_model needs the optional dependency transformers ({e})") from e
        if not os.path.exists(config_path):
            raise ValueError(f"hf_model: {config_path!r} does not exist (a config.json or a folder holding one)")
        config = AutoConfig.from_pretrained(config_path)
        config.vocab_size = vocab + 1
        config.pad_token_id = vocab
        config.num_labels = classes
        for name in ("max_position_embeddings", "n_positions"):
            if getattr(config, name, None) is not None:
                setattr(config, name, max(getattr(config, name), seq_len))
        self.name = type(config).__name__
        self.model = AutoModelForSequenceClassification.from_config(config)

    def forward(self, ids: Tensor) -> Tensor:
        return self.model(input_ids=ids).logits


# ---- memory -------------------------------------------------------------------------------------
class _CpuPeak:
    """Peak RSS growth of this process over a region (Linux: VmHWM reset via /proc/self/clear_refs)."""

    def __init__(self) -> None:
        self.ok = False
        self.base = 0
        try:
            self._trim = ctypes.CDLL("libc.so.6").malloc_trim
        except OSError:
            self._trim = None

    @staticmethod
    def _status(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        raise OSError(key)

    def start(self) -> None:
        import gc

        gc.collect()
        if self._trim is not None:
            self._trim(0)
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.base = self._status("VmRSS")
            self.ok = True
        except OSError:
            self.ok = False

    def peak(self) -> int | None:
        if not self.ok:
            return None
        try:
            return max(self._status("VmHWM") - self.base, 0)
        except OSError:
            return None


def _saved_bytes(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``fn`` and count the bytes of the distinct tensors autograd saves for backward."""
    seen: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        if t.numel():
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


# ---- what this device computes natively ---------------------------------------------------------
#: CPU flags (``/proc/cpuinfo``: x86 ``flags``, Arm ``Features``) that mean native 16-bit arithmetic.
CPU_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16", "bf16"), "float16": ("avx512_fp16", "amx_fp16", "fphp")}
#: Environment variables that cap the instruction set oneDNN (ATen's bf16/fp16 GEMM on CPU) may use.
ISA_LIMITS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
#: A 16-bit GEMM at least this fraction of the fp32 GEMM's speed counts as computed natively on CPU.
#: Measured: native bf16 (AVX512-BF16) runs at 2-3x fp32, emulated bf16 at 0.3-0.5x, fp16 without
#: AVX512-FP16 at ~0.02x -- the threshold sits far from both.
NATIVE_MIN_SPEED = 0.7
#: Other processes using at least this many cores on average while the runs trained make the timings
#: unreliable on CPU (torch's worker threads wait for each other when one of them is descheduled).
OTHERS_WARN = 0.25


class _OthersCpu:
    """CPU time other processes used over a region: all busy time in ``/proc/stat`` minus this
    process's own (``/proc/self/stat``), in cores on average. None where /proc is not there."""

    def __init__(self) -> None:
        self.start = self._now()

    @staticmethod
    def _now() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                cpu = [int(v) for v in f.readline().split()[1:]]
            with open("/proc/self/stat") as f:
                mine = f.read().rsplit(")", 1)[1].split()
            tick = os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None
        busy = sum(cpu) - cpu[3] - (cpu[4] if len(cpu) > 4 else 0)  # all but idle and iowait
        return time.perf_counter(), busy / tick, (int(mine[11]) + int(mine[12])) / tick  # utime + stime

    def cores(self) -> float | None:
        end = self._now()
        if self.start is None or end is None or end[0] <= self.start[0]:
            return None
        others = (end[1] - self.start[1]) - (end[2] - self.start[2])
        return max(0.0, others / (end[0] - self.start[0]))
#: Compute capability from which a CUDA GPU has tensor cores for the dtype.
GPU_MIN_CAPABILITY = {"bfloat16": (8, 0), "float16": (7, 0)}


def _min_ms(fns: dict[str, Callable[[], Any]], device: torch.device, reps: int, cap_s: float = 0.6) -> dict[str, float]:
    """Fastest of ``reps`` timed calls of each function (after one untimed call), interleaved so that
    a burst of load on a shared machine hits every candidate alike. A candidate whose calls add up
    to more than ``cap_s`` seconds stops early (a slow path needs no precise number)."""
    best = {k: math.inf for k in fns}
    spent = dict.fromkeys(fns, 0.0)
    for f in fns.values():
        f()
    sync(device)
    for _ in range(reps):
        for k, f in fns.items():
            if spent[k] > cap_s:
                continue
            t = time.perf_counter()
            f()
            sync(device)
            dt = time.perf_counter() - t
            spent[k] += dt
            best[k] = min(best[k], dt)
    return {k: 1e3 * v for k, v in best.items()}


def compute_support(device: str | torch.device, m: int = 1024, k: int = 128, n: int = 512, *, reps: int = 5,
                    flags: set[str] | None = None,
                    timer: Callable[[dict, torch.device, int], dict[str, float]] | None = None) -> dict[str, Any]:
    """Whether ``device`` computes bfloat16 / float16 natively, and what that rests on.

    CPU: the CPU flags (:data:`CPU_FLAGS`) *and* a measured probe -- an (m, k) @ (k, n) GEMM in
    fp32, bf16 and fp16 through ATen, fastest of ``reps``; a dtype counts as native when its GEMM
    runs at >= :data:`NATIVE_MIN_SPEED` of the fp32 speed (the measurement decides: oneDNN may be
    kept off the instructions, e.g. by ``ONEDNN_MAX_CPU_ISA``). CUDA: the compute capability
    (:data:`GPU_MIN_CAPABILITY`); the probe is reported beside it. ``flags``/``timer`` replace
    ``/proc/cpuinfo`` and the clock (tests).
    """
    dev = torch.device(device)
    out: dict[str, Any] = {"type": dev.type}
    if dev.type == "cpu":
        flags = cpu_flags() if flags is None else flags
        known = sorted({f for fs in CPU_FLAGS.values() for f in fs})
        out["cpu_flags"] = {f: f in flags for f in known}
        out["isa_limit"] = {e: os.environ[e] for e in ISA_LIMITS if os.environ.get(e)}
    cap = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
    if cap is not None:
        out["capability"] = list(cap)
    g = torch.Generator().manual_seed(0)
    a32, b32 = torch.randn(m, k, generator=g).to(dev), torch.randn(k, n, generator=g).to(dev)
    ops = {}
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        a, b = a32.to(dt), b32.to(dt)
        ops[_DTYPE_NAME[dt]] = (lambda a=a, b=b: torch.mm(a, b))
    ms = (timer or _min_ms)(ops, dev, reps)
    out["gemm"] = {"shape": [m, k, n], "ms": ms}
    for name in ("bfloat16", "float16"):
        speed = ms["float32"] / ms[name] if ms[name] > 0 else math.inf
        probe = f"a {m}x{k}x{n} {name} GEMM ran at {speed:.2f}x the fp32 GEMM's speed"
        if cap is not None:
            need = GPU_MIN_CAPABILITY[name]
            native = tuple(cap) >= need
            why = (f"compute capability {cap[0]}.{cap[1]} {'>=' if native else '<'} {need[0]}.{need[1]}; {probe}")
        else:
            native = speed >= NATIVE_MIN_SPEED
            listed = [f for f in CPU_FLAGS[name] if f in flags]
            flag_txt = (f"the CPU flags list {', '.join(listed)}" if listed
                        else f"no {'/'.join(CPU_FLAGS[name][:2])} in the CPU flags")
            why = f"{flag_txt}; {probe}"
            if listed and not native:
                lim = ", ".join(f"{e}={v}" for e, v in out["isa_limit"].items())
                why += (f" -- the GEMM library does not use those instructions here ({lim})" if lim
                        else " -- the GEMM library does not use those instructions here")
            elif not native:
                why += f": PyTorch emulates {name} arithmetic in fp32 on this CPU"
        out[name] = {"native": native, "speed_vs_fp32": speed, "why": why}
    return out


def linear_shapes(model: nn.Module, ids: Tensor) -> list[tuple[int, int, int, bool]]:
    """``(rows, in_features, out_features, bias)`` of every ``torch.nn.Linear`` call in one forward
    of ``model`` on ``ids`` (fp32, no grad) -- the GEMMs :func:`mpkern.nn.convert` would take over."""
    seen: list[tuple[int, int, int, bool]] = []
    hooks = [m.register_forward_hook(lambda mod, args, out: seen.append(
        (args[0].numel() // args[0].shape[-1], mod.in_features, mod.out_features, mod.bias is not None)))
        for m in model.modules() if type(m) is nn.Linear]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


def choose_linear(shapes: Sequence[tuple[int, int, int, bool]], dtype: torch.dtype, device: str | torch.device, *,
                  reps: int = 3, timer: Callable[[dict, torch.device, int], dict[str, float]] | None = None
                  ) -> dict[str, Any]:
    """``--linear auto``: time one forward + backward of the model's Linear GEMMs (``shapes``, from
    :func:`linear_shapes`) both ways in ``dtype`` on ``device`` and pick the faster correct one.

    Candidates, both accumulating in fp32: ``torch`` -- ``F.linear`` on the 16-bit tensors (ATen's
    GEMM: oneDNN on CPU, cuBLAS on CUDA) -- and ``mpkern`` -- :func:`mpkern.linear` (Triton on CUDA;
    elsewhere an fp32 GEMM of the upcast operands, then one rounding). On CUDA, cuBLAS may reduce
    16-bit products in reduced precision unless
    ``torch.backends.cuda.matmul.allow_{bf16,fp16}_reduced_precision_reduction`` is False: then
    the ``torch`` candidate is not counted as correct. Returns ``{"chosen", "ms", "why", ...}``.
    """
    from . import linear as mp_linear
    from .matmul import backend_for

    dev = torch.device(device)
    dname = _DTYPE_NAME[dtype]
    what = {"torch": f"ATen {dname} GEMM (F.linear)",
            "mpkern": ("mpkern.linear, Triton GEMM" if backend_for(dev) == "triton"
                       else "mpkern.linear: fp32 GEMM of the upcast operands (ATen), one rounding")}
    res: dict[str, Any] = {"dtype": dname, "candidates": what, "ms": {}, "gemms": len(shapes)}
    if not shapes:
        return res | {"chosen": "torch", "why": "the model has no torch.nn.Linear layers to convert"}
    allowed = ["torch", "mpkern"]
    if dev.type == "cuda":
        flag = f"allow_{'bf16' if dtype == torch.bfloat16 else 'fp16'}_reduced_precision_reduction"
        if getattr(torch.backends.cuda.matmul, flag, True):
            allowed = ["mpkern"]
            res["why"] = (f"torch.backends.cuda.matmul.{flag} is True: cuBLAS may reduce in {dname}, so "
                          "only the fp32-accumulating mpkern GEMM counts as correct")
    g = torch.Generator().manual_seed(1)
    data = []
    for rows, fin, fout, has_bias in sorted(set(shapes)):
        x = torch.randn(rows, fin, generator=g).to(dev, dtype).requires_grad_()
        w = (torch.randn(fout, fin, generator=g) * fin**-0.5).to(dev, dtype).requires_grad_()
        b = torch.randn(fout, generator=g).to(dev, dtype).requires_grad_() if has_bias else None
        gy = torch.randn(rows, fout, generator=g).to(dev, dtype)
        data.append((shapes.count((rows, fin, fout, has_bias)), x, w, b, gy))
    impl = {"torch": F.linear, "mpkern": mp_linear}

    def fwd_bwd(f: Callable[..., Tensor]) -> Callable[[], None]:
        def go() -> None:
            for count, x, w, b, gy in data:
                for _ in range(count):
                    f(x, w, b).backward(gy)
        return go

    res["ms"] = (timer or _min_ms)({k: fwd_bwd(impl[k]) for k in allowed}, dev, reps)
    chosen = min(allowed, key=lambda k: res["ms"][k])
    if "why" not in res:
        other = "mpkern" if chosen == "torch" else "torch"
        res["why"] = (f"measured on this device, one forward+backward of the model's {len(shapes)} Linear GEMMs in "
                      f"{dname}: {what[chosen]} {res['ms'][chosen]:.2f} ms vs {what[other]} {res['ms'][other]:.2f} ms")
    return res | {"chosen": chosen}


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
    from . import FusedAdamWMP, unscale_
    from . import nn as mpnn
    from .matmul import backend_for

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
    from . import __version__, bf16_supported

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
    support, linear_choice = _measure_device(cfg, base)
    for info in linear_choice.values():
        print(f"[compare] --linear auto, {info['dtype']}: {info['chosen']} ({info['why']})", flush=True)
    cfg, budget = fit_budget(cfg, base, linear_choice)
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
    from .plan import plan_table

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


def _measure_device(cfg: Config, base: nn.Module) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The native-compute probe (at the model's largest GEMM) and, for ``--linear auto``, the
    measured Linear choice of each 16-bit param dtype the runs use."""
    dev = torch.device(cfg.device)
    ids = make_task(replace(cfg, steps=1, val_size=1)).x_train[:1]
    one = linear_shapes(base, ids)  # one sequence on CPU in fp32; rows scale with the batch
    shapes = [(rows * cfg.batch_size, fin, fout, b) for rows, fin, fout, b in one]
    if shapes:
        m, k, n, _ = max(shapes, key=lambda t: t[0] * t[1] * t[2])
    else:
        m, k, n = cfg.batch_size * cfg.seq_len, cfg.d_model, 4 * cfg.d_model
    support = compute_support(dev, m, k, n)
    choice: dict[str, dict[str, Any]] = {}
    if cfg.linear == "auto":
        dtypes = {torch.float16 if p.endswith("fp16") else torch.bfloat16
                  for p in cfg.precisions if p in ("bf16-naive", "mpkern-bf16", "mpkern-fp16")}
        for dt in sorted(dtypes, key=str):
            choice[_DTYPE_NAME[dt]] = choose_linear(shapes, dt, dev)
    return support, choice


def lessons(results: dict[str, Any]) -> list[str]:
    """What this report shows, in words, from its own numbers: the master-weight lesson and the
    speed/memory lesson worded for whether this device computes 16-bit natively."""
    runs = {r["name"]: r for r in results["runs"]}
    out = []
    naive, ok = runs.get("bf16-naive"), [r for n, r in runs.items() if n != "bf16-naive" and r["val_acc"] is not None]
    lr = results["config"]["lr"]
    if naive is not None and naive["val_acc"] is not None and ok:
        best = max(r["val_acc"] for r in ok)
        chance = results["task"]["chance_acc"]
        masters = [n for n in runs if n.startswith("mpkern")] or [r["name"] for r in ok]
        acc = ", ".join(f"{n} {100 * runs[n]['val_acc']:.1f} %" for n in masters if runs[n]["val_acc"] is not None)
        if best < max(0.3, 3 * chance):
            out.append(f"Master weights: too few steps to show the lesson -- no run has learned the task yet (best "
                       f"{100 * best:.1f} %, chance {100 * chance:.1f} %); at lr {lr:g} the default model needs "
                       "~800 steps (the default takes up to 1000).")
        elif naive["val_acc"] < 0.5 * best:
            out.append(f"Master weights: bf16-naive (bf16 params, no fp32 master) reached "
                       f"{100 * naive['val_acc']:.1f} % (chance {100 * chance:.1f} %): at lr {lr:g} Adam's ~lr-sized "
                       f"updates are below half a bf16 ulp of most weights and round away; with fp32 masters: {acc}.")
        else:
            out.append(f"Master weights: at lr {lr:g} bf16-naive reached {100 * naive['val_acc']:.1f} %, close to the "
                       f"runs with masters ({acc}): its updates are large enough not to round away at this lr "
                       "(at the default 1e-4 they do).")
    nat = results.get("native_compute") or {}
    dev = results["device"]
    fp32 = runs.get("fp32")
    sixteen = [r for r in results["runs"] if r["name"] != "fp32" and r.get("speedup_vs_fp32")]
    speeds = ", ".join(f"{r['name']} {r['speedup_vs_fp32']:.2f}x" for r in sixteen)
    if fp32 is not None and sixteen:
        speeds = f" Measured here, tokens/s vs fp32: {speeds}."
    else:
        speeds = ""
    bf, fh = nat.get("bfloat16", {}), nat.get("float16", {})
    has_fp16 = any("fp16" in n for n in runs)
    if dev["type"] == "cpu":
        if bf.get("native"):
            out.append(f"Speed: this CPU computes bf16 natively ({bf['why']}): its bf16 GEMMs are faster than fp32 "
                       "ones, so a bf16 run gains where GEMMs dominate its step and can lose where casts and "
                       f"elementwise ops weigh as much.{speeds}"
                       + (" fp16 is not native on this CPU (" + fh.get("why", "?") + "): the fp16 runs show "
                          "the GradScaler recipe, not fp16 speed." if has_fp16 and not fh.get("native") else ""))
        else:
            out.append(f"Speed: this CPU does not compute bf16 natively ({bf.get('why', 'not measured')}). The bf16 "
                       "runs pay for that emulation in every bf16 op (in the GEMMs too, except where the GEMM column "
                       f"says mpkern: its fp32 GEMM of the upcast operands).{speeds} What mixed precision buys on "
                       "this machine is memory -- state bytes/param and the activations saved for backward (peak mem "
                       "also counts the temporaries of the GEMM path); speed needs native 16-bit compute: a CPU with "
                       "AVX512-BF16 or AMX, or a GPU (bf16 from compute capability 8.0).")
    else:
        out.append(f"Speed: {dev.get('name', 'this GPU')}: bf16 {'native' if bf.get('native') else 'not native'} "
                   f"({bf.get('why', '?')}); fp16 {'native' if fh.get('native') else 'not native'}.{speeds}")
    others = dev.get("other_processes_cores")
    if others is not None and others >= OTHERS_WARN:
        out.append(f"Timing caveat: other processes used {others:.2f} of the {dev.get('cores')} cores on average while "
                   "the runs trained: they compete for the cores, and torch's worker threads wait for each other "
                   f"when one is descheduled ({dev.get('threads')} threads here) -- tokens/s can drop several-fold "
                   "(measured on a 2-core VM with one other busy process: 10x). Re-run on a quiet machine, or compare "
                   "with --threads 1.")
    return out


_MEMORY_NOTE = {
    False: ("CPU peak memory = growth of the process's peak resident set size during the run (Linux VmHWM, "
            "reset per run via /proc/self/clear_refs after malloc_trim; includes allocator and oneDNN "
            "scratch, and the model/optimizer/activations). activation_bytes_saved_for_backward counts the "
            "distinct tensors autograd saved in one step (exact, allocator-independent)."),
    True: "CUDA peak memory = torch.cuda.max_memory_allocated during the run minus what was allocated before it.",
}


def _jsonable(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, torch.dtype):
        return str(v)
    return v


# ---- report -------------------------------------------------------------------------------------
def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2**20:.1f} MiB"


def format_table(results: dict[str, Any]) -> str:
    """The per-run table (markdown) of a :func:`run` report."""
    cols = ["run", "params", "compute", "GEMM", "tokens/s", "vs fp32", "peak mem", "act. saved", "state B/param",
            "final loss", "val acc", "skipped", "status"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results["runs"]:
        cells = [
            r["name"], r["param_dtype"], r["compute"], r.get("gemm", "?"),
            f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "n/a",
            f"{r['speedup_vs_fp32']:.2f}x" if r["speedup_vs_fp32"] else "n/a",
            _fmt_bytes(r["peak_mem_bytes"]), _fmt_bytes(r["activation_bytes_saved_for_backward"]),
            f"{r['state_bytes_per_param']['total']:.1f}",
            f"{r['final_loss']:.3f}" if math.isfinite(r["final_loss"]) else "nan",
            f"{100 * r['val_acc']:.1f} %" if r["val_acc"] is not None else "n/a",
            str(r["skipped_steps"]),
            "ok" if r["status"] == "ok" else f"diverged at step {r['diverged_at_step']}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_details(results: dict[str, Any]) -> str:
    """What exactly ran in each run (optimizer, clipping, linear layers), the loss-scale history,
    and the memory plan of the trained model -- the markdown below the table."""
    out = [f"* {line}" for line in results.get("lessons", [])]
    out += ["", "| run | optimizer | clipping | linear layers |", "|---|---|---|---|"]
    for r in results["runs"]:
        out.append(f"| {r['name']} | {r['optimizer']} | {r['clip']} | {r['linear']} |")
    for r in results["runs"]:
        if r["loss_scale_history"]:
            hist = ", ".join(f"{s:g}@{i}" for i, s in r["loss_scale_history"][:12])
            more = " ..." if len(r["loss_scale_history"]) > 12 else ""
            out.append(f"\n{r['name']} loss scale (value@step): {hist}{more}")
    out.append("")
    out.append(results["memory_note"])
    if results.get("plan"):
        from .plan import format_plan

        n = results["runs"][0]["params"]
        out.append(f"\nMemory plan for this model ({n:,} params; bytes/param measured from optimizer state tensors):\n")
        out.append(format_plan(results["plan"]))
    return "\n".join(out)


def _header(results: dict[str, Any]) -> str:
    c, d, t = results["config"], results["device"], results["task"]
    nat = results.get("native_compute") or {}
    native = "; ".join(f"{k} {'yes' if nat[k]['native'] else 'NO'} ({nat[k]['why']})"
                       for k in ("bfloat16", "float16") if k in nat) or "not measured"
    b = results.get("budget") or {}
    budget = f"; time budget {b['time_budget_s']:g} s: {b['why']}" if b.get("time_budget_s") else ""
    if c.get("hf_model"):
        model = f"transformers {results['model']['class']} from {c['hf_model']}"
    else:
        model = f"d_model {c['d_model']}, {c['layers']} layers, {c['heads']} heads"
    return (f"mpkern compare -- {d['name']} ({d['type']}), torch {results['versions']['torch']}, "
            f"{results['timestamp']}\n"
            f"model: {model} ({results['model']['params']:,} params), seq {c['seq_len']}, "
            f"batch {c['batch_size']}, {c['steps']} steps (first {c['warmup']} untimed), lr {c['lr']:g}, "
            f"clip {c['max_grad_norm']:g}, seed {c['seed']}{budget}\n"
            f"native 16-bit compute: {native}\n"
            f"task: {t['name']}, {t['classes']} classes (chance {100 * t['chance_acc']:.1f} %, ignoring the "
            f"query caps at 50 %), {t['val_sequences']} held-out validation sequences; "
            f"total wall time {results['wall_s']:.0f} s")


def write_outputs(results: dict[str, Any], out: str, *, plot: bool = True) -> dict[str, str]:
    """Write ``results.json``, ``results.md`` and (with matplotlib) ``compare.png`` into ``out``."""
    os.makedirs(out, exist_ok=True)
    paths = {"json": os.path.join(out, "results.json"), "md": os.path.join(out, "results.md")}
    with open(paths["json"], "w") as f:
        json.dump(results, f, indent=1, allow_nan=True)
    with open(paths["md"], "w") as f:
        f.write(_header(results).replace("\n", "  \n") + "\n\n" + format_table(results) + "\n\n"
                + format_details(results) + "\n")
    if plot:
        png = os.path.join(out, "compare.png")
        if plot_results(results, png):
            paths["png"] = png
    return paths


def plot_results(results: dict[str, Any], path: str) -> bool:
    """Loss curves, validation accuracy, tokens/s and peak memory in one PNG. False without matplotlib."""
    plt = pyplot("compare", "compare.png")
    if plt is None:
        return False
    runs = results["runs"]
    names = [r["name"] for r in runs]
    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    styles = ["-", "--", "-.", ":"]
    for i, r in enumerate(runs):
        ys = [float("nan") if v is None else v for v in r["losses"]]
        k = max(1, len(ys) // 60)  # smooth: running mean over k steps
        sm = [sum(ys[max(0, j - k + 1):j + 1]) / len(ys[max(0, j - k + 1):j + 1]) for j in range(len(ys))]
        # runs that learn identically overlap: distinct dashes and widths keep each one visible
        ax[0, 0].plot(range(1, len(sm) + 1), sm, ls=styles[i % len(styles)], lw=2.6 - 0.35 * i, color=f"C{i}",
                      label=r["name"] + ("" if r["status"] == "ok" else " (diverged)"))
    ax[0, 0].axhline(math.log(results["task"]["classes"]), color="gray", ls=":", lw=1, label="ln(classes): chance")
    ax[0, 0].set_xlabel("step")
    ax[0, 0].set_ylabel("train loss")
    ax[0, 0].set_title("training loss")
    ax[0, 0].legend(fontsize=8)

    def bars(a, vals, title, fmt):
        xs = range(len(names))
        a.bar(xs, [v or 0 for v in vals], color=[f"C{i}" for i in xs])
        a.set_xticks(list(xs))
        a.set_xticklabels(names, rotation=20, fontsize=8)
        a.set_title(title)
        for i, v in enumerate(vals):
            a.text(i, v or 0, "n/a" if v is None else fmt(v), ha="center", va="bottom", fontsize=8)

    bars(ax[0, 1], [None if r["val_acc"] is None else 100 * r["val_acc"] for r in runs],
         "validation accuracy (%)", lambda v: f"{v:.1f}")
    ax[0, 1].axhline(100 * results["task"]["chance_acc"], color="gray", ls=":", lw=1)
    bars(ax[1, 0], [r["tokens_per_s"] for r in runs], "tokens/s (steady state)", lambda v: f"{v:,.0f}")
    mem = [None if r["peak_mem_bytes"] is None else r["peak_mem_bytes"] / 2**20 for r in runs]
    bars(ax[1, 1], mem, "peak memory (MiB): " + runs[0]["peak_mem_kind"] if runs else "", lambda v: f"{v:.0f}")
    d = results["device"]
    fig.suptitle(f"mpkern compare: {d['name']} ({d['type']}), torch {results['versions']['torch']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
