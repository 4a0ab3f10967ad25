"""Ahead-of-time SASS check of the Triton GEMM (``triton_kernels/matmul.py``), no GPU needed.

Compiles every autotune config of the Hopper TMA kernel for ``GPUTarget("cuda", 90, 32)`` and of the
pointer kernel for ``GPUTarget("cuda", 80, 32)`` (:func:`build_cases`: bf16 and fp16 operands, 16-bit and
fp32 + bias outputs, the fp32 ACCUMULATE epilogue, the training layouts) with
``triton.compile(ASTSource(...))``, disassembles each cubin with the ``cuobjdump`` shipped with Triton
(``triton/backends/nvidia/bin``), and prints per config: compile seconds, the tensor-core instructions
(``HGMMA`` -- wgmma -- and ``UTMALDG`` -- TMA tile loads -- on sm_90, ``HMMA`` -- mma.sync -- on sm_80),
spill bytes (ptxas' report; ``STL`` instructions as a cross-check), registers per thread and shared
memory per program.

The launch is the launcher's own (``plan_launch``, what ``matmul_into`` runs, with the config given) on meta
tensors of a representative problem, specialised by Triton's own JIT binder (``benchmarks/triton_spec.py``:
pointers and integers divisible by 16 get ``tt.divisibility``, a unit stride becomes a constant), so the
code is the code the GPU would compile for that problem.

Exit status 1, with the reason, when a main sm_90 config has no HGMMA, no UTMALDG, spills, needs more
shared memory than an H100 program may have, or does not compile; also when a main sm_80 config has no
HMMA or spills. Rows marked ``info`` are shown but not checked (they show why the pruning rules exist).

    python benchmarks/matmul_sass.py                 # every case (60-80 s on two cores)
    python benchmarks/matmul_sass.py --json out.json # and the rows as JSON
    python benchmarks/matmul_sass.py --smoke         # one small sm_90 case (what tests/test_matmul_sass.py runs)
    python benchmarks/matmul_sass.py --only wgrad    # cases whose name contains "wgrad"

Compile times are real: Triton's cache goes to a fresh temporary folder unless ``--keep-cache``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SM90_SHARED_LIMIT = 232448  # bytes of dynamic shared memory one program may use on H100/H200 (227 KB)
SM80_SHARED_LIMIT = 166912  # A100 (163 KB)
PROBLEM = (4096, 4096, 4096)  # M, N, K of the representative problem (every size and stride a multiple of 16)


@dataclass(frozen=True)
class Case:
    """One kernel compilation: which kernel and arch, operand/output dtypes, epilogue, layout, config."""

    name: str
    arch: int                 # 90: the TMA kernel; 80: the pointer kernel
    dtype: str                # operands: "bf16" / "fp16"
    out: str                  # output: "bf16" / "fp16" / "fp32"
    block: tuple[int, int, int]
    stages: int
    warps: int
    bias: bool = False
    accumulate: bool = False
    a_t: bool = False         # A is a transposed view (stride(0) == 1): the weight-gradient GEMM's grad_out.t()
    b_t: bool = False         # B is a transposed view: the forward's weight.t()
    main: bool = True         # checked (exit status); False: shown for information only


def _tag(cfg: Any) -> str:
    kw = cfg.kwargs
    return f"{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']} s{cfg.num_stages} w{cfg.num_warps}"


def _case(name: str, arch: int, cfg: Any, dtype: str, out: str, **kw: Any) -> Case:
    kwa = cfg.kwargs
    return Case(f"sm{arch} {name} {_tag(cfg)}", arch, dtype, out, (kwa["BLOCK_M"], kwa["BLOCK_N"], kwa["BLOCK_K"]),
                cfg.num_stages, cfg.num_warps, **kw)


def build_cases() -> list[Case]:
    """Every autotune config of both kernels (``CONFIGS_SM90`` / ``CONFIGS_SM80``) in the layouts of training:
    forward ``x @ W.t()`` (B transposed) to a 16-bit output, input gradient ``dY @ W`` (plain) to fp32 with a
    bias, weight gradient ``dY.t() @ x`` (A transposed) accumulated into the fp32 main_grad -- the last only
    checked for the configs the autotuner's pruning keeps for ACCUMULATE (the others are shown as ``info``:
    why they are pruned). The first sm_90 config also with fp16 operands and with both operands transposed."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from mpkern.triton_kernels import matmul as tk

    cases = []
    kept90 = tk.prune_configs_sm90(tk.CONFIGS_SM90, {}, ACCUMULATE=True)
    kept80 = tk.prune_configs(tk.CONFIGS_SM80, {}, ACCUMULATE=True)
    for i, cfg in enumerate(tk.CONFIGS_SM90):
        cases.append(_case("fwd bf16->bf16", 90, cfg, "bf16", "bf16", b_t=True))
        if i == 0:
            cases.append(_case("fwd fp16->fp16", 90, cfg, "fp16", "fp16", b_t=True))
            cases.append(_case("A^T B^T bf16->bf16", 90, cfg, "bf16", "bf16", a_t=True, b_t=True))
        cases.append(_case("dgrad fp16->fp32+bias", 90, cfg, "fp16", "fp32", bias=True))
        kept = cfg in kept90
        cases.append(_case("wgrad bf16 +=fp32" + ("" if kept else " (pruned)"), 90, cfg, "bf16", "fp32",
                           accumulate=True, a_t=True, main=kept))
    for cfg in tk.CONFIGS_SM80:
        cases.append(_case("fwd bf16->bf16", 80, cfg, "bf16", "bf16", b_t=True))
        kept = cfg in kept80
        cases.append(_case("wgrad bf16 +=fp32" + ("" if kept else " (pruned)"), 80, cfg, "bf16", "fp32",
                           accumulate=True, a_t=True, main=kept))
    return cases


# One small sm_90 case: the unit test's (a second or two to compile).
SMOKE = Case("sm90 smoke fwd bf16->bf16 64x64x64 s3 w4", 90, "bf16", "bf16", (64, 64, 64), 3, 4, b_t=True)


@dataclass
class Row:
    name: str
    arch: int
    main: bool
    seconds: float | None = None
    hgmma: int = 0
    utmaldg: int = 0
    hmma: int = 0
    stl: int = 0
    spill_bytes: int | None = None
    registers: int | None = None
    shared: int | None = None
    error: str | None = None
    problems: list[str] = field(default_factory=list)


_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _tool(name: str) -> str:
    """A CUDA binary tool: the one Triton ships (the same version as its ptxas), else PATH / CUDA_HOME."""
    import triton

    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if os.path.isfile(bundled):
        return bundled
    found = shutil.which(name) or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", name)
    if not os.path.isfile(found):
        raise FileNotFoundError(f"{name} not found (triton/backends/nvidia/bin, PATH, CUDA_HOME/bin)")
    return found


def _source(case: Case) -> tuple[Any, dict]:
    """The ``ASTSource`` of ``case`` and its compile options: the launch ``matmul_into`` would make on that GPU
    with that config (``plan_launch``), specialised by Triton's own JIT binder (``triton_spec.specialise``)."""
    import torch
    import triton

    from mpkern.triton_kernels import matmul as tk
    from triton_spec import specialise

    m, n, k = PROBLEM
    dt = getattr(torch, _DTYPES[case.dtype])
    meta = dict(device="meta", dtype=dt)
    a = torch.empty(k, m, **meta).t() if case.a_t else torch.empty(m, k, **meta)
    b = torch.empty(n, k, **meta).t() if case.b_t else torch.empty(k, n, **meta)
    out = torch.empty(m, n, device="meta", dtype=getattr(torch, _DTYPES[case.out]))
    bias = torch.empty(n, device="meta", dtype=torch.float32) if case.bias else None
    bm, bn, bk = case.block
    cfg = triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=case.warps,
                        num_stages=case.stages)
    gpu = ((case.arch // 10, case.arch % 10), 132 if case.arch >= 90 else 108)
    launch = tk.plan_launch(a, b, out, bias, case.accumulate, gpu=gpu, config=cfg)
    expected = tk.tma_kernel if case.arch >= 90 else tk.pointer_kernel
    if launch.kernel is not expected:
        raise RuntimeError(f"{case.name}: the launcher picks {launch.kernel.__name__}, not {expected.__name__}")
    spec = specialise(launch.kernel, launch.args, launch.kwargs, case.arch, {})
    return spec.src, spec.options.__dict__


def _ptxas_report(ptx: str, arch: int) -> str:
    """``ptxas -v`` of the PTX (for a Triton without the ptxas-log knob)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        gpu = "sm_90a" if arch == 90 else f"sm_{arch}"
        res = subprocess.run([_tool("ptxas"), "-v", f"--gpu-name={gpu}", path, "-o", os.path.join(d, "k.o")],
                             capture_output=True, text=True, check=False)
    return res.stdout + res.stderr


def compile_case(case: Case) -> Row:
    """Compile ``case`` for its arch and count its SASS; never raises (a failure is the row's ``error``)."""
    row = Row(case.name, case.arch, case.main)
    try:
        import triton
        from triton import knobs
        from triton.backends.compiler import GPUTarget

        src, options = _source(case)
        log = io.StringIO()
        has_knob = hasattr(knobs, "nvidia") and hasattr(knobs.nvidia, "dump_ptxas_log")
        saved = knobs.nvidia.dump_ptxas_log if has_knob else None
        if has_knob:
            knobs.nvidia.dump_ptxas_log = True
        t0 = time.perf_counter()
        try:
            with contextlib.redirect_stdout(log):
                kernel = triton.compile(src, target=GPUTarget("cuda", case.arch, 32), options=options)
        finally:
            if has_knob:
                knobs.nvidia.dump_ptxas_log = saved
        row.seconds = time.perf_counter() - t0
        report = log.getvalue()
        if "spill stores" not in report:
            report = _ptxas_report(kernel.asm["ptx"], case.arch)
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
        row.spill_bytes = sum(int(s) + int(lo) for s, lo in spills) if spills else None
        regs = re.findall(r"Used (\d+) registers", report)
        row.registers = int(regs[-1]) if regs else None
        row.shared = int(kernel.metadata.shared)
        with tempfile.TemporaryDirectory() as d:
            cubin = os.path.join(d, "k.cubin")
            with open(cubin, "wb") as f:
                f.write(kernel.asm["cubin"])
            sass = subprocess.run([_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                                  check=True).stdout
            usage = subprocess.run([_tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True,
                                   check=False).stdout
        ops = re.findall(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass, flags=re.M)
        row.hgmma = sum(op == "HGMMA" for op in ops)
        row.utmaldg = sum(op == "UTMALDG" for op in ops)
        row.hmma = sum(op == "HMMA" for op in ops)
        row.stl = sum(op == "STL" for op in ops)
        if row.registers is None:
            m = re.search(r"REG:(\d+)", usage)
            row.registers = int(m.group(1)) if m else None
    except Exception as e:  # noqa: BLE001 -- a failed compile is a row of the report (and a non-zero exit)
        row.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
    row.problems = _problems(row)
    return row


def _problems(row: Row) -> list[str]:
    """Why a main row fails the check (empty when it passes or is informational)."""
    if not row.main:
        return []
    if row.error:
        return [f"does not compile ({row.error})"]
    out = []
    spilled = (row.spill_bytes or 0) > 0 or row.stl > 0
    if row.arch >= 90:
        if row.hgmma == 0:
            out.append("no HGMMA (wgmma) instruction")
        if row.utmaldg == 0:
            out.append("no UTMALDG (TMA load) instruction")
        if row.shared is not None and row.shared > SM90_SHARED_LIMIT:
            out.append(f"{row.shared} bytes of shared memory > {SM90_SHARED_LIMIT}")
    else:
        if row.hmma == 0:
            out.append("no HMMA (mma.sync) instruction")
        if row.shared is not None and row.shared > SM80_SHARED_LIMIT:
            out.append(f"{row.shared} bytes of shared memory > {SM80_SHARED_LIMIT}")
    if spilled:
        out.append(f"spills ({row.spill_bytes} bytes, {row.stl} STL)")
    return out


def run(cases: list[Case]) -> list[Row]:
    """Compile every case (Triton's JIT, not its interpreter: ``TRITON_INTERPRET`` must be off before
    ``mpkern.triton_kernels`` is imported -- :func:`main` sees to that)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    return [compile_case(c) for c in cases]


def table(rows: list[Row]) -> str:
    def num(v: Any) -> str:
        return "-" if v is None else str(v)

    head = (f"{'case':<50} {'sec':>5} {'HGMMA':>5} {'UTMALDG':>7} {'HMMA':>5} {'spill':>5} {'regs':>4} {'smem':>7}"
            "  check")
    lines = [head, "-" * len(head)]
    for r in rows:
        check = "info" if not r.main else ("FAIL: " + "; ".join(r.problems) if r.problems else "ok")
        if r.error and not r.main:
            check = f"info ({r.error})"
        sec = "-" if r.seconds is None else f"{r.seconds:.1f}"
        lines.append(f"{r.name:<50} {sec:>5} {r.hgmma:>5} {r.utmaldg:>7} {r.hmma:>5} {num(r.spill_bytes):>5} "
                     f"{num(r.registers):>4} {num(r.shared):>7}  {check}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--smoke", action="store_true", help="only the one small sm_90 case")
    p.add_argument("--only", metavar="TEXT", help="only the cases whose name contains TEXT")
    p.add_argument("--keep-cache", action="store_true", help="use Triton's cache (compile seconds are then 0)")
    args = p.parse_args(argv)

    os.environ.pop("TRITON_INTERPRET", None)  # before mpkern.triton_kernels is imported: compile, do not interpret
    cases = [SMOKE] if args.smoke else [c for c in build_cases() if not args.only or args.only in c.name]
    if not cases:
        print(f"no case matches {args.only!r}", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        if not args.keep_cache:
            os.environ["TRITON_CACHE_DIR"] = stack.enter_context(tempfile.TemporaryDirectory(prefix="mm_sass_"))
        t0 = time.perf_counter()
        rows = run(cases)
        total = time.perf_counter() - t0
    import triton

    print(f"Triton {triton.__version__}, ptxas {_ptxas_version()}, problem M=N=K={PROBLEM[0]}, {total:.0f} s in all")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "problem": PROBLEM, "rows": [asdict(r) for r in rows]}, f,
                      indent=1)
    failed = [r for r in rows if r.problems]
    for r in failed:
        print(f"FAIL {r.name}: {'; '.join(r.problems)}", file=sys.stderr)
    return 1 if failed else 0


def _ptxas_version() -> str:
    try:
        out = subprocess.run([_tool("ptxas"), "--version"], capture_output=True, text=True, check=False).stdout
    except FileNotFoundError:
        return "missing"
    m = re.search(r"release ([\d.]+)", out)
    return m.group(1) if m else "?"


if __name__ == "__main__":
    raise SystemExit(main())
