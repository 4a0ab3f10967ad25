"""The summary of one ``scripts/gpu_check.sh`` run, from the files its stages left in the output folder.

Run as ``python mpkern/bench/gpu_summary.py OUTDIR`` (what the script does: standard library only,
so the summary is printed even when torch or mpkern cannot be imported on the machine) or as
``python -m mpkern.bench.gpu_summary OUTDIR``. It reads, each if present:

* ``plan.tsv`` (the stages the script meant to run: name, limit s, what) and ``stages.tsv`` (what
  each stage did: name, limit s, exit status, seconds, status word);
* ``precheck.json``, ``device.json`` (the measured copy bandwidth, the CUDA build checks);
* the benchmark stages' JSON (``unscale.json``, ``adamw_*.json``, ``matmul*.json``): raw
  measurements only -- bytes per param from :mod:`mpkern.bytemodel` (written by the stage, with
  the name of the count it took), parameter counts, kernel / wall / CUDA-graph times in ms per
  call, FLOP counts; every rate is computed here, by :func:`gbps` and :func:`tflops`;
* ``tests_*.xml`` (pytest's JUnit XML, ``junit_family=xunit1``) or, when pytest was killed before
  writing it, the ``-v`` log ``tests_*.log``, and ``tests_*.list`` (the files that stage meant to run).

A missing, failed or interrupted stage is reported as such ("not run", "failed rc=1: ...",
"interrupted after 3 of 16 rows"); nothing here raises on a missing or damaged file.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
import xml.etree.ElementTree as ET
from typing import Any

__all__ = ["gbps", "tflops", "load_json", "read_stages", "read_plan", "parse_junit", "parse_verbose_log",
           "slowest_tests", "test_counts", "memory_rows", "matmul_rows", "release_rows", "summarize", "main"]

#: a wall time this many times the kernel time marks the step host-bound
HOST_BOUND_RATIO = 1.5
#: benchmark stage files, in the order their tables are printed (other adamw_*.json files follow)
MEMORY_STAGES = ("unscale", "adamw_cuda", "adamw_triton")
MATMUL_STAGES = ("matmul", "matmul_tuned")
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed")


# ---- rates -----------------------------------------------------------------------------------------
def gbps(nbytes: float, ms: float) -> float:
    """GB/s (1e9 bytes per second) of ``nbytes`` moved in ``ms`` milliseconds."""
    if not (isinstance(ms, (int, float)) and ms > 0 and math.isfinite(ms)):
        raise ValueError(f"gbps: time must be a positive number of ms, got {ms!r}")
    return nbytes / (ms * 1e-3) / 1e9


def tflops(flops: float, ms: float) -> float:
    """TFLOP/s (1e12 floating-point operations per second) of ``flops`` done in ``ms`` milliseconds."""
    if not (isinstance(ms, (int, float)) and ms > 0 and math.isfinite(ms)):
        raise ValueError(f"tflops: time must be a positive number of ms, got {ms!r}")
    return flops / (ms * 1e-3) / 1e12


def _ms(timing: Any, key: str = "kernel_ms") -> float | None:
    """A positive finite time from a timing dict, else None."""
    if not isinstance(timing, dict):
        return None
    v = timing.get(key)
    return float(v) if isinstance(v, (int, float)) and v > 0 and math.isfinite(v) else None


# ---- files -----------------------------------------------------------------------------------------
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


def _rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The row dicts of a stage file (anything else in ``rows`` is left out)."""
    rows = data.get("rows")
    return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []


def _num_or_none(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _read_tsv(path: str, ncols: int) -> list[list[str]]:
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


def _log_tail(path: str, n: int = 3) -> list[str]:
    """The last ``n`` non-empty lines of a stage log (shortened), or nothing if there is none."""
    try:
        with open(path, errors="replace") as f:
            tail = [ln.rstrip() for ln in f.readlines()[-200:] if ln.strip()]
    except OSError:
        return []
    return [t[:150] for t in tail[-n:]]


def _stage_word(stages: dict[str, dict[str, Any]], name: str) -> str:
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


def _read_list(path: str) -> list[str]:
    try:
        with open(path) as f:
            return [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]
    except OSError:
        return []


def test_counts(out: str, stage: str) -> dict[str, Any]:
    """One pytest stage's results: ``{"source": "junit"|"log"|None, "files": {file: counts + status},
    "failures": [...], "planned": [...]}``; files planned but absent from the results are
    ``"not run"`` (not reached before the stage ended, or every test deselected)."""
    planned = _read_list(os.path.join(out, f"{stage}.list"))
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


# ---- benchmark rows ----------------------------------------------------------------------------------
def _fmt(v: float | None, digits: int = 3) -> str:
    if v is None:
        return "-"
    if abs(v) >= 1000:
        return f"{v:.0f}"
    return f"{v:.{digits}g}"


def _stage_files(out: str, prefix: str) -> list[str]:
    try:
        names = sorted(os.listdir(out))
    except OSError:
        return []
    return [n for n in names if n.endswith(".json") and (n == f"{prefix}.json" or n.startswith(f"{prefix}_"))]


def _stage_state(data: dict[str, Any] | None, problem: str, stages: dict[str, dict[str, Any]], name: str) -> str:
    """One line on a benchmark stage: how it ended, from its JSON and the script's record."""
    word = _stage_word(stages, name)
    if data is None:
        return f"{name}: {problem}" + ("" if word == "not run" else f" (stage: {word})")
    status = data.get("status", "?")
    rows = _rows(data)
    planned = data.get("planned") if isinstance(data.get("planned"), list) else []
    line = f"{name}: {status}, {len(rows)}" + (f" of {len(planned)}" if planned else "") + " rows"
    if data.get("error"):
        line += f"; error: {str(data['error'])[:160]}"
    if word != "not run":
        line += f" (stage: {word})"
    return line


def memory_rows(rows: list[dict[str, Any]], copy_gbps: float | None,
                peers: dict[str, dict[str, Any]]) -> tuple[list[list[str]], list[str]]:
    """``(cells, notes)`` of the memory-bound rows (unscale, adamw). Cells, one list per measured row
    (:data:`MEMORY_HEADER`): GB/s from the bytes the stage took from the byte model and the
    CUDA-event kernel time, its % of the measured copy bandwidth, the same for the CUDA-graph
    replay, the wall time per call, and mpkern's speed over the PyTorch peer of its kernel
    (``peers``: kernel -> peer row) beside the byte-model limit. Notes: one line per row that
    failed and per graph capture that failed, with the reason."""
    out, notes = [], []
    for r in rows:
        bpp, params = _num_or_none(r.get("bytes_per_param")), r.get("params")
        params = params if isinstance(params, int) and params > 0 else None
        name = f"{r.get('kernel', '?')}"
        what = r.get("mode") or r.get("impl") or "?"
        backend = r.get("backend") or "?"
        k_ms, w_ms, g_ms = _ms(r.get("timing")), _ms(r.get("timing"), "wall_ms"), _ms(r.get("graph"))
        if r.get("error") or k_ms is None:
            notes.append(f"{name} {backend} {what}: failed: {str(r.get('error') or 'no kernel time')[:200]}")
            continue
        nbytes = bpp * params if bpp and params else None
        k_gbps = gbps(nbytes, k_ms) if nbytes is not None else None
        g_gbps = gbps(nbytes, g_ms) if nbytes is not None and g_ms else None

        def pct(x: float | None) -> str:
            return "-" if x is None or not copy_gbps else f"{100 * x / copy_gbps:.0f} %"

        if g_ms is not None:
            graph_cells = [_fmt(g_ms), _fmt(g_gbps), pct(g_gbps)]
        elif r.get("graph_error"):
            graph_cells = ["capture failed", "-", "-"]
            notes.append(f"{name} {backend} {what}: CUDA-graph capture failed: {str(r['graph_error'])[:200]}")
        else:
            graph_cells = ["not run", "-", "-"]
        ahead = (r.get("timing") or {}).get("queued_ahead")
        rounds = (r.get("timing") or {}).get("rounds")
        queue = "-" if ahead is None else ("yes" if ahead == rounds else f"{ahead}/{rounds}")
        host = "-" if not w_ms else (f"host-bound {w_ms / k_ms:.1f}x" if w_ms > HOST_BOUND_RATIO * k_ms
                                     else f"device {w_ms / k_ms:.1f}x")
        peer = peers.get(r.get("kernel", ""))
        if r.get("peer"):
            vs = "(peer)"
        elif (peer is None or _ms(peer.get("timing")) is None or not bpp
              or not _num_or_none(peer.get("bytes_per_param"))):
            vs = "no peer timing"
        else:
            vs = f"{_ms(peer.get('timing')) / k_ms:.2f}x (limit {peer['bytes_per_param'] / bpp:.2f}x)"
        out.append([name, backend, what, "-" if bpp is None else f"{bpp:g}",
                    "-" if params is None else f"{params / 1e6:.0f}M",
                    _fmt(k_ms), _fmt(k_gbps), pct(k_gbps), *graph_cells, _fmt(w_ms), host, queue, vs])
    return out, notes


MEMORY_HEADER = ["kernel", "backend", "mode / method", "B/param", "params", "kernel ms", "GB/s", "% copy",
                 "graph ms", "graph GB/s", "graph % copy", "wall ms", "wall/kernel", "queued", "vs torch (limit)"]
MATMUL_HEADER = ["shape", "dtype->out", "config", "mpkern ms", "TFLOP/s", "peer", "peer ms", "peer TFLOP/s",
                 "mpkern/peer", "wall ms", "tuning s"]


def matmul_rows(rows: list[dict[str, Any]]) -> tuple[list[list[str]], list[str]]:
    """``(cells, notes)`` of the GEMM rows (:data:`MATMUL_HEADER`): TFLOP/s of mpkern and of its
    cuBLAS peer from CUDA-event times; a note per row that failed."""
    out, notes = [], []
    for r in rows:
        shape = r.get("shape", "?")
        dt = f"{r.get('dtype', '?')}->{r.get('out', '?')}"
        cfg = r.get("config", "?")
        flops = r.get("flops")
        k_ms, p_ms = _ms(r.get("timing")), _ms(r.get("peer_timing"))
        if r.get("error") or k_ms is None or not isinstance(flops, (int, float)):
            peer = (f"; {r.get('peer', 'peer')}: {tflops(flops, p_ms):.0f} TFLOP/s ({_fmt(p_ms)} ms)"
                    if p_ms and isinstance(flops, (int, float)) else "")
            notes.append(f"{shape} {dt} ({cfg}): failed: {str(r.get('error') or 'no kernel time')[:200]}{peer}")
            continue
        ours = tflops(flops, k_ms)
        theirs = tflops(flops, p_ms) if p_ms else None
        ratio = f"{ours / theirs:.2f}x" if theirs else "-"
        tune = r.get("tuning_s")
        out.append([shape, dt, cfg, _fmt(k_ms), _fmt(ours), r.get("peer", "?"), _fmt(p_ms), _fmt(theirs), ratio,
                    _fmt(_ms(r.get("timing"), "wall_ms")), "-" if tune is None else f"{tune:.1f}"])
    return out, notes


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)] if rows else [len(h) for h in header]

    def line(cells: list[str]) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()

    return [line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]


# ---- the summary -------------------------------------------------------------------------------------
def _machine_lines(out: str) -> list[str]:
    pre, why = load_json(os.path.join(out, "precheck.json"))
    if pre is None:
        return [f"precheck: {why}"]
    lines = []
    gpu = pre.get("gpu") or {}
    if gpu:
        lines.append(f"GPU: {gpu.get('name', '?')} (sm_{gpu.get('arch', '?').replace('.', '')}, "
                     f"{gpu.get('sms', '?')} SMs, {_fmt((gpu.get('memory_bytes') or 0) / 2**30)} GiB, "
                     f"L2 {_fmt((gpu.get('l2_bytes') or 0) / 2**20)} MiB), driver {pre.get('driver', '?')}")
    else:
        lines.append("GPU: none visible to torch")
    lines.append(f"torch {pre.get('torch', '?')} (CUDA {pre.get('torch_cuda', '?')}), triton "
                 f"{pre.get('triton', '?')}, python {pre.get('python', '?')}, numpy {pre.get('numpy', '?')}")
    lines.append(f"ninja: {pre.get('ninja') or 'MISSING'}; nvcc: {pre.get('nvcc') or 'not found'}; "
                 f"torch CUDA vs nvcc: {pre.get('cuda_match') or 'ok'}; TORCH_CUDA_ARCH_LIST={pre.get('arch') or '-'}")
    for p in pre.get("problems") or []:
        lines.append(f"  PROBLEM: {p}")
    return lines


def _copy_gbps(out: str) -> tuple[float | None, list[str]]:
    dev, why = load_json(os.path.join(out, "device.json"))
    if dev is None:
        return None, [f"measured copy bandwidth: {why} (device stage) -- no % of bandwidth below"]
    lines = []
    checks = dev.get("checks") or {}
    if checks:
        lines.append("CUDA build: " + ", ".join(f"{k}={v}" for k, v in checks.items()))
    bw = dev.get("bandwidth") or {}
    copy = bw.get("copy") or {}
    c_ms = _ms(copy)
    if c_ms is None or not isinstance(copy.get("bytes_moved"), (int, float)):
        lines.append(f"measured copy bandwidth: not measured ({dev.get('error') or dev.get('status', '?')})")
        return None, lines
    copy_gbps = gbps(copy["bytes_moved"], c_ms)
    text = (f"measured copy bandwidth: {copy_gbps:.0f} GB/s (copy_ of {copy['bytes_moved'] / 2 / 2**20:.0f} MiB, "
            f"CUDA events over back-to-back calls)")
    inplace = bw.get("inplace") or {}
    if _ms(inplace) and isinstance(inplace.get("bytes_moved"), (int, float)):
        text += f"; in-place fp32 multiply {gbps(inplace['bytes_moved'], _ms(inplace)):.0f} GB/s"
    lines.append(text)
    return copy_gbps, lines


def _planned(data: dict[str, Any]) -> list[str]:
    planned = data.get("planned")
    return [str(m) for m in planned] if isinstance(planned, list) else []


def _stages_section(out: str, stages: dict[str, dict[str, Any]]) -> list[str]:
    plan = read_plan(out)
    lines = ["--- stages (limit, seconds taken, status) ---"]
    names = [p[0] for p in plan] + [s for s in stages if s not in {p[0] for p in plan}]
    limits = {p[0]: p[1] for p in plan}
    total_taken = 0
    for name in names:
        st = stages.get(name)
        took = st["seconds"] if st and st["seconds"] is not None else None
        total_taken += took or 0
        limit = limits.get(name, st["limit"] if st else None)
        lines.append(f"  {name:<14} {('-' if limit is None else str(limit)) + ' s':>7} "
                     f"{('-' if took is None else str(took)) + ' s':>7}  {_stage_word(stages, name)}")
        if st and st["rc"] not in (0, None):  # failed, timed out, killed: the end of its log
            lines += [f"  {'':<14} | {t}" for t in _log_tail(os.path.join(out, f"{name}.log"))]
    if plan:
        lines.append(f"  {'total':<14} {str(sum(limits.values())) + ' s':>7} {str(total_taken) + ' s':>7}")
    return lines


def _memory_section(out: str, stages: dict[str, dict[str, Any]], copy_gbps: float | None) -> list[str]:
    lines = ["--- memory-bound kernels: bytes from mpkern.bytemodel, kernel time from CUDA events over "
             "back-to-back calls, % of the measured copy bandwidth ---"]
    mem_rows, states, peers, loaded, notes = [], [], {}, [], []
    names = list(MEMORY_STAGES) + [f[:-5] for f in _stage_files(out, "adamw") if f[:-5] not in MEMORY_STAGES]
    for stage in names:
        data, why = load_json(os.path.join(out, f"{stage}.json"))
        states.append(_stage_state(data, why, stages, stage))
        if data is not None:
            loaded.append(data)
    for data in loaded:  # peers first: a peer row can sit in another stage's file
        for r in _rows(data):
            if r.get("peer") and not r.get("error") and _ms(r.get("timing")):
                peers.setdefault(r.get("kernel", ""), r)
    for data in loaded:
        cells, why = memory_rows(_rows(data), copy_gbps, peers)
        mem_rows += cells
        notes += why
        done = {r.get("mode") or r.get("impl") for r in _rows(data)}
        notes += [f"{data.get('kernel', '?')} {data.get('backend', '?')} {m}: not run (the stage ended first)"
                  for m in _planned(data) if m not in done]
    lines += [f"  {s}" for s in states]
    if mem_rows:
        lines += _table(MEMORY_HEADER, mem_rows)
    lines += [f"  {n}" for n in notes]
    lines.append("  (GB/s = bytes/param x params / time; graph: the same step replayed from a CUDA graph; "
                 f"wall/kernel > {HOST_BOUND_RATIO}: the host, not the GPU, sets the step time)")
    return lines


def _matmul_section(out: str, stages: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["--- matmul: TFLOP/s from CUDA events, against cuBLAS (torch) on the same operands ---"]
    mm_rows, notes = [], []
    for name in MATMUL_STAGES:
        data, why = load_json(os.path.join(out, f"{name}.json"))
        lines.append(f"  {_stage_state(data, why, stages, name)}")
        if data is not None:
            cells, why_rows = matmul_rows(_rows(data))
            mm_rows += cells
            notes += why_rows
            done = {f"{r.get('shape')} {r.get('dtype')}->{r.get('out')}" for r in _rows(data)}
            notes += [f"{m}: not run (the stage ended first)" for m in _planned(data) if m not in done]
    if mm_rows:
        lines += _table(MATMUL_HEADER, mm_rows)
    lines += [f"  {n}" for n in notes]
    return lines


def release_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    """Cells of release.json's rows (mpkern/bench/gpu_release.py): variant, step ms, its ratio to each
    row the stage named as its reference (``vs``), peak GB, bitwise equal to the regular run."""
    ms = {r.get("variant"): _num_or_none(r.get("step_ms")) for r in rows}
    cells = []
    for r in rows:
        t, peak = ms.get(r.get("variant")), _num_or_none(r.get("peak_GB"))
        if "error" in r or t is None:
            cells.append([str(r.get("variant")), "-", "-", "-", f"error: {r.get('error')}"])
            continue
        ratio = "; ".join(f"{t / ms[n]:.3f}x {n}" for n in r.get("vs", []) if ms.get(n))
        cells.append([r["variant"], f"{t:.2f}", ratio, "-" if peak is None else f"{peak:.2f}",
                      {True: "yes", False: "NO"}.get(r.get("bitwise"), "")])
    return cells


def _release_section(out: str, stages: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["--- gradient release: whole steps (forward included), median wall ms of synchronised steps ---"]
    data, why = load_json(os.path.join(out, "release.json"))
    lines.append(f"  {_stage_state(data, why, stages, 'release')}")
    if data is not None:
        meta = data.get("meta") or {}
        lines.append(f"  model: {meta.get('layers')} x Linear({meta.get('width')}) bf16, "
                     f"{meta.get('tokens')} rows/step, release_bucket_bytes {meta.get('bucket_bytes')}")
        cells = release_rows(_rows(data))
        if cells:
            lines += _table(["variant", "step ms", "ratio", "peak GB", "bitwise"], cells)
    return lines


def _tests_section(out: str, stages: dict[str, dict[str, Any]], stage: str) -> list[str]:
    res = test_counts(out, stage)
    kexpr = _read_list(os.path.join(out, f"{stage}.k"))
    extra = f", -k {kexpr[0]!r}" if kexpr else ""
    lines = [f"--- {stage}: tests per file (from {res['source'] or 'nothing: no XML, no log'}{extra}; "
             f"stage: {_stage_word(stages, stage)}) ---"]
    if res["source"] is None:
        return lines + [f"  no results; {len(res['planned'])} files were planned ({stage}.list)"]
    rows, tot = [], dict.fromkeys(OUTCOMES, 0)
    for f, c in res["files"].items():
        for k in OUTCOMES:
            tot[k] += c[k]
        secs = "-" if c.get("seconds") is None else f"{c['seconds']:.1f}"
        rows.append([f, *(str(c[k]) for k in OUTCOMES), secs, c["status"]])
    if rows:
        rows.append(["total", *(str(tot[k]) for k in OUTCOMES), "", ""])
        lines += _table(["file", *OUTCOMES, "seconds", "status"], rows)
    slow = slowest_tests(os.path.join(out, f"{stage}.xml"))
    if slow:
        lines.append("  slowest: " + ", ".join(f"{t} {sec:.1f} s" for t, sec in slow))
    for test, msg in res["failures"][:25]:
        lines.append(f"  FAILED {test}: {msg}")
    if len(res["failures"]) > 25:
        lines.append(f"  ... and {len(res['failures']) - 25} more (see {stage}.xml / {stage}.log)")
    return lines


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
    lines += _guarded("machine", _machine_lines, out)
    lines += [""] + _guarded("stages", _stages_section, out, stages)
    got = _guarded("copy bandwidth", _copy_gbps, out)
    copy_gbps, bw_lines = got if isinstance(got, tuple) else (None, got)
    lines += [""] + bw_lines
    lines += [""] + _guarded("memory-bound kernels", _memory_section, out, stages, copy_gbps)
    lines += [""] + _guarded("matmul", _matmul_section, out, stages)
    lines += [""] + _guarded("release", _release_section, out, stages)
    for stage in ("tests_gpu", "tests_rest"):
        lines += [""] + _guarded(stage, _tests_section, out, stages, stage)
    lines.append("=" * 86)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``gpu_summary.py OUTDIR [--write]``: print the summary (``--write``: also to ``OUTDIR/summary.txt``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    write = "--write" in args
    args = [a for a in args if a != "--write"]
    if len(args) != 1:
        print("usage: gpu_summary.py OUTDIR [--write]", file=sys.stderr)
        return 2
    out = args[0]
    if not os.path.isdir(out):
        print(f"gpu_summary: {out!r} is not a folder", file=sys.stderr)
        return 2
    text = summarize(out)
    if write:
        with open(os.path.join(out, "summary.txt"), "w") as f:
            f.write(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
