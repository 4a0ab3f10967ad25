"""The CUDA AdamW kernel's launch shape (issue 43 item 4): the shape each arch takes from
``csrc/cuda/adamw_cuda.cu``'s table, the override a sweep sets (:mod:`mpkern.launch_shape`), the sweep
stage's own logic (``tools/gpu_check/sweep.py``), and -- on a GPU -- that every shape gives the same
results bit for bit."""

from __future__ import annotations

import pytest
import torch

import mpkern
from conftest import HAS_CUDA
from mpkern import _backend, launch_shape
from tools.gpu_check import sweep

CUDA_BUILT = _backend.native() is not None and bool(getattr(_backend.native(), "cuda_built", False))
needs_cuda_build = pytest.mark.skipif(not CUDA_BUILT, reason="needs mpkern's CUDA kernels built")
needs_gpu = pytest.mark.skipif(not HAS_CUDA or not CUDA_BUILT, reason="needs a CUDA GPU and the CUDA kernels")


# ---- the sweep's logic (no GPU) --------------------------------------------------------------------
def test_sweep_shapes_are_all_valid_and_layouts_have_their_sizes():
    shapes = sweep.shapes()
    assert len(shapes) == len(set(shapes)) == 32 and (256, 8, 65536, 1) in shapes  # the built-in default among them
    for block, grid, chunk, stages in shapes:
        assert block % 32 == 0 and 32 <= block <= 256 and 1 <= grid <= 64 and chunk % 256 == 0 and chunk <= 65536
        assert stages in (1, 2)
    assert {s[3] for s in shapes} == {1, 2} and len({s[:3] for s in shapes}) == 16  # each shape at both stages
    assert sum(sweep.layout_sizes("uniform")) == 32_000_000
    assert sum(sweep.layout_sizes("gpt2")) == 124_439_808  # GPT-2 small's parameter count (tied embedding)
    # per layer 4 x 4096^2 = 67,108,864 + 3 x 4096 x 11008 = 135,266,304 + 2 x 4096 = 202,383,360; five layers
    assert sum(sweep.layout_sizes("llama")) == 1_011_916_800
    with pytest.raises(ValueError, match="layout must be one of"):
        sweep.layout_sizes("bert")


def _rows(times):
    return [{"layout": lay, "mode": mode, "shape": list(shape), "kernel_ms": ms}
            for (lay, mode), per in times.items() for shape, ms in per.items()]


def test_best_shape_is_the_geometric_mean_winner_over_the_cases_that_timed_it():
    cur, a, b, c = (256, 8, 65536, 1), (128, 4, 16384, 2), (256, 16, 16384, 1), (128, 2, 65536, 2)
    times = {
        # a: 0.9x everywhere (geomean 0.9); b: 0.5x on one case, 1.2x on the others (0.5 * 1.2^3 = 0.864,
        # geomean 0.964); c: timed in one case only -> not a candidate, however fast
        ("uniform", "fp32"): {cur: 1.0, a: 0.9, b: 0.5, c: 0.1},
        ("uniform", "8bit"): {cur: 2.0, a: 1.8, b: 2.4},
        ("gpt2", "fp32"): {cur: 4.0, a: 3.6, b: 4.8},
        ("gpt2", "8bit"): {cur: 8.0, a: 7.2, b: 9.6},
    }
    rows = _rows(times) + [{"layout": "gpt2", "mode": "8bit", "shape": list(c), "error": "boom"}]
    best = sweep.best_shape(rows, cur)
    assert best["shape"] == list(a) and best["relative_time"] == pytest.approx(0.9)
    # per mode: fp32 cases (0.5, 1.2) -> b's geomean sqrt(0.6) = 0.775 beats a's 0.9; 8bit: a (b is 1.2)
    assert best["per_mode"]["fp32"]["shape"] == list(b)
    assert best["per_mode"]["fp32"]["relative_time"] == pytest.approx(0.6**0.5)
    assert best["per_mode"]["8bit"]["shape"] == list(a)
    with pytest.raises(ValueError, match="no row timed the current shape"):
        sweep.best_shape(rows, (64, 1, 256, 1))


def test_table_row_is_a_kArchConfigs_row():
    assert sweep.table_row(9, 0, [128, 4, 16384, 2], "run x") == '    {9, 0, {128, 4, 16384, 2}, "run x"},'


def test_sweep_command_line_refuses_bad_layouts(tmp_path):
    with pytest.raises(SystemExit) as e:
        sweep.main(["--out", str(tmp_path), "--layouts", "uniform,bert"])
    assert e.value.code == 2


def test_sweep_stage_plumbing_on_the_cpu(tmp_path, monkeypatch):
    """The stage on the cpu backend with small layouts, a stand-in shape override and a stand-in timer
    whose times depend on the shape in force: every (layout, mode, shape) timed once, the shape set while
    it is timed and unset after, the winner and its table row in the JSON."""
    import contextlib
    import json

    from mpkern import measure

    state = {"shape": None}
    seen = []
    fast = (128, 4, 16384, 2)

    @contextlib.contextmanager
    def shape_set(block, grid, chunk, stages):
        state["shape"] = (block, grid, chunk, stages)
        try:
            yield
        finally:
            state["shape"] = None

    def event_time(fn, device, **kw):
        fn()
        seen.append(state["shape"])
        return {"kernel_ms": 0.5 if state["shape"] == fast else 1.0, "wall_ms": 2.0}

    monkeypatch.setattr(launch_shape, "adamw_shape", lambda dev=None: launch_shape.LaunchShape(256, 8, 65536, 1, "t"))
    monkeypatch.setattr(launch_shape, "adamw_shape_set", shape_set)
    monkeypatch.setattr(measure, "event_time", event_time)
    sizes = {"uniform": [300, 64], "gpt2": [1000, 7, 33]}
    assert sweep.stage_sweep(str(tmp_path), ("uniform", "gpt2"), device="cpu", backend="cpu",
                             sizes_of=sizes.__getitem__) == 0
    data = json.loads((tmp_path / "sweep_adamw.json").read_text())
    assert data["status"] == "done"
    rows = data["rows"]
    assert len(rows) == 2 * len(sweep.MODES) * 32 and not any("error" in r for r in rows)
    assert seen.count(None) == 0 and len(seen) == len(rows) and state["shape"] is None
    assert {tuple(r["shape"]) for r in rows} == set(sweep.shapes())
    assert rows[0]["shape"] == [256, 8, 65536, 1]  # the arch's shape first: the baseline of every case
    assert data["best"]["shape"] == list(fast) and data["best"]["relative_time"] == pytest.approx(0.5)
    assert data["best"]["table_row"].startswith('    {0, 0, {128, 4, 16384, 2}, "gpu_check sweep ')


# ---- the override's checks (the CUDA build, no GPU) ---------------------------------------------------
@needs_cuda_build
@pytest.mark.parametrize("shape,match", [((300, 8, 65536), "block must be a multiple of 32"),
                                         ((100, 8, 65536), "block must be a multiple of 32"),
                                         ((256, 0, 65536), "grid_per_sm must be in"),
                                         ((256, 8, 1000), "chunk must be a multiple of 256"),
                                         ((256, 8, 131072), "chunk must be a multiple of 256"),
                                         ((256, 8, 65536, 0), "stages must be 1 or 2"),
                                         ((256, 8, 65536, 3), "stages must be 1 or 2")])
def test_a_bad_shape_is_refused(shape, match):
    with pytest.raises(ValueError, match=match), launch_shape.adamw_shape_set(*shape):
        pass


@needs_cuda_build
def test_a_shape_must_be_ints():
    with pytest.raises(TypeError, match="block must be an int"), launch_shape.adamw_shape_set(256.0, 8, 65536):
        pass
    with pytest.raises(TypeError, match="stages must be an int"), launch_shape.adamw_shape_set(256, 8, 65536, 2.0):
        pass


# ---- on a GPU --------------------------------------------------------------------------------------
def test_info_reports_the_launch_shape_only_where_the_cuda_kernels_run():
    info = mpkern.info()
    if not (HAS_CUDA and CUDA_BUILT) or info["native"]["cuda_problem"]:
        assert info["adamw_launch_shape"] is None
    else:
        assert info["adamw_launch_shape"] == launch_shape.adamw_shape()._asdict()


@needs_gpu
def test_the_arch_takes_its_table_row_and_a_set_shape_wins_inside_the_block():
    shape = launch_shape.adamw_shape()
    assert shape.source and shape.source != "set_adamw_config"
    with launch_shape.adamw_shape_set(128, 2, 16384, 2):
        assert launch_shape.adamw_shape()[:4] == (128, 2, 16384, 2)
        assert launch_shape.adamw_shape().source == "set_adamw_config"
    assert launch_shape.adamw_shape() == shape


def _train(master, state_dtype, shape):
    gen = torch.Generator(device="cuda").manual_seed(3)
    sizes = (1, 31, 255, 4096 + 7, 70_000, 200_000)  # tails, unaligned rows, several chunks at every chunk size
    params = [torch.nn.Parameter(torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)) for n in sizes]
    grads = [[torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16) for n in sizes] for _ in range(3)]
    opt = mpkern.FusedAdamWMP(params, lr=1e-2, master_weights=master, state_dtype=state_dtype)
    with mpkern.use_backend("cuda"), launch_shape.adamw_shape_set(*shape):
        for gs in grads:
            for p, g in zip(params, gs):
                p.grad = g
            opt.step()
    torch.cuda.synchronize()
    return [p.detach().clone() for p in params], [{k: v.clone() for k, v in opt.state[p].items()} for p in params]


@needs_gpu
@pytest.mark.parametrize("master,state_dtype", [(True, "float32"), ("remainder", "bfloat16"), ("8bit", "8bit"),
                                                ("8bit", "4bit_m"), (True, "8bit"), ("remainder", "8bit"),
                                                (False, "8bit")])
def test_every_shape_gives_the_same_bits(master, state_dtype):
    """Two load stages too: the compact kernels' shared-memory staging (every master kind that has its
    own copy layout: fp32, remainder, 8-bit, none) against the one-stage default."""
    ref_p, ref_s = _train(master, state_dtype, (256, 8, 65536, 1))
    for shape in [(128, 2, 16384, 1), (256, 16, 256, 2), (64, 1, 65536, 1), (256, 8, 65536, 2), (128, 4, 16384, 2)]:
        ps, ss = _train(master, state_dtype, shape)
        for a, b in zip(ps, ref_p):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), shape
        for sa, sb in zip(ss, ref_s):
            for k in sb:
                assert torch.equal(sa[k], sb[k]), (shape, k)
