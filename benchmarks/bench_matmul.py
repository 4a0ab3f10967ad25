"""Benchmark: the mpkern Triton GEMM (fp32 accumulation) vs torch.matmul (cuBLAS), in one run.

Problems (M tokens, K in-features, N out-features; weight W stored (N, K) like nn.Linear):
    square 4096^3, 8192^3                    Y = A @ B
    LLM    M=16384, K=4096, N=11008:
        fwd    Y  = X @ W^T        (M, K) @ (K, N)
        dgrad  dX = dY @ W         (M, N) @ (N, K)
        wgrad  dW = dY^T @ X       (N, M) @ (M, K)        (transposed A, no copy)
        wgrad+main_grad: main_grad (fp32) += dY^T @ X    mpkern: fused in the epilogue;
                                                         torch: bf16 GEMM + separate fp32 add
Each in bf16 and fp16, with 16-bit output and with fp32 output (torch: ``(a @ b).float()`` is
not the same math -- it rounds to 16 bits first -- so the torch fp32 baseline is
``torch.mm(..., out_dtype=torch.float32)`` where this torch has it, else the 16-bit GEMM plus a
cast, and the table says which). TFLOP/s = 2*M*N*K / time.

On a CPU there is nothing to time: the script runs the kernel (under TRITON_INTERPRET=1) on small
shapes of the same layouts, checks it against float64, and says so.

    python benchmarks/bench_matmul.py [--dtypes bf16,fp16] [--reps 20] [--quick] [--no-plot]

Writes out/matmul_<device>.json / .md and, when matplotlib is installed, out/matmul_<device>.png.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from mpkern.triton_kernels import matmul as tk  # noqa: E402

DT = {"bf16": torch.bfloat16, "fp16": torch.float16}
SQUARE = [(4096, 4096, 4096), (8192, 8192, 8192)]
LLM = (16384, 4096, 11008)  # M, K, N


def _has_mm_out_dtype() -> bool:
    try:
        a = torch.ones(16, 16, dtype=torch.bfloat16, device="cuda" if torch.cuda.is_available() else "cpu")
        torch.mm(a, a, out_dtype=torch.float32)
        return True
    except Exception:  # noqa: BLE001 - older torch: no out_dtype
        return False


def problems(quick: bool):
    """(name, M, N, K, make(dtype, device) -> (a, b))."""
    out = []
    for m, n, k in SQUARE[:1] if quick else SQUARE:
        out.append((f"square {m}^3", m, n, k,
                    lambda dt, dev, m=m, n=n, k=k: (torch.randn(m, k, device=dev, dtype=dt),
                                                    torch.randn(k, n, device=dev, dtype=dt))))
    M, K, N = LLM
    if quick:
        M = 4096
    out.append((f"fwd {M}x{K}x{N}", M, N, K,
                lambda dt, dev: (torch.randn(M, K, device=dev, dtype=dt), torch.randn(N, K, device=dev, dtype=dt).t())))
    out.append((f"dgrad {M}x{N}x{K}", M, K, N,
                lambda dt, dev: (torch.randn(M, N, device=dev, dtype=dt), torch.randn(N, K, device=dev, dtype=dt))))
    out.append((f"wgrad {N}x{K} (red. {M})", N, K, M,
                lambda dt, dev: (torch.randn(M, N, device=dev, dtype=dt).t(), torch.randn(M, K, device=dev, dtype=dt))))
    return out


def bench_gpu(args) -> list[dict]:
    dev = torch.device("cuda")
    mm_out = _has_mm_out_dtype()
    rows = []
    for dname in args.dtypes.split(","):
        dt = DT[dname]
        for name, m, n, k, make in problems(args.quick):
            a, b = make(dt, dev)
            a = a * 0.1
            flops = 2.0 * m * n * k
            for out_name, od in ((dname, dt), ("fp32", torch.float32)):
                out = torch.empty(m, n, device=dev, dtype=od)
                t_ours = common.time_fn(lambda: tk.matmul_into(a, b, out), dev, reps=args.reps)
                if od == dt:
                    t_ref = common.time_fn(lambda: torch.matmul(a, b), dev, reps=args.reps)
                    ref_name = "torch.matmul"
                elif mm_out:
                    t_ref = common.time_fn(lambda: torch.mm(a, b, out_dtype=torch.float32), dev, reps=args.reps)
                    ref_name = "torch.mm(out_dtype=fp32)"
                else:
                    t_ref = common.time_fn(lambda: torch.matmul(a, b).float(), dev, reps=args.reps)
                    ref_name = "torch.matmul + .float()"
                rows.append(_row(name, dname, out_name, flops, t_ours, t_ref, ref_name))
                print(_fmt(rows[-1]), flush=True)
            if name.startswith("wgrad"):
                mg = torch.zeros(m, n, device=dev, dtype=torch.float32)
                t_ours = common.time_fn(lambda: tk.matmul_into(a, b, mg, accumulate=True), dev, reps=args.reps)
                t_ref = common.time_fn(lambda: mg.add_(torch.matmul(a, b)), dev, reps=args.reps)
                rows.append(_row(name + " +=main_grad", dname, "fp32 acc", flops, t_ours, t_ref,
                                 "torch.matmul + main_grad.add_"))
                print(_fmt(rows[-1]), flush=True)
            del a, b
            torch.cuda.empty_cache()
    return rows


def _row(name, dname, out_name, flops, t_ours, t_ref, ref_name) -> dict:
    return {"problem": name, "dtype": dname, "out": out_name,
            "mpkern_TFLOPs": flops / t_ours / 1e12, "torch_TFLOPs": flops / t_ref / 1e12,
            "ratio": t_ref / t_ours, "mpkern_ms": t_ours * 1e3, "torch_ms": t_ref * 1e3, "baseline": ref_name}


def _fmt(r: dict) -> str:
    return (f"{r['problem']:<34} {r['dtype']:>4} -> {r['out']:<8} mpkern {r['mpkern_TFLOPs']:7.1f} TFLOP/s  "
            f"torch {r['torch_TFLOPs']:7.1f} TFLOP/s  ({100 * r['ratio']:.0f}% of {r['baseline']})")


def check_cpu(args) -> list[dict]:
    """Correctness of the kernel (interpreter) on small shapes with the benchmark's layouts."""
    print("CPU: no GPU, so timing has no meaning here; the Triton kernel runs in the interpreter and is only "
          "checked against float64 on small shapes with the same layouts.")
    rows = []
    g = torch.Generator().manual_seed(0)
    M, K, N = 96, 64, 80
    cases = {
        "square": lambda dt: (torch.randn(64, 64, generator=g).to(dt), torch.randn(64, 64, generator=g).to(dt)),
        "fwd": lambda dt: (torch.randn(M, K, generator=g).to(dt), torch.randn(N, K, generator=g).to(dt).t()),
        "dgrad": lambda dt: (torch.randn(M, N, generator=g).to(dt), torch.randn(N, K, generator=g).to(dt)),
        "wgrad": lambda dt: (torch.randn(M, N, generator=g).to(dt).t(), torch.randn(M, K, generator=g).to(dt)),
    }
    for dname in args.dtypes.split(","):
        dt = DT[dname]
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
                print(f"{rows[-1]['problem']:<28} {dname} -> {out_name:<5} rel err {err:.2e} "
                      f"(torch {dname}: {terr:.2e})  {'ok' if ok else 'FAIL'}", flush=True)
            if name == "wgrad":
                c = torch.randn(a.shape[0], b.shape[1], generator=g)
                want = c.double() + ref
                tk.matmul_into(a, b, c, accumulate=True)
                err = ((c.double() - want).abs() / (mag + 1)).max().item()
                rows.append({"problem": "wgrad +=main_grad", "dtype": dname, "out": "fp32 acc", "max_rel_err": err,
                             "torch_same_dtype_rel_err": float("nan"), "ok": err <= 1e-5})
                print(f"{'wgrad +=main_grad':<28} {dname} -> fp32 acc rel err {err:.2e}  "
                      f"{'ok' if err <= 1e-5 else 'FAIL'}", flush=True)
    return rows


def plot(rows: list[dict], path: str, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return False
    labels = [f"{r['problem']}\n{r['dtype']}->{r['out']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, 0.55 * len(rows)), 5))
    w = 0.4
    ax.bar([i - w / 2 for i in x], [r["mpkern_TFLOPs"] for r in rows], w, label="mpkern (Triton)")
    ax.bar([i + w / 2 for i in x], [r["torch_TFLOPs"] for r in rows], w, label="torch (cuBLAS)")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, rotation=70, ha="right", fontsize=7)
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="fewer and smaller problems")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    meta = common.machine_info(dev)
    import triton

    meta["triton"] = triton.__version__
    if cuda:
        rows = bench_gpu(args)
        meta["note"] = "TFLOP/s = 2MNK/time; median of reps after warmup (first call autotunes)"
    else:
        rows = check_cpu(args)
        meta["note"] = "CPU: correctness only (Triton interpreter); timing has no meaning"
    tag = "cuda" if cuda else "cpu"
    print(common.write_results(f"matmul_{tag}", meta, rows))
    if cuda and not args.no_plot:
        path = os.path.join(common.OUT_DIR, f"matmul_{tag}.png")
        if plot(rows, path, f"mpkern matmul vs torch -- {meta['device']}"):
            print(f"plot: {path}")
    return 0 if all(r.get("ok", True) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
