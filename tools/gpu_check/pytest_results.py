"""Per-file results of a pytest run of the GPU check -- passed / failed / crashed / errors / skipped /
interrupted / not run, and seconds -- from its JUnit XML, its ``-v`` log and its collection list.
Standard library only, so the summary prints wherever Python runs.

What each source gives (pytest 9.2 + pytest-xdist 3.8.0, ``-o junit_family=xunit1``):

* **The JUnit XML** (``--junitxml``, written even when the run is stopped with SIGINT): one
  ``<testcase classname= name= file= time=>`` per test that ran. A test whose worker died is a
  testcase with ``file`` and no ``line``, holding ``<error message="failed on setup with &quot;worker
  'gw0' crashed while running 'tests/x.py::test_y'&quot;">worker 'gw0' crashed while running
  'tests/x.py::test_y'</error>`` (xdist's report, ``when="???"``, which junitxml files as a setup
  error): :data:`CRASH_RE` finds it, and the test is "crashed", not "errors". Nothing of the test's
  output is in it. A test running when SIGINT came is an empty ``<testcase time="0.000" />``.
* **The log** (pytest's ``-v`` output and, under xdist with :mod:`tools.gpu_check.crashproof`, the
  workers' stderr): ``[crashproof start] <nodeid>`` before each test (:data:`START_MARK`), then what
  the test and native code wrote and faulthandler's traceback (``Fatal Python error: Aborted`` and the
  thread stacks), then xdist's ``[gw0] node down: Not properly terminated``, ``[gw0] [ 18%] FAILED
  <nodeid>``, ``replacing crashed worker gw0`` -- or, once the restarts are spent, ``maximum crashed
  workers reached: N``. The crashed test's last output is the log from its mark to ``node down``. Where
  the XML is missing (the run was killed), outcomes come from the log's result lines (no seconds).
  A worker that ended itself because a test poisoned its CUDA context (the test stays "failed") is
  followed by ``[crashproof] CUDA context poisoned by <nodeid>: worker restarted`` (:data:`POISON_MARK`)
  before xdist's ``replacing crashed worker``: a note, not a crash (the test it was about to start ran
  in the new worker; its XML entry is an empty ``<testcase>``, skipped like SIGINT's).
* **The collection** (``--collected-out``): every test the run meant to run; those in neither the XML
  nor the log's crash were "not run" (restarts spent, or the run stopped).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

__all__ = ["CRASH_RE", "OUTCOMES", "POISON_MARK", "START_MARK", "file_results", "read_collected", "read_log",
           "read_xml", "render", "run_results"]

#: at most this many failed tests are named by :func:`render`
MAX_FAILURES = 25
#: the per-file counts, in the order they are shown
OUTCOMES = ("passed", "failed", "crashed", "errors", "skipped", "interrupted", "not_run")
#: what tools.gpu_check.crashproof writes to the log before each test, followed by the node id
START_MARK = "[crashproof start]"
#: what tools.gpu_check.crashproof's controller writes when a worker ended itself over a poisoned CUDA
#: context: ``POISON_MARK <nodeid>: worker restarted`` (or ``: worker ended, no restarts left ...``)
POISON_MARK = "[crashproof] CUDA context poisoned by"
#: xdist's report of a test whose worker died (dsession.py's handle_crashitem), in the XML and the log
CRASH_RE = re.compile(r"worker '(?P<worker>[^']+)' crashed while running (?P<q>['\"])(?P<nodeid>.+?)(?P=q)")
#: how many of the slowest tests :func:`run_results` names (for planning what fits in the next run)
SLOWEST = 8
_WORST = {"crashed": 5, "failed": 4, "errors": 3, "interrupted": 2, "skipped": 1, "passed": 0}
_WORD = {"PASSED": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped", "XFAIL": "skipped",
         "XPASS": "passed"}
# the node id ends at the first space: a worker's output may follow on the same line
_XDIST_LINE = re.compile(r"^\[(gw\d+)\] (?:\[\s*\d+%\] )?(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+)")
# a plain run's -v line; a skip or xfail adds its reason: "t.py::test_x SKIPPED (needs a CUDA GPU)   [ 71%]"
_PLAIN_LINE = re.compile(r"^(\S+::\S.*?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)(?: \(.*\))?\s+\[\s*\d+%\]\s*$")
_WORD_LINE = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)(?: \(.*\))?\s+\[\s*\d+%\]\s*$")
_NODE_DOWN = re.compile(r"^\[(gw\d+)\] node down:")
_NOTE_RES = (re.compile(r"maximum crashed workers reached: \d+"),
             re.compile(r"worker \S+ crashed and worker restarting disabled"),
             re.compile(r"!+ KeyboardInterrupt !+"), re.compile(r"^Timeout \(\d+:\d\d:\d\d\)!"))
_SECTION = re.compile(r"^([=!_-])\1{4,} \S")  # pytest's "=== FAILURES ===", "!!! KeyboardInterrupt !!!"
_CONTROLLER = re.compile(r"^(\[gw\d+\] |replacing crashed worker |maximum crashed workers reached)")


def _nodeid_key(nodeid: str) -> tuple[str, str]:
    """``(classname, name)`` as pytest's junitxml writes them for ``nodeid`` (xunit1 and xunit2)."""
    parts = nodeid.split("::")
    parts[0] = re.sub(r"\.py$", "", parts[0].replace("/", "."))
    return ".".join(parts[:-1]), parts[-1]


def _case_nodeid(file: str | None, classname: str, name: str, known: dict[tuple[str, str], str]) -> str:
    """The node id of a ``<testcase>``: looked up among the collected ids when given, else rebuilt
    from ``file`` (xunit1) and the classname's part after the module; without ``file`` (xunit2), the
    classname's dotted parts up to the first capitalised one (a class) are taken as the module path."""
    if (classname, name) in known:
        return known[(classname, name)]
    if file and not classname:  # a collection error: classname "", name the module
        return file
    if file:
        module = re.sub(r"\.py$", "", file.replace("/", "."))
        rest = classname[len(module) + 1:].split(".") if classname.startswith(module + ".") else []
        return "::".join([file, *rest, name])
    parts = classname.split(".")
    cut = next((i for i, p in enumerate(parts) if p[:1].isupper()), len(parts))
    return "::".join(["/".join(parts[:cut]) + ".py", *parts[cut:], name])


def read_collected(path: str | Path | None) -> list[str]:
    """The node ids in a ``--collected-out`` file, in collection order ([] when absent or unreadable)."""
    try:
        text = Path(path).read_text(encoding="utf-8") if path is not None else ""
    except OSError:
        return []
    return [ln.strip() for ln in text.splitlines() if ln.strip()]


def read_xml(xml_path: str | Path, collected: list[str] | None = None) -> list[dict[str, Any]]:
    """The testcases of a JUnit XML, in file order: ``{"nodeid", "outcome", "seconds", "message",
    "worker"}`` (``worker`` only for a crash). Raises ``OSError``/``ET.ParseError`` when unreadable."""
    known = {_nodeid_key(i): i for i in collected or []}
    cases = []
    for tc in ET.parse(xml_path).getroot().iter("testcase"):
        name = tc.get("name")
        if name is None:  # the empty testcase junitxml writes for a test cut off by SIGINT or re-queued (crashproof)
            continue
        outcome, message, worker = "passed", "", None
        nodeid = _case_nodeid(tc.get("file"), tc.get("classname", ""), name, known)
        for child in tc:
            crash = CRASH_RE.fullmatch((child.text or "").strip()) if child.tag == "error" else None
            kind = {"failure": "failed", "error": "errors", "skipped": "skipped"}.get(child.tag)
            if crash:
                kind, nodeid, worker = "crashed", crash.group("nodeid"), crash.group("worker")
            if kind and _WORST[kind] > _WORST[outcome]:
                outcome, message = kind, (child.get("message") or (child.text or "").strip())[:300]
        case: dict[str, Any] = {"nodeid": nodeid, "outcome": outcome, "seconds": float(tc.get("time") or 0.0),
                                "message": message}
        if worker:
            case["worker"] = worker
        cases.append(case)
    return cases


def read_log(log_path: str | Path) -> dict[str, Any]:
    """What a ``-v`` log says: ``starts`` (node ids in the order their tests began, from
    :data:`START_MARK`), ``segments`` (node id -> the lines from its last start to the next start or
    to xdist's ``node down``), ``results`` (node id -> outcome, from the result lines), ``crashes``
    (``{"nodeid", "worker"}`` from xdist's crash report), ``replaced`` (workers replaced), ``poisoned``
    (``{"nodeid", "restarted"}`` from :data:`POISON_MARK` lines) and ``notes`` (restarts spent,
    KeyboardInterrupt, faulthandler's timeout)."""
    lines = Path(log_path).read_text(encoding="utf-8", errors="replace").splitlines()
    out: dict[str, Any] = {"starts": [], "segments": {}, "results": {}, "crashes": [], "replaced": 0,
                           "poisoned": [], "notes": []}
    current: str | None = None
    seen_crash: set[str] = set()

    def result(nodeid: str, word: str) -> None:
        old = out["results"].get(nodeid, "passed")
        new = _WORD[word]
        out["results"][nodeid] = new if _WORST[new] >= _WORST[old] else old

    for raw in lines:
        before, mark, after = raw.partition(START_MARK)
        line = before if mark else raw
        m = _XDIST_LINE.match(line)
        p = _PLAIN_LINE.match(line)
        if m:
            result(m.group(3), m.group(2))
        elif p:
            result(p.group(1), p.group(2))
        elif _WORD_LINE.match(line) and current:
            result(current, line.split()[0])
        crash = CRASH_RE.fullmatch(line.strip())  # xdist's own line, not a test's output quoting it
        if crash and crash.group("nodeid") not in seen_crash:
            seen_crash.add(crash.group("nodeid"))
            out["crashes"].append({"nodeid": crash.group("nodeid"), "worker": crash.group("worker")})
        out["replaced"] += line.startswith("replacing crashed worker")
        if line.startswith(POISON_MARK + " "):
            nodeid, _, what = line[len(POISON_MARK) + 1:].rstrip().rpartition(": worker ")
            out["poisoned"].append({"nodeid": nodeid, "restarted": what == "restarted"})
        out["notes"] += [n.group().strip("! ") for n in (r.search(line) for r in _NOTE_RES) if n]
        if _SECTION.match(line) or _NODE_DOWN.match(line):  # pytest's closing sections; xdist's crash
            if current is not None and _NODE_DOWN.match(line):
                out["segments"][current].append(line)
            current = None
        elif current is not None and (line or not mark):
            out["segments"][current].append(line)
        if mark:
            current = after.strip()
            out["starts"].append(current)
            out["segments"][current] = []
    return out


def _condense_dump(lines: list[str], frames: int) -> list[str]:
    """faulthandler's dump cut to what says where it died: its first line (``Fatal Python error: ...``
    or ``Timeout (...)!``), the current thread's innermost ``frames`` frames; other threads' stacks and
    the extension-module list go. Lines outside a dump stay as they are."""
    out: list[str] = []
    state, shown = "", 0
    for ln in lines:
        if ln.startswith(("Fatal Python error:", "Timeout (")):
            out.append(ln)
            state = "dump"
        elif state and ln.startswith("Current thread"):
            out.append(ln)
            state, shown = "current", 0
        elif state and ln.startswith(("Thread 0x", "Extension modules:")):
            state = "dump"
        elif state and ln.startswith("  File "):
            shown += state == "current"
            if state == "current" and shown <= frames:
                out.append(ln)
            elif state == "current" and shown == frames + 1:
                out.append("  ...")
        elif state and not ln.strip():
            continue
        else:
            state = ""
            out.append(ln)
    return out


def _clean_output(nodeid: str, lines: list[str], keep: int, frames: int = 4) -> list[str]:
    """A test's segment of the log without xdist's own lines and pytest's echo of the node id, with
    faulthandler's dump condensed (:func:`_condense_dump`); the last ``keep`` lines."""
    echo = re.compile(r"^\S*::" + re.escape(nodeid.rsplit("::", 1)[-1]) + r"(?: |$)")
    kept = _condense_dump([echo.sub("", ln) for ln in lines if not _CONTROLLER.match(ln)], frames)
    while kept and not kept[-1].strip():
        kept.pop()
    while kept and not kept[0].strip():
        kept.pop(0)
    return kept[-keep:]


def run_results(xml_path: str | Path | None, log_path: str | Path | None = None,
                collected_path: str | Path | None = None, keep_lines: int = 40) -> dict[str, Any]:
    """Everything the summary shows about one pytest run: ``{"source": "xml"|"log"|"none", "files":
    {file: {outcome: count, ..., "seconds"}}, "failures": [{"nodeid", "outcome", "message"}] (failed
    and errors; the message is the XML's first 300 characters, empty from a log), "slowest":
    [(nodeid, seconds)] (:data:`SLOWEST` of them), "crashed": [{"nodeid", "worker", "output"}],
    "interrupted": [...], "not_run": [nodeid], "poisoned": [nodeid] (tests that poisoned their
    worker's CUDA context, each a worker restart), "notes": [str]}``. Files keep the collection's order
    (the command line's), else the XML's. Any of the three sources may be missing."""
    if keep_lines < 1:
        raise ValueError(f"keep_lines must be >= 1, got {keep_lines!r}")
    collected = read_collected(collected_path)
    notes: list[str] = []
    log = read_log(log_path) if log_path is not None and Path(log_path).is_file() else None
    cases: list[dict[str, Any]] = []
    source = "none"
    try:
        if xml_path is not None:
            cases, source = read_xml(xml_path, collected), "xml"
    except (OSError, ET.ParseError) as e:
        notes.append(f"JUnit XML unreadable ({type(e).__name__}: {str(e)[:120]})")
    if source == "none" and log is not None:
        cases = [{"nodeid": n, "outcome": o, "seconds": None} for n, o in log["results"].items()]
        source = "log"
    merged: dict[str, dict[str, Any]] = {}
    for c in cases:
        if c["nodeid"] not in merged:  # the first report of a test
            merged[c["nodeid"]] = dict(c)
            continue
        m = merged[c["nodeid"]]  # a second one (a teardown error after a pass): the worse outcome, both times
        if _WORST[c["outcome"]] > _WORST[m["outcome"]]:
            m.update(outcome=c["outcome"], worker=c.get("worker"), message=c.get("message", ""))
        if c["seconds"] is not None:
            m["seconds"] = (m["seconds"] or 0.0) + c["seconds"]
    if log is not None:
        for c in log["crashes"]:  # xdist's crash sentence beats its "FAILED" line for the same test
            m = merged.setdefault(c["nodeid"], {"nodeid": c["nodeid"], "seconds": None})
            m.update(outcome="crashed", worker=c["worker"])
        notes += [n for i, n in enumerate(log["notes"]) if n not in log["notes"][:i]]
        for p in log["poisoned"]:
            what = "worker restarted" if p["restarted"] else "worker ended, no restarts left"
            notes.append(f"CUDA context poisoned by {p['nodeid']} (counted failed): {what}")
        crashed_replaced = log["replaced"] - sum(p["restarted"] for p in log["poisoned"])
        if crashed_replaced > 0:
            notes.append(f"{crashed_replaced} crashed worker(s) replaced")
        last = log["starts"][-1] if log["starts"] else None
        if last is not None and last not in merged:  # began, never reported: stopped, or the one process died
            stopped = any("KeyboardInterrupt" in n or n.startswith("Timeout") for n in log["notes"])
            merged[last] = {"nodeid": last, "outcome": "interrupted" if stopped else "crashed", "seconds": None}
    not_run = [i for i in collected if i not in merged]
    if not collected and any("maximum crashed" in n or "KeyboardInterrupt" in n for n in notes):
        notes.append("tests not reached are not named (no --collected-out list)")
    order = [i.split("::")[0] for i in collected] + [n.split("::")[0] for n in merged]
    files: dict[str, dict[str, Any]] = {f: {**dict.fromkeys(OUTCOMES, 0), "seconds": None}
                                        for f in dict.fromkeys(order)}
    for c in merged.values():
        f = files[c["nodeid"].split("::")[0]]
        f[c["outcome"]] += 1
        if c["seconds"] is not None:
            f["seconds"] = round((f["seconds"] or 0.0) + c["seconds"], 3)
    for n in not_run:
        files[n.split("::")[0]]["not_run"] += 1

    def detail(c: dict[str, Any]) -> dict[str, Any]:
        seg = log["segments"].get(c["nodeid"], []) if log is not None else []
        return {"nodeid": c["nodeid"], "worker": c.get("worker"), "output": _clean_output(c["nodeid"], seg, keep_lines)}

    timed = sorted((c for c in merged.values() if c["seconds"]), key=lambda c: -c["seconds"])
    return {"source": source, "files": files, "not_run": not_run, "notes": notes,
            "poisoned": [p["nodeid"] for p in log["poisoned"]] if log is not None else [],
            "failures": [{"nodeid": c["nodeid"], "outcome": c["outcome"], "message": c.get("message", "")}
                         for c in merged.values() if c["outcome"] in ("failed", "errors")],
            "slowest": [(c["nodeid"], c["seconds"]) for c in timed[:SLOWEST]],
            "crashed": [detail(c) for c in merged.values() if c["outcome"] == "crashed"],
            "interrupted": [detail(c) for c in merged.values() if c["outcome"] == "interrupted"]}


def file_results(xml_path: str | Path | None, log_path: str | Path | None = None,
                 collected_path: str | Path | None = None) -> dict[str, dict[str, Any]]:
    """Per test file: ``{outcome: count for OUTCOMES, "seconds": sum of the XML's times or None}``."""
    return run_results(xml_path, log_path, collected_path)["files"]


def render(results: dict[str, Any], output_lines: int = 14) -> list[str]:
    """The summary's lines for :func:`run_results`' dict: totals, one row per file, each crashed or
    interrupted test by name with its last ``output_lines`` lines of output, the tests not run, notes."""
    files = results.get("files", {})
    cols = [o for o in OUTCOMES if o != "interrupted" or any(f[o] for f in files.values())]
    tot = {o: sum(f[o] for f in files.values()) for o in cols}
    counts = ", ".join(f"{tot[o]} {o.replace('_', ' ')}" for o in cols)
    lines = [f"tests: {counts} (from the {results.get('source')})"]
    width = max([len(f) for f in files] + [4])
    lines.append(f"  {'file':<{width}} " + " ".join(f"{o.replace('_', ' '):>11}" for o in cols) + f" {'seconds':>8}")
    for name, f in files.items():
        secs = "-" if f["seconds"] is None else f"{f['seconds']:.1f}"
        lines.append(f"  {name:<{width}} " + " ".join(f"{f[o]:>11}" for o in cols) + f" {secs:>8}")
    for kind in ("crashed", "interrupted"):
        for c in results.get(kind, []):
            who = f" (worker {c['worker']})" if c.get("worker") else ""
            out = c["output"][-output_lines:]
            lines.append(f"{kind}: {c['nodeid']}{who}; " + ("its last output:" if out else "no output in the log"))
            lines += [f"    | {ln}" for ln in out]
    if results.get("slowest"):
        lines.append("slowest: " + ", ".join(f"{n} {sec:.1f} s" for n, sec in results["slowest"]))
    for f in results.get("failures", [])[:MAX_FAILURES]:
        first = f["message"].strip().splitlines()[0][:160] if f["message"].strip() else ""
        lines.append(f"{f['outcome'].upper()} {f['nodeid']}: {first}")
    if len(results.get("failures", [])) > MAX_FAILURES:
        lines.append(f"... and {len(results['failures']) - MAX_FAILURES} more failures (see the XML / log)")
    if results.get("not_run"):
        nr = results["not_run"]
        lines.append(f"not run: {len(nr)} test(s): " + ", ".join(nr[:5]) + (" ..." if len(nr) > 5 else ""))
    lines += [f"note: {n}" for n in results.get("notes", [])]
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m tools.gpu_check.pytest_results XML [--log LOG] [--collected FILE] [--json OUT]``."""
    ap = argparse.ArgumentParser(prog="python -m tools.gpu_check.pytest_results", description=__doc__.split("\n")[0])
    ap.add_argument("xml", help="the run's JUnit XML (need not exist)")
    ap.add_argument("--log", help="the run's -v log")
    ap.add_argument("--collected", help="the run's --collected-out file")
    ap.add_argument("--json", help="write the results there as JSON")
    ap.add_argument("--lines", type=int, default=14, help="lines of a crashed test's output to show")
    ns = ap.parse_args(argv)
    res = run_results(ns.xml, ns.log, ns.collected)
    print("\n".join(render(res, ns.lines)))
    if ns.json:
        Path(ns.json).write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
