"""The end-to-end stages' tables, from their JSON -- standard library only (the summary imports it).

``python -m tools.gpu_check.e2e_table OUT/e2e_gpt2.json OUT/e2e_llama7b.json`` prints them;
:func:`render` turns one stage file (``e2e_gpt2`` or ``e2e_llama7b``) into markdown:

* ``e2e_gpt2``: one row per recipe -- tokens/s and peak memory with their ratios to fp32 and to the
  AMP recipe, the loss after N steps -- then the goals (mpkern >= AMP in tokens/s; <= 0.6x its peak at
  batch 1), where gradient release pays (:func:`release_crossing`), and with ``--find-batch`` the
  largest batch per recipe under the cap, mpkern's ratio to AMP beside it (goal >= 1.5x);
* ``e2e_llama7b``: one row per recipe -- tokens/s, peak memory, ``mpkern plan``'s planned bytes and
  measured / planned (goal within 10 %); a recipe that did not fit says so, its planned bytes beside.
"""

from __future__ import annotations

import json
import sys
from typing import Any

__all__ = ["fmt_bytes", "ratio", "render", "gpt2_table", "llama7b_table", "find_batch_table", "release_crossing",
           "main", "AMP", "REFERENCE"]

#: each stage's AMP recipe and its first reference (the lessons' FP32 baseline, where the stage has one)
AMP = {"e2e_gpt2": "amp-bf16", "e2e_gpt2_batch": "amp-bf16", "e2e_llama7b": "amp"}
REFERENCE = {"e2e_gpt2": "fp32", "e2e_gpt2_batch": "fp32", "e2e_llama7b": "amp"}
#: the issue's goals
GOAL_SPEED, GOAL_PEAK_B1, GOAL_BATCH, GOAL_PLAN = 1.0, 0.6, 1.5, 0.10


def fmt_bytes(n: float | None) -> str:
    """Bytes as GiB / MiB / KiB (``n/a`` for None)."""
    if n is None:
        return "n/a"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, None when either is missing or ``b`` is 0."""
    return a / b if a is not None and b else None


def _x(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def _rows(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["recipe"]: r for r in data.get("rows", []) if "recipe" in r}


def _ok(r: dict[str, Any], key: str) -> Any:
    """``r[key]`` of a row that ran to its end (ok), else None: a partial peak is no reference."""
    return r.get(key) if r.get("status") == "ok" else None


def _status(r: dict[str, Any]) -> str:
    s = r.get("status", "?")
    if s == "oom":
        return f"oom ({r.get('oom_at') or r.get('phase')})"
    if s not in ("ok", "diverged") and r.get("error"):
        return f"{s}: {r['error'][:80]}"
    return s


def _loss(r: dict[str, Any]) -> str:
    if r.get("loss_final") is None:
        return "n/a"
    return f"{r['loss_first']:.3f} -> {r['loss_final']:.3f}"


def _header(data: dict[str, Any]) -> str:
    m = data.get("meta", {})
    rows = data.get("rows", [])
    dev = next((r.get("device_name") or r.get("device") for r in rows if r.get("device")), m.get("device"))
    first: dict[str, Any] = next((r for r in rows if r.get("seq")), {})
    return (f"{data.get('stage')} ({data.get('status')}): device {dev}, size {m.get('size')}, batch "
            f"{m.get('batch')} x seq {first.get('seq', m.get('seq'))}, {m.get('warmup_steps')} warm-up + "
            f"{m.get('timed_steps')} timed steps per recipe, {first.get('params') or 0:,} params, memory cap "
            f"{fmt_bytes(first.get('memory_cap_bytes', m.get('memory_cap_bytes')))}.")


def release_crossing(r: dict[str, Any]) -> dict[str, Any] | None:
    """Where gradient release pays, from a release row: it frees the grads (``grad_bytes``, G) but not
    the activations (``activation_bytes`` at its batch, A = a x batch), so it lowers the peak by about
    max(0, G - A); it pays below the batch where A = G (``crossing_batch``, at the row's seq)."""
    g, a, b = r.get("grad_bytes"), r.get("activation_bytes"), r.get("batch")
    if not g or not a or not b:
        return None
    per_sample = a / b
    return {"grad_bytes": g, "activation_bytes": a, "per_sample": per_sample, "batch": b, "seq": r.get("seq"),
            "crossing_batch": g / per_sample, "saving_bytes": max(0.0, g - a)}


def _crossing_note(data: dict[str, Any]) -> str | None:
    rel = next((r for r in data.get("rows", []) if r.get("recipe", "").endswith("-release")), None)
    c = release_crossing(rel) if rel else None
    if rel is None or c is None:
        return None
    return (f"Gradient release ({rel['recipe']}) frees the grads, G = {fmt_bytes(c['grad_bytes'])} (bf16), not the "
            f"activations, A = {fmt_bytes(c['per_sample'])} per sample at seq {c['seq']} (saved for backward, "
            f"measured): it lowers the peak by about max(0, G - A), so it pays below batch "
            f"~{c['crossing_batch']:.1f} (A = G). Here batch {c['batch']}: A = {fmt_bytes(c['activation_bytes'])}, "
            f"saving ~{fmt_bytes(c['saving_bytes'])}.")


def gpt2_table(data: dict[str, Any]) -> str:
    """The challenge's table: tokens/s, peak memory, ratios to fp32 and AMP, loss; goals and notes."""
    rows = _rows(data)
    stage = data.get("stage", "e2e_gpt2")
    ref, amp = rows.get(REFERENCE[stage], {}), rows.get(AMP[stage], {})
    lines = [_header(data), "",
             "| recipe | status | tokens/s | x fp32 | x AMP | peak memory | x fp32 | x AMP | loss first -> final |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        tps, peak = _ok(r, "tokens_per_s"), _ok(r, "peak_mem_bytes")
        lines.append(f"| {name} | {_status(r)} | {f'{tps:,.0f}' if tps else 'n/a'} | "
                     f"{_x(ratio(tps, _ok(ref, 'tokens_per_s')))} | {_x(ratio(tps, _ok(amp, 'tokens_per_s')))} | "
                     f"{fmt_bytes(peak)} | {_x(ratio(peak, _ok(ref, 'peak_mem_bytes')))} | "
                     f"{_x(ratio(peak, _ok(amp, 'peak_mem_bytes')))} | {_loss(r)} |")
    notes = []
    for name, r in rows.items():
        if not name.startswith("mpkern") or r.get("status") != "ok":
            continue
        s = ratio(r.get("tokens_per_s"), _ok(amp, "tokens_per_s"))
        p = ratio(r.get("peak_mem_bytes"), _ok(amp, "peak_mem_bytes"))
        met = "met" if s is not None and s >= GOAL_SPEED else "NOT met"
        note = f"{name}: tokens/s {_x(s)} the AMP recipe's (goal >= {GOAL_SPEED:g}x: {met})"
        if r.get("batch") == 1:
            met = "met" if p and p <= GOAL_PEAK_B1 else "NOT met"
            note += f"; peak {_x(p)} (goal at batch 1 <= {GOAL_PEAK_B1:g}x: {met})"
        else:
            note += f"; peak {_x(p)} (the <= {GOAL_PEAK_B1:g}x goal is stated at batch 1; this run's: {r.get('batch')})"
        notes.append(note)
    crossing = _crossing_note(data)
    if crossing:
        notes.append(crossing)
    if notes:
        lines += [""] + [f"* {n}" for n in notes]
    if any(r.get("find_batch") for r in rows.values()):
        lines += ["", find_batch_table(data)]
    return "\n".join(lines)


def find_batch_table(data: dict[str, Any]) -> str:
    """The largest batch each recipe fits under the cap (``--find-batch``), with ratios to AMP."""
    rows = _rows(data)
    amp_fb = rows.get(AMP.get(data.get("stage", ""), ""), {}).get("find_batch") or {}
    cap = next((r["find_batch"].get("cap_bytes") for r in rows.values() if r.get("find_batch")), None)
    lines = [f"Largest batch under {fmt_bytes(cap)} (doubling from the fixed batch, then bisecting to 1/8):", "",
             "| recipe | largest batch | first not fitting | x AMP | peak at it | tokens/s at it | sizes tried |",
             "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        fb = r.get("find_batch")
        if not fb:
            lines.append(f"| {name} | n/a ({_status(r)}) | | | | | |")
            continue
        best: dict[str, Any] = next((p for p in fb.get("points", []) if p.get("batch") == fb.get("max_batch")), {})
        tps = best.get("tokens_per_s")
        rel = ratio(fb.get("max_batch"), amp_fb.get("max_batch"))
        goal = ""
        if name.startswith("mpkern") and rel is not None:
            goal = f" (goal >= {GOAL_BATCH:g}x: {'met' if rel >= GOAL_BATCH else 'NOT met'})"
        lines.append(f"| {name} | {fb.get('max_batch')} | {fb.get('first_not_fitting') or 'none tried'} | "
                     f"{_x(rel)}{goal} | {fmt_bytes(best.get('peak_mem_bytes'))} | {f'{tps:,.0f}' if tps else 'n/a'} | "
                     f"{len(fb.get('points', []))} |")
    return "\n".join(lines)


def llama7b_table(data: dict[str, Any]) -> str:
    """The 7B table: tokens/s and peak memory beside ``mpkern plan``'s planned bytes for the card."""
    rows = _rows(data)
    lines = [_header(data), "",
             "| recipe | status | tokens/s | peak memory | planned (mpkern plan) | B/param | peak / planned | "
             "plan: fits the cap | loss first -> final |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        tps, peak = _ok(r, "tokens_per_s"), _ok(r, "peak_mem_bytes")
        q = ratio(peak, r.get("planned_bytes"))
        within = "" if q is None else f" ({'within' if abs(q - 1) <= GOAL_PLAN else 'NOT within'} 10 %)"
        fits = r.get("plan_fits")
        lines.append(f"| {name} | {_status(r)} | {f'{tps:,.0f}' if tps else 'n/a'} | {fmt_bytes(peak)} | "
                     f"{fmt_bytes(r.get('planned_bytes'))} | {r.get('planned_B_per_param', 'n/a')} | "
                     f"{_x(q)}{within} | {'n/a' if fits is None else 'yes' if fits else 'no'} | {_loss(r)} |")
    notes = ["mpkern plan counts the persistent state (weights, grads, masters, moments; a release row's bucket "
             "instead of its grads); the measured peak adds the activations (checkpointed) and the step's "
             "temporaries, so peak / planned > 1 by about those."]
    for name, r in rows.items():
        if r.get("status") == "oom" and r.get("planned_bytes"):
            notes.append(f"{name} does not fit: planned {fmt_bytes(r['planned_bytes'])} against the cap "
                         f"{fmt_bytes(r.get('memory_cap_bytes'))} ({r.get('error') or r.get('oom_at')}).")
    crossing = _crossing_note(data)
    if crossing:
        notes.append(crossing)
    return "\n".join(lines + [""] + [f"* {n}" for n in notes])


def render(data: dict[str, Any]) -> str:
    """The markdown of one end-to-end stage file; ValueError for another stage's file."""
    stage = data.get("stage")
    if stage in ("e2e_gpt2", "e2e_gpt2_batch"):  # the fixed batch; the batch search (--find-batch)
        return gpt2_table(data)
    if stage == "e2e_llama7b":
        return llama7b_table(data)
    raise ValueError(f"render: expected an e2e_gpt2(_batch) or e2e_llama7b stage file, got stage {stage!r}")


def main(argv: list[str] | None = None) -> int:
    """Print the tables of the stage files named on the command line."""
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print("usage: python -m tools.gpu_check.e2e_table OUT/e2e_gpt2.json [OUT/e2e_llama7b.json ...]",
              file=sys.stderr)
        return 2
    for path in paths:
        with open(path) as f:
            print(render(json.load(f)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
