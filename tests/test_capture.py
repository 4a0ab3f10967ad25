"""CUDA-graph readiness: work tables built once per layout, ``capturable``, capture + replay.

* The Triton and CUDA multi-tensor kernels keep their device work tables in a cache keyed by the
  layout of the tensor lists (addresses, sizes, dtypes): a step over the same tensors builds no
  table and copies nothing from the host; new storage or a new param group builds a new one.
  (On CPU this is checked on the Triton backend, which runs in the interpreter; on a GPU on the
  CUDA backend too.)
* ``FusedAdamWMP(capturable=False)`` refuses to be captured; ``capturable=True`` needs a warm-up
  step (the optimizer state). A table first needed during a capture is built beside it:
  tests/test_capture_recipe.py (PyTorch's own recipe, ``zero_grad(set_to_none=True)`` first).
* On a GPU: capture + 3 replays == 3 eager steps, bit for bit (optimizer and ``unscale_``).
"""

from __future__ import annotations

import pytest
import torch

import mpkern
from conftest import DEVICE, available_backends, requires_cuda
from mpkern import _backend, _ops

BF16 = torch.bfloat16


def _params(sizes, seed, dtype=BF16, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype).to(device)) for s in sizes]


def _fill_grads(params, seed):
    """Fresh random grads written into the existing grad buffers (static storage, as in a graph)."""
    g = torch.Generator().manual_seed(seed)
    for p in params:
        new = torch.randn(p.shape, generator=g).to(p.dtype).to(p.device)
        if p.grad is None:
            p.grad = new
        else:
            p.grad.copy_(new)


@pytest.fixture
def triton_backend(monkeypatch):
    if "triton" not in available_backends():
        pytest.skip("no triton backend here")
    monkeypatch.setenv("MPKERN_BACKEND", "triton")
    from mpkern.triton_kernels.tables import TABLES

    TABLES.clear()
    return TABLES


def test_triton_adamw_table_built_once_and_rebuilt_on_change(triton_backend):
    tables = triton_backend
    params = _params([300, (17, 5)], 1)
    opt = mpkern.FusedAdamWMP(params, lr=1e-3)
    start = tables.builds
    for step in range(3):
        _fill_grads(params, 100 + step)
        opt.step()
    assert tables.builds == start + 1, "the work table must be built once for three steps over the same tensors"
    extra = _params([40], 2)
    opt.add_param_group({"params": extra})
    _fill_grads(params + extra, 200)
    opt.step()
    assert tables.builds == start + 2, "a new param group needs exactly one new table"
    params[0].data = params[0].data.clone()  # new storage for a param
    _fill_grads(params + extra, 201)
    opt.step()
    assert tables.builds == start + 3, "a param in new storage needs a new table for its group"
    for step in range(2):
        _fill_grads(params + extra, 300 + step)
        opt.step()
    assert tables.builds == start + 3


def test_triton_unscale_table_built_once(triton_backend):
    tables = triton_backend
    params = _params([1000, 7], 3)
    start = tables.builds
    for step in range(3):
        _fill_grads(params, 400 + step)
        mpkern.unscale_(params, 0.5, max_norm=1.0)
    # one table serves both kernels (statistics and scale) of the same grad list
    assert tables.builds == start + 1


def test_capture_needs_capturable(monkeypatch):
    params = _params([50], 4)
    opt = mpkern.FusedAdamWMP(params, lr=1e-3)
    _fill_grads(params, 5)
    before = params[0].detach().clone()
    monkeypatch.setattr(_ops, "capturing", lambda: True)
    with pytest.raises(RuntimeError, match="capturable=True"):
        opt.step()
    assert torch.equal(params[0], before)


def test_capture_needs_a_warm_up_step(monkeypatch):
    params = _params([50], 6)
    opt = mpkern.FusedAdamWMP(params, lr=1e-3, capturable=True)
    _fill_grads(params, 7)
    monkeypatch.setattr(_ops, "capturing", lambda: True)
    with pytest.raises(RuntimeError, match="warm-up"):
        opt.step()
    monkeypatch.setattr(_ops, "capturing", lambda: False)
    opt.step()  # the warm-up
    monkeypatch.setattr(_ops, "capturing", lambda: True)
    opt.step()  # allowed now (nothing is really captured on CPU: it runs)
    assert float(opt.state[params[0]]["step"]) == 2.0


def test_capture_rejects_a_cpu_tensor_lr(monkeypatch):
    params = _params([50], 8)
    opt = mpkern.FusedAdamWMP(params, lr=torch.tensor(1e-3), capturable=True)
    _fill_grads(params, 9)
    opt.step()
    monkeypatch.setattr(_ops, "capturing", lambda: True)
    with pytest.raises(RuntimeError, match="CPU tensor lr"):
        opt.step()


# ---- on a GPU ------------------------------------------------------------------------------------
@requires_cuda
def test_cuda_table_cache_built_once(monkeypatch):
    ext = _backend.native()
    if "cuda" not in available_backends():
        pytest.skip("cuda backend not available")
    monkeypatch.setenv("MPKERN_BACKEND", "cuda")
    params = _params([70000, 33], 10)
    opt = mpkern.FusedAdamWMP(params, lr=1e-3)
    _fill_grads(params, 11)
    opt.step()
    builds0 = ext.cuda_table_cache_stats()[0]
    for step in range(3):
        _fill_grads(params, 12 + step)
        opt.step()
        mpkern.unscale_(params, 0.5, max_norm=1.0)
    assert ext.cuda_table_cache_stats()[0] == builds0 + 1  # the unscale_ list's table, once


def _graph_backends():
    return [b for b in available_backends() if b in ("cuda", "triton", "torch")]


@requires_cuda
@pytest.mark.parametrize("mode", [{}, {"master_weights": "8bit", "state_dtype": "8bit", "seed": 3},
                                  {"master_weights": "8bit", "state_dtype": "4bit_m", "seed": 3}],
                         ids=["fp32", "8bit-8bit", "8bit-4bit_m"])
@pytest.mark.parametrize("name", _graph_backends())
def test_optimizer_capture_replays_equal_eager_steps(name, mode, monkeypatch):
    monkeypatch.setenv("MPKERN_BACKEND", name)
    sizes = [70000, (33, 7), 5]
    grads = []
    g = torch.Generator().manual_seed(12)
    for _ in range(4):
        grads.append([torch.randn(s, generator=g).to(BF16).cuda() for s in sizes])

    def make():
        params = _params(sizes, 13, device=torch.device("cuda"))
        lr = torch.tensor(1e-3, device="cuda")
        opt = mpkern.FusedAdamWMP(params, lr=lr, max_grad_norm=1.0, capturable=True, **mode)
        for p, gr in zip(params, grads[0]):
            p.grad = gr.clone()
        opt.step()  # warm-up: state and tables
        return params, opt

    eager_p, eager_opt = make()
    for k in (1, 2, 3):
        for p, gr in zip(eager_p, grads[k]):
            p.grad.copy_(gr)
        eager_opt.step()

    graph_p, graph_opt = make()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        graph_opt.step()
    torch.cuda.current_stream().wait_stream(stream)
    for k in (1, 2, 3):
        for p, gr in zip(graph_p, grads[k]):
            p.grad.copy_(gr)
        graph.replay()
    torch.cuda.synchronize()
    for pe, pg in zip(eager_p, graph_p):
        assert torch.equal(pe, pg)
        se, sg = eager_opt.state[pe], graph_opt.state[pg]
        assert se.keys() == sg.keys()
        for key, t in se.items():  # every state tensor: masters / corrections, moments / codes and scales, step
            if isinstance(t, torch.Tensor):
                assert torch.equal(t, sg[key]), key


@requires_cuda
@pytest.mark.parametrize("name", _graph_backends())
def test_unscale_capture_replays_equal_eager(name, monkeypatch):
    monkeypatch.setenv("MPKERN_BACKEND", name)
    sizes = [70000, 33]
    params = _params(sizes, 14, device=torch.device("cuda"))
    inv = torch.tensor(0.25, device="cuda")
    g = torch.Generator().manual_seed(15)
    batches = [[torch.randn(s, generator=g).to(BF16).cuda() for s in sizes] for _ in range(3)]
    for p, gr in zip(params, batches[0]):
        p.grad = gr.clone()
    mpkern.unscale_(params, inv, max_norm=1.0)  # warm-up
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        res = mpkern.unscale_(params, inv, max_norm=1.0)
    torch.cuda.current_stream().wait_stream(stream)
    for batch in batches:
        for p, gr in zip(params, batch):
            p.grad.copy_(gr)
        graph.replay()
        got = [p.grad.clone() for p in params]
        norm = res.total_norm.clone()
        for p, gr in zip(params, batch):
            p.grad.copy_(gr)
        want = mpkern.unscale_(params, inv, max_norm=1.0)
        assert torch.equal(norm, want.total_norm)
        for a, p in zip(got, params):
            assert torch.equal(a, p.grad)
