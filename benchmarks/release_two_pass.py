"""The two-pass release step against the clipped regular step with one extra backward inside it (its
grads freed before the second backward, as release's pass 1 frees them) on ``mpkern bench release``'s
full-size model, alternating, median of 8. (The bench's (f) - (e) estimate times the extra backward
in steps without an optimizer step, where the caches are kinder than inside a training step.)

    OMP_NUM_THREADS=1 python benchmarks/release_two_pass.py
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import mpkern
from mpkern.bench.release import RELEASE_SIZES, release_problem


def main() -> None:
    base, x, y = release_problem(RELEASE_SIZES["full"], torch.device("cpu"), "aten")

    def make(release: bool) -> tuple[torch.nn.Module, mpkern.FusedAdamWMP]:
        model = copy.deepcopy(base)
        return model, mpkern.FusedAdamWMP(model.parameters(), lr=1e-4, max_grad_norm=1.0, release_grads=release,
                                          release_bucket_bytes=8 << 20 if release else None)

    mc, oc = make(False)
    md, od = make(True)
    mr, orr = make(False)

    def regular() -> None:  # (c)
        F.cross_entropy(mc(x).float(), y).backward()
        oc.step()
        oc.zero_grad()

    def release() -> None:  # (d)
        od.backward(F.cross_entropy(md(x).float(), y))

    def twice() -> None:  # (r): (c) with one more backward first, its grads freed as release's pass 1 frees them
        loss = F.cross_entropy(mr(x).float(), y)
        loss.backward(retain_graph=True)
        mr.zero_grad()
        loss.backward()
        orr.step()
        orr.zero_grad()

    fns: dict[str, Callable[[], None]] = {"c": regular, "d": release, "r": twice}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for rnd in range(9):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if rnd:  # the first round warms up
                times[k].append((time.perf_counter() - t0) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, median of 8 alternating rounds")
    print(f"(c) regular clipped {med['c']:.1f} ms, (d) release two passes {med['d']:.1f} ms, (r) (c) + one extra "
          f"backward with fresh grads {med['r']:.1f} ms: d/r {med['d'] / med['r']:.3f}, d/c {med['d'] / med['c']:.3f}")


if __name__ == "__main__":
    main()
