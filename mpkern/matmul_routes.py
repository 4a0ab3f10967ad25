"""The routes of ``mpkern.matmul``: every GEMM that can compute the op with its numerical contract,
which of them may run a problem, and which one does.

The contract, the same on every route: 16-bit operands, products accumulated in fp32, a bias added
in fp32, the result rounded once to the output dtype (fp16, bf16 or fp32) -- or, accumulating, the
fp32 ``out += a @ b`` in the GEMM (``beta = 1``, the ``main_grad +=`` of :mod:`mpkern.nn`), never
through a temporary product.

Routes (:data:`ROUTES`):

* ``triton`` -- mpkern's Triton kernel (``triton_kernels/matmul.py``): CUDA; CPU tensors only under
  the interpreter with ``MPKERN_BACKEND=triton``.
* ``cublas`` -- the platform GEMM on CUDA: ATen's cuBLAS(Lt) call (``torch.mm``/``torch.addmm``, fp32
  outputs through their ``out_dtype``, the accumulation through ``torch.addmm(out, a, b,
  out_dtype=float32, out=out)``) with reduced-precision reductions, fp16 accumulation and TF32
  switched off for the call (:func:`exact_cuda_math`). A form this torch lacks (probed once, no
  host sync) makes the route no candidate for that epilogue.
* ``aten`` -- the platform GEMM on CPU: ATen's own 16-bit GEMM (oneDNN: AMX / AVX512-BF16) for
  16-bit outputs, once :func:`aten_accumulates_in_fp32` has checked on this CPU that it accumulates
  in fp32 and rounds once; ATen's 16-bit -> fp32 GEMM (``mpkern::mm_f32_``, csrc/cpu/gemm_cpu.cpp)
  for an fp32 C: fp32 outputs, a bias of another dtype, the accumulation.
* ``upcast`` -- an fp32 GEMM of fp32 copies of the operands (ATen), then one rounding: runs
  everywhere; the portable fallback (on CUDA only when Triton cannot run; TF32 off).

``cublas`` and ``aten`` both name "the platform's GEMM": :func:`platform_route` gives the one of a
device, and ``MPKERN_MATMUL_ROUTE`` accepts either for both.

Choice (:func:`route_for`): ``MPKERN_BACKEND=triton`` -> ``triton``; else ``MPKERN_MATMUL_ROUTE``
(``auto`` | ``triton`` | ``cublas`` | ``aten`` | ``upcast``) when set and not ``auto`` -- a forced
route that cannot honour the contract for a problem is an error that says why; else the candidates
of the problem are timed once and the fastest is kept (:mod:`mpkern.route_cache`: in memory and on
disk, keyed by device, dtypes, epilogue, layout and power-of-two size buckets).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from functools import cache, partial
from typing import Any

import torch

from . import _backend, route_cache
from .measure import cpu_name
from .route_cache import Problem

Tensor = torch.Tensor

__all__ = ["ENV", "ROUTES", "NOTES", "IN_DTYPES", "OUT_DTYPES", "BIAS_DTYPES", "aten_accumulates_in_fp32",
           "rounds_once_from_fp32", "candidates", "exact_cuda_math", "forced_route", "forget", "has_mm_out_dtype",
           "platform_route", "problem", "route_for", "run", "temp_meter"]

ENV = "MPKERN_MATMUL_ROUTE"
ROUTES = ("triton", "cublas", "aten", "upcast")
#: What each route runs (``mpkern info``, ``bench matmul``).
NOTES = {
    "triton": "mpkern's Triton GEMM (Hopper: persistent, TMA-fed; else pointer loads): fp32 accumulator, bias / "
              "fp32 out / fp32 += fused in the epilogue",
    "cublas": "cuBLAS(Lt) through ATen, compute type fp32, reduced-precision reduction and TF32 off for the call",
    "aten": "ATen's 16-bit GEMM (oneDNN), checked to accumulate in fp32; ATen's 16-bit -> fp32 GEMM for an fp32 C",
    "upcast": "ATen fp32 GEMM of fp32 copies of the operands, then one rounding",
}
IN_DTYPES = (torch.float16, torch.bfloat16)
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BIAS_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---- the temporary-bytes meter --------------------------------------------------------------------
_meters: list[Callable[[int], None]] = []


@contextlib.contextmanager
def temp_meter(callback: Callable[[int], None]) -> Iterator[None]:
    """Within the block, ``callback(n)`` is told, at every GEMM of these ops that holds temporaries
    (operand copies, an fp32 product), the peak bytes of them held at once. A ``TorchDispatchMode``
    sees the ops but not the tensors inside them; a memory meter (``mpkern.compare``) adds these."""
    _meters.append(callback)
    try:
        yield
    finally:
        _meters.remove(callback)


def _note_temps(nbytes: int) -> None:
    for meter in list(_meters):
        meter(nbytes)


# ---- platform capabilities ------------------------------------------------------------------------
def has_mm_out_dtype(device: torch.device | str) -> bool:
    """Whether this torch has ``torch.mm(..., out_dtype=torch.float32)`` for 16-bit operands on ``device``
    (CUDA since torch 2.8; not on CPU in 2.14)."""
    return _has_mm_out_dtype(torch.device(device).type)


@cache
def _has_mm_out_dtype(device_type: str) -> bool:
    try:
        a = torch.ones(16, 16, dtype=torch.bfloat16, device=device_type)
        torch.mm(a, a, out_dtype=torch.float32)
        return True
    except (RuntimeError, TypeError, NotImplementedError):  # older torch, or no kernel on this device
        return False


@cache
def _has_addmm_accumulate(device_type: str) -> bool:
    """``torch.addmm(c32, a16, b16, out_dtype=float32, out=c32)``: an fp32 C with beta 1 (the check
    raises before any kernel is queued, so no synchronisation)."""
    try:
        a = torch.zeros(16, 16, dtype=torch.bfloat16, device=device_type)
        c = torch.zeros(16, 16, dtype=torch.float32, device=device_type)
        torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
        return True
    except (RuntimeError, TypeError, NotImplementedError):  # "self and mat2 must have the same dtype" (older torch)
        return False


def _mm_f32() -> Any:
    """``torch.ops.mpkern.mm_f32_`` (CPU, the native extension), or None without the extension."""
    if _backend.native() is None:
        return None
    try:
        return torch.ops.mpkern.mm_f32_
    except (AttributeError, RuntimeError):  # an extension built before the op existed
        return None


#: The probe of :func:`aten_accumulates_in_fp32`: K long enough that 16-bit partial sums, or one
#: rounding per K block, would miss the correctly rounded result on most outputs.
_PROBE_M, _PROBE_K, _PROBE_N = 32, 3072, 48


@cache
def aten_accumulates_in_fp32(dtype: torch.dtype, bias: bool) -> bool:
    """Whether ATen's CPU GEMM in ``dtype`` (``torch.mm``, or ``torch.addmm`` with a bias of ``dtype``)
    keeps mpkern's contract on this CPU: measured once against float64. With fp32 accumulation and one
    rounding, an output differs from the float64 result rounded to ``dtype`` only where the exact value
    lies within fp32 accumulation error of a rounding boundary (measured: 0-0.07 % of bf16 outputs,
    0.3 % of fp16 ones, 0.07-0.7 % with a bias); 16-bit partial sums, or a rounding per block of K,
    change most of them."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(_PROBE_M, _PROBE_K, generator=g).to(dtype)
    b = torch.randn(_PROBE_K, _PROBE_N, generator=g).to(dtype)
    c = torch.randn(_PROBE_N, generator=g).to(dtype) if bias else None
    try:
        got = torch.mm(a, b) if c is None else torch.addmm(c, a, b)
    except RuntimeError:
        return False
    return rounds_once_from_fp32(got, a, b, c)


def rounds_once_from_fp32(got: Tensor, a: Tensor, b: Tensor, bias: Tensor | None = None) -> bool:
    """Whether the 16-bit ``got`` is ``a @ b (+ bias)`` accumulated in fp32 and rounded once: every
    output within an ulp of the float64 result plus fp32 accumulation error (2^-20 of the sum of
    |products|), and at most 2 % of them off the correctly rounded value."""
    dtype = got.dtype
    want = a.double() @ b.double() + (0 if bias is None else bias.double())
    mag = a.double().abs() @ b.double().abs() + (0 if bias is None else bias.double().abs())
    rounded = want.to(dtype)
    ulp = rounded.double().abs() * 2.0 ** -(7 if dtype == torch.bfloat16 else 10)
    ok = (got.double() - want).abs() <= ulp + 2.0 ** -20 * mag
    return bool(ok.all()) and (got != rounded).float().mean().item() <= 0.02


# ---- the routes -------------------------------------------------------------------------------------
def _row_major(t: Tensor) -> bool:
    """Rows of unit stride that do not overlap: what ATen's 16-bit -> fp32 GEMM (mm_f32_) takes."""
    return (t.stride(1) == 1 or t.shape[1] <= 1) and (t.stride(0) >= t.shape[1] or t.shape[0] <= 1)


def _run_triton(a: Tensor, b: Tensor, bias: Tensor | None, out_dtype: torch.dtype, acc: Tensor | None) -> Tensor:
    from mpkern.triton_kernels import matmul as tk

    if acc is not None:
        return tk.matmul_into(a, b, acc, bias, accumulate=True)
    return tk.matmul(a, b, bias, out_dtype)


@contextlib.contextmanager
def exact_cuda_math() -> Iterator[None]:
    """Within the block, ATen's CUDA GEMMs reduce in fp32 (no reduced-precision split-K reduction, no
    fp16 accumulation) and fp32 GEMMs do not use TF32; the previous settings are restored after. These
    are process-wide switches read on the host at each call: switching them off only makes another
    thread's GEMM more exact, never less."""
    flags = [f for f in ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction",
                         "allow_fp16_accumulation", "allow_tf32") if hasattr(torch.backends.cuda.matmul, f)]
    mm = torch.backends.cuda.matmul
    with warnings.catch_warnings():  # newer torch warns that allow_tf32 gives way to fp32_precision
        warnings.simplefilter("ignore")
        old = {f: getattr(mm, f) for f in flags}
        for f in flags:
            if old[f]:
                setattr(mm, f, False)
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for f in flags:
                if old[f]:
                    setattr(mm, f, old[f])


def _run_cublas(a: Tensor, b: Tensor, bias: Tensor | None, out_dtype: torch.dtype, acc: Tensor | None) -> Tensor:
    with exact_cuda_math():
        if acc is not None:
            return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        if out_dtype == a.dtype and (bias is None or bias.dtype == a.dtype):
            return torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)
        r = torch.mm(a, b, out_dtype=torch.float32)
        if bias is not None:
            r += bias
        return r if out_dtype == torch.float32 else r.to(out_dtype)  # the one rounding


def _run_aten(a: Tensor, b: Tensor, bias: Tensor | None, out_dtype: torch.dtype, acc: Tensor | None) -> Tensor:
    if acc is None and out_dtype == a.dtype and (bias is None or bias.dtype == a.dtype):
        return torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)
    # an fp32 C: ATen's 16-bit -> fp32 GEMM takes row-major operands (a transposed view is copied)
    a_r = a if _row_major(a) else a.contiguous()
    b_r = b if _row_major(b) else b.contiguous()
    copies = (a_r.nbytes if a_r is not a else 0) + (b_r.nbytes if b_r is not b else 0)
    mm_f32 = _mm_f32()
    if acc is not None:
        c = acc if _row_major(acc) else acc.contiguous()
        mm_f32(a_r, b_r, c, True)
        if c is not acc:
            acc.copy_(c)
        _note_temps(copies + (c.nbytes if c is not acc else 0))
        return acc
    c = torch.empty(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
    if bias is not None:
        c.copy_(bias.expand(c.shape))
    mm_f32(a_r, b_r, c, bias is not None)
    if out_dtype == torch.float32:
        _note_temps(copies + c.nbytes)
        return c
    out = c.to(out_dtype)  # the one rounding
    _note_temps(copies + c.nbytes + out.nbytes)
    return out


#: The upcast route converts row blocks of ``a`` of about this many bytes (fp32 copy + fp32 product) at
#: a time, so its temporaries do not grow with the batch: the fp32 copy of ``b`` (a weight) and one block.
CPU_BLOCK_BYTES = 4 << 20


def _run_upcast(a: Tensor, b: Tensor, bias: Tensor | None, out_dtype: torch.dtype, acc: Tensor | None) -> Tensor:
    with exact_cuda_math() if a.is_cuda else contextlib.nullcontext():
        b32 = b.float()
        b_copy = b32.nbytes if b32 is not b else 0
        if acc is not None:
            a32 = a.float()
            acc.addmm_(a32, b32)  # beta = 1 in the fp32 GEMM: no product temporary
            _note_temps(a32.nbytes + b_copy)
            return acc
        m, k = a.shape
        n = b.shape[1]
        bias32 = None if bias is None else bias.float()
        out = torch.empty(m, n, dtype=out_dtype, device=a.device)
        fp32_out = out_dtype == torch.float32
        rows = m if fp32_out else max(64, CPU_BLOCK_BYTES // (4 * (k + n)))
        block = 0
        for i in range(0, m, rows):
            a32 = a[i:i + rows].float()
            dst = out[i:i + rows]
            r = torch.mm(a32, b32, out=dst) if fp32_out else a32 @ b32
            if bias32 is not None:
                r += bias32
            if not fp32_out:
                dst.copy_(r)  # the one rounding of this block
            block = max(block, a32.nbytes + (0 if fp32_out else r.nbytes))
            del a32, r
        _note_temps(b_copy + block + out.nbytes)  # out: made inside the op, not yet seen by a dispatch mode
        return out


_RUNS: dict[str, Callable[[Tensor, Tensor, Tensor | None, torch.dtype, Tensor | None], Tensor]] = {
    "triton": _run_triton, "cublas": _run_cublas, "aten": _run_aten, "upcast": _run_upcast}


# ---- which routes may run a problem ---------------------------------------------------------------
def platform_route(device: torch.device) -> str:
    """The platform GEMM's route name on ``device``: ``cublas`` on CUDA, ``aten`` elsewhere."""
    return "cublas" if device.type == "cuda" else "aten"


def forced_route(device: torch.device) -> str | None:
    """The route ``MPKERN_MATMUL_ROUTE`` forces on ``device`` (``cublas`` and ``aten`` both mean the
    platform's GEMM), or None for ``auto`` / unset. An unknown value is a ValueError."""
    val = os.environ.get(ENV, "").strip().lower()
    if val in ("", "auto"):
        return None
    if val not in ROUTES:
        raise ValueError(f"{ENV}={val!r} is not a route; expected auto, {', '.join(ROUTES)}")
    return platform_route(device) if val in ("cublas", "aten") else val


def candidates(device: torch.device, dtype: torch.dtype, out_dtype: torch.dtype, epilogue: str,
               bias_dtype: torch.dtype | None = None) -> dict[str, str]:
    """``{route: ""}`` for each route that honours the contract for this problem on ``device``, and
    ``{route: why not}`` for the others (``epilogue``: ``none``, ``bias`` or ``accumulate``)."""
    backend = _backend.select(device)
    if backend == "triton":
        return {"triton": ""} | {r: "MPKERN_BACKEND=triton" for r in ROUTES if r != "triton"}
    why: dict[str, str] = {}
    if device.type == "cuda":
        why["triton"] = (_backend.runs_on("triton", device) if _backend.forced() is None
                         else f"MPKERN_BACKEND={backend}")
        if epilogue == "accumulate" and not _has_addmm_accumulate("cuda"):
            why["cublas"] = ("this torch has no torch.addmm(fp32 C, 16-bit a, b, out_dtype=float32): the accumulation "
                             "would need a temporary product")
        elif (out_dtype == torch.float32 or (bias_dtype not in (None, dtype))) and not _has_mm_out_dtype("cuda"):
            why["cublas"] = "this torch has no torch.mm(..., out_dtype=torch.float32) on CUDA"
        else:
            why["cublas"] = ""
        why["aten"] = "a CPU route"
        why["upcast"] = "" if why["triton"] else "Triton runs here (the upcast route is the fallback without it)"
        return why
    why["triton"] = _backend.runs_on("triton", device) or "Triton runs on CPU tensors only with MPKERN_BACKEND=triton"
    why["cublas"] = "a CUDA route"
    native_16 = epilogue != "accumulate" and out_dtype == dtype and bias_dtype in (None, dtype)
    if device.type != "cpu":
        why["aten"] = f"a CPU route, got {device}"
    elif native_16:
        why["aten"] = "" if aten_accumulates_in_fp32(dtype, bias_dtype is not None) else (
            f"ATen's {dtype} GEMM on this CPU does not keep fp32 accumulation with one rounding (probed)")
    else:
        why["aten"] = "" if _mm_f32() is not None else "the native extension (mpkern::mm_f32_) is not loaded"
    why["upcast"] = ""
    return why


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())
    return f"{device.type}:{cpu_name()}"


@cache
def _cuda_name(index: int) -> str:
    cap = torch.cuda.get_device_capability(index)
    return f"cuda:{torch.cuda.get_device_name(index)}:sm_{cap[0]}{cap[1]}"


def _bucket(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _layout(a: Tensor, b: Tensor) -> str:
    return "".join("n" if t.stride(1) == 1 else "t" if t.stride(0) == 1 else "g" for t in (a, b))


def problem(a: Tensor, b: Tensor, out_dtype: torch.dtype, epilogue: str) -> Problem:
    """The cache key of ``a (M, K) @ b (K, N)``: device, dtypes, epilogue, layout, size buckets."""
    return Problem(_device_name(a.device), str(a.dtype).removeprefix("torch."),
                   str(out_dtype).removeprefix("torch."), epilogue, _layout(a, b),
                   _bucket(a.shape[0]), _bucket(b.shape[1]), _bucket(a.shape[1]))


#: Decisions already taken, by the exact call (device, dtypes, shapes, strides, the accumulation and the
#: two environment variables): a later call costs one dict lookup. Emptied when it holds _DECIDED_MAX
#: calls (a run with ever-new shapes must not grow it without end; the buckets' choices stay in
#: route_cache, so refilling costs lookups, not timings).
_decided: dict[tuple[Any, ...], str] = {}
_DECIDED_MAX = 4096


def route_for(a: Tensor, b: Tensor, bias: Tensor | None, out_dtype: torch.dtype, acc: Tensor | None = None) -> str:
    """The route that runs ``a @ b (+ bias)`` into ``out_dtype``, or ``acc += a @ b`` (see the module
    docstring for the rules).

    The first call of a problem with several candidates times them (an accumulation on a scratch
    tensor, so nothing the caller holds changes); later calls look the choice up."""
    fast = (a.device, a.dtype, out_dtype, None if bias is None else bias.dtype, acc is None, a.shape, a.stride(),
            b.shape, b.stride(), os.environ.get(ENV), os.environ.get(_backend.ENV))
    route = _decided.get(fast)
    if route is not None:
        return route
    device = a.device
    epilogue = "accumulate" if acc is not None else "bias" if bias is not None else "none"
    why = candidates(device, a.dtype, out_dtype, epilogue, None if bias is None else bias.dtype)
    ok = [r for r in ROUTES if not why.get(r, "n/a")]
    forced = forced_route(device)
    if forced is not None and why.get(forced, "") == "MPKERN_BACKEND=triton":
        forced = None  # MPKERN_BACKEND=triton (the interpreter tests) decides before the route variable
    if forced is not None:
        if forced not in ok:
            gemm = f"{a.dtype} {tuple(a.shape)} @ {tuple(b.shape)} -> {out_dtype}, {epilogue}"
            raise ValueError(f"{ENV}={os.environ.get(ENV, '').strip()} cannot run this GEMM ({gemm}) on {device}: "
                             f"{why[forced]}")
        route = forced
    elif len(ok) == 1:
        route = ok[0]
    else:
        default = platform_route(device) if platform_route(device) in ok else ok[0]
        if not route_cache.timing_allowed(device):
            known = route_cache.remembered(problem(a, b, out_dtype, epilogue))
            return known if known in ok else default  # not kept in _decided: an eager call measures later
        scratch = None if acc is None else torch.zeros_like(acc)
        runs = {r: partial(_RUNS[r], a, b, bias, out_dtype, scratch) for r in ok}
        route = route_cache.choose(problem(a, b, out_dtype, epilogue), device, runs, default)
    if len(_decided) >= _DECIDED_MAX:
        _decided.clear()
    _decided[fast] = route
    return route


def forget() -> None:
    """Forget every decision (in memory; the disk file stays): the next call of each problem decides
    again -- after changing what may run (e.g. ``torch.backends`` flags a candidate rule reads)."""
    _decided.clear()
    route_cache.forget()
    for probe in (aten_accumulates_in_fp32, _has_mm_out_dtype, _has_addmm_accumulate):
        clear = getattr(probe, "cache_clear", None)  # None when a test replaced the probe
        if clear is not None:
            clear()


def run(a: Tensor, b: Tensor, bias: Tensor | None, out_dtype: torch.dtype, acc: Tensor | None = None) -> Tensor:
    """``a @ b (+ bias)`` in a new (M, N) tensor of ``out_dtype``, or ``acc += a @ b`` (fp32 ``acc``,
    returned), on the chosen route. ``a`` (M, K), ``b`` (K, N): 2-D, validated by the caller."""
    return _RUNS[route_for(a, b, bias, out_dtype, acc)](a, b, bias, out_dtype, acc)
