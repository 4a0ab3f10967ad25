"""Quick timing of the compact AdamW kernel variants (issue 15) on the CPU or a GPU, not a test.

32M bf16 params in 200 tensors, bf16 grads, one fused ``mpkern::adamw_step_`` per step; prints the
fastest and the median step time, the bytes the step moves per param (read + write) and the GB/s
of the fastest, for the default SIMD path (AVX-512 where the CPU has it, else AVX2), and with
``--avx2`` the AVX2 path (``MPKERN_CPU_AVX512=0``), with ``--scalar`` the scalar path. The fastest of several runs
is the figure to read on a shared machine (other work only ever slows a run down).

    python benchmarks/adamw_compact_cpu.py [--numel 33554432] [--tensors 200] [--reps 7] [--avx2] [--scalar]
                                           [--threads N] [--only SUBSTRING] [--interleave]
    python benchmarks/adamw_compact_cpu.py --device cuda     # the CUDA kernels (scripts/gpu_check.sh runs it)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

import mpkern  # noqa: F401 -- registers the ops
from mpkern import _backend, codecs

BF16, F32 = torch.bfloat16, torch.float32
MOM8 = "8-bit"  # int8 exp_avg + uint8 exp_avg_sq codes with bf16 scales per 32 elements
MOM4 = "4-bit m"  # 4-bit exp_avg (uint8, two codes per byte) + uint8 exp_avg_sq codes, bf16 scales per 32

# (name, master_mode, moment dtype, param stochastic rounding, bytes/param moved)
# bytes: grad 2 + param r/w 2+2 + master r/w + moments r/w (the byte model of DESIGN.md)
CASES = [
    ("fp32 master + fp32 moments (mode 1)", 1, F32, False, 2 + 4 + 8 + 16),
    ("fp32 master + bf16 moments SR (mode 1)", 1, BF16, False, 2 + 4 + 8 + 8),
    ("no master, param SR + bf16 moments SR (mode 0)", 0, BF16, True, 2 + 4 + 8),
    ("remainder + bf16 moments SR (mode 2)", 2, BF16, False, 2 + 4 + 4 + 8),
    ("8-bit master + fp32 moments (mode 3)", 3, F32, False, 2 + 4 + 2 + 16),
    ("8-bit master + bf16 moments SR (mode 3)", 3, BF16, False, 2 + 4 + 2 + 8),
    # 8-bit moments: int8 + uint8 codes r/w (4) and two bf16 scales per 32 elements r/w (0.25)
    ("fp32 master + 8-bit moments (mode 1)", 1, MOM8, False, 2 + 4 + 8 + 4.25),
    ("no master, param SR + 8-bit moments (mode 0)", 0, MOM8, True, 2 + 4 + 4.25),
    ("remainder + 8-bit moments (mode 2)", 2, MOM8, False, 2 + 4 + 4 + 4.25),
    ("8-bit master + 8-bit moments (mode 3)", 3, MOM8, False, 2 + 4 + 2 + 4.25),
    # 4-bit exp_avg: codes r/w 0.5 + 0.5, exp_avg_sq 1 + 1, scales 0.25
    ("remainder + 4-bit m moments (mode 2)", 2, MOM4, False, 2 + 4 + 4 + 3.25),
    ("8-bit master + 4-bit m moments (mode 3)", 3, MOM4, False, 2 + 4 + 2 + 3.25),
]


def _setup(params: list[torch.Tensor], grads: list[torch.Tensor], dev: torch.device, mode: int, sdt, sr: bool):
    """The tensors of one case and a closure doing one fused step on them."""
    sizes = [p.numel() for p in params]
    scales = ([], [])
    if sdt in (MOM8, MOM4):
        ms = ([torch.zeros(n, dtype=torch.int8, device=dev) for n in sizes] if sdt == MOM8 else
              [torch.zeros((n + 1) // 2, dtype=torch.uint8, device=dev) for n in sizes])
        vs = [torch.zeros(n, dtype=torch.uint8, device=dev) for n in sizes]
        scales = tuple([torch.zeros((n + 31) // 32, dtype=BF16, device=dev) for n in sizes] for _ in range(2))
    else:
        ms = [torch.zeros(n, dtype=sdt, device=dev) for n in sizes]
        vs = [torch.zeros(n, dtype=sdt, device=dev) for n in sizes]
    masters = {0: [], 1: [p.float() for p in params],
               2: [torch.zeros(n, dtype=torch.int16, device=dev) for n in sizes],
               3: [torch.zeros(n, dtype=torch.int8, device=dev) for n in sizes]}[mode]
    steps = [torch.zeros((), device=dev) for _ in sizes]
    ps = [p.clone() for p in params]
    one, zero = torch.tensor(1.0, device=dev), torch.tensor(0.0, device=dev)
    master_codec = {c.mode: name for name, c in codecs.MASTER_CODECS.items()}[mode]
    moment_codec = {MOM8: "8bit", MOM4: "4bit_m", torch.float32: "float32", BF16: "bfloat16"}[sdt]
    sm, sv = scales if sdt in (MOM8, MOM4) else (None, None)

    def step() -> None:
        torch.ops.mpkern.adamw_step_(ps, grads, ms, vs, [], masters, steps, one, zero, None, sm, sv, lr=1e-3,
                                     beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, maximize=False,
                                     master_codec=master_codec, moment_codec=moment_codec, stochastic_rounding=sr,
                                     seed=1)
    return step


def run(numel: int, tensors: int, reps: int, device: str = "cpu", only: str = "", interleave: bool = False) -> None:
    """Time the CASES (those whose name contains one of the comma-separated strings ``only``).
    ``interleave``: set all of them up first and time them round-robin, the order reversed every
    round, so that a drift of the machine's speed or the position in the run (the later of two runs
    measured ~4 % slower on a busy VM) falls on every case alike; the ratios of the fastest times to
    the first case's are printed."""
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sizes = [numel // tensors] * tensors
    sizes[-1] += numel - sum(sizes)
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=gen).to(BF16).to(dev) for n in sizes]
    grads = [(torch.randn(n, generator=gen) * 1e-2).to(BF16).to(dev) for n in sizes]
    cases = [c for c in CASES if not only or any(o and o in c[0] for o in only.split(","))]

    def timed(step) -> float:
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        return time.perf_counter() - t0

    def report(name: str, nbytes: float, times: list[float]) -> float:
        t, med = min(times), statistics.median(times)
        print(f"{name:50s} {t * 1e3:8.2f} ms (median {med * 1e3:7.2f})  {nbytes:6.2f} B/param  "
              f"{numel * nbytes / t / 1e9:6.1f} GB/s")
        return t

    if not interleave:
        for name, mode, sdt, sr, nbytes in cases:
            step = _setup(params, grads, dev, mode, sdt, sr)
            step()  # the first call warms up (page faults of fresh buffers, the device table)
            report(name, nbytes, [timed(step) for _ in range(reps)])
            del step
        return
    steps = [_setup(params, grads, dev, mode, sdt, sr) for _, mode, sdt, sr, _ in cases]
    for step in steps:
        step()
    times: list[list[float]] = [[] for _ in cases]
    for r in range(reps):
        order = range(len(cases)) if r % 2 == 0 else reversed(range(len(cases)))
        for j in order:
            times[j].append(timed(steps[j]))
    best = [report(name, nbytes, ts) for (name, _, _, _, nbytes), ts in zip(cases, times)]
    for (name, *_), t in zip(cases[1:], best[1:]):
        print(f"  {name} / {cases[0][0]}: {t / best[0]:.3f}x the time (fastest of {reps} interleaved)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=32 * 2**20)
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--scalar", action="store_true", help="also time the scalar (non-SIMD) path")
    ap.add_argument("--avx2", action="store_true", help="also time the AVX2 path where AVX-512 is the default")
    ap.add_argument("--only", default="",
                    help="only the cases whose name contains one of these comma-separated strings")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--interleave", action="store_true",
                    help="time the selected cases round-robin (all set up at once: use --only / a smaller --numel)")
    a = ap.parse_args()
    if a.device.startswith("cuda"):
        print(f"{torch.cuda.get_device_name()}: CUDA kernels")
        run(a.numel, a.tensors, a.reps, a.device, interleave=a.interleave)
        return
    if a.threads:
        torch.set_num_threads(a.threads)
    ext = _backend.native()
    print(f"threads {torch.get_num_threads()}, cpu capability {torch.backends.cpu.get_cpu_capability()}, "
          f"mpkern simd level {ext.cpu_simd_level()}")
    flags = Path("/proc/cpuinfo").read_text() if os.path.exists("/proc/cpuinfo") else ""
    has512 = all(f" {x} " in flags for x in ("avx512f", "avx512bw", "avx512vl", "avx512dq"))
    print("AVX-512 path:" if has512 and os.environ.get("MPKERN_CPU_AVX512", "1") != "0" else "AVX2 path:")
    run(a.numel, a.tensors, a.reps, only=a.only, interleave=a.interleave)
    if a.avx2 and has512:
        old = os.environ.get("MPKERN_CPU_AVX512")
        os.environ["MPKERN_CPU_AVX512"] = "0"  # read by the kernel on every call
        print("AVX2 path:")
        run(a.numel, a.tensors, a.reps, only=a.only, interleave=a.interleave)
        if old is None:
            del os.environ["MPKERN_CPU_AVX512"]
        else:
            os.environ["MPKERN_CPU_AVX512"] = old
    if a.scalar:
        ext.set_cpu_simd(False)
        print("scalar path:")
        run(a.numel, a.tensors, a.reps, only=a.only, interleave=a.interleave)
        ext.set_cpu_simd(True)


if __name__ == "__main__":
    main()
