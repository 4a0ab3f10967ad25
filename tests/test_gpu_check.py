"""scripts/gpu_check.sh and its Python stages (issue 32 item 1): the dry run lists stages whose limits
fit in 7 min 30 s, the script always prints its summary, and the summary turns canned stage JSON
into the right GB/s, % of the measured copy bandwidth, TFLOP/s and tests per file -- every expected
number computed here from the bytes and times in the canned files, not by the code under test.
The stages' plumbing runs here on the cpu backend with a stand-in timer and the script's control
flow with a stand-in python; the CUDA-event timing itself and the stages on a GPU run only there
(test_cuda_*, skipped here)."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from mpkern import measure

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/: in the tree, not installed
from tools.gpu_check import harness, precheck, read, stages_kernels, stages_matmul, summary, tables
from tools.gpu_check.rows import matmul_row, mem_row

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")
HAS_CUDA = torch.cuda.is_available()
needs_bash = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils timeout")
STAGE_LINE = re.compile(r"^  (?P<name>[a-z0-9_]+)\s+(?P<limit>\d+) s  (?P<what>.+)$")


def _read_json(path: str) -> dict:
    return json.loads(Path(path).read_text())


# ---- the script -------------------------------------------------------------------------------------
def _dry_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", SCRIPT, "--dry-run", *args], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          check=False)


PROFILES = {
    "proof": ["precheck", "build", "device", "tests_gpu", "unscale", "adamw_cuda", "e2e_gpt2", "sanitizer", "summary"],
    "scale": ["precheck", "build", "device", "sweep_adamw", "e2e_llama7b", "compare", "e2e_batch", "matmul_routes",
              "adamw_triton", "release", "summary"],
}


def _stages_of(stdout: str) -> dict[str, int]:
    return {m["name"]: int(m["limit"]) for m in map(STAGE_LINE.match, stdout.splitlines()) if m}


@needs_bash
@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_dry_run_lists_each_profiles_stages_and_their_limits_fit_in_420_s(tmp_path, profile):
    out = tmp_path / "never_created"
    p = _dry_run("--profile", profile, str(out))
    assert p.returncode == 0, p.stderr
    stages = _stages_of(p.stdout)
    assert list(stages) == PROFILES[profile], p.stdout
    assert all(v > 0 for v in stages.values()), stages
    total = sum(stages.values())
    assert total <= 420
    m = re.search(r"^total: (\d+) s", p.stdout, re.M)
    assert m and int(m.group(1)) == total
    assert not out.exists(), "a dry run must not create anything"
    assert p.stdout.startswith(f"gpu_check.sh --profile {profile}:")


@needs_bash
def test_the_default_profile_is_proof_and_its_tests_cover_every_file_that_touches_cuda():
    p = _dry_run()
    assert p.returncode == 0 and p.stdout.startswith("gpu_check.sh --profile proof:"), p.stdout + p.stderr
    listed = re.findall(r"^\s+(tests/test_\w+\.py)$", p.stdout, re.M)
    left_out = re.findall(r"^\s+not run: (tests/test_\w+\.py): \S", p.stdout, re.M)
    assert len(listed) == len(set(listed)) and all(os.path.exists(os.path.join(ROOT, f)) for f in listed + left_out)
    assert not set(listed) & set(left_out)
    # every test file that mentions cuda is run on the GPU or left out with its reason
    touches = sorted(f"tests/{f}" for f in os.listdir(os.path.join(ROOT, "tests"))
                     if re.match(r"test_\w+\.py$", f)
                     and re.search(r"cuda|HAS_CUDA|DEVICE", Path(ROOT, "tests", f).read_text()))
    assert [f for f in touches if f not in listed + left_out] == []
    # the most valuable evidence first: bit-identity and capture, then sync-freedom, then the rest
    pos = {f: i for i, f in enumerate(listed)}
    assert pos["tests/test_gpu_paths.py"] == 0
    assert max(pos["tests/test_compact_kernels.py"], pos["tests/test_capture.py"]) < pos["tests/test_nosync.py"]
    assert pos["tests/test_nosync.py"] < pos["tests/test_optim.py"]
    assert '-k "cuda or triton' in p.stdout


@needs_bash
def test_unknown_profiles_and_limits_over_the_total_are_refused():
    p = _dry_run("--profile", "fast")
    assert p.returncode == 2 and "--profile must be proof or scale" in p.stderr
    p = subprocess.run(["bash", SCRIPT, "--dry-run", "--profile", "scale"], capture_output=True, text=True, timeout=60,
                       cwd=ROOT, env=dict(os.environ, GPU_CHECK_LIMITS="compare=200"), check=False)
    assert p.returncode == 1 and "add up to" in p.stderr
    p = subprocess.run(["bash", SCRIPT, "--dry-run"], capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env=dict(os.environ, GPU_CHECK_LIMITS="e2e_llama7b=5"), check=False)  # not a proof stage
    assert p.returncode == 2 and "e2e_llama7b=5" in p.stderr


@needs_bash
def test_the_gpu_first_selection_leaves_tests_in_every_file_it_lists():
    """Each GPU-first file keeps at least one test under the stage's -k expression (here on CPU its
    triton variants run in the interpreter; a file whose every test the expression dropped would be
    listed for nothing)."""
    p = _dry_run()
    kexpr = re.search(r'^\s+-k "(.+)"$', p.stdout, re.M).group(1)
    files = re.findall(r"^\s+(tests/test_\w+\.py)$", p.stdout.split("  unscale ")[0], re.M)
    assert len(files) >= 10
    c = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-qq",
                        "-k", kexpr, *files], capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    counts = dict(re.findall(r"^(tests/test_\w+\.py): (\d+)$", c.stdout, re.M))
    assert [f for f in files if int(counts.get(f, 0)) == 0] == [], c.stdout[-2000:]


@needs_bash
def test_script_refuses_unknown_options():
    p = subprocess.run(["bash", SCRIPT, "--frobnicate"], capture_output=True, text=True, timeout=60, cwd=ROOT,
                       check=False)
    assert p.returncode == 2 and "unknown option" in p.stderr


@needs_bash
@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU path (a GPU machine runs the whole check instead)")
def test_script_without_a_gpu_still_prints_the_summary(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_CACHE=str(tmp_path / "cache"))
    p = subprocess.run(["bash", SCRIPT, str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env,
                       check=False)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "mpkern gpu_check summary" in p.stdout
    text = (out / "summary.txt").read_text()
    assert "torch.cuda.is_available() is False" in text
    for stage in ("build", "tests_gpu", "unscale", "e2e_gpt2", "sanitizer"):
        assert re.search(rf"^  {stage}\s+\d+ s\s+- s  not run \(no CUDA GPU visible to torch\)$", text, re.M), stage
    assert json.loads((out / "precheck.json").read_text())["gpu"] is None
    # a second run into the same folder moves the first one's files aside instead of summarising them
    (out / "unscale.json").write_text(json.dumps({"stage": "unscale", "status": "done", "rows": []}))
    p = subprocess.run(["bash", SCRIPT, str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env,
                       check=False)
    assert p.returncode == 1 and "unscale: not run" in (out / "summary.txt").read_text()
    assert (out / "previous_run" / "unscale.json").exists() and (out / "previous_run" / "summary.txt").exists()
    assert (out / "previous_run" / "precheck.log").exists() and not (out / "previous_run" / "previous_run").exists()


FAKE_PYTHON = r"""#!/usr/bin/env bash
# a stand-in python for gpu_check.sh: a GPU that is there, a build that hangs and ignores SIGINT,
# a tests stage that runs until stopped; the summary (and the script's own questions) run for real
echo "$*" >> "$FAKE_DIR/calls.log"
case "$*" in
  -c*|*tools.gpu_check.summary*) exec "$REAL_PY" "$@" ;;
  *tools.gpu_check.precheck*)
    out=${@: -1}; echo 9.0 > "$out/arch.txt"
    echo '{"gpu": {"name": "Fake GPU", "arch": "9.0"}, "problems": []}' > "$out/precheck.json"; exit 0 ;;
  *"-m pip"*)
    [[ $FAKE_PIP == quick ]] && exit 0
    trap '' INT; echo $$ > "$FAKE_DIR/pip.pid"; sleep 60; exit 0 ;;
  *tests_gpu.xml*) [[ $FAKE_PYTEST == quick ]] && exit 0; echo $$ > "$FAKE_DIR/pytest.pid"; sleep 60; exit 0 ;;
  *) exit 0 ;;
esac
"""


def _fake_env(tmp_path, **extra: str) -> dict[str, str]:
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    return dict(os.environ, PYTHON=str(fake), REAL_PY=sys.executable, FAKE_DIR=str(tmp_path),
                GPU_CHECK_CACHE=str(tmp_path / "cache"), **extra)


def _alive(pid_file) -> bool:
    try:
        os.kill(int(Path(pid_file).read_text()), 0)
    except ProcessLookupError:
        return False
    return True


@needs_bash
def test_every_stage_is_stopped_at_its_limit_and_the_summary_still_comes(tmp_path):
    out = tmp_path / "out"
    env = _fake_env(tmp_path, GPU_CHECK_LIMITS="build=6,tests_gpu=5")
    p = subprocess.run(["bash", SCRIPT, str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env,
                       check=False)
    assert p.returncode == 1, p.stdout + p.stderr  # two stages did not end ok
    stages = read.read_stages(str(out))
    assert stages["build"]["rc"] in (124, 137) and stages["build"]["seconds"] <= 8, stages["build"]
    assert stages["build"]["status"].startswith(("KILLED", "TIMEOUT"))  # it ignored SIGINT: SIGKILL ended it
    # tests_gpu ("+") also got the time by which the run was ahead of its plan (precheck 10 s + build 6 s +
    # device 10 s planned before it, a few seconds taken): more than its own 5 s, less than 5 + 26 s
    t = stages["tests_gpu"]
    assert t["rc"] == 124 and 5 < t["limit"] <= 31 and t["seconds"] <= t["limit"] + 2, t
    assert t["status"] == f"TIMEOUT after {t['seconds']} s (limit {t['limit']} s)"
    for name in ("precheck", "device", "unscale", "adamw_cuda", "e2e_gpt2", "sanitizer"):
        assert stages[name]["status"] == "ok", (name, stages[name])
    assert not _alive(tmp_path / "pip.pid") and not _alive(tmp_path / "pytest.pid")
    assert "mpkern gpu_check summary" in p.stdout and (out / "summary.txt").read_text() in p.stdout
    calls = (tmp_path / "calls.log").read_text()
    assert "-m tools.gpu_check.stages_kernels adamw --backend cuda" in calls and "-m tools.gpu_check.e2e gpt2" in calls
    assert calls.count("-m pytest") == 1  # one pytest process for the GPU-relevant files
    assert "-m tools.gpu_check.plugins ensure" in calls


@needs_bash
def test_a_run_whose_stages_all_end_ok_exits_0(tmp_path):
    env = _fake_env(tmp_path, FAKE_PIP="quick", FAKE_PYTEST="quick")
    p = subprocess.run(["bash", SCRIPT, str(tmp_path / "out")], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env=env, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    assert {v["status"] for v in read.read_stages(str(tmp_path / "out")).values()} == {"ok"}


@needs_bash
@pytest.mark.skipif(not getattr(importlib.import_module("mpkern._C"), "cuda_built", False),
                    reason="the script keeps only a build with its CUDA kernels (CI builds them)")
def test_a_second_run_on_a_warm_machine_reuses_the_build_and_gives_its_time_to_the_tests(tmp_path):
    env = _fake_env(tmp_path, FAKE_PIP="quick", FAKE_PYTEST="quick")
    runs = []
    for name in ("first", "second"):
        p = subprocess.run(["bash", SCRIPT, str(tmp_path / name)], capture_output=True, text=True, timeout=120,
                           cwd=ROOT, env=env, check=False)
        assert p.returncode == 0, p.stdout + p.stderr
        runs.append(read.read_stages(str(tmp_path / name)))
    assert runs[0]["build"]["status"] == "ok" and (tmp_path / "cache" / "stamp").exists()
    assert runs[1]["build"]["status"].startswith("ok (cached: the build of an earlier run")
    assert (tmp_path / "calls.log").read_text().count("-m pip") == 1  # the second run built nothing
    # a source change (here: the stamp of another tree) builds again
    (tmp_path / "cache" / "stamp").write_text("another tree\n")
    p = subprocess.run(["bash", SCRIPT, str(tmp_path / "third")], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env=env, check=False)
    assert p.returncode == 0 and read.read_stages(str(tmp_path / "third"))["build"]["status"] == "ok"
    assert (tmp_path / "calls.log").read_text().count("-m pip") == 2


@needs_bash
def test_an_interrupted_run_stops_its_stage_and_prints_the_summary(tmp_path):
    import signal
    import time

    out = tmp_path / "out"
    env = _fake_env(tmp_path, FAKE_PIP="quick")
    proc = subprocess.Popen(["bash", SCRIPT, str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=env)
    try:
        t0 = time.monotonic()
        while not (tmp_path / "pytest.pid").exists() and time.monotonic() - t0 < 60:
            time.sleep(0.2)
        assert (tmp_path / "pytest.pid").exists(), "the tests stage never started"
        proc.send_signal(signal.SIGTERM)
        stdout, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert "mpkern gpu_check summary" in stdout and "interrupted" in stdout
    time.sleep(1)
    assert not _alive(tmp_path / "pytest.pid")
    assert read.read_stages(str(out))["tests_gpu"]["status"] == "interrupted (the run was stopped)"
    assert re.search(r"^  tests_gpu\s+120 s\s+\d+ s  interrupted", (out / "summary.txt").read_text(), re.M)


# ---- pure helpers -----------------------------------------------------------------------------------
def test_per_call_ms_is_the_median_over_rounds_of_total_over_calls():
    assert measure.per_call_ms([10.0, 12.0, 11.0], 5) == pytest.approx(2.2)
    assert measure.per_call_ms([4.0, 100.0, 5.0, 6.0], 2) == pytest.approx(2.75)  # median of 2, 50, 2.5, 3
    for bad in ([], [1.0, -1.0], [float("nan")]):
        with pytest.raises(ValueError):
            measure.per_call_ms(bad, 3)
    with pytest.raises(ValueError, match="calls"):
        measure.per_call_ms([1.0], 0)


def test_rates_and_their_refusals():
    assert tables.gbps(3e9, 1000.0) == pytest.approx(3.0)
    assert tables.gbps(960e6, 0.25) == pytest.approx(3840.0)
    assert tables.tflops(2 * 4096**3, 0.25) == pytest.approx(549.755813888)
    for bad in (0, -1.0, float("inf"), None):
        with pytest.raises(ValueError):
            tables.gbps(1.0, bad)
        with pytest.raises(ValueError):
            tables.tflops(1.0, bad)


NVCC_OUT = """nvcc: NVIDIA (R) Cuda compiler driver
Copyright (c) 2005-2025 NVIDIA Corporation
Built on Wed_Jul_16_07:30:01_PM_PDT_2025
Cuda compilation tools, release 13.0, V13.0.48
Build cuda_13.0.r13.0/compiler.36260728_0
"""


def test_precheck_reads_nvcc_and_applies_torchs_version_rule():
    assert precheck.parse_nvcc_version(NVCC_OUT) == "13.0"
    assert precheck.parse_nvcc_version("Cuda compilation tools, release 12.8, V12.8.93") == "12.8"
    assert precheck.parse_nvcc_version("command not found") is None
    assert precheck.cuda_version_problem("12.8", "12.8") == ("", False)
    msg, fatal = precheck.cuda_version_problem("12.8", "12.6")
    assert not fatal and "only warns" in msg
    msg, fatal = precheck.cuda_version_problem("13.0", "12.8")
    assert fatal and "major" in msg
    assert precheck.cuda_version_problem(None, "12.8")[1] and precheck.cuda_version_problem("12.8", None)[1]
    assert precheck.arch_string((9, 0)) == "9.0" and precheck.arch_string([8, 6]) == "8.6"
    assert precheck.arch_string(None) == ""
    with pytest.raises(ValueError):
        precheck.arch_string((0, -1))


def test_stage_file_is_valid_json_after_every_row_and_says_how_it_ended(tmp_path):
    path = str(tmp_path / "adamw_cuda.json")
    sf = harness.StageFile(path, "adamw_cuda", kernel="adamw")
    assert _read_json(path)["status"] == "running"
    t = {"kernel_ms": 0.3, "wall_ms": 0.5, "calls": 20, "rounds": 5, "queued_ahead": 5}
    row = mem_row("adamw", "FusedAdamWMP", "cuda", mode="m", bytes_per_param=30,
                             bytes_source="bytemodel.STEP_TRAFFIC['mpkern']", params=1000, timing=t)
    sf.add_row(row)
    on_disk = _read_json(path)
    assert on_disk["rows"] == [row] and on_disk["rows"][0]["timing"]["kernel_ms"] == 0.3
    harness.mark_ended(str(tmp_path), ["adamw_cuda.json"], "cut off")
    assert _read_json(path)["status"] == "interrupted"
    sf.finish("done")
    assert _read_json(path)["status"] == "done"
    harness.mark_ended(str(tmp_path), ["adamw_cuda.json"], "late")  # a finished stage stays finished
    assert _read_json(path)["status"] == "done"
    with pytest.raises(ValueError):
        sf.finish("maybe")
    with pytest.raises(ValueError):
        harness.StageFile(str(tmp_path / "x.txt"), "x")


def test_rows_refuse_what_would_make_a_rate_meaningless():
    t = {"kernel_ms": 1.0, "wall_ms": 1.0}
    kw = dict(bytes_source="x", params=10, timing=t)
    with pytest.raises(ValueError, match="bytes_per_param"):
        mem_row("unscale", "i", "cuda", bytes_per_param=0, **kw)
    with pytest.raises(ValueError, match="params"):
        mem_row("unscale", "i", "cuda", bytes_per_param=6, bytes_source="x", params=0, timing=t)
    with pytest.raises(ValueError, match="error"):
        mem_row("unscale", "i", "cuda", bytes_per_param=6, bytes_source="x", params=10)
    with pytest.raises(ValueError, match="positive"):
        matmul_row("s", 0, 1, 1, "bf16", "bf16", "c", timing=t, peer="p", peer_timing=t)
    r = matmul_row("s", 2, 3, 4, "bf16", "fp32", "c", timing=t, peer="p", peer_timing=t)
    assert r["flops"] == 2 * 2 * 3 * 4


def test_the_byte_counts_the_stages_use_are_the_byte_models():
    """The stage code takes its bytes from bytemodel (unscale, fp32 step, peer) and, for the compact
    modes, from the one per-mode count -- which equals bytemodel's for the fp32 mode."""
    from mpkern import bench, bytemodel

    src = Path(stages_kernels.__file__).read_text()
    for name in ("UNSCALE_TRAFFIC[\"mpkern\"]", "UNSCALE_TRAFFIC[\"torch\"]", "STEP_TRAFFIC[\"mpkern\"]",
                 "STEP_TRAFFIC[\"amp_fp32\"]", "step_bytes_per_param(mw, sd)"):
        assert name in src, name
    assert bench.step_bytes_per_param(True, "float32") == bytemodel.STEP_TRAFFIC["mpkern"]


def test_adamw_stage_plans_every_mode_with_a_kernel_headline_first():
    from mpkern.optim import storage

    for backend in ("cuda", "triton"):
        modes = stages_kernels.ordered_modes(backend)
        assert sorted(map(str, modes)) == sorted(map(str, storage.modes(torch.bfloat16, backend=backend)))
        head = [m for m in storage.DEFAULT_MODES if m in modes]
        assert modes[:len(head)] == head


# ---- pytest output, real ------------------------------------------------------------------------------
SAMPLE_TESTS = '''
import pytest

@pytest.fixture
def broken_teardown():
    yield
    raise RuntimeError("teardown fails")

def test_pass_a():
    pass

@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_pass_param(backend):
    pass

def test_fail():
    assert 1 == 2, "one is not two"

def test_skip():
    pytest.skip("needs a CUDA GPU")

@pytest.mark.xfail(reason="known")
def test_xfail():
    assert False

def test_pass_then_teardown_error(broken_teardown):
    pass
'''


def _run_sample(tmp_path, *extra: str, timeout: float = 120) -> tuple[str, str]:
    (tmp_path / "test_sample.py").write_text(SAMPLE_TESTS)
    xml, log = str(tmp_path / "t.xml"), str(tmp_path / "t.log")
    with open(log, "w") as f:
        subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "-o", "junit_family=xunit1",
                        f"--junitxml={xml}", "test_sample.py", *extra], cwd=tmp_path, stdout=f,
                       stderr=subprocess.STDOUT, timeout=timeout, env=dict(os.environ, PYTHONPATH=""), check=False)
    return xml, log


def test_tests_are_counted_per_file_from_real_junit_xml_and_from_the_verbose_log(tmp_path):
    from tools.gpu_check import pytest_results

    xml, log = _run_sample(tmp_path)
    # 3 passes; the teardown error makes its passing test an error (counted once); an xfail counts as skipped
    want = {"passed": 3, "failed": 1, "errors": 1, "skipped": 2}
    res = pytest_results.run_results(xml, log)
    assert list(res["files"]) == ["test_sample.py"]
    assert {k: res["files"]["test_sample.py"][k] for k in want} == want
    assert any(f["nodeid"] == "test_sample.py::test_fail" and "one is not two" in f["message"] for f in res["failures"])
    res = pytest_results.run_results(None, log)  # no XML (a killed run): the -v log's result lines
    assert res["source"] == "log" and {k: res["files"]["test_sample.py"][k] for k in want} == want
    assert {f["nodeid"].split("::")[1] for f in res["failures"]} == {"test_fail", "test_pass_then_teardown_error"}


@needs_bash
def test_pytest_stopped_by_timeout_with_sigint_still_writes_its_xml(tmp_path):
    """What the tests stages rely on: `timeout -s INT` makes pytest write the JUnit XML of what ran."""
    (tmp_path / "test_slow.py").write_text(textwrap.dedent('''
        import time
        def test_quick():
            pass
        def test_slow():
            time.sleep(60)
    '''))
    xml = tmp_path / "t.xml"
    subprocess.run(["timeout", "-s", "INT", "-k", "20", "8", sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                    "-o", "junit_family=xunit1", f"--junitxml={xml}", "test_slow.py"], cwd=tmp_path,
                   capture_output=True, timeout=60, env=dict(os.environ, PYTHONPATH=""), check=False)
    from tools.gpu_check import pytest_results

    assert pytest_results.run_results(str(xml))["files"]["test_slow.py"]["passed"] >= 1


# ---- the summary on canned stage files ------------------------------------------------------------------
COPY_BYTES, COPY_MS = 2 * 2**30, 0.52           # 1 GiB read + 1 GiB written in 0.52 ms
COPY_GBPS = COPY_BYTES / (COPY_MS / 1e3) / 1e9  # 4129.8 GB/s, computed here
UNSCALE_PARAMS, ADAMW_PARAMS = 128_000_000, 32_000_000


def _timing(kernel_ms, wall_ms, ahead=5):
    return {"kernel_ms": kernel_ms, "wall_ms": wall_ms, "calls": 20, "rounds": 5, "queued_ahead": ahead}


def _mem(kernel, impl, backend, bpp, params, k, w, g=None, gerr=None, mode=None, peer=False):
    return {"kernel": kernel, "impl": impl, "backend": backend, "mode": mode, "peer": peer, "bytes_per_param": bpp,
            "bytes_source": "bytemodel", "params": params, "timing": _timing(k, w),
            "graph": None if g is None else _timing(g, g + 0.01), "graph_error": gerr, "error": None}


FP32, INT8 = "fp32 master + fp32 moments", "8-bit master + 8-bit moments"
CANNED = {
    "device.json": {"stage": "device", "status": "done", "checks": {"cuda_built": True, "selected": "cuda"},
                    "bandwidth": {"copy": {"bytes_moved": COPY_BYTES, "kernel_ms": COPY_MS, "wall_ms": 0.6},
                                  "inplace": {"bytes_moved": COPY_BYTES, "kernel_ms": 0.55, "wall_ms": 0.6}}},
    "unscale.json": {"stage": "unscale", "status": "done", "rows": [
        _mem("unscale", "mpkern.unscale_ (cuda)", "cuda", 6, UNSCALE_PARAMS, 0.21, 0.35, g=0.20),
        _mem("unscale", "mpkern.unscale_ (triton)", "triton", 6, UNSCALE_PARAMS, 0.25, 0.30,
             gerr="RuntimeError: table lookup missed during capture"),
        _mem("unscale", "torch recipe", "torch", 10, UNSCALE_PARAMS, 0.40, 0.90, g=0.39, peer=True)]},
    "adamw_cuda.json": {"stage": "adamw_cuda", "status": "done", "kernel": "adamw", "backend": "cuda",
                        "planned": [FP32, INT8, "torch AMP recipe, fp32 params"], "rows": [
        _mem("adamw", "FusedAdamWMP", "cuda", 30, ADAMW_PARAMS, 0.26, 0.45, g=0.25, mode=FP32),
        _mem("adamw", "FusedAdamWMP", "cuda", 14.25, ADAMW_PARAMS, 0.15, 0.42, g=0.14, mode=INT8),
        _mem("adamw", "torch AMP recipe, fp32 params", "torch", 48, ADAMW_PARAMS, 0.44, 0.80, g=0.43, peer=True)]},
    "adamw_triton.json": {"stage": "adamw_triton", "status": "interrupted", "kernel": "adamw", "backend": "triton",
                          "error": "interrupted (SIGINT: the stage's time limit)",
                          "planned": [FP32, INT8, "remainder + bf16 moments"], "rows": [
        _mem("adamw", "FusedAdamWMP", "triton", 30, ADAMW_PARAMS, 0.30, 0.50, g=0.29, mode=FP32)]},
    "matmul.json": {"stage": "matmul", "status": "done", "rows": [
        {"kernel": "matmul", "shape": "square 4096^3", "M": 4096, "N": 4096, "K": 4096, "dtype": "bf16", "out": "bf16",
         "config": "fixed 128x128x32", "flops": 2.0 * 4096**3, "timing": _timing(0.25, 0.26),
         "peer": "torch.matmul (cuBLAS)", "peer_timing": _timing(0.20, 0.21), "error": None},
        {"kernel": "matmul", "shape": "fwd 4096x4096x11008", "M": 4096, "N": 11008, "K": 4096, "dtype": "fp16",
         "out": "fp32", "config": "fixed 128x128x32", "flops": None, "timing": None, "peer": "torch.mm(out_dtype=fp32)",
         "peer_timing": None, "error": "OutOfResources: shared memory"}]},
}
CANNED["matmul_tuned.json"] = {"stage": "matmul_tuned", "status": "interrupted", "rows": [
    {"kernel": "matmul", "shape": "fwd 16384x4096x11008", "M": 16384, "N": 11008, "K": 4096, "dtype": "bf16",
     "out": "bf16", "config": "tuned", "flops": 2.0 * 16384 * 11008 * 4096, "timing": None,
     "peer": "torch.matmul (cuBLAS)", "peer_timing": _timing(2.2, 2.3), "error": "autotuning did not finish"}]}
JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="9">
<testcase classname="tests.test_a" name="test_x[cuda]" file="tests/test_a.py" line="3" time="0.25"/>
<testcase classname="tests.test_a" name="test_x[triton]" file="tests/test_a.py" line="3" time="0.25"/>
<testcase classname="tests.test_a" name="test_y" file="tests/test_a.py" line="9" time="0.5"/>
<testcase classname="tests.test_a" name="test_z" file="tests/test_a.py" line="12" time="1.0">
<failure message="AssertionError: found_inf differs">trace</failure></testcase>
<testcase classname="tests.test_a" name="test_w" file="tests/test_a.py" line="20" time="0.0">
<skipped type="pytest.skip" message="needs two GPUs">skip</skipped></testcase>
<testcase classname="tests.test_b.TestCapture" name="test_replay" line="5" time="2.0"/>
<testcase classname="tests.test_b.TestCapture" name="test_table" line="9" time="0.5">
<error message="RuntimeError: CUDA error: an illegal memory access">trace</error></testcase>
<testcase classname="tests.test_b.TestCapture" name="test_x" line="19" time="0.0">
<skipped type="pytest.xfail" message="issue 32 item 3"/></testcase>
</testsuite></testsuites>"""
PLAN = [("precheck", 15), ("build", 130), ("device", 15), ("tests_gpu", 90), ("unscale", 20), ("adamw_cuda", 30),
        ("release", 30), ("adamw_triton", 45), ("matmul", 25), ("matmul_tuned", 30), ("summary", 10)]


def _canned(tmp_path) -> str:
    out = tmp_path / "out"
    out.mkdir()
    for name, data in CANNED.items():
        (out / name).write_text(json.dumps(data))
    (out / "precheck.json").write_text(json.dumps({
        "python": "3.12.3", "torch": "2.11.0+cu128", "torch_cuda": "12.8", "triton": "3.6.0", "numpy": "2.4.0",
        "ninja": "1.11.1", "nvcc": "12.8", "cuda_match": "ok", "arch": "9.0", "driver": "570.1", "problems": [],
        "gpu": {"name": "NVIDIA H200", "arch": "9.0", "sms": 132, "memory_bytes": 141 * 2**30,
                "l2_bytes": 60 * 2**20}}))
    (out / "plan.tsv").write_text("".join(f"{n}\t{lim}\twhat {n}\n" for n, lim in PLAN))
    (out / "stages.tsv").write_text("precheck\t15\t0\t3\tok\nbuild\t150\t0\t97\tok\ndevice\t15\t0\t9\tok\n"
                                    "tests_gpu\t90\t1\t88\tfailed rc=1 after 88 s\nunscale\t20\t0\t12\tok\n"
                                    "adamw_cuda\t30\t0\t25\tok\n"
                                    "adamw_triton\t45\t124\t45\tTIMEOUT after 45 s (limit 45 s)\n"
                                    "matmul\t25\t0\t20\tok\n")
    (out / "adamw_triton.log").write_text("compiling...\n\nKeyboardInterrupt: signal 2\n")
    (out / "tests_gpu.xml").write_text(JUNIT)
    (out / "tests_gpu.list").write_text("tests/test_a.py\ntests/test_b.py\ntests/test_c.py\n")
    (out / "tests_gpu.k").write_text("cuda or triton\n")
    return str(out)


def _table(text: str, first_header: str) -> tuple[list[str], list[list[str]]]:
    """The table whose header line starts with ``first_header``: header cells and row cells (split on 2+ spaces)."""
    lines = text.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.startswith(first_header + "  "))
    rows = []
    for ln in lines[i + 2:]:
        if not ln.strip() or ln.startswith(("  ", "---", "=")):
            break
        rows.append(re.split(r"\s{2,}", ln.strip()))
    return re.split(r"\s{2,}", lines[i].strip()), rows


def _num(cell: str) -> float:
    return float(cell.split()[0].rstrip("x%"))


def test_summary_of_canned_stages_has_every_number_right(tmp_path):
    out = _canned(tmp_path)
    text = summary.summarize(out)
    assert f"measured copy bandwidth: {COPY_GBPS:.0f} GB/s" in text
    header, rows = _table(text, "kernel")
    assert header == tables.MEMORY_HEADER
    by = {(r[0], r[1], r[2]): r for r in rows}
    col = {h: i for i, h in enumerate(header)}
    measured = (CANNED["unscale.json"]["rows"] + CANNED["adamw_cuda.json"]["rows"]
                + CANNED["adamw_triton.json"]["rows"])
    peer_ms = {"unscale": 0.40, "adamw": 0.44}
    peer_bpp = {"unscale": 10, "adamw": 48}
    for r in measured:
        cells = by[(r["kernel"], r["backend"], r["mode"] or r["impl"])]
        assert len(cells) == len(header) and all(c.strip() for c in cells), cells  # every column filled
        nbytes = r["bytes_per_param"] * r["params"]
        k_ms, w_ms = r["timing"]["kernel_ms"], r["timing"]["wall_ms"]
        want = nbytes / (k_ms * 1e-3) / 1e9
        assert _num(cells[col["GB/s"]]) == pytest.approx(want, rel=5e-3)
        assert _num(cells[col["% copy"]]) == pytest.approx(100 * want / COPY_GBPS, abs=0.5)
        assert _num(cells[col["kernel ms"]]) == pytest.approx(k_ms)
        assert _num(cells[col["wall ms"]]) == pytest.approx(w_ms)
        ratio = w_ms / k_ms
        assert cells[col["wall/kernel"]] == (f"host-bound {ratio:.1f}x" if ratio > 1.5 else f"device {ratio:.1f}x")
        assert cells[col["queued"]] == "yes"
        if r["graph"] is not None:
            g_want = nbytes / (r["graph"]["kernel_ms"] * 1e-3) / 1e9
            assert _num(cells[col["graph GB/s"]]) == pytest.approx(g_want, rel=5e-3)
            assert _num(cells[col["graph % copy"]]) == pytest.approx(100 * g_want / COPY_GBPS, abs=0.5)
        else:
            assert cells[col["graph ms"]] == "capture failed"
            assert (f"  unscale triton {r['impl']}: CUDA-graph capture failed: RuntimeError: table lookup missed "
                    "during capture") in text.splitlines()
        vs = cells[col["vs torch (limit)"]]
        if r["peer"]:
            assert vs == "(peer)"
        else:
            speed = peer_ms[r["kernel"]] / k_ms
            lim = peer_bpp[r["kernel"]] / r["bytes_per_param"]
            assert vs == f"{speed:.2f}x (limit {lim:.2f}x)"
    # the stage cut off by its limit: what it measured, then its planned modes as not run
    assert len(rows) == len(measured)
    for mode in (INT8, "remainder + bf16 moments"):
        assert f"  adamw triton {mode}: not run (the stage ended first)" in text.splitlines()
    assert "adamw_triton: interrupted, 1 of 3 rows" in text
    assert re.search(r"^  adamw_triton\s+45 s\s+45 s  TIMEOUT after 45 s", text, re.M)
    assert "| KeyboardInterrupt: signal 2" in text  # the end of a failed stage's log


def test_summary_matmul_tflops_against_cublas(tmp_path):
    text = summary.summarize(_canned(tmp_path))
    header, rows = _table(text, "shape")
    assert header == tables.MATMUL_HEADER
    (ok,) = rows
    col = {h: i for i, h in enumerate(header)}
    flops = 2.0 * 4096**3
    assert len(ok) == len(header) and all(c.strip() for c in ok)
    assert _num(ok[col["TFLOP/s"]]) == pytest.approx(flops / 0.25e-3 / 1e12, rel=5e-3)
    assert _num(ok[col["peer TFLOP/s"]]) == pytest.approx(flops / 0.20e-3 / 1e12, rel=5e-3)
    assert ok[col["mpkern/peer"]] == f"{0.20 / 0.25:.2f}x"
    assert ok[col["peer"]] == "torch.matmul (cuBLAS)"
    assert "  fwd 4096x4096x11008 fp16->fp32 (fixed 128x128x32): failed: OutOfResources: shared memory" in text
    tuned_peer = 2.0 * 16384 * 11008 * 4096 / 2.2e-3 / 1e12  # the cuBLAS row a cut-off tuning leaves
    assert ("  fwd 16384x4096x11008 bf16->bf16 (tuned): failed: autotuning did not finish; torch.matmul (cuBLAS): "
            f"{tuned_peer:.0f} TFLOP/s (2.2 ms)") in text
    assert "matmul_tuned: interrupted, 1 rows" in text


def test_summary_tests_per_file(tmp_path):
    text = summary.summarize(_canned(tmp_path))
    gpu = text.split("--- tests_gpu")[1].split("\n\n")[0]
    head = next(ln for ln in gpu.splitlines() if ln.strip().startswith("file "))
    cols = head.replace("not run", "not_run").split()[1:]
    got = {ln.split()[0]: dict(zip(cols, ln.split()[1:])) for ln in gpu.splitlines()
           if ln.strip().startswith("tests/test_")}
    # counted here from the canned XML: test_a 3 passed, 1 failed, 1 skipped, 0.25+0.25+0.5+1.0+0.0 s; test_b (no
    # file attribute: from its classname) 1 passed, 1 error, 1 xfail (counted skipped), 2.5 s
    assert {k: got["tests/test_a.py"][k] for k in ("passed", "failed", "skipped", "errors", "seconds")} == {
        "passed": "3", "failed": "1", "skipped": "1", "errors": "0", "seconds": "2.0"}
    assert {k: got["tests/test_b.py"][k] for k in ("passed", "failed", "skipped", "errors", "seconds")} == {
        "passed": "1", "failed": "0", "skipped": "1", "errors": "1", "seconds": "2.5"}
    assert "not collected (the stage ended first, or -k left nothing): tests/test_c.py" in gpu
    assert "FAILED tests/test_a.py::test_z: AssertionError: found_inf differs" in gpu
    assert "ERRORS tests/test_b.py::TestCapture::test_table: RuntimeError: CUDA error" in gpu
    assert "slowest: tests/test_b.py::TestCapture::test_replay 2.0 s, tests/test_a.py::test_z 1.0 s, " in gpu
    assert "-k 'cuda or triton'" in gpu and "failed rc=1 after 88 s" in gpu
    # and at the top of the summary, with where to look
    top = text.split("--- what failed and where to look")[1].split("\n\n")[0]
    assert "test tests/test_a.py::test_z: AssertionError: found_inf differs -> tests_gpu.xml" in top
    assert "stage tests_gpu: failed rc=1 after 88 s -> tests_gpu.log" in top
    assert ("stage adamw_triton: TIMEOUT after 45 s (limit 45 s) -> adamw_triton.log (last line: "
            "KeyboardInterrupt") in top


def test_summary_of_an_empty_or_damaged_folder_says_so(tmp_path):
    text = summary.summarize(str(tmp_path))
    assert "precheck: not run" in text and "measured copy bandwidth: not run" in text
    assert "no stage ran (no stages.tsv in this folder)" in text
    assert "unscale" not in text and "matmul" not in text  # no section for a stage neither planned nor run
    (tmp_path / "unscale.json").write_text("{not json")
    (tmp_path / "device.json").write_text(json.dumps({"stage": "device", "status": "failed",
                                                      "error": "no CUDA GPU visible to torch"}))
    (tmp_path / "tests_gpu.xml").write_text("<testsuites><testsuite>")  # cut off mid-write
    text = summary.summarize(str(tmp_path))
    assert "unscale: unreadable (JSONDecodeError" in text
    assert "not measured (no CUDA GPU visible to torch)" in text
    assert "--- tests_gpu: tests per file" in text and "JUnit XML unreadable (ParseError" in text


def test_summary_survives_stage_files_of_the_wrong_shape(tmp_path):
    good = _canned(tmp_path)
    with open(os.path.join(good, "adamw_cuda.json"), "w") as f:  # rows that are not row dicts
        json.dump({"stage": "adamw_cuda", "status": "done", "rows": [1, "x", {"kernel": "adamw", "mode": "m",
                   "bytes_per_param": "30", "params": 5, "timing": {"kernel_ms": "fast"}}], "planned": "m"}, f)
    with open(os.path.join(good, "matmul.json"), "w") as f:
        json.dump({"stage": "matmul", "status": "done", "rows": {"a": 1}}, f)
    with open(os.path.join(good, "precheck.json"), "w") as f:
        json.dump({"gpu": {"name": 7, "arch": 9}}, f)  # an arch that is not a string
    text = summary.summarize(good)
    assert "adamw ? m: failed: no kernel time" in text  # no backend in the row: said as "?"
    assert "matmul: done, 0 rows" in text
    assert "--- machine: could not be summarised (AttributeError" in text
    _h, rows = _table(text, "kernel")
    assert {r[2] for r in rows} >= {"mpkern.unscale_ (cuda)", "fp32 master + fp32 moments"}  # the rest stands


#: a python -c prologue that makes torch, mpkern, numpy and triton unimportable, then runs module argv[1]
#: as __main__ with the rest of argv: what the script's standard-library-only steps must survive
WITHOUT_TORCH = """
import runpy, sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "mpkern", "numpy", "triton"):
            raise ImportError(f"{name} refused: this step must run on the standard library alone")
sys.meta_path.insert(0, Refuse())
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def test_summary_command_line(tmp_path):
    out = _canned(tmp_path)
    cmd = [sys.executable, "-c", WITHOUT_TORCH, "tools.gpu_check.summary"]
    p = subprocess.run([*cmd, out, "--write"], capture_output=True, text=True, timeout=60, cwd=ROOT,
                       check=False)  # runs with torch and mpkern unimportable
    assert p.returncode == 0, p.stderr
    assert Path(out, "summary.txt").read_text() == p.stdout
    p = subprocess.run([*cmd, str(tmp_path / "missing")], capture_output=True, text=True, timeout=60, cwd=ROOT,
                       check=False)
    assert p.returncode == 2 and "not a folder" in p.stderr


def test_precheck_without_torch_says_so(tmp_path):
    """The precheck runs before anything is built: on the standard library alone it writes its files
    and reports the torch it could not import (exit status 3: no GPU to check)."""
    p = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, "tools.gpu_check.precheck", str(tmp_path)],
                       capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    assert p.returncode == 3, p.stdout + p.stderr
    res = _read_json(str(tmp_path / "precheck.json"))
    assert res["gpu"] is None and res["problems"][0].startswith("import torch failed: ImportError: torch refused")
    assert (tmp_path / "arch.txt").read_text() == ""


# ---- the stages' plumbing on the CPU, with a stand-in timer ------------------------------------------------
@pytest.fixture
def fake_timer(monkeypatch):
    """event_time runs the call 3 times and reports fixed times; graph capture fails (no CUDA)."""
    calls = []

    def event_time(fn, device="cuda", *, calls_=None, **kw):
        for _ in range(3):
            fn()
        calls.append(fn)
        return {"kernel_ms": 0.5, "wall_ms": 2.0, "calls": kw.get("calls", 20), "rounds": kw.get("rounds", 5),
                "queued_ahead": kw.get("rounds", 5)}

    def graph_time(fn, device="cuda", **kw):
        raise RuntimeError("CUDA graphs need a GPU")

    monkeypatch.setattr(measure, "event_time", event_time)
    monkeypatch.setattr(measure, "graph_time", graph_time)
    return calls


def _device_json(out, copy_ms=COPY_MS):
    with open(os.path.join(out, "device.json"), "w") as f:
        json.dump({"stage": "device", "status": "done",
                   "bandwidth": {"copy": {"bytes_moved": COPY_BYTES, "kernel_ms": copy_ms}}}, f)


def test_unscale_stage_rows_on_the_cpu_backend(tmp_path, fake_timer):
    from mpkern import bytemodel

    out = str(tmp_path)
    assert stages_kernels.stage_unscale(out, params=30_000, tensors=4, device="cpu", backends=("cpu", "cuda")) == 0
    data = _read_json(os.path.join(out, "unscale.json"))
    assert data["status"] == "done" and data["planned"] == ["mpkern.unscale_ (cpu)", "mpkern.unscale_ (cuda)",
                                                            "torch recipe"]
    cpu, cuda, peer = data["rows"]
    assert cpu["bytes_per_param"] == bytemodel.UNSCALE_TRAFFIC["mpkern"] and cpu["params"] == 30_000
    assert cpu["timing"]["kernel_ms"] == 0.5 and cpu["graph"] is None and "CUDA graphs" in cpu["graph_error"]
    assert cuda["timing"] is None and cuda["error"].startswith("backend unavailable")
    assert peer["peer"] and peer["bytes_per_param"] == bytemodel.UNSCALE_TRAFFIC["torch"]
    _device_json(out)
    text = summary.summarize(out)
    want = 6 * 30_000 / 0.5e-3 / 1e9  # 0.36 GB/s
    _h, rows = _table(text, "kernel")
    (row,) = [r for r in rows if r[2] == "mpkern.unscale_ (cpu)"]
    assert _num(row[6]) == pytest.approx(want, rel=5e-3)
    assert row[-1] == f"{0.5 / 0.5:.2f}x (limit {10 / 6:.2f}x)"
    assert "unscale cuda mpkern.unscale_ (cuda): failed: backend unavailable" in text


def test_unscale_stage_really_clips_the_grads_it_times(tmp_path, fake_timer):
    """inv_scale 1 and max_norm 1: after the timed calls the grads' global norm is max_norm (what
    keeps repeated in-place calls from decaying the grads during the timing)."""
    import inspect

    stages_kernels.stage_unscale(str(tmp_path), params=30_000, tensors=4, device="cpu", backends=("cpu",))
    _ours, peer = fake_timer
    grads = [p.grad for p in inspect.getclosurevars(peer).nonlocals["ps"]]  # the bf16 grads both rows timed
    assert len(grads) == 4 and sum(g.numel() for g in grads) == 30_000
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in grads]))
    assert float(norm) == pytest.approx(1.0, rel=1e-2)  # they started at N(0, 64^2): norm ~11000


def test_adamw_stage_rows_on_the_cpu_backend(tmp_path, fake_timer):
    from mpkern import bench, bytemodel

    out = str(tmp_path)
    modes = [(True, "float32"), ("8bit", "8bit")]
    assert stages_kernels.stage_adamw(out, "cpu", peer=True, params=30_000, tensors=4, modes=modes, device="cpu") == 0
    data = _read_json(os.path.join(out, "adamw_cpu.json"))
    assert data["status"] == "done" and len(data["planned"]) == 3
    fp32, int8, peer = data["rows"]
    assert [r["error"] for r in data["rows"]] == [None] * 3, data["rows"]
    assert fp32["bytes_per_param"] == bytemodel.STEP_TRAFFIC["mpkern"]
    assert int8["bytes_per_param"] == bench.step_bytes_per_param("8bit", "8bit")
    assert peer["bytes_per_param"] == bytemodel.STEP_TRAFFIC["amp_fp32"] and peer["peer"]
    assert fp32["mode"] == bench.mode_label(True, "float32") and fp32["first_step_s"] > 0
    _device_json(out)
    text = summary.summarize(out)
    _h, rows = _table(text, "kernel")
    by = {r[2]: r for r in rows}
    for r in (fp32, int8, peer):
        cells = by[r["mode"] or r["impl"]]
        assert _num(cells[6]) == pytest.approx(r["bytes_per_param"] * 30_000 / 0.5e-3 / 1e9, rel=5e-3)
        assert cells[10] == "-" and cells[8] == "capture failed"
    assert by[fp32["mode"]][-1] == f"1.00x (limit {48 / 30:.2f}x)"
    with pytest.raises(ValueError, match="backend"):
        stages_kernels.stage_adamw(out, "tpu", device="cpu")


def test_matmul_stage_rows_on_the_cpu(tmp_path, fake_timer, monkeypatch):
    monkeypatch.setenv("MPKERN_MATMUL_CONFIG", "")  # the stage sets it; restored after the test
    out = str(tmp_path)
    cases = [("square 64^3", 64, 64, 64, "square", "bf16"), ("wgrad 48x32 (red. 40)", 48, 32, 40, "wgrad", "bf16")]
    assert stages_matmul.stage_matmul(out, device="cpu", cases=cases) == 0
    data = _read_json(os.path.join(out, "matmul.json"))
    got = [(r["shape"], r["out"], r["error"]) for r in data["rows"]]
    assert got == [("square 64^3", "bf16", None), ("square 64^3", "fp32", None),
                   ("wgrad 48x32 (red. 40)", "bf16", None), ("wgrad 48x32 (red. 40)", "fp32", None),
                   ("wgrad 48x32 (red. 40)", "+=main_grad", None)]
    assert data["planned"] == [f"{s} bf16->{o}" for s, o, _ in got]
    assert data["rows"][0]["flops"] == 2 * 64**3 and data["rows"][2]["flops"] == 2 * 48 * 32 * 40
    text = summary.summarize(out)
    _h, rows = _table(text, "shape")
    assert len(rows) == 5 and _num(rows[0][4]) == pytest.approx(2 * 64**3 / 0.5e-3 / 1e12, rel=5e-3)
    assert "not run (the stage ended first)" not in text
    # the tuned stage: its provisional row (peer timed, tuning pending) is replaced by the finished one
    assert stages_matmul.stage_matmul(out, tuned=True, device="cpu", cases=cases[:1]) == 0
    (row,) = _read_json(os.path.join(out, "matmul_tuned.json"))["rows"]
    assert row["error"] is None and row["tuning_s"] >= 0 and row["config"].startswith("tuned")
    assert row["timing"]["kernel_ms"] == 0.5 and row["peer_timing"]["kernel_ms"] == 0.5


def test_matmul_routes_stage_writes_bench_matmul_rows(tmp_path, monkeypatch):
    """The GPU check's matmul_routes stage is bench_matmul's rows (one implementation), in its JSON."""
    from mpkern.bench import matmul as bench_mm

    seen = {}

    def fake(dev, **kw):
        seen.update(kw, dev=dev)
        return [{"kernel": "matmul", "method": "torch.matmul: x", "ms": 1.0}]

    monkeypatch.setattr(bench_mm, "bench_matmul", fake)
    monkeypatch.setenv("MPKERN_MATMUL_CONFIG", "x")  # recorded, so the stage's setting is undone after the test
    monkeypatch.delenv("MPKERN_MATMUL_CONFIG")
    assert stages_matmul.stage_matmul_routes(str(tmp_path), device=torch.device("cpu")) == 0
    data = json.loads((tmp_path / "matmul_routes.json").read_text())
    assert data["rows"] == [{"kernel": "matmul", "method": "torch.matmul: x", "ms": 1.0}]
    assert seen["quick"] and seen["dtypes"] == "bf16" and os.environ["MPKERN_MATMUL_CONFIG"] == "fixed"


def test_summary_of_the_routes_and_compare_stages(tmp_path):
    """The routes stage's rows (bench_matmul's, built with mpkern.bench.common.row) and compare's report
    in the summary: ms, TFLOP/s and the speed over cuBLAS computed here; a default route slower than
    the platform GEMM is said to be."""
    from mpkern.bench.common import row

    flops = 2.0 * 4096**3
    rows = [row("matmul", "torch.matmul: square bf16", 1e-3, flops=flops, bound=flops / 1e-3 / 1e12),
            row("matmul", "default -> cublas: square bf16", 1.1e-3, flops=flops, vs="torch.matmul", peer_ratio=1 / 1.1)]
    (tmp_path / "plan.tsv").write_text("matmul_routes\t25\tx\ncompare\t50\tx\n")
    (tmp_path / "stages.tsv").write_text("matmul_routes\t25\t0\t20\tok\ncompare\t50\t0\t44\tok\n")
    (tmp_path / "matmul_routes.json").write_text(json.dumps({"stage": "matmul_routes", "status": "done", "rows": rows}))
    (tmp_path / "compare").mkdir()
    (tmp_path / "compare" / "results.md").write_text("# mpkern compare\n" + "".join(f"line {i}\n" for i in range(60)))
    text = summary.summarize(str(tmp_path))
    routes = text.split("--- matmul routes vs cuBLAS (torch.matmul): done, 2 rows ---")[1].split("\n\n")[0]
    cells = [re.split(r"\s{2,}", ln.strip()) for ln in routes.splitlines()
             if ln.strip().startswith(("torch", "default"))]
    # TFLOP/s = 2 * 4096^3 / seconds / 1e12: 137 at 1 ms, 125 at 1.1 ms (3 significant digits)
    assert cells[0] == ["torch.matmul: square bf16", "1", f"{flops / 1e-3 / 1e12:.3g}", "-"]
    assert cells[1] == ["default -> cublas: square bf16", "1.1", f"{flops / 1.1e-3 / 1e12:.3g}", f"{1 / 1.1:.2f}x"]
    assert "the default route is slower than the platform GEMM (< 0.95x) in 1 rows" in routes
    comp = text.split("--- mpkern compare --device cuda (stage: ok")[1]
    assert "  # mpkern compare" in comp and "  line 38" in comp and "  line 39" not in comp
    assert "... 21 more lines in compare/results.md" in comp


# ---- on a GPU only ---------------------------------------------------------------------------------------
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@requires_cuda
def test_cuda_event_time_queues_ahead_and_graph_time_replays_the_call():
    x = torch.zeros(1 << 20, device="cuda")
    y = torch.empty_like(x)
    t = measure.event_time(lambda: y.copy_(x), calls=10, rounds=3, warmup=1)
    assert t["kernel_ms"] > 0 and t["wall_ms"] > 0 and len(t["kernel_ms_rounds"]) == 3
    assert t["queued_ahead"] == 3, t  # the hold outlasted the host's queueing in every round
    counter = torch.zeros((), device="cuda")
    g = measure.graph_time(lambda: counter.add_(1), calls=10, rounds=3, warmup=2)
    torch.cuda.synchronize()
    replays = int(counter.item()) - 2  # the eager warm-up calls; capture itself runs nothing
    assert g["kernel_ms"] > 0 and replays >= 1 + 2 * 3 * 10 and (replays - 1) % 10 == 0
    bw = measure.copy_bandwidth("cuda", 1 << 26, calls=3, rounds=2)
    assert bw["copy"]["bytes_moved"] == 2 * (1 << 26) and bw["copy"]["kernel_ms"] > 0


@requires_cuda
def test_cuda_small_stages_end_to_end(tmp_path):
    out = str(tmp_path)
    assert stages_kernels.stage_unscale(out, params=2_000_000, tensors=7) == 0
    assert stages_kernels.stage_adamw(out, "cuda", peer=True, params=2_000_000, tensors=7,
                                  modes=[(True, "float32"), ("8bit", "8bit")]) == 0
    data = _read_json(os.path.join(out, "adamw_cuda.json"))
    assert data["status"] == "done" and len(data["rows"]) == 3
    assert [r["error"] for r in data["rows"]] == [None] * 3, data["rows"]
    text = summary.summarize(out)
    assert "mpkern.unscale_ (cuda)" in text and "(peer)" in text


# ---- the gradient-release stage ----------------------------------------------------------------------
def test_release_stage_plumbing_on_cpu(tmp_path):
    """The stage on the CPU with a tiny model: every variant timed, the release runs bitwise equal to the
    regular ones, and the summary prints the table."""
    from tools.gpu_check import release as release_stage

    assert release_stage.stage_release(str(tmp_path), layers=2, width=16, tokens=8, iters=2, warmup=1,
                                     device="cpu") == 0
    data = json.loads((tmp_path / "release.json").read_text())
    assert data["status"] == "done"
    assert [r["variant"] for r in data["rows"]] == [v[0] for v in release_stage.VARIANTS] + [release_stage.REFERENCE]
    assert all("error" not in r and len(r["all_ms"]) == 2 for r in data["rows"]), data["rows"]
    assert [r["bitwise"] for r in data["rows"] if r["release"]] == [True, True]
    text = summary.summarize(str(tmp_path))
    assert "gradient release" in text and "release two passes + clip" in text


def test_release_rows_ratios():
    rows = [{"variant": "regular", "step_ms": 10.0, "peak_GB": 3.0},
            {"variant": "release one pass", "step_ms": 10.5, "peak_GB": 2.5, "bitwise": True, "vs": ["regular"]},
            {"variant": "regular + clip", "step_ms": 11.0, "peak_GB": 3.0},
            {"variant": "release two passes + clip", "step_ms": 16.5, "peak_GB": 2.5, "bitwise": False,
             "vs": ["regular + clip", "forward + two backwards"]},
            {"variant": "forward + two backwards", "step_ms": 15.0, "peak_GB": 3.1},
            {"variant": "broken", "error": "RuntimeError: x"}]
    cells = tables.release_rows(rows)
    assert cells[1] == ["release one pass", "10.50", "1.050x regular", "2.50", "yes"]
    assert cells[3][2] == "1.500x regular + clip; 1.100x forward + two backwards" and cells[3][4] == "NO"
    assert cells[5] == ["broken", "-", "-", "-", "error: RuntimeError: x"]


@needs_bash
def test_a_shorter_total_with_stages_left_out():
    """GPU_CHECK_TOTAL (a lease with less time left) with GPU_CHECK_LIMITS zeroing the stages not needed."""
    env = dict(os.environ, GPU_CHECK_TOTAL="320", GPU_CHECK_LIMITS="adamw_cuda=0,e2e_gpt2=0,tests_gpu=110")
    p = subprocess.run(["bash", SCRIPT, "--dry-run"], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env,
                       check=False)
    assert p.returncode == 0, p.stderr
    stages = _stages_of(p.stdout)
    assert stages["adamw_cuda"] == 0 and stages["e2e_gpt2"] == 0 and stages["tests_gpu"] == 110
    assert re.search(rf"^total: {sum(stages.values())} s .*at most 320 s", p.stdout, re.M), p.stdout
    for bad in ("421", "3m"):
        p = subprocess.run(["bash", SCRIPT, "--dry-run"], capture_output=True, text=True, timeout=60, cwd=ROOT,
                           env=dict(os.environ, GPU_CHECK_TOTAL=bad), check=False)
        assert p.returncode == 2 and "GPU_CHECK_TOTAL" in p.stderr
    p = subprocess.run(["bash", SCRIPT, "--dry-run"], capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env=dict(os.environ, GPU_CHECK_TOTAL="300"), check=False)
    assert p.returncode == 1 and "over the total of 300 s" in p.stderr  # the default limits do not fit


def test_stage_dump_after_prints_the_main_threads_stack_and_the_process_lives_on(tmp_path):
    """MPKERN_STAGE_DUMP_AFTER: after that long the stage's main-thread stack is on stderr (stuck in a
    sleep here, as a stage stuck in a compiler or a kernel would be) and the process goes on."""
    code = ("import time; from tools.gpu_check import harness; harness.dump_stacks_later(); "
            "time.sleep(3); print('alive')")
    env = dict(os.environ, MPKERN_STAGE_DUMP_AFTER="1")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
                       check=False)
    assert p.returncode == 0 and p.stdout.strip() == "alive", p.stderr
    assert "Stack (most recent call first)" in p.stderr and 'File "<string>", line 1' in p.stderr
    env["MPKERN_STAGE_DUMP_AFTER"] = ""
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
                       check=False)
    assert p.returncode == 0 and p.stderr == ""
