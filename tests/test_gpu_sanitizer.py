# The canned reports below keep compute-sanitizer's lines as long as it prints them:
# ruff: noqa: E501
"""The GPU check's sanitizer stage (issue 42 item 4) without a GPU: the workload's every labelled call
runs on the cpu backend and its labels cover every storage mode the registry gives a CUDA kernel and
the chunk boundaries read from the CUDA source; the kernel scan finds the kernels and the shared-memory
ones; compute-sanitizer's report text (canned samples in its real format, sources cited beside each)
becomes findings mapped to the calls that caused them; the stage writes its JSON when the tool is
absent (exit 0) and, through a stand-in compute-sanitizer that runs the workload on the CPU, when it
is present or cut off by its limit; the table renders the JSON. What only a GPU can show -- the real
tool attaching, its filters matching the mangled names, errors or none -- runs in scripts/gpu_check.sh.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from mpkern.optim import storage
from tools.gpu_check import sanitizer, sanitizer_table
from tools.gpu_check.sanitizer_report import CALL, error_kind, kernel_of, parse_report, scan_kernels, scan_source_tree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _workload(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.gpu_check.sanitizer_workload", "--device", "cpu", *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)


@pytest.fixture(scope="module")
def full_run() -> subprocess.CompletedProcess:
    return _workload()


def _labels(stdout: str) -> list[str]:
    return [ln[len(CALL):] for ln in stdout.splitlines() if ln.startswith(CALL)]


def _chunk_from_source() -> int:
    """kChunk of csrc/cuda/multi_tensor.cuh, read from the header (``1 << 16`` or a number)."""
    text = Path(ROOT, "csrc", "cuda", "multi_tensor.cuh").read_text()
    expr = re.search(r"constexpr\s+int64_t\s+kChunk\s*=\s*([^;]+);", text).group(1)
    m = re.fullmatch(r"\s*1\s*<<\s*(\d+)\s*", expr)
    return 1 << int(m.group(1)) if m else int(expr)


# ---- the workload on the CPU ------------------------------------------------------------------------
def test_workload_every_call_runs_on_cpu(full_run):
    assert full_run.returncode == 0, full_run.stdout[-3000:] + full_run.stderr[-3000:]
    rep = parse_report(full_run.stdout, "cpu", [])
    assert rep["failed"] == [] and rep["ended"]
    assert rep["planned"] == rep["calls"] == rep["done"] > 100
    labels = _labels(full_run.stdout)
    assert len(set(labels)) == len(labels), "labels must be unique: an error maps to one call"


def test_workload_covers_every_cuda_storage_mode(full_run):
    """Every (param dtype, master:moments) the registry gives a CUDA kernel, each in the three views."""
    labels = _labels(full_run.stdout)
    seen = {(m.group(1), m.group(2), m.group(3)) for m in
            (re.match(r"adamw p=(\w+) g=\1 mode=(\S+) view=(.+)$", lb) for lb in labels) if m}
    expected = {(SHORT[pdt], f"{storage.master_kind(mw, pdt).name}:{sd}")
                for pdt in (torch.bfloat16, torch.float16, torch.float32)
                for mw, sd in storage.modes(pdt, backend="cuda")}
    assert len(expected) >= 16 + 12 + 4 - 8  # fp32 params keep no master: 4 distinct modes
    for view in ("p@1 g@3", "p@0 g@1", "aligned"):
        assert {(p, mode) for p, mode, v in seen if v == view} == expected, view


def test_workload_hits_the_chunk_and_vector_boundaries(full_run):
    """unscale_ at the chunk read from the CUDA header +-1 and the 16-byte vector width +-1, per
    grad dtype, whole and at element offsets 1 and 3; AdamW lists hold the chunk +-1 too."""
    labels = set(_labels(full_run.stdout))
    chunk = _chunk_from_source()
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        v = 16 // torch.empty((), dtype=dt).element_size()
        for n in (1, v - 1, v, v + 1, chunk - 1, chunk, chunk + 1):
            for view in ("aligned", "@1", "@3"):
                assert f"unscale g={SHORT[dt]} n={n} view={view} clip" in labels
    from tools.gpu_check import sanitizer_workload  # torch-dependent: imported where used

    assert {chunk - 1, chunk, chunk + 1} <= set(sanitizer_workload.adam_sizes(False))


# ---- the kernels, from the source ---------------------------------------------------------------------
def test_scan_finds_the_trees_kernels_and_their_shared_memory():
    found = scan_source_tree(ROOT)
    n_global = sum(len(re.findall(r"\b__global__\b", p.read_text())) for p in Path(ROOT, "csrc", "cuda").glob("*.cu*"))
    assert len(found) == n_global  # one definition per __global__ in the tree
    # adamw_cuda.cu's shared memory is a device function's (the compact kernels' two-stage loads), outside
    # any kernel body: the scan counts it for both of the file's kernels
    assert found == {"adamw_kernel": True, "prep_kernel": True, "stats_kernel": True,
                     "stats_finalize_kernel": True, "scale_kernel": True}


def test_kernel_filters_match_the_builds_mangled_names():
    """``kns=<length><name>`` (the stage's --kernel-name filter) is in the mangled name of each kernel
    of the built extension, when it was built with CUDA: the filter instruments what it should."""
    built = sorted(Path(ROOT, "mpkern").glob("_C*.so"))
    blob = built[0].read_bytes() if built else b""
    mangled = set(re.findall(rb"_ZN6mpkern4cuda[A-Za-z0-9_]+", blob))
    if not mangled:
        pytest.skip("the extension here was built without CUDA kernels")
    for k in scan_source_tree(ROOT):
        assert any(f"{len(k)}{k}".encode() in m for m in mangled), f"no mangled name in {built[0].name} holds {k}"


def test_scan_kernels_reads_attributes_templates_declarations_and_comments():
    src = textwrap.dedent("""
        template <int N>
        __global__ void __launch_bounds__(256, min_blocks(N, 2))
            tiled(const float* x) {  // __shared__ in a comment does not count
          float y = x[0];
        }
        __global__ void declared_only(int* p);
        /* __global__ void commented(int* p) { __shared__ int s; } */
        __global__ void reduce(int* p) {
          __shared__ int s[32];
          if (p) { s[0] = *p; }
        }
    """)
    assert scan_kernels(src) == {"tiled": False, "reduce": True}
    helper = "__device__ int f() { __shared__ int s; return s; }\n__global__ void k(int* p) { *p = f(); }\n"
    assert scan_kernels(helper) == {"k": True}  # a device function's shared array: every kernel counts


# ---- compute-sanitizer's report text ----------------------------------------------------------------------
# memcheck in CUDA 12.x: the shape of the reports quoted in ORNL/HeCBench#132 (CUDA 12.9: "Invalid __global__
# read of size 4 bytes / at compress(...)+0xb0 / by thread (1,0,0) in block (5,0,0) / Access at 0x... is out of
# bounds / and is 1 bytes after the nearest allocation at 0x... of size 324 bytes / Saved host backtrace ... /
# Host Frame: ..."), device frames as in google-deepmind/mujoco_warp#664 ("Device Frame: f(...)+0x1dd40 in
# file:1047"), "ERROR SUMMARY: 0 errors" as quoted from a CUDA 12.8 run; the names are mpkern's demangled ones.
MEMCHECK_12 = """\
========= COMPUTE-SANITIZER
@@sanitizer-plan 3 calls on cuda (cuda backend)
@@sanitizer-call unscale g=bf16 n=65537 view=@3 clip
@@sanitizer-done unscale g=bf16 n=65537 view=@3 clip
@@sanitizer-call adamw p=bf16 g=bf16 mode=8bit:4bit_m view=p@1 g@3
========= Invalid __global__ read of size 16 bytes
=========     at void mpkern::cuda::(anonymous namespace)::adamw_kernel<(int)2, (int)2, (int)5, (int)3>(const mpkern::cuda::(anonymous namespace)::AdamMeta *, const mpkern::cuda::(anonymous namespace)::TensorConsts *, int, long, mpkern::cuda::(anonymous namespace)::AdamScalars)+0x1c50
=========     by thread (7,0,0) in block (3,0,0)
=========     Access at 0x7f3a5e2000f4 is out of bounds
=========     and is 4 bytes after the nearest allocation at 0x7f3a5e200000 of size 240 bytes
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: cudaLaunchKernel [0x7c2a3] in libcudart.so.12
=========         Host Frame: mpkern::cuda::adamw_step_cuda_(...) [0x1f00] in _C.cpython-311-x86_64-linux-gnu.so
=========
========= Invalid __global__ read of size 16 bytes
=========     at void mpkern::cuda::(anonymous namespace)::adamw_kernel<(int)2, (int)2, (int)5, (int)3>(const mpkern::cuda::(anonymous namespace)::AdamMeta *, const mpkern::cuda::(anonymous namespace)::TensorConsts *, int, long, mpkern::cuda::(anonymous namespace)::AdamScalars)+0x1c50
=========     by thread (8,0,0) in block (3,0,0)
=========     Access at 0x7f3a5e200104 is out of bounds
=========     and is 20 bytes after the nearest allocation at 0x7f3a5e200000 of size 240 bytes
=========
@@sanitizer-done adamw p=bf16 g=bf16 mode=8bit:4bit_m view=p@1 g@3
@@sanitizer-call grad_stats g=fp16 view=@3 unscale_(optimizer) deferred
========= Invalid __shared__ write of size 8 bytes
=========     at double mpkern::cuda::(anonymous namespace)::block_reduce<double, mpkern::cuda::(anonymous namespace)::SumD>(double, SumD, double *)+0x90 in unscale_cuda.cu:33
=========     by thread (0,0,0) in block (0,0,0)
=========     Address 0x400 is out of bounds
=========         Device Frame: mpkern::cuda::(anonymous namespace)::stats_finalize_kernel(const mpkern::cuda::TensorMeta *, int, long, const double *, const unsigned int *, const float *, float *, float *)+0x4f0 in unscale_cuda.cu:195
=========
@@sanitizer-done grad_stats g=fp16 view=@3 unscale_(optimizer) deferred
@@sanitizer-end calls=3 failed=0
========= ERROR SUMMARY: 3 errors
"""

# memcheck in CUDA 11.x: "at 0x3b0 in void f<...>(...)" and "Address 0x964000008 is out of bounds", the shape
# quoted in numba/numba#7284 and zama-ai/concrete-core#332; the misaligned report is the example of NVIDIA's
# Compute Sanitizer manual ("Understanding Memcheck Errors": "at unaligned_kernel():0x160 in memcheck_demo.cu:6
# / Address 0x7f6510c00001 is misaligned"); the API error is that manual's "Program hit ... (error N) on CUDA API
# call to ..." with the runtime's error name as CUDA 12 prints it.
MEMCHECK_11 = """\
========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 8 bytes
=========     at 0x3b0 in void mpkern::cuda::(anonymous namespace)::scale_kernel(const mpkern::cuda::TensorMeta *, int, long, const float *)
=========     by thread (251,0,0) in block (0,0,0)
=========     Address 0x964000008 is out of bounds
=========
@@sanitizer-call unscale g=fp32 n=3 view=@1 clip
========= Invalid __global__ write of size 4 bytes
=========     at unaligned_kernel():0x160 in memcheck_demo.cu:6
=========     by thread (0,0,0) in block (0,0,0)
=========     Address 0x7f6510c00001 is misaligned
=========
========= Program hit cudaErrorIllegalAddress (error 700) due to "an illegal memory access was encountered" on CUDA API call to cudaStreamSynchronize.
=========     Saved host backtrace up to driver entry point at error
=========
@@sanitizer-fail unscale g=fp32 n=3 view=@1 clip :: RuntimeError: CUDA error: an illegal memory access was encountered
@@sanitizer-end calls=9 failed=1
========= Target application returned an error
========= ERROR SUMMARY: 3 errors
"""

# racecheck's analysis report in CUDA 12.4+: "Error: Race reported between Write access at f(...)+0xd790 in
# file:324 / and Read access at f(...)+0xd5c0 in file:312 [16 hazards]" (NVIDIA/cudf#23900, NVIDIA/cccl#1903),
# the warning form "Warning: Race reported between Read access at ... / and Write access at ... [294291
# hazards]" (ORNL/HeCBench#133) and "RACECHECK SUMMARY: 1 hazard displayed (0 errors, 1 warning)"
# (kokkos/kokkos#6217).
RACECHECK = """\
========= COMPUTE-SANITIZER
@@sanitizer-plan 2 calls on cuda (cuda backend)
@@sanitizer-call unscale g=fp16 n=16385 view=@3 clip
========= Error: Race reported between Write access at mpkern::cuda::(anonymous namespace)::stats_kernel(const mpkern::cuda::TensorMeta *, int, long, double *, unsigned int *)+0x8d0 in unscale_cuda.cu:158
=========     and Read access at mpkern::cuda::(anonymous namespace)::stats_kernel(const mpkern::cuda::TensorMeta *, int, long, double *, unsigned int *)+0x9a0 in unscale_cuda.cu:160 [128 hazards]
=========
========= Warning: Race reported between Read access at mpkern::cuda::(anonymous namespace)::scale_kernel(const mpkern::cuda::TensorMeta *, int, long, const float *)+0x260
=========     and Write access at mpkern::cuda::(anonymous namespace)::scale_kernel(const mpkern::cuda::TensorMeta *, int, long, const float *)+0x200 [512 hazards]
=========
@@sanitizer-done unscale g=fp16 n=16385 view=@3 clip
@@sanitizer-call unscale g=fp16 n=1 view=@3 clip
@@sanitizer-done unscale g=fp16 n=1 view=@3 clip
@@sanitizer-end calls=2 failed=0
========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)
"""
KERNELS = ["adamw_kernel", "prep_kernel", "stats_kernel", "stats_finalize_kernel", "scale_kernel"]


def _by_kernel(findings: list[dict]) -> dict[str, dict]:
    return {f["kernel"]: f for f in findings}


def test_parse_memcheck_12_maps_errors_to_kernels_and_calls():
    rep = parse_report(MEMCHECK_12, "memcheck", KERNELS)
    assert (rep["errors"], rep["planned"], rep["calls"], rep["done"], rep["ended"]) == (3, 3, 3, 3, True)
    got = _by_kernel(rep["findings"])
    assert set(got) == {"adamw_kernel", "stats_finalize_kernel"}  # the device frame names the kernel
    adam = got["adamw_kernel"]
    assert (adam["label"], adam["kind"], adam["count"]) == (
        "adamw p=bf16 g=bf16 mode=8bit:4bit_m view=p@1 g@3", "Invalid __global__ read (out of bounds)", 2)
    assert adam["first_lines"][0] == "Invalid __global__ read of size 16 bytes"
    assert adam["first_lines"][3] == "Access at 0x7f3a5e2000f4 is out of bounds"
    fin = got["stats_finalize_kernel"]
    assert (fin["label"], fin["kind"], fin["count"]) == (
        "grad_stats g=fp16 view=@3 unscale_(optimizer) deferred", "Invalid __shared__ write (out of bounds)", 1)


def test_parse_memcheck_11_docs_and_api_errors():
    rep = parse_report(MEMCHECK_11, "memcheck", KERNELS)
    assert rep["errors"] == 3 and rep["failed"] and rep["notes"] == ["Target application returned an error"]
    rows = {(f["kernel"], f["label"], f["kind"]): f["count"] for f in rep["findings"]}
    assert rows == {
        ("scale_kernel", "(before the first call)", "Invalid __global__ read (out of bounds)"): 1,
        ("unaligned_kernel", "unscale g=fp32 n=3 view=@1 clip", "Invalid __global__ write (misaligned)"): 1,
        ("?", "unscale g=fp32 n=3 view=@1 clip", "CUDA API error cudaErrorIllegalAddress"): 1,
    }


def test_parse_racecheck_counts_hazards_and_severities():
    rep = parse_report(RACECHECK, "racecheck", KERNELS)
    assert (rep["errors"], rep["warnings"], rep["done"]) == (1, 1, 2)
    got = _by_kernel(rep["findings"])
    assert (got["stats_kernel"]["kind"], got["stats_kernel"]["hazards"]) == ("race error: Write/Read", 128)
    assert (got["scale_kernel"]["kind"], got["scale_kernel"]["hazards"]) == ("race warning: Read/Write", 512)
    assert {f["label"] for f in rep["findings"]} == {"unscale g=fp16 n=16385 view=@3 clip"}


def test_parse_cut_off_run_has_no_summary():
    cut = MEMCHECK_12.split("@@sanitizer-done adamw")[0]
    rep = parse_report(cut, "memcheck", KERNELS)
    assert rep["errors"] is None and rep["summary"] is None and not rep["ended"]
    assert (rep["calls"], rep["done"]) == (2, 1) and _by_kernel(rep["findings"])["adamw_kernel"]["count"] == 2


def test_kernel_names_and_kinds():
    assert kernel_of(["at void ns::fused_scale_kernel<float>(float *)+0x10"], KERNELS) == "fused_scale_kernel"
    assert kernel_of(["at _ZN6mpkern4cuda12_GLOBAL__N_112adamw_kernelILi2EEEvPKv+0x10"], KERNELS) == "adamw_kernel"
    assert error_kind(["ERROR: Potential WAW hazard detected at __shared__ 0x0 in block (0,0,0) :"]) == \
        "race error: WAW hazard"  # racecheck --racecheck-report hazard (gunrock/gunrock#844's shape)
    assert error_kind(["Malloc/Free error encountered : Double free", "at 0x79d8"]) == "Malloc/Free error: Double free"


# ---- the stage ----------------------------------------------------------------------------------------------
def _stage(tmp_path: Path, env: dict, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "tools.gpu_check.sanitizer", "--out", str(out), *args],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=env, check=False)
    return r, json.loads((out / "sanitizer.json").read_text())


def _bare_env(tmp_path: Path, path_dirs: list[str]) -> dict:
    empty = tmp_path / "no_cuda"
    empty.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    env.update(PATH=os.pathsep.join(path_dirs), CUDA_HOME=str(empty))
    return env


def test_stage_without_compute_sanitizer_says_so_and_succeeds(tmp_path):
    if os.path.exists("/usr/local/cuda/bin/compute-sanitizer"):
        pytest.skip("this machine has /usr/local/cuda/bin/compute-sanitizer")
    r, data = _stage(tmp_path, _bare_env(tmp_path, ["/usr/bin", "/bin"]), "--limit", "30")
    assert r.returncode == 0, r.stderr
    assert data["status"] == "done" and data["rows"] == [] and data["findings"] == []
    assert data["note"].startswith("compute-sanitizer not found (looked in PATH, ")
    assert str(tmp_path / "no_cuda" / "bin") in data["note"] and "/usr/local/cuda/bin" in data["note"]
    assert sanitizer_table.lines(data) == [f"sanitizer: {data['note']}"]


FAKE = """\
#!{python}
# A stand-in compute-sanitizer: answers --help/--version, records its arguments, runs the application
# (on the CPU) echoing its output, and after the first adamw call marker reports one memcheck error.
import os, subprocess, sys, time
args = sys.argv[1:]
if args and args[0] in ("--help", "--version"):
    print("Compute Sanitizer 2099.1 stand-in" if args[0] == "--version" else
          "--tool --error-exitcode --show-backtrace --report-api-errors --print-limit --launch-timeout --port")
    sys.exit(0)
tool = args[args.index("--tool") + 1]
with open(os.path.join(os.environ["FAKE_LOG"], tool + ".argv"), "w") as f:
    f.write("\\n".join(args))
if os.environ.get("FAKE_HANG"):  # a run that never ends: one call begun, a child process waiting under it
    print("@@sanitizer-plan 5 calls on cuda (cuda backend)")
    print("@@sanitizer-call unscale g=fp32 n=1 view=@3 clip", flush=True)
    child = subprocess.Popen(["sleep", "600"])
    with open(os.path.join(os.environ["FAKE_LOG"], "child.pid"), "w") as f:
        f.write(str(child.pid))
    time.sleep(600)
app = args[args.index("-m") - 1:]
app[app.index("cuda")] = "cpu"
print("========= COMPUTE-SANITIZER", flush=True)
p = subprocess.Popen(app, stdout=subprocess.PIPE, text=True)
told = False
for line in p.stdout:
    print(line, end="", flush=True)
    if tool == "memcheck" and not told and line.startswith("@@sanitizer-call adamw"):
        told = True
        print("========= Invalid __global__ write of size 4 bytes")
        print("=========     at mpkern::cuda::(anonymous namespace)::prep_kernel(const AdamMeta *, int, AdamScalars, TensorConsts *)+0x1b0")
        print("=========     by thread (0,0,0) in block (0,0,0)")
        print("=========     Access at 0x7f0000000100 is out of bounds")
        print("=========", flush=True)
p.wait()
print("========= " + ("ERROR SUMMARY: %d errors" % told if tool == "memcheck"
                      else "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"), flush=True)
sys.exit(p.returncode or (19 if told else 0))
"""


def _fake_sanitizer(tmp_path: Path) -> dict:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "compute-sanitizer"
    exe.write_text(FAKE.format(python=sys.executable))
    exe.chmod(0o755)
    env = _bare_env(tmp_path, [str(bindir), "/usr/bin", "/bin"])
    env["FAKE_LOG"] = str(tmp_path)
    return env


def test_stage_with_a_stand_in_sanitizer_runs_both_tools(tmp_path):
    env = _fake_sanitizer(tmp_path)
    assert sanitizer.find_sanitizer(env) == (str(tmp_path / "bin" / "compute-sanitizer"), ["PATH"])
    r, data = _stage(tmp_path, env, "--limit", "100", "--quick")
    assert r.returncode == 0, r.stderr[-3000:]
    assert data["status"] == "done" and data["meta"]["version"] == "Compute Sanitizer 2099.1 stand-in"
    rows = {row["tool"]: row for row in data["rows"]}
    mem, race = rows["memcheck"], rows["racecheck"]
    assert (mem["status"], mem["errors"], race["status"], race["errors"]) == ("errors", 1, "clean", 0)
    assert mem["calls_done"] == mem["calls_planned"] > race["calls_done"] == race["calls_planned"] > 0
    race_labels = _labels((tmp_path / "out" / "sanitizer_racecheck.log").read_text())
    assert race_labels and all(lb.startswith(("unscale ", "grad_stats ", "adamw_staged ")) for lb in race_labels)
    assert any(lb.startswith("adamw_staged ") for lb in race_labels)  # the two-stage loop's shared memory
    [finding] = data["findings"]
    assert finding["kernel"] == "prep_kernel" and finding["label"].startswith("adamw ")
    # memcheck filters on every kernel, racecheck on the shared-memory ones, by the mangled length-prefixed name
    mem_argv = (tmp_path / "memcheck.argv").read_text().split("\n")
    race_argv = (tmp_path / "racecheck.argv").read_text().split("\n")
    filters = {tool: {a for i, a in enumerate(argv) if argv[i - 1] == "--kernel-name"}
               for tool, argv in (("memcheck", mem_argv), ("racecheck", race_argv))}
    assert filters["memcheck"] == {f"kns={len(k)}{k}" for k in KERNELS}
    # every kernel has shared memory since the compact AdamW kernels' two-stage loads (adamw_cuda.cu: a device
    # function's, which the scan counts for the file's two kernels)
    assert filters["racecheck"] == {"kns=12stats_kernel", "kns=21stats_finalize_kernel", "kns=12scale_kernel",
                                    "kns=12adamw_kernel", "kns=11prep_kernel"}
    assert "--port" in mem_argv and mem_argv[mem_argv.index("--port") + 1] != race_argv[race_argv.index("--port") + 1]
    lines = sanitizer_table.lines(data)
    assert lines[0].startswith(f"memcheck: 1 error over {mem['calls_done']} of {mem['calls_done']} calls (5 kernels)")
    assert lines[1].startswith('  prep_kernel in "adamw ') and "Invalid __global__ write (out of bounds) x1" in lines[1]
    assert lines[2].startswith(f"racecheck: 0 hazards over {race['calls_done']} of") and "(5 kernels)" in lines[2]


def _gone(pid: int, wait_s: float = 5.0) -> bool:
    """Whether process ``pid`` ended (a zombie not yet reaped by init counts) within ``wait_s``."""
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.05)
    return False


def test_stage_cut_off_by_its_limit(tmp_path):
    env = _fake_sanitizer(tmp_path)
    env["FAKE_HANG"] = "1"
    r, data = _stage(tmp_path, env, "--limit", "6", "--tools", "memcheck")
    assert r.returncode == 0, r.stderr[-3000:]
    [row] = data["rows"]
    assert (row["status"], row["errors"], row["calls_started"], row["calls_done"]) == ("timeout", None, 1, 0)
    assert row["seconds"] < 10
    assert sanitizer_table.lines(data)[0].startswith("memcheck: CUT OFF by its limit after 0 of 5 calls")
    child = int((tmp_path / "child.pid").read_text())
    assert _gone(child), "the whole process group must go, not the sanitizer alone"


# ---- the table ----------------------------------------------------------------------------------------------
def test_table_lines():
    data = {"stage": "sanitizer", "status": "done", "note": None, "rows": [
        {"tool": "memcheck", "status": "clean", "errors": 0, "warnings": None, "seconds": 12.4, "calls_done": 214,
         "calls_planned": 214, "kernels": KERNELS},
        {"tool": "racecheck", "status": "errors", "errors": 1, "warnings": 1, "seconds": 7.6, "calls_done": 39,
         "calls_planned": 39, "kernels": KERNELS[2:]},
    ], "findings": [
        {"tool": "racecheck", "kernel": "stats_kernel", "label": "unscale g=fp16 n=16385 view=@3 clip",
         "kind": "race error: Write/Read", "count": 1, "hazards": 128,
         "first_lines": ["Error: Race reported between Write access at stats_kernel(...)+0x8d0",
                         "and Read access at stats_kernel(...)+0x9a0 [128 hazards]"]},
    ]}
    assert sanitizer_table.lines(data) == [
        "memcheck: 0 errors over 214 of 214 calls (5 kernels) in 12 s",
        "racecheck: 1 hazard + 1 warning over 39 of 39 calls (3 kernels) in 8 s -- ERRORS",
        '  stats_kernel in "unscale g=fp16 n=16385 view=@3 clip": race error: Write/Read x1 (128 hazards)'
        " -- and Read access at stats_kernel(...)+0x9a0 [128 hazards]",
    ]
    failed = {"status": "done", "rows": [{"tool": "memcheck", "status": "failed", "errors": None, "exit_code": 1,
                                          "seconds": 3, "calls_done": 0, "calls_planned": None,
                                          "notes": ["Error: No attachable process found."], "kernels": []}]}
    assert sanitizer_table.lines(failed) == [
        "memcheck: FAILED (exit 1) after 0 calls in 3 s: no summary from the tool -- "
        "Error: No attachable process found."]


def test_the_gpu_checks_summary_puts_a_finding_at_its_top(tmp_path):
    """A memory-checker error is listed under 'what failed and where to look' and in its section."""
    from tools.gpu_check import summary

    env = _fake_sanitizer(tmp_path)
    r, data = _stage(tmp_path, env, "--limit", "100", "--quick")
    assert r.returncode == 0, r.stderr[-3000:]
    text = summary.summarize(str(tmp_path / "out"))
    top = text.split("--- what failed and where to look")[1].split("\n\n")[0]
    assert "sanitizer.json: memcheck found 1 errors -> the sanitizer section and sanitizer_memcheck.log" in top
    section = text.split("--- memory checker (compute-sanitizer) ---")[1]
    assert section.splitlines()[1].strip() == sanitizer_table.lines(data)[0]
