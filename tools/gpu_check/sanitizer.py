"""The sanitizer stage: compute-sanitizer's memcheck and racecheck over mpkern's CUDA kernels.

``python -m tools.gpu_check.sanitizer --out DIR --limit SECONDS`` writes ``DIR/sanitizer.json``
(:class:`.harness.StageFile`): a row per tool run (``tool``, ``status``: clean / errors / warnings /
timeout / failed / skipped, ``errors``, ``warnings``, ``seconds``, how many of the workload's calls
ran, the summary line, the log's name) and ``findings``, one per (tool, kernel, call label, error
kind) with its count and first lines (:func:`.sanitizer_report.parse_report`); each tool's whole
output stays beside it in ``sanitizer_<tool>.log``. :mod:`.sanitizer_table` turns the JSON into
summary lines.

* **Where**: ``compute-sanitizer`` on ``PATH``, else under ``$CUDA_HOME/bin``, ``$CUDA_PATH/bin``,
  ``/usr/local/cuda/bin``, or a pip ``nvidia-cuda-sanitizer-api`` wheel's folder. Absent: the JSON says
  where it looked, status ``done``, no rows, exit 0 -- a stage that cannot run is not a failure.
* **What**: memcheck over every call of :mod:`.sanitizer_workload` (every kernel of ``csrc/cuda``,
  found by :func:`.sanitizer_report.scan_source_tree`), racecheck -- shared-memory hazards only --
  over the kernels whose body declares ``__shared__`` (the same scan) and only the workload's
  families that launch them, at a few sizes. Both run at once, each a process of its own with its
  own connection port, so each gets the whole limit less the probe.
* **Fast**: ``--kernel-name kns=<length><name>`` per kernel (the Itanium-mangled form of the name:
  only mpkern's kernels are instrumented, not torch's), ``--show-backtrace device``, API-error
  reports off (torch's own probing calls fail by design), ``--error-exitcode``; each option only
  where the installed version's ``--help`` lists it. ``PYTORCH_NO_CUDA_MEMORY_CACHING=1``: every
  tensor its own exact ``cudaMalloc``, so a read past a tensor's end is out of bounds to memcheck.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from . import harness
from .harness import StageFile, run_stage
from .sanitizer_report import parse_report, scan_source_tree

__all__ = ["FILE", "TOOLS", "command", "find_sanitizer", "main", "read_run", "stage_sanitizer", "wait_all"]

FILE = "sanitizer.json"
#: tool -> (workload arguments, whether it checks only the kernels with shared memory)
TOOLS: dict[str, tuple[tuple[str, ...], bool]] = {
    "memcheck": ((), False),
    "racecheck": (("--only", "unscale,grad_stats,adamw_staged", "--sizes", "few"), True),
}
#: compute-sanitizer's exit code when the workload succeeded but the tool found errors
ERROR_EXIT = 19
#: seconds kept for the probe (--version, --help) and for writing the JSON
PROBE_S = 3.0
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXE = "compute-sanitizer"


def candidates(env: Mapping[str, str]) -> list[str]:
    """Where compute-sanitizer is looked for after ``PATH``, in order."""
    places = [os.path.join(env[v], "bin") for v in ("CUDA_HOME", "CUDA_PATH") if env.get(v)]
    places.append("/usr/local/cuda/bin")
    for entry in sys.path:  # pip's nvidia-cuda-sanitizer-api-cu1x wheel
        places += sorted(glob.glob(os.path.join(entry, "nvidia", "cuda_sanitizer_api", "compute-sanitizer")))
    return list(dict.fromkeys(places))


def find_sanitizer(env: Mapping[str, str] | None = None) -> tuple[str | None, list[str]]:
    """(the compute-sanitizer executable or None, the places looked in)."""
    env = os.environ if env is None else env
    looked = ["PATH"]
    exe = shutil.which(EXE, path=env.get("PATH", ""))
    if exe:
        return exe, looked
    for folder in candidates(env):
        looked.append(folder)
        path = os.path.join(folder, EXE)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path, looked
    return None, looked


def _probe(exe: str, flag: str) -> str:
    try:
        r = subprocess.run([exe, flag], capture_output=True, text=True, timeout=PROBE_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"({flag} failed: {e})"
    return r.stdout + r.stderr


def command(exe: str, tool: str, kernels: Sequence[str], help_text: str, port: int | None,
            timeout_s: int) -> list[str]:
    """The compute-sanitizer command line for ``tool`` over ``kernels`` (all kernels when empty); an
    option the installed version's ``--help`` does not list is left out."""
    cmd = [exe, "--tool", tool]

    def opt(name: str, *values: str) -> None:
        if f"--{name}" in help_text:
            cmd.extend([f"--{name}", *values])

    opt("error-exitcode", str(ERROR_EXIT))
    opt("show-backtrace", "device")
    opt("report-api-errors", "no")
    opt("print-limit", "200")
    opt("target-processes", "application-only")
    opt("launch-timeout", str(max(timeout_s, 1)))
    if port is not None:
        opt("port", str(port))
    for k in kernels:
        cmd.extend(["--kernel-name", f"kns={len(k)}{k}"])
    return cmd


def _stop(proc: subprocess.Popen[str]) -> None:
    """End ``proc``'s process group (the sanitizer and the workload under it): TERM, then KILL."""
    for sig, wait_s in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(PYTORCH_NO_CUDA_MEMORY_CACHING="1", PYTHONUNBUFFERED="1")
    env.setdefault("CUDA_MODULE_LOADING", "LAZY")
    return env


def start(cmd: Sequence[str], log_path: str) -> tuple[subprocess.Popen[str], Any]:
    """Start ``cmd`` in a process group of its own, stdout and stderr into ``log_path``."""
    log = open(log_path, "w")  # noqa: SIM115 -- the stage closes it once the process ended
    proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=_env(),
                            start_new_session=True)
    return proc, log


def wait_all(procs: Mapping[str, subprocess.Popen[str]], deadline: float, t0: float) -> dict[str, tuple[float, bool]]:
    """Wait for the processes (by tool) until ``deadline`` (``time.monotonic()``), stopping those still
    running then -> tool: (seconds from ``t0`` to its end, whether it was cut off)."""
    ended: dict[str, tuple[float, bool]] = {}
    while len(ended) < len(procs):
        for tool, proc in procs.items():
            if tool not in ended and proc.poll() is not None:
                ended[tool] = (round(time.monotonic() - t0, 1), False)
        if len(ended) < len(procs) and time.monotonic() >= deadline:
            for tool, proc in procs.items():
                if tool not in ended:
                    _stop(proc)
                    ended[tool] = (round(time.monotonic() - t0, 1), True)
        time.sleep(0.05)
    return ended


def read_run(tool: str, proc: subprocess.Popen[str], log_path: str, seconds: float, timed_out: bool,
             kernels: Sequence[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One ended run's log -> (its row, its findings)."""
    with open(log_path, errors="replace") as f:
        rep = parse_report(f.read(), tool, kernels)
    if timed_out:
        status = "timeout"
    elif rep["nogpu"]:
        status = "no gpu"
    elif rep["errors"]:
        status = "errors"
    elif (rep["errors"] is None or proc.returncode not in (0, ERROR_EXIT) or rep["failed"] or not rep["ended"]
          or rep["done"] != rep["planned"]):
        status = "failed"  # no summary, or the workload did not get through its calls
    else:  # the summary is the count; findings beside a zero count are listed, not counted
        status = "warnings" if rep["warnings"] else "clean"
    row = {"tool": tool, "status": status, "errors": rep["errors"], "warnings": rep["warnings"],
           "findings": sum(f["count"] for f in rep["findings"]), "seconds": seconds,
           "calls_planned": rep["planned"], "calls_started": rep["calls"], "calls_done": rep["done"],
           "failed_calls": rep["failed"][:20], "exit_code": proc.returncode, "summary": rep["summary"],
           "notes": rep["notes"][:10], "kernels": list(kernels), "log": os.path.basename(log_path)}
    return row, rep["findings"]


def stage_sanitizer(out: str, limit_s: float, tools: Sequence[str] = tuple(TOOLS), quick: bool = False) -> int:
    """The stage's body (see the module doc) -> its exit code (3: the workload saw no CUDA GPU).
    ``quick``: memcheck's workload at a few sizes too (racecheck's always is)."""
    t0 = time.monotonic()
    sf = StageFile(os.path.join(out, FILE), "sanitizer", note=None, findings=[])
    exe, looked = find_sanitizer()
    if exe is None:
        sf.set(note=f"{EXE} not found (looked in {', '.join(looked)})", meta={"looked_in": looked})
        sf.finish("done")
        print(f"sanitizer: {sf.data['note']}")
        return 0
    found = scan_source_tree(ROOT)
    help_text = _probe(exe, "--help")
    version = next((ln for ln in _probe(exe, "--version").splitlines() if ln.strip()), "?")
    shared = [k for k, uses in found.items() if uses]
    sf.set(meta={"sanitizer": exe, "version": version, "limit_s": limit_s, "kernels": sorted(found),
                 "racecheck_kernels": shared, "racecheck_chosen_by": "a __shared__ in the kernel's body "
                 "(tools/gpu_check/sanitizer_report.scan_source_tree over csrc/cuda)",
                 "env": "PYTORCH_NO_CUDA_MEMORY_CACHING=1", "quick": quick},
           planned=list(tools))
    deadline = t0 + limit_s - 1.0  # a second for reading the logs and writing the JSON
    runs: list[tuple[str, subprocess.Popen[str], Any, str, list[str], str]] = []
    nogpu = False
    try:
        _start_runs(exe, tools, found, help_text, deadline, quick, out, sf, runs)
        ended = wait_all({r[0]: r[1] for r in runs}, deadline, time.monotonic())
        for tool, proc, log, log_path, kernels, line in runs:
            log.close()
            row, findings = read_run(tool, proc, log_path, *ended[tool], kernels)
            row["command"] = line
            sf.add_row(row)
            sf.set(findings=sf.data["findings"] + findings)
            nogpu = nogpu or row["status"] == "no gpu"
    finally:  # interrupted (the stage's own limit): no sanitizer left behind
        for _, proc, log, *_ in runs:
            _stop(proc)
            log.close()
    if nogpu:
        raise RuntimeError("no CUDA GPU: the workload found none (see the sanitizer logs)")
    sf.finish("done")
    return 0


def _start_runs(exe: str, tools: Sequence[str], found: Mapping[str, bool], help_text: str, deadline: float,
                quick: bool, out: str, sf: StageFile, runs: list[Any]) -> None:
    """Start one sanitizer process per tool (appended to ``runs`` as each starts); a tool with no
    kernel to check gets a ``skipped`` row."""
    shared = [k for k, uses in found.items() if uses]
    for i, tool in enumerate(tools):
        args, only_shared = TOOLS[tool]
        if quick and "--sizes" not in args:
            args = (*args, "--sizes", "few")
        kernels = shared if only_shared else sorted(found)
        if only_shared and not kernels:
            sf.add_row({"tool": tool, "status": "skipped", "errors": None, "seconds": 0.0,
                        "notes": ["no kernel in csrc/cuda uses shared memory"], "kernels": []})
            continue
        budget = int(deadline - time.monotonic())
        cmd = command(exe, tool, kernels, help_text, 49152 + 64 * i, budget)
        cmd += [sys.executable, "-m", "tools.gpu_check.sanitizer_workload", "--device", "cuda", *args]
        log_path = os.path.join(out, f"sanitizer_{tool}.log")
        proc, log = start(cmd, log_path)
        runs.append((tool, proc, log, log_path, kernels, " ".join(cmd)))


def main(argv: list[str] | None = None) -> int:
    """``python -m tools.gpu_check.sanitizer --out DIR --limit SECONDS`` (see the module doc)."""
    ap = argparse.ArgumentParser(prog="python -m tools.gpu_check.sanitizer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output folder (sanitizer.json and the tools' logs)")
    ap.add_argument("--limit", type=float, default=harness.stage_limit(30.0),
                    help="seconds for the whole stage (default: MPKERN_STAGE_LIMIT, set by gpu_check.sh, else 30)")
    ap.add_argument("--tools", default=",".join(TOOLS), help=f"comma list of {', '.join(TOOLS)}")
    ap.add_argument("--quick", action="store_true", help="memcheck's workload at a few sizes (racecheck's always)")
    args = ap.parse_args(argv)
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    if not tools or any(t not in TOOLS for t in tools):
        ap.error(f"--tools: want a comma list of {', '.join(TOOLS)}, got {args.tools!r}")
    if not args.limit > PROBE_S + 2:
        ap.error(f"--limit: want more than {PROBE_S + 2:g} seconds, got {args.limit:g}")
    return run_stage(args.out, [FILE], lambda: stage_sanitizer(args.out, args.limit, tools, args.quick))


if __name__ == "__main__":
    sys.exit(main())
