"""One recipe of an end-to-end stage, in its own process (``python -m tools.gpu_check.e2e_worker``).

:mod:`.e2e` starts one of these per recipe, so an out-of-memory error or a crash costs one row and
the memory peaks of two recipes never mix. The worker writes its row to its own stage file (one
row, rewritten at each phase: ``plan``, ``build``, ``warmup``, ``timed``, ``find_batch``), so a
worker killed at its limit or by a crash still leaves what it knew (the planned bytes at least).

Memory: on CUDA ``torch.cuda.max_memory_allocated`` since the recipe was built (the peak stats are
reset after the build: the base model it was copied from is gone by then), the cap enforced with
``torch.cuda.set_per_process_memory_fraction`` and an out-of-memory error caught as the row's
``oom``. On a CPU the tracked tensor bytes (``mpkern compare``'s measure: weights + masters +
moments, plus the peak of the tensors one steady step creates, :class:`mpkern.compare.memory.LiveBytes`)
beside the peak RSS growth; a tracked peak over the cap makes the row ``oom``.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import math
import os
import signal
import sys
import time
import traceback
from functools import partial
from typing import Any

from .harness import StageFile, run_stage, short_error

__all__ = ["main", "measure", "find_batch", "PROBE_STEPS", "DUMP_SIGNAL"]

#: steps per batch size of the --find-batch search: one to allocate everything, one measured
PROBE_STEPS = 2
#: the signal on which the worker writes its main thread's Python stack to stderr (from the signal
#: handler, in C: it shows a thread stuck in native code too); :mod:`.e2e` sends it before stopping one
DUMP_SIGNAL = signal.SIGUSR1


def _device(name: str) -> Any:
    import torch

    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"--device {name}: no CUDA GPU is visible to torch")
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"--device must be cpu or cuda[:N], got {name!r}")
    return dev


def _cap(dev: Any, cap: int | None) -> tuple[int | None, int | None]:
    """``(cap, device memory)``: on CUDA the cap (default the card's memory) is enforced by the
    allocator; on a CPU it is compared with the tracked peak (None: no cap)."""
    import torch

    if dev.type != "cuda":
        return cap, None
    total = torch.cuda.get_device_properties(dev).total_memory
    cap = total if cap is None else cap
    if cap < total:
        torch.cuda.set_per_process_memory_fraction(cap / total, dev)
    return cap, total


def _free(dev: Any) -> None:
    import torch

    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _persistent(r: Any) -> int:
    """Bytes of weights + masters + moments (the grads are counted in a step's peak)."""
    from mpkern import bytemodel

    st = bytemodel.count_state(r.params, r.opt)
    return st.total - st.bytes["grads"]


def _step(r: Any, x: Any, y: Any, dev: Any, profile: bool) -> tuple[Any, int | None]:
    """One training step -> ``(loss, tracked peak)``; the peak (CPU) only when ``profile``."""
    if not profile or dev.type != "cpu":
        return r.step(x, y), None
    from mpkern.compare.memory import LiveBytes

    with LiveBytes() as m:
        loss = r.step(x, y)
    return loss, _persistent(r) + m.peak


def measure(row: dict[str, Any], sf: StageFile, stage: str, name: str, sh: Any, dev: Any, batch: int, steps: int,
            warmup: int, cap: int | None, linear: str) -> Any:
    """Build recipe ``name`` and train ``warmup + steps`` steps on the fixed batch; fill ``row``
    (written at each phase). Returns the recipe (None when it did not fit) for --find-batch."""
    import torch

    from mpkern.compare.memory import CpuPeak, saved_bytes
    from mpkern.measure import sync

    from . import e2e_recipes as R

    rss = CpuPeak()
    if dev.type == "cpu":
        rss.start()
    row["phase"] = "build"
    sf.write()
    r = R.build(stage, name, sh, dev, linear)
    row.update(what=r.describe, grad_bytes=sum(p.numel() * p.element_size() for p in r.params))
    _free(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    x, y = R.make_batch(sh, batch, dev)
    losses = torch.full((warmup + steps,), float("nan"), device=dev)
    row["phase"] = "warmup"
    sf.write()
    t0 = t1 = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            sync(dev)
            row["phase"] = "timed"
            sf.write()
            t0 = time.perf_counter()
        if i == 0:  # what autograd keeps for backward: the activations of this batch
            loss, row["activation_bytes"] = saved_bytes(partial(r.step, x, y))
            tracked = None
        else:
            loss, tracked = _step(r, x, y, dev, profile=i == 1)
        losses[i] = loss
        if tracked is not None:
            row["peak_mem_bytes"] = tracked
            if cap is not None and tracked > cap:
                row.update(status="oom", oom_at=f"step {i}: tracked peak {tracked} B over the cap {cap} B")
                return r
    sync(dev)
    t1 = time.perf_counter()
    hist = losses.cpu().tolist()
    if dev.type == "cuda":
        row["peak_mem_bytes"] = torch.cuda.max_memory_allocated(dev)
    else:
        row["rss_growth_bytes"] = rss.peak()
    row.update(status="ok" if all(math.isfinite(v) for v in hist) else "diverged",
               tokens_per_s=steps * batch * sh.seq / (t1 - t0), step_s=(t1 - t0) / steps,
               loss_first=hist[0], loss_final=hist[-1], losses=[round(v, 5) for v in hist],
               state_bytes=_persistent(r))
    return r


def find_batch(row: dict[str, Any], sf: StageFile, stage: str, name: str, sh: Any, dev: Any, start: int,
               cap: int, linear: str, r: Any) -> None:
    """The largest batch recipe ``name`` fits under ``cap`` (``mpkern compare --find-batch``'s search:
    doubling from ``start``, then bisecting), each size :data:`PROBE_STEPS` steps on the recipe
    already built; after an out-of-memory error the recipe is built again. ``row["find_batch"]``."""
    import torch

    from mpkern.compare.batch import search
    from mpkern.measure import sync

    from . import e2e_recipes as R

    fb: dict[str, Any] = {"cap_bytes": cap, "start": start, "points": []}
    row.update(find_batch=fb, phase="find_batch")
    held = {"r": r}

    def probe(b: int) -> dict[str, Any]:
        point: dict[str, Any] = {"batch": b, "status": "ok", "peak_mem_bytes": None, "tokens_per_s": None}
        oom = rec = x = y = loss = None
        try:
            if held["r"] is None:
                held["r"] = R.build(stage, name, sh, dev, linear)
            rec = held["r"]
            x, y = R.make_batch(sh, b, dev)
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            rec.step(x, y)
            sync(dev)
            t0 = time.perf_counter()
            loss, tracked = _step(rec, x, y, dev, profile=True)
            sync(dev)
            if dev.type == "cuda":
                point["tokens_per_s"] = b * sh.seq / (time.perf_counter() - t0)
                tracked = torch.cuda.max_memory_allocated(dev)
            point["peak_mem_bytes"] = tracked
            if not math.isfinite(float(loss)):
                point["status"] = "diverged"  # still fitted in memory: the search is about memory
            if tracked is not None and tracked > cap:
                point["status"] = "over_cap"
        except torch.OutOfMemoryError as e:
            oom = short_error(e)
        if oom is not None:  # outside the except: its traceback no longer holds the step's tensors
            held["r"] = rec = x = y = loss = None
            point.update(status="oom", error=oom)
            _free(dev)
        return point

    def fits(b: int) -> bool:
        point = probe(b)
        fb["points"].append(point)
        fb["points"].sort(key=lambda p: p["batch"])
        sf.write()
        return point["status"] in ("ok", "diverged")

    lo, hi = search(fits, start)
    fb.update(max_batch=lo, first_not_fitting=hi)
    row["phase"] = "done"
    sf.write()


def _run(args: argparse.Namespace) -> int:
    import torch

    from mpkern.measure import cpu_name

    from . import e2e_recipes as R

    sh = R.shape(args.stage, args.size)
    batch = args.batch
    sf = StageFile(args.out, f"e2e_{args.stage}:{args.recipe}", recipe=args.recipe)
    row: dict[str, Any] = {"recipe": args.recipe, "status": "running", "phase": "plan", "batch": batch,
                           "seq": sh.seq, "warmup_steps": args.warmup, "timed_steps": args.steps,
                           "tokens_per_s": None, "peak_mem_bytes": None, "loss_final": None, "error": None}
    sf.add_row(row)
    row["what_recipe"] = R.spec(args.stage, args.recipe).what
    dev = _device(args.device)
    cap, total = _cap(dev, args.memory_cap)
    if dev.type == "cuda":  # off by default: the fp32 recipe is fp32 GEMMs unless the check turns TF32 on
        row["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    row.update(device=str(dev), device_name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_name(),
               memory_cap_bytes=cap, device_memory_bytes=total,
               peak_mem_kind=("torch.cuda.max_memory_allocated after the build" if dev.type == "cuda" else
                              "tracked tensor bytes: weights + masters + moments + one steady step's peak"))
    row.update(R.planned(args.stage, args.recipe, sh, cap))
    sf.write()

    t_start = time.perf_counter()
    r = None
    oom = None
    try:
        r = measure(row, sf, args.stage, args.recipe, sh, dev, batch, args.steps, args.warmup, cap, args.linear)
    except torch.OutOfMemoryError as e:
        oom = short_error(e)
    except Exception as e:  # noqa: BLE001 -- any failure of one recipe is its row, the stage goes on
        traceback.print_exc()
        row.update(status="error", error=short_error(e))
    if oom is not None:
        if dev.type == "cuda":
            row["peak_mem_bytes"] = torch.cuda.max_memory_allocated(dev)  # the peak before the failed allocation
        row.update(status="oom", oom_at=row["phase"], error=oom)
        r = None
        _free(dev)
    if row["status"] == "ok" and row.get("peak_mem_bytes") and row.get("planned_bytes"):
        row["peak_over_planned"] = row["peak_mem_bytes"] / row["planned_bytes"]
    row["wall_s"] = time.perf_counter() - t_start
    sf.write()
    if args.find_batch:
        if cap is None:
            raise ValueError("--find-batch on a CPU needs --memory-cap (the tracked peak is compared with it)")
        if row["status"] != "ok":
            r = None  # built again by the search's first size
            _free(dev)
        find_batch(row, sf, args.stage, args.recipe, sh, dev, batch, cap, args.linear, r)
    row["phase"] = "done"
    sf.finish("done")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse the worker's command line and run it under :func:`.harness.run_stage` -> exit status."""
    ap = argparse.ArgumentParser(prog="python -m tools.gpu_check.e2e_worker", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=("gpt2", "llama7b"))
    ap.add_argument("recipe")
    ap.add_argument("--out", required=True, help="this worker's JSON file")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", choices=("tiny", "full"), default="full")
    ap.add_argument("--steps", type=int, required=True, help="timed steps")
    ap.add_argument("--warmup", type=int, required=True, help="untimed steps first (>= 2)")
    ap.add_argument("--batch", type=int, required=True, help="the fixed batch")
    ap.add_argument("--memory-cap", type=int, default=None, help="bytes")
    ap.add_argument("--linear", choices=("torch", "mpkern", "auto"), default="torch")
    ap.add_argument("--find-batch", action="store_true")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 2 or args.batch < 1:
        ap.error(f"--steps and --batch must be >= 1 and --warmup >= 2, got {args.steps}, {args.batch}, {args.warmup}")
    faulthandler.register(DUMP_SIGNAL, all_threads=False)
    return run_stage(os.path.dirname(os.path.abspath(args.out)), [os.path.basename(args.out)], lambda: _run(args))


if __name__ == "__main__":
    sys.exit(main())
