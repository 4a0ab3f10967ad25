"""The GPU check's end-to-end stages (issue 42 point 3: the lessons' challenge on GPT-2, the seeds' 7B
sentence on a Llama-7B shape) run here at ``--size tiny`` on the CPU through their real command line
-- the same driver, workers and tables a GPU run uses. The stages run once per module, side by side:

* ``gpt2`` with ``--find-batch`` under a 6 MiB cap;
* ``llama7b`` under a 2 MiB cap, below what the fp32-state recipes need (16 B/param: 4 weights + 4
  grads + 8 moments for AMP; 2 + 2 + 4 + 8 for mpkern's fp32 master), so they must be ``oom`` rows
  while the compact release recipe trains (two of its five recipes: a worker's imports cost ~6-9 s
  of this 2-core machine; the other three run in-process through the worker's own function);
* one recipe with far more steps than its ``--limit`` allows: the driver stops it (a ``timeout`` row,
  its stacks in the log) and still ends the stage with status 0.

What only a GPU run shows (CUDA peaks, the cap enforced by the allocator, the 7B rows) is not here.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
E2E = [sys.executable, "-m", "tools.gpu_check.e2e"]
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH")))))
GPT2_CAP = 6 * 2**20
LLAMA_CAP = 2 * 2**20
STEPS, WARMUP = 4, 2
TIMEOUT_LIMIT = 11  # the driver keeps 5.5 s of it to stop the worker, whose minimum is 5 s (tiny)
#: the llama7b recipes the command-line run takes (the others: test_llama7b_the_other_recipes_in_process)
LLAMA_CLI = ("amp", "mpkern-8bit-4bitm-release")


def _needs_transformers() -> None:
    """The recipes' workers build their models with transformers (GPT-2, Llama): an optional package."""
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("the end-to-end recipes build transformers models: needs transformers (the hf extra)")


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([*E2E, *args], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _quick(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*E2E, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The three stage runs, started together; ``{name: (exit status, output, stage JSON, seconds)}``."""
    _needs_transformers()
    base = tmp_path_factory.mktemp("e2e")
    common = ("--device", "cpu", "--size", "tiny", "--steps", str(STEPS), "--warmup", str(WARMUP))
    procs = {
        "gpt2": _start("gpt2", *common, "--find-batch", "--memory-cap", str(GPT2_CAP), "--out", str(base / "g")),
        "llama7b": _start("llama7b", *common, "--memory-cap", str(LLAMA_CAP), "--recipes", ",".join(LLAMA_CLI),
                          "--out", str(base / "l")),
        "timeout": _start("llama7b", "--device", "cpu", "--size", "tiny", "--steps", "1000000", "--recipes",
                          "mpkern-8bit-8bit", "--limit", str(TIMEOUT_LIMIT), "--out", str(base / "t")),
    }
    t0 = time.perf_counter()
    out = {}
    for name, p in procs.items():
        text, _ = p.communicate(timeout=240)
        stage = "gpt2_batch" if name == "gpt2" else "llama7b"  # the gpt2 run searches batches: its own file
        sub = {"gpt2": "g", "llama7b": "l", "timeout": "t"}[name]
        with open(base / sub / f"e2e_{stage}.json") as f:
            out[name] = (p.returncode, text, json.load(f), time.perf_counter() - t0, base / sub)
    return out


def _rows(data: dict) -> dict[str, dict]:
    return {r["recipe"]: r for r in data["rows"]}


# ---- the command line -------------------------------------------------------------------------
def test_help_of_both_stages_names_the_options():
    for stage in ("gpt2", "llama7b"):
        p = _quick(stage, "--help")
        assert p.returncode == 0, p.stderr
        for opt in ("--device", "--size", "--steps", "--out", "--limit", "--memory-cap", "--find-batch", "--recipes"):
            assert opt in p.stdout, (stage, opt)


def test_the_driver_and_the_tables_import_no_torch():
    # the summary (standard library only) imports the tables; the driver runs where torch may not import
    code = ("import sys, tools.gpu_check.e2e, tools.gpu_check.e2e_table; "
            "assert 'torch' not in sys.modules and 'mpkern' not in sys.modules, sorted(sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60,
                       check=False)
    assert p.returncode == 0, p.stderr


def test_bad_arguments_are_refused_by_name(tmp_path):
    p = _quick("gpt2", "--device", "cpu", "--recipes", "fp32,nope", "--out", str(tmp_path))
    assert p.returncode == 2 and "--recipes" in p.stderr
    p = _quick("gpt2", "--device", "cpu", "--find-batch", "--out", str(tmp_path))
    assert p.returncode == 2 and "--memory-cap" in p.stderr
    p = _quick("llama7b", "--device", "cpu", "--memory-cap", "12 parsecs", "--out", str(tmp_path))
    assert p.returncode == 2 and "--memory-cap" in p.stderr
    p = _quick("llama7b", "--device", "cpu", "--warmup", "1", "--out", str(tmp_path))
    assert p.returncode == 2 and "--warmup" in p.stderr


def test_the_driver_lists_the_recipes_the_workers_build():
    from tools.gpu_check import e2e, e2e_recipes

    assert {s: tuple(x.name for x in e2e_recipes.RECIPES[s]) for s in e2e_recipes.STAGES} == e2e.RECIPES


def test_a_limit_too_short_for_any_worker_skips_every_recipe_and_exits_0(tmp_path):
    p = _quick("llama7b", "--device", "cpu", "--size", "tiny", "--limit", "1", "--out", str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    data = json.loads((tmp_path / "e2e_llama7b.json").read_text())
    assert data["status"] == "done"
    assert [r["status"] for r in data["rows"]] == ["skipped"] * 5
    assert not list((tmp_path / "e2e_work").glob("*.log"))  # no worker was started


# ---- the stages' rows -------------------------------------------------------------------------
def test_gpt2_every_recipe_trains_and_reports_speed_memory_and_loss(runs):
    rc, text, data, _, _ = runs["gpt2"]
    assert rc == 0, text
    assert data["status"] == "done"
    rows = _rows(data)
    assert list(rows) == ["fp32", "amp-bf16", "fp16-scaler", "mpkern-fp32-master", "mpkern-8bit-4bitm-release"]
    for name, r in rows.items():
        assert r["status"] == "ok", (name, r.get("error"), r.get("log_tail"))
        assert r["tokens_per_s"] > 0 and r["timed_steps"] == STEPS and r["batch"] == 2 and r["seq"] == 32
        assert len(r["losses"]) == STEPS + WARMUP and all(math.isfinite(v) for v in r["losses"])
        # the tracked peak holds the persistent state counted from the tensors, plus a step's grads
        assert r["peak_mem_bytes"] >= r["state_bytes"] + r["grad_bytes"] or name.endswith("-release")
        assert r["peak_mem_bytes"] > r["state_bytes"] > 0
        assert r["activation_bytes"] > 0 and r["params"] > 0 and r["planned_bytes"] > 0


def test_gpt2_mpkern_fp32_master_loss_follows_the_amp_and_fp32_recipes(runs):
    rows = _rows(runs["gpt2"][2])
    amp, fp32, mp = rows["amp-bf16"], rows["fp32"], rows["mpkern-fp32-master"]
    # Same initial weights, batch, lr, clip, and fp32 AdamW math on fp32 masters; the runs differ only
    # in bf16 rounding of the compute (AMP rounds the fp32 weights to bf16 at each use; mpkern keeps the
    # params in bf16 and also computes layer norm / softmax there): relative errors of a few bf16 units
    # (2^-8 = 0.4 %) per op, measured here at ~0.05 % of the loss. 1 % of the loss is ~20x that and
    # still well below what the recipes learn in these steps (asserted), so a recipe that did not
    # learn, or learned at a different rate, fails.
    tol = 0.01 * amp["loss_final"]
    assert amp["loss_first"] - amp["loss_final"] > 5 * tol
    assert abs(mp["loss_final"] - amp["loss_final"]) <= tol
    assert abs(mp["loss_final"] - fp32["loss_final"]) <= tol
    assert abs(mp["loss_first"] - fp32["loss_first"]) <= 0.01 * fp32["loss_first"]  # same start, bf16-rounded


def test_gpt2_find_batch_brackets_the_cap(runs):
    for name, r in _rows(runs["gpt2"][2]).items():
        fb = r["find_batch"]
        assert fb["cap_bytes"] == GPT2_CAP and fb["start"] == 2
        pts = {p["batch"]: p for p in fb["points"]}
        lo, hi = fb["max_batch"], fb["first_not_fitting"]
        assert lo >= 2 and hi is not None and lo < hi <= 2 * lo, name
        assert pts[lo]["status"] == "ok" and pts[lo]["peak_mem_bytes"] <= GPT2_CAP
        assert pts[hi]["status"] == "over_cap" and pts[hi]["peak_mem_bytes"] > GPT2_CAP
        peaks = [pts[b]["peak_mem_bytes"] for b in sorted(pts)]
        assert peaks == sorted(peaks), (name, peaks)  # a larger batch never needs less


def test_llama7b_a_small_cap_makes_oom_rows_with_their_planned_bytes_and_the_stage_exits_0(runs):
    rc, text, data, _, _ = runs["llama7b"]
    assert rc == 0, text
    assert data["status"] == "done"
    rows = _rows(data)
    assert tuple(rows) == LLAMA_CLI
    r = rows["amp"]
    assert r["status"] == "oom", r
    assert r["planned_bytes"] == 16 * r["params"] > LLAMA_CAP  # 16 B/param, independent of the plan's measurement
    assert r["peak_mem_bytes"] > LLAMA_CAP and r["memory_cap_bytes"] == LLAMA_CAP and r["plan_fits"] is False
    assert r["tokens_per_s"] is None
    r = rows["mpkern-8bit-4bitm-release"]
    assert r["status"] == "ok", (r.get("error"), r.get("log_tail"))
    assert r["tokens_per_s"] > 0 and math.isfinite(r["loss_final"]) and r["loss_final"] < r["loss_first"]
    assert 0 < r["peak_mem_bytes"] <= LLAMA_CAP and r["planned_bytes"] < r["peak_mem_bytes"]
    assert r["peak_over_planned"] == pytest.approx(r["peak_mem_bytes"] / r["planned_bytes"])
    assert r["plan_fits"] is True


@pytest.mark.parametrize("recipe", ["bf16-adamw", "mpkern-fp32-master", "mpkern-8bit-8bit"])
def test_llama7b_the_other_recipes_in_process(tmp_path, recipe):
    _needs_transformers()
    import torch

    from tools.gpu_check import e2e_recipes, e2e_worker
    from tools.gpu_check.harness import StageFile

    sh = e2e_recipes.shape("llama7b", "tiny")
    row: dict = {"recipe": recipe}
    sf = StageFile(str(tmp_path / "w.json"), "w")
    sf.add_row(row)
    e2e_worker.measure(row, sf, "llama7b", recipe, sh, torch.device("cpu"), 1, STEPS, WARMUP, LLAMA_CAP, "torch")
    written = json.loads((tmp_path / "w.json").read_text())["rows"][0]
    if recipe == "mpkern-fp32-master":  # 2 + 2 + 4 + 8 B/param: over the cap at its first tracked step
        assert row["status"] == "oom" and row["oom_at"].startswith("step 1") and row["peak_mem_bytes"] > LLAMA_CAP
        assert row["peak_mem_bytes"] >= 16 * e2e_recipes.param_count("llama7b", sh)
        return
    assert row["status"] == "ok" and row["tokens_per_s"] > 0 and row["loss_final"] < row["loss_first"]
    assert 0 < row["peak_mem_bytes"] <= LLAMA_CAP
    assert written["phase"] == "timed"  # written as it went


def test_a_worker_past_its_limit_is_stopped_with_its_stacks_and_the_stage_exits_0(runs):
    rc, text, data, _, out = runs["timeout"]
    assert rc == 0, text
    (r,) = data["rows"]
    assert r["status"] == "timeout" and "--limit" in r["error"] and r["log_tail"]
    assert "Stack (most recent call first)" in (out / r["worker"]["log"]).read_text()  # dumped before the stop
    assert r["worker"]["wall_s"] <= TIMEOUT_LIMIT + 1  # the stage keeps to its limit (its stop included)


# ---- the tables -------------------------------------------------------------------------------
def _cell(table: str, recipe: str, col: int) -> str:
    line = next(ln for ln in table.splitlines() if ln.startswith(f"| {recipe} |"))
    return [c.strip() for c in line.strip("|").split("|")][col]


def test_the_tables_render_the_rows_and_their_ratios(runs):
    from tools.gpu_check import e2e_table

    g, ll = runs["gpt2"][2], runs["llama7b"][2]
    gt, lt = e2e_table.render(g), e2e_table.render(ll)
    rows = _rows(g)
    for name in rows:
        assert f"| {name} | ok |" in gt
    mp, amp, fp32 = rows["mpkern-fp32-master"], rows["amp-bf16"], rows["fp32"]
    assert _cell(gt, "mpkern-fp32-master", 3) == f"{mp['tokens_per_s'] / fp32['tokens_per_s']:.2f}x"
    assert _cell(gt, "mpkern-fp32-master", 4) == f"{mp['tokens_per_s'] / amp['tokens_per_s']:.2f}x"
    assert _cell(gt, "mpkern-8bit-4bitm-release", 7) == (
        f"{rows['mpkern-8bit-4bitm-release']['peak_mem_bytes'] / amp['peak_mem_bytes']:.2f}x")
    assert "Largest batch under 6.00 MiB" in gt and "pays below batch" in gt
    _, batches = gt.split("Largest batch under")
    fb, amp_fb = rows["mpkern-fp32-master"]["find_batch"], amp["find_batch"]
    assert _cell(batches, "mpkern-fp32-master", 1) == str(fb["max_batch"])
    assert _cell(batches, "mpkern-fp32-master", 3).startswith(f"{fb['max_batch'] / amp_fb['max_batch']:.2f}x")
    assert re.search(r"\| amp \| oom \(step 1[^|]*\) \|", lt)
    lrows = _rows(ll)
    assert e2e_table.fmt_bytes(lrows["amp"]["planned_bytes"]) in _cell(lt, "amp", 4)
    q = lrows["mpkern-8bit-4bitm-release"]["peak_over_planned"]
    assert _cell(lt, "mpkern-8bit-4bitm-release", 6).startswith(f"{q:.2f}x")
    assert "amp does not fit: planned" in lt
    with pytest.raises(ValueError, match="stage"):
        e2e_table.render({"stage": "unscale", "rows": []})


def test_the_gpu_checks_summary_shows_the_stage_files_and_the_oom_rows_are_no_failure(runs):
    """The summary (tools.gpu_check.summary) over the stage folders these runs left: the end-to-end
    section holds each stage's table; an OOM row is a result, not something that failed."""
    from tools.gpu_check import summary

    for name, file in (("gpt2", "e2e_gpt2_batch.json"), ("llama7b", "e2e_llama7b.json")):
        out = runs[name][4]
        text = summary.summarize(str(out))
        section = text.split(f"--- end to end, {file}: done, ")[1]
        rows = _rows(runs[name][2])
        assert section.startswith(f"{len(rows)} rows ---"), section[:200]
        for recipe in rows:
            assert f"| {recipe} |" in section
        top = text.split("--- what failed and where to look")[1].split("\n\n")[0]
        assert "e2e_" not in top, top  # no stage file failed, no row with an error (oom rows are results)
