"""Which mpkern modules one ``FusedAdamWMP.step()`` runs code in (``sys.setprofile``), not a test.

The seam issue's measure: a first step (state created, the step cache built) and a cached step of
one traced configuration -- bf16 params, 8-bit master + 8-bit moments, ``max_grad_norm=1.0``, CPU --
listed module by module (a subpackage of ``mpkern.optim``, e.g. ``optim.storage``, counts once),
with the number of calls of ``mpkern._backend.select``. The counting is
:func:`mpkern.optim.trace.modules_run`, which ``tests/test_step_cache_dispatch.py`` asserts on.

    python benchmarks/seam_trace.py [--state-dtype 8bit] [--master-weights 8bit] [--no-clip]
"""

from __future__ import annotations

import argparse

import torch

import mpkern
from mpkern.optim.trace import modules_run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--state-dtype", default="8bit")
    ap.add_argument("--master-weights", default="8bit")
    ap.add_argument("--no-clip", action="store_true")
    a = ap.parse_args()
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 64).to(torch.bfloat16)) for _ in range(4)]
    master: bool | str = True if a.master_weights == "True" else a.master_weights
    opt = mpkern.FusedAdamWMP(params, lr=1e-3, master_weights=master, state_dtype=a.state_dtype,
                              max_grad_norm=None if a.no_clip else 1.0)
    for p in params:
        p.grad = torch.randn_like(p)
    for label in ("first step", "cached step", "cached step"):
        run = modules_run(opt.step)
        selects = run.calls.get("mpkern._backend.select", 0)
        print(f"{label}: {len(run.modules)} mpkern modules, _backend.select x{selects}")
        for mod, n in sorted(run.modules.items(), key=lambda kv: -kv[1]):
            print(f"    {mod:40s} {n:6d} calls")


if __name__ == "__main__":
    main()
