"""Copies and cached device buffers across devices and streams (issue 13 items 10 and 11).

* A device-to-host copy is blocking (``non_blocking=True`` returns before the data lands and the
  CPU kernel reads it at once); host/device-to-GPU copies stay asynchronous.
* The device-constant cache (``_ops.scalar_on``) evicts the least recently used constant, never one
  a CUDA graph capture used, and does not hand out a constant filled inside a capture.
* Cached device buffers (Triton work tables, device constants; the CUDA table cache in C++) used
  on another stream than the one that filled them: that stream waits on the fill, and the buffer
  is recorded on it for the allocator.

On CPU the logic is checked with stand-ins for CUDA streams and events; on a GPU, for real, with
the filling stream held back by a sleep kernel.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from conftest import available_backends, requires_cuda
from mpkern import _backend, _ops


# ---- item 10: which copies may be asynchronous --------------------------------------------------
class _CopySpy(torch.Tensor):
    """A meta tensor (so: on another device than the target) that records its ``.to`` calls."""

    calls: ClassVar[list[dict]] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            cls.calls.append(kwargs)
            return torch.full((), 2.5)
        return super().__torch_function__(func, types, args, kwargs)  # results stay spies


@pytest.mark.parametrize("target, non_blocking", [("cpu", False), ("cuda", True)])
def test_copies_to_the_cpu_are_blocking(target, non_blocking):
    assert _ops.non_blocking_to(torch.device(target)) is non_blocking
    for call in (lambda t: _ops.scalar_on(t, target), lambda t: _ops.lr_args(t, target)[0]):
        _CopySpy.calls.clear()
        call(torch.empty((), device="meta").as_subclass(_CopySpy))
        assert len(_CopySpy.calls) == 1
        assert bool(_CopySpy.calls[0].get("non_blocking", False)) is non_blocking, _CopySpy.calls


@requires_cuda
def test_cuda_scalar_read_on_the_cpu_waits_for_the_copy():
    x = torch.zeros((), device="cuda")
    lr = torch.zeros((), device="cuda")
    torch.cuda._sleep(200_000_000)  # the stream is busy; the writes below land after it
    x.fill_(3.0)
    lr.fill_(0.25)
    assert float(_ops.scalar_on(x, "cpu")) == 3.0
    t, f = _ops.lr_args(lr, "cpu")
    assert f == 0.0 and float(t) == 0.25


# ---- item 11: the device-constant cache ---------------------------------------------------------
def test_constant_cache_evicts_the_least_recently_used():
    base = 91_000.0  # values no other code uses
    first = [_ops.scalar_on(base + i, "cpu") for i in range(_ops._MAX_CONSTS)]
    assert _ops.scalar_on(base, "cpu") is first[0]  # a hit: now the most recently used
    _ops.scalar_on(base + _ops._MAX_CONSTS, "cpu")  # one more: evicts the least recently used
    assert _ops.scalar_on(base, "cpu") is first[0], "a constant used just now was evicted"
    assert _ops.scalar_on(base + 1, "cpu") is not first[1], "the least recently used one was kept"


class _FakeStream:
    def __init__(self, name):
        self.name = name
        self.waited = []

    def wait_event(self, event):
        self.waited.append(event)

    def __eq__(self, other):
        return isinstance(other, _FakeStream) and other.name == self.name

    def __hash__(self):
        return hash(self.name)


class _FakeEvent:
    complete = False

    def record(self, stream):
        self.stream = stream

    def query(self):
        return _FakeEvent.complete


class _Recorded(torch.Tensor):
    """A CPU tensor standing in for a CUDA buffer: records its ``record_stream`` calls."""

    def record_stream(self, stream):
        self.__dict__.setdefault("streams", []).append(stream)


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA streams, events, capture state and a CPU ``torch.full`` for device 'cuda' (logic only)."""
    state = {"stream": _FakeStream("s1"), "capturing": False}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: state["stream"])
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real_full = torch.full
    monkeypatch.setattr(torch, "full", lambda size, value, dtype=None, device=None:
                        real_full(size, value, dtype=dtype).as_subclass(_Recorded))
    monkeypatch.setattr(_FakeEvent, "complete", False)
    return state


def test_constant_used_by_a_capture_is_never_evicted(fake_cuda):
    base = 92_000.0
    t = _ops.scalar_on(base, "cuda")
    fake_cuda["capturing"] = True
    assert _ops.scalar_on(base, "cuda") is t  # the graph reads this tensor on every replay
    fresh = _ops.scalar_on(base + 0.5, "cuda")  # none yet: filled inside the capture
    fake_cuda["capturing"] = False
    for i in range(2 * _ops._MAX_CONSTS):
        _ops.scalar_on(base + 1 + i, "cuda")
    assert _ops.scalar_on(base, "cuda") is t, "a constant a captured graph uses was evicted"
    # a fill recorded in a capture has not run: nobody else may be handed that tensor
    assert _ops.scalar_on(base + 0.5, "cuda") is not fresh


def test_constant_used_on_another_stream_waits_for_its_fill(fake_cuda):
    t = _ops.scalar_on(93_000.0, "cuda")
    s1, s2 = fake_cuda["stream"], _FakeStream("s2")
    assert _ops.scalar_on(93_000.0, "cuda") is t and not s1.waited  # same stream: in order anyway
    fake_cuda["stream"] = s2
    assert _ops.scalar_on(93_000.0, "cuda") is t
    assert len(s2.waited) == 1 and t.__dict__.get("streams") == [s2]
    _FakeEvent.complete = True  # the fill is seen complete: no more waits, recorded once per stream
    _ops.scalar_on(93_000.0, "cuda")
    _ops.scalar_on(93_000.0, "cuda")
    assert len(s2.waited) == 1 and t.__dict__.get("streams") == [s2]


# ---- item 11: Triton work tables ----------------------------------------------------------------
def test_triton_table_used_on_another_stream_waits_for_its_copy(fake_cuda):
    from mpkern.triton_kernels.tables import TableCache

    cache = TableCache()
    table = torch.arange(6).as_subclass(_Recorded)
    dev = torch.device("cuda")
    entry = cache.get("k", dev, lambda: (table, [(0, 1)]))
    assert entry[0] is table
    s2 = _FakeStream("s2")
    fake_cuda["stream"] = s2
    assert cache.get("k", dev, lambda: pytest.fail("rebuilt")) is entry
    assert len(s2.waited) == 1, "the second stream did not wait for the table's host-to-device copy"
    assert table.__dict__.get("streams") == [s2], "the table was not recorded on the stream that uses it"
    cache.get("k", dev, lambda: pytest.fail("rebuilt"))
    assert table.__dict__.get("streams") == [s2]
    # inside a capture nothing can be waited on (and a graph's tables are never freed)
    s3 = _FakeStream("s3")
    fake_cuda.update(stream=s3, capturing=True)
    cache.get("k", dev, lambda: pytest.fail("rebuilt"))
    assert not s3.waited


@requires_cuda
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_table_built_on_a_busy_stream_used_on_another(backend, monkeypatch):
    """On a GPU: the work table is built (and its copy queued) on a stream held back by a sleep
    kernel; the same call on a second stream hits the cache and must still read the real table."""
    if backend not in available_backends():
        pytest.skip(f"no {backend} backend here")
    monkeypatch.setenv("MPKERN_BACKEND", backend)
    if backend == "triton":
        from mpkern.triton_kernels.tables import TABLES

        TABLES.clear()
    else:
        _backend.native().cuda_table_cache_clear()
    g = torch.Generator().manual_seed(11)
    grads = [torch.randn(n, generator=g).to(torch.bfloat16).cuda() for n in (70_000, 3, 1000)]
    want = [float((t.double() * 0.5).pow(2).sum()) for t in grads]
    torch.cuda.synchronize()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s1):
        torch.cuda._sleep(400_000_000)
        _ops.grad_stats(grads, torch.full((), 0.5, device="cuda"), _backend.select(torch.device("cuda")))
    with torch.cuda.stream(s2):
        inv = torch.full((), 0.5, device="cuda")
        sumsq, _ = _ops.grad_stats(grads, inv, _backend.select(torch.device("cuda")))
    torch.cuda.synchronize()
    for got, w in zip(sumsq.tolist(), want):
        assert got == pytest.approx(w, rel=1e-5)


@requires_cuda
def test_capture_replay_after_many_new_constants():
    """A graph captured with cached constants replays correctly after the cache saw 2x its size."""
    x = torch.randn(1000, device="cuda")
    _ops.scalar_on(0.375, "cuda")  # warm: cached eagerly
    torch.cuda.synchronize()
    out = torch.empty_like(x)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        torch.mul(x, _ops.scalar_on(0.375, "cuda"), out=out)
    for i in range(2 * _ops._MAX_CONSTS):
        _ops.scalar_on(94_000.0 + i, "cuda")
    junk = [torch.full((1,), 7.0, device="cuda") for _ in range(200)]  # reuse any freed memory
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x * 0.375)
    del junk
