"""Timing, bandwidth and machine helpers shared by ``mpkern bench`` and ``mpkern compare``.

One implementation of each measurement rule: how a call is timed (device synchronised at the
boundaries, median of repeats, untimed setup before each call), what the memory bandwidth of this
device is, how the machine is named in result files, and how results are written and plotted.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import torch

__all__ = ["sync", "time_fn", "measure_bandwidth", "cpu_name", "cpu_flags", "machine_info", "device_info",
           "write_json", "pyplot"]


def sync(device: torch.device) -> None:
    """Wait for the device (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device: torch.device, *, reps: int = 15, warmup: int = 3,
            setup: Callable[[], object] | None = None) -> float:
    """Median wall time of ``fn()`` in seconds; ``setup()`` runs untimed before each call."""
    return time_alternating([(fn, setup)], device, reps=reps, warmup=warmup)[0]


def time_alternating(fns: list[tuple[Callable[[], object], Callable[[], object] | None]], device: torch.device, *,
                     reps: int = 15, warmup: int = 3) -> list[float]:
    """Median wall times (seconds) of several ``(fn, setup)`` pairs timed in alternation: each round
    runs every ``setup()`` (untimed) and ``fn()`` once, in order, so a slow stretch of a shared
    machine falls on all of them alike and their ratios hold where separate runs drift."""
    if not fns:
        raise ValueError("time_alternating: fns must name at least one (fn, setup) pair")
    if reps < 1:
        raise ValueError(f"time_alternating: reps must be >= 1, got {reps}")
    times: list[list[float]] = [[] for _ in fns]
    for r in range(warmup + reps):
        for k, (fn, setup) in enumerate(fns):
            if setup:
                setup()
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            if r >= warmup:
                times[k].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def measure_bandwidth(device: torch.device, nbytes: int = 1 << 28) -> dict[str, float]:
    """Achievable memory bandwidth (GB/s) of an in-place fp32 multiply (read + write) and a copy."""
    n = nbytes // 4
    x = torch.rand(n, device=device)
    y = torch.empty_like(x)
    t_inplace = time_fn(lambda: x.mul_(1.0000001), device, reps=10)
    t_copy = time_fn(lambda: y.copy_(x), device, reps=10)
    return {"inplace_GBps": 2 * nbytes / t_inplace / 1e9, "copy_GBps": 2 * nbytes / t_copy / 1e9}


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags(text: str | None = None) -> set[str]:
    """The feature flags of the first CPU listed in ``/proc/cpuinfo`` (or in ``text``); empty if unknown."""
    if text is None:
        try:
            with open("/proc/cpuinfo") as f:
                text = f.read()
        except OSError:
            return set()
    for line in text.splitlines():
        key, _, val = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(val.split())
    return set()


def machine_info(device: torch.device) -> dict[str, Any]:
    """Timestamp, versions and device name for result files."""
    info: dict[str, Any] = {
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        info["device"] = torch.cuda.get_device_name(device)
    else:
        info["device"] = (f"{cpu_name()} {platform.machine()} ({os.cpu_count()} cores, "
                          f"ATen {torch.backends.cpu.get_cpu_capability()})")
    return info


def device_info(device: torch.device) -> dict[str, Any]:
    """The device as a dict: type and name, plus capability (CUDA) or cores/threads/ATen SIMD (CPU)."""
    if device.type == "cuda":
        return {"type": "cuda", "name": torch.cuda.get_device_name(device),
                "capability": list(torch.cuda.get_device_capability(device))}
    return {"type": "cpu", "name": cpu_name(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "aten_capability": torch.backends.cpu.get_cpu_capability()}


def write_json(result: dict[str, Any], path: str) -> None:
    """Write a result dict as indented JSON (creating the directory)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def pyplot(who: str, what: str) -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or None after a one-line notice (``[who] ... no what``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"[{who}] matplotlib is not installed: no {what} (pip install matplotlib)")
        return None
    return plt
