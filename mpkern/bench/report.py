"""How results are shown: the markdown table every ``mpkern bench`` run prints, and a bar plot of
mpkern's speedup over each peer beside its byte-model limit."""

from __future__ import annotations

import os
from typing import Any

from ..measure import pyplot


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table. A peer's row carries mpkern's speedup over it and the limit; a row
    with ``vs`` carries its own speed over that row (``1.85x vs <vs>``). "state B/param": resident
    optimizer state (masters + moments) per param, where the row has it."""
    state = any(r.get("state_bytes_per_param") is not None for r in rows)
    cols = ["kernel", "method", "ms", "B/param", *(["state B/param"] if state else []), "rate", "% of bound",
            "mpkern speedup", "byte-model limit"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lim = r["byte_model_limit"]
        if lim is not None:
            lim_s = f"{lim:.2f}x"
        elif r["mpkern_speedup"] is not None:
            lim_s = r.get("note") or "n/a (compute-bound)"
        else:
            lim_s = ""
        x = r["mpkern_speedup"]
        speed = "" if x is None else f"{x:.2f}x" if x >= 0.1 else f"{x:.2g}x"
        if speed and r.get("vs"):
            speed += f" vs {r['vs']}"
        cells = [r["kernel"], r["method"], "" if r["ms"] is None else f"{r['ms']:.3g}",
                 "" if r["bytes_per_param"] is None else f"{r['bytes_per_param']:g}"]
        if state:
            sb = r.get("state_bytes_per_param")
            cells.append("" if sb is None else f"{sb:.4g}")
        cells += ["" if r["rate"] is None else f"{r['rate']:.3g} {r['unit']}",
                  "" if r["pct_of_bound"] is None else f"{r['pct_of_bound']:.0f} % of {r['bound']}", speed, lim_s]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> bool:
    """Bars of mpkern's speedup over each peer beside the byte-model limit. False without matplotlib."""
    plt = pyplot("bench", "plot")
    if plt is None:
        return False
    peers = [r for r in result["rows"] if r["mpkern_speedup"] is not None]
    if not peers:
        return False
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(peers)), 4.5))
    xs = list(range(len(peers)))
    w = 0.4
    ax.bar([x - w / 2 for x in xs], [r["mpkern_speedup"] for r in peers], w, label="measured speedup")
    ax.bar([x + w / 2 for x in xs], [r["byte_model_limit"] or 0 for r in peers], w, label="byte-model limit")
    ax.axhline(1.0, color="gray", lw=1, ls=":")
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{r['method'][:38]}\nvs {r['vs'][:30]}" if r.get("vs") else
                        f"{r['kernel']}\nvs {r['method'][:38]}" for r in peers], fontsize=7, rotation=15)
    ax.set_ylabel("peer time / mpkern time (or time of 'vs' / row time)")
    ax.set_title(f"mpkern bench -- {result['meta']['device']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
