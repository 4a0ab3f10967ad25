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
* ``tests_*.xml`` (pytest's JUnit XML, ``junit_family=xunit1``) or, when pytest was killed before
  writing it, the ``-v`` log ``tests_*.log``, and ``tests_*.list`` (the files that stage meant to run).

A missing, failed or interrupted stage is reported as such ("not run", "failed rc=1: ...",
"interrupted after 3 of 16 rows"); one damaged file costs its own section (:mod:`.sections`), never
the summary.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from .read import read_stages
from .sections import (
    copy_bandwidth_lines,
    machine_lines,
    matmul_section,
    memory_section,
    release_section,
    stages_section,
    tests_section,
)

__all__ = ["main", "summarize"]

def _guarded(what: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)``, or -- if it raises on files it did not expect -- one line saying so, so that one
    damaged file costs its own section, never the summary."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 -- the summary must be printed whatever the stages left
        return [f"--- {what}: could not be summarised ({type(e).__name__}: {str(e)[:120]}) ---"]


def summarize(out: str) -> str:
    """The text of ``summary.txt`` for the output folder ``out``."""
    stages = read_stages(out)
    lines = ["=" * 30 + " mpkern gpu_check summary " + "=" * 30]
    lines += _guarded("machine", machine_lines, out)
    lines += [""] + _guarded("stages", stages_section, out, stages)
    got = _guarded("copy bandwidth", copy_bandwidth_lines, out)
    copy_gbps, bw_lines = got if isinstance(got, tuple) else (None, got)
    lines += [""] + bw_lines
    lines += [""] + _guarded("memory-bound kernels", memory_section, out, stages, copy_gbps)
    lines += [""] + _guarded("matmul", matmul_section, out, stages)
    lines += [""] + _guarded("release", release_section, out, stages)
    for stage in ("tests_gpu", "tests_rest"):
        lines += [""] + _guarded(stage, tests_section, out, stages, stage)
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
