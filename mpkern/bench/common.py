"""What every benchmark of :mod:`mpkern.bench` shares: problem sizes, the optimizer-side step they
all time, random tensor sizes, the table row, a failed row's reason and the host-bound timer.

Timing, bandwidth and machine helpers live in :mod:`mpkern.measure` (shared with ``mpkern compare``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..measure import sync
from ..optim import FusedAdamWMP

Tensor = torch.Tensor
KERNELS = ("unscale", "adamw", "matmul", "release")

#: sizes: (params, tensors, reps) for the optimizer-side benchmarks
FULL = {"params": 32_000_000, "tensors": 200, "reps": 15}
QUICK = {"params": 16_000_000, "tensors": 100, "reps": 7}

#: the optimizer-side step every AdamW row times: loss scale 1024, clip at 1.0, lr 1e-4
ADAMW_LR, ADAMW_INV_SCALE, ADAMW_MAX_NORM = 1e-4, 1.0 / 1024, 1.0
#: the peer every AdamW-side row's speed is measured against (:func:`mpkern.bench.amp_fp32_recipe`)
BASELINE = "torch AMP recipe, fp32 params"


def tensor_sizes(total: int, count: int, seed: int = 0) -> list[int]:
    """``count`` random tensor sizes (within a factor ~10 of each other) summing to ``total``."""
    if total < count or count < 1:
        raise ValueError(f"need total >= count >= 1, got total={total}, count={count}")
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(count, generator=g) + 0.1
    sizes = (w / w.sum() * total).long().clamp(min=1)
    sizes[-1] += total - int(sizes.sum())
    return sizes.tolist()


def row(kernel: str, method: str, t: float | None, *, bpp: float | None = None, params: int = 0,
        flops: float | None = None, bw: float | None = None, peer_ratio: float | None = None,
        limit: float | None = None, bound: float | None = None, bound_name: str = "in-place bandwidth",
        state_bpp: float | None = None, vs: str | None = None, note: str | None = None) -> dict[str, Any]:
    """One table row. Memory-bound rows: ``bpp`` bytes/param over ``params`` -> GB/s and % of ``bw``
    (``bound_name`` says which bandwidth). Compute rows: ``flops`` -> TFLOP/s and % of ``bound`` (the
    peer's TFLOP/s). Neither (a peer whose traffic the byte model does not know): time only.
    ``t`` None: the row did not run (``note`` says why). ``state_bpp``: resident optimizer-state
    bytes/param. ``vs``: ``peer_ratio`` is this row's speed over row ``vs`` (``vs`` time / this time)
    instead of mpkern's over this row."""
    r: dict[str, Any] = {"kernel": kernel, "method": method, "ms": None if t is None else t * 1e3}
    if t is None:
        r.update(unit="", rate=None, bytes_per_param=bpp, pct_of_bound=None, bound=None)
    elif flops is not None:
        rate = flops / t / 1e12
        r.update(unit="TFLOP/s", rate=rate, bytes_per_param=None,
                 pct_of_bound=None if bound is None else 100 * rate / bound, bound="peer TFLOP/s")
    elif bpp is not None:
        rate = bpp * params / t / 1e9
        r.update(unit="GB/s", rate=rate, bytes_per_param=bpp,
                 pct_of_bound=None if bw is None else 100 * rate / bw, bound=bound_name)
    else:
        r.update(unit="", rate=None, bytes_per_param=None, pct_of_bound=None, bound=None)
    r["mpkern_speedup"] = peer_ratio
    r["byte_model_limit"] = limit
    if state_bpp is not None:
        r["state_bytes_per_param"] = state_bpp
    if vs is not None:
        r["vs"] = vs
    if note is not None:
        r["note"] = note
    return r


def failure(e: BaseException) -> str:
    """A row's one-line reason for a benchmark that raised."""
    first = str(e).strip().splitlines()[0][:100] if str(e).strip() else ""
    return f"failed: {type(e).__name__}: {first}"


def best_of(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """Fastest of ``reps`` calls, seconds (host-bound timings: the minimum is the figure)."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def unscale_problem(dev: torch.device, sizes: list[int], seed: int = 0) -> list[torch.nn.Parameter]:
    """The unscale benchmarks' params: one bf16 param per size (its values never read) holding a
    "loss-scaled" bf16 grad (N(0, 64^2), drawn on the CPU from ``seed``, so every device gets the same)."""
    g = torch.Generator().manual_seed(seed)
    ps = []
    for n in sizes:
        p = torch.nn.Parameter(torch.empty(n, dtype=torch.bfloat16, device=dev))
        p.grad = (torch.randn(n, generator=g) * 64.0).to(torch.bfloat16).to(dev)
        ps.append(p)
    return ps


def adamw_problem(dev: torch.device, sizes: list[int], seed: int = 1) -> tuple[list[Tensor], list[Tensor]]:
    """``(grads16, init)``: "loss-scaled" bf16 grads (N(0, 64^2)) and fp32 initial weights (N(0, 0.02^2))."""
    g = torch.Generator().manual_seed(seed)
    grads16 = [(torch.randn(n, generator=g) * 64).to(torch.bfloat16).to(dev) for n in sizes]
    init = [(torch.randn(n, generator=g) * 0.02).to(dev) for n in sizes]
    return grads16, init


def grads_of(params: Iterable[Tensor]) -> list[Tensor]:
    """Each param's ``.grad``: the benchmarks' problems give every param one (a param without raises)."""
    grads = []
    for p in params:
        g = p.grad
        if g is None:
            raise ValueError(f"a benchmark param of shape {tuple(p.shape)} has no .grad")
        grads.append(g)
    return grads


def fused_flag(dev: torch.device) -> bool | None:
    """``torch.optim.AdamW``'s ``fused``: True where a fused kernel exists (CUDA, and CPU from torch 2.4),
    else None (its default: foreach)."""
    return True if dev.type in ("cuda", "cpu") else None


def backward_step(opt: torch.optim.Optimizer, loss: Tensor) -> None:
    """One training step's backward and optimizer step: ``opt.backward(loss)`` for a ``FusedAdamWMP`` with
    ``release_grads=True`` (the step inside backward), else ``loss.backward(); opt.step();
    opt.zero_grad(set_to_none=True)`` -- the two ways the release benchmarks set side by side."""
    if isinstance(opt, FusedAdamWMP) and opt.release_grads:
        opt.backward(loss)
        return
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def torch_unscale_clip(params: Sequence[Tensor], inv: Tensor, max_norm: float) -> Tensor:
    """PyTorch's recipe for what ``mpkern.unscale_(params, inv, max_norm=...)`` does, on the same grads;
    returns found_inf. GradScaler's ``_amp_foreach_non_finite_check_and_unscale_`` (read + write), then
    ``clip_grad_norm_(foreach=True)`` (norm read + scale read/write): 5 grad-sized accesses
    (bytemodel.UNSCALE_TRAFFIC["torch"]). bf16 grads on CUDA, which that op has no kernel for (torch
    2.11: "not implemented for 'BFloat16'"), take its foreach equivalent with the same accesses: the
    multiply, then the clip, whose total norm is non-finite exactly when a grad is."""
    grads = grads_of(params)
    if inv.device.type == "cuda" and any(g.dtype == torch.bfloat16 for g in grads):
        torch._foreach_mul_(grads, inv)
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        return (~torch.isfinite(norm)).float()
    found = torch.zeros((), device=inv.device)
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
    torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    return found


def unscale_clip(params: Sequence[Tensor], inv: Tensor) -> None:
    """PyTorch's AMP recipe before the step: GradScaler's unscale (with its inf check), then the clip."""
    torch_unscale_clip(params, inv, ADAMW_MAX_NORM)


def amp_fp32_recipe(init: list[Tensor], grads16: list[Tensor], inv: Tensor, lr: float = ADAMW_LR, *,
                    capturable: bool = False) -> tuple[Callable[[], None], Callable[[], None], torch.optim.Optimizer]:
    """``(step, restore, optimizer)`` of the baseline every AdamW row is measured against: the AMP
    recipe on fp32 params and grads (unscale + ``clip_grad_norm_(foreach=True)`` +
    ``torch.optim.AdamW(fused=True)``; 48 B/param). ``restore()`` puts the grads back (untimed).
    ``capturable``: AdamW's own switch (its step may then be captured in a CUDA graph)."""
    dev = inv.device
    pa = [torch.nn.Parameter(w.clone()) for w in init]
    ga = [x.float() for x in grads16]
    for p, x in zip(pa, ga):
        p.grad = x.clone()
    opt = torch.optim.AdamW(pa, lr=lr, capturable=capturable, fused=fused_flag(dev))

    def restore() -> None:
        torch._foreach_copy_(grads_of(pa), ga)

    def step() -> None:
        unscale_clip(pa, inv)
        opt.step()

    return step, restore, opt


def state_nbytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of an optimizer's per-param state, from the tensors themselves: tensor subclasses
    (torchao's quantized states) count their inner tensors (codes, scales, maps); 0-dim tensors
    (``step``) are not counted; a storage shared by several tensors counts once."""
    seen: set[tuple[int, str]] = set()

    def count(t: Tensor) -> int:
        if type(t) is not Tensor and not isinstance(t, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
            names, _ = t.__tensor_flatten__()
            return sum(count(getattr(t, n)) for n in names)
        if t.dim() == 0:
            return 0
        st = t.untyped_storage()
        key = (st.data_ptr(), str(t.device))
        if key in seen or st.data_ptr() == 0:
            return 0
        seen.add(key)
        return st.nbytes()

    return sum(count(v) for st in optimizer.state.values() for v in st.values() if isinstance(v, Tensor))
