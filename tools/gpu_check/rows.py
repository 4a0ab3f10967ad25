"""The rows of the GPU check's benchmark stages, as their JSON files keep them -- pure, standard library only.

:func:`mem_row` (a memory-bound kernel: bytes per param, params, raw times) and :func:`matmul_row`
(a GEMM: the problem, mpkern's and the peer's raw times) are what :mod:`.stages_kernels` and
:mod:`.stages_matmul` write and :mod:`.tables` reads; rates are computed there, never here.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TIMING_KEYS", "matmul_row", "mem_row"]

#: what a row keeps of a :func:`mpkern.measure.event_time` / :func:`~mpkern.measure.graph_time` result
TIMING_KEYS = ("kernel_ms", "wall_ms", "calls", "rounds", "queued_ahead", "hold_ms", "kernel_ms_rounds",
               "wall_ms_rounds")


def _timing(t: dict[str, Any] | None) -> dict[str, Any] | None:
    """The keys of :data:`TIMING_KEYS` that ``t`` has (None stays None)."""
    if t is None:
        return None
    return {k: t[k] for k in TIMING_KEYS if k in t}


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
