"""The CUDA AdamW step's bandwidth on paper (issue 43 item 3), before any GPU run: how much of the copy
bandwidth a layout can reach with the kernel as launched today, and what bounds it.

Two limits, per layout x storage mode x GPU:

* **Bytes in flight (Little's law)**: to keep an HBM system busy, an SM needs ``BW / SMs x latency``
  bytes of loads outstanding (H100 SXM 3.35 TB/s, H200 4.8 TB/s; ~700 ns loaded latency). The kernel
  keeps, per thread, one vector iteration's loads outstanding (kVE = 8 elements: the bytes a step
  reads per element x 8), times the resident threads (blocks of 256; blocks per SM from the register
  budget ``adam_min_blocks`` asks ptxas for: 4 for the fp32/bf16-moment kernels, 2 for the compact ones).
* **Chunks and waves**: the step is one launch over 65536-element chunks (``multi_tensor.cuh``
  ``kChunk``), a grid of ``min(chunks, 8 x SMs)`` blocks striding over them, of which ``slots`` =
  SMs x blocks-per-SM are resident. Simulated: every active block moves its chunks' bytes at an equal
  share of the bandwidth, capped by what its own bytes in flight sustain (``in flight / latency``);
  a block that ends frees its slot for the next. A layout whose chunk count is a little over the
  slots (today's 200 x 160K: 600 chunks on 528 H100 slots) runs a second, nearly empty wave.

Printed for today's launch and two alternatives the model suggests: 16384-element chunks, and a
balanced persistent grid (every resident block the same share of the elements). Also the clip
pre-pass (``grad_stats``: the grads read once more, its own launch) and the prep launch, as fractions
of the step. Assumptions are printed; what only the GPU run can say (the real latency, whether ptxas
keeps all 8 elements' loads in flight, the copy bandwidth on an H100) is what the sweep stage measures.

    python benchmarks/adamw_gpu_model.py            # the three layouts, both GPUs, every mode
    python benchmarks/adamw_gpu_model.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass

# ---- the GPUs (public specs) and the kernel as built (csrc/cuda/adamw_cuda.cu, multi_tensor.cuh) -----
GPUS = {  # name: (SMs, peak HBM GB/s, measured or assumed copy GB/s, source of the copy figure)
    "H100 SXM 80GB": (132, 3350.0, 0.88 * 3350.0, "assumed 88 % of peak (the H200's measured ratio)"),
    "H200": (132, 4800.0, 4272.0, "measured, first GPU run (1 GiB copy_)"),
}
LATENCY_NS = 700.0          # loaded HBM latency assumed for Little's law (~600-800 ns on Hopper)
BLOCK = 256                 # kAdamBlock
VE = 8                      # kVE: elements per thread-iteration
CHUNK = 1 << 16             # kChunk
GRID_PER_SM = 8             # grid_for(chunks, 8)
PREP_LAUNCH_US = 4.0        # the prep kernel: one launch (~2-3 us) + one block over the tensor table
#: storage mode: (bytes read per element in the update, bytes per param of the whole step, blocks per
#: SM, SASS instructions per element of the main loop or None where not counted, load stages): the compact
#: ones by benchmarks/cuda_sass_count.py --arch sm_90, issue 43 stop 53 (2026-12-07: fmas in the update,
#: word-at-a-time decodes and packing; 87.6 / 87.6 at stop 52 -- the step without the IEEE rare cases,
#: no NaN-master case, one hash first step per lane --, 110.9 / 111.2 at stop 51, 125.2 / 124.9 after
#: codec 2, RESULTS "Codec 2"; codec 1 had 198.5 and 201.1); "2 stages":
#: the loop that copies the next pass's loads into shared memory while the current one updates
#: (AdamConfig::stages 2): twice the bytes in flight per thread, at its own instruction count
MODES = {
    "fp32 master + fp32 moments": (14, 30.0, 4, None, 1),
    "remainder + bf16 moments": (10, 20.0, 4, None, 1),
    "8-bit master + bf16 moments": (7, 18.0, 4, None, 1),
    "8-bit master + 8-bit moments": (4.125, 14.25, 2, 78.4, 1),
    "8-bit master + 4-bit m + 8-bit v": (3.625, 13.25, 2, 78.4, 1),
    "8-bit master + 8-bit moments, 2 stages": (4.125, 14.25, 2, 85.5, 2),
    "8-bit master + 4-bit m + 8-bit v, 2 stages": (3.625, 13.25, 2, 85.5, 2),
}
CLOCK_GHZ = 1.98            # Hopper SXM boost clock
ISSUE_PER_SM_CLK = 4 * 32   # 4 warp schedulers x 32 threads: thread-instructions per SM per clock
#: the first GPU run's measurement (H200, 200 x 160K, % of copy bandwidth; RESULTS "First GPU run")
MEASURED_H200_UNIFORM = {"fp32 master + fp32 moments": 57, "remainder + bf16 moments": 49,
                         "8-bit master + bf16 moments": 41, "8-bit master + 8-bit moments": 23,
                         "8-bit master + 4-bit m + 8-bit v": 21}
GRAD_BYTES = 2  # bf16 grads: what the clip pre-pass reads again


@dataclass
class Row:
    layout: str
    gpu: str
    mode: str
    params: int
    tensors: int
    chunks: int
    grid: int
    slots: int
    waves: float
    need_kb_per_sm: float
    have_kb_per_sm: float
    eff_today: float
    eff_chunk16k: float
    eff_balanced: float
    prepass_frac: float
    prep_frac: float
    pct_of_copy_today: float
    pct_of_copy_best: float
    issue_limit_pct: float | None
    measured_pct: float | None


# ---- layouts ------------------------------------------------------------------------------------------
def layout_uniform() -> list[int]:
    """Today's benchmark: 32M bf16 params in 200 tensors of 160K."""
    return [160_000] * 200


def layout_gpt2() -> list[int]:
    """GPT-2 small as transformers builds it (124M, tied 38.6M embedding, 1-D norms and biases)."""
    d, v, ctx, layers = 768, 50257, 1024, 12
    sizes = [v * d, ctx * d]
    for _ in range(layers):
        sizes += [d, d, d * 3 * d, 3 * d, d * d, d, d, d, d * 4 * d, 4 * d, 4 * d * d, d]
    return sizes + [d, d]


def layout_llama(layers: int = 5) -> list[int]:
    """A Llama-style stack of >= 1B params: per layer q, k, v, o (4096^2), gate, up, down (4096 x
    11008) and two 4096 norms; 5 layers = 1.01B."""
    d, f = 4096, 11008
    sizes: list[int] = []
    for _ in range(layers):
        sizes += [d * d] * 4 + [d * f] * 3 + [d, d]
    return sizes


LAYOUTS = {"200 x 160K": layout_uniform, "GPT-2 small": layout_gpt2, "Llama stack 1.0B": layout_llama}


# ---- the simulation -------------------------------------------------------------------------------------
def chunk_sizes(sizes: list[int], chunk: int) -> list[int]:
    out: list[int] = []
    for n in sizes:
        out += [chunk] * (n // chunk) + ([n % chunk] if n % chunk else [])
    return out


def simulate(work: list[list[float]], slots: int, bw: float, cap: float) -> float:
    """Seconds for blocks with the given per-block chunk bytes (in grid order): ``slots`` run at once,
    each at ``min(cap, bw / active)`` bytes/s; a finished block's slot goes to the next."""
    pending = [sum(w) for w in work]
    t, nxt = 0.0, 0
    active: list[float] = []  # remaining bytes of the resident blocks
    while nxt < len(pending) and len(active) < slots:
        active.append(pending[nxt])
        nxt += 1
    while active:
        rate = min(cap, bw / len(active))
        step = min(active) / rate
        t += step
        active = [a - step * rate for a in active]
        done = sum(1 for a in active if a <= 1e-6)
        active = [a for a in active if a > 1e-6]
        for _ in range(done):
            if nxt < len(pending):
                active.append(pending[nxt])
                nxt += 1
    return t


def efficiency(sizes: list[int], chunk: int | None, bytes_per_elem: float, slots: int, grid_cap: int,
               bw: float, cap: float) -> float:
    """Moved bytes / (time x bw) for one launch: ``chunk`` None = balanced (equal shares per slot)."""
    total = sum(sizes) * bytes_per_elem
    if chunk is None:
        work = [[total / slots] for _ in range(slots)]
    else:
        cs = chunk_sizes(sizes, chunk)
        grid = min(len(cs), grid_cap)
        work = [[c * bytes_per_elem for c in cs[b::grid]] for b in range(grid)]
    return total / (simulate(work, slots, bw, cap) * bw)


def model(layout: str, sizes: list[int], gpu: str, mode: str) -> Row:
    sms, peak, copy, _ = GPUS[gpu]
    read_b, step_b, per_sm, instr, stages = MODES[mode]
    bw = copy * 1e9  # the copy bandwidth: what a kernel that moves its bytes well reaches
    slots = sms * per_sm
    in_flight_block = BLOCK * VE * read_b * stages
    cap = in_flight_block / (LATENCY_NS * 1e-9)
    cs = chunk_sizes(sizes, CHUNK)
    upd_b = step_b - GRAD_BYTES  # the update kernel's bytes per param (the pre-pass reads the grads)
    eff = {c: efficiency(sizes, c, upd_b, slots, sms * GRID_PER_SM, bw, cap) for c in (CHUNK, 1 << 14, None)}
    n = sum(sizes)
    t_update = n * upd_b / (bw * eff[CHUNK])
    t_pre = n * GRAD_BYTES / (bw * 0.9)  # the norm pre-pass: one read of the grads (+ its finalize)
    t_prep = PREP_LAUNCH_US * 1e-6
    total_today = t_update + t_pre + t_prep
    best_update = n * upd_b / (bw * max(eff.values()))
    # instruction issue: elements/s the SMs can issue at `instr` per element, as % of what the copy
    # bandwidth needs at this mode's bytes per element (the update kernel's bytes)
    issue = None if instr is None else 100 * (sms * ISSUE_PER_SM_CLK * CLOCK_GHZ * 1e9 / instr) / (bw / upd_b)
    measured = MEASURED_H200_UNIFORM.get(mode) if (layout, gpu) == ("200 x 160K", "H200") else None
    return Row(layout, gpu, mode, n, len(sizes), len(cs), min(len(cs), sms * GRID_PER_SM), slots,
               len(cs) / slots, peak * 1e9 / sms * LATENCY_NS * 1e-9 / 1e3, per_sm * in_flight_block / 1e3,
               eff[CHUNK], eff[1 << 14], eff[None], t_pre / total_today, t_prep / total_today,
               100 * n * step_b / total_today / bw, 100 * n * step_b / (best_update + t_pre + t_prep) / bw,
               issue, measured)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the rows as JSON")
    args = ap.parse_args(argv)
    print(f"assumed: HBM latency {LATENCY_NS:.0f} ns; block {BLOCK}, {VE} elements per thread-iteration, "
          f"chunk {CHUNK}, grid min(chunks, {GRID_PER_SM} x SMs); copy bandwidth: "
          + "; ".join(f"{g} {c:.0f} GB/s ({why})" for g, (_, _, c, why) in GPUS.items()))
    rows = [model(lay, fn(), gpu, mode) for lay, fn in LAYOUTS.items() for gpu in GPUS for mode in MODES]
    head = ("layout", "GPU", "mode", "chunks", "slots", "waves", "need KB/SM", "in flight KB/SM",
            "eff today", "eff 16K chunks", "eff balanced", "pre-pass", "% of copy today", "% best",
            "issue limit %", "measured %")
    print(" | ".join(head))
    for r in rows:
        print(" | ".join([r.layout, r.gpu, r.mode, str(r.chunks), str(r.slots), f"{r.waves:.2f}",
                          f"{r.need_kb_per_sm:.1f}", f"{r.have_kb_per_sm:.0f}", f"{r.eff_today:.2f}",
                          f"{r.eff_chunk16k:.2f}", f"{r.eff_balanced:.2f}", f"{100 * r.prepass_frac:.0f} %",
                          f"{r.pct_of_copy_today:.0f}", f"{r.pct_of_copy_best:.0f}",
                          "-" if r.issue_limit_pct is None else f"{r.issue_limit_pct:.0f}",
                          "-" if r.measured_pct is None else f"{r.measured_pct:.0f}"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0 if all(math.isfinite(r.eff_today) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
