"""The summary of one ``scripts/gpu_check.sh`` run, from the files its stages left in the output folder.

``python -m tools.gpu_check.summary OUTDIR [--write]`` (what the script runs from its EXIT trap; from
the repository root). Standard library only -- it imports neither torch nor mpkern, so the summary is
printed even where they cannot be imported. It reads, each if present (:mod:`.read`):

* ``plan.tsv`` (the stages the script meant to run: name, limit s, what) and ``stages.tsv`` (what
  each stage did: name, limit s, exit status, seconds, status word);
* ``precheck.json``, ``device.json`` (the measured copy bandwidth, the CUDA build checks);
* the benchmark stages' JSON (``unscale.json``, ``adamw_*.json``, ``matmul*.json``, ``release.json``):
  raw measurements only -- bytes per param from :mod:`mpkern.bytemodel` (written by the stage, with
  the name of the count it took), parameter counts, kernel / wall / CUDA-graph times in ms per
  call, FLOP counts; every rate is computed by :mod:`.tables`;
* ``tests_gpu.xml`` (pytest's JUnit XML, ``junit_family=xunit1``), its ``-v`` log, the collected test
  ids and ``tests_gpu.list`` (the files the stage meant to run): :mod:`.pytest_results`;
* the whole-run stages' files (``e2e_*.json``, ``compare/results.md``, ``matmul_routes.json``,
  ``sanitizer.json``): :mod:`.sections_runs`.

It opens with what failed and where to look (:mod:`.verdict`).

A missing, failed or interrupted stage is reported as such ("not run", "failed rc=1: ...",
"interrupted after 3 of 16 rows"); one damaged file costs its own section (:mod:`.sections`), never
the summary.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from .read import read_plan, read_stages, stage_files
from .sections import (
    MATMUL_STAGES,
    MEMORY_STAGES,
    copy_bandwidth_lines,
    machine_lines,
    matmul_section,
    memory_section,
    release_section,
    stages_section,
    tests_section,
)
from .sections_runs import compare_section, e2e_section, matmul_routes_section, sanitizer_section
from .verdict import verdict_lines

__all__ = ["main", "summarize"]

def _guarded(what: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)``, or -- if it raises on files it did not expect -- one line saying so, so that one
    damaged file costs its own section, never the summary."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 -- the summary must be printed whatever the stages left
        return [f"--- {what}: could not be summarised ({type(e).__name__}: {str(e)[:120]}) ---"]


#: the sections after the stage list: (title, function, the stages whose files it reads) -- a section
#: is printed when one of its stages was planned (plan.tsv) or left a file (a stage run by hand)
SECTIONS: tuple[tuple[str, Any, tuple[str, ...]], ...] = (
    ("memory-bound kernels", memory_section, (*MEMORY_STAGES, "adamw")),  # "adamw": any adamw_*.json
    ("end to end", e2e_section, ("e2e", "e2e_gpt2", "e2e_batch", "e2e_llama7b")),
    ("compare", compare_section, ("compare",)),
    ("matmul routes", matmul_routes_section, ("matmul_routes",)),
    ("matmul", matmul_section, MATMUL_STAGES),
    ("release", release_section, ("release",)),
    ("memory checker", sanitizer_section, ("sanitizer",)),
)


def _present(out: str, planned: set[str], names: tuple[str, ...]) -> bool:
    """Whether a section has something to say: one of its stages was planned or left a file
    (``NAME.json``, ``NAME_*.json``, or a folder ``NAME``)."""
    return any(n in planned or stage_files(out, n) or os.path.isdir(os.path.join(out, n)) for n in names)


def summarize(out: str) -> str:
    """The text of ``summary.txt`` for the output folder ``out``."""
    stages = read_stages(out)
    planned = {p[0] for p in read_plan(out)}
    lines = ["=" * 30 + " mpkern gpu_check summary " + "=" * 30]
    lines += _guarded("what failed", verdict_lines, out, stages)
    lines += [""] + _guarded("machine", machine_lines, out)
    lines += [""] + _guarded("stages", stages_section, out, stages)
    if "tests_gpu" in planned or os.path.exists(os.path.join(out, "tests_gpu.xml")):
        lines += [""] + _guarded("tests_gpu", tests_section, out, stages, "tests_gpu")
    got = _guarded("copy bandwidth", copy_bandwidth_lines, out)
    copy_gbps, bw_lines = got if isinstance(got, tuple) else (None, got)
    lines += [""] + bw_lines
    for title, fn, names in SECTIONS:
        if _present(out, planned, names):
            args = (out, stages, copy_gbps) if fn is memory_section else (out, stages)
            lines += [""] + _guarded(title, fn, *args)
    lines.append("=" * 86)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m tools.gpu_check.summary OUTDIR [--write]``: print the summary (``--write``: also to
    ``OUTDIR/summary.txt``). Exit status 0, or 2 on a bad command line or a missing folder."""
    args = list(sys.argv[1:] if argv is None else argv)
    write = "--write" in args
    args = [a for a in args if a != "--write"]
    if len(args) != 1:
        print("usage: python -m tools.gpu_check.summary OUTDIR [--write]", file=sys.stderr)
        return 2
    out = args[0]
    if not os.path.isdir(out):
        print(f"tools.gpu_check.summary: {out!r} is not a folder", file=sys.stderr)
        return 2
    text = summarize(out)
    if write:
        with open(os.path.join(out, "summary.txt"), "w") as f:
            f.write(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
