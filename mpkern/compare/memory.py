"""Memory and machine-load meters of one run: CPU peak RSS, live tensor bytes, saved activations,
other processes' CPU time."""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable
from typing import Any

import torch

Tensor = torch.Tensor



# ---- memory -------------------------------------------------------------------------------------
class CpuPeak:
    """Peak RSS growth of this process over a region (Linux: VmHWM reset via /proc/self/clear_refs)."""

    def __init__(self) -> None:
        self.ok = False
        self.base = 0
        self._trim: Callable[[int], object] | None
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


def saved_bytes(fn: Callable[[], Any]) -> tuple[Any, int]:
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

OTHERS_WARN = 0.25


class OthersCpu:
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


class LiveBytes:
    """Peak bytes of the tensors created while it is active (a ``TorchDispatchMode``): every storage
    an op returns is counted from its creation until it is freed, so activations, grads and the
    temporaries between ops are all in ``peak``. Inside a custom op the mode sees no tensors: the
    fp32 temporaries of ``mpkern.linear``'s CPU GEMM path (operand copies, fp32 product) are told
    to it by :mod:`mpkern.matmul` at each call (``gemm_temp_peak``: the largest of them, a part of
    ``peak``). Allocator-independent and exact for what goes through the dispatcher (scratch memory
    a kernel allocates internally is not seen). Works for real and meta tensors."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        meter = self
        self.live = self.peak = self.gemm_temp_peak = 0
        self._seen: set[int] = set()

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        meter._add(t.untyped_storage())
                return out

        self._mode = _Mode()

    def _add(self, st: Any) -> None:
        import weakref

        key, n = id(st), st.nbytes()
        if n == 0 or key in self._seen:
            return
        self._seen.add(key)
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(st, self._free, key, n)

    def _free(self, key: int, n: int) -> None:
        self._seen.discard(key)
        self.live -= n

    def _temps(self, n: int) -> None:
        """A GEMM inside a custom op held ``n`` bytes of temporaries on top of what is live now."""
        self.gemm_temp_peak = max(self.gemm_temp_peak, n)
        self.peak = max(self.peak, self.live + n)

    def __enter__(self) -> LiveBytes:
        from ..matmul import temp_meter

        self._meter = temp_meter(self._temps)
        self._meter.__enter__()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        self._meter.__exit__(*exc)


def live_peak(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``fn`` under :class:`LiveBytes`; ``(result, peak bytes of the tensors it created)``."""
    with LiveBytes() as m:
        out = fn()
    return out, m.peak
