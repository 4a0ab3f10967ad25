"""The ``mpkern`` command line: ``info``, ``compare``, ``bench``, ``plan``.

A thin layer over importable functions (:func:`mpkern.compare.run`, :func:`mpkern.bench.run`,
:func:`mpkern.plan.plan_table`): it parses and checks flags (a bad flag exits with status 2 and
argparse's message), calls the function and prints.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping
from typing import Any


# ---- argument types (argparse turns their ValueError/ArgumentTypeError into exit code 2) --------
def _number(cast: type, what: str, *, allow_zero: bool = False):
    """An argparse type: ``cast(s)``, finite and > 0 (>= 0 with ``allow_zero``), else exit 2 with ``what``."""
    def parse(s: str):
        try:
            v = cast(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}") from None
        if not (math.isfinite(v) and (v >= 0 if allow_zero else v > 0)):
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}")
        return v

    return parse


_positive_int = _number(int, "a positive integer")
_nonneg_int = _number(int, "a non-negative integer", allow_zero=True)
_positive_float = _number(float, "a positive finite number")


def _optimizer_state(s: str) -> str:
    """``--optimizer-state``: a shorthand or ``MASTER:MOMENTS`` the storage registry reads."""
    from .compare.config import optimizer_state_args

    try:
        optimizer_state_args(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return s


def _precisions(s: str) -> list[str]:
    from .compare import PRECISIONS

    names = [p.strip() for p in s.split(",") if p.strip()]
    bad = [p for p in names if p not in PRECISIONS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"unknown precision(s) {bad or [s]}; choose from {','.join(PRECISIONS)}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a precision is listed twice: {s!r}")
    return names


def _size(s: str) -> int:
    from .measure import parse_size

    try:
        return parse_size(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _device(s: str) -> str:
    import torch

    try:
        dev = torch.device(s)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"not a device: {s!r} (use cpu or cuda)") from None
    if dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"device must be cpu or cuda, got {s!r}")
    return s


def _resolve_device(device: str | None, parser: argparse.ArgumentParser) -> str:
    """``--device`` or the default (cuda if available, else cpu); CUDA without a GPU exits 2."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {device}: torch.cuda.is_available() is False on this machine")
    return device


# ---- info ---------------------------------------------------------------------------------------
def _cmd_info(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import mpkern

    data = mpkern.info()
    if args.json:
        print(json.dumps(data, indent=2, default=str))
        return 0
    print(f"mpkern {data['version']}  (torch {data['torch']}, CUDA {data['torch_cuda']})")
    if data["torch_warning"]:
        print(f"warning     : {data['torch_warning']}")
    print(f"device      : {data['device']}")
    print(f"capability  : {data['capability']}")
    print(f"bf16 / fp16 : {data['bf16']} / {data['fp16']}")
    if data["native_built_against_torch"]:
        print(f"native ext  : built against torch {data['native_built_against_torch']}")
    print(f"forced      : {data['forced_backend'] or '(none; MPKERN_BACKEND unset)'}")
    print("backends:")
    for name, st in data["backends"].items():
        mark = "yes" if st["available"] else "no "
        print(f"  {name:<7} {mark}  {st['reason']}")
    shape = data.get("adamw_launch_shape")
    if shape:
        print(f"adamw CUDA launch: block {shape['block']}, {shape['grid_per_sm']} blocks per SM, chunk "
              f"{shape['chunk']} ({shape['source']})")
    print("matmul / linear routes (MPKERN_MATMUL_ROUTE; auto: the faster per problem, timed once):")
    for name, note in data["matmul"].items():
        print(f"  {name:<7} {note}")
    for problem, why in data.get("matmul_routes", {}).items():
        ok = [r for r, w in why.items() if not w]
        print(f"  {problem:<17} may run on: {', '.join(ok) or 'none'}")
    chosen = data.get("matmul_chosen", [])
    if chosen:
        print(f"matmul routes chosen so far on this device type ({len(chosen)}; the cache file of mpkern.route_cache):")
        for e in chosen[:20]:
            p = e["problem"]
            ms = ", ".join(f"{r} {t:.3g} ms" for r, t in e["ms"].items())
            size = f"M~{p['m']} N~{p['n']} K~{p['k']}"
            print(f"  {p['dtype']}->{p['out_dtype']} {p['epilogue']:<10} {p['layout']} {size}: {e['route']} ({ms})")
    return 0


# ---- compare ------------------------------------------------------------------------------------
_COMPARE_FLAGS = ("hf_model", "steps", "lr", "batch_size", "seq_len", "d_model", "layers", "heads", "classes", "seed",
                  "warmup", "optimizer_state", "linear", "threads", "max_grad_norm", "log_every",
                  "time_budget", "min_steps", "release", "release_bucket_bytes")


def _cmd_compare(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from . import compare

    device = _resolve_device(args.device, parser)
    if args.memory_budget is not None and not args.find_batch:
        parser.error("--memory-budget goes with --find-batch")
    if args.release_bucket_bytes is not None and not args.release:
        parser.error("--release-bucket goes with --release")
    overrides = {k: getattr(args, k) for k in _COMPARE_FLAGS if getattr(args, k) is not None}
    try:
        res = compare.run(args.precision, device=device, out=args.out, progress=not args.no_progress,
                          plot=not args.no_plot, find_batch=args.find_batch, memory_budget=args.memory_budget,
                          doctor=args.doctor, **overrides)
    except ValueError as e:  # e.g. bf16 asked for on a GPU without it, d_model not divisible by heads
        parser.error(str(e))
    print()
    print(compare.format_header(res))
    print()
    if args.find_batch:
        from .compare.batch import format_batch_table

        print(format_batch_table(res))
        if args.out:
            print(f"\nwrote {args.out}/results.json, results.md" + (", batch_scaling.png" if not args.no_plot else ""))
        return 0
    print(compare.format_table(res))
    print()
    print(compare.format_details(res))
    if args.out:
        print(f"\nwrote {args.out}/results.json, results.md" + (", compare.png" if not args.no_plot else ""))
    for entry in res.get("doctor", []):
        print(f"\nmpkern doctor -- run {entry['run']}: the model in {entry['dtype']} ({entry['recipe']}) against fp32")
        print(entry["text"])
    diverged = [r["name"] for r in res["runs"] if r["status"] == "diverged"]
    if diverged:
        print(f"diverged: {', '.join(diverged)} (the other runs completed)")
    return 0


# ---- bench --------------------------------------------------------------------------------------
def _cmd_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from . import bench, measure

    device = _resolve_device(args.device, parser)
    def log(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    try:
        res = bench.run(args.which, device=device, quick=args.quick, params=args.params, tensors=args.tensors,
                        reps=args.reps, log=log, **bench.adamw_run_kwargs(args))
    except ValueError as e:  # a bad --modes list
        parser.error(str(e))
    m = res["meta"]
    print(f"\n{m['device']}, torch {m['torch']}, {m['threads']} threads, {m['timestamp']}"
          + (f", in-place bandwidth {m['bandwidth']['inplace_GBps']:.1f} GB/s" if "bandwidth" in m else "")
          + (f"; optimizer-side sizes: {m['params'] / 1e6:g}M params in {m['tensors']} tensors"
             if m["which"] in ("unscale", "adamw", "all") else "") + "\n")
    print(bench.format_table(res["rows"]))
    if args.json:
        measure.write_json(res, args.json)
        print(f"\nwrote {args.json}")
    if args.plot and bench.plot(res, args.plot):
        print(f"wrote {args.plot}")
    return 0


# ---- plan ---------------------------------------------------------------------------------------
def _cmd_plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from . import plan

    if args.memory_budget is not None:
        return _plan_batches(args, parser)
    if args.params is None and args.hf_config is None:
        parser.error("give --params N (e.g. 7e9) or --hf-config PATH (or --memory-budget SIZE)")
    if args.hf_config is not None:
        try:
            n, model_class = plan.hf_config_count(args.hf_config)
        except (ValueError, OSError) as e:
            parser.error(f"--hf-config: {e}")
        source = f"{args.hf_config} ({model_class}: {n:,} params)"
    else:
        n = args.params
        source = f"{n:,.0f} params"
    rows = plan.plan_table(n, world_size=args.world_size, gpu_mem=args.gpu_mem)
    if args.json:
        print(json.dumps({"params": n, "world_size": args.world_size, "gpu_mem_GB": args.gpu_mem, "rows": rows},
                         indent=1))
        return 0
    shard = f", sharded over {args.world_size} ranks (FSDP2-style: all state / N)" if args.world_size > 1 else ""
    mem = f", {args.gpu_mem:g} GB per device" if args.gpu_mem else ""
    print(f"Training state per recipe for {source}{shard}{mem}.")
    print("Bytes/param measured from the optimizers' real state tensors on a small model, then scaled.\n")
    print(plan.format_plan(rows))
    print("\nActivations, temporaries and (for FSDP) the gathered layer params come on top of this.")
    return 0


def _plan_batches(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``mpkern plan --memory-budget SIZE``: the largest batch per recipe (:mod:`mpkern.batch_plan`)."""
    from . import batch_plan

    if args.params is not None:
        parser.error("--memory-budget measures a step of a model: give --hf-config PATH, or nothing for "
                     "mpkern compare's model (not --params)")
    try:
        res = batch_plan.plan_batches(args.memory_budget, hf_config=args.hf_config, seq_len=args.seq_len,
                                      margin=args.safety_margin)
    except (ValueError, OSError) as e:
        parser.error(f"--memory-budget: {e}")
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        print(batch_plan.format_batches(res))
    return 0


# ---- parser -------------------------------------------------------------------------------------
def _version() -> str:
    from mpkern import __version__

    return __version__


def _add_compare_parser(sub: Any) -> None:
    """The ``compare`` subcommand's flags."""
    pc = sub.add_parser(
        "compare", help="train the same small model in fp32 / bf16 / fp16 / mpkern and compare speed, memory, accuracy",
        description="Train one small transformer classifier several ways (same init, data, order and "
                    "hyperparameters) and report tokens/s, speedup vs fp32, peak memory, state bytes/param, "
                    "final loss, validation accuracy, skipped steps and the fp16 loss scale. "
                    "Default: every run the device supports, sized by a measured probe to fit --time-budget "
                    "(CPU: 110 s of training, under 150 s in all on a 2-core CPU).")
    pc.add_argument("--precision", type=_precisions, default=None, metavar="LIST",
                    help="comma-separated runs: fp32,bf16,fp16,bf16-naive,mpkern-bf16,mpkern-8bit,mpkern-fp16 "
                         "(default: all the device supports; CPU leaves out the fp16 runs: no native fp16 there). "
                         "mpkern-8bit: bf16 params, FusedAdamWMP(master_weights='8bit', state_dtype='8bit'), "
                         "7.125 B/param")
    pc.add_argument("--device", type=_device, default=None, help="cpu or cuda (default: cuda if available)")
    pc.add_argument("--steps", type=_positive_int,
                    help="training steps per run (CPU default: up to 1000, as the time budget allows; "
                         "given explicitly, the time budget is off unless --time-budget is given too)")
    pc.add_argument("--time-budget", type=_positive_float, metavar="SECONDS",
                    help="seconds for all training runs together (CPU default 110): the steps are chosen from a "
                         "short measured probe of each run on this device, never below --min-steps; a run the "
                         "probe finds >= 4x slower than fp32 is time-boxed (10 s, reported as stopped)")
    pc.add_argument("--min-steps", type=_positive_int,
                    help="fewest steps the time budget may choose (default 800: the master-weight lesson needs them)")
    pc.add_argument("--lr", type=_positive_float,
                    help="learning rate (default 1e-4: bf16-naive's updates round away while the runs with fp32 "
                         "masters learn; at 3e-4 bf16-naive learns too -- try it to see where the lesson starts)")
    pc.add_argument("--batch-size", type=_positive_int, help="sequences per step (CPU default 32)")
    pc.add_argument("--seq-len", type=_positive_int, help="tokens per sequence (CPU default 16)")
    pc.add_argument("--d-model", type=_positive_int, help="model width (CPU default 128)")
    pc.add_argument("--layers", type=_positive_int, help="transformer blocks (CPU default 2)")
    pc.add_argument("--heads", type=_positive_int, help="attention heads (CPU default 4)")
    pc.add_argument("--classes", type=_positive_int, help="number of classes of the task (default 32)")
    pc.add_argument("--seed", type=_nonneg_int, help="seed of data and init (default 0)")
    pc.add_argument("--warmup", type=_nonneg_int, help="untimed first steps (default 20)")
    pc.add_argument("--log-every", type=_positive_int, help="steps between progress updates / divergence checks")
    pc.add_argument("--max-grad-norm", type=_positive_float, help="gradient clipping norm (default 1.0)")
    pc.add_argument("--optimizer-state", type=_optimizer_state, default=None, metavar="STATE",
                    help="FusedAdamWMP state of the mpkern runs: fp32 masters+moments (default, 16 B/param with "
                         "param and grad), int16 remainder masters (14; mpkern-bf16 only, mpkern-fp16 keeps fp32 "
                         "masters), bf16 moments (12), remainder + bf16 moments (10), 8-bit master "
                         "corrections + bf16 moments (9), remainder + 8-bit moments (8.125), 8-bit masters + "
                         "8-bit moments (7.125), remainder-4bit-m (7.625) or 8bit-4bit-m (6.625: a 4-bit "
                         "exp_avg, two codes per byte) -- bf16 / 8-bit moments and 8-bit masters are rounded "
                         "stochastically (docs/storage.md); or any MASTER:MOMENTS of the storage registry, "
                         "e.g. remainder:8bit")
    pc.add_argument("--linear", choices=("auto", "mpkern", "torch"), default=None,
                    help="Linear layers of the 16-bit-param runs: mpkern.nn.Linear or torch.nn.Linear "
                         "(auto: whichever is faster on this device, measured before the runs -- both accumulate "
                         "in fp32; the table's GEMM column says which ran)")
    pc.add_argument("--threads", type=_positive_int,
                    help="torch intra-op threads (default: the cores other processes leave free, by the 1-minute load "
                         "average, when a probe GEMM gains from them; else one)")
    pc.add_argument("--out", default="mpkern-compare", help="output directory (default ./mpkern-compare)")
    pc.add_argument("--no-plot", action="store_true", help="do not write compare.png")
    pc.add_argument("--no-progress", action="store_true", help="no progress bars")
    pc.add_argument("--hf-model", default=None, metavar="CONFIG_PATH",
                    help="train a transformers sequence classifier built (random init, no download) from this local "
                         "config.json or folder instead of the built-in model; vocab/labels are set to the task's")
    pc.add_argument("--find-batch", action="store_true",
                    help="instead of the comparison: grow each run's batch (doubling from --batch-size, then "
                         "bisecting) until it no longer fits --memory-budget; at each size train --steps steps "
                         "(default 20) and record tokens/s, peak memory, stability and val accuracy")
    pc.add_argument("--memory-budget", type=_size, default=None, metavar="SIZE",
                    help="memory budget of --find-batch, e.g. 96MiB or 20GB (CPU: required, the measured peak tensor "
                         "bytes decide; CUDA: default the device's free memory, an out-of-memory error counts as not "
                         "fitting)")
    pc.add_argument("--release", action="store_true",
                    help="also train each mpkern run with gradient release, right after it (named RUN+release): "
                         "FusedAdamWMP(release_grads=True), the step inside opt.backward(loss[, scaler]) and each "
                         "bucket's grads freed once stepped -- its tokens/s and peak memory beside the regular run's, "
                         "and whether every step's loss was the same")
    pc.add_argument("--release-bucket", dest="release_bucket_bytes", type=_size, default=None, metavar="SIZE",
                    help="with --release: bytes of grads stepped together inside backward, e.g. 256KiB (default "
                         "the optimizer's release_bucket_bytes, 32 MiB: on a model whose grads are smaller, one "
                         "bucket holds them all and none is freed early)")
    pc.add_argument("--doctor", action="store_true",
                    help="also diagnose the model (initial weights, one validation batch) in each 16-bit run's dtype "
                         "and recipe (mpkern.diagnose: the layers where it departs from fp32 and the fixes); "
                         "appended to the report and results.json")
    pc.set_defaults(func=_cmd_compare)


def _cmd_doctor(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .compare.diagnosis import compare_case
    from .doctor import command

    device = _resolve_device(args.device, parser)
    dtypes = args.dtype or ["fp16", "bf16"]
    if "bf16" in dtypes and device.startswith("cuda"):
        import torch

        if not torch.cuda.is_bf16_supported():
            print("[doctor] leaving out bf16: this GPU has no native bf16 (compute capability < 8.0)")
            dtypes = [d for d in dtypes if d != "bf16"]
    command.run(args.model or ["compare", "gpt2"], dtypes, device=device, recipe=args.recipe, full=args.full,
                loss_scale=args.loss_scale, out=args.out, as_json=args.json, plot=not args.no_plot, seed=args.seed,
                keep_fp32=args.keep_fp32, builders={"compare": compare_case})
    return 0


def _choices(allowed: tuple[str, ...], what: str):
    def parse(s: str) -> list[str]:
        items = [x.strip() for x in s.split(",") if x.strip()]
        bad = [x for x in items if x not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{what} must be a comma list of {', '.join(allowed)}; got {s!r}")
        return items
    return parse


def _add_doctor_parser(sub: Any) -> None:
    """The ``doctor`` subcommand's flags."""
    from .doctor.models import MODELS

    pd = sub.add_parser(
        "doctor", help="find the layers where fp16/bf16 breaks a model, say why, and the fix",
        description="Run each model once in fp32 and once in the 16-bit recipe on the same inputs and measure "
                    "every module: its own error (alone, on the fp32 input), the accumulated error, headroom to "
                    "the dtype's max, inf/NaN appearing, values below the smallest normal, and every gradient at "
                    "the loss scale; then print the findings with their fixes (mpkern.diagnose).")
    pd.add_argument("--model", type=_choices(("compare", *MODELS), "--model"), default=None, metavar="LIST",
                    help="comma list of compare (the built-in compare classifier), gpt2 (GPT-2 LM from its config), "
                         "bert (BERT sequence classifier from its config); default compare,gpt2. Random weights, "
                         "no download; needs transformers for gpt2/bert. The examples of docs/doctor.md: lse (a naive "
                         "log-sum-exp), cancel (an offset added and taken away), tiny (a badly scaled layer), "
                         "gradscale (a small loss at loss scale 1)")
    pd.add_argument("--dtype", type=_choices(("fp16", "bf16"), "--dtype"), default=None, metavar="LIST",
                    help="comma list of fp16,bf16 (default both)")
    pd.add_argument("--recipe", choices=("autocast", "params"), default="autocast",
                    help="autocast (fp32 params + torch.autocast, default) or params (a 16-bit copy of the model)")
    pd.add_argument("--full", action="store_true",
                    help="the Hugging Face models at full size (GPT-2 small, BERT-base) instead of 2 layers x 128")
    pd.add_argument("--loss-scale", type=_positive_float, default=None,
                    help="loss scale the gradients are judged at "
                         "(default: GradScaler's first, 2^16, for fp16; 1 for bf16)")
    pd.add_argument("--keep-fp32", type=lambda s: [x for x in s.split(",") if x], default=None, metavar="NAMES",
                    help="comma list of module names to run as fp32 islands first (mpkern.nn.keep_fp32): check a fix")
    pd.add_argument("--device", type=_device, default=None, help="cpu or cuda (default: cuda if available)")
    pd.add_argument("--seed", type=_nonneg_int, default=0, help="seed of weights and inputs (default 0)")
    pd.add_argument("--json", action="store_true", help="print the diagnoses as JSON (progress goes to stderr)")
    pd.add_argument("--out", default=None, help="directory for doctor.json and a plot (PNG) per diagnosis")
    pd.add_argument("--no-plot", action="store_true", help="with --out: no PNG plots")
    pd.set_defaults(func=_cmd_doctor)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``mpkern`` command (exposed for tests and docs)."""
    return _parser_and_commands()[0]


def _parser_and_commands() -> tuple[argparse.ArgumentParser, Mapping[str, argparse.ArgumentParser]]:
    """The ``mpkern`` parser and its subcommands' parsers by name (each command reports its errors through its own).

    A subcommand added with ``sub.add_parser(name)`` and ``set_defaults(func=...)`` is found by :func:`main`
    through the public ``choices`` of the subparsers action; nothing else needs registering.
    """
    p = argparse.ArgumentParser(prog="mpkern", description="mpkern: fused mixed-precision training kernels")
    p.add_argument("--version", action="version", version=f"mpkern {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True)

    pi = sub.add_parser("info", help="device, dtype support and which backends are available (and why not)")
    pi.add_argument("--json", action="store_true",
                    help="print mpkern.info() as JSON (version, torch, device, capability, bf16/fp16, backends with "
                         "availability and reason, matmul notes)")
    pi.set_defaults(func=_cmd_info)

    _add_compare_parser(sub)

    pb = sub.add_parser(
        "bench", help="kernel benchmarks vs the PyTorch peers, with the byte-model limit of each ratio",
        description="Time mpkern's kernels against the PyTorch recipe a user would otherwise run, in one process, "
                    "and print time, GB/s (TFLOP/s for matmul), %% of measured bandwidth, the speed ratio and "
                    "its byte-model limit (peer bytes / mpkern bytes).")
    pb.add_argument("which", nargs="?", default="all", choices=("unscale", "adamw", "matmul", "release", "all"))
    pb.add_argument("--device", type=_device, default=None, help="cpu or cuda (default: cuda if available)")
    pb.add_argument("--quick", action="store_true", help="small sizes: under a minute on a 2-core CPU")
    pb.add_argument("--json", metavar="FILE", help="write the results (with machine and versions) as JSON")
    pb.add_argument("--plot", metavar="FILE", help="write a PNG of speedups vs byte-model limits (needs matplotlib)")
    pb.add_argument("--params", type=_positive_int, help="parameters of the optimizer-side benchmarks")
    pb.add_argument("--tensors", type=_positive_int, help="number of tensors they are split into")
    pb.add_argument("--reps", type=_positive_int, help="timed repetitions (median reported)")
    from . import bench

    bench.add_adamw_arguments(pb)  # --modes, --torchao-params, --no-torchao, --no-host-time
    pb.set_defaults(func=_cmd_bench)

    _add_doctor_parser(sub)

    pp = sub.add_parser(
        "plan", help="memory per recipe for a model of N params (bytes/param measured from real optimizer state)",
        description="Bytes per parameter of weights, grads, master weights and moments for each mixed-precision "
                    "recipe, measured once from the real state tensors of each optimizer on a small model and "
                    "scaled to --params; optionally sharded over --world-size ranks, against --gpu-mem.")
    pp.add_argument("--params", type=_positive_float, help="number of parameters, e.g. 7e9")
    pp.add_argument("--hf-config", metavar="PATH", help="take the parameter count from a transformers config.json")
    pp.add_argument("--world-size", type=_positive_int, default=1, help="ranks the state is sharded over (FSDP2)")
    pp.add_argument("--gpu-mem", type=_positive_float, default=None, metavar="GB", help="memory per device in GB")
    pp.add_argument("--memory-budget", type=_size, default=None, metavar="SIZE",
                    help="estimate the largest batch per recipe within SIZE (e.g. 20GB) from a measured step of "
                         "--hf-config's model (meta device) or of mpkern compare's model")
    pp.add_argument("--seq-len", type=_positive_int, default=None,
                    help="tokens per sample of --memory-budget's step (default 16 for compare's model, 512 for "
                         "--hf-config)")
    pp.add_argument("--safety-margin", type=_number(float, "a fraction in [0, 1)", allow_zero=True), default=0.1,
                    metavar="FRACTION", help="share of the budget the estimate leaves unused (default 0.1)")
    pp.add_argument("--json", action="store_true", help="print as JSON")
    pp.set_defaults(func=_cmd_plan)
    return p, sub.choices


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mpkern`` console script; returns the exit status."""
    parser, commands = _parser_and_commands()
    args = parser.parse_args(argv)
    return args.func(args, commands[args.cmd])  # the subcommand's own parser, for its errors


if __name__ == "__main__":
    sys.exit(main())
