"""``mpkern doctor``: diagnose the built-in models in fp16 and bf16 and print what breaks and the fix."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

import torch

from .. import nn as mpnn
from . import models
from .case import CaseBuilder
from .run import diagnose

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def run(model_names: list[str], dtypes: list[str], *, device: str = "cpu", recipe: str = "autocast",
        full: bool = False, loss_scale: float | None = None, out: str | None = None, as_json: bool = False,
        plot: bool = True, seed: int = 0, keep_fp32: list[str] | None = None,
        builders: Mapping[str, CaseBuilder] | None = None) -> list[dict[str, Any]]:
    """Diagnose each model in each dtype; print the tables (or JSON); write ``doctor.json`` and one
    PNG per diagnosis into ``out``. ``keep_fp32``: module names made fp32 islands first
    (:func:`mpkern.nn.keep_fp32`), to check a fix. ``builders``: the models named in ``model_names``
    that :func:`.models.build` does not know, each built from ``(device, seed)`` (the CLI gives
    ``compare``: :func:`mpkern.compare.diagnosis.compare_case`). Returns
    ``[{"model", "describe", "dtype", "diagnosis"}, ...]``."""
    builders = builders or {}
    results = []
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if as_json else (lambda *a: print(*a, flush=True))
    if out:
        os.makedirs(out, exist_ok=True)
    total = len(model_names) * len(dtypes)
    i = 0
    for name in model_names:
        try:
            case = (builders[name](device, seed) if name in builders
                    else models.build(name, device, full=full, seed=seed))
        except ValueError as e:  # transformers missing (the CLI has checked the names)
            say(f"[doctor] skipping {name}: {e}")
            continue
        if keep_fp32:
            mpnn.keep_fp32(case.model, names=keep_fp32)
        for dt in dtypes:
            i += 1
            t0 = time.perf_counter()
            say(f"[doctor {i}/{total}] {case.describe} -- {dt} ({recipe}) ...")
            d = diagnose(case.model, case.inputs, dtype=DTYPES[dt], loss_fn=case.loss_fn,
                         loss_scale=loss_scale if loss_scale is not None else case.loss_scale, recipe=recipe)
            say(f"[doctor {i}/{total}] done in {time.perf_counter() - t0:.1f} s: {len(d.findings)} finding(s)")
            entry = {"model": name, "describe": case.describe, "dtype": dt, "diagnosis": d.to_dict()}
            if out and plot:
                try:
                    import matplotlib.pyplot as plt

                    path = os.path.join(out, f"doctor_{name}_{dt}.png")
                    plt.close(d.plot(path))
                    entry["plot"] = path
                except ImportError:
                    pass
            results.append(entry)
            if not as_json:
                print()
                print(f"== {case.describe}: {dt} ==")
                print(d)
                print()
    if as_json:
        print(json.dumps(results, indent=1))
    if out:
        with open(os.path.join(out, "doctor.json"), "w") as f:
            json.dump(results, f, indent=1)
        if not as_json:
            print(f"wrote {out}/doctor.json" + (" and a plot per diagnosis" if plot else ""))
    return results
