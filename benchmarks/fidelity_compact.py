"""Fidelity of FusedAdamWMP's storage modes against fp32 AdamW, same data, same seed, same steps.

Two runs of the ``mpkern compare`` task (the synthetic "red?/blue?" attention classifier):

* **pretrain**: from scratch at lr 1e-4 -- where bf16 without master weights fails (Adam's updates
  of ~lr are below half a bf16 ulp of most weights);
* **finetune**: from a checkpoint that fp32 AdamW trained to ~60 % accuracy, at lr 3e-5.

Every run prints its final training loss (mean of the last 10 % of steps), its ratio to fp32
AdamW's, and validation accuracy, with the storage bytes per parameter of its optimizer state.
With ``--release`` every mpkern mode runs a second time with gradient release
(``release_grads=True``, ``opt.backward(loss)``: the step inside backward, two passes for the clip);
it is bit-identical to the regular step, so its row must equal the regular one -- the table says
whether the final params are the same bits (a check of the harness as much as of release).
This is a benchmark (it trains models), not a test: run it by hand and record the numbers in
``benchmarks/RESULTS.md``.

    python benchmarks/fidelity_compact.py [--steps 1000] [--finetune-steps 600] [--json out.json] [--only 4-bit,8-bit]
                                          [--release]
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time

import torch
import torch.nn.functional as F

import mpkern
from mpkern import compare
from mpkern.optim import storage

MODES = {
    # name: (param dtype, optimizer factory(params, lr, wd), state bytes/param or None for torch's)
    "fp32 AdamW": (torch.float32, lambda ps, lr, wd: torch.optim.AdamW(ps, lr=lr, weight_decay=wd), 8.0),
    "bf16 AdamW, no masters": (torch.bfloat16, lambda ps, lr, wd: torch.optim.AdamW(ps, lr=lr, weight_decay=wd), 4.0),
    "mpkern fp32 master + fp32 moments": (torch.bfloat16, dict(master_weights=True), None),
    "mpkern remainder + bf16 moments": (torch.bfloat16, dict(master_weights="remainder", state_dtype="bfloat16"),
                                        None),
    "mpkern 8-bit master + bf16 moments": (torch.bfloat16, dict(master_weights="8bit", state_dtype="bfloat16"),
                                           None),
    "mpkern remainder + 8-bit moments": (torch.bfloat16, dict(master_weights="remainder", state_dtype="8bit"), None),
    "mpkern 8-bit master + 8-bit moments": (torch.bfloat16, dict(master_weights="8bit", state_dtype="8bit"), None),
    "mpkern remainder + 4-bit m + 8-bit v moments": (torch.bfloat16, dict(master_weights="remainder",
                                                                          state_dtype="4bit_m"), None),
    "mpkern 8-bit master + 4-bit m + 8-bit v moments": (torch.bfloat16, dict(master_weights="8bit",
                                                                             state_dtype="4bit_m"), None),
    "mpkern no master + SR params + bf16 moments": (
        torch.bfloat16, dict(master_weights=False, stochastic_rounding=True, state_dtype="bfloat16"), None),
}


def train(name: str, base: torch.nn.Module, task: compare.Task, cfg: compare.Config, lr: float, steps: int,
          offset: int, release: bool = False) -> dict:
    dtype, make, nbytes = MODES[name]
    model = copy.deepcopy(base).to(dtype)
    params = list(model.parameters())
    if isinstance(make, dict):
        opt = mpkern.FusedAdamWMP(params, lr=lr, weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm,
                                  release_grads=release, **make)
        nbytes = storage.state_bytes_per_param(make.get("master_weights", True), make.get("state_dtype", "float32"),
                                               dtype)
        clip = None
    else:
        opt = make(params, lr, cfg.weight_decay)
        clip = cfg.max_grad_norm
    losses = []
    t0 = time.perf_counter()
    for i in range(steps):
        j = (offset + i) % (task.x_train.shape[0] // cfg.batch_size)
        x = task.x_train[j * cfg.batch_size:(j + 1) * cfg.batch_size]
        y = task.y_train[j * cfg.batch_size:(j + 1) * cfg.batch_size]
        loss = F.cross_entropy(model(x).float(), y)
        if release:  # backward + clip + step, the grads freed bucket by bucket
            opt.backward(loss)
            losses.append(float(loss.detach()))
            continue
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    with torch.no_grad():
        acc = float((model(task.x_val).argmax(-1) == task.y_val).float().mean())
    tail = max(1, steps // 10)
    return {"loss": sum(losses[-tail:]) / tail, "val_acc": acc, "state_B_per_param": nbytes,
            "seconds": time.perf_counter() - t0, "model": model}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--finetune-steps", type=int, default=600)
    ap.add_argument("--json", default=None)
    ap.add_argument("--release", action="store_true",
                    help="run every mpkern mode a second time with release_grads=True (must equal the regular run)")
    ap.add_argument("--only", default="", metavar="SUBSTRING,...",
                    help="run only the modes whose name contains one of these (fp32 AdamW, the reference, always runs)")
    args = ap.parse_args()
    wanted = [w for w in args.only.split(",") if w]
    names = [n for n in MODES if n == "fp32 AdamW" or not wanted or any(w in n for w in wanted)]
    cfg = compare.Config(steps=max(args.steps, args.finetune_steps) + 400)
    task = compare.make_task(cfg)
    torch.manual_seed(cfg.seed)
    base = compare.Classifier(task.vocab, cfg.seq_len, cfg.d_model, cfg.layers, cfg.heads, task.classes)
    print(f"# fidelity of FusedAdamWMP storage modes vs fp32 AdamW -- {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, mpkern {mpkern.__version__}")
    out = {}
    # a fine-tuning start: fp32 AdamW trained part of the way (same for every mode)
    start = train("fp32 AdamW", base, task, cfg, 1e-4, 400, 0)["model"]
    for phase, (b, lr, steps, offset) in {"pretrain": (base, 1e-4, args.steps, 0),
                                          "finetune": (start, 3e-5, args.finetune_steps, 400)}.items():
        print(f"\n## {phase}: lr {lr}, {steps} steps, batch {cfg.batch_size}\n")
        print("| run | state B/param | final loss | vs fp32 | val acc | params = regular run's |")
        print("|---|---|---|---|---|---|")
        rows = {}
        for name in names:
            runs = [(name, False)] + ([(f"{name} + release", True)] if args.release and isinstance(MODES[name][1], dict)
                                      else [])
            for label, release in runs:
                r = train(name, b, task, cfg, lr, steps, offset, release)
                model = r.pop("model")
                if not release:
                    regular = model
                else:
                    r["bitwise_equal_to_regular"] = all(torch.equal(p, q) for p, q in
                                                        zip(model.parameters(), regular.parameters()))
                rows[label] = r
                ref = rows["fp32 AdamW"]["loss"]
                same = {True: "yes", False: "**no**"}.get(r.get("bitwise_equal_to_regular"), "")
                print(f"| {label} | {r['state_B_per_param']:g} | {r['loss']:.4f} | {r['loss'] / ref:.3f}x | "
                      f"{100 * r['val_acc']:.1f} % | {same} |", flush=True)
        out[phase] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
