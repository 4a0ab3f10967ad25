"""The top of the GPU check's summary: what failed and where to look -- standard library only.

One line per problem, each naming the file to open: a stage that did not end ok (its log, and the
last line it wrote), a test that failed or crashed (the JUnit XML / log of its stage), a benchmark
stage file that says ``failed``/``interrupted``, a row that recorded an error, a memory-checker finding.
"""

from __future__ import annotations

import os
from typing import Any

from .pytest_results import run_results
from .read import load_json, log_tail, read_list, read_plan, stage_rows

__all__ = ["problems", "verdict_lines"]

#: the pytest stages: their results are read per test, not per stage file
TEST_STAGES = ("tests_gpu",)
#: at most this many lines per kind of problem (the rest are counted)
MAX_LINES = 12


def _stage_problems(out: str, stages: dict[str, dict[str, Any]]) -> list[str]:
    lines = []
    planned = [p[0] for p in read_plan(out)]
    for name in planned + [s for s in stages if s not in planned]:
        st = stages.get(name)
        if name == "summary" or st is None or str(st["status"]).startswith("ok"):
            continue
        tail = log_tail(os.path.join(out, f"{name}.log"), 1)
        where = f"{name}.log" + (f" (last line: {tail[0]})" if tail else "")
        lines.append(f"stage {name}: {st['status']} -> {where}")
    return lines


def _test_problems(out: str) -> list[str]:
    lines = []
    for stage in TEST_STAGES:
        if not os.path.exists(os.path.join(out, f"{stage}.list")):
            continue
        res = run_results(os.path.join(out, f"{stage}.xml"), os.path.join(out, f"{stage}.log"),
                          os.path.join(out, f"{stage}.collected"))
        src = f"{stage}.xml" if res["source"] == "xml" else f"{stage}.log"
        lines += [f"test {c['nodeid']} CRASHED -> its last output in the {stage} section and {stage}.log"
                  for c in res["crashed"]]
        for f in res["failures"]:
            first = f["message"].strip().splitlines()[0][:140] if f["message"].strip() else f["outcome"]
            lines.append(f"test {f['nodeid']}: {first} -> {src}")
        never = [f for f in read_list(os.path.join(out, f"{stage}.list")) if f not in res["files"]]
        if res["not_run"] or never:
            lines.append(f"{stage}: {len(res['not_run'])} tests not run, {len(never)} planned files never collected "
                         f"-> the {stage} section")
    return lines


def _file_problems(out: str) -> list[str]:
    lines = []
    try:
        names = sorted(n for n in os.listdir(out) if n.endswith(".json"))
    except OSError:
        return []
    for fname in names:
        data, _ = load_json(os.path.join(out, fname))
        if not isinstance(data, dict) or "stage" not in data:
            continue
        status = data.get("status")
        if status in ("failed", "interrupted"):
            lines.append(f"{fname}: {status}: {str(data.get('error') or '')[:140]} -> {data['stage']}.log")
        bad = [r for r in stage_rows(data) if r.get("error") and r.get("status") not in ("oom",)]
        for r in bad[:3]:
            what = r.get("recipe") or r.get("mode") or r.get("method") or r.get("shape") or r.get("kernel") or "row"
            lines.append(f"{fname}: {what}: {str(r['error'])[:140]}")
        if len(bad) > 3:
            lines.append(f"{fname}: ... and {len(bad) - 3} more rows with an error")
        for r in stage_rows(data):  # the memory checker's rows count the errors it found
            if isinstance(r.get("errors"), int) and r["errors"] > 0:
                lines.append(f"{fname}: {r.get('tool', '?')} found {r['errors']} errors -> the sanitizer section "
                             f"and {r.get('log', data['stage'] + '.log')}")
    return lines


def problems(out: str, stages: dict[str, dict[str, Any]]) -> list[str]:
    """Every problem of the run in ``out``, most basic first: stages, then tests, then stage files."""
    found = []
    for kind in (_stage_problems(out, stages), _test_problems(out), _file_problems(out)):
        found += kind[:MAX_LINES]
        if len(kind) > MAX_LINES:
            found.append(f"... and {len(kind) - MAX_LINES} more of the same kind")
    return found


def verdict_lines(out: str, stages: dict[str, dict[str, Any]]) -> list[str]:
    """The summary's first section: "nothing failed" or the list of :func:`problems`."""
    found = problems(out, stages)
    if not stages:
        return ["--- what failed and where to look: no stage ran (no stages.tsv in this folder) ---", *found]
    if not found:
        return ["--- what failed and where to look: nothing (every stage ended ok, no test failed) ---"]
    return [f"--- what failed and where to look ({len(found)}; files under {out}) ---",
            *(f"  * {p}" for p in found)]
