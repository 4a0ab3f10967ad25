"""What ``mpkern.diagnose`` costs against the runs it compares (issue 31: <= 3x).

Baseline, timed in the same process: one fp32 forward+backward plus one forward+backward in the
recipe (autocast), with the model's own loss -- the two runs a diagnosis needs at the least.
Then ``mpkern.diagnose`` on the same model and inputs. Baseline and diagnosis alternate
(``--repeat`` rounds, warm-up first), so a noisy shared machine affects both alike; the ratio of the
medians is printed beside each round's.

    python benchmarks/doctor_overhead.py                      # GPT-2 small from its config, bf16, 2 x 128
    python benchmarks/doctor_overhead.py --dtype fp16 --seq-len 64 --repeat 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext

import torch

import mpkern
from mpkern.doctor import models


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("gpt2", "bert"), default="gpt2")
    ap.add_argument("--small", action="store_true", help="the 2-layer, 128-wide config instead of the full one")
    ap.add_argument("--dtype", choices=("fp16", "bf16"), default="bf16")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[a.dtype]
    case = models.hf_case(a.model, a.device, full=not a.small, batch=a.batch, seq_len=a.seq_len)
    m, dev = case.model, torch.device(a.device)
    n = sum(p.numel() for p in m.parameters())
    print(f"{case.describe}; {n / 1e6:.1f}M params; {a.dtype} autocast; device {a.device}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def fwd_bwd(ctx) -> None:
        with ctx:
            loss = case.loss_fn(m(**case.inputs))
        loss.float().backward()
        m.zero_grad(set_to_none=True)

    def baseline() -> float:
        sync()
        t = time.perf_counter()
        fwd_bwd(nullcontext())
        fwd_bwd(torch.autocast(dev.type, dtype=dt))
        sync()
        return time.perf_counter() - t

    def diagnosis() -> tuple[float, mpkern.Diagnosis]:
        sync()
        t = time.perf_counter()
        d = mpkern.diagnose(m, case.inputs, dtype=dt, loss_fn=case.loss_fn)
        sync()
        return time.perf_counter() - t, d

    baseline()  # warm-up (allocator, kernels, autocast caches)
    bases, diags = [], []
    for r in range(a.repeat):
        b = baseline()
        s, d = diagnosis()
        bases.append(b)
        diags.append(s)
        print(f"round {r + 1}: fp32 + {a.dtype} fwd+bwd {b:7.2f} s | diagnose {s:7.2f} s | ratio {s / b:.2f}x "
              f"({len(d.layers)} modules, {len(d.findings)} findings)", flush=True)
    bm, dm = statistics.median(bases), statistics.median(diags)
    print(f"median: baseline {bm:.2f} s, diagnose {dm:.2f} s -> {dm / bm:.2f}x (goal <= 3x)")


if __name__ == "__main__":
    main()
