"""Kernel benchmarks, each against the PyTorch peer a user would otherwise run, in the same process.

One implementation behind ``mpkern bench`` and ``benchmarks/bench_*.py`` (thin wrappers):

* :func:`bench_unscale` -- ``mpkern.unscale_`` vs ``_amp_foreach_non_finite_check_and_unscale_`` +
  ``clip_grad_norm_`` on the same bf16 grads.
* :func:`bench_adamw` -- ``mpkern.unscale_`` + ``FusedAdamWMP.step`` vs (a) the AMP recipe on fp32
  params (fused AdamW) and (b) bf16 params with hand-kept fp32 masters.
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

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone
from functools import partial
from typing import Any

import torch

from . import bytemodel

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


def sync(device: torch.device) -> None:
    """Wait for the device (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device: torch.device, *, reps: int = 15, warmup: int = 3,
            setup: Callable[[], object] | None = None) -> float:
    """Median wall time of ``fn()`` in seconds; ``setup()`` runs untimed before each call."""
    for _ in range(warmup):
        if setup:
            setup()
        fn()
    times = []
    for _ in range(reps):
        if setup:
            setup()
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_bandwidth(device: torch.device, nbytes: int = 1 << 28) -> dict[str, float]:
    """Achievable memory bandwidth (GB/s) of an in-place fp32 multiply (read + write) and a copy."""
    n = nbytes // 4
    x = torch.rand(n, device=device)
    y = torch.empty_like(x)
    t_inplace = time_fn(lambda: x.mul_(1.0000001), device, reps=10)
    t_copy = time_fn(lambda: y.copy_(x), device, reps=10)
    return {"inplace_GBps": 2 * nbytes / t_inplace / 1e9, "copy_GBps": 2 * nbytes / t_copy / 1e9}


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device) -> dict[str, Any]:
    """Timestamp, versions and device name for result files."""
    info: dict[str, Any] = {
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        info["device"] = torch.cuda.get_device_name(device)
    else:
        info["device"] = (f"{cpu_name()} {platform.machine()} ({os.cpu_count()} cores, "
                          f"ATen {torch.backends.cpu.get_cpu_capability()})")
    return info


def _row(kernel: str, method: str, t: float, *, bpp: float | None = None, params: int = 0,
         flops: float | None = None, bw: float | None = None, peer_ratio: float | None = None,
         limit: float | None = None, bound: float | None = None) -> dict[str, Any]:
    """One table row. Memory-bound rows: ``bpp`` bytes/param over ``params`` -> GB/s and % of ``bw``.
    Compute rows: ``flops`` -> TFLOP/s and % of ``bound`` (the peer's TFLOP/s)."""
    r: dict[str, Any] = {"kernel": kernel, "method": method, "ms": t * 1e3}
    if flops is not None:
        rate = flops / t / 1e12
        r.update(unit="TFLOP/s", rate=rate, bytes_per_param=None,
                 pct_of_bound=None if bound is None else 100 * rate / bound, bound="peer TFLOP/s")
    else:
        rate = bpp * params / t / 1e9
        r.update(unit="GB/s", rate=rate, bytes_per_param=bpp,
                 pct_of_bound=None if bw is None else 100 * rate / bw, bound="in-place bandwidth")
    r["mpkern_speedup"] = peer_ratio
    r["byte_model_limit"] = limit
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
def bench_adamw(device: torch.device | str, *, params: int = FULL["params"], tensors: int = FULL["tensors"],
                reps: int = 10, bandwidth: dict[str, float] | None = None,
                log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Loss-scaled (1/1024), clipped (1.0) AdamW step: FusedAdamWMP vs the two PyTorch recipes."""
    import mpkern

    dev = torch.device(device)
    bw = bandwidth or measure_bandwidth(dev)
    sizes = tensor_sizes(params, tensors)
    g = torch.Generator().manual_seed(1)
    grads16 = [(torch.randn(n, generator=g) * 64).to(torch.bfloat16).to(dev) for n in sizes]
    init = [(torch.randn(n, generator=g) * 0.02).to(dev) for n in sizes]
    inv = torch.tensor(1.0 / 1024, device=dev)
    lr = 1e-4
    fused_kw = {"fused": True} if dev.type in ("cuda", "cpu") else {}

    pa = [torch.nn.Parameter(w.clone()) for w in init]  # (a) fp32 params and grads
    ga = [x.float() for x in grads16]
    for p, x in zip(pa, ga):
        p.grad = x.clone()
    opt_a = torch.optim.AdamW(pa, lr=lr, **fused_kw)

    def restore_a() -> None:
        torch._foreach_copy_([p.grad for p in pa], ga)

    def recipe_a() -> None:
        found = torch.zeros((), device=dev)
        torch._amp_foreach_non_finite_check_and_unscale_([p.grad for p in pa], found, inv)
        torch.nn.utils.clip_grad_norm_(pa, 1.0, foreach=True)
        opt_a.step()

    pb = [torch.nn.Parameter(w.to(torch.bfloat16)) for w in init]  # (b) bf16 params, fp32 masters by hand
    for p, x in zip(pb, grads16):
        p.grad = x.clone()
    masters = [torch.nn.Parameter(p.detach().float()) for p in pb]
    for m in masters:
        m.grad = torch.empty_like(m)
    opt_b = torch.optim.AdamW(masters, lr=lr, **fused_kw)

    def recipe_b() -> None:
        torch._foreach_copy_([m.grad for m in masters], [p.grad for p in pb])
        found = torch.zeros((), device=dev)
        torch._amp_foreach_non_finite_check_and_unscale_([m.grad for m in masters], found, inv)
        torch.nn.utils.clip_grad_norm_(masters, 1.0, foreach=True)
        opt_b.step()
        torch._foreach_copy_([p.data for p in pb], [m.data for m in masters])

    pc = [torch.nn.Parameter(w.to(torch.bfloat16)) for w in init]  # (c) mpkern
    for p, x in zip(pc, grads16):
        p.grad = x.clone()
    opt_c = mpkern.FusedAdamWMP(pc, lr=lr)

    def fused() -> None:
        mpkern.unscale_(opt_c, inv, max_norm=1.0)  # deferred into the step: grads are only read
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
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run benchmark ``which`` (``unscale``, ``adamw``, ``matmul`` or ``all``); return ``{"meta", "rows"}``.

    Sizes (``params``/``tensors``/``reps`` override those of the optimizer-side benchmarks): full
    32M params in 200 tensors, 15 repetitions (``FULL``); ``quick`` 16M params in 100 tensors, 7
    repetitions (``QUICK``; the AdamW benchmark runs 5 fewer, at least 3, in both). The bandwidth
    probe is 256 MiB in both. matmul: on CPU one shape, 1024x512x1024 (quick, at most 5
    repetitions) or 2048x1024x2048 (at most 10); on CUDA the 4096^3 square (quick; also 8192^3 in
    full) and the LLM-layer forward, input-gradient and weight-gradient GEMMs with 4096 tokens
    (quick) or 16384.
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
    kernels = KERNELS if which == "all" else (which,)
    meta = machine_info(dev) | {"which": which, "quick": quick, **size}
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
        rows += bench_adamw(dev, params=size["params"], tensors=size["tensors"], reps=max(size["reps"] - 5, 3),
                            bandwidth=bw, log=log)
    if "matmul" in kernels:
        rows += bench_matmul(dev, quick=quick, log=log)
    meta["seconds"] = time.perf_counter() - t0
    return {"meta": meta, "rows": rows}


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table; a peer's row carries mpkern's speedup over it and the limit."""
    cols = ["kernel", "method", "ms", "B/param", "rate", "% of bound", "mpkern speedup", "byte-model limit"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lim = r["byte_model_limit"]
        if r["mpkern_speedup"] is not None and lim is None:
            lim_s = "n/a (compute-bound)"
        else:
            lim_s = f"{lim:.2f}x" if lim is not None else ""
        cells = [r["kernel"], r["method"], f"{r['ms']:.3g}",
                 "" if r["bytes_per_param"] is None else f"{r['bytes_per_param']:g}",
                 f"{r['rate']:.3g} {r['unit']}",
                 "" if r["pct_of_bound"] is None else f"{r['pct_of_bound']:.0f} % of {r['bound']}",
                 "" if r["mpkern_speedup"] is None else f"{r['mpkern_speedup']:.2f}x", lim_s]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(result: dict[str, Any], path: str) -> None:
    """Write a :func:`run` result as JSON (creating the directory)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def pyplot(who: str, what: str) -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or None after a one-line notice (``[who] ... no what``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"[{who}] matplotlib is not installed: no {what} (pip install matplotlib)")
        return None
    return plt


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
    ax.set_xticklabels([f"{r['kernel']}\nvs {r['method'][:38]}" for r in peers], fontsize=7, rotation=15)
    ax.set_ylabel("peer time / mpkern time")
    ax.set_title(f"mpkern bench -- {result['meta']['device']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


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
    args = ap.parse_args(argv)
    res = run(kernel, device=args.device, quick=args.quick, params=None if args.params is None else int(args.params),
              tensors=args.tensors, reps=args.reps)
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
