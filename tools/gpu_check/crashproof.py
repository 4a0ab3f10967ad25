"""The pytest plugin that adds what pytest-xdist lacks for the GPU check's crash-proof test run.

Loaded with ``-p tools.gpu_check.crashproof`` (:func:`tools.gpu_check.plugins.xdist_args` builds the
whole argument list). It imports only pytest and the standard library; its xdist hooks are optional,
so it loads in a plain pytest run too. With one worker (``-n 1``), pytest-xdist already survives a
crash: the dead worker is replaced, the test it was running is reported failed with "worker 'gw0'
crashed while running '<nodeid>'", and the rest run in the new worker. What it does not do, added here:

* **Order after a crash.** ``--dist load`` hands the worker the tests in collection order (the files'
  order on the command line), but when a worker dies the tests it had been sent and not yet run go to
  the *end* of the queue: up to half of the remaining tests (one with ``--maxschedchunk 1``) would run
  after every other file. :func:`pytest_handlecrashitem` (xdist's hook for that moment, given the
  scheduler; ``sched.pending`` holds indices into the collection) sorts the queue back into
  collection order, so the most valuable files still run first.
* **The crashed test's last output.** xdist keeps none of it (its report carries only the sentence
  above), and a worker's standard output goes to ``/dev/null`` (execnet keeps fd 1 for itself). In a
  worker, :func:`pytest_sessionstart` points fd 1 at fd 2, so what the test printed (under
  ``--capture=tee-sys``), what native code wrote (CUDA's messages, a device ``printf``) and
  faulthandler's traceback all reach the run's log; :func:`pytest_runtest_logstart` writes
  ``START_MARK <nodeid>`` there before each test, so :mod:`tools.gpu_check.pytest_results` can cut the
  crashed (or interrupted) test's output out of the log by name. In a plain run (no xdist) the mark
  names the test that was running when the one process died.
* **The tests that never ran.** When the restarts run out, xdist stops and the JUnit XML lists only
  what ran. ``--collected-out PATH`` writes the collected node ids there (one a line, as soon as the
  collection is known), so the tests the run never reached are named.
* **A poisoned CUDA context.** An illegal memory access or a device-side assert does not kill the
  process: the test fails with ``RuntimeError: CUDA error: ...`` and every later CUDA call in that
  process fails too, so one bug would read as hundreds of failures. A worker whose test failed (or
  xfailed) with one of :data:`CUDA_POISON_PATTERNS` (:func:`poisons_cuda`) ends itself (``os._exit``)
  when the next test starts -- after the failing test's reports and xdist's "protocol complete" have
  gone to the controller, before the next test's first report -- having written the poisoning test's
  node id to a file named after the worker in a folder the controller made and handed to every worker
  (``workerinput``, :func:`pytest_configure_node`). xdist (3.8.0: ``DSession.worker_errordown``) takes
  the next test for the one the worker died running and calls :func:`pytest_handlecrashitem` with it;
  finding the file, that hook puts the test back at the head of the queue
  (``sched.mark_test_pending``), turns xdist's "crashed" report for it into a silent passed-setup
  report (no terminal line, no count; JUnit XML gets an empty ``<testcase time="0.000"/>``, which
  :mod:`tools.gpu_check.pytest_results` skips) and writes ``[crashproof] CUDA context poisoned by
  <nodeid>: worker restarted`` to the log. The failing test stays failed with its own message; the
  next one runs in the fresh worker xdist starts. Each such restart counts against
  ``--max-worker-restart`` like a crash (it costs the same: a new process and CUDA context); when none
  is left the line says so and the tests after it are "not run". A plain run (no xdist) is unchanged.
  CUDA reports a kernel's fault at a later synchronising call, so the test named may be the one after
  the faulty kernel's (``CUDA_LAUNCH_BLOCKING=1`` pins it, at a cost in speed).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tools.gpu_check.pytest_results import POISON_MARK, START_MARK

__all__ = ["CUDA_POISON_PATTERNS", "POISON_MARK", "START_MARK", "WORKERINPUT_KEY", "poisons_cuda",
           "pytest_addoption", "pytest_collection_finish", "pytest_configure", "pytest_configure_node",
           "pytest_handlecrashitem", "pytest_runtest_logreport", "pytest_runtest_logstart", "pytest_sessionstart",
           "pytest_testnodedown", "pytest_unconfigure", "pytest_xdist_node_collection_finished"]

#: What a failed test's exception says when the CUDA context it ran in is poisoned: CUDA's "sticky"
#: errors, after which every CUDA call in the process fails (CUDA runtime API docs, ``cudaError``),
#: in the words torch (``CUDA error: <text>``), Triton (``Triton Error [CUDA]: <text>``), the
#: runtime/driver enum names and cuBLAS use. Searched (``re.search``) by :func:`poisons_cuda`. Not
#: here, as they leave the context usable: out of memory, ``CUBLAS_STATUS_NOT_SUPPORTED`` /
#: ``INVALID_VALUE`` / ``ALLOC_FAILED`` (argument and allocation errors), stream-capture errors. A false
#: match costs one worker restart (~10 s on the GPU machine); a miss, a run of follow-on failures.
CUDA_POISON_PATTERNS: tuple[str, ...] = (
    r"an illegal memory access was encountered",  # cudaErrorIllegalAddress
    r"device-side assert(ion)? triggered",  # cudaErrorAssert: a kernel's assert (torch's index checks)
    r"unspecified launch failure",  # cudaErrorLaunchFailure
    r"an illegal instruction was encountered",  # cudaErrorIllegalInstruction
    r"CUDA error: misaligned address",  # cudaErrorMisalignedAddress (the bare phrase is too common a word)
    r"the launch timed out and was terminated",  # cudaErrorLaunchTimeout
    r"uncorrectable ECC error encountered",  # cudaErrorECCUncorrectable
    r"\bcudaError(IllegalAddress|Assert|LaunchFailure|IllegalInstruction|MisalignedAddress|LaunchTimeout"
    r"|HardwareStackError|InvalidPc|ECCUncorrectable)\b",
    r"\bCUDA_ERROR_(ILLEGAL_ADDRESS|ASSERT|LAUNCH_FAILED|ILLEGAL_INSTRUCTION|MISALIGNED_ADDRESS|LAUNCH_TIMEOUT"
    r"|HARDWARE_STACK_ERROR|INVALID_PC|ECC_UNCORRECTABLE)\b",
    r"\bCUBLAS_STATUS_(EXECUTION_FAILED|INTERNAL_ERROR)\b",  # a cuBLAS kernel that failed to run
)
#: the key in xdist's ``workerinput`` that holds the folder of poisoning marks (see :func:`pytest_configure_node`)
WORKERINPUT_KEY = "crashproof_poison_dir"
_POISON_RE = re.compile("|".join(f"(?:{p})" for p in CUDA_POISON_PATTERNS))

#: per-process state: whether this process runs tests (not xdist's controller); whether the collection was written
_STATE: dict[str, bool] = {"runs_tests": False, "collected_written": False}
#: a worker's ``sys.stdout`` while its terminal reporter is being created (see :func:`pytest_configure`)
_SAVED_STDOUT: list[Any] = []
#: the poisoned-context restart: in the controller ``config``, the marks' folder ``dir`` (made here:
#: ``owner``) and ``downs`` (workers gone down); in a worker ``dir``, its ``worker`` id and ``poisoned_by``
_RESTART: dict[str, Any] = {"config": None, "dir": None, "owner": False, "downs": 0, "worker": None,
                            "poisoned_by": None}



def pytest_addoption(parser: Any) -> None:
    """``--collected-out PATH``: where the controller writes the collected node ids."""
    parser.addoption("--collected-out", dest="crashproof_collected_out", default=None, metavar="PATH",
                     help="write the collected test ids there, one a line (tools.gpu_check.crashproof)")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: Any) -> None:
    """Note whether this process runs tests (an xdist worker, or a plain run without xdist's
    controller). In a worker whose fd 1 is ``/dev/null`` (execnet's doing), hand the worker's own
    terminal reporter -- created next, from ``sys.stdout`` -- a ``/dev/null`` stream of its own, so
    that it stays silent once :func:`pytest_sessionstart` points fd 1 at the log (the controller
    reports every test; the worker's copy would only repeat it)."""
    worker = hasattr(config, "workerinput")  # xdist gives every worker's config a ``workerinput``
    controller = not worker and getattr(config.option, "dist", "no") != "no"
    _STATE["runs_tests"] = not controller
    if controller:
        _RESTART["config"] = config
    if not worker:
        return
    _RESTART["dir"] = config.workerinput.get(WORKERINPUT_KEY)
    _RESTART["worker"] = str(config.workerinput.get("workerid"))
    try:
        to_devnull = os.path.samestat(os.fstat(1), os.stat(os.devnull))
    except OSError:  # no fd 1 or no /dev/null: the output stays where it was
        to_devnull = False
    if to_devnull:
        _SAVED_STDOUT.append(sys.stdout)
        sys.stdout = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 -- lives as long as the worker


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: Any) -> None:
    """In a worker (see :func:`pytest_configure`): fd 1 becomes fd 2, the run's log, and
    ``sys.stdout`` the stream on fd 1 again, before the first test."""
    if _SAVED_STDOUT:
        os.dup2(2, 1)
        sys.stdout = _SAVED_STDOUT.pop()


def poisons_cuda(text: str) -> bool:
    """Whether a failed test's report text says its CUDA context is poisoned: one of
    :data:`CUDA_POISON_PATTERNS` in the exception's lines (pytest's ``E   `` lines, every exception of
    a chain; the whole text where it has none: ``--tb=native``/``line``, a plugin's plain string), so a
    test whose source or comment merely mentions such an error does not count."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    exc_lines = [ln for ln in text.splitlines() if ln.startswith("E ")]
    return _POISON_RE.search("\n".join(exc_lines) if exc_lines else text) is not None


def pytest_runtest_logreport(report: Any) -> None:
    """In an xdist worker of this plugin's controller: note the first test whose report failed (or
    xfailed: the context is as poisoned) with a CUDA error that poisons the context."""
    if _RESTART["worker"] is None or _RESTART["dir"] is None or _RESTART["poisoned_by"] is not None:
        return  # the controller, a worker of a controller without this plugin, or already noted
    if (report.failed or hasattr(report, "wasxfail")) and poisons_cuda(report.longreprtext):
        _RESTART["poisoned_by"] = report.nodeid


def _end_poisoned_worker() -> None:
    """Write the poisoning test's node id to ``<dir>/<worker id>`` (atomically) and end this worker
    at once: its CUDA context is lost, and xdist starts a fresh one."""
    mark = Path(_RESTART["dir"], str(_RESTART["worker"]))
    tmp = mark.with_name(mark.name + ".tmp")
    tmp.write_text(_RESTART["poisoned_by"], encoding="utf-8")
    os.replace(tmp, mark)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed or broken: its text dies with the process
            stream.flush()
    os._exit(3)  # no atexit, no teardown: they would touch the poisoned context


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    """Where tests run: ``START_MARK nodeid`` on fd 2, in one write, before the test's setup begins.
    In a worker whose CUDA context an earlier test poisoned: end the worker instead (first, before
    xdist tells the controller this test started; see the module docstring)."""
    if _RESTART["poisoned_by"] is not None:
        _end_poisoned_worker()
    if _STATE["runs_tests"]:
        os.write(2, f"{START_MARK} {nodeid}\n".encode("utf-8", "replace"))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """In the controller, for every worker it starts (restarts too): hand it the marks' folder (made
    on the first call, removed by :func:`pytest_unconfigure`)."""
    if _RESTART["dir"] is None:
        _RESTART["dir"], _RESTART["owner"] = tempfile.mkdtemp(prefix="crashproof-"), True
    node.workerinput[WORKERINPUT_KEY] = _RESTART["dir"]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """In the controller: count the workers that went down (xdist counts the same ones, each error
    down, against ``--max-worker-restart``)."""
    if error:
        _RESTART["downs"] += 1


def pytest_unconfigure(config: Any) -> None:
    """In the controller: remove the marks' folder."""
    if _RESTART["owner"] and _RESTART["dir"] is not None:
        shutil.rmtree(_RESTART["dir"], ignore_errors=True)
        _RESTART["dir"], _RESTART["owner"] = None, False


def _take_poison_mark(report: Any) -> str | None:
    """The node id the dead worker of ``report`` (xdist sets ``report.node``) wrote before ending
    itself on purpose, the mark removed; ``None`` when it died on its own."""
    workerinput = getattr(getattr(report, "node", None), "workerinput", None)
    if _RESTART["dir"] is None or not isinstance(workerinput, dict):
        return None
    mark = Path(_RESTART["dir"], str(workerinput.get("workerid")))
    try:
        nodeid = mark.read_text(encoding="utf-8").strip()
    except OSError:
        return None
    mark.unlink(missing_ok=True)
    return nodeid or None


def _restarts_left(config: Any) -> bool:
    """Whether xdist replaces the worker that just went down (its rule in ``worker_errordown``)."""
    try:
        from xdist.dsession import get_default_max_worker_restart
    except ImportError:  # not reached: this hook is xdist's, so xdist is there
        return True
    most = get_default_max_worker_restart(config)
    return most is None or _RESTART["downs"] <= most


def _say(config: Any, line: str) -> None:
    """A line in the controller's output (the run's log), on a line of its own."""
    terminal = config.pluginmanager.getplugin("terminalreporter") if config is not None else None
    if terminal is not None:
        terminal.write_line(line)
    else:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem: str, report: Any, sched: Any) -> None:
    """When the worker ended itself over a poisoned CUDA context (its mark is there): ``crashitem`` is
    the test it was about to start, not a crash -- queue it again and make xdist's report for it a
    silent passed setup. Then put the tests the dead worker held back in collection order (``--dist
    load``'s queue holds collection indices; another scheduler's queue is left as it is)."""
    poisoned_by = _take_poison_mark(report)
    if poisoned_by is not None and hasattr(sched, "mark_test_pending"):
        sched.mark_test_pending(crashitem)
        report.outcome, report.when, report.longrepr = "passed", "setup", None
        config = _RESTART["config"]
        what = ("worker restarted" if _restarts_left(config) else
                "worker ended, no restarts left (--max-worker-restart)")
        _say(config, f"{POISON_MARK} {poisoned_by}: {what}")
    pending = getattr(sched, "pending", None)
    if isinstance(pending, list) and all(isinstance(i, int) for i in pending):
        pending.sort()


def _write_collected(config: Any, ids: list[str]) -> None:
    """Write ``ids`` to ``--collected-out``, once per process, atomically."""
    path = config.getoption("crashproof_collected_out", None)
    if not path or _STATE["collected_written"]:
        return
    _STATE["collected_written"] = True
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(f"{i}\n" for i in ids)
    os.replace(tmp, path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """Under xdist, in the controller: the first worker's collection goes to ``--collected-out``."""
    _write_collected(node.config, list(ids))


def pytest_collection_finish(session: Any) -> None:
    """In a plain run (no xdist): the collection goes to ``--collected-out``; a worker writes none."""
    if _STATE["runs_tests"] and not hasattr(session.config, "workerinput"):
        _write_collected(session.config, [item.nodeid for item in session.items])
