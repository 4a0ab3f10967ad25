"""The GPU check's crash-proof test run (issue 42), shown on the CPU with real pytest runs in
subprocesses: a test that kills its pytest worker (``os.abort()``) is reported crashed by name with its
last output and the tests after it still run (in a new worker); the files run in their command-line
order across a crash; spent restarts and a SIGINT leave the rest "not run" by name; the plain fallback
names the test that killed its one process; a test that poisons the CUDA context (simulated) costs
one worker restart, stays "failed" and the tests after it pass in the new worker, none lost; and
``tools.gpu_check.plugins`` finds pytest-xdist or installs it offline from the tree's wheels into a
fresh venv.

Each run's facts are checked against what the tests themselves recorded (their process ids, a file
they append their names to), not only against what ``tools.gpu_check.pytest_results`` reads."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest

from tools.gpu_check import plugins
from tools.gpu_check.crashproof import poisons_cuda
from tools.gpu_check.pytest_results import POISON_MARK, START_MARK, render, run_results

REPO = Path(__file__).resolve().parents[1]

#: a test file: one passes, one aborts its process after printing, one passes after it; the passing
#: ones write their process id, so the test can see the one after the crash ran in a new worker
CRASH_FILE = """
import os, resource, sys
from pathlib import Path

def test_before():
    Path("pid_before").write_text(str(os.getpid()))

def test_abort():
    print("about to abort: stdout", flush=True)
    sys.stderr.write("about to abort: stderr\\n")
    sys.stderr.flush()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file
    os.abort()

def test_after():
    Path("pid_after").write_text(str(os.getpid()))
"""

#: what torch raises on an illegal address (the words of cudaErrorIllegalAddress)
ILLEGAL = "CUDA error: an illegal memory access was encountered"


def _poison_file(names: list[str], poison: set[str], fail: set[str] = frozenset()) -> str:
    """A test file simulating a poisoned CUDA context: each test appends ``name pid`` to ``ran.txt``,
    then fails with :data:`ILLEGAL` if an earlier test poisoned this very process (``poisoned_pid``
    holds its pid), as every CUDA call does after a sticky error. Those in ``poison`` then poison it and
    raise :data:`ILLEGAL`; those in ``fail`` raise an ordinary AssertionError (whose source line, not its
    message, names the CUDA error)."""
    body = ["import os", "from pathlib import Path", "",
            "def _run(name):",
            "    with open('ran.txt', 'a') as f:",
            "        f.write(f'{name} {os.getpid()}\\n')",
            "    p = Path('poisoned_pid')",
            "    if p.exists() and p.read_text() == str(os.getpid()):",
            f"        raise RuntimeError({ILLEGAL!r})", ""]
    for n in names:
        body += [f"def {n}():", f"    _run({n!r})"]
        if n in poison:
            body += ["    Path('poisoned_pid').write_text(str(os.getpid()))", f"    raise RuntimeError({ILLEGAL!r})"]
        if n in fail:
            body.append(f"    assert len(Path('ran.txt').read_text()) == -1  # not {ILLEGAL!r}")
        body.append("")
    return "\n".join(body)


def _ran(tmp: Path) -> list[tuple[str, str]]:
    """``(name, pid)`` for each test start the poison files recorded, in order."""
    return [tuple(ln.split()) for ln in (tmp / "ran.txt").read_text().splitlines()]


def _recording_file(names: list[str], crash: set[str]) -> str:
    """A test file whose tests append their own name to ``ran.txt`` when they start; those in
    ``crash`` then abort their process."""
    body = ["import os, resource", "from pathlib import Path", ""]
    for n in names:
        body += [f"def {n}():", "    with open('ran.txt', 'a') as f:", f"        f.write('{n}\\n')"]
        if n in crash:
            body += ["    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))", "    os.abort()"]
        body.append("")
    return "\n".join(body)


def _env() -> dict[str, str]:
    """This environment with the tree importable (the plugin) and no pytest settings from outside."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PIP_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def _pytest_cmd(tmp: Path, args: list[str], files: list[str]) -> list[str]:
    """``python -m pytest`` over ``files`` in ``tmp`` (its own rootdir and ini), -v, xunit1 XML."""
    (tmp / "pytest.ini").write_text("[pytest]\n")
    return [sys.executable, "-m", "pytest", "-c", str(tmp / "pytest.ini"), "--rootdir", str(tmp), "-p",
            "no:cacheprovider", "-v", "-o", "junit_family=xunit1", f"--junitxml={tmp / 'run.xml'}", *args, *files]


def _run(tmp: Path, args: list[str], files: list[str], timeout: float = 180) -> int:
    """Run pytest as the GPU check does (stdout and stderr into one log); returns its exit code."""
    with open(tmp / "run.log", "w") as log:
        return subprocess.run(_pytest_cmd(tmp, args, files), cwd=tmp, env=_env(), stdout=log,
                              stderr=subprocess.STDOUT, timeout=timeout, check=False).returncode


def _counts(files: dict, name: str) -> dict:
    return {k: v for k, v in files[name].items() if k != "seconds"}


def _zero(**counts: int) -> dict:
    return {**dict.fromkeys(("passed", "failed", "crashed", "errors", "skipped", "interrupted", "not_run"), 0),
            **counts}


def test_abort_is_reported_crashed_by_name_and_the_later_test_runs(tmp_path):
    (tmp_path / "test_crash.py").write_text(CRASH_FILE)
    rc = _run(tmp_path, plugins.xdist_args(collected_out=tmp_path / "collected.txt"), ["test_crash.py"])
    log = (tmp_path / "run.log").read_text()
    assert rc == 1, log  # the crash counts as a failure of the run, not as its end
    # xdist's own sentence, in the XML and the log, names the test
    assert "worker 'gw0' crashed while running 'test_crash.py::test_abort'" in (tmp_path / "run.xml").read_text()
    assert "replacing crashed worker gw0" in log
    # the test after the crash ran, in another process than the one before it
    before, after = (tmp_path / "pid_before").read_text(), (tmp_path / "pid_after").read_text()
    assert before != after
    res = run_results(tmp_path / "run.xml", tmp_path / "run.log", tmp_path / "collected.txt")
    assert res["source"] == "xml"
    assert _counts(res["files"], "test_crash.py") == _zero(passed=2, crashed=1)
    assert res["not_run"] == []
    [crash] = res["crashed"]
    assert crash["nodeid"] == "test_crash.py::test_abort" and crash["worker"] == "gw0"
    out = "\n".join(crash["output"])
    for text in ("about to abort: stdout", "about to abort: stderr", "Fatal Python error: Aborted",
                 "test_crash.py\", line 13 in test_abort"):
        assert text in out, out
    text = "\n".join(render(res))
    assert "crashed: test_crash.py::test_abort (worker gw0); its last output:" in text
    # without the XML (a killed run), the log alone gives the same counts, without seconds
    by_log = run_results(tmp_path / "missing.xml", tmp_path / "run.log", tmp_path / "collected.txt")
    assert by_log["source"] == "log"
    assert _counts(by_log["files"], "test_crash.py") == _zero(passed=2, crashed=1)
    assert by_log["files"]["test_crash.py"]["seconds"] is None


def test_files_keep_the_command_line_order_across_a_crash(tmp_path):
    (tmp_path / "test_zeta.py").write_text(_recording_file(["test_z1", "test_z2", "test_z3", "test_z4"], {"test_z2"}))
    (tmp_path / "test_alpha.py").write_text(_recording_file(["test_a1", "test_a2"], set()))
    (tmp_path / "test_mid.py").write_text(_recording_file(["test_m1", "test_m2"], {"test_m1"}))
    files = ["test_zeta.py", "test_mid.py", "test_alpha.py"]  # not alphabetical, not by size
    _run(tmp_path, plugins.xdist_args(collected_out=tmp_path / "collected.txt"), files)
    ran = (tmp_path / "ran.txt").read_text().split()
    # xdist alone would run the test after each crash last (--dist load queues what the dead worker held at the end)
    assert ran == ["test_z1", "test_z2", "test_z3", "test_z4", "test_m1", "test_m2", "test_a1", "test_a2"]
    res = run_results(tmp_path / "run.xml", tmp_path / "run.log", tmp_path / "collected.txt")
    assert list(res["files"]) == files
    assert [c["nodeid"] for c in res["crashed"]] == ["test_zeta.py::test_z2", "test_mid.py::test_m1"]
    assert _counts(res["files"], "test_zeta.py") == _zero(passed=3, crashed=1)
    assert _counts(res["files"], "test_mid.py") == _zero(passed=1, crashed=1)
    assert _counts(res["files"], "test_alpha.py") == _zero(passed=2)


def test_spent_restarts_leave_the_rest_not_run_by_name(tmp_path):
    names = ["test_1", "test_c1", "test_c2", "test_4", "test_5"]
    (tmp_path / "test_m.py").write_text(_recording_file(names, {"test_c1", "test_c2"}))
    rc = _run(tmp_path, plugins.xdist_args(restarts=1, collected_out=tmp_path / "collected.txt"), ["test_m.py"])
    assert rc == 1
    assert (tmp_path / "ran.txt").read_text().split() == ["test_1", "test_c1", "test_c2"]
    res = run_results(tmp_path / "run.xml", tmp_path / "run.log", tmp_path / "collected.txt")
    assert _counts(res["files"], "test_m.py") == _zero(passed=1, crashed=2, not_run=2)
    assert res["not_run"] == ["test_m.py::test_4", "test_m.py::test_5"]
    assert "maximum crashed workers reached: 1" in res["notes"]


def test_sigint_names_the_running_test_and_leaves_the_rest_not_run(tmp_path):
    (tmp_path / "test_s.py").write_text(
        "import time\n\ndef test_quick():\n    pass\n\ndef test_slow():\n    time.sleep(120)\n\n"
        "def test_later():\n    pass\n")
    cmd = _pytest_cmd(tmp_path, plugins.xdist_args(collected_out=tmp_path / "collected.txt"), ["test_s.py"])
    with open(tmp_path / "run.log", "w") as log:
        # a session of its own, signalled as a whole -- what `timeout -s INT` does to a stage -- with SIGINT
        # at its default, as `timeout` leaves it (a suite started in the background of a non-interactive
        # shell runs with SIGINT ignored, and a child would inherit that)
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            deadline = time.monotonic() + 120
            while f"{START_MARK} test_s.py::test_slow" not in (tmp_path / "run.log").read_text():
                assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "run.log").read_text()
                time.sleep(0.2)
            time.sleep(0.5)
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    res = run_results(tmp_path / "run.xml", tmp_path / "run.log", tmp_path / "collected.txt")
    assert res["source"] == "xml"
    assert _counts(res["files"], "test_s.py") == _zero(passed=1, interrupted=1, not_run=1)
    assert [c["nodeid"] for c in res["interrupted"]] == ["test_s.py::test_slow"]
    assert res["not_run"] == ["test_s.py::test_later"]


def test_plain_fallback_names_the_test_that_killed_the_process(tmp_path):
    (tmp_path / "test_crash.py").write_text(CRASH_FILE)
    rc = _run(tmp_path, plugins.plain_args(collected_out=tmp_path / "collected.txt"), ["test_crash.py"])
    assert rc == -signal.SIGABRT  # one process: the crash ends the run, and no XML is written
    assert not (tmp_path / "run.xml").exists() and not (tmp_path / "pid_after").exists()
    res = run_results(tmp_path / "run.xml", tmp_path / "run.log", tmp_path / "collected.txt")
    assert res["source"] == "log"
    assert _counts(res["files"], "test_crash.py") == _zero(passed=1, crashed=1, not_run=1)
    assert [c["nodeid"] for c in res["crashed"]] == ["test_crash.py::test_abort"]
    assert "Fatal Python error: Aborted" in res["crashed"][0]["output"]
    assert res["not_run"] == ["test_crash.py::test_after"]


def test_poisoned_cuda_context_costs_one_restart_and_no_test(tmp_path):
    (tmp_path / "test_p.py").write_text(_poison_file(["test_a", "test_b", "test_c", "test_d"], {"test_b"}))
    # the last test of the run poisons too: nothing left to run, so no restart
    (tmp_path / "test_q.py").write_text(_poison_file(["test_e", "test_f"], {"test_f"}))
    rc = _run(tmp_path, plugins.xdist_args(collected_out=tmp_path / "collected.txt"), ["test_p.py", "test_q.py"])
    log = (tmp_path / "run.log").read_text()
    assert rc == 1, log
    ran = _ran(tmp_path)
    assert [n for n, _ in ran] == ["test_a", "test_b", "test_c", "test_d", "test_e", "test_f"]  # once each, in order
    pid = dict(ran)
    assert pid["test_a"] == pid["test_b"] != pid["test_c"]  # test_c ran in a new worker ...
    assert pid["test_c"] == pid["test_d"] == pid["test_e"] == pid["test_f"]  # ... and no other restart
    assert log.count(POISON_MARK) == 1 and f"{POISON_MARK} test_p.py::test_b: worker restarted" in log
    assert "crashed while running" not in log + (tmp_path / "run.xml").read_text()
    res = run_results(tmp_path / "run.xml", tmp_path / "run.log", tmp_path / "collected.txt")
    assert _counts(res["files"], "test_p.py") == _zero(passed=3, failed=1)
    assert _counts(res["files"], "test_q.py") == _zero(passed=1, failed=1)
    assert res["crashed"] == [] and res["not_run"] == []
    assert [(f["nodeid"], f["message"]) for f in res["failures"]] == [
        ("test_p.py::test_b", f"RuntimeError: {ILLEGAL}"), ("test_q.py::test_f", f"RuntimeError: {ILLEGAL}")]
    assert res["poisoned"] == ["test_p.py::test_b"]
    assert res["notes"] == ["CUDA context poisoned by test_p.py::test_b (counted failed): worker restarted"]


def test_poisoned_context_with_no_restarts_left_leaves_the_rest_not_run(tmp_path):
    (tmp_path / "test_p.py").write_text(_poison_file(["test_a", "test_b", "test_c", "test_d"], {"test_b"}))
    rc = _run(tmp_path, plugins.xdist_args(restarts=0, collected_out=tmp_path / "collected.txt"), ["test_p.py"])
    log = (tmp_path / "run.log").read_text()
    assert rc == 1, log
    assert [n for n, _ in _ran(tmp_path)] == ["test_a", "test_b"]
    assert f"{POISON_MARK} test_p.py::test_b: worker ended, no restarts left" in log
    res = run_results(tmp_path / "run.xml", tmp_path / "run.log", tmp_path / "collected.txt")
    assert _counts(res["files"], "test_p.py") == _zero(passed=1, failed=1, not_run=2)  # not "crashed"
    assert res["not_run"] == ["test_p.py::test_c", "test_p.py::test_d"]
    assert "CUDA context poisoned by test_p.py::test_b (counted failed): worker ended, no restarts left" in res["notes"]


def test_an_ordinary_failure_keeps_the_worker(tmp_path):
    (tmp_path / "test_p.py").write_text(_poison_file(["test_a", "test_b", "test_c"], set(), fail={"test_b"}))
    rc = _run(tmp_path, plugins.xdist_args(collected_out=tmp_path / "collected.txt"), ["test_p.py"])
    log = (tmp_path / "run.log").read_text()
    assert rc == 1, log
    ran = _ran(tmp_path)
    assert [n for n, _ in ran] == ["test_a", "test_b", "test_c"]
    assert len({p for _, p in ran}) == 1  # one worker throughout
    assert ILLEGAL in log  # the failing test's source line, shown in its report, names the error ...
    assert POISON_MARK not in log and "replacing crashed worker" not in log  # ... but its exception does not
    res = run_results(tmp_path / "run.xml", tmp_path / "run.log", tmp_path / "collected.txt")
    assert _counts(res["files"], "test_p.py") == _zero(passed=2, failed=1)
    assert res["poisoned"] == [] and res["notes"] == []


@pytest.mark.parametrize(("text", "poisoned"), [
    (f"E       RuntimeError: {ILLEGAL}\nE       CUDA kernel errors might be asynchronously reported", True),
    ("E   RuntimeError: CUDA error: device-side assert triggered", True),
    ("E   RuntimeError: Triton Error [CUDA]: an illegal memory access was encountered", True),
    ("E   RuntimeError: CUDA error: unspecified launch failure", True),
    ("E   RuntimeError: CUDA error: misaligned address", True),
    ("E   RuntimeError: CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx( handle, ...)`", True),
    ("E   cupy.cuda.runtime.CUDARuntimeError: cudaErrorIllegalAddress: an illegal memory access", True),
    ("E   CUDA_ERROR_LAUNCH_FAILED", True),
    # a chain: the CUDA error is the cause, the test's own exception comes last
    (f"E   RuntimeError: {ILLEGAL}\n\nThe above exception was the direct cause\nE   AssertionError: bad", True),
    # no "E" lines (--tb=native, or a plugin's string): the whole text
    (f'Traceback (most recent call last):\n  File "t.py", line 3\nRuntimeError: {ILLEGAL}', True),
    ("E   torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", False),
    ("E   RuntimeError: CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasGemmEx(...)`", False),
    ("E   AssertionError: misaligned address path not taken", False),
    (f">       assert x == 2  # {ILLEGAL}\nE       assert 1 == 2", False),  # in the source only
    ("", False),
])
def test_poisons_cuda_reads_the_exception_lines(text, poisoned):
    assert poisons_cuda(text) is poisoned


def test_poisons_cuda_wants_a_str():
    with pytest.raises(TypeError, match="text"):
        poisons_cuda(None)


def test_xdist_args_and_their_command_line():
    args = plugins.xdist_args(3, "c.txt")
    assert args[:4] == ["-n", "1", "--dist", "load"]
    assert args[args.index("--max-worker-restart") + 1] == "3"
    assert args[args.index("-p") + 1] == "tools.gpu_check.crashproof"
    assert args[-2:] == ["--collected-out", "c.txt"]
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="restarts"):
            plugins.xdist_args(bad)
    out = subprocess.run([sys.executable, "-m", "tools.gpu_check.plugins", "args", "--restarts", "3",
                          "--collected-out", "c.txt"], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == args


def test_the_tree_carries_both_wheels_and_they_fit_python_3_10_to_3_13():
    names = sorted(p.name for p in plugins.WHEELS.glob("*.whl"))
    assert [n.split("-")[0] for n in names] == ["execnet", "pytest_xdist"]
    assert all(n.endswith("-py3-none-any.whl") for n in names)  # pure Python: any 3.x, any machine
    assert plugins.version_tuple(plugins.wheel_version(plugins.WHEELS, "pytest-xdist")) >= plugins.MIN_XDIST


def _link_pytest(into: Path) -> None:
    """Symlink pytest and the distributions it needs here (from this Python's site-packages) --
    not pytest-xdist nor execnet."""
    from packaging.requirements import Requirement  # pytest's own dependency

    todo, seen = ["pytest"], set()
    while todo:
        dist = metadata.distribution(todo.pop())
        name = dist.metadata["Name"].lower()
        if name in seen:
            continue
        seen.add(name)
        for r in dist.requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] not in ("..", "__pycache__")}:
            if not (into / top).exists():
                (into / top).symlink_to(Path(str(dist.locate_file(top))))
    assert "pytest-xdist" not in seen and "execnet" not in seen


def test_ensure_finds_or_installs_xdist_offline_from_the_tree_wheels(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=180)
    py = str(venv / "bin" / "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()

    def ensure() -> dict:
        # no pip configuration at all: no index, no find-links but the tree's wheels folder
        env = {**_env(), "PIP_CONFIG_FILE": os.devnull}
        r = subprocess.run([sys.executable, "-m", "tools.gpu_check.plugins", "ensure", "--python", py, "--out",
                            str(tmp_path / "plugins.json")], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=300, check=False)
        res = json.loads((tmp_path / "plugins.json").read_text())
        assert r.stdout.strip() == res["line"] and r.returncode == (res["status"] == "unavailable")
        return res

    res = ensure()  # a bare venv: no pytest, nothing to install xdist beside
    assert res["status"] == "unavailable" and "pytest does not import" in res["line"]
    assert "one plain pytest process" in res["line"]
    deps = tmp_path / "deps"
    deps.mkdir()
    _link_pytest(deps)
    old = tmp_path / "old" / "xdist"  # an xdist too old to take: no --maxschedchunk
    old.mkdir(parents=True)
    (old / "__init__.py").write_text("__version__ = '3.1.0'\n")
    (old / "plugin.py").write_text("")
    Path(site, "deps.pth").write_text(f"{deps}\n{old.parent}\n")  # after site-packages on sys.path
    want = plugins.wheel_version(plugins.WHEELS, "pytest-xdist")  # 3.8.0 (the wheel file's name)
    res = ensure()
    assert res["status"] == "installed", res
    assert res["line"] == f"pytest-xdist: installed {want} from the tree's wheels (replacing 3.1.0, older than 3.2)"
    where = subprocess.run([py, "-c", "import xdist, execnet; print(xdist.__file__); print(execnet.__file__)"],
                           capture_output=True, text=True, check=True).stdout.split()
    assert all(w.startswith(site) for w in where), where
    res = ensure()
    assert (res["status"], res["line"]) == ("found", f"pytest-xdist: found {want}")
    assert res["execnet"] == plugins.wheel_version(plugins.WHEELS, "execnet")
