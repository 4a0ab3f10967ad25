"""The sections of the GPU check's summary, one function each -- standard library only.

Each takes the output folder (and the script's stage records, :func:`.read.read_stages`) and returns
its lines: the machine (``precheck.json``), the stages with their limits and times, the measured copy
bandwidth (``device.json``), the memory-bound kernels, the GEMMs, gradient release and the tests per
file. A stage that is missing, failed or was cut off is said to be so.
"""

from __future__ import annotations

import os
from typing import Any

from .pytest_results import render, run_results
from .read import (
    load_json,
    log_tail,
    read_list,
    read_plan,
    stage_files,
    stage_rows,
    stage_word,
)
from .tables import (
    HOST_BOUND_RATIO,
    MATMUL_HEADER,
    MEMORY_HEADER,
    fmt,
    gbps,
    matmul_rows,
    memory_rows,
    ms_of,
    release_rows,
    text_table,
)

__all__ = ["MATMUL_STAGES", "MEMORY_STAGES", "copy_bandwidth_lines", "machine_lines", "matmul_section",
           "memory_section", "release_section", "stages_section", "tests_section"]

#: benchmark stage files, in the order their tables are printed (other adamw_*.json files follow)
MEMORY_STAGES = ("unscale", "adamw_cuda", "adamw_triton")
MATMUL_STAGES = ("matmul", "matmul_tuned")


def _stage_state(data: dict[str, Any] | None, problem: str, stages: dict[str, dict[str, Any]], name: str) -> str:
    """One line on a benchmark stage: how it ended, from its JSON and the script's record."""
    word = stage_word(stages, name)
    if data is None:
        return f"{name}: {problem}" + ("" if word == "not run" else f" (stage: {word})")
    status = data.get("status", "?")
    rows = stage_rows(data)
    planned = data.get("planned") if isinstance(data.get("planned"), list) else []
    line = f"{name}: {status}, {len(rows)}" + (f" of {len(planned)}" if planned else "") + " rows"
    if data.get("error"):
        line += f"; error: {str(data['error'])[:160]}"
    if word != "not run":
        line += f" (stage: {word})"
    return line


def _planned(data: dict[str, Any]) -> list[str]:
    """The row names a stage file says it meant to write (``planned``)."""
    planned = data.get("planned")
    return [str(m) for m in planned] if isinstance(planned, list) else []


def machine_lines(out: str) -> list[str]:
    """The GPU, the versions, the toolchain and the problems the precheck found (``precheck.json``)."""
    pre, why = load_json(os.path.join(out, "precheck.json"))
    if pre is None:
        return [f"precheck: {why}"]
    lines = []
    gpu = pre.get("gpu") or {}
    if gpu:
        lines.append(f"GPU: {gpu.get('name', '?')} (sm_{gpu.get('arch', '?').replace('.', '')}, "
                     f"{gpu.get('sms', '?')} SMs, {fmt((gpu.get('memory_bytes') or 0) / 2**30)} GiB, "
                     f"L2 {fmt((gpu.get('l2_bytes') or 0) / 2**20)} MiB), driver {pre.get('driver', '?')}")
    else:
        lines.append("GPU: none visible to torch")
    lines.append(f"torch {pre.get('torch', '?')} (CUDA {pre.get('torch_cuda', '?')}), triton "
                 f"{pre.get('triton', '?')}, python {pre.get('python', '?')}, numpy {pre.get('numpy', '?')}")
    lines.append(f"ninja: {pre.get('ninja') or 'MISSING'}; nvcc: {pre.get('nvcc') or 'not found'}; "
                 f"torch CUDA vs nvcc: {pre.get('cuda_match') or 'ok'}; TORCH_CUDA_ARCH_LIST={pre.get('arch') or '-'}")
    for p in pre.get("problems") or []:
        lines.append(f"  PROBLEM: {p}")
    return lines


def copy_bandwidth_lines(out: str) -> tuple[float | None, list[str]]:
    """``(copy GB/s or None, lines)``: the CUDA build checks and the measured copy bandwidth (``device.json``)."""
    dev, why = load_json(os.path.join(out, "device.json"))
    if dev is None:
        return None, [f"measured copy bandwidth: {why} (device stage) -- no % of bandwidth below"]
    lines = []
    checks = dev.get("checks") or {}
    if checks:
        lines.append("CUDA build: " + ", ".join(f"{k}={v}" for k, v in checks.items()))
    bw = dev.get("bandwidth") or {}
    copy = bw.get("copy") or {}
    c_ms = ms_of(copy)
    if c_ms is None or not isinstance(copy.get("bytes_moved"), (int, float)):
        lines.append(f"measured copy bandwidth: not measured ({dev.get('error') or dev.get('status', '?')})")
        return None, lines
    copy_gbps = gbps(copy["bytes_moved"], c_ms)
    text = (f"measured copy bandwidth: {copy_gbps:.0f} GB/s (copy_ of {copy['bytes_moved'] / 2 / 2**20:.0f} MiB, "
            f"CUDA events over back-to-back calls)")
    inplace = bw.get("inplace") or {}
    if ms_of(inplace) and isinstance(inplace.get("bytes_moved"), (int, float)):
        text += f"; in-place fp32 multiply {gbps(inplace['bytes_moved'], ms_of(inplace)):.0f} GB/s"
    lines.append(text)
    return copy_gbps, lines


def stages_section(out: str, stages: dict[str, dict[str, Any]]) -> list[str]:
    """Every planned stage: its limit, the seconds it took, how it ended; the end of a failed stage's log."""
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
                     f"{('-' if took is None else str(took)) + ' s':>7}  {stage_word(stages, name)}")
        if st and st["rc"] not in (0, None):  # failed, timed out, killed: the end of its log
            lines += [f"  {'':<14} | {t}" for t in log_tail(os.path.join(out, f"{name}.log"))]
    if plan:
        lines.append(f"  {'total':<14} {str(sum(limits.values())) + ' s':>7} {str(total_taken) + ' s':>7}")
    return lines


def memory_section(out: str, stages: dict[str, dict[str, Any]], copy_gbps: float | None) -> list[str]:
    """The unscale and AdamW stages' table (:func:`.tables.memory_rows`), its notes and the rows not reached."""
    lines = ["--- memory-bound kernels: bytes from mpkern.bytemodel, kernel time from CUDA events over "
             "back-to-back calls, % of the measured copy bandwidth ---"]
    mem_rows, states, peers, loaded, notes = [], [], {}, [], []
    names = list(MEMORY_STAGES) + [f[:-5] for f in stage_files(out, "adamw") if f[:-5] not in MEMORY_STAGES]
    for stage in names:
        data, why = load_json(os.path.join(out, f"{stage}.json"))
        states.append(_stage_state(data, why, stages, stage))
        if data is not None:
            loaded.append(data)
    for data in loaded:  # peers first: a peer row can sit in another stage's file
        for r in stage_rows(data):
            if r.get("peer") and not r.get("error") and ms_of(r.get("timing")):
                peers.setdefault(r.get("kernel", ""), r)
    for data in loaded:
        cells, why = memory_rows(stage_rows(data), copy_gbps, peers)
        mem_rows += cells
        notes += why
        done = {r.get("mode") or r.get("impl") for r in stage_rows(data)}
        notes += [f"{data.get('kernel', '?')} {data.get('backend', '?')} {m}: not run (the stage ended first)"
                  for m in _planned(data) if m not in done]
    lines += [f"  {s}" for s in states]
    if mem_rows:
        lines += text_table(MEMORY_HEADER, mem_rows)
    lines += [f"  {n}" for n in notes]
    lines.append("  (GB/s = bytes/param x params / time; graph: the same step replayed from a CUDA graph; "
                 f"wall/kernel > {HOST_BOUND_RATIO}: the host, not the GPU, sets the step time)")
    return lines


def matmul_section(out: str, stages: dict[str, dict[str, Any]]) -> list[str]:
    """The GEMM stages' table (:func:`.tables.matmul_rows`), its notes and the rows not reached."""
    lines = ["--- matmul: TFLOP/s from CUDA events, against cuBLAS (torch) on the same operands ---"]
    mm_rows, notes = [], []
    for name in MATMUL_STAGES:
        data, why = load_json(os.path.join(out, f"{name}.json"))
        lines.append(f"  {_stage_state(data, why, stages, name)}")
        if data is not None:
            cells, why_rows = matmul_rows(stage_rows(data))
            mm_rows += cells
            notes += why_rows
            done = {f"{r.get('shape')} {r.get('dtype')}->{r.get('out')}" for r in stage_rows(data)}
            notes += [f"{m}: not run (the stage ended first)" for m in _planned(data) if m not in done]
    if mm_rows:
        lines += text_table(MATMUL_HEADER, mm_rows)
    lines += [f"  {n}" for n in notes]
    return lines


def release_section(out: str, stages: dict[str, dict[str, Any]]) -> list[str]:
    """The gradient-release stage: its model and its table (:func:`.tables.release_rows`)."""
    lines = ["--- gradient release: whole steps (forward included), median wall ms of synchronised steps ---"]
    data, why = load_json(os.path.join(out, "release.json"))
    lines.append(f"  {_stage_state(data, why, stages, 'release')}")
    if data is not None:
        meta = data.get("meta") or {}
        if meta:  # a stage that failed before it built its model has none
            lines.append(f"  model: {meta.get('layers')} x Linear({meta.get('width')}) bf16, "
                         f"{meta.get('tokens')} rows/step, release_bucket_bytes {meta.get('bucket_bytes')}")
        cells = release_rows(stage_rows(data))
        if cells:
            lines += text_table(["variant", "step ms", "ratio", "peak GB", "bitwise"], cells)
    return lines


def tests_section(out: str, stages: dict[str, dict[str, Any]], stage: str) -> list[str]:
    """One pytest stage: tests per file and outcome, each crashed test by name with its last output,
    the failures, the slowest tests, the files planned but never collected (:mod:`.pytest_results`)."""
    res = run_results(os.path.join(out, f"{stage}.xml"), os.path.join(out, f"{stage}.log"),
                      os.path.join(out, f"{stage}.collected"))
    kexpr = read_list(os.path.join(out, f"{stage}.k"))
    plugin, _ = load_json(os.path.join(out, "plugins.json"))
    how = f"; {plugin['line']}" if plugin and plugin.get("line") else ""
    lines = [f"--- {stage}: tests per file (-k {kexpr[0] if kexpr else '-'!r}; stage: {stage_word(stages, stage)}"
             f"{how}) ---"]
    lines += [f"  {ln}" for ln in render(res)]
    never = [f for f in read_list(os.path.join(out, f"{stage}.list")) if f not in res["files"]]
    if never:
        lines.append(f"  not collected (the stage ended first, or -k left nothing): {', '.join(never)}")
    return lines
