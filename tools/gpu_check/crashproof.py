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
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

from tools.gpu_check.pytest_results import START_MARK

__all__ = ["START_MARK", "pytest_addoption", "pytest_collection_finish", "pytest_configure",
           "pytest_handlecrashitem", "pytest_runtest_logstart", "pytest_sessionstart",
           "pytest_xdist_node_collection_finished"]

#: per-process state: whether this process runs tests (not xdist's controller); whether the collection was written
_STATE: dict[str, bool] = {"runs_tests": False, "collected_written": False}
#: a worker's ``sys.stdout`` while its terminal reporter is being created (see :func:`pytest_configure`)
_SAVED_STDOUT: list[Any] = []



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
    if not worker:
        return
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


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    """Where tests run: ``START_MARK nodeid`` on fd 2, in one write, before the test's setup begins."""
    if _STATE["runs_tests"]:
        os.write(2, f"{START_MARK} {nodeid}\n".encode("utf-8", "replace"))


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem: str, report: Any, sched: Any) -> None:
    """Put the tests the dead worker held back in collection order (``--dist load``'s queue holds
    collection indices; another scheduler's queue is left as it is)."""
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
