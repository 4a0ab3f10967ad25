"""Reading what a ``scripts/gpu_check.sh`` run left in its output folder -- standard library only.

The script's own records (``plan.tsv``: the stages it meant to run; ``stages.tsv``: what each did),
the stages' JSON files (:func:`load_json`, :func:`stage_rows`), their logs, and pytest's results per
test file (:func:`test_counts`: the JUnit XML, ``junit_family=xunit1``, or -- when pytest was killed
before writing it -- the ``-v`` log, against the ``tests_*.list`` of files the stage meant to run).
Nothing here raises on a missing or damaged file: it says "not run" or "unreadable", or returns
nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import xml.etree.ElementTree as ET
from typing import Any

__all__ = ["OUTCOMES", "load_json", "log_tail", "parse_junit", "parse_verbose_log", "read_list", "read_plan",
           "read_stages", "slowest_tests", "stage_files", "stage_rows", "stage_word", "test_counts"]

OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed")


def load_json(path: str) -> tuple[dict[str, Any] | None, str]:
    """``(data, problem)``: the JSON object in ``path``, or None and why ("not run" when absent)."""
    if not os.path.exists(path):
        return None, "not run"
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        return None, f"unreadable ({type(e).__name__}: {str(e)[:80]})"
    if not isinstance(data, dict):
        return None, "unreadable (not a JSON object)"
    return data, ""


def stage_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The row dicts of a stage file (anything else in ``rows`` is left out)."""
    rows = data.get("rows")
    return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []


def _read_tsv(path: str, ncols: int) -> list[list[str]]:
    """The lines of a tab-separated file with at least ``ncols`` cells (first ``ncols``; ``#`` lines skipped)."""
    rows = []
    try:
        with open(path) as f:
            for line in f:
                cells = line.rstrip("\n").split("\t")
                if len(cells) >= ncols and cells[0] and not cells[0].startswith("#"):
                    rows.append(cells[:ncols])
    except OSError:
        pass
    return rows


def read_plan(out: str) -> list[tuple[str, int, str]]:
    """The planned stages ``(name, limit s, what)`` from ``plan.tsv``."""
    plan = []
    for name, limit, what in _read_tsv(os.path.join(out, "plan.tsv"), 3):
        try:
            plan.append((name, int(limit), what))
        except ValueError:
            continue
    return plan


def read_stages(out: str) -> dict[str, dict[str, Any]]:
    """What each stage did, from ``stages.tsv``: ``{name: {limit, rc, seconds, status}}`` (last line wins)."""
    res: dict[str, dict[str, Any]] = {}
    for name, limit, rc, secs, status in _read_tsv(os.path.join(out, "stages.tsv"), 5):
        def num(x: str) -> int | None:
            try:
                return int(x)
            except ValueError:
                return None
        res[name] = {"limit": num(limit), "rc": num(rc), "seconds": num(secs), "status": status}
    return res


def stage_files(out: str, prefix: str) -> list[str]:
    """The JSON files of ``out`` named ``PREFIX.json`` or ``PREFIX_*.json``, sorted."""
    try:
        names = sorted(os.listdir(out))
    except OSError:
        return []
    return [n for n in names if n.endswith(".json") and (n == f"{prefix}.json" or n.startswith(f"{prefix}_"))]


def log_tail(path: str, n: int = 3) -> list[str]:
    """The last ``n`` non-empty lines of a stage log (shortened), or nothing if there is none."""
    try:
        with open(path, errors="replace") as f:
            tail = [ln.rstrip() for ln in f.readlines()[-200:] if ln.strip()]
    except OSError:
        return []
    return [t[:150] for t in tail[-n:]]


def stage_word(stages: dict[str, dict[str, Any]], name: str) -> str:
    """"ok", "TIMEOUT", "failed rc=N", "not run (...)" for a stage name."""
    st = stages.get(name)
    if st is None:
        return "(this summary)" if name == "summary" else "not run"
    return st["status"]


# ---- tests -----------------------------------------------------------------------------------------
def _file_of(classname: str, file_attr: str | None) -> str:
    """The test file of a JUnit testcase: its ``file`` attribute (xunit1), else from ``classname``
    (``tests.test_x`` or ``tests.test_x.TestClass`` -> ``tests/test_x.py``)."""
    if file_attr:
        return file_attr
    parts = classname.split(".")
    for i, p in enumerate(parts):
        if p.startswith("test_"):
            return "/".join(parts[: i + 1]) + ".py"
    return classname or "?"


def parse_junit(path: str) -> tuple[dict[str, dict[str, Any]], list[tuple[str, str]]] | None:
    """Per-file counts from pytest's JUnit XML: ``({file: {passed, failed, error, skipped, xfailed,
    seconds}}, [(test id, first line of the failure), ...])``; None if the file is absent or damaged."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    files: dict[str, dict[str, Any]] = {}
    failures: list[tuple[str, str]] = []
    for tc in root.iter("testcase"):
        f = _file_of(tc.get("classname", ""), tc.get("file"))
        c = files.setdefault(f, dict.fromkeys(OUTCOMES, 0) | {"seconds": 0.0})
        with contextlib.suppress(ValueError):  # a malformed time counts as 0 s
            c["seconds"] += float(tc.get("time", 0) or 0)
        kids = {child.tag: child for child in tc}
        if "failure" in kids or "error" in kids:
            kind = "failed" if "failure" in kids else "error"
            el = kids.get("failure", kids.get("error"))
            msg = (el.get("message") or (el.text or "")).strip().splitlines()
            failures.append((f"{f}::{tc.get('name', '?')}", (msg[0] if msg else "")[:160]))
        elif "skipped" in kids:
            kind = "xfailed" if kids["skipped"].get("type") == "pytest.xfail" else "skipped"
        else:
            kind = "passed"
        c[kind] += 1
    return files, failures


def slowest_tests(path: str, n: int = 8) -> list[tuple[str, float]]:
    """The ``n`` slowest tests of a JUnit XML file, ``(file::name, seconds)``, slowest first (for
    planning what fits in the next run); empty if the file is absent or damaged."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return []
    times = []
    for tc in root.iter("testcase"):
        try:
            t = float(tc.get("time", 0) or 0)
        except ValueError:
            continue
        times.append((f"{_file_of(tc.get('classname', ''), tc.get('file'))}::{tc.get('name', '?')}", t))
    return sorted(times, key=lambda x: -x[1])[:n]


_VERBOSE = re.compile(r"^(?P<file>\S+?\.py)::(?P<test>.+?) (?P<outcome>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_OUTCOME_WORD = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "error",
                 "SKIPPED": "skipped", "XFAIL": "xfailed"}
_PRIORITY = {"failed": 4, "error": 3, "xfailed": 2, "skipped": 1, "passed": 0}


def parse_verbose_log(path: str) -> tuple[dict[str, dict[str, Any]], list[tuple[str, str]]] | None:
    """Per-file counts from a ``pytest -v`` log (the lines ``file.py::test OUTCOME``), for a run
    killed before it wrote its XML; a test reported twice (a teardown error after a pass) counts
    once, by its worse outcome. ``seconds`` is unknown there (None). None if the log is absent."""
    try:
        with open(path, errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return None
    outcome: dict[tuple[str, str], str] = {}
    for line in lines:
        m = _VERBOSE.match(line.strip())
        if not m:
            continue
        key, word = (m["file"], m["test"]), _OUTCOME_WORD[m["outcome"]]
        if key not in outcome or _PRIORITY[word] > _PRIORITY[outcome[key]]:
            outcome[key] = word
    files: dict[str, dict[str, Any]] = {}
    failures = []
    for (f, t), word in outcome.items():
        c = files.setdefault(f, dict.fromkeys(OUTCOMES, 0) | {"seconds": None})
        c[word] += 1
        if word in ("failed", "error"):
            failures.append((f"{f}::{t}", word))
    return files, failures


def read_list(path: str) -> list[str]:
    """The non-empty, non-``#`` lines of a file (``tests_*.list``, ``tests_*.k``); nothing if it is absent."""
    try:
        with open(path) as f:
            return [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]
    except OSError:
        return []


def test_counts(out: str, stage: str) -> dict[str, Any]:
    """One pytest stage's results: ``{"source": "junit"|"log"|None, "files": {file: counts + status},
    "failures": [...], "planned": [...]}``; files planned but absent from the results are
    ``"not run"`` (not reached before the stage ended, or every test deselected)."""
    planned = read_list(os.path.join(out, f"{stage}.list"))
    parsed, source = parse_junit(os.path.join(out, f"{stage}.xml")), "junit"
    if parsed is None:
        parsed, source = parse_verbose_log(os.path.join(out, f"{stage}.log")), "log"
    if parsed is None:
        parsed, source = ({}, []), None
    files, failures = parsed
    for f in files.values():
        f["status"] = "ran"
    for f in planned:
        files.setdefault(f, dict.fromkeys(OUTCOMES, 0) | {"seconds": None, "status": "not run"})
    order = {f: i for i, f in enumerate(planned)}
    files = dict(sorted(files.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])))
    return {"source": source, "files": files, "failures": failures, "planned": planned}
