"""The sanitizer stage's JSON as summary lines -- standard library only, pure.

``lines(data)`` for ``sanitizer.json`` (:mod:`.sanitizer`): one line per tool run --
``memcheck: 0 errors over 214 of 214 calls (5 kernels) in 12 s`` -- then its findings, one line
each (kernel, the call that caused it, the error kind, how many, the report's first line); or why
it did not run (``compute-sanitizer not found (looked in ...)``, cut off by its limit, no GPU).
``python -m tools.gpu_check.sanitizer_table OUT/sanitizer.json`` prints them.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["finding_line", "lines", "run_line"]

#: findings listed per tool run; the rest are counted
MAX_FINDINGS = 12


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _calls(row: Mapping[str, Any]) -> str:
    done, planned = row.get("calls_done"), row.get("calls_planned")
    if done is None:
        return "the workload"
    return f"{done} of {planned} calls" if planned is not None else _plural(int(done), "call")


def run_line(row: Mapping[str, Any]) -> str:
    """One tool run: ``racecheck: 0 hazards over 39 of 39 calls (3 kernels) in 8 s``."""
    tool, status = row.get("tool", "?"), row.get("status", "?")
    noun = "hazard" if tool == "racecheck" else "error"
    kernels = row.get("kernels") or []
    what = f"{_calls(row)} ({_plural(len(kernels), 'kernel')})" if kernels else _calls(row)
    secs = f"{float(row.get('seconds') or 0):.0f} s"
    errors, warnings = row.get("errors"), row.get("warnings")
    counted = _plural(int(errors if errors is not None else row.get("findings") or 0), noun)
    if warnings:
        counted += f" + {_plural(int(warnings), 'warning')}"
    if status == "skipped":
        return f"{tool}: skipped ({'; '.join(row.get('notes') or []) or 'nothing to check'})"
    if status == "timeout":
        return f"{tool}: CUT OFF by its limit after {what} in {secs}: {counted} so far (no summary)"
    if status == "no gpu":
        return f"{tool}: the workload found no CUDA GPU"
    if status == "failed":
        why = "; ".join((row.get("failed_calls") or [])[:2] + (row.get("notes") or [])[:2])
        summary = f"{counted} in the summary" if errors is not None else "no summary from the tool"
        return (f"{tool}: FAILED (exit {row.get('exit_code')}) after {what} in {secs}: {summary}"
                + (f" -- {why}" if why else ""))
    mark = "" if status == "clean" else " -- " + status.upper()
    return f"{tool}: {counted} over {what} in {secs}{mark}"


def finding_line(f: Mapping[str, Any]) -> str:
    """One finding: ``  adamw_kernel in "adamw p=bf16 ... view=p@1 g@3": Invalid __global__ read
    (out of bounds) x12 -- Access at 0x... is out of bounds``."""
    count = int(f.get("count") or 0)
    hazards = int(f.get("hazards") or 0)
    times = f"x{count}" + (f" ({hazards} hazards)" if hazards > count else "")
    first = f.get("first_lines") or []
    detail = next((ln for want in (("Access ", "Address "), ("and ",), ("at ",)) for ln in first[1:]
                   if ln.startswith(want)), "")
    detail = f" -- {detail[:140]}" if detail else ""
    return f"  {f.get('kernel', '?')} in \"{f.get('label', '?')}\": {f.get('kind', '?')} {times}{detail}"


def lines(data: Mapping[str, Any]) -> list[str]:
    """``sanitizer.json`` -> the summary's lines (see the module doc)."""
    if data.get("note") and not data.get("rows"):
        return [f"sanitizer: {data['note']}"]
    out = []
    if data.get("status") not in ("done", None):
        out.append(f"sanitizer: stage {data['status']}" + (f" ({data['error']})" if data.get("error") else ""))
    findings = list(data.get("findings") or [])
    for row in data.get("rows") or []:
        out.append(run_line(row))
        mine = [f for f in findings if f.get("tool") == row.get("tool")]
        out += [finding_line(f) for f in mine[:MAX_FINDINGS]]
        if len(mine) > MAX_FINDINGS:
            out.append(f"  ... and {len(mine) - MAX_FINDINGS} more findings (see {row.get('log', 'the log')})")
    if not out:
        out.append(f"sanitizer: no tool run recorded (stage {data.get('status', '?')})")
    return out


def main(argv: list[str] | None = None) -> int:
    """Print the lines of the ``sanitizer.json`` named by the one argument."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m tools.gpu_check.sanitizer_table OUT/sanitizer.json", file=sys.stderr)
        return 2
    with open(args[0]) as f:
        print("\n".join(lines(json.load(f))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
