"""Kernel benchmarks, each against the PyTorch peer a user would otherwise run, in the same process.

One implementation behind ``mpkern bench`` and ``benchmarks/bench_*.py`` (thin wrappers):

* :func:`bench_unscale` -- ``mpkern.unscale_`` vs ``_amp_foreach_non_finite_check_and_unscale_`` +
  ``clip_grad_norm_`` on the same bf16 grads.
* :func:`bench_adamw` -- ``mpkern.unscale_`` + ``FusedAdamWMP.step`` vs (a) the AMP recipe on fp32
  params (fused AdamW) and (b) bf16 params with hand-kept fp32 masters; then, against (a):
  :func:`bench_adamw_modes` (the compact storage modes: bytes moved, state bytes, GB/s vs the copy
  bandwidth, ratio and limit), :func:`bench_torchao` (torchao's AdamW8bit and bf16 stochastic-
  rounding AdamW, state bytes from their tensors) and :func:`bench_host_time` (us per tensor of a
  step on 1000 tiny tensors, vs torch fused AdamW + foreach clip; :func:`host_time` is also
  ``benchmarks/host_time.py``).
* :func:`bench_matmul` -- ``mpkern.matmul`` vs ``torch.matmul`` (TFLOP/s). On CUDA the Triton GEMM
  against cuBLAS; on CPU what mpkern runs there (ATen in fp32, then a cast) against ATen's own
  16-bit GEMM; with ``check=True`` on CPU also the Triton kernel in the interpreter vs float64.

Every row reports time, GB/s by the byte model of :mod:`mpkern.bytemodel` (TFLOP/s for matmul),
the share of the measured in-place memory bandwidth, and on each peer row the speed ratio
``peer time / mpkern time`` beside its byte-model limit ``peer bytes / mpkern bytes``. Inputs that a
call modifies are restored (untimed) before every timed call, so repeated in-place unscaling does
not drive the grads into subnormals and time something else.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from . import bytemodel
from .measure import cpu_name, machine_info, measure_bandwidth, pyplot, sync, time_fn, write_json  # noqa: F401 (re-exported)

Tensor = torch.Tensor
KERNELS = ("unscale", "adamw", "matmul")

#: sizes: (params, tensors, reps) for the optimizer-side benchmarks
FULL = {"params": 32_000_000, "tensors": 200, "reps": 15}
QUICK = {"params": 16_000_000, "tensors": 100, "reps": 7}


# ---- helpers ------------------------------------------------------------------------------------
def tensor_sizes(total: int, count: int, seed: int = 0) -> list[int]:
    """``count`` random tensor sizes (within a factor ~10 of each other) summing to ``total``."""
    if total < count or count < 1:
        raise ValueError(f"need total >= count >= 1, got total={total}, count={count}")
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(count, generator=g) + 0.1
    sizes = (w / w.sum() * total).long().clamp(min=1)
    sizes[-1] += total - int(sizes.sum())
    return sizes.tolist()


def _row(kernel: str, method: str, t: float | None, *, bpp: float | None = None, params: int = 0,
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


# ---- unscale_ -----------------------------------------------------------------------------------
def bench_unscale(device: torch.device | str, *, params: int = FULL["params"], tensors: int = FULL["tensors"],
                  reps: int = FULL["reps"], bandwidth: dict[str, float] | None = None,
                  log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """``mpkern.unscale_(params, inv_scale, max_norm=1)`` vs the PyTorch AMP recipe, bf16 grads."""
    import mpkern

    dev = torch.device(device)
    bw = bandwidth or measure_bandwidth(dev)
    g = torch.Generator().manual_seed(0)
    ps = []
    for n in tensor_sizes(params, tensors):
        p = torch.nn.Parameter(torch.empty(n, dtype=torch.bfloat16, device=dev))
        p.grad = (torch.randn(n, generator=g) * 64.0).to(torch.bfloat16).to(dev)  # "scaled" grads
        ps.append(p)
    grads = [p.grad for p in ps]
    backup = [x.clone() for x in grads]
    inv = torch.tensor(1.0 / 1024.0, device=dev)

    def restore() -> None:
        torch._foreach_copy_(grads, backup)

    def recipe() -> None:
        found_inf = torch.zeros((), device=dev)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv)
        torch.nn.utils.clip_grad_norm_(ps, 1.0, foreach=True)

    def fused() -> None:
        mpkern.unscale_(ps, inv, max_norm=1.0)

    restore()
    recipe()
    ref = [x.float().clone() for x in grads]
    restore()
    fused()
    worst = max(((x.float() - r).abs() / r.abs().clamp(min=1e-30)).max().item() for x, r in zip(grads, ref))
    log(f"unscale_: max relative difference of grads, mpkern vs recipe {worst:.2e} (bf16 eps 7.8e-3)")
    t_ref = time_fn(recipe, dev, reps=reps, setup=restore)
    t_ours = time_fn(fused, dev, reps=reps, setup=restore)
    b_ours, b_ref = bytemodel.UNSCALE_TRAFFIC["mpkern"], bytemodel.UNSCALE_TRAFFIC["torch"]
    return [
        _row("unscale", f"mpkern.unscale_ ({mpkern._backend.select(dev)})", t_ours, bpp=b_ours, params=params,
             bw=bw["inplace_GBps"]),
        _row("unscale", "torch: _amp_foreach_non_finite_check_and_unscale_ + clip_grad_norm_", t_ref, bpp=b_ref,
             params=params, bw=bw["inplace_GBps"], peer_ratio=t_ref / t_ours, limit=bytemodel.limit(b_ref, b_ours)),
    ]


# ---- AdamW --------------------------------------------------------------------------------------
#: the optimizer-side step every AdamW row times: loss scale 1024, clip at 1.0, lr 1e-4
ADAMW_LR, ADAMW_INV_SCALE, ADAMW_MAX_NORM = 1e-4, 1.0 / 1024, 1.0


def _adamw_problem(dev: torch.device, sizes: list[int], seed: int = 1) -> tuple[list[Tensor], list[Tensor]]:
    """``(grads16, init)``: "loss-scaled" bf16 grads (N(0, 64^2)) and fp32 initial weights (N(0, 0.02^2))."""
    g = torch.Generator().manual_seed(seed)
    grads16 = [(torch.randn(n, generator=g) * 64).to(torch.bfloat16).to(dev) for n in sizes]
    init = [(torch.randn(n, generator=g) * 0.02).to(dev) for n in sizes]
    return grads16, init


def _unscale_clip(params: list[Tensor], inv: Tensor) -> None:
    """PyTorch's AMP recipe before the step: GradScaler's unscale (with its inf check), then the clip."""
    found = torch.zeros((), device=inv.device)
    torch._amp_foreach_non_finite_check_and_unscale_([p.grad for p in params], found, inv)
    torch.nn.utils.clip_grad_norm_(params, ADAMW_MAX_NORM, foreach=True)


def amp_fp32_recipe(init: list[Tensor], grads16: list[Tensor], inv: Tensor,
                    lr: float = ADAMW_LR) -> tuple[Callable[[], None], Callable[[], None], torch.optim.Optimizer]:
    """``(step, restore, optimizer)`` of the baseline every AdamW row is measured against: the AMP
    recipe on fp32 params and grads (unscale + ``clip_grad_norm_(foreach=True)`` +
    ``torch.optim.AdamW(fused=True)``; 48 B/param). ``restore()`` puts the grads back (untimed)."""
    dev = inv.device
    fused_kw = {"fused": True} if dev.type in ("cuda", "cpu") else {}
    pa = [torch.nn.Parameter(w.clone()) for w in init]
    ga = [x.float() for x in grads16]
    for p, x in zip(pa, ga):
        p.grad = x.clone()
    opt = torch.optim.AdamW(pa, lr=lr, **fused_kw)

    def restore() -> None:
        torch._foreach_copy_([p.grad for p in pa], ga)

    def step() -> None:
        _unscale_clip(pa, inv)
        opt.step()

    return step, restore, opt


def bench_adamw(device: torch.device | str, *, params: int = FULL["params"], tensors: int = FULL["tensors"],
                reps: int = 10, bandwidth: dict[str, float] | None = None,
                log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Loss-scaled (1/1024), clipped (1.0) AdamW step: FusedAdamWMP vs the two PyTorch recipes."""
    import mpkern

    dev = torch.device(device)
    bw = bandwidth or measure_bandwidth(dev)
    grads16, init = _adamw_problem(dev, tensor_sizes(params, tensors))
    inv = torch.tensor(ADAMW_INV_SCALE, device=dev)
    lr = ADAMW_LR
    fused_kw = {"fused": True} if dev.type in ("cuda", "cpu") else {}
    recipe_a, restore_a, _ = amp_fp32_recipe(init, grads16, inv, lr)  # (a) fp32 params and grads

    pb = [torch.nn.Parameter(w.to(torch.bfloat16)) for w in init]  # (b) bf16 params, fp32 masters by hand
    for p, x in zip(pb, grads16):
        p.grad = x.clone()
    masters = [torch.nn.Parameter(p.detach().float()) for p in pb]
    for m in masters:
        m.grad = torch.empty_like(m)
    opt_b = torch.optim.AdamW(masters, lr=lr, **fused_kw)

    def recipe_b() -> None:
        torch._foreach_copy_([m.grad for m in masters], [p.grad for p in pb])
        _unscale_clip(masters, inv)
        opt_b.step()
        torch._foreach_copy_([p.data for p in pb], [m.data for m in masters])

    pc = [torch.nn.Parameter(w.to(torch.bfloat16)) for w in init]  # (c) mpkern
    for p, x in zip(pc, grads16):
        p.grad = x.clone()
    opt_c = mpkern.FusedAdamWMP(pc, lr=lr)

    def fused() -> None:
        mpkern.unscale_(opt_c, inv, max_norm=ADAMW_MAX_NORM)  # deferred into the step: grads are only read
        opt_c.step()

    recipe_b()
    fused()
    worst = max((a.float() - b.float()).abs().max().item() for a, b in zip(pb, pc))
    log(f"adamw: after one step, max |param (b) - param (c)| = {worst:.3g} (bf16 params, lr {lr})")
    t_a = time_fn(recipe_a, dev, reps=reps, setup=restore_a)
    t_b = time_fn(recipe_b, dev, reps=reps)  # reads the bf16 grads, never writes them
    t_c = time_fn(fused, dev, reps=reps)     # reads the bf16 grads, never writes them
    # the host-side check that re-seeds masters after external writes to the params (issue 7):
    # timed with it off, then on again, so drift between the two timings shows as noise
    opt_c._mpkern_check_writes = False
    t_off = time_fn(fused, dev, reps=reps)
    opt_c._mpkern_check_writes = True
    t_on = time_fn(fused, dev, reps=reps)
    log(f"adamw: external-write check ({tensors} tensors): on {1e3 * t_c:.3f} / {1e3 * t_on:.3f} ms, "
        f"off {1e3 * t_off:.3f} ms -> {1e6 * (min(t_c, t_on) - t_off):+.0f} us per step")
    on_us, off_us = write_check_host_cost(dev, tensors)
    log(f"adamw: external-write check, host cost alone ({tensors} tensors of 64 elements, interleaved): "
        f"on {on_us:.0f} us, off {off_us:.0f} us -> {on_us - off_us:+.1f} us per step")
    tr = bytemodel.STEP_TRAFFIC
    bwi = bw["inplace_GBps"]
    return [
        _row("adamw", f"mpkern unscale_ + FusedAdamWMP ({mpkern._backend.select(dev)})", t_c, bpp=tr["mpkern"],
             params=params, bw=bwi),
        _row("adamw", "torch AMP recipe, fp32 params (unscale + clip + fused AdamW)", t_a, bpp=tr["amp_fp32"],
             params=params, bw=bwi, peer_ratio=t_a / t_c, limit=bytemodel.limit(tr["amp_fp32"], tr["mpkern"])),
        _row("adamw", "torch bf16 params + hand-kept fp32 masters", t_b, bpp=tr["bf16_masters"], params=params,
             bw=bwi, peer_ratio=t_b / t_c, limit=bytemodel.limit(tr["bf16_masters"], tr["mpkern"])),
        _row("adamw", "mpkern, external-write check off (its cost: the difference)", t_off, bpp=tr["mpkern"],
             params=params, bw=bwi),
    ]


def write_check_host_cost(device: torch.device, tensors: int = 200, rounds: int = 40,
                          steps: int = 20) -> tuple[float, float]:
    """Median step time (us) of FusedAdamWMP on ``tensors`` tiny bf16 params with the external-write
    check on and off, interleaved ``rounds`` times -- the step is host-bound there, so the
    difference is the check's host cost."""
    import mpkern

    g = torch.Generator().manual_seed(3)
    ps = [torch.nn.Parameter(torch.randn(64, generator=g).to(torch.bfloat16).to(device)) for _ in range(tensors)]
    for p in ps:
        p.grad = torch.randn(64, generator=g).to(torch.bfloat16).to(device)
    opt = mpkern.FusedAdamWMP(ps, lr=1e-3)
    for _ in range(3):
        opt.step()
    res: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for check in (True, False):
            opt._mpkern_check_writes = check
            sync(device)
            t = time.perf_counter()
            for _ in range(steps):
                opt.step()
            sync(device)
            res[check].append((time.perf_counter() - t) / steps * 1e6)
    return statistics.median(res[True]), statistics.median(res[False])


# ---- AdamW: the compact optimizer-state modes, torchao, host time per tensor (issue 15) ---------
#: ``master_weights=`` / ``state_dtype=`` values -> the words of the tables
MASTER_LABELS: dict[Any, str] = {True: "fp32 master", "remainder": "remainder", "8bit": "8-bit master",
                                 False: "no master (SR params)"}
MOMENT_LABELS = {"float32": "fp32 moments", "bfloat16": "bf16 moments", "8bit": "8-bit moments"}
#: the headline modes of issue 15 (``adamw_modes("default")``); those whose moment kind this
#: build lacks (``"8bit"`` before it lands in ``mpkern.optim.storage.MOMENT_KINDS``) are left out
DEFAULT_ADAMW_MODES: tuple[tuple[Any, str], ...] = (
    (True, "float32"), ("remainder", "bfloat16"), ("8bit", "bfloat16"), ("8bit", "8bit"), ("remainder", "8bit"))
BASELINE = "torch AMP recipe, fp32 params"
_MASTER_NAMES = {"true": True, "fp32": True, "remainder": "remainder", "8bit": "8bit", "false": False,
                 "none": False}
_MOMENT_NAMES = {"fp32": "float32", "bf16": "bfloat16"}


def adamw_modes(which: str | None = "default") -> list[tuple[Any, str]]:
    """The ``(master_weights, state_dtype)`` pairs the compact-mode rows run: ``"default"``
    (:data:`DEFAULT_ADAMW_MODES`), ``"all"`` (every master kind x every moment kind of this build),
    ``"none"``, or a comma list of ``master:moments`` (master ``true``/``fp32``, ``remainder``,
    ``8bit``, ``false``/``none``; moments ``float32``/``fp32``, ``bfloat16``/``bf16``, ``8bit``)."""
    from .optim import storage

    moments = storage.MOMENT_KINDS
    if which in (None, "none", ""):
        return []
    if which == "default":
        return [m for m in DEFAULT_ADAMW_MODES if m[1] in moments]
    if which == "all":
        return [(mw, sd) for mw in storage.MASTER_KINDS for sd in moments]
    out = []
    for item in which.split(","):
        mw, _, sd = item.strip().partition(":")
        sd = _MOMENT_NAMES.get(sd.lower(), sd.lower())
        if mw.lower() not in _MASTER_NAMES or sd not in moments:
            raise ValueError(f"adamw mode {item!r}: want master:moments with master in {sorted(_MASTER_NAMES)} and "
                             f"moments in {sorted(moments) + sorted(_MOMENT_NAMES)}, or 'default', 'all', 'none'")
        out.append((_MASTER_NAMES[mw.lower()], sd))
    return out


def mode_label(master_weights: Any, state_dtype: str) -> str:
    """``"remainder + bf16 moments"`` for ``("remainder", "bfloat16")``."""
    return f"{MASTER_LABELS[master_weights]} + {MOMENT_LABELS.get(state_dtype, state_dtype + ' moments')}"


def step_bytes_per_param(master_weights: Any, state_dtype: Any, param_dtype: torch.dtype = torch.bfloat16,
                         grad_dtype: torch.dtype = torch.bfloat16, *, clip: bool = True,
                         amsgrad: bool = False) -> float:
    """Bytes one loss-scaled, clipped ``FusedAdamWMP`` step moves per param in a storage mode.

    :mod:`mpkern.bytemodel` has this only for the fp32 mode (``STEP_TRAFFIC["mpkern"]``, 30), so it
    is computed here -- in this one helper -- from the storage descriptions
    (:func:`mpkern.optim.storage.state_bytes_per_param`, the bytes the optimizer allocates) and the
    param/grad sizes: the read-only clip/unscale pre-pass reads the grad (``clip``), then the fused
    step reads the grad, reads and writes all of the state, writes the param, and reads the param
    too unless an fp32 master holds the whole value (remainder, 8-bit correction and no-master
    modes rebuild the value from the param). fp32 + fp32 gives 30 = ``STEP_TRAFFIC["mpkern"]``;
    8-bit master + 8-bit moments 2 x 7.125 = 14.25 (DESIGN.md).
    """
    from .optim import storage

    kind = storage.master_kind(master_weights, param_dtype)
    state = storage.state_bytes_per_param(master_weights, state_dtype, param_dtype, amsgrad=amsgrad)
    p, g = param_dtype.itemsize, grad_dtype.itemsize
    param_rw = p if kind.mode == storage.FP32.mode else 2 * p
    return (g if clip else 0) + g + param_rw + 2 * state


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


def bench_adamw_modes(device: torch.device | str, *, params: int = FULL["params"], tensors: int = FULL["tensors"],
                      reps: int = 10, modes: str | list[tuple[Any, str]] = "default",
                      bandwidth: dict[str, float] | None = None, baseline_s: float | None = None,
                      log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """``mpkern.unscale_`` + ``FusedAdamWMP.step`` on bf16 params in each compact storage mode
    (:func:`adamw_modes`), the same problem as :func:`bench_adamw`.

    Each row: time, the bytes the step moves (:func:`step_bytes_per_param`), GB/s and its share of
    the measured in-place bandwidth (read + write, like the step; the bound the other AdamW rows use), the resident optimizer-state bytes/param (the storage
    descriptions; the tensors' own count is ``state_bytes_measured``), and the speed ratio over
    the baseline (:func:`amp_fp32_recipe`, timed here unless ``baseline_s`` is given) beside its
    byte-model limit 48 / bytes moved. ``master_weights=False`` runs with ``stochastic_rounding=True``
    (the only way a bf16 param without a master keeps small updates). As in :func:`bench_adamw`
    the grads are only read (the unscale is deferred into the step), so nothing is restored.
    """
    import mpkern

    from .optim import storage

    dev = torch.device(device)
    modes = adamw_modes(modes) if isinstance(modes, str) else list(modes)
    if not modes:
        return []
    bw = bandwidth or measure_bandwidth(dev)
    inplace_bw = bw.get("inplace_GBps")  # the step updates its state in place, like the baseline's rows
    grads16, init = _adamw_problem(dev, tensor_sizes(params, tensors))
    inv = torch.tensor(ADAMW_INV_SCALE, device=dev)
    base_bpp = bytemodel.STEP_TRAFFIC["amp_fp32"]
    if baseline_s is None:
        step_a, restore_a, _ = amp_fp32_recipe(init, grads16, inv)
        baseline_s = time_fn(step_a, dev, reps=reps, setup=restore_a)
        del step_a, restore_a
    rows = []
    for mw, sd in modes:
        ps = [torch.nn.Parameter(w.to(torch.bfloat16)) for w in init]
        for p, x in zip(ps, grads16):
            p.grad = x
        opt = mpkern.FusedAdamWMP(ps, lr=ADAMW_LR, master_weights=mw, state_dtype=sd, stochastic_rounding=mw is False)

        def fused(opt: torch.optim.Optimizer = opt) -> None:
            mpkern.unscale_(opt, inv, max_norm=ADAMW_MAX_NORM)  # deferred into the step: grads are only read
            opt.step()

        bpp = step_bytes_per_param(mw, sd)
        state_model = storage.state_bytes_per_param(mw, sd, torch.bfloat16)
        label = mode_label(mw, sd)
        try:
            t = time_fn(fused, dev, reps=reps)
        except Exception as e:  # noqa: BLE001 -- e.g. a Python storage kind ahead of the built kernels
            why = _failure(e)
            log(f"adamw {label}: {why}")
            rows.append(_row("adamw", f"FusedAdamWMP {label}: {why}", None, bpp=bpp, state_bpp=state_model, note=why)
                        | {"master_weights": mw, "state_dtype": sd})
            del opt, ps, fused
            continue
        row = _row("adamw", f"FusedAdamWMP {label} ({mpkern._backend.select(dev)})", t, bpp=bpp, params=params,
                   bw=inplace_bw, peer_ratio=baseline_s / t,
                   limit=bytemodel.limit(base_bpp, bpp), state_bpp=state_model, vs=BASELINE)
        row.update(master_weights=mw, state_dtype=sd, state_bytes_measured=state_nbytes(opt) / params)
        rows.append(row)
        log(f"adamw {label}: {t * 1e3:.2f} ms, {bpp:g} B/param moved, state {state_model:g} B/param, "
            f"{baseline_s / t:.2f}x the AMP fp32 recipe (limit {base_bpp / bpp:.2f}x)")
        del opt, ps, fused
    return rows


def _failure(e: BaseException) -> str:
    """A row's one-line reason for a benchmark that raised."""
    first = str(e).strip().splitlines()[0][:100] if str(e).strip() else ""
    return f"failed: {type(e).__name__}: {first}"


# ---- torchao, side by side ----------------------------------------------------------------------
#: (label, torchao class name, param dtype, constructor kwargs) of the torchao rows
TORCHAO_CASES: tuple[tuple[str, str, torch.dtype, dict[str, Any]], ...] = (
    ("AdamW8bit, fp32 params", "AdamW8bit", torch.float32, {}),
    ("AdamW8bit, bf16 params (bf16_stochastic_round)", "AdamW8bit", torch.bfloat16, {"bf16_stochastic_round": True}),
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
        except Exception:  # noqa: BLE001, S112
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
        return [_row("adamw", f"torchao {label}: {why}", None, note=why) for label, *_ in cases]
    sizes = _torchao_sizes(params, tensors)
    n = sum(sizes)
    grads16, init = _adamw_problem(dev, sizes, seed=2)
    inv = torch.tensor(ADAMW_INV_SCALE, device=dev)
    rows = []
    for label, cls_name, dt, kw in cases:
        cls = getattr(mod, cls_name, None)
        api = f"{mod.__name__}.{cls_name}"
        if cls is None:
            why = f"torchao {version} has no {cls_name}"
            rows.append(_row("adamw", f"torchao {label}: {why}", None, note=why))
            continue
        ps = [torch.nn.Parameter(w.to(dt)) for w in init]
        gs = [x.to(dt) for x in grads16]
        for p, x in zip(ps, gs):
            p.grad = x.clone()
        opt = cls(ps, lr=ADAMW_LR, **kw)

        def restore(ps: list[Tensor] = ps, gs: list[Tensor] = gs) -> None:
            torch._foreach_copy_([p.grad for p in ps], gs)

        def step(ps: list[Tensor] = ps, opt: torch.optim.Optimizer = opt) -> None:
            _unscale_clip(ps, inv)
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
            why = _failure(e)
            log(f"torchao {label}: {why}")
            rows.append(_row("adamw", f"torchao {label}: {why}", None, note=why))
            continue
        state = state_nbytes(opt) / n
        ratio = None
        if baseline_s is not None:
            ratio = (baseline_s / (baseline_params or n)) / (t / n)
        row = _row("adamw", f"torchao {label} (torchao {version})", t, params=n, peer_ratio=ratio, state_bpp=state,
                   vs=None if ratio is None else BASELINE, note="per-param time ratio" if n != baseline_params else None)
        row.update(api=api, kwargs={k: v for k, v in kw.items()}, params=n, first_step_s=first,
                   torchao_version=version)
        rows.append(row)
        log(f"torchao {label}: {t * 1e3:.2f} ms ({n / 1e6:g}M params; first step incl. compile {first:.1f} s), "
            f"state {state:.3f} B/param")
        del opt, ps, gs, step, restore
    return rows


# ---- host time per tensor -------------------------------------------------------------------------
def _best(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """Fastest of ``reps`` calls, seconds (host-bound timings: the minimum is the figure)."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def host_time(device: torch.device | str = "cpu", *, tensors: int = 1000, numel: int = 256, reps: int = 30,
              clip: bool = True, modes: str | list[tuple[Any, str]] = "default",
              breakdown: bool = False) -> dict[str, Any]:
    """Host time of one optimizer step on ``tensors`` tiny bf16 tensors (host-bound: Python,
    dispatch and per-tensor setup, not memory traffic), fastest of ``reps``, in seconds.

    Returns ``{"tensors", "numel", "clip", "mpkern": {mode label: s (or why it failed)}, "torch": s, "breakdown"}``:
    ``FusedAdamWMP.step`` (clipping fused via ``max_grad_norm``) in each mode of :func:`adamw_modes`,
    torch's fused AdamW + foreach ``clip_grad_norm_`` on fp32 copies, and with ``breakdown`` the
    parts of the first mode's full-path step (collect, prepare, kernel call incl. the dispatcher's
    list unpacking; read through the optimizer's private helpers, so ``{"error": ...}`` when they
    change). ``full_path``: (label, s) of the first mode with the step cache off -- what a first
    step, or one after an external write, costs; the cached steps are the ``mpkern`` entries.
    """
    import mpkern

    dev = torch.device(device)
    modes = adamw_modes(modes) if isinstance(modes, str) else list(modes)
    max_norm = ADAMW_MAX_NORM if clip else None
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(numel, generator=g).to(torch.bfloat16).to(dev) for _ in range(tensors)]
    grads = [torch.randn(numel, generator=g).to(torch.bfloat16).to(dev) for _ in range(tensors)]
    out: dict[str, Any] = {"tensors": tensors, "numel": numel, "clip": clip, "mpkern": {}, "breakdown": None}
    first = None
    for mw, sd in modes:
        ps = [torch.nn.Parameter(x.clone()) for x in base]
        for p, x in zip(ps, grads):
            p.grad = x
        opt = mpkern.FusedAdamWMP(ps, lr=1e-3, max_grad_norm=max_norm, master_weights=mw, state_dtype=sd,
                                  stochastic_rounding=mw is False)
        try:
            for _ in range(3):
                opt.step()
            sync(dev)
            out["mpkern"][mode_label(mw, sd)] = _best(opt.step, reps, dev)
        except Exception as e:  # noqa: BLE001 -- as in bench_adamw_modes
            out["mpkern"][mode_label(mw, sd)] = _failure(e)
            continue
        if first is None:
            first = opt
            # the full path (first step, or after a write): the step cache switched off
            opt._mpkern_step_cache = False
            out["full_path"] = (mode_label(mw, sd), _best(opt.step, reps, dev))
            opt._mpkern_step_cache = True
    ref_ps = [torch.nn.Parameter(x.float()) for x in base]
    for q, x in zip(ref_ps, grads):
        q.grad = x.float()
    fused_kw = {"fused": True} if dev.type in ("cuda", "cpu") else {}
    ref = torch.optim.AdamW(ref_ps, lr=1e-3, **fused_kw)

    def torch_step() -> None:
        if clip:
            torch.nn.utils.clip_grad_norm_(ref_ps, ADAMW_MAX_NORM, foreach=True)
        ref.step()

    torch_step()
    out["torch"] = _best(torch_step, reps, dev)
    if breakdown and first is not None:
        out["breakdown"] = _host_breakdown(first, reps, dev)
    return out


def _host_breakdown(opt: Any, reps: int, dev: torch.device) -> dict[str, Any]:
    """Seconds of the parts of ``opt.step()`` (first bucket), through the optimizer's private helpers."""
    try:
        from .optim.functional import fused_adamw_mp

        work, _ = opt._collect()
        group, _dev, kind, pairs = work[0]
        lists, _ = opt._prepare(group, kind, pairs, True)
        *tensors, sids, offs, scales = lists
        one, zero = torch.ones((), device=dev), torch.zeros((), device=dev)
        return {"collect": _best(opt._collect, reps, dev),
                "prepare": _best(lambda: opt._prepare(group, kind, pairs, True), reps, dev),
                "kernel call": _best(lambda: fused_adamw_mp(dev.type, *tensors, one, zero, None, 1e-3, group,
                                                            kind.mode, sids, offs, *(scales or ())), reps, dev)}
    except Exception as e:  # noqa: BLE001 -- private API of mpkern.optim, changed by its authors
        return {"error": f"{type(e).__name__}: {e}"}


def bench_host_time(device: torch.device | str = "cpu", *, tensors: int = 1000, numel: int = 256, reps: int = 30,
                    modes: str | list[tuple[Any, str]] = "default",
                    log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """:func:`host_time` (clip on) as table rows: ``rate`` is us per tensor; each mpkern row carries
    its speed over torch's fused AdamW + foreach clip (no byte-model limit: the step is host-bound)."""
    res = host_time(device, tensors=tensors, numel=numel, reps=reps, clip=True, modes=modes)
    what = f"{tensors} bf16 x {numel}, clip on"
    peer = "torch fused AdamW + foreach clip_grad_norm_ (fp32 copies)"
    t_ref = res["torch"]
    rows = []
    for label, t in res["mpkern"].items():
        if isinstance(t, str):  # the mode failed: why
            rows.append(_row("adamw", f"host time: FusedAdamWMP {label}: {t}", None, note=t))
            continue
        rows.append(_host_row(f"host time: FusedAdamWMP {label} ({what})", t, tensors, t_ref / t, peer))
    rows.append(_host_row(f"host time: {peer} ({what})", t_ref, tensors))
    log("adamw host time: " + ", ".join(f"{k} {v / tensors * 1e6:.2f} us" if not isinstance(v, str) else f"{k} {v}"
                                        for k, v in res["mpkern"].items())
        + f"; torch {t_ref / tensors * 1e6:.2f} us per tensor")
    return rows


def _host_row(method: str, t: float, tensors: int, ratio: float | None = None, vs: str | None = None) -> dict[str, Any]:
    r = _row("adamw", method, t, peer_ratio=ratio, vs=vs, note="host-bound: no byte-model limit" if vs else None)
    r.update(unit="us/tensor", rate=t / tensors * 1e6, tensors=tensors)
    return r


# ---- matmul -------------------------------------------------------------------------------------
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
GPU_SQUARE = [(4096, 4096, 4096), (8192, 8192, 8192)]
GPU_LLM = (16384, 4096, 11008)  # M, K, N
CPU_SHAPES = {"quick": (1024, 512, 1024), "full": (2048, 1024, 2048)}  # M, K, N


def _has_mm_out_dtype(device: torch.device) -> bool:
    try:
        a = torch.ones(16, 16, dtype=torch.bfloat16, device=device)
        torch.mm(a, a, out_dtype=torch.float32)
        return True
    except Exception:  # noqa: BLE001 -- older torch: no out_dtype
        return False


def wgrad_accumulate_peer(device: torch.device | str) -> tuple[str, Callable[[Tensor, Tensor, Tensor], Tensor]]:
    """``(name, fn)``: what a PyTorch user runs for ``main_grad += a @ b`` with 16-bit ``a``, ``b`` and
    an fp32 ``main_grad`` -- fp32 accumulation throughout, the product never rounded to 16 bits:

    * ``torch.addmm(mg, a, b, out_dtype=fp32, out=mg)``: one GEMM with an fp32 C and beta 1 (what
      Megatron's fused wgrad kernel does), where this torch has it on ``device``;
    * else ``mg.add_(torch.mm(a, b, out_dtype=fp32))`` (an fp32 product, then an add pass);
    * else ``mg.addmm_(a.float(), b.float())`` (upcast copies, an fp32 GEMM; older torch, CPU).
    """
    dev = torch.device(device)

    def fused(a, b, mg):
        return torch.addmm(mg, a, b, out_dtype=torch.float32, out=mg)

    def two_pass(a, b, mg):
        return mg.add_(torch.mm(a, b, out_dtype=torch.float32))

    def upcast(a, b, mg):
        return mg.addmm_(a.float(), b.float())

    g = torch.Generator().manual_seed(0)
    a = torch.randn(16, 16, generator=g).to(torch.bfloat16).to(dev)
    b = torch.randn(16, 16, generator=g).to(torch.bfloat16).to(dev)
    want = a.double() @ b.double() + 1.0
    for name, fn in (("torch.addmm(out_dtype=fp32, out=main_grad)", fused),
                     ("torch.mm(out_dtype=fp32) + main_grad.add_", two_pass)):
        try:
            got = fn(a, b, torch.ones(16, 16, device=dev)).double()
        except (RuntimeError, NotImplementedError, TypeError):  # this torch or device lacks it
            continue
        if torch.allclose(got, want, rtol=1e-5, atol=1e-5):
            return name, fn
    return "main_grad.addmm_(a.float(), b.float())", upcast


def _gpu_problems(quick: bool) -> list[tuple[str, int, int, int, Callable]]:
    """(name, M, N, K, make(dtype, device) -> (a, b)) in nn.Linear's layouts."""
    out = []
    for m, n, k in GPU_SQUARE[:1] if quick else GPU_SQUARE:
        out.append((f"square {m}^3", m, n, k,
                    lambda dt, dev, m=m, n=n, k=k: (torch.randn(m, k, device=dev, dtype=dt),
                                                    torch.randn(k, n, device=dev, dtype=dt))))
    big_m, k_, n_ = GPU_LLM
    m_ = 4096 if quick else big_m
    out.append((f"fwd {m_}x{k_}x{n_}", m_, n_, k_,
                lambda dt, dev: (torch.randn(m_, k_, device=dev, dtype=dt),
                                 torch.randn(n_, k_, device=dev, dtype=dt).t())))
    out.append((f"dgrad {m_}x{n_}x{k_}", m_, k_, n_,
                lambda dt, dev: (torch.randn(m_, n_, device=dev, dtype=dt), torch.randn(n_, k_, device=dev, dtype=dt))))
    out.append((f"wgrad {n_}x{k_} (red. {m_})", n_, k_, m_,
                lambda dt, dev: (torch.randn(m_, n_, device=dev, dtype=dt).t(),
                                 torch.randn(m_, k_, device=dev, dtype=dt))))
    return out


def bench_matmul(device: torch.device | str, *, quick: bool = False, dtypes: str = "bf16,fp16", reps: int = 20,
                 log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """``mpkern.matmul`` vs ``torch`` in TFLOP/s, 16-bit and fp32 outputs (and ``+= main_grad`` on CUDA)."""
    import mpkern

    from .matmul import backend_for, matmul_accumulate_

    dev = torch.device(device)
    rows: list[dict[str, Any]] = []
    mm_out = _has_mm_out_dtype(dev)
    if dev.type == "cuda":
        problems = _gpu_problems(quick)
    else:
        m, k, n = CPU_SHAPES["quick" if quick else "full"]
        problems = [(f"fwd {m}x{k}x{n}", m, n, k,
                     lambda dt, d: (torch.randn(m, k, device=d, dtype=dt), torch.randn(n, k, device=d, dtype=dt).t()))]
        reps = min(reps, 5 if quick else 10)
    ours_name = f"mpkern.matmul ({backend_for(dev)})"
    for dname in dtypes.split(","):
        if dname not in DTYPES:
            raise ValueError(f"dtypes: {dname!r} is not one of {list(DTYPES)}")
        dt = DTYPES[dname]
        for name, m, n, k, make in problems:
            a, b = make(dt, dev)
            a = a * 0.1
            flops = 2.0 * m * n * k
            for out_name, od in ((dname, dt), ("fp32", torch.float32)):
                t_ours = time_fn(partial(mpkern.matmul, a, b, out_dtype=od), dev, reps=reps, warmup=2)
                if od == dt:
                    peer, fn = "torch.matmul", partial(torch.matmul, a, b)
                elif mm_out:
                    peer, fn = "torch.mm(out_dtype=fp32)", partial(torch.mm, a, b, out_dtype=torch.float32)
                else:
                    peer, fn = "torch.matmul + .float()", (lambda a=a, b=b: torch.matmul(a, b).float())
                t_ref = time_fn(fn, dev, reps=reps, warmup=2)
                label = f"{name} {dname}->{out_name}"
                ref_rate = flops / t_ref / 1e12
                rows.append(_row("matmul", f"{ours_name}: {label}", t_ours, flops=flops, bound=ref_rate))
                rows.append(_row("matmul", f"{peer}: {label}", t_ref, flops=flops, bound=ref_rate,
                                 peer_ratio=t_ref / t_ours))
                log(f"matmul {label}: mpkern {flops / t_ours / 1e12:.3f} TFLOP/s, {peer} {ref_rate:.3f} TFLOP/s")
            if dev.type == "cuda" and name.startswith("wgrad"):
                mg = torch.zeros(m, n, device=dev, dtype=torch.float32)
                t_ours = time_fn(partial(matmul_accumulate_, a, b, mg), dev, reps=reps)
                peer, fn = wgrad_accumulate_peer(dev)
                t_ref = time_fn(partial(fn, a, b, mg), dev, reps=reps)
                ref_rate = flops / t_ref / 1e12
                rows.append(_row("matmul", f"{ours_name}: {name} +=main_grad {dname}", t_ours, flops=flops,
                                 bound=ref_rate))
                rows.append(_row("matmul", f"{peer}: {name} {dname}", t_ref, flops=flops,
                                 bound=ref_rate, peer_ratio=t_ref / t_ours))
            del a, b
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def check_matmul_interpreter(dtypes: str = "bf16,fp16", log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """CPU: the Triton GEMM under ``TRITON_INTERPRET=1`` on small shapes in the benchmark's layouts,
    against float64 (16-bit outputs within 2x PyTorch's own same-dtype error; fp32 within 1e-5)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from mpkern.triton_kernels import matmul as tk

    rows = []
    g = torch.Generator().manual_seed(0)
    m, k, n = 96, 64, 80
    cases = {
        "square": lambda dt: (torch.randn(64, 64, generator=g).to(dt), torch.randn(64, 64, generator=g).to(dt)),
        "fwd": lambda dt: (torch.randn(m, k, generator=g).to(dt), torch.randn(n, k, generator=g).to(dt).t()),
        "dgrad": lambda dt: (torch.randn(m, n, generator=g).to(dt), torch.randn(n, k, generator=g).to(dt)),
        "wgrad": lambda dt: (torch.randn(m, n, generator=g).to(dt).t(), torch.randn(m, k, generator=g).to(dt)),
    }
    for dname in dtypes.split(","):
        dt = DTYPES[dname]
        for name, make in cases.items():
            a, b = make(dt)
            ref = a.double() @ b.double()
            mag = a.double().abs() @ b.double().abs()
            for out_name, od in ((dname, dt), ("fp32", torch.float32)):
                y = tk.matmul(a, b, out_dtype=od)
                err = ((y.double() - ref).abs() / mag).max().item()
                terr = (((a @ b).double() - ref).abs() / mag).max().item()
                ok = err <= (1e-5 if od == torch.float32 else 2 * terr + 1e-6)
                rows.append({"problem": f"{name} {tuple(a.shape)}@{tuple(b.shape)}", "dtype": dname, "out": out_name,
                             "max_rel_err": err, "torch_same_dtype_rel_err": terr, "ok": ok})
                log(f"{rows[-1]['problem']:<28} {dname} -> {out_name:<5} rel err {err:.2e} "
                    f"(torch {dname}: {terr:.2e})  {'ok' if ok else 'FAIL'}")
            if name == "wgrad":
                c = torch.randn(a.shape[0], b.shape[1], generator=g)
                want = c.double() + ref
                tk.matmul_into(a, b, c, accumulate=True)
                err = ((c.double() - want).abs() / (mag + 1)).max().item()
                rows.append({"problem": "wgrad +=main_grad", "dtype": dname, "out": "fp32 acc", "max_rel_err": err,
                             "torch_same_dtype_rel_err": float("nan"), "ok": err <= 1e-5})
                verdict = "ok" if err <= 1e-5 else "FAIL"
                log(f"{'wgrad +=main_grad':<28} {dname} -> fp32 acc rel err {err:.2e}  {verdict}")
    return rows


# ---- all together -------------------------------------------------------------------------------
def run(which: str = "all", *, device: str | torch.device | None = None, quick: bool = False,
        params: int | None = None, tensors: int | None = None, reps: int | None = None,
        modes: str = "default", torchao: bool = True, torchao_params: int | None = None,
        host: bool = True, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run benchmark ``which`` (``unscale``, ``adamw``, ``matmul`` or ``all``); return ``{"meta", "rows"}``.

    Sizes (``params``/``tensors``/``reps`` override those of the optimizer-side benchmarks): full
    32M params in 200 tensors, 15 repetitions (``FULL``); ``quick`` 16M params in 100 tensors, 7
    repetitions (``QUICK``; the AdamW benchmark runs 5 fewer, at least 3, in both). The bandwidth
    probe is 256 MiB in both. matmul: on CPU one shape, 1024x512x1024 (quick, at most 5
    repetitions) or 2048x1024x2048 (at most 10); on CUDA the 4096^3 square (quick; also 8192^3 in
    full) and the LLM-layer forward, input-gradient and weight-gradient GEMMs with 4096 tokens
    (quick) or 16384.

    ``adamw`` also runs, on the same sizes and against the same AMP-recipe baseline:
    :func:`bench_adamw_modes` for ``modes`` (see :func:`adamw_modes`: ``"default"``, ``"all"``,
    ``"none"`` or a ``master:moments`` list); with ``torchao`` :func:`bench_torchao` on
    ``torchao_params`` (default: the same count; "not installed" rows without torchao); with
    ``host`` :func:`bench_host_time` (1000 bf16 tensors of 256 elements, clip on, fastest of 30).
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
        rows += bench_adamw_modes(dev, params=size["params"], tensors=size["tensors"], reps=areps, modes=mode_list,
                                  bandwidth=bw, baseline_s=baseline_s, log=log)
        if torchao:
            rows += bench_torchao(dev, params=min(torchao_params or size["params"], size["params"]),
                                  tensors=size["tensors"], reps=areps, baseline_s=baseline_s,
                                  baseline_params=size["params"], log=log)
        if host:
            rows += bench_host_time(dev, log=log)
    if "matmul" in kernels:
        rows += bench_matmul(dev, quick=quick, log=log)
    meta["seconds"] = time.perf_counter() - t0
    return {"meta": meta, "rows": rows}


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table. A peer's row carries mpkern's speedup over it and the limit; a row
    with ``vs`` carries its own speed over that row (``1.85x vs <vs>``). "state B/param": resident
    optimizer state (masters + moments) per param, where the row has it."""
    state = any(r.get("state_bytes_per_param") is not None for r in rows)
    cols = ["kernel", "method", "ms", "B/param", *(["state B/param"] if state else []), "rate", "% of bound",
            "mpkern speedup", "byte-model limit"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lim = r["byte_model_limit"]
        if lim is not None:
            lim_s = f"{lim:.2f}x"
        elif r["mpkern_speedup"] is not None:
            lim_s = r.get("note") or "n/a (compute-bound)"
        else:
            lim_s = ""
        x = r["mpkern_speedup"]
        speed = "" if x is None else f"{x:.2f}x" if x >= 0.1 else f"{x:.2g}x"
        if speed and r.get("vs"):
            speed += f" vs {r['vs']}"
        cells = [r["kernel"], r["method"], "" if r["ms"] is None else f"{r['ms']:.3g}",
                 "" if r["bytes_per_param"] is None else f"{r['bytes_per_param']:g}"]
        if state:
            sb = r.get("state_bytes_per_param")
            cells.append("" if sb is None else f"{sb:.4g}")
        cells += ["" if r["rate"] is None else f"{r['rate']:.3g} {r['unit']}",
                  "" if r["pct_of_bound"] is None else f"{r['pct_of_bound']:.0f} % of {r['bound']}", speed, lim_s]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> bool:
    """Bars of mpkern's speedup over each peer beside the byte-model limit. False without matplotlib."""
    plt = pyplot("bench", "plot")
    if plt is None:
        return False
    peers = [r for r in result["rows"] if r["mpkern_speedup"] is not None]
    if not peers:
        return False
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(peers)), 4.5))
    xs = list(range(len(peers)))
    w = 0.4
    ax.bar([x - w / 2 for x in xs], [r["mpkern_speedup"] for r in peers], w, label="measured speedup")
    ax.bar([x + w / 2 for x in xs], [r["byte_model_limit"] or 0 for r in peers], w, label="byte-model limit")
    ax.axhline(1.0, color="gray", lw=1, ls=":")
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{r['method'][:38]}\nvs {r['vs'][:30]}" if r.get("vs") else
                        f"{r['kernel']}\nvs {r['method'][:38]}" for r in peers], fontsize=7, rotation=15)
    ax.set_ylabel("peer time / mpkern time (or time of 'vs' / row time)")
    ax.set_title(f"mpkern bench -- {result['meta']['device']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def add_adamw_arguments(ap: Any) -> None:
    """The AdamW benchmark's own options on an ``argparse`` parser (``benchmarks/bench_adamw.py``;
    ``mpkern bench`` can take the same); :func:`adamw_run_kwargs` turns them into :func:`run`'s."""
    ap.add_argument("--modes", default="default", metavar="default|all|none|MASTER:MOMENTS,...",
                    help="FusedAdamWMP storage modes on bf16 params: 'default' (fp32+fp32, remainder+bf16, "
                         "8bit+bf16, and 8bit+8bit, remainder+8bit where 8-bit moments exist), 'all' (every "
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


def script_main(kernel: str, argv: list[str] | None = None, *, out_dir: str | None = None,
                doc: str | None = None) -> int:
    """The command line of ``benchmarks/bench_<kernel>.py``: same code as ``mpkern bench <kernel>``,
    results also written to ``out_dir/<kernel>_<device>.json`` / ``.md`` (and ``.png``)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="small sizes (as mpkern bench --quick)")
    ap.add_argument("--params", type=float, default=None, help=f"total parameters (default {FULL['params']:.0e})")
    ap.add_argument("--tensors", type=int, default=None, help=f"number of tensors (default {FULL['tensors']})")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (median reported)")
    ap.add_argument("--no-plot", action="store_true")
    if kernel in ("adamw", "all"):
        add_adamw_arguments(ap)
    args = ap.parse_args(argv)
    res = run(kernel, device=args.device, quick=args.quick, params=None if args.params is None else int(args.params),
              tensors=args.tensors, reps=args.reps, **adamw_run_kwargs(args))
    md = format_table(res["rows"])
    print(f"\n{res['meta']['device']}, {res['meta']['threads']} threads\n\n{md}")
    ok = True
    if kernel == "matmul" and torch.device(args.device).type == "cpu" and not args.quick:
        checks = check_matmul_interpreter()
        res["interpreter_check"] = checks
        ok = all(c["ok"] for c in checks)
    if out_dir:
        tag = f"{kernel}_{torch.device(args.device).type}"
        write_json(res, os.path.join(out_dir, f"{tag}.json"))
        with open(os.path.join(out_dir, f"{tag}.md"), "w") as f:
            f.write(f"{res['meta']}\n\n{md}\n")
        if not args.no_plot:
            plot(res, os.path.join(out_dir, f"{tag}.png"))
    return 0 if ok else 1
