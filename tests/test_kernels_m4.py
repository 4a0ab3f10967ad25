"""Kernel layer of the 4-bit exp_avg (issue 22; ``state_dtype="4bit_m"``): uint8 exp_avgs holding two
signed 4-bit codes per byte (element 2j in the low nibble of byte j), ``sign(c) s c^2`` with c in
[-7, 7] and a bf16 scale per 32 elements, next to the 8-bit exp_avg_sq.

* bit-identity of every kernel path (CPU AVX-512 where present, AVX2, scalar, Triton, CUDA when
  present) on sizes that are not multiples of the group or of two (1, 31, 33, 1000, 65537), an
  offset view, stream offsets that cross 2^32 inside a group, maximize, and grads that overflow;
* the pure-PyTorch reference against the kernels;
* the codec against float64 written here: unbiased over two decades below the group max, the group
  max at code 6 or 7, scales amax / 49 rounded up to bf16, the odd tail's high nibble 0;
* bad arguments are refused alike everywhere (found_inf as a bitwise no-op: test_kernels_compact's
  test for both grouped kinds).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from conftest import DEVICE, available_backends, call_adamw_op
from mpkern import _ops, reference, reference_codecs
from test_kernels_compact import (
    BF16,
    CPU_PATHS,
    EPS,
    F16,
    F32,
    SIZES,
    _args8,
    _bits,
    _case8,
    _clone,
    _cpu_only,
    _kernel_backends,
    _magnitudes,
    _mom4_state,
    _run8,
    reference_close,
    refused_alike,
)

G32 = 32
KM4_64 = 1.0 / 49

NAMES = ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "masters", "steps", "exp_avg_scales",
         "exp_avg_sq_scales")


def _codes64(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The signed 4-bit codes of n elements (float64), decoded here from the documented layout."""
    b = packed.reshape(-1).cpu().long()
    nib = torch.stack([b % 16, b // 16], dim=1).reshape(-1)[:n]
    return torch.where(nib >= 8, nib - 16, nib).double()


def _decode_m64(packed: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    c = _codes64(packed, n)
    s = scales.reshape(-1).double().cpu().repeat_interleave(G32)[:n]
    return s * c * c.abs()


def _case4(mode, pdt, seed=0, sizes=SIZES + (300,)):
    """4-bit state for one call (test_kernels_compact's _case8 with these moments): the SIZES and an
    offset view; the stream offset of the 1000-element tensor crosses 2^32 inside a group of 32."""
    state, streams, offsets = _case8(mode, pdt, seed, sizes, moments=_mom4_state)
    return state, streams, offsets + [2**32 - 2000] * (len(sizes) - len(offsets))


_args4, _run4 = _args8, _run8


MODES = [(0, BF16, True), (0, F32, False), (1, BF16, False), (1, F16, False), (2, BF16, False), (3, BF16, False),
         (3, F16, False)]


def _assert_same(out, names_order):
    ref = out[names_order[0]]
    for b in names_order[1:]:
        for name, lst_a, lst_b in zip(NAMES, ref, out[b]):
            for i, (a, c) in enumerate(zip(lst_a, lst_b)):
                assert torch.equal(_bits(a), _bits(c)), f"{b} vs {names_order[0]}: {name}[{i}] differs"


@pytest.mark.parametrize("mode,pdt,sr", MODES, ids=lambda x: str(x).replace("torch.", ""))
def test_m4_kernel_paths_bit_identical(mode, pdt, sr):
    bs = _kernel_backends()
    if len(bs) < 2:
        pytest.skip("needs two kernel paths")
    state0, streams, offsets = _case4(mode, pdt, seed=80 + mode)
    out = {b: _run4(b, _clone(state0), mode, sr, streams, offsets, maximize=mode == 1) for b in bs}
    _assert_same(out, bs)
    ref = out[bs[0]]
    for k in (0, 2, 3, 7, 8):  # params, codes and scales moved
        assert not torch.equal(_bits(ref[k][3]), _bits(state0[k][3])), NAMES[k]
    for cm, p in zip(ref[2], ref[0]):  # the documented layout kept: an odd tail's high nibble is 0
        if p.numel() % 2:
            assert int(cm[-1].item()) >> 4 == 0


@pytest.mark.parametrize("mode,pdt,sr", MODES[::2], ids=lambda x: str(x).replace("torch.", ""))
def test_m4_cpu_paths_bit_identical_with_overflowing_grads(mode, pdt, sr):
    """The CPU kernel's paths with maximize and huge / non-finite grads in some groups (NaN and
    top-code scales, NaN signs) and a tensor of 4200 elements (several vector blocks)."""
    if "cpu" not in available_backends():
        pytest.skip("no C++ CPU kernels")
    state0, streams, offsets = _case4(mode, pdt, seed=90 + mode, sizes=SIZES + (300, 4096 + 64 + 40))
    g = state0[1][-1]
    g[100:104] = torch.tensor([float("nan"), float("inf"), -float("inf"), 6e4]).to(g.dtype)
    g[2000] = 3e4
    out = {b: _run4(b, _clone(state0), mode, sr, streams, offsets, maximize=True) for b in CPU_PATHS}
    _assert_same(out, CPU_PATHS)
    sm = out["cpu"][7][-1].view(torch.int16).cpu()
    assert int(sm[100 // G32]) == 0x7FC0  # the NaN group's scale


@pytest.mark.parametrize("mode,pdt,sr", MODES[::3], ids=lambda x: str(x).replace("torch.", ""))
def test_m4_reference_matches_kernels(mode, pdt, sr):
    """The pure-PyTorch reference runs the same fp32 operations: the same codes and scales up to rare
    one-code flips where an fp32 rounding differs, the masters within fp32 rounding."""
    bs = _kernel_backends()
    if not bs:
        pytest.skip("no kernel backend")
    state0, streams, offsets = _case4(mode, pdt, seed=60 + mode, sizes=(1, 31, 33, 1000, 300))
    k = _run4(bs[0], _clone(state0), mode, sr, streams, offsets)
    r = _clone(state0)
    reference.adamw_step_(*_args4(r, mode, sr, streams, offsets))
    reference_close(k, r, mode, lambda c, p: _codes64(c, p.numel()).int())


def _encode_m_with_kernel(x, draws, backend="cpu"):
    """Encode x (fp32, flat) `draws` times through the kernel with fresh random bits: zero state and
    beta1 = 0 make the updated exp_avg exactly g. Returns the packed codes and scales of each draw."""
    n = x.numel()
    out = []
    step = torch.zeros((), device=DEVICE)
    one, zero = torch.tensor(1.0, device=DEVICE), torch.tensor(0.0, device=DEVICE)
    for _ in range(draws):
        cm, cv, sm, sv = _mom4_state(n, None, zero=True)
        p = torch.zeros(n, device=DEVICE)
        call_adamw_op(partial(_ops.adamw_step_, backend), [p], [x], [cm], [cv], [], [], [step], one, zero, None, 0.0,
                      0.0, 0.0, EPS, 0.0, False, 0, False, 77, [], [], [sm], [sv])
        out.append((cm, sm))
    return out


def test_m4_codec_unbiased_and_scaled():
    """decode(encode(x)) is unbiased over 1e-2..1 of the group max: per magnitude decade the summed
    error over 400 draws is within 5 standard deviations of the rounding noise (binomial p(1-p)
    step^2, float64 here), and within 2 % of the values; signs kept; the group max codes 6 or 7;
    scales amax / 49 rounded up to bf16."""
    _cpu_only()
    gen = torch.Generator().manual_seed(21)
    groups, draws = 48, 400
    x64, logrel = _magnitudes(groups, gen, 2.0)
    x = x64.float()
    n = x.numel()
    res = _encode_m_with_kernel(x, draws)
    target = x.double()
    amax = target.abs().reshape(groups, G32).amax(dim=1)
    s = res[0][1].double()
    assert bool((s >= amax * KM4_64 * (1 - 2**-23)).all() and (s <= amax * KM4_64 * (1 + 2**-7)).all())
    top = _codes64(res[0][0], n).reshape(groups, G32)[:, 0].abs()
    assert set(top.tolist()) <= {6.0, 7.0}
    dec = torch.stack([_decode_m64(c, sc, n) for c, sc in res])
    mean = dec.mean(dim=0)
    sg = s.repeat_interleave(G32)
    y = target.abs() / sg
    kk = torch.floor(y.sqrt())
    lo, hi = kk**2, (kk + 1) ** 2
    pfrac = ((y - lo) / (hi - lo)).clamp(0, 1)
    var = pfrac * (1 - pfrac) * ((hi - lo) * sg) ** 2 / draws
    err = mean.abs() - target.abs()
    for d in range(2):
        sel = (logrel <= -d) & (logrel > -d - 1)
        z = err[sel].sum() / var[sel].sum().sqrt().clamp(min=1e-300)
        assert abs(z.item()) < 5, (d, z.item())
        rel = (err[sel].sum() / target[sel].abs().sum()).item()
        assert abs(rel) < 0.02, (d, rel)
    nz = mean != 0
    assert bool((torch.sign(mean[nz]) == torch.sign(target[nz])).all())


def _bad_cases():
    def mod(fn):
        st, _, _ = _case4(1, BF16, seed=2, sizes=(40, 7))
        fn(st)
        return st

    return {
        "packed numel": (ValueError, lambda: mod(lambda st: st[2].__setitem__(1, torch.zeros(7, dtype=torch.uint8,
                                                                                         device=DEVICE)))),
        "8-bit next to 4-bit": (TypeError, lambda: mod(lambda st: st[2].__setitem__(
            1, torch.zeros(4, dtype=torch.int8, device=DEVICE)))),
        "v not uint8": (TypeError, lambda: mod(lambda st: st[3].__setitem__(0, st[3][0].to(torch.int8)))),
        "scale numel": (ValueError, lambda: mod(lambda st: st[7].__setitem__(0, st[7][0][:1].clone()))),
        "amsgrad": (ValueError, lambda: mod(lambda st: st[4].extend([torch.zeros(40, device=DEVICE),
                                                                     torch.zeros(7, device=DEVICE)]))),
    }


def test_m4_bad_arguments_refused_alike_everywhere():
    refused_alike(_bad_cases())


def test_m4_reference_helpers_roundtrip():
    """moment4_encode with the nearest rule then moment4_decode: every element within half a code
    step of its value (float64 bound here), the packed layout as documented."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(65, generator=gen) * 1e-3
    packed, scales = reference_codecs.moment4_encode(x)
    assert packed.dtype == torch.uint8 and packed.numel() == 33 and scales.numel() == 3
    assert int(packed[-1]) >> 4 == 0
    dec = reference_codecs.moment4_decode(packed, scales, 65).double()
    assert torch.equal(dec, _decode_m64(packed, scales, 65))
    s = scales.double().repeat_interleave(G32)[:65]
    y = x.double().abs() / s
    k = torch.floor(y.sqrt()).clamp(max=6)
    half = 0.5 * ((k + 1) ** 2 - k**2) * s
    assert bool(((dec - x.double()).abs() <= half * (1 + 1e-6)).all())
    with pytest.raises(ValueError, match="ceil"):
        reference_codecs.moment4_decode(packed[:-1], scales, 65)
