"""The summary's sections of the stages that run whole things -- standard library only: the
end-to-end trainings (:mod:`.e2e_table`), ``mpkern compare`` on the GPU, the GEMM routes and the
memory checker (:mod:`.sanitizer_table`). Each returns its lines, or one line saying the stage did
not run in this profile.
"""

from __future__ import annotations

import os
from typing import Any

from . import e2e_table, sanitizer_table
from .read import load_json, stage_files, stage_rows, stage_word
from .tables import fmt, text_table

__all__ = ["compare_section", "e2e_section", "matmul_routes_section", "sanitizer_section"]

#: the lines of compare's results.md shown in the summary (the rest is in the file)
COMPARE_LINES = 40


def _absent(title: str, stage: str, stages: dict[str, dict[str, Any]], problem: str) -> list[str]:
    return [f"--- {title}: {problem} (stage: {stage_word(stages, stage)}) ---"]


def e2e_section(out: str, stages: dict[str, dict[str, Any]]) -> list[str]:
    """The end-to-end tables, one per ``e2e_*.json`` stage file (the GPT-2 challenge, its batch
    scaling, the 7B sentence), each with how its stage ended."""
    names = stage_files(out, "e2e")
    if not names:
        return ["--- end to end (GPT-2 challenge, 7B on one card): no stage file in this run ---"]
    lines: list[str] = []
    for name in names:
        data, problem = load_json(os.path.join(out, name))
        stage = name.removesuffix(".json")
        if data is None:
            lines += _absent(f"end to end, {name}", stage, stages, problem)
            continue
        head = f"--- end to end, {name}: {data.get('status', '?')}, {len(stage_rows(data))} rows"
        if data.get("error"):
            head += f"; error: {str(data['error'])[:160]}"
        lines.append(head + " ---")
        lines += [f"  {ln}" for ln in e2e_table.render(data).splitlines()]
        lines.append("")
    return lines[:-1]


def sanitizer_section(out: str, stages: dict[str, dict[str, Any]]) -> list[str]:
    """The memory checker: one line per tool run, the findings, or why it did not run."""
    data, problem = load_json(os.path.join(out, "sanitizer.json"))
    if data is None:
        return _absent("memory checker (compute-sanitizer)", "sanitizer", stages, problem)
    return ["--- memory checker (compute-sanitizer) ---", *(f"  {ln}" for ln in sanitizer_table.lines(data))]


def matmul_routes_section(out: str, stages: dict[str, dict[str, Any]]) -> list[str]:
    """mpkern.matmul's routes beside torch.matmul (cuBLAS): ms, TFLOP/s and the speed over cuBLAS per
    row (the rows of :func:`mpkern.bench.matmul.bench_matmul`; the default's row names the route it took)."""
    data, problem = load_json(os.path.join(out, "matmul_routes.json"))
    if data is None:
        return _absent("matmul routes vs cuBLAS", "matmul_routes", stages, problem)
    rows = stage_rows(data)
    cells = [[str(r.get("method", "?")), fmt(r.get("ms")), fmt(r.get("rate")),
              "-" if r.get("mpkern_speedup") is None else f"{r['mpkern_speedup']:.2f}x"] for r in rows]
    lines = [f"--- matmul routes vs cuBLAS (torch.matmul): {data.get('status', '?')}, {len(rows)} rows ---"]
    if cells:
        lines += [f"  {ln}" for ln in text_table(["GEMM", "ms", "TFLOP/s", "vs peer"], cells)]
    slower = [r for r in rows if "default" in str(r.get("method")) and (r.get("mpkern_speedup") or 1.0) < 0.95]
    if slower:
        lines.append(f"  the default route is slower than the platform GEMM (< 0.95x) in {len(slower)} rows")
    return lines


def compare_section(out: str, stages: dict[str, dict[str, Any]]) -> list[str]:
    """``mpkern compare --device cuda``: the head of its report (``compare/results.md``)."""
    path = os.path.join(out, "compare", "results.md")
    try:
        with open(path, errors="replace") as f:
            text = f.read().splitlines()
    except OSError:
        return _absent("mpkern compare --device cuda", "compare", stages, "no compare/results.md")
    lines = [f"--- mpkern compare --device cuda (stage: {stage_word(stages, 'compare')}; "
             f"the whole report: compare/results.md) ---"]
    lines += [f"  {ln}" for ln in text[:COMPARE_LINES]]
    if len(text) > COMPARE_LINES:
        lines.append(f"  ... {len(text) - COMPARE_LINES} more lines in compare/results.md")
    return lines
