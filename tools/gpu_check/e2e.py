"""The end-to-end stages of the GPU check (issue 42, point 3): ``gpt2`` and ``llama7b``.

``python -m tools.gpu_check.e2e {gpt2,llama7b} --out DIR [--device cuda] [--size full|tiny] ...``

* ``gpt2`` -- the lessons' challenge: GPT-2 small (random init), seq 1024, a fixed batch, ~20 timed
  steps per recipe: ``fp32``, ``amp-bf16``, ``fp16-scaler``, ``mpkern-fp32-master``,
  ``mpkern-8bit-4bitm-release``. ``--find-batch``: the largest batch each fits under the cap.
* ``llama7b`` -- the seeds' 7B sentence: a Llama-7B-shaped model made on the device in bf16 (fp32 for
  AMP), activation checkpointing, batch 1 x 2048, ~8 timed steps per recipe: ``amp``,
  ``bf16-adamw``, ``mpkern-fp32-master``, ``mpkern-8bit-8bit``, ``mpkern-8bit-4bitm-release``; each
  row beside ``mpkern plan``'s prediction. A recipe that does not fit is an ``oom`` row.

This driver is standard library only: each recipe runs in its own process
(``python -m tools.gpu_check.e2e_worker``, :mod:`.e2e_worker`), one at a time, so an out-of-memory
error or a crash is one row and the memory peaks never mix. The stage file ``OUT/e2e_<stage>.json``
(:class:`.harness.StageFile`) gets each row when its worker ends; a worker gets the time the
``--limit`` leaves less a reserve for each recipe after it, and at its end dumps its stack (SIGUSR1)
and is stopped (SIGINT, then SIGKILL); a recipe with too little time left is a ``skipped``
row. Worker logs: ``OUT/e2e_work/``. Exit status: 0 whatever the rows say (oom, error, crashed are
results), 3 when the device has no CUDA GPU, 130 when the stage itself was interrupted.

Row keys (one row per recipe; absent where it does not apply):
``recipe``, ``status`` (ok / oom / diverged / error / crashed / timeout / skipped), ``phase`` (where
it was: plan, build, warmup, timed, find_batch, done), ``error``, ``oom_at``, ``batch``, ``seq``,
``warmup_steps``, ``timed_steps``, ``tokens_per_s``, ``step_s``, ``peak_mem_bytes``,
``peak_mem_kind``, ``rss_growth_bytes`` (CPU), ``state_bytes`` (weights + masters + moments, counted),
``grad_bytes``, ``activation_bytes`` (saved for backward at the fixed batch), ``loss_first``,
``loss_final``, ``losses``, ``what`` (param dtype, compute, optimizer, clip, linear), ``what_recipe``,
``device``, ``device_memory_bytes``, ``memory_cap_bytes``, ``plan_row``, ``params``,
``planned_B_per_param``, ``planned_state_bytes``, ``planned_transient_bytes``, ``planned_bytes``,
``plan_fits``, ``peak_over_planned``, ``wall_s``, ``find_batch`` (``cap_bytes``, ``start``,
``max_batch``, ``first_not_fitting``, ``points``: batch, status, peak_mem_bytes, tokens_per_s),
``worker`` (rc, wall_s, log), ``log_tail`` (a failed worker's last output).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any

from . import harness
from .harness import DUMP_AFTER_ENV, StageFile, run_stage

__all__ = ["main", "parse_bytes", "RECIPES", "DEFAULTS", "MIN_START_S"]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: stage -> its recipes in table order (kept equal to e2e_recipes.RECIPES: tested)
RECIPES = {
    "gpt2": ("fp32", "amp-bf16", "fp16-scaler", "mpkern-fp32-master", "mpkern-8bit-4bitm-release"),
    "llama7b": ("amp", "bf16-adamw", "mpkern-fp32-master", "mpkern-8bit-8bit", "mpkern-8bit-4bitm-release"),
}
#: (stage, size) -> default (batch, timed steps, warm-up steps)
DEFAULTS = {("gpt2", "full"): (8, 20, 3), ("gpt2", "tiny"): (2, 20, 2),
            ("llama7b", "full"): (1, 8, 2), ("llama7b", "tiny"): (1, 8, 2)}
#: size -> seconds a worker needs at least (imports, build, a few steps); reserved for each later recipe
MIN_START_S = {"full": 15.0, "tiny": 5.0}
#: seconds between a worker's SIGINT and its SIGKILL
GRACE_S = 5.0
#: the most seconds stopping a worker takes (its stack dump, then the SIGINT's grace): kept out of its time
STOP_S = 0.5 + GRACE_S
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """``"80GB"``, ``"24MiB"``, ``"1.5GiB"``, ``"4096"`` -> bytes; ValueError naming the argument otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"--memory-cap: expected a positive size such as 80GB, 24MiB or 4096, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _worker_cmd(args: argparse.Namespace, recipe: str, out: str) -> list[str]:
    cmd = [sys.executable, "-m", "tools.gpu_check.e2e_worker", args.stage, recipe, "--out", out,
           "--device", args.device, "--size", args.size, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--batch", str(args.batch), "--linear", args.linear]
    if args.memory_cap is not None:
        cmd += ["--memory-cap", str(args.memory_cap)]
    return cmd + (["--find-batch"] if args.find_batch else [])


def _stop(proc: subprocess.Popen) -> None:
    """SIGUSR1 (the worker dumps its stack: :data:`.e2e_worker.DUMP_SIGNAL`), SIGINT (it marks its file
    interrupted), then SIGKILL after :data:`GRACE_S`."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGUSR1)
    try:
        proc.wait(0.5)
        return
    except subprocess.TimeoutExpired:
        pass
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def _worker_row(path: str, recipe: str) -> tuple[dict[str, Any], str | None]:
    """The worker's row (or a bare one) and its file's status (None: no file)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {"recipe": recipe, "status": "crashed", "phase": "start"}, None
    rows = data.get("rows") or [{"recipe": recipe, "phase": "start"}]
    return rows[0], data.get("status")


def run_recipe(args: argparse.Namespace, recipe: str, timeout: float, work: str) -> dict[str, Any]:
    """Run one worker for at most ``timeout`` seconds -> its row, with how the worker ended."""
    out = os.path.join(work, f"{args.stage}_{recipe}.json")
    log = os.path.join(work, f"{args.stage}_{recipe}.log")
    for p in (out, log):
        if os.path.exists(p):
            os.remove(p)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH")))))
    # the worker's stack is dumped by _stop's signal, in its own thread: faulthandler's watchdog
    # (harness.dump_stacks_later) reads a running thread's frames and was seen to crash the worker
    env.pop(DUMP_AFTER_ENV, None)
    t0 = time.perf_counter()
    timed_out = False
    with open(log, "w") as logf:
        proc = subprocess.Popen(_worker_cmd(args, recipe, out), cwd=ROOT, env=env, stdout=logf,
                                stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop(proc)
        except BaseException:
            _stop(proc)  # the stage itself was interrupted: its worker goes with it
            raise
    rc = proc.returncode
    row, file_status = _worker_row(out, recipe)
    if rc == 3 and "no CUDA GPU" in _tail(log):
        raise RuntimeError(f"no CUDA GPU for --device {args.device} (worker log {log})")
    if timed_out:
        row.update(status="timeout", error=f"cut off by the stage's --limit after {timeout:.0f} s "
                                           f"(phase {row.get('phase')}; stacks in the log)")
    elif rc != 0 or file_status != "done":
        row["status"] = "crashed" if rc is None or rc < 0 or file_status in (None, "running") else "error"
        row["error"] = row.get("error") or (f"worker exit status {rc}" + (f" (signal {-rc})" if rc and rc < 0 else ""))
    if row.get("status") not in ("ok", "oom", "diverged"):
        row["log_tail"] = _tail(log)
    row["worker"] = {"rc": rc, "wall_s": round(time.perf_counter() - t0, 2), "log": os.path.relpath(log, args.out)}
    return row


def stage_name(args: argparse.Namespace) -> str:
    """The stage file's name (without ``.json``): ``e2e_<stage>``, ``e2e_<stage>_batch`` with --find-batch
    (so the batch search and the fixed-batch run of one profile or folder keep their own files)."""
    return f"e2e_{args.stage}" + ("_batch" if args.find_batch else "")


def _body(args: argparse.Namespace) -> int:
    sf = StageFile(os.path.join(args.out, f"{stage_name(args)}.json"), stage_name(args))
    work = os.path.join(args.out, "e2e_work")
    os.makedirs(work, exist_ok=True)
    sf.set(meta={"size": args.size, "device": args.device, "batch": args.batch, "timed_steps": args.steps,
                 "warmup_steps": args.warmup, "memory_cap_bytes": args.memory_cap, "find_batch": args.find_batch,
                 "linear": args.linear, "limit_s": args.limit, "argv": sys.argv[1:]},
           planned=list(args.recipes))
    deadline = time.perf_counter() + args.limit
    min_start = MIN_START_S[args.size]
    for i, recipe in enumerate(args.recipes):
        remaining = deadline - time.perf_counter() - STOP_S
        later = len(args.recipes) - i - 1
        if remaining < min_start:
            sf.add_row({"recipe": recipe, "status": "skipped", "phase": "start",
                        "error": f"the stage's --limit left {max(remaining, 0):.0f} s (a worker needs {min_start:g})"})
            continue
        timeout = min(remaining, max(min_start, remaining - later * min_start))
        row = run_recipe(args, recipe, timeout, work)
        sf.add_row(row)
        print(f"[e2e {args.stage}] {recipe:<26} {row.get('status')}"
              + (f"  {row['tokens_per_s']:,.0f} tok/s" if row.get("tokens_per_s") else "")
              + (f"  peak {row['peak_mem_bytes'] / 2**20:,.1f} MiB" if row.get("peak_mem_bytes") else "")
              + (f"  ({row['error']})" if row.get("error") else ""), flush=True)
    meta = dict(sf.data["meta"])
    first: dict[str, Any] = next((r for r in sf.data["rows"] if r.get("device_memory_bytes") or r.get("device")), {})
    meta.update(device_memory_bytes=first.get("device_memory_bytes"), memory_cap_bytes=first.get("memory_cap_bytes",
                meta["memory_cap_bytes"]), seq=first.get("seq"), params=first.get("params"))
    sf.set(meta=meta)
    sf.finish("done")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The stage's command line, checked (exit status 2 with the argument named on a bad one)."""
    ap = argparse.ArgumentParser(prog="python -m tools.gpu_check.e2e", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=tuple(RECIPES))
    ap.add_argument("--out", required=True, help="output folder: OUT/e2e_<stage>.json, worker logs in OUT/e2e_work/")
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--size", choices=("full", "tiny"), default="full",
                    help="full: the issue's model; tiny: 2 layers, 64 wide, seq 32 (a CPU runs it in seconds)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per recipe (default gpt2 20, llama7b 8)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps before them (>= 2; default 2-3)")
    ap.add_argument("--batch", type=int, default=None, help="the fixed batch (default gpt2 8 full / 2 tiny, llama7b 1)")
    ap.add_argument("--recipes", default=None, help="comma-separated subset of the stage's recipes, in table order")
    ap.add_argument("--memory-cap", default=None, metavar="BYTES",
                    help="per-recipe memory cap, e.g. 40GB or 24MiB (default: the card's memory; CPU: none). CUDA: "
                         "enforced by the allocator; CPU: a tracked peak over it makes the row oom")
    ap.add_argument("--find-batch", action="store_true",
                    help="also search the largest batch each recipe fits under the cap (doubling, then bisecting)")
    ap.add_argument("--linear", choices=("torch", "mpkern", "auto"), default="torch",
                    help="the 16-bit recipes' Linear layers (mpkern compare --linear); default torch: no route "
                         "timing or Triton compile inside the stage")
    ap.add_argument("--limit", type=float, default=harness.stage_limit(420.0),
                    help="seconds for the whole stage (default: MPKERN_STAGE_LIMIT, set by gpu_check.sh, else 420)")
    args = ap.parse_args(argv)
    batch, steps, warmup = DEFAULTS[(args.stage, args.size)]
    args.batch = batch if args.batch is None else args.batch
    args.steps = steps if args.steps is None else args.steps
    args.warmup = warmup if args.warmup is None else args.warmup
    if args.batch < 1 or args.steps < 1 or args.warmup < 2:
        ap.error(f"--batch and --steps must be >= 1 and --warmup >= 2, got {args.batch}, {args.steps}, {args.warmup}")
    if not args.limit > 0:
        ap.error(f"--limit must be a positive number of seconds, got {args.limit}")
    try:
        args.memory_cap = None if args.memory_cap is None else parse_bytes(args.memory_cap)
    except ValueError as e:
        ap.error(str(e))
    if args.recipes is None:
        args.recipes = RECIPES[args.stage]
    else:
        asked = [r.strip() for r in args.recipes.split(",") if r.strip()]
        bad = [r for r in asked if r not in RECIPES[args.stage]]
        if bad or not asked:
            ap.error(f"--recipes: {args.stage} has {', '.join(RECIPES[args.stage])}; got {args.recipes!r}")
        args.recipes = tuple(r for r in RECIPES[args.stage] if r in asked)
    if args.find_batch and args.memory_cap is None and not args.device.startswith("cuda"):
        ap.error("--find-batch on a CPU needs --memory-cap (the tracked peak is compared with it)")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run one end-to-end stage -> its exit status (see the module's docstring)."""
    args = parse_args(argv)
    return run_stage(args.out, [f"{stage_name(args)}.json"], lambda: _body(args))


if __name__ == "__main__":
    sys.exit(main())
