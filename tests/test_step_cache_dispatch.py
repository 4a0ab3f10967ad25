"""The cached step is one path through the dispatcher (csrc/fastpath.cpp): the backend is chosen once
and later steps are cached ones, counted by the functions a step runs (``sys.setprofile``, see
:mod:`mpkern.optim.trace`); the profiler and a dispatch mode see each cached step's ops; the cache
reads no CPython dict internals.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

import mpkern
from conftest import DEVICE
from mpkern import _backend
from mpkern.optim.trace import module_key

ROOT = pathlib.Path(mpkern.__file__).parent


NATIVE_CACHE = _backend.native() is not None and hasattr(_backend.native(), "StepCache")


needs_cache = pytest.mark.skipif(not NATIVE_CACHE or DEVICE.type != "cpu",
                                 reason="the cached step needs the native CPU extension")


def _traced_opt(**kw):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 64).to(torch.bfloat16)) for _ in range(4)]
    opt = mpkern.FusedAdamWMP(params, lr=1e-3, master_weights="8bit", state_dtype="8bit", max_grad_norm=1.0, **kw)
    for p in params:
        p.grad = torch.randn_like(p)
    return opt, params


def _counting(opt):
    hits = []
    real = opt._fast_step

    def counted(fc):
        hits.append(1)
        return real(fc)

    opt._fast_step = counted
    return hits


def test_module_key_counts_an_optim_subpackage_once():
    assert module_key("mpkern.optim.storage.moments") == "mpkern.optim.storage"
    assert module_key("mpkern.optim.storage") == "mpkern.optim.storage"
    assert module_key("mpkern.optim.runtime") == "mpkern.optim.runtime"
    assert module_key("mpkern.amp") == "mpkern.amp"


_TRACE = """
import json, torch, mpkern
from mpkern.optim.trace import modules_run
torch.manual_seed(0)
params = [torch.nn.Parameter(torch.randn(64, 64).to(torch.bfloat16)) for _ in range(4)]
opt = mpkern.FusedAdamWMP(params, lr=1e-3, master_weights="8bit", state_dtype="8bit", max_grad_norm=1.0)
for p in params:
    p.grad = torch.randn_like(p)
hits = []
real = opt._fast_step
opt._fast_step = lambda fc: (hits.append(1), real(fc))
runs = [modules_run(opt.step) for _ in range(3)]
print(json.dumps({"runs": [[r.modules, r.calls] for r in runs], "cached": len(hits)}))
"""


@needs_cache
def test_backend_chosen_once_and_later_steps_cached():
    # in a fresh interpreter: the global optimizer hooks other tests install (mpkern.nn's) are not the step's.
    # (How many modules a step passes through is not asserted: the import layers are checked by lint-imports.)
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _TRACE], capture_output=True, text=True, timeout=300, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    (_first, first_calls), *cached = res["runs"]
    assert first_calls.get("mpkern._backend.select", 0) <= 1  # chosen once per device (one bucket here)
    for _modules, calls in cached:
        assert "mpkern._backend.select" not in calls
    assert res["cached"] == 2  # the second and third steps were cached ones


def test_no_cpython_dict_internals_in_csrc():
    csrc = ROOT.parent / "csrc"
    if not csrc.is_dir():
        pytest.skip("no source tree")
    for path in csrc.rglob("*"):
        if path.suffix in (".cpp", ".h", ".cu", ".cuh"):
            text = path.read_text(encoding="utf-8")
            assert "ma_version_tag" not in text and "PyDictObject" not in text, path


@needs_cache
def test_profiler_sees_every_cached_step():
    opt, _ = _traced_opt()
    opt.step()  # builds the cache
    hits = _counting(opt)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            opt.step()
    assert len(hits) == 3
    names = [e.name for e in prof.events()]
    assert names.count("mpkern::adamw_step_") == 3
    assert names.count("mpkern::grad_stats") == 3  # the clip's statistics pass, through the dispatcher too


@needs_cache
def test_dispatch_mode_sees_cached_steps():
    from conftest import OpsSeen

    opt, _ = _traced_opt()
    opt.step()
    hits = _counting(opt)
    with OpsSeen() as seen:
        opt.step()
    assert hits == [1]
    assert "mpkern.adamw_step_.default" in seen.ops
