"""mpkern.matmul (its default route) against torch.matmul alone, many alternating rounds: is the op ever
slower than the platform's GEMM? (`bench matmul` times every route; here two calls per round, so the
ratio's noise on a shared machine is as small as this machine allows.)

Per GEMM of :func:`mpkern.bench.matmul.problems` (GPT-2-small and Llama-7B layers, fwd / dgrad / wgrad
in nn.Linear's layouts) and 16-bit output: the two calls alternate, the order rotated each round, and
the median and the fastest round of each are printed with their ratio (torch time / mpkern time).

    python benchmarks/matmul_vs_platform.py [--device cpu] [--dtypes bf16,fp16] [--rounds 30] [--quick]
                                            [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial

import torch

import mpkern
from mpkern.bench.matmul import DTYPES, problems
from mpkern.matmul_routes import route_for


def _times(fns: list, device: torch.device, rounds: int) -> list[list[float]]:
    out: list[list[float]] = [[] for _ in fns]
    for f in fns:
        f()
    for r in range(rounds):
        for j in range(len(fns)):
            k = (j + r) % len(fns)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fns[k]()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            out[k].append(time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="the quick problem set (fewer, smaller GEMMs)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    rows = []
    print(f"{'GEMM':<44} {'torch med':>9} {'mpkern med':>10} {'ratio':>6} {'torch min':>9} {'mpkern min':>10} "
          f"{'ratio':>6}  route")
    for dname in args.dtypes.split(","):
        dt = DTYPES[dname]
        for name, m, n, k, make in problems(dev, args.quick):
            a, b = make(dt, dev)
            fns = [partial(torch.matmul, a, b), partial(mpkern.matmul, a, b)]
            t_torch, t_ours = _times(fns, dev, args.rounds)
            route = route_for(a, b, None, dt)
            med = (statistics.median(t_torch), statistics.median(t_ours))
            best = (min(t_torch), min(t_ours))
            rows.append({"gemm": f"{name} {dname}", "m": m, "n": n, "k": k, "route": route,
                         "torch_ms_median": med[0] * 1e3, "mpkern_ms_median": med[1] * 1e3,
                         "torch_ms_min": best[0] * 1e3, "mpkern_ms_min": best[1] * 1e3,
                         "ratio_median": med[0] / med[1], "ratio_min": best[0] / best[1]})
            print(f"{name + ' ' + dname:<44} {med[0] * 1e3:9.3f} {med[1] * 1e3:10.3f} {med[0] / med[1]:6.3f} "
                  f"{best[0] * 1e3:9.3f} {best[1] * 1e3:10.3f} {best[0] / best[1]:6.3f}  {route}", flush=True)
    for key in ("ratio_median", "ratio_min"):
        vals = [r[key] for r in rows]
        print(f"{key}: min {min(vals):.3f}, median {statistics.median(vals):.3f}, max {max(vals):.3f} "
              f"over {len(vals)} GEMMs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(dev), "torch": torch.__version__, "threads": torch.get_num_threads(),
                       "rounds": args.rounds, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
