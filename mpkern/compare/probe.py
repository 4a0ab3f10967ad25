"""What this device computes natively (a measured GEMM probe) and which Linear path the 16-bit runs take."""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..measure import cpu_flags, sync
from .config import DTYPE_NAME, SIXTEEN_BIT_PARAMS, Config
from .task import make_task

Tensor = torch.Tensor



# ---- what this device computes natively ---------------------------------------------------------
#: CPU flags (``/proc/cpuinfo``: x86 ``flags``, Arm ``Features``) that mean native 16-bit arithmetic.
CPU_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16", "bf16"), "float16": ("avx512_fp16", "amx_fp16", "fphp")}
#: Environment variables that cap the instruction set oneDNN (ATen's bf16/fp16 GEMM on CPU) may use.
ISA_LIMITS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
#: A 16-bit GEMM at least this fraction of the fp32 GEMM's speed counts as computed natively on CPU.
#: Measured (one thread): native bf16 (AVX512-BF16 / AMX) 1.8-6x fp32, bf16 emulated by oneDNN on
#: AVX-512 0.3-0.5x, on AVX2 0.02-0.3x, fp16 without AVX512-FP16 ~0.02x -- the threshold sits far from both.
NATIVE_MIN_SPEED = 0.7
#: ``--linear auto`` on a CPU with native 16-bit compute: ATen's 16-bit GEMM (no fp32 operand copies)
#: unless mpkern's fp32 GEMM path measures at least this many times faster.
LINEAR_MARGIN = 1.25
#: ``--threads`` unset: all of torch's threads only when they make the probe GEMM at least this much
#: faster than one thread (median of interleaved repeats); else one thread (see :func:`choose_threads`).
THREADS_MIN_GAIN = 1.25

GPU_MIN_CAPABILITY = {"bfloat16": (8, 0), "float16": (7, 0)}


@contextmanager
def cpu_threads(device: torch.device, n: int | None) -> Iterator[None]:
    """Run the block with ``n`` torch threads on CPU (restored after); a no-op elsewhere or for None."""
    if device.type != "cpu" or n is None:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _interleaved(fns: dict[str, Callable[[], Any]], device: torch.device, reps: int,
                 cap_s: float = 0.6) -> dict[str, list[float]]:
    """Seconds of ``reps`` timed calls of each function (after one untimed call), interleaved so that
    a burst of load on a shared machine hits every candidate alike. A candidate whose calls add up
    to more than ``cap_s`` seconds stops early (a slow path needs no precise number)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()
    sync(device)
    for _ in range(reps):
        for k, f in fns.items():
            if sum(times[k]) > cap_s:
                continue
            t = time.perf_counter()
            f()
            sync(device)
            times[k].append(time.perf_counter() - t)
    return times


def _min_ms(fns: dict[str, Callable[[], Any]], device: torch.device, reps: int, cap_s: float = 0.6) -> dict[str, float]:
    """Fastest of ``reps`` interleaved timed calls of each function, in ms (see :func:`_interleaved`)."""
    return {k: 1e3 * min(v) for k, v in _interleaved(fns, device, reps, cap_s).items()}


def _median_ms(fns: dict[str, Callable[[], Any]], device: torch.device, reps: int,
               cap_s: float = 0.6) -> dict[str, float]:
    """Median of ``reps`` interleaved timed calls of each function, in ms: what a run typically meets."""
    return {k: 1e3 * statistics.median(v) for k, v in _interleaved(fns, device, reps, cap_s).items()}


def compute_support(device: str | torch.device, m: int = 1024, k: int = 128, n: int = 512, *, reps: int = 7,
                    flags: set[str] | None = None,
                    timer: Callable[[dict, torch.device, int], dict[str, float]] | None = None) -> dict[str, Any]:
    """Whether ``device`` computes bfloat16 / float16 natively, and what that rests on.

    CPU: the CPU flags (:data:`CPU_FLAGS`) *and* a measured probe -- an (m, k) @ (k, n) GEMM in
    fp32, bf16 and fp16 through ATen on one thread, fastest of ``reps`` interleaved calls (a ratio of
    instruction sets: one thread keeps it when another process loads the machine, where several
    threads wait for each other -- measured 0.45 vs 7.8 ms for the same fp32 GEMM); a dtype counts as
    native when its GEMM runs at >= :data:`NATIVE_MIN_SPEED` of the fp32 speed (the measurement decides: oneDNN may be
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
    ops: dict[str, Callable[[], Any]] = {}
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        a, b = a32.to(dt), b32.to(dt)
        ops[DTYPE_NAME[dt]] = partial(torch.mm, a, b)
    with cpu_threads(dev, 1):
        ms = (timer or _min_ms)(ops, dev, reps)
    out["gemm"] = {"shape": [m, k, n], "ms": ms, "threads": 1 if dev.type == "cpu" else None}
    for name in ("bfloat16", "float16"):
        speed = ms["float32"] / ms[name] if ms[name] > 0 else math.inf
        probe = f"a {m}x{k}x{n} {name} GEMM ran at {speed:.2f}x the fp32 GEMM's speed"
        if cap is not None:
            need = GPU_MIN_CAPABILITY[name]
            native = tuple(cap) >= need
            why = (f"compute capability {cap[0]}.{cap[1]} {'>=' if native else '<'} {need[0]}.{need[1]}; {probe}")
        else:
            native = speed >= NATIVE_MIN_SPEED
            assert flags is not None  # no capability: a CPU, whose flags were read above
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
                  native: dict[str, Any] | None = None, reps: int = 5,
                  timer: Callable[[dict, torch.device, int], dict[str, float]] | None = None) -> dict[str, Any]:
    """``--linear auto``: which GEMM the 16-bit-param runs use for the model's Linear layers
    (``shapes``, from :func:`linear_shapes`) in ``dtype`` on ``device``.

    Candidates, both accumulating in fp32: ``torch`` -- ``F.linear`` on the 16-bit tensors (ATen's
    GEMM: oneDNN on CPU, cuBLAS on CUDA) -- and ``mpkern`` -- :func:`mpkern.linear`, which itself takes
    the faster of its routes per shape (:mod:`mpkern.matmul_routes`: the platform GEMM where it keeps
    fp32 accumulation, Triton on CUDA, the fp32 GEMM of upcast operands).

    CPU: decided by the native-compute probe first (``native``: :func:`compute_support`'s entry for
    ``dtype``): a dtype the CPU does not compute natively (its GEMM measured below
    :data:`NATIVE_MIN_SPEED` of fp32, e.g. 0.02-0.06x on an AVX2-only CPU) takes ``mpkern`` without
    timing the emulated GEMM. Otherwise one forward + backward of the GEMMs is timed both ways on one
    thread (fastest of ``reps`` interleaved calls) and ``torch`` is kept unless ``mpkern`` measures
    :data:`LINEAR_MARGIN` times faster -- a decision a burst of load cannot flip. CUDA: cuBLAS may
    reduce 16-bit products in reduced precision unless
    ``torch.backends.cuda.matmul.allow_{bf16,fp16}_reduced_precision_reduction`` is False: then only
    ``mpkern`` counts as correct; else the faster wins. Returns ``{"chosen", "ms", "why", ...}``.
    """
    from .. import linear as mp_linear
    from ..matmul import route_summary

    dev = torch.device(device)
    dname = DTYPE_NAME[dtype]
    what = {"torch": f"ATen {dname} GEMM (F.linear)",
            "mpkern": f"mpkern.linear (route {route_summary(dev, dtype)}; fp32 accumulation, one rounding)"}
    res: dict[str, Any] = {"dtype": dname, "candidates": what, "ms": {}, "gemms": len(shapes)}
    if not shapes:
        return res | {"chosen": "torch", "why": "the model has no torch.nn.Linear layers to convert"}
    if dev.type == "cpu" and native is not None and not native.get("native", True):
        return res | {"chosen": "mpkern", "why": (
            f"the native-compute probe measured ATen's {dname} GEMM at {native['speed_vs_fp32']:.2f}x of fp32 on "
            f"this CPU (emulated, < {NATIVE_MIN_SPEED}x): {what['mpkern']}")}
    allowed = ["torch", "mpkern"]
    if dev.type == "cuda":
        flag = f"allow_{'bf16' if dtype == torch.bfloat16 else 'fp16'}_reduced_precision_reduction"
        if getattr(torch.backends.cuda.matmul, flag, True):
            allowed = ["mpkern"]
            res["why"] = (f"torch.backends.cuda.matmul.{flag} is True: cuBLAS may reduce in {dname}, so "
                          "only the fp32-accumulating mpkern GEMM counts as correct")
    fns = _linear_calls(shapes, dtype, dev, {"torch": F.linear, "mpkern": mp_linear})
    with cpu_threads(dev, 1):
        res["ms"] = (timer or _min_ms)({k: fns[k] for k in allowed}, dev, reps)
    ms = res["ms"]
    if len(allowed) == 1:
        chosen = allowed[0]
    elif dev.type == "cpu":
        chosen = "mpkern" if ms["mpkern"] * LINEAR_MARGIN <= ms["torch"] else "torch"
    else:
        chosen = min(allowed, key=lambda k: ms[k])
    if "why" not in res:
        other = "mpkern" if chosen == "torch" else "torch"
        rule = (f" (ATen's unless mpkern's is {LINEAR_MARGIN:g}x faster: no fp32 operand copies)"
                if dev.type == "cpu" else "")
        res["why"] = (f"measured on this device{' on one thread' if dev.type == 'cpu' else ''}, one forward+backward "
                      f"of the model's {len(shapes)} Linear GEMMs in {dname}: {what[chosen]} {ms[chosen]:.2f} ms vs "
                      f"{what[other]} {ms[other]:.2f} ms{rule}")
    return res | {"chosen": chosen}


def _linear_calls(shapes: Sequence[tuple[int, int, int, bool]], dtype: torch.dtype, dev: torch.device,
                  impl: dict[str, Callable[..., Tensor]]) -> dict[str, Callable[[], None]]:
    """One forward + backward of every Linear GEMM in ``shapes`` through each of ``impl``."""
    g = torch.Generator().manual_seed(1)
    data = []
    for rows, fin, fout, has_bias in sorted(set(shapes)):
        x = torch.randn(rows, fin, generator=g).to(dev, dtype).requires_grad_()
        w = (torch.randn(fout, fin, generator=g) * fin**-0.5).to(dev, dtype).requires_grad_()
        b = torch.randn(fout, generator=g).to(dev, dtype).requires_grad_() if has_bias else None
        gy = torch.randn(rows, fout, generator=g).to(dev, dtype)
        data.append((shapes.count((rows, fin, fout, has_bias)), x, w, b, gy))

    def fwd_bwd(f: Callable[..., Tensor]) -> Callable[[], None]:
        def go() -> None:
            for count, x, w, b, gy in data:
                for _ in range(count):
                    f(x, w, b).backward(gy)
        return go

    return {k: fwd_bwd(f) for k, f in impl.items()}


def _others_load() -> float | None:
    """The 1-minute load average (``/proc/loadavg``): before compare starts its work, what other
    processes kept runnable over the last minute -- a longer look at the machine than any probe."""
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def choose_threads(device: torch.device, requested: int, m: int, k: int, n: int, *, reps: int = 15,
                   load: float | str | None = "read",
                   timer: Callable[[dict, torch.device, int], dict[str, float]] | None = None) -> dict[str, Any]:
    """The torch threads the runs train with (set here). ``requested`` (``--threads``) > 0 is taken
    as given. Unset on CPU: the cores other processes leave free (cores less the 1-minute load
    average, ``load``; at most torch's threads, at least one), and more than one only when an
    (m, k) @ (k, n) fp32 GEMM, timed on one thread and on that many interleaved (median of ``reps``),
    is :data:`THREADS_MIN_GAIN` times faster on them. On a machine where another process keeps a
    core busy, torch's threads wait for each other at every op (measured on 2 cores: the same GEMM
    0.45 ms on one thread, 7.8-11 ms on two) and one thread trains several times faster."""
    avail = torch.get_num_threads()
    if device.type != "cpu":
        return {"threads": avail, "why": f"{device.type}: torch's {avail} threads (host side only)"}
    if requested:
        torch.set_num_threads(requested)
        return {"threads": requested, "why": f"--threads {requested}"}
    if load == "read":
        load = _others_load()
    elif isinstance(load, str):
        raise ValueError(f"load must be a number, None or 'read', got {load!r}")
    cores = os.cpu_count() or avail
    free = avail if load is None else min(avail, max(1, int(cores - load + 0.5)))
    out: dict[str, Any] = {"available": avail, "cores": cores, "load_1min": load}
    if free <= 1:
        torch.set_num_threads(1)
        why = ("torch has one thread here" if avail <= 1 else
               f"the 1-minute load average is {load:.2f} on {cores} cores: other processes keep the cores busy and "
               "torch's threads would wait for each other -- one thread (--threads N overrides)")
        return out | {"threads": 1, "why": why}
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)

    def at(t: int) -> Callable[[], None]:
        def go() -> None:
            with cpu_threads(device, t):
                torch.mm(a, b)
        return go

    ms = (timer or _median_ms)({"1": at(1), str(free): at(free)}, device, reps)
    gain = ms["1"] / ms[str(free)] if ms[str(free)] > 0 else math.inf
    use = free if gain >= THREADS_MIN_GAIN else 1
    torch.set_num_threads(use)
    why = (f"a {m}x{k}x{n} fp32 GEMM took {ms[str(free)]:.2f} ms on {free} threads vs {ms['1']:.2f} ms on one "
           f"(median of {reps}, interleaved): {gain:.2f}x")
    why += (f"; 1-minute load average {load:.2f}" if load is not None else "")
    why += (f": {free} threads" if use == free else
            f" < {THREADS_MIN_GAIN:g}x -- other processes keep the cores busy and torch's threads would wait for "
            "each other: one thread (--threads N overrides)")
    return out | {"ms": ms, "gain": gain, "threads": use, "why": why}


def measure_device(cfg: Config, base: nn.Module) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The native-compute probe (at the model's largest GEMM), the torch threads the runs use
    (:func:`choose_threads`, in ``support["threads"]``) and, for ``--linear auto``, the Linear
    choice of each 16-bit param dtype the runs use (decided from the probe where it is clear)."""
    dev = torch.device(cfg.device)
    ids = make_task(replace(cfg, steps=1, val_size=1)).x_train[:1]
    one = linear_shapes(base, ids)  # one sequence on CPU in fp32; rows scale with the batch
    shapes = [(rows * cfg.batch_size, fin, fout, b) for rows, fin, fout, b in one]
    if shapes:
        m, k, n, _ = max(shapes, key=lambda t: t[0] * t[1] * t[2])
    else:
        m, k, n = cfg.batch_size * cfg.seq_len, cfg.d_model, 4 * cfg.d_model
    support = compute_support(dev, m, k, n)
    support["threads"] = choose_threads(dev, cfg.threads, m, k, n)
    choice: dict[str, dict[str, Any]] = {}
    if cfg.linear == "auto":
        dtypes = {torch.float16 if p.endswith("fp16") else torch.bfloat16
                  for p in cfg.precisions if p in SIXTEEN_BIT_PARAMS}
        for dt in sorted(dtypes, key=str):
            choice[DTYPE_NAME[dt]] = choose_linear(shapes, dt, dev, native=support.get(DTYPE_NAME[dt]))
    return support, choice
