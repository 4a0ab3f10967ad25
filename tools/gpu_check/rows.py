"""The stage files of ``scripts/gpu_check.sh`` and the rows they hold -- pure, no GPU needed.

:class:`StageFile` is one stage's JSON file, rewritten atomically after every row; :func:`mem_row`
and :func:`matmul_row` build the rows :mod:`mpkern.bench.gpu_stages` measures and
:mod:`mpkern.bench.gpu_summary` reads.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from typing import Any

__all__ = ["StageFile", "matmul_row", "mem_row", "now_iso", "short_error"]


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def short_error(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"


class StageFile:
    """One stage's JSON file, rewritten (atomically: a temporary file, then ``os.replace``) after
    every change: ``{"stage", "status", "started", "updated", "meta", "planned", "rows", "error", ...}``.
    ``status``: ``running`` until :meth:`finish` sets ``done``, ``failed`` or ``interrupted``."""

    def __init__(self, path: str, stage: str, **extra: Any) -> None:
        if not path.endswith(".json"):
            raise ValueError(f"StageFile: the path must end in .json, got {path!r}")
        self.path = path
        self.data: dict[str, Any] = {"stage": stage, "status": "running", "started": now_iso(), "updated": now_iso(),
                                     "meta": {}, "planned": [], "rows": [], "error": None, **extra}
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.write()

    def write(self) -> None:
        self.data["updated"] = now_iso()
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, self.path)

    def set(self, **items: Any) -> None:
        self.data.update(items)
        self.write()

    def add_row(self, row: dict[str, Any]) -> int:
        """Append ``row`` (written at once); returns its index for :meth:`replace_row`."""
        self.data["rows"].append(row)
        self.write()
        return len(self.data["rows"]) - 1

    def replace_row(self, index: int, row: dict[str, Any]) -> None:
        """Put ``row`` in place of row ``index`` (a provisional row completed) and write."""
        if not 0 <= index < len(self.data["rows"]):
            raise IndexError(f"StageFile.replace_row: no row {index} (the stage has {len(self.data['rows'])})")
        self.data["rows"][index] = row
        self.write()

    def finish(self, status: str = "done", error: str | None = None) -> None:
        if status not in ("done", "failed", "interrupted"):
            raise ValueError(f"StageFile.finish: status must be done, failed or interrupted, got {status!r}")
        self.data["status"] = status
        if error is not None:
            self.data["error"] = error
        self.write()


# ---- rows (pure) ------------------------------------------------------------------------------------
def _timing(t: dict[str, Any] | None) -> dict[str, Any] | None:
    if t is None:
        return None
    keep = ("kernel_ms", "wall_ms", "calls", "rounds", "queued_ahead", "hold_ms", "kernel_ms_rounds", "wall_ms_rounds")
    return {k: t[k] for k in keep if k in t}


def mem_row(kernel: str, impl: str, backend: str, *, bytes_per_param: float, bytes_source: str, params: int,
            timing: dict[str, Any] | None = None, graph: dict[str, Any] | None = None,
            graph_error: str | None = None, mode: str | None = None, peer: bool = False,
            error: str | None = None, **extra: Any) -> dict[str, Any]:
    """One memory-bound row as the stage JSON keeps it: what ran, the bytes per param it moves (and
    which count of the byte model says so), the param count, and its raw times from
    :func:`mpkern.measure.event_time` / :func:`~mpkern.measure.graph_time` (``None`` where they did
    not run: then ``error`` / ``graph_error`` says why)."""
    if not (isinstance(bytes_per_param, (int, float)) and bytes_per_param > 0):
        raise ValueError(f"mem_row: bytes_per_param must be positive, got {bytes_per_param!r}")
    if not (isinstance(params, int) and params > 0):
        raise ValueError(f"mem_row: params must be a positive int, got {params!r}")
    if timing is None and error is None:
        raise ValueError("mem_row: a row without a timing needs the error that stopped it")
    return {"kernel": kernel, "impl": impl, "backend": backend, "mode": mode, "peer": peer,
            "bytes_per_param": bytes_per_param, "bytes_source": bytes_source, "params": params,
            "timing": _timing(timing), "graph": _timing(graph), "graph_error": graph_error, "error": error, **extra}


def matmul_row(shape: str, m: int, n: int, k: int, dtype: str, out: str, config: str, *,
               timing: dict[str, Any] | None, peer: str, peer_timing: dict[str, Any] | None,
               error: str | None = None, **extra: Any) -> dict[str, Any]:
    """One GEMM row: the problem (``flops`` = 2 M N K), mpkern's and the peer's raw times."""
    for name, v in (("m", m), ("n", n), ("k", k)):
        if not (isinstance(v, int) and v > 0):
            raise ValueError(f"matmul_row: {name} must be a positive int, got {v!r}")
    if timing is None and error is None:
        raise ValueError("matmul_row: a row without a timing needs the error that stopped it")
    return {"kernel": "matmul", "shape": shape, "M": m, "N": n, "K": k, "dtype": dtype, "out": out,
            "config": config, "flops": 2.0 * m * n * k, "timing": _timing(timing), "peer": peer,
            "peer_timing": _timing(peer_timing), "error": error, **extra}


# ---- shared GPU pieces --------------------------------------------------------------------------------
