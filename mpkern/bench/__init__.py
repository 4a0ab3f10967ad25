"""Kernel benchmarks, each against the PyTorch peer a user would otherwise run, in the same process.

One implementation behind ``mpkern bench``, one module per kernel family:

* :mod:`.unscale` -- :func:`bench_unscale`: ``mpkern.unscale_`` vs
  ``_amp_foreach_non_finite_check_and_unscale_`` + ``clip_grad_norm_`` on the same bf16 grads.
* :mod:`.adamw` -- :func:`bench_adamw`: ``mpkern.unscale_`` + ``FusedAdamWMP.step`` vs (a) the AMP
  recipe on fp32 params (fused AdamW; :func:`amp_fp32_recipe`, the baseline of every AdamW-side
  row) and (b) bf16 params with hand-kept fp32 masters, and the external-write check's cost.
* :mod:`.modes` -- :func:`bench_adamw_modes`: the storage modes (master kind x moment kind, all
  names, labels and byte counts from the optimizer's storage-kind registry): bytes moved, state
  bytes, GB/s vs the in-place bandwidth, ratio over (a) and its limit.
* :mod:`.torchao_peers` -- :func:`bench_torchao`: torchao's AdamW8bit, AdamW4bit and bf16
  stochastic-rounding AdamW, state bytes from their tensors.
* :mod:`.host` -- :func:`host_time` / :func:`bench_host_time`: us per tensor of a step on 1000 tiny
  tensors vs torch fused AdamW + foreach clip (``benchmarks/host_time.py`` adds the full path's breakdown).
* :mod:`.matmul` -- :func:`bench_matmul`: ``mpkern.matmul`` vs ``torch.matmul`` (TFLOP/s). On CUDA
  the Triton GEMM against cuBLAS; on CPU what mpkern runs there (ATen in fp32, then a cast) against
  ATen's own 16-bit GEMM; the GEMM problems (:func:`matmul_problems`, their operands
  :func:`operands`).
* :mod:`.release` -- :func:`bench_release`: a training step with gradient release
  (``FusedAdamWMP(release_grads=True)``, ``opt.backward``) beside the regular one, one pass and two
  (``max_grad_norm``), and what one extra backward pass costs; tokens/s and the ratios against the goals.
* :mod:`.report` -- :func:`format_table`, :func:`plot`; :mod:`.runner` -- :func:`run` (all of the
  above, as ``mpkern bench`` runs them); :mod:`.common` -- sizes, the unscale and AdamW problems
  (:func:`unscale_problem`, :func:`adamw_problem`), the table row, :func:`state_nbytes`.

The GPU check (``scripts/gpu_check.sh``) times these problems on a lent GPU with its own tooling,
``tools/gpu_check/`` (not part of this package).

Timing, bandwidth and machine helpers are :mod:`mpkern.measure`'s (shared with ``mpkern compare``;
re-exported here). Every row reports time, GB/s by the byte model of :mod:`mpkern.bytemodel`
(TFLOP/s for matmul), the share of the measured in-place memory bandwidth, and on each peer row
the speed ratio ``peer time / mpkern time`` beside its byte-model limit ``peer bytes / mpkern
bytes``. Inputs that a call modifies are restored (untimed) before every timed call, so repeated
in-place unscaling does not drive the grads into subnormals and time something else. The
optimizer is driven through its public API only (its documented switches and
:func:`mpkern.optim.step_parts`).
"""

from __future__ import annotations

from ..measure import cpu_name, machine_info, measure_bandwidth, pyplot, sync, time_fn, write_json
from .adamw import bench_adamw, write_check_host_cost
from .common import (
    ADAMW_INV_SCALE,
    ADAMW_LR,
    ADAMW_MAX_NORM,
    BASELINE,
    FULL,
    KERNELS,
    QUICK,
    adamw_problem,
    amp_fp32_recipe,
    state_nbytes,
    tensor_sizes,
    unscale_problem,
)
from .host import bench_host_time, host_time
from .matmul import (
    DTYPES,
    GPU_LLM,
    GPU_SQUARE,
    MODEL_LAYERS,
    bench_linear_e2e,
    bench_matmul,
    operands,
    problems as matmul_problems,
    wgrad_accumulate_peer,
)
from .modes import (
    DEFAULT_ADAMW_MODES,
    adamw_modes,
    bench_adamw_modes,
    mode_label,
    optimizer_kwargs,
    step_bytes_per_param,
)
from .release import RELEASE_GOAL, RELEASE_SIZES, bench_release
from .report import format_table, plot
from .runner import adamw_run_kwargs, add_adamw_arguments, run
from .torchao_peers import TORCHAO_CASES, bench_torchao, torchao_optim
from .unscale import bench_unscale

__all__ = [
                     "ADAMW_INV_SCALE",
                     "ADAMW_LR",
                     "ADAMW_MAX_NORM",
                     "BASELINE",

                     "DEFAULT_ADAMW_MODES",
                     "DTYPES",
                     "FULL",
                     "GPU_LLM",
                     "GPU_SQUARE",
                     "KERNELS",
                     "QUICK",
                     "RELEASE_GOAL",
                     "RELEASE_SIZES",
                     "TORCHAO_CASES",
                     "adamw_modes",
                     "adamw_problem",
                     "adamw_run_kwargs",
                     "add_adamw_arguments",
                     "amp_fp32_recipe",
                     "bench_adamw",
                     "bench_adamw_modes",
                     "bench_host_time",
                     "bench_matmul", "bench_linear_e2e", "matmul_problems", "MODEL_LAYERS",
                     "bench_release",
                     "bench_torchao",
                     "bench_unscale",
                     "cpu_name",
                     "format_table",
                     "host_time",
                     "machine_info",
                     "measure_bandwidth",
                     "mode_label",
                     "operands",
                     "optimizer_kwargs",
                     "plot",
                     "pyplot",
                     "run",
                     "state_nbytes",
                     "step_bytes_per_param",
                     "sync",
                     "tensor_sizes",
                     "time_fn",
                     "torchao_optim",
                     "unscale_problem",
                     "wgrad_accumulate_peer",
                     "write_check_host_cost",
                     "write_json",
]
