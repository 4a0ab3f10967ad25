"""The matmul route choice, timed once per problem and remembered: in memory and in a JSON file.

:mod:`mpkern.matmul_routes` asks :func:`choose` which of its candidate routes runs a problem
(device, dtypes, epilogue, operand layout, size bucket -- a :class:`Problem`). The first time a
problem is seen, each candidate is timed (fastest of a few calls after a warm-up, on scratch
outputs the caller provides) and the winner is kept:

* in memory, for the life of the process: later calls of the problem cost a dict lookup -- no
  timing, no host synchronisation;
* on disk, in ``<cache dir>/matmul_routes.json`` (``MPKERN_CACHE_DIR``, else
  ``$XDG_CACHE_HOME/mpkern``, else ``~/.cache/mpkern``), so the next process starts with it.

The disk file is a convenience, never a risk: plain JSON (never pickle -- a file anyone could write
must not run code); read defensively (a file that does not parse, or an entry that is not a known
route, is ignored); every entry carries the software it was measured with (torch, triton, CUDA,
driver, device or CPU model -- :func:`fingerprint`), and an entry of another fingerprint is stale:
ignored, and dropped at the next write. Writes go to a temporary file in the same folder and are
moved into place with ``os.replace`` (atomic on POSIX and Windows), so a reader sees the old file
or the new one, never half of one; two processes writing at once each leave a valid file (the last
one's). ``MPKERN_MATMUL_ROUTE_CACHE=0`` turns the disk file off (memory only).

No timing ever happens inside a CUDA-graph capture or while ``torch.compile`` traces: the caller's
``default`` route is taken there, and not remembered, so the next eager call still measures.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any, NamedTuple

import torch

__all__ = ["Problem", "choose", "cache_path", "entries", "fingerprint", "forget", "remembered", "timing_allowed"]

#: Another route replaces the caller's default only when it measures at least this many times faster
#: (a burst of load on a shared machine during the one timing must not fix a slower route for good).
MARGIN = 1.05
#: The file's format; a file of another format is ignored (and replaced at the next write).
FORMAT = 1
FILE_NAME = "matmul_routes.json"


class Problem(NamedTuple):
    """What a route is chosen for. Sizes are bucketed to the next power of two (a new batch size
    in the same bucket reuses the choice); ``layout`` says which operands are transposed views."""

    device: str      # "cuda:NVIDIA H100 80GB HBM3:sm_90" or "cpu:<model name>"
    dtype: str       # operand dtype, e.g. "bfloat16"
    out_dtype: str   # "bfloat16", "float16" or "float32"
    epilogue: str    # "none", "bias" or "accumulate"
    layout: str      # "nn", "nt", "tn" or "tt": a (row-major or transposed), b (row-major or transposed)
    m: int
    n: int
    k: int

    def key(self) -> str:
        return "|".join(str(v) for v in self)


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"


@cache
def _driver() -> str:
    try:
        return Path("/proc/driver/nvidia/version").read_text().splitlines()[0].strip()
    except (OSError, IndexError):
        return "none"


@cache
def fingerprint(device_type: str) -> str:
    """The software and hardware a timing on ``device_type`` depends on: torch, triton, CUDA and the
    driver for ``cuda``; torch, oneDNN's ISA cap and the CPU for ``cpu``. An entry measured under
    another fingerprint is stale."""
    parts = [f"torch {torch.__version__}"]
    if device_type == "cuda":
        parts += [f"triton {_version('triton')}", f"cuda {torch.version.cuda}", f"driver {_driver()}"]
    else:
        isa = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "default"
        parts += [f"machine {platform.machine()}", f"onednn isa {isa}"]
    return "; ".join(parts)


def cache_path() -> Path | None:
    """Where the disk cache lives, or None when ``MPKERN_MATMUL_ROUTE_CACHE=0`` turns it off."""
    if os.environ.get("MPKERN_MATMUL_ROUTE_CACHE", "1").strip() == "0":
        return None
    root = os.environ.get("MPKERN_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "mpkern")
    return Path(root) / FILE_NAME


# ---- memory -------------------------------------------------------------------------------------
_lock = threading.Lock()
_memory: dict[str, str] = {}


_disk: dict[str, dict[str, Any]] | None = None  # the file's entries, read once per process (or after forget())


def remembered(problem: Problem) -> str | None:
    """The route remembered for ``problem`` (memory, then the disk file as read at first use), or None."""
    global _disk
    key = problem.key()
    route = _memory.get(key)
    if route is not None:
        return route
    if _disk is None:
        _disk = _read_file()
    entry = _disk.get(key)
    if entry is None or entry.get("fingerprint") != fingerprint(problem.device.split(":", 1)[0]):
        return None
    route = entry.get("route")
    if not isinstance(route, str):
        return None
    _memory[key] = route
    return route


def forget() -> None:
    """Drop the in-memory choices and the copy of the file: the next call of each problem reads the
    file again, or measures."""
    global _disk
    with _lock:
        _memory.clear()
        _disk = None


def entries(device_prefix: str = "") -> list[dict[str, Any]]:
    """The disk file's up-to-date entries whose device starts with ``device_prefix`` (e.g. ``"cpu"``):
    ``{"problem": Problem, "route", "ms"}`` each (``mpkern info``)."""
    out = []
    for key, entry in sorted(_read_file().items()):
        fields = key.split("|")
        if len(fields) != len(Problem._fields) or not key.startswith(device_prefix):
            continue
        try:
            prob = Problem(*fields[:5], *(int(f) for f in fields[5:]))  # type: ignore[arg-type]
        except ValueError:
            continue
        if entry.get("fingerprint") == fingerprint(prob.device.split(":", 1)[0]):
            out.append({"problem": prob, "route": entry.get("route"), "ms": entry.get("ms", {})})
    return out


# ---- disk ---------------------------------------------------------------------------------------
def _read_file() -> dict[str, dict[str, Any]]:
    """The file's entries, or {} when it is absent, unreadable, not JSON or of another format."""
    path = cache_path()
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
        return {}
    return {k: v for k, v in data["entries"].items() if isinstance(k, str) and isinstance(v, dict)}


def _write_entry(problem: Problem, route: str, ms: Mapping[str, float]) -> None:
    """Merge one entry into the file, dropping stale ones, and move the new file into place."""
    path = cache_path()
    if path is None:
        return
    fp = fingerprint(problem.device.split(":", 1)[0])
    entries = {k: v for k, v in _read_file().items()
               if v.get("fingerprint") == fingerprint(str(k).split(":", 1)[0])}
    entries[problem.key()] = {"route": route, "ms": {r: round(t, 4) for r, t in ms.items()}, "fingerprint": fp,
                              "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".matmul_routes.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"format": FORMAT, "entries": entries}, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:  # a read-only or full cache folder: the choice still lives in memory
        return


# ---- timing -------------------------------------------------------------------------------------
def timing_allowed(device: torch.device) -> bool:
    """False inside a CUDA-graph capture or a ``torch.compile`` trace: no timing (and no host sync)."""
    if torch.compiler.is_compiling():
        return False
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _seconds(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """The fastest of ``reps`` calls of ``fn`` after one warm-up call (CUDA: events, synchronised)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return best


def choose(problem: Problem, device: torch.device, runs: Mapping[str, Callable[[], Any]], default: str,
           reps: int = 3) -> str:
    """The route for ``problem`` among ``runs`` (route -> a call that runs it on scratch outputs).

    One candidate: it. Remembered (memory or an up-to-date disk entry naming a candidate): that.
    Inside a capture or a compile trace: ``default``, not remembered. Otherwise each candidate is
    timed (:func:`_seconds`), the fastest -- ``default`` unless another is :data:`MARGIN` times
    faster -- is remembered in memory and on disk, and returned.
    """
    if len(runs) == 1:
        return next(iter(runs))
    route = remembered(problem)
    if route is not None and route in runs:
        return route
    if not timing_allowed(device):
        return default
    ms = {name: _seconds(fn, device, reps) * 1e3 for name, fn in runs.items()}
    route = min(ms, key=lambda r: ms[r])
    if default in ms and ms[route] * MARGIN >= ms[default]:
        route = default  # within the margin: the default (the platform GEMM), so noise cannot flip it
    with _lock:
        _memory[problem.key()] = route
    _write_entry(problem, route, ms)
    return route
