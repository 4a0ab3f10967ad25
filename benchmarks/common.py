"""Shared benchmark helpers: timing, memory-bandwidth measurement, result files."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone

import torch

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


def tensor_sizes(total: int, count: int, seed: int = 0) -> list[int]:
    """``count`` random tensor sizes (within a factor ~10 of each other) summing to ``total``."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(count, generator=g) + 0.1
    sizes = (w / w.sum() * total).long().clamp(min=1)
    sizes[-1] += total - int(sizes.sum())
    return sizes.tolist()


def size_args(description: str, reps: int) -> argparse.ArgumentParser:
    """The common command line of the optimizer-side benchmarks."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=32e6, help="total parameters (default 32M)")
    ap.add_argument("--tensors", type=int, default=200, help="number of tensors (default 200)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=reps, help="timed repetitions (median reported)")
    return ap


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device: torch.device, *, reps: int = 15, warmup: int = 3,
            setup: Callable[[], object] | None = None) -> float:
    """Median wall time of ``fn()`` in seconds; ``setup()`` runs untimed before each call."""
    for _ in range(warmup):
        if setup:
            setup()
        fn()
    times = []
    for _ in range(reps):
        if setup:
            setup()
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_bandwidth(device: torch.device, nbytes: int = 1 << 28) -> dict[str, float]:
    """Achievable memory bandwidth (GB/s) of an in-place fp32 multiply (read + write) and a copy."""
    n = nbytes // 4
    x = torch.rand(n, device=device)
    y = torch.empty_like(x)
    t_inplace = time_fn(lambda: x.mul_(1.0000001), device, reps=10)
    t_copy = time_fn(lambda: y.copy_(x), device, reps=10)
    return {"inplace_GBps": 2 * nbytes / t_inplace / 1e9, "copy_GBps": 2 * nbytes / t_copy / 1e9}


def machine_info(device: torch.device) -> dict[str, object]:
    info: dict[str, object] = {
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        info["device"] = torch.cuda.get_device_name(device)
    else:
        info["device"] = f"CPU {platform.machine()} ({os.cpu_count()} cores, ATen {torch.backends.cpu.get_cpu_capability()})"
    return info


def write_results(name: str, meta: dict, rows: list[dict]) -> str:
    """Write ``out/<name>.json`` and ``out/<name>.md``; return the markdown table."""
    os.makedirs(OUT_DIR, exist_ok=True)
    with open(os.path.join(OUT_DIR, f"{name}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    cols = list(rows[0].keys()) if rows else []
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in r.values()) + " |")
    md = "\n".join(lines)
    with open(os.path.join(OUT_DIR, f"{name}.md"), "w") as f:
        f.write(f"{meta}\n\n{md}\n")
    return md
