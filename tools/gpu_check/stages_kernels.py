"""The benchmark stages of ``scripts/gpu_check.sh``: what only a GPU can show, each stage one process
that writes its own JSON file after every row (so a stage cut off by its time limit keeps what it
measured), raw measurements only -- rates are computed by :mod:`mpkern.bench.gpu_summary`.

``python -m mpkern.bench.gpu_stages STAGE --out DIR [options]``, STAGE one of:

* ``device``   -- the CUDA build is there, runs on this GPU and is selected; ``mpkern.info()``; the
  measured copy bandwidth (a 1 GiB ``copy_`` and an in-place multiply, CUDA events) -> ``device.json``.
* ``unscale``  -- ``mpkern.unscale_`` (clip at 1.0) on each GPU backend (cuda, triton) and PyTorch's
  ``_amp_foreach_non_finite_check_and_unscale_`` + ``clip_grad_norm_`` on the same bf16 grads
  -> ``unscale.json``. Bytes per param: ``bytemodel.UNSCALE_TRAFFIC``.
* ``adamw``    -- ``mpkern.unscale_(opt)`` + ``FusedAdamWMP.step`` in every storage mode that has a
  kernel on ``--backend`` (the storage registry's list), the headline modes first; with ``--peer``
  also the AMP recipe on fp32 params (unscale + clip + fused AdamW) -> ``adamw_<backend>.json``.
  Bytes per param: ``bytemodel.STEP_TRAFFIC`` (fp32 mode, peer) and, for the compact modes,
  :func:`mpkern.bench.modes.step_bytes_per_param` (the same count, from the storage descriptions).
* ``matmul``   -- ``mpkern.matmul`` with the fixed Triton config (``MPKERN_MATMUL_CONFIG=fixed``: no
  tuning) against cuBLAS (``torch.matmul``; ``torch.mm(out_dtype=fp32)``) and the ``+= main_grad``
  weight-gradient GEMM against its PyTorch peer -> ``matmul.json``.
* ``matmul_tuned`` -- one bf16 shape (the LLM-layer forward GEMM) through the autotuner (one tuning,
  at most the kernel's config list, timed as ``tuning_s``) against cuBLAS -> ``matmul_tuned.json``.

Every memory-bound row has three times (ms per call, :mod:`mpkern.measure`): ``timing.kernel_ms``
(CUDA events over back-to-back calls queued behind a device-side hold: kernel time without host
gaps), ``timing.wall_ms`` (host + device per call, what a training loop sees) and
``graph.kernel_ms`` (the same call captured once in a CUDA graph and replayed). The optimizers are
built with ``capturable=True`` for all three, so all three run the same kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from typing import Any

from .gpu_rows import StageFile, matmul_row, mem_row, short_error

__all__ = ["StageFile", "mem_row", "matmul_row", "stage_device", "stage_unscale", "stage_adamw", "stage_matmul",
           "stage_matmul_routes",
           "STAGES", "main"]

#: the problem sizes: params (elements), tensors; chosen so the working set is far above the L2
#: cache (H100/H200: 50-60 MB) -- unscale 128M bf16 grads (256 MB), adamw 32M params (~1 GB a step)
SIZES = {"unscale": (128_000_000, 200), "adamw": (32_000_000, 200)}
#: timing: back-to-back calls per round, rounds (median), warm-up calls
CALLS, ROUNDS, WARMUP = 20, 5, 3
#: the inverse loss scale of every row: 1.0 as a device tensor, so the peers' repeated in-place
#: unscale + clip settles at norm max_norm instead of decaying towards zero over the timed calls
INV_SCALE = 1.0


def _gpu() -> Any:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU visible to torch (torch.cuda.is_available() is False)")
    return torch.device("cuda", torch.cuda.current_device())


def _backend_ok(name: str, dev: Any) -> str:
    """Empty if mpkern's backend ``name`` runs on ``dev``, else why not."""
    from mpkern import _backend

    try:
        with _backend.use_backend(name):
            _backend.select(dev)
    except RuntimeError as e:
        return str(e)
    return ""


def _times(fn: Callable[[], object], dev: Any, graph: bool = True) -> tuple[dict, dict | None, str | None]:
    """``(eager timing, graph timing or None, graph error or None)`` of ``fn`` on ``dev``."""
    from mpkern.measure import event_time, graph_time

    t = event_time(fn, dev, calls=CALLS, rounds=ROUNDS, warmup=WARMUP)
    if not graph:
        return t, None, "not captured"
    try:
        return t, graph_time(fn, dev, calls=CALLS, rounds=ROUNDS, warmup=WARMUP), None
    except Exception as e:  # noqa: BLE001 -- a capture that fails is a result of the run, written down
        from mpkern.measure import sync

        sync(dev)
        return t, None, short_error(e)


def _free(dev: Any) -> None:
    """Give the caching allocator's free blocks back between rows (GPU only)."""
    import torch

    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _sizes(total: int, count: int) -> list[int]:
    from .common import tensor_sizes

    return tensor_sizes(total, count)


def _meta(dev: Any, **extra: Any) -> dict[str, Any]:
    import torch

    from mpkern.measure import machine_info

    return machine_info(dev) | {"torch_cuda": torch.version.cuda, "calls": CALLS, "rounds": ROUNDS,
                                "warmup": WARMUP, "inv_scale": INV_SCALE, **extra}


def _log(msg: str) -> None:
    print(f"[gpu_stages {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- stages ---------------------------------------------------------------------------------------------
def stage_device(out: str) -> int:
    """The CUDA build checks, ``mpkern.info()`` and the measured copy bandwidth -> ``device.json``.
    Exit status 1 when the CUDA kernels are not built, cannot run here or are not selected (the
    bandwidth is measured anyway)."""
    import mpkern
    from mpkern import _backend
    from mpkern.measure import copy_bandwidth

    sf = StageFile(os.path.join(out, "device.json"), "device")
    dev = _gpu()
    sf.set(meta=_meta(dev))
    checks: dict[str, Any] = {}
    ext = _backend.native()
    checks["native"] = "imported" if ext is not None else f"not importable: {_backend.native_error()}"
    checks["cuda_built"] = bool(ext is not None and getattr(ext, "cuda_built", False))
    checks["cuda_archs"] = getattr(ext, "cuda_archs", None) if ext is not None else None
    checks["problem"] = _backend.cuda_device_problem(dev.index) if checks["cuda_built"] else "not built"
    checks["selected"] = _backend.select(dev)
    checks["triton"] = _backend_ok("triton", dev) or "runs"
    sf.set(checks=checks, info=mpkern.info())
    _log(f"checks: {checks}")
    bw = copy_bandwidth(dev, 1 << 30)
    sf.set(bandwidth=bw)
    c = bw["copy"]
    _log(f"copy: {c['bytes_moved'] / (c['kernel_ms'] * 1e-3) / 1e9:.0f} GB/s ({c['kernel_ms']:.3f} ms per 1 GiB copy_)")
    ok = checks["cuda_built"] and not checks["problem"] and checks["selected"] == "cuda"
    sf.finish("done" if ok else "failed", None if ok else f"the CUDA kernels are not in use: {checks}")
    return 0 if ok else 1


def stage_unscale(out: str, params: int | None = None, tensors: int | None = None, *, device: Any = None,
                  backends: tuple[str, ...] = ("cuda", "triton")) -> int:
    """``mpkern.unscale_`` on the cuda and triton backends and PyTorch's recipe, same bf16 grads.
    ``device``/``backends``: the current GPU and its two backends unless given (a CPU test drives
    the stage's plumbing on the cpu backend with a stand-in timer)."""
    import torch

    import mpkern
    from mpkern import _backend, bytemodel

    total, count = params or SIZES["unscale"][0], tensors or SIZES["unscale"][1]
    sf = StageFile(os.path.join(out, "unscale.json"), "unscale", kernel="unscale",
                   backend=", ".join((*backends, "torch")))
    dev = _gpu() if device is None else torch.device(device)
    sf.set(meta=_meta(dev, params=total, tensors=count, max_norm=1.0),
           planned=[f"mpkern.unscale_ ({b})" for b in backends] + ["torch recipe"])
    gen = torch.Generator(device=dev).manual_seed(0)
    ps = []
    for n in _sizes(total, count):
        p = torch.nn.Parameter(torch.empty(n, dtype=torch.bfloat16, device=dev))
        p.grad = (torch.randn(n, device=dev, generator=gen) * 64).to(torch.bfloat16)
        ps.append(p)
    inv = torch.tensor(INV_SCALE, device=dev)
    ours, theirs = bytemodel.UNSCALE_TRAFFIC["mpkern"], bytemodel.UNSCALE_TRAFFIC["torch"]
    for name in backends:
        impl = f"mpkern.unscale_ ({name})"
        why = _backend_ok(name, dev)
        if why:
            sf.add_row(mem_row("unscale", impl, name, bytes_per_param=ours, bytes_source="bytemodel.UNSCALE_TRAFFIC"
                               "['mpkern']", params=total, error=f"backend unavailable: {why}"))
            continue
        try:
            with _backend.use_backend(name):
                t, g, gerr = _times(lambda: mpkern.unscale_(ps, inv, max_norm=1.0), dev)
            sf.add_row(mem_row("unscale", impl, name, bytes_per_param=ours,
                               bytes_source="bytemodel.UNSCALE_TRAFFIC['mpkern']", params=total, timing=t, graph=g,
                               graph_error=gerr))
            _log(f"{impl}: kernel {t['kernel_ms']:.3f} ms, wall {t['wall_ms']:.3f} ms, graph "
                 f"{g['kernel_ms'] if g else gerr}")
        except Exception as e:  # noqa: BLE001 -- the row says why; the next backend still runs
            traceback.print_exc()
            sf.add_row(mem_row("unscale", impl, name, bytes_per_param=ours, bytes_source="bytemodel.UNSCALE_TRAFFIC"
                               "['mpkern']", params=total, error=short_error(e)))

    from .common import torch_unscale_clip

    def recipe() -> None:
        torch_unscale_clip(ps, inv, 1.0)

    impl = "torch recipe"
    try:
        t, g, gerr = _times(recipe, dev)
        sf.add_row(mem_row("unscale", impl, "torch", bytes_per_param=theirs,
                           bytes_source="bytemodel.UNSCALE_TRAFFIC['torch']", params=total, timing=t, graph=g,
                           graph_error=gerr, peer=True,
                           method="bench.common.torch_unscale_clip: _amp_foreach_non_finite_check_and_unscale_ "
                                  "(bf16 on CUDA: _foreach_mul_) + clip_grad_norm_(foreach=True)"))
    except Exception as e:  # noqa: BLE001 -- the row says why; the next row still runs
        traceback.print_exc()
        sf.add_row(mem_row("unscale", impl, "torch", bytes_per_param=theirs,
                           bytes_source="bytemodel.UNSCALE_TRAFFIC['torch']", params=total, error=short_error(e),
                           peer=True))
    sf.finish()
    return 0


def _ordered_modes(backend: str) -> list[tuple[Any, str]]:
    """Every ``(master_weights, state_dtype)`` with a kernel on ``backend`` for bf16 params, the
    headline modes (the registry's ``DEFAULT_MODES``) first."""
    import torch

    from mpkern.optim import storage

    every = storage.modes(torch.bfloat16, backend=backend)
    head = [m for m in storage.DEFAULT_MODES if m in every]
    return head + [m for m in every if m not in head]


def stage_adamw(out: str, backend: str, *, peer: bool = False, params: int | None = None,
                tensors: int | None = None, modes: list[tuple[Any, str]] | None = None, device: Any = None) -> int:
    """``mpkern.unscale_(opt)`` + ``FusedAdamWMP.step`` on bf16 params in every storage mode on ``backend``
    (and with ``peer`` the AMP recipe on fp32 params) -> ``adamw_<backend>.json``. ``device``: the
    current GPU unless given (``backend`` must then run there)."""
    import torch

    import mpkern
    from mpkern import _backend, bytemodel
    from mpkern.measure import sync
    from mpkern.optim import storage

    from .common import ADAMW_LR, ADAMW_MAX_NORM, unscale_clip
    from .modes import mode_label, optimizer_kwargs, step_bytes_per_param

    if backend not in _backend.BACKENDS:
        raise ValueError(f"stage_adamw: backend must be one of {_backend.BACKENDS}, got {backend!r}")
    total, count = params or SIZES["adamw"][0], tensors or SIZES["adamw"][1]
    sf = StageFile(os.path.join(out, f"adamw_{backend}.json"), f"adamw_{backend}", kernel="adamw", backend=backend)
    dev = _gpu() if device is None else torch.device(device)
    mode_list = list(modes) if modes is not None else _ordered_modes(backend)
    no_kernel = [storage.label(mw, sd) for mw, sd in storage.modes(torch.bfloat16) if (mw, sd) not in mode_list]
    sf.set(meta=_meta(dev, params=total, tensors=count, lr=ADAMW_LR, max_norm=ADAMW_MAX_NORM, capturable=True,
                      modes_without_a_kernel_here=no_kernel),
           planned=[mode_label(mw, sd) for mw, sd in mode_list] + (["torch AMP recipe, fp32 params"] if peer else []))
    gen = torch.Generator(device=dev).manual_seed(1)
    sizes = _sizes(total, count)
    grads16 = [(torch.randn(n, device=dev, generator=gen) * 64).to(torch.bfloat16) for n in sizes]
    init = [torch.randn(n, device=dev, generator=gen) * 0.02 for n in sizes]
    inv = torch.tensor(INV_SCALE, device=dev)
    why = _backend_ok(backend, dev)
    for mw, sd in mode_list:
        label = mode_label(mw, sd)
        fp32 = (mw is True and storage.moment_name(sd) == "float32")
        bpp = bytemodel.STEP_TRAFFIC["mpkern"] if fp32 else step_bytes_per_param(mw, sd)
        src = "bytemodel.STEP_TRAFFIC['mpkern']" if fp32 else "bench.modes.step_bytes_per_param (storage descriptions)"
        if why:
            sf.add_row(mem_row("adamw", "FusedAdamWMP", backend, mode=label, bytes_per_param=bpp, bytes_source=src,
                               params=total, error=f"backend unavailable: {why}"))
            continue
        opt = None
        try:
            with _backend.use_backend(backend):
                ps = [torch.nn.Parameter(w.to(torch.bfloat16)) for w in init]
                for p, x in zip(ps, grads16):
                    p.grad = x
                opt = mpkern.FusedAdamWMP(ps, lr=ADAMW_LR, capturable=True, **optimizer_kwargs(mw, sd))

                def step(opt: Any = opt) -> None:
                    mpkern.unscale_(opt, inv, max_norm=ADAMW_MAX_NORM)  # deferred into the step: grads only read
                    opt.step()

                t0 = time.perf_counter()
                step()  # the first step: state, tables (and on triton, the kernel's compile)
                sync(dev)
                first_s = time.perf_counter() - t0
                t, g, gerr = _times(step, dev)
            sf.add_row(mem_row("adamw", "FusedAdamWMP", backend, mode=label, bytes_per_param=bpp, bytes_source=src,
                               params=total, timing=t, graph=g, graph_error=gerr, first_step_s=first_s,
                               master_weights=mw, state_dtype=sd))
            _log(f"adamw {backend} {label}: first step {first_s:.2f} s, kernel {t['kernel_ms']:.3f} ms, wall "
                 f"{t['wall_ms']:.3f} ms, graph {g['kernel_ms'] if g else gerr}")
        except Exception as e:  # noqa: BLE001 -- the row says why; the next mode still runs
            traceback.print_exc()
            sf.add_row(mem_row("adamw", "FusedAdamWMP", backend, mode=label, bytes_per_param=bpp, bytes_source=src,
                               params=total, error=short_error(e)))
        del opt
        _free(dev)
    if peer:
        impl = "torch AMP recipe, fp32 params"
        bpp = bytemodel.STEP_TRAFFIC["amp_fp32"]
        try:
            pa = [torch.nn.Parameter(w.clone()) for w in init]
            for p, x in zip(pa, grads16):
                p.grad = x.float()
            opt_a = torch.optim.AdamW(pa, lr=ADAMW_LR, fused=True, capturable=dev.type == "cuda")

            def recipe() -> None:
                unscale_clip(pa, inv)
                opt_a.step()

            recipe()
            t, g, gerr = _times(recipe, dev)
            sf.add_row(mem_row("adamw", impl, "torch", bytes_per_param=bpp, bytes_source="bytemodel.STEP_TRAFFIC"
                               "['amp_fp32']", params=total, timing=t, graph=g, graph_error=gerr, peer=True,
                               method="_amp_foreach_non_finite_check_and_unscale_ + clip_grad_norm_(foreach) + "
                                      "AdamW(fused=True, capturable=True)"))
        except Exception as e:  # noqa: BLE001 -- the row says why; the next row still runs
            traceback.print_exc()
            sf.add_row(mem_row("adamw", impl, "torch", bytes_per_param=bpp, bytes_source="bytemodel.STEP_TRAFFIC"
                               "['amp_fp32']", params=total, error=short_error(e), peer=True))
    sf.finish()
    return 0


def _mm_cases(tuned: bool) -> list[tuple[str, int, int, int, str, str]]:
    """(shape name, M, N, K, operand layout, dtypes) of the GEMM rows; layouts as nn.Linear's."""
    from .matmul import GPU_LLM, GPU_SQUARE

    big_m, k, n = GPU_LLM
    if tuned:
        return [(f"fwd {big_m}x{k}x{n}", big_m, n, k, "fwd", "bf16")]
    sq = GPU_SQUARE[0][0]
    return [(f"square {sq}^3", sq, sq, sq, "square", "bf16,fp16"),
            (f"fwd 4096x{k}x{n}", 4096, n, k, "fwd", "bf16,fp16"),
            (f"wgrad {n}x{k} (red. 4096)", n, k, 4096, "wgrad", "bf16")]


def _operands(layout: str, m: int, n: int, k: int, dt: Any, dev: Any) -> tuple[Any, Any]:
    import torch

    if layout == "square":
        return torch.randn(m, k, device=dev, dtype=dt) * 0.1, torch.randn(k, n, device=dev, dtype=dt)
    if layout == "fwd":  # x @ weight.t()
        return torch.randn(m, k, device=dev, dtype=dt) * 0.1, torch.randn(n, k, device=dev, dtype=dt).t()
    if layout == "wgrad":  # grad_out.t() @ x
        return (torch.randn(k, m, device=dev, dtype=dt) * 0.1).t(), torch.randn(k, n, device=dev, dtype=dt)
    raise ValueError(f"unknown layout {layout!r}")


def stage_matmul(out: str, tuned: bool = False, *, device: Any = None,
                 cases: list[tuple[str, int, int, int, str, str]] | None = None) -> int:
    """GEMM rows against cuBLAS: the fixed config (``tuned=False`` -> ``matmul.json``) or one tuned
    bf16 shape (``matmul_tuned.json``). ``device``/``cases`` (``(name, M, N, K, layout, dtypes)``,
    layout ``square``/``fwd``/``wgrad``): the current GPU and :func:`_mm_cases` unless given."""
    import torch

    import mpkern
    from mpkern.matmul import matmul_accumulate_
    from mpkern.matmul_routes import has_mm_out_dtype
    from mpkern.measure import event_time, sync
    from mpkern.triton_kernels import matmul as tk

    from .matmul import DTYPES, wgrad_accumulate_peer

    if tuned:
        os.environ.pop("MPKERN_MATMUL_CONFIG", None)
    else:
        os.environ["MPKERN_MATMUL_CONFIG"] = "fixed"
    name = "matmul_tuned" if tuned else "matmul"
    sf = StageFile(os.path.join(out, f"{name}.json"), name, kernel="matmul")
    dev = _gpu() if device is None else torch.device(device)
    if dev.type == "cuda":  # this stage measures the Triton kernel (matmul_routes: every route)
        os.environ["MPKERN_MATMUL_ROUTE"] = "triton"
    fixed = "fixed " + "x".join(str(tk.fixed_config(dev)[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
    sf.set(meta=_meta(dev, config="autotuned" if tuned else fixed))
    mm_out = has_mm_out_dtype(dev)
    cases = _mm_cases(tuned) if cases is None else list(cases)
    planned = []
    for shape, _m, _n, _k, layout, dts in cases:
        for d in dts.split(","):
            outs = [d] if tuned else [d, "fp32"]
            planned += [f"{shape} {d}->{o}" for o in outs]
            if layout == "wgrad":
                planned.append(f"{shape} {d}->+=main_grad")
    sf.set(planned=planned)
    for shape, m, n, k, layout, dts in cases:
        for dname in dts.split(","):
            dt = DTYPES[dname]
            a, b = _operands(layout, m, n, k, dt, dev)
            for oname in ([dname] if tuned else [dname, "fp32"]):
                od = dt if oname == dname else torch.float32
                if od == dt:
                    peer, peer_fn = "torch.matmul (cuBLAS)", (lambda a=a, b=b: torch.matmul(a, b))
                elif mm_out:
                    peer = "torch.mm(out_dtype=fp32)"
                    peer_fn = partial(torch.mm, a, b, out_dtype=torch.float32)
                else:
                    peer, peer_fn = "torch.matmul + .float()", (lambda a=a, b=b: torch.matmul(a, b).float())
                cfg = "tuned" if tuned else fixed
                extra: dict[str, Any] = {}
                pt = idx = None
                try:
                    pt = event_time(peer_fn, dev, calls=CALLS, rounds=ROUNDS, warmup=WARMUP)
                    if tuned:  # the peer's row first: a tuning cut off by the stage limit leaves it
                        idx = sf.add_row(matmul_row(shape, m, n, k, dname, oname, cfg, timing=None, peer=peer,
                                                    peer_timing=pt, error="autotuning did not finish"))
                        t0 = time.perf_counter()
                        mpkern.matmul(a, b, out_dtype=od)  # the one tuning run of this shape
                        sync(dev)
                        extra["tuning_s"] = time.perf_counter() - t0
                        best = tk.last_tuned_config()
                        cfg = f"tuned {best}" if best is not None else "tuned"
                    t = event_time(lambda a=a, b=b, od=od: mpkern.matmul(a, b, out_dtype=od), dev, calls=CALLS,
                                   rounds=ROUNDS, warmup=WARMUP)
                    row = matmul_row(shape, m, n, k, dname, oname, cfg, timing=t, peer=peer, peer_timing=pt, **extra)
                    _log(f"matmul {shape} {dname}->{oname} ({cfg}): {t['kernel_ms']:.3f} ms, {peer} "
                         f"{pt['kernel_ms']:.3f} ms")
                except Exception as e:  # noqa: BLE001 -- the row says why; the next row still runs
                    traceback.print_exc()
                    row = matmul_row(shape, m, n, k, dname, oname, cfg, timing=None, peer=peer, peer_timing=pt,
                                     error=short_error(e), **extra)
                if idx is None:
                    sf.add_row(row)
                else:
                    sf.replace_row(idx, row)
            if layout == "wgrad" and not tuned:
                mg = torch.zeros(m, n, device=dev, dtype=torch.float32)
                peer, fn = wgrad_accumulate_peer(dev)
                try:
                    t = event_time(lambda a=a, b=b, mg=mg: matmul_accumulate_(a, b, mg), dev, calls=CALLS,
                                   rounds=ROUNDS, warmup=WARMUP)
                    pt = event_time(lambda a=a, b=b, mg=mg, fn=fn: fn(a, b, mg), dev, calls=CALLS, rounds=ROUNDS,
                                    warmup=WARMUP)
                    sf.add_row(matmul_row(shape, m, n, k, dname, "+=main_grad", fixed, timing=t, peer=peer,
                                          peer_timing=pt))
                except Exception as e:  # noqa: BLE001 -- the row says why; the next row still runs
                    traceback.print_exc()
                    sf.add_row(matmul_row(shape, m, n, k, dname, "+=main_grad", fixed, timing=None, peer=peer,
                                          peer_timing=None, error=short_error(e)))
                del mg
            del a, b
            _free(dev)
    sf.finish()
    return 0


def stage_matmul_routes(out: str, *, device: Any = None, dtypes: str = "bf16") -> int:
    """Every route of mpkern.matmul beside torch.matmul (cuBLAS) on the square 4096^3 GEMM and the
    GPT-2-small and Llama-7B layer GEMMs (fwd, dgrad, wgrad, += main_grad; 2048 tokens), and the route
    the default took: :func:`mpkern.bench.matmul.bench_matmul` (the same rows as ``mpkern bench
    matmul --quick``), into ``matmul_routes.json`` row by row. The Triton route runs the fixed config
    (``MPKERN_MATMUL_CONFIG=fixed``: no autotuning inside the stage's limit)."""
    os.environ.setdefault("MPKERN_MATMUL_CONFIG", "fixed")
    os.environ.pop("MPKERN_MATMUL_ROUTE", None)
    from .matmul import bench_matmul

    sf = StageFile(os.path.join(out, "matmul_routes.json"), "matmul_routes", kernel="matmul")
    dev = _gpu() if device is None else device
    sf.set(meta=_meta(dev, config=os.environ["MPKERN_MATMUL_CONFIG"]))
    for r in bench_matmul(dev, quick=True, dtypes=dtypes, reps=10, log=_log):
        sf.add_row(r)
    sf.finish()
    return 0


STAGES = ("device", "unscale", "adamw", "matmul", "matmul_tuned", "matmul_routes")


def dump_stacks_later() -> None:
    """With ``MPKERN_STAGE_DUMP_AFTER=SECONDS`` (set by gpu_check.sh), dump every thread's Python stack
    to stderr after that long: a stage stuck in native code (a compile, a kernel) shows where."""
    import faulthandler

    after = os.environ.get("MPKERN_STAGE_DUMP_AFTER", "")
    if after.isdigit() and int(after) > 0:
        faulthandler.dump_traceback_later(int(after), exit=False)


def _interrupt(signum: int, frame: Any) -> None:
    """SIGTERM as KeyboardInterrupt, so a stage stopped by ``timeout`` marks its file ``interrupted``."""
    raise KeyboardInterrupt(f"signal {signum}")


def _mark_ended(out: str, files: list[str], why: str, status: str = "interrupted") -> None:
    """Set ``status`` (``interrupted``: the stage was cut off; ``failed``) and the reason in the
    stage files still ``running``."""
    for fname in files:
        path = os.path.join(out, fname)
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if data.get("status") == "running":
            data["status"], data["error"] = status, why
            tmp = f"{path}.tmp"
            with open(tmp, "w") as f:
                json.dump(data, f, indent=1, default=str)
            os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring). Exit status: 0 done, 1 a check failed (device
    stage), 2 bad arguments, 3 no GPU, 130 interrupted (the stage file then says ``interrupted``)."""
    ap = argparse.ArgumentParser(prog="python -m mpkern.bench.gpu_stages", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=STAGES)
    ap.add_argument("--out", required=True, help="output folder (the stage writes its JSON there)")
    ap.add_argument("--backend", choices=("cuda", "triton"), default="cuda", help="adamw: the mpkern backend")
    ap.add_argument("--peer", action="store_true", help="adamw: also time the PyTorch AMP recipe")
    ap.add_argument("--params", type=float, default=None, help="unscale/adamw: total params (default: SIZES)")
    ap.add_argument("--tensors", type=int, default=None, help="unscale/adamw: number of tensors")
    args = ap.parse_args(argv)
    params = None if args.params is None else int(args.params)
    if (params is not None and params < 1) or (args.tensors is not None and args.tensors < 1):
        ap.error("--params and --tensors must be positive")
    os.makedirs(args.out, exist_ok=True)
    signal.signal(signal.SIGTERM, _interrupt)
    dump_stacks_later()
    files = {"device": ["device.json"], "unscale": ["unscale.json"], "adamw": [f"adamw_{args.backend}.json"],
             "matmul": ["matmul.json"], "matmul_tuned": ["matmul_tuned.json"],
             "matmul_routes": ["matmul_routes.json"]}[args.stage]
    try:
        if args.stage == "device":
            return stage_device(args.out)
        if args.stage == "unscale":
            return stage_unscale(args.out, params, args.tensors)
        if args.stage == "adamw":
            return stage_adamw(args.out, args.backend, peer=args.peer, params=params, tensors=args.tensors)
        if args.stage == "matmul_routes":
            return stage_matmul_routes(args.out)
        return stage_matmul(args.out, tuned=args.stage == "matmul_tuned")
    except KeyboardInterrupt as e:
        _mark_ended(args.out, files, f"interrupted ({e or 'SIGINT'}: the stage's time limit)")
        return 130
    except Exception as e:  # noqa: BLE001 -- a stage process: any failure is written down and becomes its exit code
        traceback.print_exc()
        _mark_ended(args.out, files, short_error(e), "failed")
        return 3 if "no CUDA GPU" in str(e) else 1


if __name__ == "__main__":
    sys.exit(main())
