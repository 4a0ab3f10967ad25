"""``mpkern compare --find-batch``: how large a batch each run fits in a memory budget.

The lessons' practical project ("increment batch size until near OOM; record throughput,
stability and validation accuracy"): for each run, the batch grows by doubling from the
configured one (halving first when that does not fit) until a size does not fit, then bisects
between the last size that fit and the first that did not (to 1/8 of the size). At every size the
run trains ``steps`` steps from the same initial weights and records tokens/s, peak memory,
stability (finite loss; skipped steps) and validation accuracy.

What "fits" means: CPU -- the run's peak tensor bytes (persistent state + the peak of the tensors a
steady step creates, :class:`.memory.LiveBytes`) within ``memory_budget``; the run stops at its
second step when that step is over. CUDA -- ``torch.cuda.max_memory_allocated`` within the budget
(default: the device's free memory), and a CUDA out-of-memory error is caught and counts as not
fitting (status ``"oom"``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..measure import fmt_size
from .config import Config
from .task import make_task
from .train import train_one

#: the largest batch the search tries
MAX_BATCH = 1 << 16
#: bisection stops when the gap between fitting and not fitting is at most 1/RESOLUTION of the size
RESOLUTION = 8
FITS = ("ok", "diverged")  # a diverged size still fitted in memory: the search is about memory


def default_budget(device: torch.device) -> int:
    """CUDA: the device's free memory now; CPU has no default (ValueError)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    raise ValueError("memory_budget: on CPU --find-batch needs --memory-budget SIZE (e.g. 96MiB): the measured "
                     "peak is compared with it")


def measure_point(name: str, cfg: Config, base: nn.Module, batch: int, budget: int,
                  linear_choice: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Train run ``name`` at ``batch`` for ``cfg.steps`` steps; the point of its scaling curve."""
    c = replace(cfg, batch_size=batch, time_box={}, memory_budget=budget, warmup=min(cfg.warmup, 2),
                val_size=min(cfg.val_size, 512))
    try:
        r = train_one(name, c, make_task(c), base, progress=False, linear_choice=linear_choice)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {"batch_size": batch, "tokens_per_s": None, "peak_mem_bytes": None, "status": "oom", "val_acc": None,
                "skipped_steps": None, "final_loss": None}
    status = r["status"]
    if status == "ok" and r["peak_mem_bytes"] is not None and r["peak_mem_bytes"] > budget:
        status = "over_budget"
    return {"batch_size": batch, "tokens_per_s": r["tokens_per_s"] if status in FITS else None,
            "peak_mem_bytes": r["peak_mem_bytes"], "status": status,
            "val_acc": r["val_acc"] if status in FITS else None, "skipped_steps": r["skipped_steps"],
            "final_loss": r["final_loss"] if status in FITS else None}


def search(fits: Callable[[int], bool], start: int) -> tuple[int, int | None]:
    """``(largest size that fits, smallest tried size that does not)``: doubling from ``start`` (halving
    first when ``start`` does not fit), then bisecting to 1/:data:`RESOLUTION` of the size."""
    lo, hi, b = 0, None, start
    if fits(b):
        lo = b
        while hi is None and b * 2 <= MAX_BATCH:
            b *= 2
            if fits(b):
                lo = b
            else:
                hi = b
    else:
        hi = b
        while b > 1 and lo == 0:
            b //= 2
            if fits(b):
                lo = b
            else:
                hi = b
    while hi is not None and lo > 0 and hi - lo > max(1, lo // RESOLUTION):
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


def find_batch(cfg: Config, base: nn.Module, budget: int,
               linear_choice: dict[str, dict[str, Any]] | None = None,
               log: Callable[[str], None] = print) -> dict[str, Any]:
    """``{run: {"max_batch_size", "points": [...]}}`` for every run in ``cfg.precisions``."""
    out: dict[str, Any] = {}
    for name in cfg.precisions:
        points: dict[int, dict[str, Any]] = {}

        def fits(b: int, name: str = name, points: dict = points) -> bool:
            p = measure_point(name, cfg, base, b, budget, linear_choice)
            points[b] = p
            log(f"[find-batch] {name:<12} batch {b:>6}: {p['status']:<11} peak {fmt_size(p['peak_mem_bytes'])}"
                + (f", {p['tokens_per_s']:,.0f} tok/s" if p["tokens_per_s"] else ""))
            return p["status"] in FITS

        lo, hi = search(fits, cfg.batch_size)
        out[name] = {"max_batch_size": lo, "first_not_fitting": hi,
                     "points": [points[b] for b in sorted(points)]}
    return out


def ratios(scaling: dict[str, Any]) -> dict[str, float | None]:
    """Each run's largest batch over fp32's (None without an fp32 run that fits at all)."""
    ref = (scaling.get("fp32") or {}).get("max_batch_size")
    return {n: (s["max_batch_size"] / ref if ref else None) for n, s in scaling.items()}


def format_batch_table(results: dict[str, Any]) -> str:
    """One row per (run, batch size) and the summary of how much larger a batch each run fits."""
    scaling = results["batch_scaling"]
    lines = ["| run | batch | status | tokens/s | peak mem | final loss | val acc | skipped |", "|" + "---|" * 8]
    for name, s in scaling.items():
        for p in s["points"]:
            mark = " **max**" if p["batch_size"] == s["max_batch_size"] else ""
            lines.append(f"| {name} | {p['batch_size']}{mark} | {p['status']} | "
                         + (f"{p['tokens_per_s']:,.0f}" if p["tokens_per_s"] else "n/a") + " | "
                         + f"{fmt_size(p['peak_mem_bytes'])} | "
                         + (f"{p['final_loss']:.3f}" if p["final_loss"] is not None else "n/a") + " | "
                         + (f"{100 * p['val_acc']:.1f} %" if p["val_acc"] is not None else "n/a") + " | "
                         + f"{p['skipped_steps'] if p['skipped_steps'] is not None else 'n/a'} |")
    rat = ratios(scaling)
    summary = ", ".join(f"{n} {s['max_batch_size']}" + (f" ({rat[n]:.2f}x fp32)" if rat[n] and n != "fp32" else "")
                        for n, s in scaling.items())
    return "\n".join(lines) + f"\n\nLargest batch within {fmt_size(results['memory_budget_bytes'])}: {summary}."


def plot_batch(results: dict[str, Any], path: str) -> bool:
    """tokens/s and peak memory against batch size, one line per run, the largest batch marked."""
    from ..measure import pyplot

    plt = pyplot("compare", "batch_scaling.png")
    if plt is None:
        return False
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (name, s) in enumerate(results["batch_scaling"].items()):
        pts = [p for p in s["points"] if p["peak_mem_bytes"] is not None]
        fit = [p for p in pts if p["tokens_per_s"]]
        ax[0].plot([p["batch_size"] for p in fit], [p["tokens_per_s"] for p in fit], "o-", color=f"C{i}", label=name)
        ax[1].plot([p["batch_size"] for p in pts], [p["peak_mem_bytes"] / 2**20 for p in pts], "o-", color=f"C{i}",
                   label=name)
        for p in pts:
            if p["batch_size"] == s["max_batch_size"]:
                ax[0].plot(p["batch_size"], p["tokens_per_s"], "*", ms=16, color=f"C{i}")
                ax[1].plot(p["batch_size"], p["peak_mem_bytes"] / 2**20, "*", ms=16, color=f"C{i}")
    ax[1].axhline(results["memory_budget_bytes"] / 2**20, color="gray", ls=":", label="budget")
    for a, title in ((ax[0], "tokens/s"), (ax[1], "peak memory (MiB)")):
        a.set_xscale("log", base=2)
        a.set_xlabel("batch size (star: largest that fits)")
        a.set_title(title)
        a.legend(fontsize=8)
    fig.suptitle(f"mpkern compare --find-batch: {results['device']['name']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
