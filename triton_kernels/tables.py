"""Device work tables of the Triton multi-tensor kernels, built once per tensor layout and cached.

A work table lists (tensor, chunk) items with the tensors' addresses; it depends only on the
*layout* of the tensor list -- each tensor's address, size and dtype -- so it is cached under that
layout. A step over the same params, grads and optimizer state finds the table an earlier step
built: no host-side table building and no host-to-device copy per step, and the kernels can be
captured in a CUDA graph. Params moved to new storage, a new param group or new grads are a new
layout and get a new table. The key costs one pass over the tensors (not over their chunks).

CUDA graphs: a table a capture uses is pinned (never evicted, not cleared). A capture that misses
-- PyTorch's whole-network recipe, ``zero_grad(set_to_none=True)`` then forward, backward and
``step()`` inside ``torch.cuda.graph``, allocates the grads in the graph's pool, so their layout is
new -- builds the table beside the capture (:func:`build_beside_capture`): on a side stream, in
the allocator's ordinary pool, waited for on the host before the capture goes on, so the graph
holds no copy of its own and every replay (and every later eager call) reads the finished table.
The same rules as the CUDA backend's cache (csrc/cuda/table_lru.h, table_cache.cpp).
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch

MAX_TABLES = 256
_CAPTURE_MODE_RELAXED = 2  # CU_STREAM_CAPTURE_MODE_RELAXED (cuda.h)


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors of a cached entry: itself, or those in its tuple/list items or attributes."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        items = value
    elif hasattr(value, "__dict__"):
        items = list(vars(value).values())
    else:
        return []
    return [t for item in items for t in _tensors_in(item)]


class StreamUse:
    """Cross-stream safety of a cached CUDA buffer made on one stream and used on others.

    The buffer's filling work (a host-to-device copy, a fill kernel) is ordered on the stream that
    made it; a kernel on another stream is not ordered after it, and the caching allocator only
    knows the making stream. So, on use from another stream: that stream waits on an event
    recorded after the filling work, until the event is seen complete (then never again), and
    the buffer is recorded on the stream (``record_stream``) once, so that freeing it on eviction
    waits for that stream's kernels. Inside a CUDA graph capture neither can be done (an event
    recorded outside the capture cannot be queried or waited on there; ``record_stream`` is not
    needed for a buffer a graph uses: such buffers are never evicted): ``torch.cuda.graph``
    synchronises the device before capturing, so a buffer made in a warm-up step has landed.
    """

    __slots__ = ("done", "event", "stream", "streams", "tensors")

    def __init__(self, tensors: list[torch.Tensor], device: torch.device) -> None:
        self.tensors = tensors
        self.stream = torch.cuda.current_stream(device)
        self.event = torch.cuda.Event()
        self.event.record(self.stream)
        self.done = False
        self.streams = [self.stream]  # streams the tensors are known to the allocator on

    def use(self, device: torch.device, capturing: bool) -> None:
        """Order the current stream of ``device`` after the filling work (no host sync)."""
        stream = torch.cuda.current_stream(device)
        if stream == self.stream or capturing:
            return
        if not self.done:
            if self.event.query():
                self.done = True
            else:
                stream.wait_event(self.event)
        if stream not in self.streams:
            for t in self.tensors:
                t.record_stream(stream)
            self.streams.append(stream)


def _capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph (never for a CPU device)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class TableCache:
    """Least-recently-used cache of device work tables, keyed by layout.

    Attributes:
        builds: how many tables were built (tests and benchmarks read it).
    """

    def __init__(self, max_entries: int = MAX_TABLES) -> None:
        self.max_entries = max_entries
        self.builds = 0
        # key -> (entry, StreamUse or None), least recently used first
        self._entries: OrderedDict[Hashable, tuple[Any, StreamUse | None]] = OrderedDict()
        self._captured: dict[Hashable, tuple[Any, StreamUse | None]] = {}  # used by a captured graph: never evicted

    def get(self, key: Hashable, device: torch.device, build: Callable[[], Any]) -> Any:
        """The table for ``key``; ``build()`` makes it on a miss (during a CUDA graph capture beside
        the capture: :func:`build_beside_capture`).

        On a GPU the current stream is ordered after the table's host-to-device copy, also when
        the table was built on another stream (see :class:`StreamUse`)."""
        cuda = device.type == "cuda"
        capturing = _capturing(device)
        item = self._captured.get(key)
        if item is None:
            item = self._entries.get(key)
        if item is not None:
            if key in self._entries:
                self._entries.move_to_end(key)
            if capturing:
                self._captured[key] = item
            entry, use = item
            if use is not None:
                use.use(device, capturing)
            return entry
        if capturing:  # pinned at once: the graph being captured reads it on every replay
            entry, use = build_beside_capture(device, build)
            self.builds += 1
            self._captured[key] = (entry, use)
            return entry
        entry = build()
        self.builds += 1
        self._entries[key] = (entry, StreamUse(_tensors_in(entry), device) if cuda else None)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return entry

    def clear(self) -> None:
        """Drop every table that no captured CUDA graph uses."""
        self._entries.clear()


#: The one cache of every Triton multi-tensor kernel.
TABLES = TableCache()


# ---- building a table while a stream captures ------------------------------------------------------
def build_beside_capture(device: torch.device, build: Callable[[], Any]) -> tuple[Any, StreamUse]:
    """``build()`` run while the current stream of ``device`` captures a CUDA graph, outside the
    graph: on a side stream (its host-to-device copy is then not captured, and its buffers come from
    the allocator's ordinary pool: the graph's pool serves the capturing stream only), waited for
    on the host before the capture goes on. The graph holds no copy of its own, so every replay
    reads the finished table, and so does any later call. The thread is in relaxed capture mode
    meanwhile (:func:`relaxed_capture_mode`). Returns ``(entry, its StreamUse)``, marked done."""
    with relaxed_capture_mode():
        side = _side_stream(device)
        _BESIDE_CAPTURE.append(device)
        try:
            with torch.cuda.stream(side):
                entry = build()
                use = StreamUse(_tensors_in(entry), device)
        finally:
            _BESIDE_CAPTURE.pop()
        side.synchronize()
    use.done = True
    return entry, use


_SIDE_STREAMS: dict[torch.device, Any] = {}
_BESIDE_CAPTURE: list[torch.device] = []  # non-empty while build_beside_capture runs a build


def _side_stream(device: torch.device) -> Any:
    """A stream of ``device`` for :func:`build_beside_capture` that is not capturing. Streams come
    from torch's pool, which the capturing stream may come from too: a capturing one is passed over."""
    stream = _SIDE_STREAMS.get(device)
    for _ in range(64):
        if stream is not None and not _is_capturing(stream):
            _SIDE_STREAMS[device] = stream
            return stream
        stream = torch.cuda.Stream(device)
    raise RuntimeError("mpkern: found no CUDA stream that is not capturing to build a work table on")


def _is_capturing(stream: Any) -> bool:
    with torch.cuda.stream(stream):
        return torch.cuda.is_current_stream_capturing()


_EXCHANGE_MODE: list[Any] = []  # the driver's cuThreadExchangeStreamCaptureMode, once loaded


def _exchange_capture_mode(mode: ctypes.c_int) -> None:
    if not _EXCHANGE_MODE:
        name = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
        try:
            fn = ctypes.CDLL(name).cuThreadExchangeStreamCaptureMode
        except (OSError, AttributeError) as e:
            raise RuntimeError(f"mpkern: cannot build a work table during a CUDA graph capture: the CUDA driver "
                               f"({name}) or its cuThreadExchangeStreamCaptureMode is not available ({e}). Run "
                               "the same call once eagerly before capturing (a warm-up step), with the same "
                               "params, grads and optimizer state storage.") from e
        fn.argtypes = [ctypes.POINTER(ctypes.c_int)]
        fn.restype = ctypes.c_int
        _EXCHANGE_MODE.append(fn)
    rc = _EXCHANGE_MODE[0](ctypes.byref(mode))
    if rc != 0:
        raise RuntimeError(f"mpkern: cuThreadExchangeStreamCaptureMode failed (CUresult {rc})")


@contextlib.contextmanager
def relaxed_capture_mode() -> Iterator[None]:
    """This thread in relaxed CUDA stream-capture mode for the block, the previous mode after it.

    In the default (global) mode, calls that may synchronise -- a stream synchronisation, an event
    query (the pinned-memory allocator's), a ``cudaMalloc`` -- are errors while any stream
    captures, even when they touch no capturing stream; the caching allocator switches to relaxed
    mode around its ``cudaMalloc`` during a capture for the same reason. torch has no Python API
    for it, so the driver's ``cuThreadExchangeStreamCaptureMode`` is called (thread state shared
    with the runtime torch uses)."""
    mode = ctypes.c_int(_CAPTURE_MODE_RELAXED)
    _exchange_capture_mode(mode)  # mode now holds the previous one
    try:
        yield
    finally:
        _exchange_capture_mode(mode)


def layout(tensors: Sequence[torch.Tensor | None]) -> tuple:
    """The part of a tensor list a work table depends on: (address, size, dtype) per tensor."""
    return tuple((0, 0, None) if t is None else (t.data_ptr(), t.numel(), t.dtype) for t in tensors)


def to_device(rows: list[list[int]] | list[tuple[int, ...]], width: int, device: torch.device) -> torch.Tensor:
    """An int64 [len(rows), width] device tensor from host rows (pinned, asynchronous copy; not
    pinned when built beside a capture, whose copy the host waits for anyway: no pinned-memory
    allocation while a stream captures)."""
    host = torch.tensor(rows, dtype=torch.int64).reshape(-1, width)
    if device.type == "cuda" and not _BESIDE_CAPTURE:
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
