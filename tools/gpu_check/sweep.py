"""The sweep stage of ``scripts/gpu_check.sh --profile scale`` (issue 43 item 4): the CUDA AdamW
kernel's launch shape -- threads per block, grid blocks per SM, elements per chunk, the compact
kernels' load stages -- timed over a few values each, so that one GPU run finds the best shape for its
card.

``python -m tools.gpu_check.sweep --out DIR [--layouts uniform,gpt2] [--calls N]`` -> ``sweep_adamw.json``:
one row per (layout, storage mode, shape) with the kernel time (``mpkern.measure.event_time``: CUDA
events over back-to-back ``FusedAdamWMP.step`` calls on the cuda backend) and the bytes per second of
the step's byte model; then ``best``: the shape with the smallest geometric mean of time relative to
the arch's current shape over every (layout, mode), the per-mode bests beside it, and the row to put
in ``csrc/cuda/adamw_cuda.cu``'s ``kArchConfigs`` (the dispatch's arch -> shape table). Every shape
gives the same results bit for bit (``tests/test_adamw_shapes.py``); the sweep only times.

The shapes are set with :func:`mpkern.launch_shape.adamw_shape_set`; the block size is at most the
kernels' launch bound (256): larger blocks, and other blocks-per-SM register budgets, would need other
compiled instances.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .gpu import adamw_optimizer, free, log, meta, resolve
from .harness import StageFile, run_stage, short_error

__all__ = ["BLOCKS", "CHUNKS", "GRIDS", "LAYOUTS", "MODES", "STAGES", "best_shape", "layout_sizes", "main", "shapes",
           "stage_sweep", "table_row"]

#: the values swept (block: a multiple of 32 up to the launch bound 256; chunk: a multiple of 256 up to 65536;
#: stages: the compact kernels' loads in registers (1) or the next pass's staged in shared memory (2) --
#: the fp32 kernel ignores it, and is timed under both so that every shape has every case)
BLOCKS = (128, 256)
GRIDS = (2, 4, 8, 16)
CHUNKS = (16384, 65536)
STAGES = (1, 2)
#: (master_weights, state_dtype): the fp32 kernel and the compact one (their register budgets differ)
MODES = ((True, "float32"), ("8bit", "8bit"))
#: the layouts: today's benchmark and GPT-2 small as transformers builds it (tied 38.6M embedding,
#: 1-D norms and biases); "llama" (a 1.0B stack of 4096^2 / 4096 x 11008 / 4096) on request
LAYOUTS = ("uniform", "gpt2", "llama")
DEFAULT_LAYOUTS = ("uniform", "gpt2")
#: timing per shape: back-to-back calls per round, rounds (median), warm-up calls
CALLS, ROUNDS, WARMUP = 5, 3, 1

Shape = tuple[int, int, int, int]


def shapes() -> list[Shape]:
    """Every (block, grid_per_sm, chunk, stages) of the sweep."""
    return list(itertools.product(BLOCKS, GRIDS, CHUNKS, STAGES))


def layout_sizes(name: str) -> list[int]:
    """The tensor sizes of a layout (``LAYOUTS``)."""
    if name == "uniform":
        return [160_000] * 200
    if name == "gpt2":
        d, v, ctx, layers = 768, 50257, 1024, 12
        sizes = [v * d, ctx * d]
        for _ in range(layers):
            sizes += [d, d, d * 3 * d, 3 * d, d * d, d, d, d, d * 4 * d, 4 * d, 4 * d * d, d]
        return sizes + [d, d]
    if name == "llama":
        d, f = 4096, 11008
        return ([d * d] * 4 + [d * f] * 3 + [d, d]) * 5
    raise ValueError(f"layout_sizes: layout must be one of {LAYOUTS}, got {name!r}")


def best_shape(rows: Iterable[dict[str, Any]], current: Shape) -> dict[str, Any]:
    """The shape with the smallest geometric mean, over every (layout, mode) that timed both it and
    ``current``, of its kernel time relative to ``current``'s; with the per-mode bests. Rows without a
    time (failed) are left out. ValueError when no row timed ``current``."""
    times: dict[tuple[str, str], dict[Shape, float]] = {}
    for r in rows:
        if r.get("kernel_ms"):
            times.setdefault((r["layout"], r["mode"]), {})[tuple(r["shape"])] = float(r["kernel_ms"])
    cases = [k for k, t in times.items() if current in t]
    if not cases:
        raise ValueError(f"best_shape: no row timed the current shape {current}")
    candidates = set.intersection(*(set(times[k]) for k in cases))

    def geomean(shape: Shape, keys: Sequence[tuple[str, str]]) -> float:
        return math.exp(sum(math.log(times[k][shape] / times[k][current]) for k in keys) / len(keys))

    best = min(sorted(candidates), key=lambda s: geomean(s, cases))
    per_mode = {}
    for mode in sorted({m for _, m in cases}):
        keys = [k for k in cases if k[1] == mode]
        s = min(sorted(candidates), key=lambda s, keys=keys: geomean(s, keys))
        per_mode[mode] = {"shape": list(s), "relative_time": geomean(s, keys)}
    return {"shape": list(best), "relative_time": geomean(best, cases), "current": list(current),
            "cases": [list(k) for k in cases], "per_mode": per_mode}


def table_row(major: int, minor: int, shape: Sequence[int], source: str) -> str:
    """The ``kArchConfigs`` row of ``csrc/cuda/adamw_cuda.cu`` for an arch and its best shape."""
    block, grid, chunk, stages = (int(x) for x in shape)
    return f'    {{{major}, {minor}, {{{block}, {grid}, {chunk}, {stages}}}, "{source}"}},'


def stage_sweep(out: str, layouts: Sequence[str] = DEFAULT_LAYOUTS, *, calls: int = CALLS, device: Any = None,
                backend: str = "cuda", sizes_of: Callable[[str], list[int]] = layout_sizes) -> int:
    """Time ``FusedAdamWMP.step`` on ``backend`` under every shape for every layout x mode ->
    ``sweep_adamw.json``; the arch's shape is back in force at the end. ``device`` / ``backend`` /
    ``sizes_of``: the current GPU, ``"cuda"`` and :func:`layout_sizes` unless a test says otherwise."""
    import torch

    import mpkern
    from mpkern.bench.common import ADAMW_LR, adamw_problem
    from mpkern.bench.modes import mode_label, step_bytes_per_param
    from mpkern.launch_shape import adamw_shape, adamw_shape_set
    from mpkern.measure import event_time

    for lay in layouts:
        sizes_of(lay)  # ValueError for an unknown name, before anything runs
    dev = resolve(device)
    block, grid, chunk, stages, source = adamw_shape(dev)
    current: Shape = (block, grid, chunk, stages)
    sf = StageFile(os.path.join(out, "sweep_adamw.json"), "sweep_adamw", kernel="adamw", backend=backend)
    cap = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else (0, 0)
    gpu_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)
    sf.set(meta=meta(dev, capability=list(cap), current_shape=list(current), current_source=source, lr=ADAMW_LR,
                     calls=calls, rounds=ROUNDS, warmup=WARMUP, layouts=list(layouts)),
           planned=[f"{lay} / {mode_label(mw, sd)} / {s}" for lay in layouts for mw, sd in MODES for s in shapes()])
    rows: list[dict[str, Any]] = []
    for lay in layouts:
        sizes = sizes_of(lay)
        grads16, init = adamw_problem(dev, sizes)
        for mw, sd in MODES:
            label = mode_label(mw, sd)
            bpp = step_bytes_per_param(mw, sd)
            opt = None
            try:
                with mpkern.use_backend(backend):
                    opt = adamw_optimizer(init, grads16, mw, sd, ADAMW_LR)
                    opt.step()  # the state
                    for shape in [current, *[s for s in shapes() if s != current]]:
                        with adamw_shape_set(*shape):
                            t = event_time(opt.step, dev, calls=calls, rounds=ROUNDS, warmup=WARMUP)
                        row = {"layout": lay, "mode": label, "shape": list(shape), "params": sum(sizes),
                               "bytes_per_param": bpp, "kernel_ms": t["kernel_ms"], "wall_ms": t["wall_ms"],
                               "gbps": bpp * sum(sizes) / (t["kernel_ms"] * 1e6)}
                        rows.append(row)
                        sf.add_row(row)
                log(f"sweep {lay} {label}: {len(shapes())} shapes timed")
            except Exception as e:  # noqa: BLE001 -- the row says why; the next mode still runs
                sf.add_row({"layout": lay, "mode": label, "error": short_error(e)})
            del opt
            free(dev)
        del grads16, init
        free(dev)
    best = best_shape(rows, current)
    best["table_row"] = table_row(cap[0], cap[1], best["shape"],
                                  f"gpu_check sweep {time.strftime('%Y-%m-%d')}, {gpu_name}: "
                                  f"{100 * (1 - best['relative_time']):.1f} % less time than {tuple(current)}")
    sf.set(best=best)
    log(f"sweep best shape {tuple(best['shape'])}: {best['relative_time']:.3f} x the time of {current} "
        f"(per mode {best['per_mode']}); kArchConfigs row:\n{best['table_row']}")
    sf.finish()
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring); exit status as :func:`.harness.run_stage`."""
    ap = argparse.ArgumentParser(prog="python -m tools.gpu_check.sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder (sweep_adamw.json)")
    ap.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS), help=f"comma-separated, of {LAYOUTS}")
    ap.add_argument("--calls", type=int, default=CALLS, help="back-to-back steps per timing round")
    args = ap.parse_args(argv)
    layouts = [x for x in args.layouts.split(",") if x]
    bad = [x for x in layouts if x not in LAYOUTS]
    if bad or not layouts or args.calls < 1:
        ap.error(f"--layouts must name some of {LAYOUTS} (got {args.layouts!r}) and --calls must be >= 1")
    return run_stage(args.out, ["sweep_adamw.json"], lambda: stage_sweep(args.out, layouts, calls=args.calls))


if __name__ == "__main__":
    sys.exit(main())
