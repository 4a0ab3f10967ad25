"""The optimizer's seam (issue 29): one owner of the runtime state, the step's factor planned (not
posted), one cached path through the dispatcher, keyword-only op schemas.

Measured, not assumed: the functions a step runs (``sys.setprofile``, see :mod:`mpkern.optim.trace`),
the profiler's view of cached steps, and the op schema as the dispatcher holds it. (Private reaches
and import layers are the linters' job: ruff's SLF001, scripts/lint_private_names.py, lint-imports.)
"""

from __future__ import annotations

import inspect
import pathlib

import pytest
import torch

import mpkern
from conftest import DEVICE
from mpkern import _backend, _fused_unscale, amp
from mpkern.optim import step_plan
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


def test_unscale_has_no_private_arguments():
    assert not [n for n in inspect.signature(mpkern.unscale_).parameters if n.startswith("_")]
    assert not hasattr(amp, "unscale_cached")


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


def test_adamw_schema_scalars_are_keyword_only_and_codecs_named():
    schema = torch.ops.mpkern.adamw_step_.default._schema
    kw = {a.name for a in schema.arguments if a.kwarg_only}
    assert {"lr", "beta1", "beta2", "eps", "weight_decay", "maximize", "master_codec", "moment_codec",
            "stochastic_rounding", "seed"} <= kw
    assert "master_mode" not in {a.name for a in schema.arguments}
    kinds = {a.name: str(a.type) for a in schema.arguments}
    assert kinds["master_codec"] == "str" and kinds["moment_codec"] == "str"


def _one_param_args(master_codec="fp32", moment_codec="float32"):
    p = torch.randn(8, device=DEVICE)
    args = ([p.bfloat16()], [torch.randn(8, device=DEVICE).bfloat16()], [torch.zeros(8, device=DEVICE)],
            [torch.zeros(8, device=DEVICE)], [], [p.clone()], [torch.zeros((), device=DEVICE)],
            torch.ones((), device=DEVICE), torch.zeros((), device=DEVICE), None)
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, maximize=False, master_codec=master_codec,
              moment_codec=moment_codec, stochastic_rounding=False, seed=0)
    return args, kw


@pytest.mark.parametrize("bad,match", [({"master_codec": "int16"}, "master_codec must be"),
                                       ({"moment_codec": "8bit"}, "moment_codec '8bit' needs"),
                                       ({"moment_codec": "fp8"}, "moment_codec must be")])
def test_bad_codecs_refused_before_anything_changes(bad, match):
    for backend in ("torch", *(["cpu"] if _backend.native() is not None and DEVICE.type == "cpu" else [])):
        args, kw = _one_param_args()
        kw.update(bad)
        before = args[0][0].clone()
        with pytest.raises((ValueError, TypeError), match=match):
            mpkern._ops.adamw_step_(backend, *args, **kw)
        assert torch.equal(args[0][0], before)


def test_positional_scalars_are_refused():
    args, kw = _one_param_args()
    with pytest.raises((TypeError, RuntimeError)):
        torch.ops.mpkern.adamw_step_(*args, None, None, *kw.values())


def test_plan_step_is_computed_not_posted():
    """The plan comes back from one function; nothing is left on the optimizer on the way."""
    g = torch.tensor([3.0, 4.0])
    stats = mpkern.optim.step_plan.stats_pass([g], [g], None)
    plan = step_plan.plan_step(None, max_norm=1.0, grad_scale=None, found_inf=None, device=g.device, stats=stats)
    # norm 5 (float64 reference), clip coefficient 1 / (5 + 1e-6)
    assert plan.norm.item() == pytest.approx(5.0, rel=1e-6)
    assert plan.factor.item() == pytest.approx(1.0 / (5.0 + 1e-6), rel=1e-6)
    assert plan.found_inf.item() == 0.0
    scale = torch.tensor(8.0)
    plan = step_plan.plan_step(None, max_norm=None, grad_scale=scale, found_inf=torch.tensor([1.0]), device=g.device,
                         stats=None)
    assert plan.factor.item() == 0.125 and plan.found_inf.item() == 1.0 and plan.norm is None
    # what unscale_ left, with the step's own max_grad_norm on top: the smaller coefficient wins
    one = torch.ones(())
    pend = _fused_unscale.Pending(torch.tensor(0.5), one, torch.zeros(()), torch.tensor(10.0), torch.tensor(10.0),
                                  False)
    plan = step_plan.plan_step(pend, max_norm=2.0, grad_scale=None, found_inf=None, device=g.device, stats=None)
    assert plan.factor.item() == pytest.approx(0.5 * 2.0 / (10.0 + 1e-6), rel=1e-6)
    assert plan.norm is pend.reported


def test_runtime_owns_the_state_and_survives_copies():
    import copy

    opt, params = _traced_opt()
    rt = opt.mpkern_runtime
    assert _fused_unscale.runtime(opt) is rt and _fused_unscale.fuses_unscale(opt)
    mpkern.unscale_(opt, 0.5)
    assert rt.pending is not None
    dup = copy.deepcopy(opt)
    assert dup.mpkern_runtime is not rt and dup.mpkern_runtime.pending is not None
    opt.step()
    assert rt.pending is None and opt.last_found_inf is not None
    assert not _fused_unscale.fuses_unscale(torch.optim.SGD(params, lr=0.1))
