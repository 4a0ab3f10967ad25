"""pytest-xdist for the GPU check's tests: found in the GPU machine's Python, or installed offline from
the wheels that travel with the tree, and the pytest arguments that make one crash cost one test.

Standard library only (it runs before anything else is known to work)::

    python -m tools.gpu_check.plugins ensure --python PY [--out OUT/plugins.json]
    python -m tools.gpu_check.plugins args [--restarts N] [--collected-out PATH] [--plain]

``ensure`` prints one line -- ``pytest-xdist: found 3.8.0``, ``pytest-xdist: installed 3.8.0 from the
tree's wheels`` or ``pytest-xdist: unavailable: <reason>; ...`` -- writes it with the versions as JSON,
and exits 0 when xdist is usable, 1 when the caller must fall back to one plain pytest process (where
a crash ends the run). ``args`` prints the pytest arguments, one a line (``mapfile -t`` reads them):
:func:`xdist_args`, or :func:`plain_args` with ``--plain``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_RESTARTS", "MIN_XDIST", "PLUGIN", "WHEELS", "ensure", "install", "main", "plain_args",
           "probe", "version_tuple", "wheel_version", "xdist_args"]

#: the folder of pure-Python wheels that travel with the tree (README.md there)
WHEELS = Path(__file__).resolve().parent / "wheels"
#: the pytest plugin that adds what xdist lacks (order after a crash, the crashed test's output, the collection)
PLUGIN = "tools.gpu_check.crashproof"
#: the oldest pytest-xdist taken as found: ``--maxschedchunk`` came in 3.2.0 (older: the tree's wheel is installed)
MIN_XDIST = (3, 2)
#: worker restarts allowed in one run (see :func:`xdist_args`)
DEFAULT_RESTARTS = 10
#: what the caller does without xdist
FALLBACK = "the GPU tests run in one plain pytest process (a crash ends that run)"

#: run in the probed Python: the versions of pytest, execnet and xdist (with xdist's plugin imported), as JSON
_PROBE = """
import importlib, json
out = {}
for name in ("pytest", "execnet", "xdist", "xdist.plugin"):
    try:
        mod = importlib.import_module(name)
        out[name] = str(getattr(mod, "__version__", "?"))
    except Exception as e:
        out[name] = None
        out[name + " error"] = (type(e).__name__ + ": " + str(e))[:200]
print(json.dumps(out))
"""


def xdist_args(restarts: int = DEFAULT_RESTARTS, collected_out: str | os.PathLike[str] | None = None) -> list[str]:
    """The pytest arguments for a run where a crash costs the crashed test plus one worker restart,
    never the run, and the tests run in the order of the files on the command line.

    * ``-n 1``: one worker process runs every test (one GPU); pytest's own process is the controller,
      which survives the worker's death, reports the test it was running as failed with "worker 'gw0'
      crashed while running '<nodeid>'" and starts a new worker for the rest.
    * ``--dist load --maxschedchunk 1``: ``load`` sends the tests in collection order, and collection
      follows the command line. When a worker dies, ``load`` puts the tests the dead worker held back at
      the end of its queue; ``--maxschedchunk 1`` keeps that to the one test after the crashed one, and
      the plugin (below) sorts it back: the order stays exact (tests/test_gpu_xdist.py). ``loadfile``
      (and ``loadscope``) are worse: by default they reorder files by their number of tests, and after a
      crash they queue the whole file again, crashed test included -- with pytest-xdist 3.8.0 that test
      crashed a second time and the run hung. ``--dist no`` is no option (xdist makes ``-n 1`` ``load``).
      (``worksteal`` also keeps the order with one worker: it hands it every test at once.)
    * ``--max-worker-restart N``: each crash costs one restart (a new process: imports, CUDA context,
      the files collected again -- ~10 s on the GPU machine). Past ``N`` crashes xdist stops and the tests
      not reached are "not run" (named from ``--collected-out``); 10 is more crashes than a stage's limit
      leaves time for, and a worker that dies while collecting, every time, stops after 10 restarts
      instead of filling the limit.
    * ``-p tools.gpu_check.crashproof``: the order after a crash, the crashed test's output in the log,
      the collected ids (see that module).
    * ``--capture=tee-sys``: a test's prints go to its report *and* to the log as they happen, and native
      writes to fd 1/2 go straight to the log; under the default ``fd`` capture the crashed test's output
      dies with the worker's temporary file (measured: nothing of it reached the log).
    * ``--collected-out PATH`` (when given): the collected node ids, for the tests never reached.
    """
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
        raise ValueError(f"restarts must be an int >= 0, got {restarts!r}")
    args = ["-n", "1", "--dist", "load", "--maxschedchunk", "1", "--max-worker-restart", str(restarts),
            "-p", PLUGIN, "--capture=tee-sys"]
    if collected_out is not None:
        args += ["--collected-out", os.fspath(collected_out)]
    return args


def plain_args(collected_out: str | os.PathLike[str] | None = None) -> list[str]:
    """The fallback without xdist: one plain pytest process, where a crash ends the run. The plugin
    still marks each test's start in the log (so the test that died is named) and writes the
    collection; ``--continue-on-collection-errors`` keeps a file that fails to import from stopping
    the whole run (xdist goes on by itself); ``--capture=tee-sys`` as in :func:`xdist_args`."""
    args = ["-p", PLUGIN, "--capture=tee-sys", "--continue-on-collection-errors"]
    if collected_out is not None:
        args += ["--collected-out", os.fspath(collected_out)]
    return args


def version_tuple(version: str) -> tuple[int, ...]:
    """``"3.8.0"`` -> ``(3, 8, 0)``; the leading digits of each dotted part (``"3.8.0rc1"`` -> ``(3, 8, 0)``)."""
    if not isinstance(version, str):
        raise TypeError(f"version must be a str, got {type(version).__name__}")
    parts = []
    for part in version.split("."):
        m = re.match(r"\d+", part)
        if not m:
            break
        parts.append(int(m.group()))
    return tuple(parts)


def wheel_version(wheels: str | os.PathLike[str], project: str) -> str | None:
    """The newest version of ``project`` among the wheel files in ``wheels`` (``None``: none there)."""
    prefix = re.sub(r"[-_.]+", "_", project).lower() + "-"
    found = [p.name[len(prefix):].split("-")[0] for p in Path(wheels).glob("*.whl")
             if p.name.lower().startswith(prefix)]
    return max(found, key=version_tuple) if found else None


def probe(python: str, timeout: float = 60.0) -> dict[str, Any]:
    """The versions of pytest, execnet and pytest-xdist importable in ``python`` (``None``: not
    importable, with the error under ``"<name> error"``), or ``{"error": ...}`` when it cannot run."""
    try:
        r = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"cannot run {python}: {type(e).__name__}: {e}"[:300]}
    last = r.stdout.strip().splitlines()[-1:] or [""]
    try:
        out: dict[str, Any] = json.loads(last[0])
    except ValueError:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"{python} -c <probe> exited {r.returncode}: {tail}"[:300]}
    if out.get("xdist") is not None and out.get("xdist.plugin") is None:
        out["xdist error"] = out.get("xdist.plugin error", "xdist.plugin does not import")
        out["xdist"] = None
    return out


def install(python: str, wheels: str | os.PathLike[str] = WHEELS, timeout: float = 180.0) -> tuple[bool, str]:
    """``python -m pip install --no-index --find-links WHEELS pytest-xdist==<the wheel's version>``
    (execnet comes from the same folder; pytest must be there already). Returns ``(ok, detail)``,
    ``detail`` the version wanted or why it failed."""
    version = wheel_version(wheels, "pytest-xdist")
    if version is None:
        return False, f"no pytest-xdist wheel in {wheels}"
    cmd = [python, "-m", "pip", "install", "--no-index", "--find-links", os.fspath(wheels),
           "--disable-pip-version-check", "--no-input", "-q", f"pytest-xdist=={version}"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"pip install: {type(e).__name__}: {e}"[:300]
    if r.returncode != 0:
        lines = [ln for ln in (r.stderr + r.stdout).strip().splitlines() if ln.strip()]
        why = next((ln for ln in reversed(lines) if "ERROR" in ln), lines[-1] if lines else "no output")
        return False, f"pip install exited {r.returncode}: {why.strip()}"[:300]
    return True, version


def ensure(python: str, wheels: str | os.PathLike[str] = WHEELS) -> dict[str, Any]:
    """pytest-xdist in ``python``: found (at least :data:`MIN_XDIST`), else installed from ``wheels``
    offline, else unavailable. Returns ``{"status": "found"|"installed"|"unavailable", "line",
    "python", "pytest", "xdist", "execnet", "detail", "seconds"}``; ``line`` is what to print."""
    if not isinstance(python, str) or not python:
        raise ValueError(f"python must be a non-empty path or command, got {python!r}")
    t0 = time.monotonic()
    res: dict[str, Any] = {"python": python, "wheels": os.fspath(wheels)}

    def done(status: str, line: str, found: dict[str, Any], detail: str = "") -> dict[str, Any]:
        res.update(status=status, line=line, detail=detail, pytest=found.get("pytest"),
                   xdist=found.get("xdist"), execnet=found.get("execnet"),
                   seconds=round(time.monotonic() - t0, 2))
        if status == "unavailable":
            res["fallback"] = FALLBACK
        return res

    def unavailable(reason: str, found: dict[str, Any]) -> dict[str, Any]:
        return done("unavailable", f"pytest-xdist: unavailable: {reason}; {FALLBACK}", found, reason)

    before = probe(python)
    if "error" in before:
        return unavailable(before["error"], before)
    if before.get("pytest") is None:
        return unavailable(f"pytest does not import in {python} ({before.get('pytest error')})", before)
    have = before.get("xdist")
    if have is not None and version_tuple(have) >= MIN_XDIST:
        return done("found", f"pytest-xdist: found {have}", before)
    ok, detail = install(python, wheels)
    if not ok:
        return unavailable(detail, before)
    after = probe(python)
    if after.get("xdist") != detail:
        why = after.get("error") or after.get("xdist error") or f"found {after.get('xdist')}"
        return unavailable(f"pytest-xdist {detail} installed but does not import as such ({why})", after)
    replaced = f" (replacing {have}, older than {'.'.join(map(str, MIN_XDIST))})" if have else ""
    return done("installed", f"pytest-xdist: installed {detail} from the tree's wheels{replaced}", after)


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m tools.gpu_check.plugins", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("ensure", help="find pytest-xdist in PY or install it offline from the tree's wheels")
    e.add_argument("--python", default=sys.executable, help="the Python that runs the tests (default: this one)")
    e.add_argument("--wheels", default=os.fspath(WHEELS), help="the folder of wheels (default: %(default)s)")
    e.add_argument("--out", help="write the result there as JSON")
    a = sub.add_parser("args", help="print the pytest arguments, one a line")
    a.add_argument("--restarts", type=int, default=DEFAULT_RESTARTS)
    a.add_argument("--collected-out", help="where the run writes the collected test ids")
    a.add_argument("--plain", action="store_true", help="the arguments without xdist (one plain process)")
    ns = ap.parse_args(argv)
    if ns.cmd == "args":
        if ns.restarts < 0:
            ap.error("--restarts must be >= 0")
        args = plain_args(ns.collected_out) if ns.plain else xdist_args(ns.restarts, ns.collected_out)
        print("\n".join(args))
        return 0
    res = ensure(ns.python, ns.wheels)
    print(res["line"], flush=True)
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
    return 0 if res["status"] != "unavailable" else 1


if __name__ == "__main__":
    sys.exit(main())
