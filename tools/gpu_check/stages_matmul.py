"""The GEMM stages of ``scripts/gpu_check.sh``: each stage one process that writes its JSON file
after every row, raw times only (TFLOP/s are computed by the summary, :mod:`.tables`).

``python -m tools.gpu_check.stages_matmul STAGE --out DIR``, STAGE one of:

* ``matmul``   -- ``mpkern.matmul`` with the fixed Triton config (``MPKERN_MATMUL_CONFIG=fixed``: no
  tuning) against cuBLAS (``torch.matmul``; ``torch.mm(out_dtype=fp32)``) and the ``+= main_grad``
  weight-gradient GEMM against its PyTorch peer (:func:`mpkern.bench.matmul.wgrad_accumulate_peer`)
  -> ``matmul.json``.
* ``matmul_tuned`` -- one bf16 shape (the LLM-layer forward GEMM) through the autotuner (one tuning,
  at most the kernel's config list, timed as ``tuning_s``) against cuBLAS -> ``matmul_tuned.json``.
* ``matmul_routes`` -- every route of ``mpkern.matmul`` beside cuBLAS:
  :func:`mpkern.bench.matmul.bench_matmul`'s rows -> ``matmul_routes.json``.

The operands are :func:`mpkern.bench.matmul.operands` (nn.Linear's layouts); times are
:func:`mpkern.measure.event_time`'s (CUDA events over back-to-back calls).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from functools import partial
from typing import Any

from .gpu import CALLS, ROUNDS, WARMUP, free, log, meta, resolve
from .harness import StageFile, run_stage, short_error
from .rows import matmul_row

__all__ = ["STAGES", "main", "mm_cases", "stage_matmul", "stage_matmul_routes"]

STAGES = ("matmul", "matmul_tuned", "matmul_routes")


def mm_cases(tuned: bool) -> list[tuple[str, int, int, int, str, str]]:
    """(shape name, M, N, K, operand layout, dtypes) of the GEMM rows; layouts as
    :func:`mpkern.bench.matmul.operands`'s (nn.Linear's)."""
    from mpkern.bench.matmul import GPU_LLM, GPU_SQUARE

    big_m, k, n = GPU_LLM
    if tuned:
        return [(f"fwd {big_m}x{k}x{n}", big_m, n, k, "fwd", "bf16")]
    sq = GPU_SQUARE[0][0]
    return [(f"square {sq}^3", sq, sq, sq, "square", "bf16,fp16"),
            (f"fwd 4096x{k}x{n}", 4096, n, k, "fwd", "bf16,fp16"),
            (f"wgrad {n}x{k} (red. 4096)", n, k, 4096, "wgrad", "bf16")]


def _planned(cases: list[tuple[str, int, int, int, str, str]], tuned: bool) -> list[str]:
    """The row names a stage over ``cases`` means to write, in order (the summary lists those not reached)."""
    planned = []
    for shape, _m, _n, _k, layout, dts in cases:
        for d in dts.split(","):
            outs = [d] if tuned else [d, "fp32"]
            planned += [f"{shape} {d}->{o}" for o in outs]
            if layout == "wgrad":
                planned.append(f"{shape} {d}->+=main_grad")
    return planned


def stage_matmul(out: str, tuned: bool = False, *, device: Any = None,
                 cases: list[tuple[str, int, int, int, str, str]] | None = None) -> int:
    """GEMM rows against cuBLAS: the fixed config (``tuned=False`` -> ``matmul.json``) or one tuned
    bf16 shape (``matmul_tuned.json``). ``device``/``cases`` (``(name, M, N, K, layout, dtypes)``,
    layout ``square``/``fwd``/``wgrad``): the current GPU and :func:`mm_cases` unless given."""
    import torch

    import mpkern
    from mpkern import measure
    from mpkern.bench.matmul import DTYPES, operands, wgrad_accumulate_peer
    from mpkern.matmul import matmul_accumulate_
    from mpkern.matmul_routes import has_mm_out_dtype
    from mpkern.triton_kernels import matmul as tk

    if tuned:
        os.environ.pop("MPKERN_MATMUL_CONFIG", None)
    else:
        os.environ["MPKERN_MATMUL_CONFIG"] = "fixed"
    name = "matmul_tuned" if tuned else "matmul"
    sf = StageFile(os.path.join(out, f"{name}.json"), name, kernel="matmul")
    dev = resolve(device)
    if dev.type == "cuda":  # this stage measures the Triton kernel (matmul_routes: every route)
        os.environ["MPKERN_MATMUL_ROUTE"] = "triton"
    fixed = "fixed " + "x".join(str(tk.fixed_config(dev)[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
    sf.set(meta=meta(dev, config="autotuned" if tuned else fixed))
    mm_out = has_mm_out_dtype(dev)
    cases = mm_cases(tuned) if cases is None else list(cases)
    sf.set(planned=_planned(cases, tuned))

    def timed(fn: Any) -> dict[str, Any]:
        return measure.event_time(fn, dev, calls=CALLS, rounds=ROUNDS, warmup=WARMUP)

    for shape, m, n, k, layout, dts in cases:
        for dname in dts.split(","):
            dt = DTYPES[dname]
            a, b = operands(layout, m, n, k, dt, dev)
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
                    pt = timed(peer_fn)
                    if tuned:  # the peer's row first: a tuning cut off by the stage limit leaves it
                        idx = sf.add_row(matmul_row(shape, m, n, k, dname, oname, cfg, timing=None, peer=peer,
                                                    peer_timing=pt, error="autotuning did not finish"))
                        t0 = time.perf_counter()
                        mpkern.matmul(a, b, out_dtype=od)  # the one tuning run of this shape
                        measure.sync(dev)
                        extra["tuning_s"] = time.perf_counter() - t0
                        best = tk.last_tuned_config()
                        cfg = f"tuned {best}" if best is not None else "tuned"
                    t = timed(lambda a=a, b=b, od=od: mpkern.matmul(a, b, out_dtype=od))
                    row = matmul_row(shape, m, n, k, dname, oname, cfg, timing=t, peer=peer, peer_timing=pt, **extra)
                    log(f"matmul {shape} {dname}->{oname} ({cfg}): {t['kernel_ms']:.3f} ms, {peer} "
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
                    t = timed(lambda a=a, b=b, mg=mg: matmul_accumulate_(a, b, mg))
                    pt = timed(lambda a=a, b=b, mg=mg, fn=fn: fn(a, b, mg))
                    sf.add_row(matmul_row(shape, m, n, k, dname, "+=main_grad", fixed, timing=t, peer=peer,
                                          peer_timing=pt))
                except Exception as e:  # noqa: BLE001 -- the row says why; the next row still runs
                    traceback.print_exc()
                    sf.add_row(matmul_row(shape, m, n, k, dname, "+=main_grad", fixed, timing=None, peer=peer,
                                          peer_timing=None, error=short_error(e)))
                del mg
            del a, b
            free(dev)
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
    from mpkern.bench.matmul import bench_matmul

    sf = StageFile(os.path.join(out, "matmul_routes.json"), "matmul_routes", kernel="matmul")
    dev = resolve(device)
    sf.set(meta=meta(dev, config=os.environ["MPKERN_MATMUL_CONFIG"]))
    for r in bench_matmul(dev, quick=True, dtypes=dtypes, reps=10, log=log):
        sf.add_row(r)
    sf.finish()
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring). Exit status: 0 done, 1 failed, 2 bad arguments,
    3 no GPU, 130 interrupted (:func:`.harness.run_stage`)."""
    ap = argparse.ArgumentParser(prog="python -m tools.gpu_check.stages_matmul", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=STAGES)
    ap.add_argument("--out", required=True, help="output folder (the stage writes its JSON there)")
    args = ap.parse_args(argv)
    if args.stage == "matmul_routes":
        return run_stage(args.out, ["matmul_routes.json"], lambda: stage_matmul_routes(args.out))
    tuned = args.stage == "matmul_tuned"
    return run_stage(args.out, [f"{args.stage}.json"], lambda: stage_matmul(args.out, tuned=tuned))


if __name__ == "__main__":
    sys.exit(main())
