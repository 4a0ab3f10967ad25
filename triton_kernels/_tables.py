"""Device work tables of the Triton multi-tensor kernels, built once per tensor layout and cached.

A work table lists (tensor, chunk) items with the tensors' addresses; it depends only on the
*layout* of the tensor list -- each tensor's address, size and dtype -- so it is cached under that
layout. A step over the same params, grads and optimizer state finds the table an earlier step
built: no host-side table building and no host-to-device copy per step, and the kernels can be
captured in a CUDA graph. Params moved to new storage, a new param group or new grads are a new
layout and get a new table (outside a capture; inside one, building is an error that says why).
The key costs one pass over the tensors (not over their chunks).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

MAX_TABLES = 256

_CAPTURE_MESSAGE = (
    "mpkern: cannot capture this call in a CUDA graph: its tensor list (addresses, sizes or dtypes) has no "
    "device work table yet, and building one needs a host-to-device copy. Run the same call once eagerly "
    "before capturing (a warm-up step), and keep the params, grads and optimizer state in the same storage "
    "between warm-up and capture.")


class TableCache:
    """Least-recently-used cache of device work tables, keyed by layout.

    Attributes:
        builds: how many tables were built (tests and benchmarks read it).
    """

    def __init__(self, max_entries: int = MAX_TABLES) -> None:
        self.max_entries = max_entries
        self.builds = 0
        self._entries: OrderedDict[Hashable, Any] = OrderedDict()
        self._captured: dict[Hashable, Any] = {}  # used by a captured graph: never evicted

    def get(self, key: Hashable, device: torch.device, build: Callable[[], Any]) -> Any:
        """The table for ``key``; ``build()`` makes it on a miss (never during a CUDA graph capture)."""
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        entry = self._captured.get(key)
        if entry is None:
            entry = self._entries.get(key)
        if entry is not None:
            if key in self._entries:
                self._entries.move_to_end(key)
            if capturing:
                self._captured[key] = entry
            return entry
        if capturing:
            raise RuntimeError(_CAPTURE_MESSAGE)
        entry = build()
        self.builds += 1
        self._entries[key] = entry
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return entry

    def clear(self) -> None:
        """Drop every table that no captured CUDA graph uses."""
        self._entries.clear()


#: The one cache of every Triton multi-tensor kernel.
TABLES = TableCache()


def layout(tensors: Sequence[torch.Tensor | None]) -> tuple:
    """The part of a tensor list a work table depends on: (address, size, dtype) per tensor."""
    return tuple((0, 0, None) if t is None else (t.data_ptr(), t.numel(), t.dtype) for t in tensors)


def to_device(rows: list[list[int]] | list[tuple[int, ...]], width: int, device: torch.device) -> torch.Tensor:
    """An int64 [len(rows), width] device tensor from host rows (pinned, asynchronous copy)."""
    host = torch.tensor(rows, dtype=torch.int64).reshape(-1, width)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def common_head(buffers: Sequence[tuple[int, int]], vec: int = 8) -> int:
    """Smallest ``h`` in ``[0, vec)`` such that element ``h`` of every buffer is 16-byte aligned.

    ``buffers``: ``(address, element size)`` pairs (address 0: absent, ignored). -1 if no such
    element exists (e.g. a bf16 view at an odd element offset next to an aligned fp32 buffer).
    """
    for h in range(vec):
        if all(a == 0 or (a + h * es) % 16 == 0 for a, es in buffers):
            return h
    return -1


def work_ranges(numel: int, head: int, chunk: int, vec: int) -> list[tuple[int, int, bool]]:
    """``(begin, end, aligned)`` element ranges covering ``[0, numel)``, none longer than ``chunk``.

    The aligned body starts at element ``head`` (see :func:`common_head`; -1: no body) and ends at
    a multiple of ``vec`` elements from there; its ranges are relative to element ``head`` (begin
    a multiple of ``chunk``, end a multiple of ``vec``). The head and the tail are unaligned
    ranges in absolute element indices.
    """
    if head < 0 or head >= numel:
        return [(b, min(numel, b + chunk), False) for b in range(0, numel, chunk)]
    body = (numel - head) // vec * vec
    out = [(b, min(body, b + chunk), True) for b in range(0, body, chunk)]
    if head:
        out.append((0, head, False))
    if head + body < numel:
        out.append((head + body, numel, False))
    return out
