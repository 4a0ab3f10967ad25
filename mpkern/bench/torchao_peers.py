"""torchao's low-bit AdamWs side by side with the AdamW benchmark (AdamW8bit on fp32 and bf16
params, AdamW4bit on bf16 params, bf16 stochastic-rounding AdamW): the same loss-scaled, clipped
step, time and the state bytes counted from their real tensors; "not installed" rows when torchao
does not import."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ..measure import sync, time_fn
from .common import (
    ADAMW_INV_SCALE,
    ADAMW_LR,
    BASELINE,
    FULL,
    Tensor,
    adamw_problem,
    failure,
    grads_of,
    row,
    state_nbytes,
    unscale_clip,
)

#: (label, torchao class name, param dtype, constructor kwargs) of the torchao rows
TORCHAO_CASES: tuple[tuple[str, str, torch.dtype, dict[str, Any]], ...] = (
    ("AdamW8bit, fp32 params", "AdamW8bit", torch.float32, {}),
    ("AdamW8bit, bf16 params (bf16_stochastic_round)", "AdamW8bit", torch.bfloat16, {"bf16_stochastic_round": True}),
    ("AdamW4bit, bf16 params (bf16_stochastic_round)", "AdamW4bit", torch.bfloat16, {"bf16_stochastic_round": True}),
    ("bf16 AdamW, stochastic rounding (bf16 params and moments)", "_AdamW", torch.bfloat16,
     {"bf16_stochastic_round": True}),
)


def torchao_optim() -> tuple[Any, str, str]:
    """``(module, version, "")`` of torchao's low-bit optimizers, or ``(None, "", why)``:
    ``torchao.optim`` (torchao >= 0.11), else the older ``torchao.prototype.low_bit_optim``."""
    try:
        import torchao
    except ImportError:
        return None, "", "not installed (pip install torchao)"
    except Exception as e:  # noqa: BLE001 -- a torchao built for another torch can fail in many ways
        return None, "", f"unavailable: import torchao failed ({type(e).__name__}: {e})"
    version = getattr(torchao, "__version__", "?")
    for name in ("torchao.optim", "torchao.prototype.low_bit_optim"):
        try:
            mod = __import__(name, fromlist=["AdamW8bit"])
        except Exception:  # noqa: BLE001 -- a module path this torchao lacks or cannot import: try the next
            continue
        if hasattr(mod, "AdamW8bit"):
            return mod, version, ""
    return None, version, f"unavailable: torchao {version} has no AdamW8bit"


def _torchao_sizes(params: int, tensors: int) -> list[int]:
    """Equal tensor sizes, multiples of 256 (torchao quantizes only tensors of >= 4096 elements
    divisible by its block) -- one shape, so its per-param ``torch.compile`` compiles once."""
    per = max(4096, (params // tensors) // 256 * 256)
    return [per] * max(1, min(tensors, params // per))


def bench_torchao(device: torch.device | str, *, params: int = FULL["params"], tensors: int = FULL["tensors"],
                  reps: int = 10, baseline_s: float | None = None, baseline_params: int | None = None,
                  cases: tuple[tuple[str, str, torch.dtype, dict[str, Any]], ...] = TORCHAO_CASES,
                  log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """torchao's low-bit AdamWs (:data:`TORCHAO_CASES`) doing the same loss-scaled, clipped step
    (``_amp_foreach_non_finite_check_and_unscale_`` + ``clip_grad_norm_`` + ``step()``, grads
    restored untimed before each call); rows say "not installed" when torchao does not import.

    ``params`` in ``tensors`` equal tensors (:func:`_torchao_sizes`; the row's ``params`` says the
    count used). Each row: time (the first step, which compiles, is timed apart as
    ``first_step_s``), the optimizer-state bytes/param summed from the real state tensors
    (:func:`state_nbytes`), and the speed ratio over the baseline per param (``baseline_s`` over
    ``baseline_params``; both sides memory-bound, so time scales with the param count). torchao's
    compiled step has no byte-model count here, so no GB/s and no limit."""
    dev = torch.device(device)
    mod, version, why = torchao_optim()
    if mod is None:
        log(f"torchao: {why}")
        return [row("adamw", f"torchao {label}: {why}", None, note=why) for label, *_ in cases]
    sizes = _torchao_sizes(params, tensors)
    n = sum(sizes)
    grads16, init = adamw_problem(dev, sizes, seed=2)
    inv = torch.tensor(ADAMW_INV_SCALE, device=dev)
    rows = []
    for label, cls_name, dt, kw in cases:
        cls = getattr(mod, cls_name, None)
        api = f"{mod.__name__}.{cls_name}"
        if cls is None:
            why = f"torchao {version} has no {cls_name}"
            rows.append(row("adamw", f"torchao {label}: {why}", None, note=why))
            continue
        ps = [torch.nn.Parameter(w.to(dt)) for w in init]
        gs = [x.to(dt) for x in grads16]
        for p, x in zip(ps, gs):
            p.grad = x.clone()
        opt = cls(ps, lr=ADAMW_LR, **kw)

        def restore(ps: list[torch.nn.Parameter] = ps, gs: list[Tensor] = gs) -> None:
            torch._foreach_copy_(grads_of(ps), gs)

        def step(ps: list[torch.nn.Parameter] = ps, opt: torch.optim.Optimizer = opt) -> None:
            unscale_clip(ps, inv)
            opt.step()

        try:
            restore()
            sync(dev)
            t0 = time.perf_counter()
            step()
            sync(dev)
            first = time.perf_counter() - t0
            t = time_fn(step, dev, reps=reps, warmup=1, setup=restore)
        except Exception as e:  # noqa: BLE001 -- e.g. no C++ compiler for inductor on this machine
            why = failure(e)
            log(f"torchao {label}: {why}")
            rows.append(row("adamw", f"torchao {label}: {why}", None, note=why))
            continue
        state = state_nbytes(opt) / n
        ratio = None
        if baseline_s is not None:
            ratio = (baseline_s / (baseline_params or n)) / (t / n)
        r = row("adamw", f"torchao {label} (torchao {version})", t, params=n, peer_ratio=ratio, state_bpp=state,
                vs=None if ratio is None else BASELINE, note="per-param time ratio" if n != baseline_params else None)
        r.update(api=api, kwargs=dict(kw), params=n, first_step_s=first,
                 torchao_version=version)
        rows.append(r)
        log(f"torchao {label}: {t * 1e3:.2f} ms ({n / 1e6:g}M params; first step incl. compile {first:.1f} s), "
            f"state {state:.3f} B/param")
        del opt, ps, gs, step, restore
    return rows
