"""compare.png: loss curves, validation accuracy, tokens/s and peak memory of the runs."""

from __future__ import annotations

import math
from typing import Any

from ..measure import pyplot


def plot_results(results: dict[str, Any], path: str) -> bool:
    """Loss curves, validation accuracy, tokens/s and peak memory in one PNG. False without matplotlib."""
    plt = pyplot("compare", "compare.png")
    if plt is None:
        return False
    runs = results["runs"]
    names = [r["name"] for r in runs]
    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    styles = ["-", "--", "-.", ":"]
    for i, r in enumerate(runs):
        ys = [float("nan") if v is None else v for v in r["losses"]]
        k = max(1, len(ys) // 60)  # smooth: running mean over k steps
        sm = [sum(ys[max(0, j - k + 1):j + 1]) / len(ys[max(0, j - k + 1):j + 1]) for j in range(len(ys))]
        # runs that learn identically overlap: distinct dashes and widths keep each one visible
        ax[0, 0].plot(range(1, len(sm) + 1), sm, ls=styles[i % len(styles)], lw=2.6 - 0.35 * i, color=f"C{i}",
                      label=r["name"] + ("" if r["status"] == "ok" else " (diverged)"))
    ax[0, 0].axhline(math.log(results["task"]["classes"]), color="gray", ls=":", lw=1, label="ln(classes): chance")
    ax[0, 0].set_xlabel("step")
    ax[0, 0].set_ylabel("train loss")
    ax[0, 0].set_title("training loss")
    ax[0, 0].legend(fontsize=8)

    def bars(a, vals, title, fmt):
        xs = range(len(names))
        a.bar(xs, [v or 0 for v in vals], color=[f"C{i}" for i in xs])
        a.set_xticks(list(xs))
        a.set_xticklabels(names, rotation=20, fontsize=8)
        a.set_title(title)
        for i, v in enumerate(vals):
            a.text(i, v or 0, "n/a" if v is None else fmt(v), ha="center", va="bottom", fontsize=8)

    bars(ax[0, 1], [None if r["val_acc"] is None else 100 * r["val_acc"] for r in runs],
         "validation accuracy (%)", lambda v: f"{v:.1f}")
    ax[0, 1].axhline(100 * results["task"]["chance_acc"], color="gray", ls=":", lw=1)
    bars(ax[1, 0], [r["tokens_per_s"] for r in runs], "tokens/s (steady state)", lambda v: f"{v:,.0f}")
    mem = [None if r["peak_mem_bytes"] is None else r["peak_mem_bytes"] / 2**20 for r in runs]
    kind = runs[0]["peak_mem_kind"].split(":")[0] if runs else ""  # "tensor bytes" / "cuda.max_memory_allocated ..."
    bars(ax[1, 1], mem, f"peak memory (MiB, {kind.split(' - ')[0]})", lambda v: f"{v:.1f}")
    d = results["device"]
    fig.suptitle(f"mpkern compare: {d['name']} ({d['type']}), torch {results['versions']['torch']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
