"""The GPU check's numbers as text tables -- standard library only, pure.

Stage rows (:mod:`.rows`; ``release.json``'s own) in, table cells out: every rate is computed here
from the raw bytes, FLOP counts and times the stages wrote -- GB/s (:func:`gbps`) and its share of the
measured copy bandwidth, TFLOP/s (:func:`tflops`), wall over kernel time, mpkern's speed over its
PyTorch peer beside the byte-model limit -- and :func:`text_table` lines them up.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["HOST_BOUND_RATIO", "MATMUL_HEADER", "MEMORY_HEADER", "fmt", "gbps", "matmul_rows", "memory_rows",
           "ms_of", "release_rows", "text_table", "tflops"]

#: a wall time this many times the kernel time marks the step host-bound
HOST_BOUND_RATIO = 1.5


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


def ms_of(timing: Any, key: str = "kernel_ms") -> float | None:
    """A positive finite time from a timing dict, else None."""
    if not isinstance(timing, dict):
        return None
    v = timing.get(key)
    return float(v) if isinstance(v, (int, float)) and v > 0 and math.isfinite(v) else None


def _num_or_none(v: Any) -> float | None:
    """``v`` as a finite float (not a bool), else None."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def fmt(v: float | None, digits: int = 3) -> str:
    """A number for a table cell: ``digits`` significant digits, whole from 1000 on, ``-`` for None."""
    if v is None:
        return "-"
    if abs(v) >= 1000:
        return f"{v:.0f}"
    return f"{v:.{digits}g}"


MEMORY_HEADER = ["kernel", "backend", "mode / method", "B/param", "params", "kernel ms", "GB/s", "% copy",
                 "graph ms", "graph GB/s", "graph % copy", "wall ms", "wall/kernel", "queued", "vs torch (limit)"]
MATMUL_HEADER = ["shape", "dtype->out", "config", "mpkern ms", "TFLOP/s", "peer", "peer ms", "peer TFLOP/s",
                 "mpkern/peer", "wall ms", "tuning s"]


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
        k_ms, w_ms, g_ms = ms_of(r.get("timing")), ms_of(r.get("timing"), "wall_ms"), ms_of(r.get("graph"))
        if r.get("error") or k_ms is None:
            notes.append(f"{name} {backend} {what}: failed: {str(r.get('error') or 'no kernel time')[:200]}")
            continue
        nbytes = bpp * params if bpp and params else None
        k_gbps = gbps(nbytes, k_ms) if nbytes is not None else None
        g_gbps = gbps(nbytes, g_ms) if nbytes is not None and g_ms else None

        def pct(x: float | None) -> str:
            return "-" if x is None or not copy_gbps else f"{100 * x / copy_gbps:.0f} %"

        if g_ms is not None:
            graph_cells = [fmt(g_ms), fmt(g_gbps), pct(g_gbps)]
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
        elif (peer is None or ms_of(peer.get("timing")) is None or not bpp
              or not _num_or_none(peer.get("bytes_per_param"))):
            vs = "no peer timing"
        else:
            vs = f"{ms_of(peer.get('timing')) / k_ms:.2f}x (limit {peer['bytes_per_param'] / bpp:.2f}x)"
        out.append([name, backend, what, "-" if bpp is None else f"{bpp:g}",
                    "-" if params is None else f"{params / 1e6:.0f}M",
                    fmt(k_ms), fmt(k_gbps), pct(k_gbps), *graph_cells, fmt(w_ms), host, queue, vs])
    return out, notes


def matmul_rows(rows: list[dict[str, Any]]) -> tuple[list[list[str]], list[str]]:
    """``(cells, notes)`` of the GEMM rows (:data:`MATMUL_HEADER`): TFLOP/s of mpkern and of its
    cuBLAS peer from CUDA-event times; a note per row that failed."""
    out, notes = [], []
    for r in rows:
        shape = r.get("shape", "?")
        dt = f"{r.get('dtype', '?')}->{r.get('out', '?')}"
        cfg = r.get("config", "?")
        flops = r.get("flops")
        k_ms, p_ms = ms_of(r.get("timing")), ms_of(r.get("peer_timing"))
        if r.get("error") or k_ms is None or not isinstance(flops, (int, float)):
            peer = (f"; {r.get('peer', 'peer')}: {tflops(flops, p_ms):.0f} TFLOP/s ({fmt(p_ms)} ms)"
                    if p_ms and isinstance(flops, (int, float)) else "")
            notes.append(f"{shape} {dt} ({cfg}): failed: {str(r.get('error') or 'no kernel time')[:200]}{peer}")
            continue
        ours = tflops(flops, k_ms)
        theirs = tflops(flops, p_ms) if p_ms else None
        ratio = f"{ours / theirs:.2f}x" if theirs else "-"
        tune = r.get("tuning_s")
        out.append([shape, dt, cfg, fmt(k_ms), fmt(ours), r.get("peer", "?"), fmt(p_ms), fmt(theirs), ratio,
                    fmt(ms_of(r.get("timing"), "wall_ms")), "-" if tune is None else f"{tune:.1f}"])
    return out, notes


def release_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    """Cells of release.json's rows (:mod:`.release`): variant, step ms, its ratio to each
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


def text_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """The lines of a text table: the header, a rule, the rows; columns as wide as their widest cell."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)] if rows else [len(h) for h in header]

    def line(cells: list[str]) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()

    return [line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]
