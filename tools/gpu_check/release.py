"""The gradient-release stage of ``scripts/gpu_check.sh``: whole training steps, regular beside release.

``python -m tools.gpu_check.release --out DIR`` -> ``DIR/release.json``. One bf16 model (a stack of
``Linear(width, width)`` + GELU, ``FusedAdamWMP`` with fp32 masters and moments) steps on ``tokens``
rows per step in each variant, all in one process:

* ``regular``: ``loss.backward(); opt.step(); opt.zero_grad()``;
* ``release one pass``: ``opt.backward(loss)`` (``release_grads=True``, no clip);
* ``regular + clip`` / ``release two passes + clip``: the same with ``max_grad_norm``;
* ``forward + two backwards``: ``loss.backward(retain_graph=True); loss.backward()`` and the regular
  clipped step -- what "the two-pass mode costs one extra backward" is measured against.

Per row: the median wall time of a synchronised step (``step_ms``, the forward included in every
variant alike), the peak allocated memory over the timed steps (``peak_GB``), and -- for the release
variants -- whether three steps from the same weights and batches equal the matching regular run
bit for bit (``bitwise``). Raw numbers only; :func:`.tables.release_rows` makes the ratios. The model is
this stage's own (``mpkern bench release`` times mpkern compare's classifier instead); the step is
:func:`mpkern.bench.common.backward_step`, the one both benchmarks take.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from .gpu import log, resolve
from .harness import StageFile, run_stage, short_error

__all__ = ["REFERENCE", "SIZE", "VARIANTS", "main", "stage_release"]

REFERENCE = "forward + two backwards"
#: (label, max_grad_norm, release_grads, the rows its time is compared with -- in the row as ``vs``)
VARIANTS = (("regular", None, False, ()), ("release one pass", None, True, ("regular",)),
            ("regular + clip", 1.0, False, ()), ("release two passes + clip", 1.0, True, ("regular + clip", REFERENCE)))
#: the default problem: 24 x Linear(2048, 2048) (100M bf16 params), 4096 rows per step
SIZE = {"layers": 24, "width": 2048, "tokens": 4096}


def _model(layers: int, width: int, dev: Any) -> Any:
    import torch

    torch.manual_seed(0)
    mods: list[Any] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*mods).to(device=dev, dtype=torch.bfloat16)


def _stepper(model: Any, clip: float | None, release: bool) -> tuple[Any, Callable[[Any], None]]:
    """(optimizer, step(x)) of one variant."""
    import mpkern
    from mpkern.bench.common import backward_step

    opt = mpkern.FusedAdamWMP(model.parameters(), lr=1e-4, max_grad_norm=clip, release_grads=release)

    def step(x: Any) -> None:
        backward_step(opt, model(x).float().square().mean())

    return opt, step


def _timed(step: Callable[[Any], None], xs: list[Any], dev: Any, warmup: int) -> tuple[list[float], float]:
    """(wall ms of each synchronised step after ``warmup`` ones, peak allocated GB over the timed steps)."""
    import torch

    from mpkern.measure import sync

    for x in xs[:warmup]:
        step(x)
    sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for x in xs[warmup:]:
        t0 = time.perf_counter()
        step(x)
        sync(dev)
        times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated(dev) / 1e9 if dev.type == "cuda" else float("nan")
    return times, peak


def _bitwise(layers: int, width: int, clip: float | None, xs: list[Any], dev: Any) -> bool:
    """Whether three release steps equal three regular steps bit for bit (params and masters)."""
    import torch

    runs = []
    for release in (False, True):
        model = _model(layers, width, dev)
        opt, step = _stepper(model, clip, release)
        for x in xs[:3]:
            step(x)
        runs.append((list(model.parameters()), [opt.state[p]["master_param"] for p in model.parameters()]))
    (pa, ma), (pb, mb) = runs
    return all(torch.equal(a, b) for a, b in zip(pa + ma, pb + mb))


def stage_release(out: str, *, layers: int | None = None, width: int | None = None, tokens: int | None = None,
                  iters: int = 10, warmup: int = 3, device: Any = None) -> int:
    """Time every variant (see the module docs) -> ``release.json``. ``device``: the current GPU unless
    given (a CPU test drives the plumbing on the CPU with a tiny model)."""
    import torch

    from mpkern.optim.release import DEFAULT_BUCKET_BYTES

    layers, width, tokens = layers or SIZE["layers"], width or SIZE["width"], tokens or SIZE["tokens"]
    sf = StageFile(os.path.join(out, "release.json"), "release", kernel="release")
    dev = resolve(device)
    sf.set(meta={"layers": layers, "width": width, "tokens": tokens, "params": layers * (width * width + width),
                 "iters": iters, "warmup": warmup, "device": str(dev), "torch": torch.__version__,
                 "bucket_bytes": DEFAULT_BUCKET_BYTES},
           planned=[v[0] for v in VARIANTS] + [REFERENCE])
    gen = torch.Generator(device=dev).manual_seed(1)
    xs = [torch.randn(tokens, width, device=dev, generator=gen).to(torch.bfloat16) for _ in range(iters + warmup)]
    for label, clip, release, vs in VARIANTS:
        try:
            model = _model(layers, width, dev)
            _, step = _stepper(model, clip, release)
            times, peak = _timed(step, xs, dev, warmup)
            del model, step
            row = {"variant": label, "clip": clip, "release": release, "step_ms": statistics.median(times),
                   "all_ms": times, "peak_GB": peak, "vs": list(vs)}
            if release:
                row["bitwise"] = _bitwise(layers, width, clip, xs, dev)
            sf.add_row(row)
            log(f"release {label}: {row['step_ms']:.2f} ms, peak {peak:.2f} GB")
        except Exception as e:  # noqa: BLE001 -- the row says why; the next variant still runs
            traceback.print_exc()
            sf.add_row({"variant": label, "clip": clip, "release": release, "error": short_error(e)})
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    try:
        model = _model(layers, width, dev)
        opt, _ = _stepper(model, 1.0, False)

        def twice(x: Any) -> None:
            loss = model(x).float().square().mean()
            loss.backward(retain_graph=True)
            loss.backward()
            opt.step()
            opt.zero_grad()

        times, peak = _timed(twice, xs, dev, warmup)
        sf.add_row({"variant": REFERENCE, "clip": 1.0, "release": False, "step_ms": statistics.median(times),
                    "all_ms": times, "peak_GB": peak})
    except Exception as e:  # noqa: BLE001 -- the row says why; the stage's other rows still run
        traceback.print_exc()
        sf.add_row({"variant": REFERENCE, "error": short_error(e)})
    sf.finish()
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring). Exit status: 0 done, 1 failed, 3 no GPU, 130
    interrupted (:func:`.harness.run_stage`: ``release.json`` then says how it ended)."""
    ap = argparse.ArgumentParser(prog="python -m tools.gpu_check.release", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder (release.json is written there)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=None)
    args = ap.parse_args(argv)
    return run_stage(args.out, ["release.json"],
                     lambda: stage_release(args.out, layers=args.layers, width=args.width, tokens=args.tokens))


if __name__ == "__main__":
    sys.exit(main())
