"""What this device computes natively (a measured GEMM probe) and which Linear path the 16-bit runs take."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..measure import cpu_flags, sync
from .config import _DTYPE_NAME, SIXTEEN_BIT_PARAMS, Config
from .task import make_task

Tensor = torch.Tensor



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
    from .. import linear as mp_linear
    from ..matmul import backend_for

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

def measure_device(cfg: Config, base: nn.Module) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
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
                  for p in cfg.precisions if p in SIXTEEN_BIT_PARAMS}
        for dt in sorted(dtypes, key=str):
            choice[_DTYPE_NAME[dt]] = choose_linear(shapes, dt, dev)
    return support, choice
