"""``mpkern.matmul`` against ``torch`` in TFLOP/s: on CUDA the Triton GEMM against cuBLAS (square,
LLM-layer forward, input- and weight-gradient GEMMs, ``+= main_grad``); on CPU what mpkern runs
there (ATen in fp32, then a cast) against ATen's own 16-bit GEMM, and the Triton kernel under the
interpreter against float64 (:func:`check_matmul_interpreter`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from ..measure import time_fn
from .common import Tensor, row

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

    from ..matmul import backend_for, matmul_accumulate_

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
                rows.append(row("matmul", f"{ours_name}: {label}", t_ours, flops=flops, bound=ref_rate))
                rows.append(row("matmul", f"{peer}: {label}", t_ref, flops=flops, bound=ref_rate,
                                peer_ratio=t_ref / t_ours))
                log(f"matmul {label}: mpkern {flops / t_ours / 1e12:.3f} TFLOP/s, {peer} {ref_rate:.3f} TFLOP/s")
            if dev.type == "cuda" and name.startswith("wgrad"):
                mg = torch.zeros(m, n, device=dev, dtype=torch.float32)
                t_ours = time_fn(partial(matmul_accumulate_, a, b, mg), dev, reps=reps)
                peer, fn = wgrad_accumulate_peer(dev)
                t_ref = time_fn(partial(fn, a, b, mg), dev, reps=reps)
                ref_rate = flops / t_ref / 1e12
                rows.append(row("matmul", f"{ours_name}: {name} +=main_grad {dname}", t_ours, flops=flops,
                                bound=ref_rate))
                rows.append(row("matmul", f"{peer}: {name} {dname}", t_ref, flops=flops,
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
