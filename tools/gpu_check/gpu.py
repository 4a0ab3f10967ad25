"""What the GPU check's benchmark stages share: the GPU they run on, whether an mpkern backend runs
there, how a call is timed (kernel, wall and CUDA-graph times, :mod:`mpkern.measure`), the meta
every stage file starts with, and the stage log line.

Imports torch and mpkern when called, never at import: the summary's modules must not reach them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .harness import short_error

__all__ = ["CALLS", "INV_SCALE", "ROUNDS", "WARMUP", "adamw_optimizer", "backend_ok", "free", "gpu", "log", "meta",
           "resolve", "times"]

#: timing: back-to-back calls per round, rounds (median), warm-up calls
CALLS, ROUNDS, WARMUP = 20, 5, 3
#: the inverse loss scale of every memory-bound row: 1.0 as a device tensor, so the peers' repeated
#: in-place unscale + clip settles at norm max_norm instead of decaying towards zero over the timed calls
INV_SCALE = 1.0


def gpu() -> Any:
    """The current CUDA device; RuntimeError ("no CUDA GPU ...": the stage's exit status 3) without one."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU visible to torch (torch.cuda.is_available() is False)")
    return torch.device("cuda", torch.cuda.current_device())


def resolve(device: Any) -> Any:
    """``device`` as a ``torch.device``; None: :func:`gpu` (a CPU test passes ``"cpu"``)."""
    import torch

    return gpu() if device is None else torch.device(device)


def backend_ok(name: str, dev: Any) -> str:
    """Empty if mpkern's backend ``name`` runs on ``dev``, else why not (``mpkern.info()`` with the
    backend forced: the one it selects, or why it cannot)."""
    import mpkern

    with mpkern.use_backend(name):
        selected = mpkern.info()["selected_backend"]
    return "" if selected == name else str(selected).removeprefix("error: ")


def times(fn: Callable[[], object], dev: Any, graph: bool = True) -> tuple[dict, dict | None, str | None]:
    """``(eager timing, graph timing or None, graph error or None)`` of ``fn`` on ``dev``:
    :func:`mpkern.measure.event_time` and :func:`~mpkern.measure.graph_time` (looked up at call time)."""
    from mpkern import measure

    t = measure.event_time(fn, dev, calls=CALLS, rounds=ROUNDS, warmup=WARMUP)
    if not graph:
        return t, None, "not captured"
    try:
        return t, measure.graph_time(fn, dev, calls=CALLS, rounds=ROUNDS, warmup=WARMUP), None
    except Exception as e:  # noqa: BLE001 -- a capture that fails is a result of the run, written down
        measure.sync(dev)
        return t, None, short_error(e)


def adamw_optimizer(init: Any, grads16: Any, master_weights: Any, state_dtype: str, lr: float) -> Any:
    """``FusedAdamWMP`` (capturable) over bf16 params made from the fp32 ``init`` tensors, with the bf16
    ``grads16`` as their grads, keeping its state as ``master_weights`` / ``state_dtype`` say (call it
    inside the backend it is to run on)."""
    import torch

    import mpkern
    from mpkern.bench.modes import optimizer_kwargs

    ps = [torch.nn.Parameter(w.to(torch.bfloat16)) for w in init]
    for p, g in zip(ps, grads16):
        p.grad = g
    return mpkern.FusedAdamWMP(ps, lr=lr, capturable=True, **optimizer_kwargs(master_weights, state_dtype))


def free(dev: Any) -> None:
    """Give the caching allocator's free blocks back between rows (GPU only)."""
    import torch

    if dev.type == "cuda":
        torch.cuda.empty_cache()


def meta(dev: Any, **extra: Any) -> dict[str, Any]:
    """A stage file's ``meta``: the machine (:func:`mpkern.measure.machine_info`), torch's CUDA, the
    timing constants and ``extra``."""
    import torch

    from mpkern.measure import machine_info

    return machine_info(dev) | {"torch_cuda": torch.version.cuda, "calls": CALLS, "rounds": ROUNDS,
                                "warmup": WARMUP, "inv_scale": INV_SCALE, **extra}


def log(msg: str) -> None:
    """One line of the stage log, with the time."""
    print(f"[stage {time.strftime('%H:%M:%S')}] {msg}", flush=True)
