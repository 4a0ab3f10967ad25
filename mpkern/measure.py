"""Timing, bandwidth and machine helpers shared by ``mpkern bench`` and ``mpkern compare``.

One implementation of each measurement rule: how a call is timed (device synchronised at the
boundaries, median of repeats, untimed setup before each call), what the memory bandwidth of this
device is, how the machine is named in result files, and how results are written and plotted.

Device time on a GPU (:func:`event_time`, :func:`graph_time`, :func:`copy_bandwidth`): a call
timed between two synchronisations measures the host whenever the host side of the call is
slower than its kernels (a 200-tensor optimizer step: ~0.2-0.35 ms of Python and dispatch against
0.04-0.2 ms of H200 kernel time). These time *several back-to-back calls* between two CUDA events
recorded after a device-side hold (``torch.cuda._sleep``) long enough for the host to queue every
call first, so the device runs them without gaps and the events see kernel time only; each result
also carries the wall time of the same calls (what a training loop sees) and says whether the
queue really stayed ahead of the device (``queued_ahead``). Turning event times into per-call times
(:func:`per_call_ms`) is pure; rates are computed where they are shown
(the GPU check's summary, ``tools/gpu_check/tables.py``).
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import torch

__all__ = ["sync", "time_fn", "measure_bandwidth", "cpu_name", "cpu_flags", "machine_info", "device_info",
           "write_json", "pyplot", "per_call_ms", "event_time", "graph_time", "copy_bandwidth", "parse_size",
           "fmt_size"]


# memory sizes, as the CLI reads and the reports print them
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str | float | int) -> int:
    """Bytes of a memory size: ``"96MiB"``, ``"20GB"``, ``"1.5GiB"``, ``"4096"`` (bytes); ValueError otherwise."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        v = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"memory size: expected a number with an optional unit (B, KB, MB, GB, KiB, MiB, GiB), "
                             f"e.g. 96MiB or 20GB, got {text!r}")
        v = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"memory size must be positive, got {text!r}")
    return int(v)


def fmt_size(n: float | None) -> str:
    """``n`` bytes as KiB / MiB / GiB (``"n/a"`` for None)."""
    if n is None:
        return "n/a"
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def sync(device: torch.device) -> None:
    """Wait for the device (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device: torch.device, *, reps: int = 15, warmup: int = 3,
            setup: Callable[[], object] | None = None) -> float:
    """Median wall time of ``fn()`` in seconds; ``setup()`` runs untimed before each call."""
    return time_alternating([(fn, setup)], device, reps=reps, warmup=warmup)[0]


def time_alternating(fns: list[tuple[Callable[[], object], Callable[[], object] | None]], device: torch.device, *,
                     reps: int = 15, warmup: int = 3, rotate: bool = False) -> list[float]:
    """Median wall times (seconds) of several ``(fn, setup)`` pairs timed in alternation: each round
    runs every ``setup()`` (untimed) and ``fn()`` once, in order, so a slow stretch of a shared
    machine falls on all of them alike and their ratios hold where separate runs drift.

    ``rotate``: round ``r`` starts at pair ``r % len(fns)``, so each call follows each other call
    equally often (with ``reps`` a multiple of ``len(fns)``): a call that leaves the caches cold
    (a GEMM of large fp32 copies) does not always slow the same next one."""
    if not fns:
        raise ValueError("time_alternating: fns must name at least one (fn, setup) pair")
    if reps < 1:
        raise ValueError(f"time_alternating: reps must be >= 1, got {reps}")
    times: list[list[float]] = [[] for _ in fns]
    n = len(fns)
    for r in range(warmup + reps):
        for j in range(n):
            k = (j + r) % n if rotate else j
            fn, setup = fns[k]
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


# ---- device time on a GPU: CUDA events over back-to-back calls ------------------------------------
def per_call_ms(elapsed_ms: list[float], calls: int) -> float:
    """Median over rounds of ``elapsed / calls``: the per-call time of rounds that each timed
    ``calls`` back-to-back calls between two events (``elapsed_ms``: one total per round)."""
    if calls < 1:
        raise ValueError(f"per_call_ms: calls must be >= 1, got {calls}")
    if not elapsed_ms:
        raise ValueError("per_call_ms: no rounds were timed")
    bad = [e for e in elapsed_ms if not (isinstance(e, (int, float)) and math.isfinite(e) and e >= 0)]
    if bad:
        raise ValueError(f"per_call_ms: elapsed times must be finite non-negative numbers, got {bad}")
    return statistics.median(e / calls for e in elapsed_ms)


_CYCLES_PER_MS: dict[int, float] = {}


def _cycles_per_ms(device: torch.device) -> float:
    """GPU clock cycles per millisecond of ``torch.cuda._sleep`` on ``device`` (measured once)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CYCLES_PER_MS:
        with torch.cuda.device(idx):
            cycles = 20_000_000
            torch.cuda._sleep(cycles // 10)  # noqa: SLF001 -- wakes the clock up (see _cycles_per_ms)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(cycles)  # noqa: SLF001 -- torch's spin kernel: no public form
            b.record()
            b.synchronize()
            _CYCLES_PER_MS[idx] = cycles / max(a.elapsed_time(b), 1e-3)
    return _CYCLES_PER_MS[idx]


def event_time(fn: Callable[[], object], device: torch.device | str = "cuda", *, calls: int = 20, rounds: int = 5,
               warmup: int = 3) -> dict[str, Any]:
    """Kernel time and wall time of ``fn()`` on a CUDA device, in ms per call.

    ``kernel_ms``: per round, ``calls`` back-to-back calls between two CUDA events, the first
    recorded after a device-side hold (``torch.cuda._sleep``) of about three times the host's own
    time for those calls, so every call is queued before the device starts on them and the events
    time the kernels without host gaps; the median over ``rounds`` of total / ``calls``.
    ``wall_ms``: the same calls timed on the host, synchronised before and after (host and device
    together: what a loop of steps costs). ``queued_ahead``: in how many rounds the device was still
    in the hold when the last call had been queued (if not, the host was slower than the hold and
    ``kernel_ms`` may include gaps; a round like that is retried once with a longer hold).
    ``fn`` must not synchronise with the host (a step that does shows ``queued_ahead`` < rounds).
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"event_time: needs a CUDA device, got {dev}")
    if calls < 1 or rounds < 1 or warmup < 0:
        raise ValueError(f"event_time: calls and rounds must be >= 1 and warmup >= 0, got {calls}, {rounds}, {warmup}")
    with torch.cuda.device(dev):
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        walls = []
        for _ in range(rounds):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) * 1e3)
        wall_ms = per_call_ms(walls, calls)
        hold_ms = min(max(2.0, 3.0 * max(walls)), 5000.0)
        cycles_per_ms = _cycles_per_ms(dev)
        elapsed, ahead = [], 0
        for _ in range(rounds):
            for attempt in range(2):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(int(hold_ms * cycles_per_ms))  # noqa: SLF001 -- the device-side hold
                start.record()
                for _ in range(calls):
                    fn()
                end.record()
                was_ahead = not start.query()  # the device is still in the hold: every call is queued
                end.synchronize()
                if was_ahead or attempt == 1:
                    break
                hold_ms = min(2 * hold_ms, 5000.0)
            ahead += was_ahead
            elapsed.append(start.elapsed_time(end))
    return {"kernel_ms": per_call_ms(elapsed, calls), "wall_ms": wall_ms, "calls": calls, "rounds": rounds,
            "kernel_ms_rounds": [e / calls for e in elapsed], "wall_ms_rounds": [w / calls for w in walls],
            "hold_ms": hold_ms, "queued_ahead": ahead}


def graph_time(fn: Callable[[], object], device: torch.device | str = "cuda", *, calls: int = 20, rounds: int = 5,
               warmup: int = 3) -> dict[str, Any]:
    """``fn()`` captured once in a CUDA graph (after ``warmup`` eager calls on a side stream, as
    PyTorch's recipe does) and its replay timed like :func:`event_time` (``kernel_ms``: device
    time per replay; ``wall_ms``: host and device per replay). Capture errors propagate: the caller
    records them as the row's reason."""
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"graph_time: needs a CUDA device, got {dev}")
    with torch.cuda.device(dev):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
        out = event_time(graph.replay, dev, calls=calls, rounds=rounds, warmup=1)
        torch.cuda.synchronize()
        del graph
    return out


def copy_bandwidth(device: torch.device | str = "cuda", nbytes: int = 1 << 30, *, calls: int = 10,
                   rounds: int = 5) -> dict[str, Any]:
    """Device memory bandwidth from a large ``copy_`` (``nbytes`` read + ``nbytes`` written) and an
    in-place fp32 multiply, each timed with :func:`event_time`. Returns ``{"copy": {...},
    "inplace": {...}}`` with ``bytes_moved`` and ``kernel_ms``/``wall_ms`` per call (the GB/s,
    ``bytes_moved / kernel time``, is computed where it is shown). ``nbytes`` should be far larger
    than the L2 cache (default 1 GiB)."""
    dev = torch.device(device)
    if nbytes < 1 << 20:
        raise ValueError(f"copy_bandwidth: nbytes must be at least 1 MiB, got {nbytes}")
    n = nbytes // 4
    x = torch.rand(n, device=dev)
    y = torch.empty_like(x)
    res: dict[str, Any] = {}
    for name, fn in (("copy", lambda: y.copy_(x)), ("inplace", lambda: x.mul_(1.0000001))):
        t = event_time(fn, dev, calls=calls, rounds=rounds, warmup=2)
        t["bytes_moved"] = 2 * n * 4
        res[name] = t
    return res


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
