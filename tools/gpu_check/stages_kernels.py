"""The device and memory-bound kernel stages of ``scripts/gpu_check.sh``: what only a GPU can show,
each stage one process that writes its own JSON file after every row (so a stage cut off by its
time limit keeps what it measured), raw measurements only -- rates are computed by the summary
(:mod:`.tables`).

``python -m tools.gpu_check.stages_kernels STAGE --out DIR [options]``, STAGE one of:

* ``device``   -- the CUDA build is there, runs on this GPU and is selected; ``mpkern.info()``; the
  measured copy bandwidth (a 1 GiB ``copy_`` and an in-place multiply, CUDA events) -> ``device.json``.
* ``unscale``  -- ``mpkern.unscale_`` (clip at 1.0) on each GPU backend (cuda, triton) and PyTorch's
  ``_amp_foreach_non_finite_check_and_unscale_`` + ``clip_grad_norm_`` on the same bf16 grads
  (:func:`mpkern.bench.common.unscale_problem`) -> ``unscale.json``. Bytes per param:
  ``bytemodel.UNSCALE_TRAFFIC``.
* ``adamw``    -- ``mpkern.unscale_(opt)`` + ``FusedAdamWMP.step`` in every storage mode that has a
  kernel on ``--backend`` (the storage registry's list), the headline modes first, on
  :func:`mpkern.bench.common.adamw_problem`; with ``--peer`` also the AMP recipe on fp32 params
  (:func:`mpkern.bench.common.amp_fp32_recipe`: unscale + clip + fused AdamW) -> ``adamw_<backend>.json``.
  Bytes per param: ``bytemodel.STEP_TRAFFIC`` (fp32 mode, peer) and, for the compact modes,
  :func:`mpkern.bench.modes.step_bytes_per_param` (the same count, from the storage descriptions).

Every row has three times (ms per call, :mod:`mpkern.measure`): ``timing.kernel_ms`` (CUDA events
over back-to-back calls queued behind a device-side hold: kernel time without host gaps),
``timing.wall_ms`` (host + device per call, what a training loop sees) and ``graph.kernel_ms`` (the
same call captured once in a CUDA graph and replayed). The optimizers are built with
``capturable=True`` for all three, so all three run the same kernels.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from typing import Any

from .gpu import INV_SCALE, adamw_optimizer, backend_ok, free, log, meta, resolve, times
from .harness import StageFile, run_stage, short_error
from .rows import mem_row

__all__ = ["SIZES", "STAGES", "main", "ordered_modes", "stage_adamw", "stage_device", "stage_unscale"]

#: the problem sizes: params (elements), tensors; chosen so the working set is far above the L2
#: cache (H100/H200: 50-60 MB) -- unscale 128M bf16 grads (256 MB), adamw 32M params (~1 GB a step)
SIZES = {"unscale": (128_000_000, 200), "adamw": (32_000_000, 200)}
STAGES = ("device", "unscale", "adamw")


def stage_device(out: str) -> int:
    """The CUDA build checks, ``mpkern.info()`` and the measured copy bandwidth -> ``device.json``.
    Exit status 1 when the CUDA kernels are not built, cannot run here or are not selected (the
    bandwidth is measured anyway)."""
    import mpkern
    from mpkern.measure import copy_bandwidth

    sf = StageFile(os.path.join(out, "device.json"), "device")
    dev = resolve(None)
    sf.set(meta=meta(dev))
    info = mpkern.info()
    native = info["native"]
    checks: dict[str, Any] = {
        "native": "imported" if native["imported"] else f"not importable: {native['error']}",
        "cuda_built": native["cuda_built"], "cuda_archs": native["cuda_archs"], "problem": native["cuda_problem"],
        "selected": info["selected_backend"], "triton": backend_ok("triton", dev) or "runs"}
    sf.set(checks=checks, info=info)
    log(f"checks: {checks}")
    bw = copy_bandwidth(dev, 1 << 30)
    sf.set(bandwidth=bw)
    c = bw["copy"]
    log(f"copy: {c['bytes_moved'] / (c['kernel_ms'] * 1e-3) / 1e9:.0f} GB/s ({c['kernel_ms']:.3f} ms per 1 GiB copy_)")
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
    from mpkern import bytemodel
    from mpkern.bench.common import tensor_sizes, torch_unscale_clip, unscale_problem

    total, count = params or SIZES["unscale"][0], tensors or SIZES["unscale"][1]
    sf = StageFile(os.path.join(out, "unscale.json"), "unscale", kernel="unscale",
                   backend=", ".join((*backends, "torch")))
    dev = resolve(device)
    sf.set(meta=meta(dev, params=total, tensors=count, max_norm=1.0),
           planned=[f"mpkern.unscale_ ({b})" for b in backends] + ["torch recipe"])
    ps = unscale_problem(dev, tensor_sizes(total, count))
    inv = torch.tensor(INV_SCALE, device=dev)
    ours, theirs = bytemodel.UNSCALE_TRAFFIC["mpkern"], bytemodel.UNSCALE_TRAFFIC["torch"]
    for name in backends:
        impl = f"mpkern.unscale_ ({name})"
        why = backend_ok(name, dev)
        if why:
            sf.add_row(mem_row("unscale", impl, name, bytes_per_param=ours, bytes_source="bytemodel.UNSCALE_TRAFFIC"
                               "['mpkern']", params=total, error=f"backend unavailable: {why}"))
            continue
        try:
            with mpkern.use_backend(name):
                t, g, gerr = times(lambda: mpkern.unscale_(ps, inv, max_norm=1.0), dev)
            sf.add_row(mem_row("unscale", impl, name, bytes_per_param=ours,
                               bytes_source="bytemodel.UNSCALE_TRAFFIC['mpkern']", params=total, timing=t, graph=g,
                               graph_error=gerr))
            log(f"{impl}: kernel {t['kernel_ms']:.3f} ms, wall {t['wall_ms']:.3f} ms, graph "
                f"{g['kernel_ms'] if g else gerr}")
        except Exception as e:  # noqa: BLE001 -- the row says why; the next backend still runs
            traceback.print_exc()
            sf.add_row(mem_row("unscale", impl, name, bytes_per_param=ours, bytes_source="bytemodel.UNSCALE_TRAFFIC"
                               "['mpkern']", params=total, error=short_error(e)))

    def recipe() -> None:
        torch_unscale_clip(ps, inv, 1.0)

    impl = "torch recipe"
    try:
        t, g, gerr = times(recipe, dev)
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


def ordered_modes(backend: str) -> list[tuple[Any, str]]:
    """Every ``(master_weights, state_dtype)`` with a kernel on ``backend`` for bf16 params, the
    headline modes (:func:`mpkern.bench.modes.adamw_modes`'s ``"default"``) first."""
    import torch

    from mpkern.bench.modes import adamw_modes
    from mpkern.optim import storage

    every = storage.modes(torch.bfloat16, backend=backend)
    head = [m for m in adamw_modes("default") if m in every]
    return head + [m for m in every if m not in head]


def stage_adamw(out: str, backend: str, *, peer: bool = False, params: int | None = None,
                tensors: int | None = None, modes: list[tuple[Any, str]] | None = None, device: Any = None) -> int:
    """``mpkern.unscale_(opt)`` + ``FusedAdamWMP.step`` on bf16 params in every storage mode on ``backend``
    (and with ``peer`` the AMP recipe on fp32 params) -> ``adamw_<backend>.json``. ``device``: the
    current GPU unless given (``backend`` must then run there)."""
    import torch

    import mpkern
    from mpkern import BACKENDS, bytemodel
    from mpkern.bench.common import ADAMW_LR, ADAMW_MAX_NORM, adamw_problem, amp_fp32_recipe, tensor_sizes
    from mpkern.bench.modes import adamw_modes, mode_label, step_bytes_per_param
    from mpkern.measure import sync
    from mpkern.optim import storage

    if backend not in BACKENDS:
        raise ValueError(f"stage_adamw: backend must be one of {BACKENDS}, got {backend!r}")
    total, count = params or SIZES["adamw"][0], tensors or SIZES["adamw"][1]
    sf = StageFile(os.path.join(out, f"adamw_{backend}.json"), f"adamw_{backend}", kernel="adamw", backend=backend)
    dev = resolve(device)
    mode_list = list(modes) if modes is not None else ordered_modes(backend)
    no_kernel = [mode_label(mw, sd) for mw, sd in adamw_modes("all") if (mw, sd) not in mode_list]
    sf.set(meta=meta(dev, params=total, tensors=count, lr=ADAMW_LR, max_norm=ADAMW_MAX_NORM, capturable=True,
                     modes_without_a_kernel_here=no_kernel),
           planned=[mode_label(mw, sd) for mw, sd in mode_list] + (["torch AMP recipe, fp32 params"] if peer else []))
    grads16, init = adamw_problem(dev, tensor_sizes(total, count))
    inv = torch.tensor(INV_SCALE, device=dev)
    why = backend_ok(backend, dev)
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
            with mpkern.use_backend(backend):
                opt = adamw_optimizer(init, grads16, mw, sd, ADAMW_LR)

                def step(opt: Any = opt) -> None:
                    mpkern.unscale_(opt, inv, max_norm=ADAMW_MAX_NORM)  # deferred into the step: grads only read
                    opt.step()

                t0 = time.perf_counter()
                step()  # the first step: state, tables (and on triton, the kernel's compile)
                sync(dev)
                first_s = time.perf_counter() - t0
                t, g, gerr = times(step, dev)
            sf.add_row(mem_row("adamw", "FusedAdamWMP", backend, mode=label, bytes_per_param=bpp, bytes_source=src,
                               params=total, timing=t, graph=g, graph_error=gerr, first_step_s=first_s,
                               master_weights=mw, state_dtype=sd))
            log(f"adamw {backend} {label}: first step {first_s:.2f} s, kernel {t['kernel_ms']:.3f} ms, wall "
                f"{t['wall_ms']:.3f} ms, graph {g['kernel_ms'] if g else gerr}")
        except Exception as e:  # noqa: BLE001 -- the row says why; the next mode still runs
            traceback.print_exc()
            sf.add_row(mem_row("adamw", "FusedAdamWMP", backend, mode=label, bytes_per_param=bpp, bytes_source=src,
                               params=total, error=short_error(e)))
        del opt
        free(dev)
    if peer:
        impl = "torch AMP recipe, fp32 params"
        bpp = bytemodel.STEP_TRAFFIC["amp_fp32"]
        capturable = dev.type == "cuda"
        try:
            recipe, _restore, _opt = amp_fp32_recipe(init, grads16, inv, ADAMW_LR, capturable=capturable)
            recipe()  # never restored: at inv_scale 1 and max_norm 1 the grads settle at norm 1
            t, g, gerr = times(recipe, dev)
            sf.add_row(mem_row("adamw", impl, "torch", bytes_per_param=bpp, bytes_source="bytemodel.STEP_TRAFFIC"
                               "['amp_fp32']", params=total, timing=t, graph=g, graph_error=gerr, peer=True,
                               method="bench.common.amp_fp32_recipe: _amp_foreach_non_finite_check_and_unscale_ + "
                                      f"clip_grad_norm_(foreach) + AdamW(fused=True, capturable={capturable})"))
        except Exception as e:  # noqa: BLE001 -- the row says why; the next row still runs
            traceback.print_exc()
            sf.add_row(mem_row("adamw", impl, "torch", bytes_per_param=bpp, bytes_source="bytemodel.STEP_TRAFFIC"
                               "['amp_fp32']", params=total, error=short_error(e), peer=True))
    sf.finish()
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring). Exit status: 0 done, 1 a check failed (device
    stage) or the stage failed, 2 bad arguments, 3 no GPU, 130 interrupted (the stage file then says
    ``interrupted``): :func:`.harness.run_stage`."""
    ap = argparse.ArgumentParser(prog="python -m tools.gpu_check.stages_kernels", description=__doc__,
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
    if args.stage == "device":
        return run_stage(args.out, ["device.json"], lambda: stage_device(args.out))
    if args.stage == "unscale":
        return run_stage(args.out, ["unscale.json"], lambda: stage_unscale(args.out, params, args.tensors))
    return run_stage(args.out, [f"adamw_{args.backend}.json"],
                     lambda: stage_adamw(args.out, args.backend, peer=args.peer, params=params, tensors=args.tensors))


if __name__ == "__main__":
    sys.exit(main())
