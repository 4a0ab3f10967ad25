"""The report: lessons in words, the markdown table and details, and the files written."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch

from .config import split_run
from .memory import OTHERS_WARN
from .plot import plot_results


def lessons(results: dict[str, Any]) -> list[str]:
    """What this report shows, in words, from its own numbers: the master-weight lesson and the
    speed/memory lesson worded for whether this device computes 16-bit natively."""
    runs = {r["name"]: r for r in results["runs"]}
    out = []
    naive, ok = runs.get("bf16-naive"), [r for n, r in runs.items() if n != "bf16-naive" and r["val_acc"] is not None]
    lr = results["config"]["lr"]
    if naive is not None and naive["val_acc"] is not None and ok:
        best = max(r["val_acc"] for r in ok)
        chance = results["task"]["chance_acc"]
        masters = [n for n in runs if n.startswith("mpkern") and not split_run(n)[1]] or [r["name"] for r in ok]
        acc = ", ".join(f"{n} {100 * runs[n]['val_acc']:.1f} %" for n in masters if runs[n]["val_acc"] is not None)
        if best < max(0.3, 3 * chance):
            out.append(f"Master weights: too few steps to show the lesson -- no run has learned the task yet (best "
                       f"{100 * best:.1f} %, chance {100 * chance:.1f} %); at lr {lr:g} the default model needs "
                       "~800 steps (the default takes up to 1000).")
        elif naive["val_acc"] < 0.5 * best:
            out.append(f"Master weights: bf16-naive (bf16 params, no fp32 master) reached "
                       f"{100 * naive['val_acc']:.1f} % (chance {100 * chance:.1f} %): at lr {lr:g} Adam's ~lr-sized "
                       f"updates are below half a bf16 ulp of most weights and round away; with fp32 masters: {acc}.")
        else:
            out.append(f"Master weights: at lr {lr:g} bf16-naive reached {100 * naive['val_acc']:.1f} %, close to the "
                       f"runs with masters ({acc}): its updates are large enough not to round away at this lr "
                       "(at the default 1e-4 they do).")
    out += _mode_lessons(runs) + _release_lessons(runs) + _time_box_lessons(results)
    nat = results.get("native_compute") or {}
    dev = results["device"]
    fp32 = runs.get("fp32")
    sixteen = [r for r in results["runs"] if r["name"] != "fp32" and r.get("speedup_vs_fp32")]
    speeds = ", ".join(f"{r['name']} {r['speedup_vs_fp32']:.2f}x" for r in sixteen)
    speeds = f" Measured here, tokens/s vs fp32: {speeds}." if fp32 is not None and sixteen else ""
    bf, fh = nat.get("bfloat16", {}), nat.get("float16", {})
    has_fp16 = any("fp16" in n for n in runs)
    if dev["type"] == "cpu":
        if bf.get("native"):
            out.append(f"Speed: this CPU computes bf16 natively ({bf['why']}): its bf16 GEMMs are faster than fp32 "
                       "ones, so a bf16 run gains where GEMMs dominate its step and can lose where casts and "
                       f"elementwise ops weigh as much.{speeds}"
                       + (" fp16 is not native on this CPU (" + fh.get("why", "?") + "): the fp16 runs show "
                          "the GradScaler recipe, not fp16 speed." if has_fp16 and not fh.get("native") else ""))
        else:
            out.append(f"Speed: this CPU does not compute bf16 natively ({bf.get('why', 'not measured')}). The bf16 "
                       "runs pay for that emulation in every bf16 op (in the GEMMs too, except where the GEMM column "
                       f"says mpkern: its fp32 GEMM of the upcast operands).{speeds} What mixed precision buys on "
                       "this machine is memory -- state bytes/param and the activations saved for backward (peak mem "
                       "also counts the temporaries of the GEMM path); speed needs native 16-bit compute: a CPU with "
                       "AVX512-BF16 or AMX, or a GPU (bf16 from compute capability 8.0).")
    else:
        out.append(f"Speed: {dev.get('name', 'this GPU')}: bf16 {'native' if bf.get('native') else 'not native'} "
                   f"({bf.get('why', '?')}); fp16 {'native' if fh.get('native') else 'not native'}.{speeds}")
    others = dev.get("other_processes_cores")
    if others is not None and others >= OTHERS_WARN:
        out.append(f"Timing caveat: other processes used {others:.2f} of the {dev.get('cores')} cores on average while "
                   "the runs trained: they compete for the cores, and torch's worker threads wait for each other "
                   f"when one is descheduled ({dev.get('threads')} threads here) -- tokens/s can drop several-fold "
                   "(measured on a 2-core VM with one other busy process: 10x). Re-run on a quiet machine, or compare "
                   "with --threads 1.")
    return out


def _mode_lessons(runs: dict[str, dict[str, Any]]) -> list[str]:
    """What each mpkern mode saves (state bytes/param against fp32's) and costs (val acc against fp32's)."""
    fp32 = runs.get("fp32")
    parts = []
    for name, r in runs.items():
        if (not name.startswith("mpkern") or split_run(name)[1] or r.get("status", "ok") != "ok"
                or r["val_acc"] is None or "state_bytes_per_param" not in r):
            continue
        bpp = r["state_bytes_per_param"]["total"]
        text = f"{name} ({r['optimizer'].removeprefix('mpkern.FusedAdamWMP(').split(')')[0]}) keeps {bpp:.4g} B/param"
        if fp32 is not None and fp32["val_acc"] is not None and "state_bytes_per_param" in fp32:
            ref = fp32["state_bytes_per_param"]["total"]
            saves = f"{100 * (1 - bpp / ref):.0f} % less training state than fp32" if bpp < ref else "as much as fp32"
            d = 100 * (r["val_acc"] - fp32["val_acc"])
            cost = ("no measurable accuracy cost" if abs(d) < 1.0
                    else f"{-d:.1f} points below fp32" if d < 0 else f"{d:.1f} points above fp32")
            text += (f" ({saves}) and reached {100 * r['val_acc']:.1f} % val acc vs fp32's "
                     f"{100 * fp32['val_acc']:.1f} %: {cost}")
        else:
            text += f" and reached {100 * r['val_acc']:.1f} % val acc"
        parts.append(text)
    return ["mpkern modes: " + "; ".join(parts) + "."] if parts else []


def release_vs_regular(runs: list[dict[str, Any]]) -> None:
    """Put into each release run's ``release`` entry its numbers against its regular run's (when that
    ran): tokens/s and peak memory ratios, and whether every step's loss was the same."""
    by_name = {r["name"]: r for r in runs}
    for r in runs:
        rel, reg = r.get("release"), by_name.get(split_run(r["name"])[0])
        if rel is None or reg is None:
            continue
        rel["tokens_per_s_vs_regular"] = (r["tokens_per_s"] / reg["tokens_per_s"]
                                          if r["tokens_per_s"] and reg["tokens_per_s"] else None)
        rel["peak_mem_vs_regular"] = (r["peak_mem_bytes"] / reg["peak_mem_bytes"]
                                      if r["peak_mem_bytes"] and reg["peak_mem_bytes"] else None)
        rel["same_losses"] = r["losses"] == reg["losses"] and r["steps_done"] == reg["steps_done"]


def _release_lessons(runs: dict[str, dict[str, Any]]) -> list[str]:
    """Each release run against its regular run: speed, peak memory, grad bytes held, same losses."""
    from ..measure import fmt_size

    out = []
    for name, r in runs.items():
        rel = r.get("release")
        if rel is None or "same_losses" not in rel:
            continue
        reg = runs[rel["of"]]
        speed = (f"{r['tokens_per_s']:,.0f} vs {reg['tokens_per_s']:,.0f} tokens/s "
                 f"({rel['tokens_per_s_vs_regular']:.2f}x)" if rel["tokens_per_s_vs_regular"] else "tokens/s n/a")
        mem = (f"peak mem {fmt_size(r['peak_mem_bytes'])} vs {fmt_size(reg['peak_mem_bytes'])} "
               f"({rel['peak_mem_vs_regular']:.2f}x)" if rel["peak_mem_vs_regular"] else "peak mem n/a")
        held = (f"grads held at once {fmt_size(rel['peak_grad_bytes'])} of {fmt_size(rel['grad_bytes_all'])} "
                f"(bucket {fmt_size(rel['bucket_bytes'])}, {rel['backward_passes']} backward passes per step)")
        if rel["peak_grad_bytes"] >= rel["grad_bytes_all"]:
            held += " -- the whole gradient fits one bucket, so no grad is freed early (--release-bucket SIZE)"
        if rel["peak_mem_vs_regular"] and rel["peak_mem_vs_regular"] >= 1.0:
            held += (" -- peak mem is not lower: the activations, not the grads, set the step's peak"
                     + (", and the two-pass backward keeps the whole graph (retain_graph) while pass 1's grads "
                        "arrive" if rel["backward_passes"] == 2 else ""))
        same = ("the same loss at every step (bit-identical training)" if rel["same_losses"]
                else "DIFFERENT losses from the regular run")
        out.append(f"Gradient release: {name} (the step inside opt.backward, each bucket's grads freed once "
                   f"stepped) against {rel['of']}: {speed}, {mem}; {held}; {same}.")
    return out


def _time_box_lessons(results: dict[str, Any]) -> list[str]:
    """Why a run stopped early (its time box) and what its numbers then mean."""
    boxes = (results.get("budget") or {}).get("time_boxed") or {}
    out = []
    for r in results["runs"]:
        if r.get("status") != "stopped":
            continue
        why = boxes.get(r["name"], {}).get("why", "it was time-boxed")
        acc = f"{100 * r['val_acc']:.1f} %" if r["val_acc"] is not None else "n/a"
        out.append(f"Time box: {r['name']} stopped at step {r['steps_done']} of {results['config']['steps']} -- {why}. "
                   f"Its tokens/s are measured over those steps; its loss ({r['final_loss']:.3f}) and val acc ({acc}) "
                   "are those of the step it reached, not comparable with the finished runs' (--time-budget off, e.g. "
                   "--steps 800, trains it fully).")
    return out


# What the peak-memory column measures, by ``device is CUDA``.
MEMORY_NOTE = {
    False: ("CPU peak mem = tensor bytes of the run: its weights, masters and moments plus the peak of the tensors "
            "one steady training step creates (activations, grads and the temporaries of each op, counted from "
            "creation to free through the dispatcher; allocator-independent), including the fp32 temporaries inside "
            "mpkern.linear's CPU GEMM path (the fp32 weight copy and one row block of the upcast input and product: "
            "'GEMM temps' below, the largest at once). RSS peak = growth of the process's peak resident set size "
            "during the run "
            "(Linux VmHWM, reset per run; includes what the allocator keeps after frees and oneDNN scratch). "
            "act. saved counts the distinct tensors autograd saved for backward in one step."),
    True: "CUDA peak memory = torch.cuda.max_memory_allocated during the run minus what was allocated before it.",
}


def jsonable(v: Any) -> Any:
    """``v`` with dtypes as strings and tuples as lists (nested), ready for ``json.dump``."""
    if isinstance(v, dict):
        return {k: jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, torch.dtype):
        return str(v)
    return v


# ---- report -------------------------------------------------------------------------------------
def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2**20:.1f} MiB"


def _status(r: dict[str, Any]) -> str:
    if r["status"] == "diverged":
        return f"diverged at step {r['diverged_at_step']}"
    if r["status"] == "stopped":
        return f"time-boxed: stopped at step {r['steps_done']}"
    return r["status"]


def format_table(results: dict[str, Any]) -> str:
    """The per-run table (markdown) of a :func:`run` report."""
    rss = any(r.get("rss_peak_bytes") is not None for r in results["runs"])
    cols = ["run", "params", "compute", "GEMM", "tokens/s", "vs fp32", "peak mem"] + ["RSS peak"] * rss + [
            "act. saved", "state B/param", "final loss", "val acc", "skipped", "status"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results["runs"]:
        cells = [
            r["name"], r["param_dtype"], r["compute"], r.get("gemm", "?"),
            f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "n/a",
            f"{r['speedup_vs_fp32']:.2f}x" if r["speedup_vs_fp32"] else "n/a",
            _fmt_bytes(r["peak_mem_bytes"])] + [_fmt_bytes(r.get("rss_peak_bytes"))] * rss + [
            _fmt_bytes(r["activation_bytes_saved_for_backward"]),
            f"{r['state_bytes_per_param']['total']:.4g}",
            f"{r['final_loss']:.3f}" if math.isfinite(r["final_loss"]) else "nan",
            f"{100 * r['val_acc']:.1f} %" if r["val_acc"] is not None else "n/a",
            str(r["skipped_steps"]),
            _status(r),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_details(results: dict[str, Any]) -> str:
    """What exactly ran in each run (optimizer, clipping, linear layers), the loss-scale history,
    and the memory plan of the trained model -- the markdown below the table."""
    out = [f"* {line}" for line in results.get("lessons", [])]
    out += ["", "| run | optimizer | clipping | linear layers |", "|---|---|---|---|"]
    for r in results["runs"]:
        out.append(f"| {r['name']} | {r['optimizer']} | {r['clip']} | {r['linear']} |")
    for r in results["runs"]:
        if r["loss_scale_history"]:
            hist = ", ".join(f"{s:g}@{i}" for i, s in r["loss_scale_history"][:12])
            more = " ..." if len(r["loss_scale_history"]) > 12 else ""
            out.append(f"\n{r['name']} loss scale (value@step): {hist}{more}")
    temps = [f"{r['name']} {_fmt_bytes(r['gemm_temp_bytes'])}" for r in results["runs"] if r.get("gemm_temp_bytes")]
    if temps:
        out.append("\nGEMM temps (fp32 temporaries inside mpkern.linear's CPU path, the largest at once; part of peak "
                   "mem): " + ", ".join(temps) + ".")
    out.append("")
    out.append(results["memory_note"])
    if results.get("plan"):
        from ..plan import format_plan

        n = results["runs"][0]["params"]
        out.append(f"\nMemory plan for this model ({n:,} params; bytes/param measured from optimizer state tensors):\n")
        out.append(format_plan(results["plan"]))
    return "\n".join(out)


def format_header(results: dict[str, Any]) -> str:
    """The lines above the table: device, versions, config, task, native compute and budget of ``results``."""
    c, d, t = results["config"], results["device"], results["task"]
    nat = results.get("native_compute") or {}
    native = "; ".join(f"{k} {'yes' if nat[k]['native'] else 'NO'} ({nat[k]['why']})"
                       for k in ("bfloat16", "float16") if k in nat) or "not measured"
    th = nat.get("threads") or {}
    if th.get("why"):
        native += f"\nthreads: {th['threads']} ({th['why']})"
    b = results.get("budget") or {}
    budget = f"; time budget {b['time_budget_s']:g} s: {b['why']}" if b.get("time_budget_s") else ""
    if "memory_budget_bytes" in results:
        from ..measure import fmt_size

        budget = (f"; --find-batch: batch grown from {c['batch_size']} (doubling, then bisecting) within "
                  f"{fmt_size(results['memory_budget_bytes'])}, {c['steps']} steps per size")
    warm = min(c["warmup"], 2) if "memory_budget_bytes" in results else c["warmup"]  # batch.measure_point's
    if c.get("hf_model"):
        model = f"transformers {results['model']['class']} from {c['hf_model']}"
    else:
        model = f"d_model {c['d_model']}, {c['layers']} layers, {c['heads']} heads"
    return (f"mpkern compare -- {d['name']} ({d['type']}), torch {results['versions']['torch']}, "
            f"{results['timestamp']}\n"
            f"model: {model} ({results['model']['params']:,} params), seq {c['seq_len']}, "
            f"batch {c['batch_size']}, {c['steps']} steps (first {warm} untimed), lr {c['lr']:g}, "
            f"clip {c['max_grad_norm']:g}, seed {c['seed']}{budget}\n"
            f"native 16-bit compute: {native}\n"
            f"task: {t['name']}, {t['classes']} classes (chance {100 * t['chance_acc']:.1f} %, ignoring the "
            f"query caps at 50 %), {t['val_sequences']} held-out validation sequences; "
            f"total wall time {results['wall_s']:.0f} s")


def write_outputs(results: dict[str, Any], out: str, *, plot: bool = True) -> dict[str, str]:
    """Write ``results.json``, ``results.md`` and (with matplotlib) ``compare.png`` -- for a
    ``--find-batch`` report ``batch_scaling.png`` -- into ``out``."""
    from .batch import format_batch_table, plot_batch

    os.makedirs(out, exist_ok=True)
    paths = {"json": os.path.join(out, "results.json"), "md": os.path.join(out, "results.md")}
    with open(paths["json"], "w") as f:
        json.dump(results, f, indent=1, allow_nan=True)
    scaling = "batch_scaling" in results
    body = format_batch_table(results) if scaling else format_table(results) + "\n\n" + format_details(results)
    for entry in results.get("doctor", []):
        body += (f"\n\n## mpkern doctor: {entry['run']} ({entry['dtype']}, {entry['recipe']})\n\n"
                 f"```\n{entry['text']}\n```")
    with open(paths["md"], "w") as f:
        f.write(format_header(results).replace("\n", "  \n") + "\n\n" + body + "\n")
    if plot:
        png = os.path.join(out, "batch_scaling.png" if scaling else "compare.png")
        if (plot_batch if scaling else plot_results)(results, png):
            paths["png"] = png
    return paths
