"""Running the benchmarks: :func:`run` (what ``mpkern bench`` calls) and the AdamW benchmark's
options on its command line."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ..measure import machine_info, measure_bandwidth
from .adamw import bench_adamw
from .common import FULL, KERNELS, QUICK
from .host import bench_host_time
from .matmul import bench_linear_e2e, bench_matmul
from .modes import adamw_modes, bench_adamw_modes
from .release import bench_release
from .torchao_peers import bench_torchao, torchao_optim
from .unscale import bench_unscale


def run(which: str = "all", *, device: str | torch.device | None = None, quick: bool = False,
        params: int | None = None, tensors: int | None = None, reps: int | None = None,
        modes: str = "default", torchao: bool = True, torchao_params: int | None = None,
        host: bool = True, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run benchmark ``which`` (``unscale``, ``adamw``, ``matmul``, ``release`` or ``all``); return
    ``{"meta", "rows"}``.

    Sizes (``params``/``tensors``/``reps`` override those of the optimizer-side benchmarks): full
    32M params in 200 tensors, 15 repetitions (``FULL``); ``quick`` 16M params in 100 tensors, 7
    repetitions (``QUICK``; the AdamW benchmark runs 5 fewer, at least 3, in both). The bandwidth
    probe is 256 MiB in both. matmul: the GPT-2-small and Llama-7B layer GEMMs (forward, input and
    weight gradient; :func:`mpkern.bench.matmul.problems`) with 256 tokens (quick, CPU; the large
    ones left out) or 1024 (CPU), 2048 or 8192 (CUDA, which adds the square and LLM shapes of the
    first GPU run), every route beside ``torch.matmul``; the full run adds :func:`bench_linear_e2e`
    (GPT-2 small forward + backward with torch's and mpkern's Linear).

    ``adamw`` also runs, on the same sizes and against the same AMP-recipe baseline:
    :func:`bench_adamw_modes` for ``modes`` (see :func:`adamw_modes`: ``"default"``, ``"all"``,
    ``"none"`` or a ``master:moments`` list); with ``torchao`` :func:`bench_torchao` on
    ``torchao_params`` (default: the same count; "not installed" rows without torchao); with
    ``host`` :func:`bench_host_time` (1000 bf16 tensors of 256 elements, clip on, fastest of 30).

    ``release``: :func:`bench_release` -- a training step of mpkern compare's classifier in bf16
    params with gradient release beside the regular step (:data:`RELEASE_SIZES`: quick 3.3M params,
    full 19.3M params), ``reps`` rounds in alternation.
    """
    if which not in KERNELS + ("all",):
        raise ValueError(f"which must be one of {KERNELS + ('all',)}, got {which!r}")
    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: CUDA was asked for but torch.cuda.is_available() is False")
    size = dict(QUICK if quick else FULL)
    for k, v in (("params", params), ("tensors", tensors), ("reps", reps)):
        if v is not None:
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{k} must be a positive integer, got {v!r}")
            size[k] = v
    if torchao_params is not None and (not isinstance(torchao_params, int) or torchao_params < 1):
        raise ValueError(f"torchao_params must be a positive integer, got {torchao_params!r}")
    kernels = KERNELS if which == "all" else (which,)
    meta = machine_info(dev) | {"which": which, "quick": quick, **size}
    if "adamw" in kernels:
        _mod, version, why = torchao_optim() if torchao else (None, "", "not run")
        mode_list = adamw_modes(modes)  # a bad mode fails here, before the long runs
        meta.update(adamw_modes=[[mw, sd] for mw, sd in mode_list], torchao=version or why)
    bw = None
    if "unscale" in kernels or "adamw" in kernels:
        log(f"measuring memory bandwidth on {dev} ...")
        bw = measure_bandwidth(dev)
        meta["bandwidth"] = bw
        log(f"  in-place fp32 multiply {bw['inplace_GBps']:.1f} GB/s, copy {bw['copy_GBps']:.1f} GB/s")
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    if "unscale" in kernels:
        rows += bench_unscale(dev, params=size["params"], tensors=size["tensors"], reps=size["reps"], bandwidth=bw,
                              log=log)
    if "adamw" in kernels:
        areps = max(size["reps"] - 5, 3)
        base = bench_adamw(dev, params=size["params"], tensors=size["tensors"], reps=areps, bandwidth=bw, log=log)
        rows += base
        baseline_s = base[1]["ms"] / 1e3  # (a), the AMP recipe on fp32 params
        # each mode beside its own alternating baseline (the AMP recipe row above is a separate run)
        rows += bench_adamw_modes(dev, params=size["params"], tensors=size["tensors"], reps=areps, modes=mode_list,
                                  bandwidth=bw, log=log)
        if torchao:
            rows += bench_torchao(dev, params=min(torchao_params or size["params"], size["params"]),
                                  tensors=size["tensors"], reps=areps, baseline_s=baseline_s,
                                  baseline_params=size["params"], log=log)
        if host:
            rows += bench_host_time(dev, log=log)
    if "matmul" in kernels:
        rows += bench_matmul(dev, quick=quick, log=log)
        if not quick:
            rows += bench_linear_e2e(dev, log=log)
    if "release" in kernels:
        rows += bench_release(dev, quick=quick, reps=size["reps"], log=log)
    meta["seconds"] = time.perf_counter() - t0
    return {"meta": meta, "rows": rows}


def add_adamw_arguments(ap: Any) -> None:
    """The AdamW benchmark's own options on an ``argparse`` parser (``mpkern bench``'s);
    :func:`adamw_run_kwargs` turns them into :func:`run`'s."""
    ap.add_argument("--modes", default="default", metavar="default|all|none|MASTER:MOMENTS,...",
                    help="FusedAdamWMP storage modes on bf16 params: 'default' (fp32+fp32, remainder+bf16, "
                         "8bit+bf16, 8bit+8bit, remainder+8bit, 8bit+4bit_m, remainder+4bit_m), 'all' (every "
                         "master_weights x state_dtype), 'none', or a list such as remainder:bf16,8bit:8bit")
    ap.add_argument("--torchao-params", type=float, default=None, metavar="N",
                    help="cap the params of the torchao rows (torchao compiles per tensor and is slow on CPU)")
    ap.add_argument("--no-torchao", action="store_true", help="skip the torchao rows")
    ap.add_argument("--no-host-time", action="store_true",
                    help="skip the host-time rows (1000 bf16 tensors of 256, us per tensor)")


def adamw_run_kwargs(args: Any) -> dict[str, Any]:
    """:func:`run`'s AdamW keywords from options added by :func:`add_adamw_arguments` (absent: defaults)."""
    tp = getattr(args, "torchao_params", None)
    return {"modes": getattr(args, "modes", "default"), "torchao": not getattr(args, "no_torchao", False),
            "torchao_params": None if tp is None else int(tp), "host": not getattr(args, "no_host_time", False)}
