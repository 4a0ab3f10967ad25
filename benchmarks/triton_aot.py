"""Triton's cold start, ahead of time: every kernel specialisation a GPU stage's first calls compile, timed.

No GPU needed. For each stage of ``scripts/gpu_check.sh`` that runs Triton kernels -- ``unscale``
(``mpkern.unscale_`` with a clip, on the triton backend), ``adamw_triton`` (``unscale_(opt)`` + the first
``FusedAdamWMP.step`` of every storage mode with a Triton kernel, headline modes first),
``adamw_default`` (a ``FusedAdamWMP`` with default arguments) and ``matmul`` (the fixed-config GEMMs) --
the script collects the launches those first calls make and compiles each distinct specialisation
with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90 | 80, 32))``.

The launches are the launchers' own, not a list written here:

* unscale / AdamW: the stage's calls run on CPU tensors of the stage's sizes, with each Triton kernel's
  launch (``JITFunction.run``) replaced by a recorder: every argument and constexpr is the one the
  launcher passes (dtype codes, aligned / unaligned row groups, the tensor count of the beta powers ...).
* matmul: :func:`mpkern.triton_kernels.matmul.plan_launch` -- the function ``matmul_into`` launches
  through -- on meta tensors of the stage's shapes and layouts, for an H100 (sm_90: the TMA kernel) and
  an A100 (sm_80: the pointer kernel).

Each launch is specialised by Triton's own binder (``create_function_from_signature`` with the target's
backend: tensors -> typed pointers, 16-byte-aligned ones and integers divisible by 16 marked
``tt.divisibility``, an integer 1 made a constant, unless ``do_not_specialize``) -- the rules of the
Triton that runs the script -- and two launches with the same signature, constants and options are one
compile, as in the JIT's cache. Triton 3.6 also builds a C launcher per signature with the host C
compiler (3.8 has a prebuilt one): its build is timed too (without linking libcuda, absent here).

    python benchmarks/triton_aot.py                      # every stage, sm_90 and sm_80
    python benchmarks/triton_aot.py --only unscale,matmul --arch 90 --json out.json
    python benchmarks/triton_aot.py --smoke              # scale_ over four small tensors, sm_90

Compile times are real: Triton's cache is a fresh temporary folder unless ``--keep-cache``. Seconds are
CPU seconds (this process and the ptxas / C compiler runs it waits for: Triton compiles on one thread, so
this is the time on an idle core) beside wall seconds, which other work on the machine inflates. A
stage's cold start = a fresh process's first compile (the warm-up) + its specialisations + (3.6) its
launcher builds and Triton's ``cuda_utils`` module; "shared cache": what it adds when the stages before it
(in the order above) left their compiles in one persistent TRITON_CACHE_DIR.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from typing import Any

import triton_spec as ts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ("unscale", "adamw_triton", "adamw_default", "matmul")
GPUS = {90: ((9, 0), 132), 80: ((8, 0), 108)}  # sm -> (capability, SMs): H100 SXM, A100
# the smoke stage's tensors (dtype, numel): aligned rows, a tail, a short tensor, a second dtype
SMOKE_TENSORS = (("bfloat16", 4096), ("bfloat16", 1000), ("bfloat16", 37), ("float16", 1000))
GOAL_S = 10.0  # issue 42: every Triton stage's cold start <= 10 s on a 2-core machine

Launch = tuple[str, Any, tuple, dict]  # (step, JIT function, positional args, keyword args)


def _setup() -> None:
    """Import the kernels as compiled JIT functions (``TRITON_INTERPRET`` off), mpkern's copy of them."""
    os.environ.pop("TRITON_INTERPRET", None)
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import mpkern.triton_kernels.adamw
    import mpkern.triton_kernels.matmul
    import mpkern.triton_kernels.unscale  # noqa: F401 -- imported before the recorder sets TRITON_INTERPRET


def _bf16_params(sizes: list[int]) -> list[Any]:
    """Params laid out as the stages' builders make them (``mpkern.bench.common.unscale_problem`` /
    ``adamw_problem``: one fresh bf16 param and bf16 grad per size), values not drawn: none is read."""
    import torch

    ps = []
    for n in sizes:
        p = torch.nn.Parameter(torch.empty(n, dtype=torch.bfloat16))
        p.grad = torch.empty(n, dtype=torch.bfloat16)
        ps.append(p)
    return ps


def _kernel_modules() -> list[Any]:
    from mpkern.triton_kernels import adamw, unscale

    return [unscale, adamw]


def launches_unscale() -> list[Launch]:
    """The unscale stage: ``mpkern.unscale_(ps, inv, max_norm=1.0)`` on the triton backend."""
    import torch

    import mpkern
    from mpkern.bench.common import tensor_sizes
    from tools.gpu_check.stages_kernels import SIZES

    ps = _bf16_params(tensor_sizes(*SIZES["unscale"]))
    with ts.recording(_kernel_modules()) as calls, mpkern.use_backend("triton"):
        mpkern.unscale_(ps, torch.tensor(1.0), max_norm=1.0)
    return [("unscale_", *c) for c in calls]


def launches_adamw(default: bool) -> list[Launch]:
    """The adamw stage on triton: per storage mode (headline modes first), a fresh ``FusedAdamWMP`` and its
    first ``unscale_(opt, inv, max_norm)`` + ``step()``; ``default``: one optimizer with default arguments."""
    import torch

    import mpkern
    from mpkern.bench.common import ADAMW_LR, ADAMW_MAX_NORM, tensor_sizes
    from mpkern.bench.modes import mode_label, optimizer_kwargs
    from tools.gpu_check.stages_kernels import SIZES, ordered_modes

    modes: list[Any] = [None] if default else ordered_modes("triton")
    out: list[Launch] = []
    for mode in modes:
        kwargs = {} if mode is None else dict(capturable=True, **optimizer_kwargs(*mode))
        ps = _bf16_params(tensor_sizes(*SIZES["adamw"]))  # fresh params per mode, as the stage's
        with ts.recording(_kernel_modules()) as calls, mpkern.use_backend("triton"):
            opt = mpkern.FusedAdamWMP(ps, lr=ADAMW_LR, **kwargs)
            mpkern.unscale_(opt, torch.tensor(1.0), max_norm=ADAMW_MAX_NORM)
            opt.step()
        out += [("default step" if mode is None else mode_label(*mode), *c) for c in calls]
    return out


def launches_matmul(sm: int) -> list[Launch]:
    """The matmul stage (``MPKERN_MATMUL_CONFIG=fixed``): each case's ``mpkern.matmul(a, b, out_dtype)`` per
    output dtype and, for wgrad, ``matmul_accumulate_`` into an fp32 main_grad -- planned by ``plan_launch``
    for GPU ``sm`` on meta tensors in the layouts of ``mpkern.bench.matmul.operands``."""
    import torch

    from mpkern.triton_kernels import matmul as tk
    from tools.gpu_check.stages_matmul import mm_cases

    def empty(*shape: int, dtype: Any = torch.float32) -> Any:
        return torch.empty(*shape, dtype=dtype, device="meta")

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    out: list[Launch] = []
    saved = os.environ.get("MPKERN_MATMUL_CONFIG")
    os.environ["MPKERN_MATMUL_CONFIG"] = "fixed"
    try:
        for shape, m, n, k, layout, dts in mm_cases(False):
            for d in dts.split(","):
                dt = dtypes[d]
                a = empty(k, m, dtype=dt).t() if layout == "wgrad" else empty(m, k, dtype=dt)
                b = empty(n, k, dtype=dt).t() if layout == "fwd" else empty(k, n, dtype=dt)
                runs = [(f"{shape} {d}->{o}", empty(m, n, dtype=od), False) for o, od in ((d, dt), ("fp32", None))]
                if layout == "wgrad":
                    runs.append((f"{shape} {d}->+=main_grad", empty(m, n), True))
                for step, c, acc in runs:
                    ln = tk.plan_launch(a, b, c, None, acc, gpu=GPUS[sm])
                    out.append((step, ln.kernel, ln.args, ln.kwargs))
    finally:
        if saved is None:
            os.environ.pop("MPKERN_MATMUL_CONFIG", None)
        else:
            os.environ["MPKERN_MATMUL_CONFIG"] = saved
    return out


def launches_smoke() -> list[Launch]:
    """The smoke stage: ``scale_`` over :data:`SMOKE_TENSORS` (what ``tests/test_triton_aot.py`` counts again)."""
    import torch

    from mpkern.triton_kernels import unscale

    tensors = [torch.empty(n, dtype=getattr(torch, dt)) for dt, n in SMOKE_TENSORS]
    with ts.recording([unscale]) as calls:
        unscale.scale_(tensors, torch.tensor(0.5))
    return [("scale_", *c) for c in calls]


def stage_launches(stage: str, sm: int) -> list[Launch]:
    """The launches of ``stage``'s first calls on a GPU of compute capability ``sm``."""
    if stage == "matmul":
        return launches_matmul(sm)
    return {"unscale": launches_unscale, "adamw_triton": lambda: launches_adamw(False),
            "adamw_default": lambda: launches_adamw(True), "smoke": launches_smoke}[stage]()


def run(stages: list[str], sms: list[int]) -> dict[str, Any]:
    """Collect, specialise and compile every stage's launches for every ``sm``; the report as a dict."""
    recorded: dict[str, list[Launch]] = {}
    specs: dict[str, ts.Spec] = {}
    needs: dict[tuple[str, int], list[str]] = {}  # (stage, sm) -> its specs' keys, first need first
    steps: list[dict[str, Any]] = []
    binders: dict = {}
    for sm in sms:
        for st in stages:
            if st == "matmul" or st not in recorded:  # the others' launches do not depend on the GPU
                recorded[st] = stage_launches(st, sm)
            launches = recorded[st]
            keys = needs.setdefault((st, sm), [])
            for step, fn, args, kw in launches:
                spec = ts.specialise(fn, args, kw, sm, binders)
                spec = specs.setdefault(spec.key, spec)
                spec.needed_by.append(f"{st}: {step}")
                if spec.key not in keys:
                    keys.append(spec.key)
                    steps.append({"stage": st, "step": step, "sm": sm, "key": spec.key})
    warm = ts.warmup_seconds(sms[0])  # before any other compile: a fresh process's first compile (a second
    builds: dict[str, ts.Seconds] = {}  # arch in the same process adds ~0.05 s: not a stage's cost)
    for spec in specs.values():
        compiled = ts.compile_spec(spec)
        spec.launcher = ts.launcher_source(spec, compiled) if compiled is not None else None
        if spec.launcher is not None and spec.launcher not in builds:
            builds[spec.launcher] = ts.build_seconds(spec.launcher, "__triton_launcher")
    runtime = ts.runtime_module()
    utils = ts.build_seconds(runtime, "cuda_utils") if runtime is not None else NONE

    def cost(keys: list[str], seen_launchers: set[str]) -> tuple[ts.Seconds, int, ts.Seconds]:
        new = {specs[k].launcher for k in keys if specs[k].launcher is not None} - seen_launchers
        seen_launchers |= new
        return total(specs[k].seconds or NONE for k in keys), len(new), total(builds[c] for c in new)

    stage_rows = []
    for sm in sms:
        seen: set[str] = set()
        shared: set[str] = set()
        for st in stages:
            keys = needs[st, sm]
            comp, nl, ls = cost(keys, set())
            fresh = [k for k in keys if k not in seen]
            scomp, _, sls = cost(fresh, shared)
            seen |= set(fresh)
            cold = total([warm, comp, ls, utils])
            stage_rows.append({"stage": st, "sm": sm, "specialisations": len(keys), "compile": comp,
                               "launchers": nl, "launcher": ls, "warmup": warm, "cuda_utils": utils, "cold": cold,
                               "ok": cold.cpu <= GOAL_S, "shared_new": len(fresh),
                               "shared": total([warm, scomp, sls] + ([utils] if st == stages[0] else []))})
    for row in steps:
        row["seconds"] = specs[row.pop("key")].seconds
    return {"specs": list(specs.values()), "stages": stage_rows, "steps": steps, "warmup": warm,
            "launcher_builds": sorted(builds.values()), "cuda_utils": utils}


NONE = ts.Seconds(0.0, 0.0)


def total(parts: Any) -> ts.Seconds:
    """The sum of :class:`Seconds`."""
    parts = list(parts)
    return ts.Seconds(sum(p.wall for p in parts), sum(p.cpu for p in parts))


def _shown(spec: ts.Spec, varying: set[str]) -> str:
    """The specialisation in one line: the constexprs that differ between this kernel's specialisations, then
    the runtime signature (``/16``: divisible by 16; an integer 1 shows as a constexpr)."""
    cx = " ".join(f"{k}={v}" for k, v in spec.constexprs.items() if k in varying)
    sig = " ".join(t.replace("tensordesc", "desc").replace(", ", ",") for t in spec.signature.values())
    return f"{cx or '-'} | {sig}"


def _s(x: ts.Seconds | None) -> str:
    return "ERROR" if x is None else f"{x.cpu:6.2f} {x.wall:6.2f}"


def tables(report: dict[str, Any]) -> str:
    """The report as text: specialisations, per kernel, first calls, per stage (seconds: CPU, then wall)."""
    specs: list[ts.Spec] = report["specs"]
    by_kernel: dict[str, list[ts.Spec]] = {}
    for s in specs:
        by_kernel.setdefault(s.kernel.__name__, []).append(s)
    varying = {k: {n for n in ss[0].constexprs if len({str(s.constexprs.get(n)) for s in ss}) > 1}
               for k, ss in by_kernel.items()}
    lines = [f"{'kernel':<28} {'specialisation (varying constexprs | signature)':<90} {'sm':>3} {'cpu s':>6} "
             f"{'wall s':>6}", "-" * 136]
    for s in specs:
        lines.append(f"{s.kernel.__name__:<28} {_shown(s, varying[s.kernel.__name__])[:90]:<90} {s.sm:>3} "
                     f"{_s(s.seconds)}")
    lines += ["", f"{'kernel':<28} {'sm':>3} {'specialisations':>15} {'cpu s':>6} {'wall s':>6}", "-" * 62]
    for name, ss in by_kernel.items():
        for sm in sorted({s.sm for s in ss}, reverse=True):
            mine = [s for s in ss if s.sm == sm]
            lines.append(f"{name:<28} {sm:>3} {len(mine):>15} {_s(total(s.seconds or NONE for s in mine))}")
    lines += ["", f"{'first calls: stage / step (its new specialisations)':<62} {'sm':>3} {'cpu s':>6} {'wall s':>6}",
              "-" * 80]
    for r in report["steps"]:
        lines.append(f"{(r['stage'] + ' / ' + r['step'])[:62]:<62} {r['sm']:>3} {_s(r['seconds'])}")
    head = (f"{'stage: cold start (fresh process, empty cache)':<46} {'sm':>3} {'specs':>5} {'compile':>7} "
            f"{'launchers':>11} {'warm-up':>7} {'utils':>5} {'cold cpu':>8} {'wall':>6} {'<=10s':>5} "
            f"{'shared cache':>14}")
    lines += ["", head, "-" * len(head)]
    for r in report["stages"]:
        lines.append(f"{r['stage']:<46} {r['sm']:>3} {r['specialisations']:>5} {r['compile'].cpu:>7.2f} "
                     f"{r['launchers']:>3} {r['launcher'].cpu:>6.2f}s {r['warmup'].cpu:>7.2f} "
                     f"{r['cuda_utils'].cpu:>5.2f} {r['cold'].cpu:>8.2f} {r['cold'].wall:>6.2f} "
                     f"{'yes' if r['ok'] else 'NO':>5} {r['shared_new']:>3} {r['shared'].cpu:>8.2f} s")
    return "\n".join(lines)


def _plain(x: Any) -> Any:
    """``x`` with every :class:`Seconds` as ``{"wall": .., "cpu": ..}`` (JSON would make it a list)."""
    if isinstance(x, ts.Seconds):
        return x._asdict()
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    p.add_argument("--only", metavar="STAGES", help=f"comma-separated stages (of {', '.join(STAGES)})")
    p.add_argument("--arch", default="90,80", help="comma-separated compute capabilities: 90 (H100), 80 (A100)")
    p.add_argument("--smoke", action="store_true", help="only scale_ over four small tensors, sm_90")
    p.add_argument("--keep-cache", action="store_true", help="use Triton's cache (compile seconds are then ~0)")
    args = p.parse_args(argv)
    stages = ["smoke"] if args.smoke else [s.strip() for s in (args.only or ",".join(STAGES)).split(",")]
    sms = [90] if args.smoke else [int(a) for a in args.arch.split(",")]
    bad = [s for s in stages if s not in (*STAGES, "smoke")] + [str(a) for a in sms if a not in GPUS]
    if bad:
        p.error(f"unknown stage or arch: {', '.join(bad)}")
    _setup()
    with contextlib.ExitStack() as stack:
        if not args.keep_cache:
            os.environ["TRITON_CACHE_DIR"] = stack.enter_context(tempfile.TemporaryDirectory(prefix="tri_aot_"))
        t0 = time.perf_counter()
        report = run(stages, sms)
        took = time.perf_counter() - t0
    import triton

    print(f"Triton {triton.__version__}, ptxas {ts.ptxas_version()}, {len(report['specs'])} specialisations, "
          f"{took:.0f} s in all (load {os.getloadavg()[0]:.1f}); a process's first compile {report['warmup'].cpu:.2f} s"
          + (f"; C launchers built: {len(report['launcher_builds'])}, cuda_utils {report['cuda_utils'].cpu:.2f} s"
             if report["cuda_utils"].cpu else "; launchers prebuilt (none built)"))
    print(tables(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_plain({"triton": triton.__version__, "ptxas": ts.ptxas_version(), "seconds": took,
                              "load": os.getloadavg()[0], **{k: v for k, v in report.items() if k != "specs"},
                              "specs": [s.as_dict() for s in report["specs"]]}), f, indent=1, default=str)
    failed = [s for s in report["specs"] if s.error]
    for s in failed:
        print(f"FAIL {s.kernel.__name__} sm_{s.sm}: {s.error}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
