"""One norm on every backend (issue 20, item 4): the statistics pass (``grad_stats``: the sum of
squares of ``mpkern.unscale_``, the ``max_grad_norm`` pre-pass of ``FusedAdamWMP``, per-tensor
norms) gives the same bits on every backend, so a clipped step is bit-identical across backends.

* ``grad_stats`` bit for bit between the pure-PyTorch reference, the C++ CPU kernel (AVX2 and
  scalar, 1 and 2 threads), Triton (interpreter here) and CUDA where present; each sum against an
  independent float64 numpy sum (tight relative tolerance), and the order of
  ``csrc/include/mpkern/norm.h`` recomputed here in numpy, on tensors built so that other
  summation orders round to other float32 results (the bit equality is not an accident of
  well-conditioned data). Sizes across the 256-element blocks, the 16384-element chunks and the
  128-lane wrap of chunks, offset views, fp32/bf16/fp16, inf and NaN.
* ``FusedAdamWMP(max_grad_norm=5.0)``: three clipped steps (one with an overflowing grad, which
  the pre-pass skips) in every storage mode of the registry, fp32 and bf16 params, offset views:
  params, state and the grad norm bit-identical between the kernel backends and the torch
  reference backend.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch

from conftest import DEVICE, available_backends
from mpkern import _backend, _ops
from mpkern.optim import storage

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
SIZES = (1, 31, 33, 1000, 16383, 16384, 16385, 65537, 16384 * 130 + 7)  # the last crosses the 128-lane wrap
INV = 0.7109375 * 2.0**-3  # not a power of two: the finish's rounding matters


# ---- backends ------------------------------------------------------------------------------------
def _stat_paths() -> list[str]:
    """Statistics paths: "torch" (the reference), the C++ CPU kernel with AVX2 / without SIMD at 1
    and 2 threads (on CPU copies of the grads when the test device is a GPU), triton, cuda."""
    bs = available_backends()
    out = ["torch"]
    if _backend.native() is not None and not _backend.runs_on("cpu", torch.device("cpu")):
        out += ["cpu-t1", "cpu-t2", "cpu-scalar-t1", "cpu-scalar-t2"]
    out += [b for b in ("triton", "cuda") if b in bs]
    return out


@contextlib.contextmanager
def _cpu_threads(path: str):
    ext = _backend.native()
    threads = torch.get_num_threads()
    scalar = "scalar" in path
    torch.set_num_threads(int(path[-1]))
    if scalar:
        ext.set_cpu_simd(False)
    try:
        yield
    finally:
        if scalar:
            ext.set_cpu_simd(True)
        torch.set_num_threads(threads)


def _stats(path: str, make, inv: float = INV) -> tuple[torch.Tensor, torch.Tensor]:
    """grad_stats of the grads ``make(device)`` builds, on ``path``; results on the CPU."""
    if path.startswith("cpu"):
        grads = make(torch.device("cpu"))
        with _cpu_threads(path):
            s, m = _ops.grad_stats(grads, torch.tensor([inv]), "cpu")
    else:
        grads = make(DEVICE)
        s, m = _ops.grad_stats(grads, torch.tensor([inv], device=DEVICE), path)
    return s.cpu(), m.cpu()


def _assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Equal bits, NaN == NaN (a NaN's payload/sign is not part of the contract)."""
    assert a.dtype == b.dtype == F32 and a.shape == b.shape, what
    nan = torch.isnan(a)
    assert torch.equal(nan, torch.isnan(b)), f"{what}: NaN positions differ"
    ai, bi = a.view(torch.int32)[~nan], b.view(torch.int32)[~nan]
    bad = (ai != bi).nonzero().flatten().tolist()
    assert not bad, f"{what}: entries {bad[:5]} differ: {a[~nan][bad[:5]].tolist()} vs {b[~nan][bad[:5]].tolist()}"


# ---- independent float64 recomputations ------------------------------------------------------------
def _np64(g: torch.Tensor) -> np.ndarray:
    return g.detach().cpu().float().double().numpy().ravel()


def _halves_np(v: np.ndarray) -> np.ndarray:
    while v.shape[-1] > 1:
        w = v.shape[-1] // 2
        v = v[..., :w] + v[..., w:]
    return v[..., 0]


def _norm_order_np(x: np.ndarray) -> float:
    """norm.h's sum of squares, recomputed here in numpy float64 (the spec, not mpkern's code)."""
    n = x.size
    chunks = -(-n // 16384)
    q = np.zeros(chunks * 16384)
    q[:n] = x * x
    q = q.reshape(chunks, 64, 16, 16)  # chunk, block, row, lane
    lanes = q[:, :, 0, :].copy()
    for r in range(1, 16):
        lanes = lanes + q[:, :, r, :]
    part = _halves_np(_halves_np(lanes))  # lanes of each block, then the 64 blocks: [chunks]
    tl = np.zeros(128)
    for c in range(chunks):
        tl[c % 128] = tl[c % 128] + part[c]
    return float(_halves_np(tl))


def _check_vs_float64(grads: list[torch.Tensor], sumsq: torch.Tensor, amax: torch.Tensor) -> None:
    inv2 = float(np.float32(INV)) ** 2
    for i, g in enumerate(grads):
        x = _np64(g)
        exp_sum = float(np.sum(x * x)) * inv2
        exp_max = float(np.max(np.abs(x))) if x.size else 0.0
        got_s, got_m = float(sumsq[i]), float(amax[i])
        if np.isnan(x).any():
            assert math.isnan(got_s) and math.isnan(got_m), f"grad {i}: NaN not propagated"
            continue
        assert got_m == exp_max, f"grad {i}: amax {got_m} vs {exp_max}"
        if math.isinf(exp_sum):
            assert got_s == math.inf, f"grad {i}: sumsq {got_s} vs inf"
            continue
        # float32 rounding of an fp64 sum good to ~40 * 2^-53: within 2^-23 relative
        assert abs(got_s - exp_sum) <= 2.0**-23 * exp_sum, f"grad {i}: sumsq {got_s!r} vs float64 {exp_sum!r}"
        # and exactly the float32 of norm.h's order recomputed here
        assert got_s == float(np.float32(_norm_order_np(x) * inv2)), f"grad {i}: not norm.h's order"


# ---- the gradient lists ---------------------------------------------------------------------------------
def _random_grads(dtype: torch.dtype, seed: int):
    """Random grads over SIZES (magnitudes over 2^-6..2^6 per element), offset views (element 5 of
    a bigger tensor; one across chunk boundaries), and non-finite ones (inf; -inf and inf; NaN)."""
    g = torch.Generator().manual_seed(seed)
    bases = []
    for n in SIZES:
        mag = torch.exp2(torch.randint(-6, 7, (n,), generator=g).double())
        bases.append(torch.randn(n, generator=g, dtype=torch.float64) * mag)
    big = torch.randn(2 * 16384 + 100, generator=g, dtype=torch.float64) * 3
    bad_inf = torch.randn(1000, generator=g, dtype=torch.float64)
    bad_inf[17] = math.inf
    bad_both = torch.randn(16390, generator=g, dtype=torch.float64)
    bad_both[3], bad_both[16385] = -math.inf, math.inf
    bad_nan = torch.randn(16390, generator=g, dtype=torch.float64)
    bad_nan[16385] = math.nan

    def make(device: torch.device) -> list[torch.Tensor]:
        whole = big.to(dtype).to(device)
        out = [b.to(dtype).to(device) for b in bases]
        out += [whole[5:], whole[5:5 + 1000]]  # offset views (unaligned start)
        out += [b.to(dtype).to(device) for b in (bad_inf, bad_both, bad_nan)]
        return out

    return make


def _order_sensitive_grads(device: torch.device) -> list[torch.Tensor]:
    """fp32 grads whose float32 sum of squares depends on the summation order: 1 and 2^-12 make
    1 + 2^-24 (a float32 rounding tie), and squares of 2^-27 (a quarter of an fp64 ulp at 1)
    survive only where the order adds them to each other before the big ones."""
    rows = torch.zeros(300)  # lane 0: the tiny ones in rows 1..15, under the 1 of row 0: lost
    rows[0], rows[1] = 1.0, 2.0**-12
    rows[16:256:16] = 2.0**-27
    blocks = torch.zeros(16384)  # blocks 1, 17, 33 meet in the halves-tree before block 0
    blocks[0], blocks[8] = 1.0, 2.0**-12
    blocks[256 * torch.tensor([1, 17, 33])] = 2.0**-27
    lanes = torch.zeros(16384 * 131)  # chunk partials: chunks 1 and 129, 65 and 128 share or pair lanes
    lanes[0], lanes[1] = 1.0, 2.0**-12
    lanes[16384 * torch.tensor([1, 65, 128, 129])] = 2.0**-27
    return [t.to(device) for t in (rows, blocks, lanes)]


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=str)
def test_grad_stats_bits_on_every_backend(dtype):
    make = _random_grads(dtype, seed={F32: 1, BF16: 2, F16: 3}[dtype])
    paths = _stat_paths()
    out = {p: _stats(p, make) for p in paths}
    ref_s, ref_m = out["torch"]
    _check_vs_float64(make(torch.device("cpu")), ref_s, ref_m)
    for p in paths[1:]:
        _assert_same_bits(out[p][0], ref_s, f"{dtype} sumsq: {p} vs reference")
        _assert_same_bits(out[p][1], ref_m, f"{dtype} amax: {p} vs reference")
    if len(paths) < 2:
        pytest.skip("only the reference runs here")


# (big lane, first small lane, lane distance of the pair): the two small ones meet each other at the
# tree level of that distance (8, 4, 2), before either meets the big one's lanes
# (lanes 2 and 4 beside a big lane 0 would not do: 4 meets 0 at distance 4, before 2)
LANE_PAIR_CASES = [(big, small, d) for d in (8, 4, 2) for big, small in ((0, 1), (1, 0), (0, 2), (1, 2))
                   if (big, small, d) != (0, 2, 2)]


def _lane_pairing_grads(device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    """Blocks whose float32 sum of squares tells norm.h's lane pairs from others: a 1 and a 2^-12
    (squares 1 + 2^-24, a float32 rounding tie) in lanes l and l+8, and two of 11 * 2^-30 (squares
    121 * 2^-60: each lost against the 1 in fp64, the two together kept) in lanes l' and l'+d, which
    the halves-tree adds to each other before the 1. Right pairs round the tie up, others to 1. The
    cases put the small ones in odd lanes beside an even big one and the reverse (the AVX2 bf16 rows
    keep even and odd elements apart), at each distance."""
    out = []
    for big, small, d in LANE_PAIR_CASES:
        x = torch.zeros(300)  # a whole block and a partial one
        x[big], x[big + 8] = 1.0, 2.0**-12
        x[small], x[small + d] = 11 * 2.0**-30, 11 * 2.0**-30
        out.append(x.to(dtype).to(device))
    return out


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_grad_stats_lane_pairs(dtype):
    spec = float(np.float32(1.0 + 2.0**-23))  # the tie rounded up by the kept small squares
    for g in _lane_pairing_grads(torch.device("cpu"), dtype):  # the cases discriminate
        x = _np64(g)
        assert float(np.float32(_norm_order_np(x))) == spec
        assert float(np.float32((1.0 + 121 * 2.0**-60) + 2.0**-24 + 121 * 2.0**-60)) != spec  # one at a time: lost
    for p in _stat_paths():
        s, _ = _stats(p, lambda dev: _lane_pairing_grads(dev, dtype), 1.0)
        assert s.tolist() == [spec] * len(LANE_PAIR_CASES), f"{p}: {s.tolist()}"


def test_grad_stats_order_sensitive_cases():
    inv = 0.125  # a power of two keeps the float32 rounding ties of the cases
    inv2 = inv * inv
    grads = _order_sensitive_grads(torch.device("cpu"))
    exact = [float(np.float32(math.fsum(float(v) ** 2 for v in _np64(g)[_np64(g) != 0]) * inv2)) for g in grads]
    spec = [float(np.float32(_norm_order_np(_np64(g)) * inv2)) for g in grads]
    pairwise = [float(np.float32(np.sum(_np64(g) ** 2) * inv2)) for g in grads]
    # the cases discriminate: norm.h's order rounds otherwise than exact and than numpy's pairwise sums
    assert spec[0] != exact[0] and spec[1] != pairwise[1] and spec[2] != pairwise[2], (spec, exact, pairwise)
    paths = _stat_paths()
    for p in paths:
        s, _ = _stats(p, _order_sensitive_grads, inv)
        assert s.tolist() == spec, f"{p}: {s.tolist()} vs norm.h's order {spec}"


# ---- a clipped FusedAdamWMP step on every backend ------------------------------------------------------
E2E_SIZES = (1, 31, 33, 1000)
E2E_BIG = (1, 31, 33, 1000, 65537)  # the Triton interpreter is slow: 65537 for two modes


def _e2e_modes() -> list[tuple[torch.dtype, object, str, tuple[int, ...]]]:
    """Every (param dtype, master_weights, state_dtype) of the storage registry that every
    compared backend has a kernel for (fp32 params: one per moment kind, masters do not apply)."""
    backs = [b for b in ("cpu", "triton", "cuda", "torch") if b in available_backends()]
    out = []
    for pdt in (BF16, F32):
        common = [m for m in storage.modes(pdt) if all(m in storage.modes(pdt, backend=b) for b in backs)]
        seen = set()
        for mw, sd in common:
            if pdt == F32 and sd in seen:
                continue
            seen.add(sd)
            big = (pdt, mw, sd) in ((BF16, "8bit", "8bit"), (F32, True, "float32"))
            out.append((pdt, mw, sd, E2E_BIG if big else E2E_SIZES))
    return out


def _e2e_params(pdt: torch.dtype, sizes: tuple[int, ...]) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(11)
    params = [torch.nn.Parameter((torch.randn(n, generator=g) * 0.5).to(pdt).to(DEVICE)) for n in sizes]
    buf = (torch.randn(1011, generator=g) * 0.5).to(pdt).to(DEVICE)
    params.append(torch.nn.Parameter(buf[5:1005]))  # an offset view of a bigger tensor
    return params


def _e2e_grads(params: list[torch.Tensor], step: int, pdt: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for i, p in enumerate(params):
        n = p.numel()
        gbuf = (torch.randn(n + 8, generator=g) * 3.0).to(pdt).to(DEVICE)
        out.append(gbuf[5:5 + n] if i == len(params) - 1 else gbuf[:n].clone())  # the last: offset view
    if step == 1:  # an overflowed grad: the pre-pass finds it and the step is skipped
        out[2][7] = math.inf
    return out


def _e2e_run(backend: str, pdt: torch.dtype, mw: object, sd: str, sizes: tuple[int, ...]):
    """Three clipped steps; the params, every state tensor, the grad norms and found_inf flags."""
    import mpkern

    with mpkern.use_backend(backend):
        params = _e2e_params(pdt, sizes)
        opt = mpkern.FusedAdamWMP(params, lr=1e-2, weight_decay=0.01, max_grad_norm=5.0, master_weights=mw,
                                  state_dtype=sd, seed=7)
        norms, found = [], []
        for step in range(3):
            for p, gr in zip(params, _e2e_grads(params, step, pdt)):
                p.grad = gr
            opt.step()
            norms.append(opt.last_grad_norm.detach().reshape(1).cpu().float())
            found.append(float(opt.last_found_inf))
    state = [(f"state[{i}].{k}", v.detach().cpu()) for i, p in enumerate(params)
             for k, v in sorted(opt.state[p].items()) if isinstance(v, torch.Tensor)]
    return [p.detach().cpu() for p in params], state, torch.cat(norms), found


def _bits(t: torch.Tensor) -> torch.Tensor:
    if not t.is_floating_point():
        return t
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _assert_runs_equal(a, b, what: str) -> None:
    pa, sa, na, fa = a
    pb, sb, nb, fb = b
    assert fa == fb == [0.0, 1.0, 0.0], f"{what}: found_inf {fa} vs {fb}"
    assert torch.equal(_bits(na), _bits(nb)), f"{what}: grad norms {na.tolist()} vs {nb.tolist()}"
    assert (na[::2] > 5.0).all(), "the finite steps must clip"
    for i, (x, y) in enumerate(zip(pa, pb)):
        assert torch.equal(_bits(x), _bits(y)), f"{what}: param {i} differs in {int((x != y).sum())} elements"
    assert [k for k, _ in sa] == [k for k, _ in sb], what
    for (k, x), (_, y) in zip(sa, sb):
        assert torch.equal(_bits(x), _bits(y)), f"{what}: {k} differs in {int((x != y).sum())} elements"


@pytest.mark.parametrize("pdt,mw,sd,sizes", _e2e_modes(),
                         ids=lambda v: str(v).replace("torch.", "") if not isinstance(v, tuple) else str(len(v)))
def test_clipped_steps_bit_identical_across_backends(pdt, mw, sd, sizes):
    kernels = [b for b in ("cpu", "cuda", "triton") if b in available_backends()]
    runs = {b: _e2e_run(b, pdt, mw, sd, sizes) for b in kernels}
    for b in kernels[1:]:
        _assert_runs_equal(runs[kernels[0]], runs[b], f"{b} vs {kernels[0]}")
    if not kernels:
        pytest.skip("no kernel backend here")
    ref = _e2e_run("torch", pdt, mw, sd, sizes)
    # the norm pass is the same on the reference: the same grad norms and skip decisions
    assert torch.equal(_bits(ref[2]), _bits(runs[kernels[0]][2])) and ref[3] == runs[kernels[0]][3]
    # the reference takes its float32 sqrt correctly rounded (through fp64), as the kernels' sqrtf
    _assert_runs_equal(runs[kernels[0]], ref, f"torch vs {kernels[0]}")


def test_total_sumsq_one_order():
    """The sum over tensors (norm.h step 5): within fp64 rounding of the exact sum, rounded once,
    and the same bits whatever the device's own reduction order would be."""
    from mpkern.reference import total_sumsq

    g = torch.Generator().manual_seed(11)
    for n in (1, 2, 3, 7, 8, 1000, 1025):
        v = (torch.rand(n, generator=g) * torch.exp2(torch.randint(-30, 30, (n,), generator=g).float()))
        exact = math.fsum(float(x) for x in v.double())
        got = total_sumsq(v)
        assert got.dtype == F32 and got.shape == ()
        assert got.item() == pytest.approx(exact, rel=2 ** -23), n
        # a halves-tree in fp64 written out independently
        xs = [float(x) for x in v.double()] + [0.0] * ((1 << (n - 1).bit_length()) - n)
        while len(xs) > 1:
            h = len(xs) // 2
            xs = [xs[i] + xs[i + h] for i in range(h)]
        assert got.item() == float(np.float32(xs[0])), n
    assert total_sumsq(torch.zeros(0)).item() == 0.0
    inf = torch.tensor([1.0, float("inf"), 2.0])
    assert math.isinf(total_sumsq(inf).item())
