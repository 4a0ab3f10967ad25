"""Reading what a ``scripts/gpu_check.sh`` run left in its output folder -- standard library only.

The script's own records (``plan.tsv``: the stages it meant to run; ``stages.tsv``: what each did),
the stages' JSON files (:func:`load_json`, :func:`stage_rows`) and their logs; pytest's results are
read by :mod:`.pytest_results`.
Nothing here raises on a missing or damaged file: it says "not run" or "unreadable", or returns
nothing.
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["load_json", "log_tail", "read_list", "read_plan", "read_stages", "stage_files", "stage_rows", "stage_word"]


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


def read_list(path: str) -> list[str]:
    """The non-empty, non-``#`` lines of a file (``tests_*.list``, ``tests_*.k``); nothing if it is absent."""
    try:
        with open(path) as f:
            return [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]
    except OSError:
        return []
