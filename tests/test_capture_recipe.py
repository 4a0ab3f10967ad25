"""CUDA graphs with PyTorch's own whole-network recipe (issue 32 item 3).

The recipe: warm-up steps on a side stream, ``opt.zero_grad(set_to_none=True)``, then
``torch.cuda.graph(g)`` around forward, backward and ``opt.step()``. The backward inside the
capture allocates the grads in the graph's private pool, so the kernels' device tables (keyed by
the tensors' addresses) miss during the capture; the cache then builds the table beside the capture
(a side stream, waited for on the host, pinned), and replays read the graph-pool grads' addresses.

* On CPU, up to the device boundary: the CUDA cache's rules (csrc/cuda/table_lru.h, compiled here
  with the host compiler against tests/cpp/table_lru_test.cpp), the Triton cache's capture-time
  build and pinning with stand-ins for streams, events and the driver's capture mode, and the
  recipe's steps through the optimizer with a capture simulated (Triton kernels in the interpreter).
* On a GPU, for real on the native CUDA and the Triton backends: replays equal eager steps bit for
  bit; ``unscale_`` over grads made inside the capture reads the right table on replay and after.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import os
import shutil
import subprocess

import pytest
import torch

import mpkern
from conftest import DEVICE, available_backends, requires_cuda
from mpkern import _backend, _ops
from mpkern.triton_kernels import tables

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BF16 = torch.bfloat16


# ---- the CUDA backend's cache rules, compiled for the host ---------------------------------------
def test_cuda_table_cache_rules(tmp_path):
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler (c++, g++ or clang++) on PATH to build tests/cpp/table_lru_test.cpp")
    exe = tmp_path / "table_lru_test"
    build = subprocess.run([cxx, "-std=c++17", "-Wall", "-Wextra", "-Werror", "-I", os.path.join(ROOT, "csrc"),
                            os.path.join(ROOT, "tests", "cpp", "table_lru_test.cpp"), "-o", str(exe)],
                           capture_output=True, text=True, timeout=120, check=False)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout[-3000:]


# ---- the Triton backend's cache, with stand-ins for CUDA -----------------------------------------
class _Stream:
    def __init__(self, name, capturing=False):
        self.name, self.capturing = name, capturing
        self.synced = 0

    def synchronize(self):
        self.synced += 1
        _LOG.append(("sync", self.name))

    def wait_event(self, event):
        _LOG.append(("wait", self.name))

    def __eq__(self, other):
        return isinstance(other, _Stream) and other.name == self.name

    def __hash__(self):
        return hash(self.name)


class _Event:
    def record(self, stream):
        self.stream = stream
        _LOG.append(("record", stream.name))

    def query(self):
        return False


_LOG: list[tuple[str, str]] = []


@pytest.fixture
def fake_cuda(monkeypatch):
    """Streams (the capturing one current), a stream pool whose first stream is the capturing
    one, events, and the driver's capture mode, all logged in _LOG."""
    _LOG.clear()
    capture = _Stream("capture", capturing=True)
    pool = iter([capture, _Stream("pool1"), _Stream("pool2")])
    state = {"current": capture}

    @contextlib.contextmanager
    def on_stream(s):
        prev, state["current"] = state["current"], s
        try:
            yield
        finally:
            state["current"] = prev

    @contextlib.contextmanager
    def relaxed():
        _LOG.append(("relaxed", "on"))
        try:
            yield
        finally:
            _LOG.append(("relaxed", "off"))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: state["current"])
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: next(pool))
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["current"].capturing)
    monkeypatch.setattr(tables, "relaxed_capture_mode", relaxed)
    monkeypatch.setattr(tables, "_SIDE_STREAMS", {})
    return state


class _Recorded(torch.Tensor):
    """A CPU tensor standing in for a CUDA buffer: records its ``record_stream`` calls."""

    def record_stream(self, stream):
        _LOG.append(("record_stream", stream.name))


def test_triton_table_built_beside_the_capture(fake_cuda):
    dev = torch.device("cuda", 0)
    table = torch.arange(4).as_subclass(_Recorded)

    def build():
        _LOG.append(("build", torch.cuda.current_stream().name))
        assert not torch.cuda.is_current_stream_capturing()
        return table, [(0, 4)]

    cache = tables.TableCache(max_entries=2)
    entry = cache.get(("layout", 1), dev, build)
    assert entry[0] is table and cache.builds == 1
    # in relaxed mode: built on a stream that is not capturing (the pool's capturing stream passed
    # over), its copy's event recorded there, that stream synchronised before the mode is restored
    assert _LOG == [("relaxed", "on"), ("build", "pool1"), ("record", "pool1"), ("sync", "pool1"),
                    ("relaxed", "off")], _LOG
    assert fake_cuda["current"].name == "capture"  # the capture goes on, on its own stream
    # pinned and landed: later hits, in the capture or eager on any stream, rebuild nothing and
    # wait on nothing, also after more tables than the cache keeps and after clear()
    _LOG.clear()
    assert cache.get(("layout", 1), dev, lambda: pytest.fail("rebuilt")) is entry
    with torch.cuda.stream(_Stream("eager")):
        for i in range(5):
            cache.get(("other", i), dev, lambda: (torch.zeros(1).as_subclass(_Recorded), []))
        cache.clear()
        assert cache.get(("layout", 1), dev, lambda: pytest.fail("a table a graph uses was dropped")) is entry
    assert ("wait", "eager") not in _LOG and ("relaxed", "on") not in _LOG
    assert ("record_stream", "eager") in _LOG  # the allocator learns of the stream that uses it
    assert cache.builds == 1 + 5
    # a second capture-time build: the same side stream
    _LOG.clear()
    cache.get(("layout", 2), dev, build)
    assert ("build", "pool1") in _LOG and cache.builds == 7


def test_no_pinned_staging_beside_a_capture(fake_cuda, monkeypatch):
    """The host waits for a table built beside a capture: its rows are copied from ordinary memory
    (no pinned-memory allocation, with its event queries, while a stream captures); an eager build
    stages them in pinned memory for an asynchronous copy."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: _LOG.append(("pin", "")) or self)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: self.as_subclass(_Recorded))
    dev = torch.device("cuda", 0)
    cache = tables.TableCache()
    cache.get("captured", dev, lambda: (tables.to_device([[1, 2]], 2, dev), []))
    assert ("pin", "") not in _LOG and ("sync", "pool1") in _LOG
    with torch.cuda.stream(_Stream("eager")):
        cache.get("eager", dev, lambda: (tables.to_device([[1, 2]], 2, dev), []))
    assert ("pin", "") in _LOG


def test_relaxed_capture_mode_restores_the_previous_mode(monkeypatch):
    mode = {"thread": 0}  # CU_STREAM_CAPTURE_MODE_GLOBAL
    seen = []

    def exchange(ptr):
        m = ctypes.cast(ptr, ctypes.POINTER(ctypes.c_int)).contents
        m.value, mode["thread"] = mode["thread"], m.value
        return 0

    monkeypatch.setattr(tables, "_EXCHANGE_MODE", [exchange])
    with tables.relaxed_capture_mode():
        seen.append(mode["thread"])
    assert seen == [2] and mode["thread"] == 0
    with pytest.raises(ValueError), tables.relaxed_capture_mode():
        raise ValueError("inside")
    assert mode["thread"] == 0, "an error inside the block left the thread in relaxed mode"
    monkeypatch.setattr(tables, "_EXCHANGE_MODE", [lambda ptr: 900])  # CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    with pytest.raises(RuntimeError, match="CUresult 900"), tables.relaxed_capture_mode():
        pass


# ---- the recipe through the optimizer, capture simulated on CPU ----------------------------------
class _Net(torch.nn.Module):
    """Two bf16 linear layers: weights over several kernel chunks, a width not a multiple of 8."""

    def __init__(self, seed, device, width=520):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.a = torch.nn.Linear(256, width, device=device, dtype=BF16)
            self.b = torch.nn.Linear(width, 33, device=device, dtype=BF16)

    def forward(self, x):
        return self.b(torch.nn.functional.gelu(self.a(x)))


def _inputs(n, device, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 256, generator=g).to(BF16).to(device) for _ in range(n)]


def _step(model, opt, x):
    opt.zero_grad(set_to_none=True)
    loss = model(x).sum()
    loss.backward()
    opt.step()
    return loss


def _same_state(model_a, opt_a, model_b, opt_b):
    for (name, pa), pb in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(pa, pb), name
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert sa.keys() == sb.keys()
        for key, t in sa.items():
            if isinstance(t, torch.Tensor):
                assert torch.equal(t, sb[key]), (name, key)


def test_recipe_through_the_optimizer_with_a_simulated_capture(monkeypatch):
    """The optimizer accepts grads that are new at capture time (set_to_none=True, then backward
    inside the capture) and its Triton tables for them are built beside the capture, once: a
    replay over the same grads finds them. On CPU nothing is captured (the steps run); the
    comparison is with eager steps from the same start."""
    if "triton" not in available_backends():
        pytest.skip("no triton backend here")
    monkeypatch.setenv("MPKERN_BACKEND", "triton")
    xs = _inputs(4, DEVICE)
    eager = _Net(1, DEVICE, width=40)
    graphed = copy.deepcopy(eager)
    opts = [mpkern.FusedAdamWMP(m.parameters(), lr=1e-3, max_grad_norm=1.0, capturable=True) for m in (eager, graphed)]
    for x in xs[:2]:  # warm-up
        _step(eager, opts[0], x)
        _step(graphed, opts[1], x)
    built_beside = []

    def beside(device, build):
        built_beside.append(device)
        return build(), None

    @contextlib.contextmanager
    def capturing():  # the graphed twin's calls only
        with monkeypatch.context() as m:
            m.setattr(tables, "build_beside_capture", beside)
            m.setattr(tables, "_capturing", lambda device: True)
            m.setattr(_ops, "capturing", lambda: True)
            yield

    graphed_opt = opts[1]
    graphed_opt.zero_grad(set_to_none=True)
    static_x = xs[2].clone()
    with capturing():  # the capture: grads allocated now
        loss = graphed(static_x).sum()
        loss.backward()
        graphed_opt.step()
    assert len(built_beside) >= 1, "no table was built during the capture: the grads were not new"
    assert torch.equal(loss, _step(eager, opts[0], xs[2]))
    _same_state(eager, opts[0], graphed, graphed_opt)
    # a "replay": new input, the grads written into the same storage; no table is built
    n, builds = len(built_beside), tables.TABLES.builds
    static_x.copy_(xs[3])
    grads = [p.grad for p in graphed.parameters()]
    graphed_opt.zero_grad(set_to_none=True)
    with capturing():
        loss = graphed(static_x).sum()
        loss.backward()
        for p, g in zip(graphed.parameters(), grads):
            g.copy_(p.grad)
            p.grad = g
        graphed_opt.step()
    assert len(built_beside) == n and tables.TABLES.builds == builds
    assert torch.equal(loss, _step(eager, opts[0], xs[3]))
    _same_state(eager, opts[0], graphed, graphed_opt)


# ---- on a GPU ------------------------------------------------------------------------------------
def _gpu_backend(name, monkeypatch):
    if name not in available_backends():
        pytest.skip(f"the {name} backend is not available here")
    monkeypatch.setenv("MPKERN_BACKEND", name)


def _builds(name):
    return _backend.native().cuda_table_cache_stats()[0] if name == "cuda" else tables.TABLES.builds


@requires_cuda
@pytest.mark.parametrize("mode", [{}, {"master_weights": "8bit", "state_dtype": "8bit", "seed": 3}],
                         ids=["fp32", "8bit-8bit"])
@pytest.mark.parametrize("name", ["cuda", "triton"])
def test_pytorch_recipe_replays_equal_eager_steps(name, mode, monkeypatch):
    _gpu_backend(name, monkeypatch)
    dev = torch.device("cuda")
    xs = _inputs(6, dev)
    eager = _Net(2, dev)
    graphed = copy.deepcopy(eager)
    kw = dict(lr=1e-3, max_grad_norm=1.0, capturable=True, **mode)
    opt_e = mpkern.FusedAdamWMP(eager.parameters(), **kw)
    opt_g = mpkern.FusedAdamWMP(graphed.parameters(), **kw)
    static_x = xs[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as in torch's docs
        for x in xs[:3]:
            static_x.copy_(x)
            _step(graphed, opt_g, static_x)
    torch.cuda.current_stream().wait_stream(side)
    losses_e = [_step(eager, opt_e, x) for x in xs[:3]]
    builds = _builds(name)
    opt_g.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = graphed(static_x).sum()
        static_loss.backward()
        opt_g.step()
    assert _builds(name) > builds, "no table was built during the capture: the grads were not new"
    for x in xs[3:]:
        static_x.copy_(x)
        graph.replay()
        losses_e.append(_step(eager, opt_e, x))
        assert torch.equal(static_loss, losses_e[-1])
    torch.cuda.synchronize()
    _same_state(eager, opt_e, graphed, opt_g)


@requires_cuda
@pytest.mark.parametrize("name", ["cuda", "triton"])
def test_unscale_of_grads_made_inside_the_capture(name, monkeypatch):
    """Grads allocated inside the capture (graph pool): the table built beside the capture is right
    on every replay, and an eager call over the same grads afterwards finds it and is right too."""
    _gpu_backend(name, monkeypatch)
    g = torch.Generator().manual_seed(21)
    sizes = [70_000, 33, 4096]
    srcs = [[torch.randn(n, generator=g).to(BF16).cuda() for n in sizes] for _ in range(3)]
    static = [s.clone() for s in srcs[0]]
    warm = [torch.nn.Parameter(torch.zeros(n, dtype=BF16, device="cuda")) for n in sizes]
    for p, s in zip(warm, srcs[0]):
        p.grad = s.clone()
    mpkern.unscale_(warm, 0.5, max_norm=1e9)  # eager: kernels compiled (other grads: another table)
    torch.cuda.synchronize()
    builds = _builds(name)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        params = [torch.nn.Parameter(torch.zeros(n, dtype=BF16, device="cuda")) for n in sizes]
        for p, s in zip(params, static):
            p.grad = s * 1.0  # a new tensor in the graph's pool
        res = mpkern.unscale_(params, 0.5, max_norm=1e9)
    assert _builds(name) > builds, "no table was built during the capture"
    for src in srcs:
        for s, new in zip(static, src):
            s.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        want = sum(float((t.double() * 0.5).pow(2).sum()) for t in src) ** 0.5
        assert float(res.total_norm) == pytest.approx(want, rel=1e-5)
        for p, t in zip(params, src):
            assert torch.equal(p.grad, (t.float() * 0.5).to(BF16))
    builds = _builds(name)
    for p, t in zip(params, srcs[0]):
        p.grad.copy_(t)
    eager = mpkern.unscale_(params, 0.5, max_norm=1e9)
    torch.cuda.synchronize()
    assert _builds(name) == builds, "the eager call over the graph's grads did not find the capture's table"
    want = sum(float((t.double() * 0.5).pow(2).sum()) for t in srcs[0]) ** 0.5
    assert float(eager.total_norm) == pytest.approx(want, rel=1e-5)
