"""Kernel layer of the 4-bit exp_avg (issue 22; ``state_dtype="4bit_m"``): uint8 exp_avgs holding two
sign-magnitude 4-bit codes per byte (element 2j in the low nibble of byte j), ``+-u(q) s`` with u the
1-mantissa-bit ladder (0, 1/2, 1, 2, 3, 5, 7, 11; codec 2, issue 43) and a bf16 power-of-two scale per
32 elements, next to the 8-bit exp_avg_sq.

* bit-identity of every kernel path (CPU AVX-512 where present, AVX2, scalar, Triton, CUDA when
  present) on sizes that are not multiples of the group or of two (1, 31, 33, 1000, 65537), an
  offset view, stream offsets that cross 2^32 inside a group, maximize, and grads that overflow;
* the pure-PyTorch reference against the kernels;
* the codec against float64 written here (tests/_ladder64.py): unbiased over two decades below the group
  max, no code above 7, scales the smallest powers of two that put the group max at or below 11, the
  odd tail's high nibble 0;
* bad arguments are refused alike everywhere (found_inf as a bitwise no-op: test_compact_kernels's
  test for both grouped kinds).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

import _ladder64
from conftest import DEVICE, available_backends, call_adamw_op
from mpkern import _ops, reference_codecs
from test_compact_kernels import (
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

NAMES = ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "masters", "steps", "exp_avg_scales",
         "exp_avg_sq_scales")


def _codes64(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The signed 4-bit codes +-q of n elements (float64), decoded here from the documented layout
    (sign-magnitude nibbles: bit 3 the sign)."""
    b = packed.reshape(-1).cpu().long()
    nib = torch.stack([b % 16, b // 16], dim=1).reshape(-1)[:n]
    return torch.where(nib >= 8, -(nib - 8), nib).double()


def _decode_m64(packed: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    return _ladder64.decode64(packed, scales, "m4", n)


def _case4(mode, pdt, seed=0, sizes=SIZES + (300,)):
    """4-bit state for one call (test_compact_kernels's _case8 with these moments): the SIZES and an
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
    a = _args4(r, mode, sr, streams, offsets)
    call_adamw_op(_ops._reference_adamw_step_, *a)
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
    step^2, float64 here from the ladder's neighbouring values), and within 2 % of the values; signs
    kept; no code above 7; scales the smallest powers of two that put the group max at or below 11."""
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
    assert torch.equal(s, _ladder64.scale64(amax, "m4"))
    assert max(float(_codes64(c, n).abs().max()) for c, _ in res) <= 7
    dec = torch.stack([_decode_m64(c, sc, n) for c, sc in res])
    mean = dec.mean(dim=0)
    sg = s.repeat_interleave(G32)
    y = target.abs() / sg
    lo, hi = _ladder64.neighbours64(y, 1)
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
    lo, hi = _ladder64.neighbours64(x.double().abs() / s, 1)
    assert bool(((dec - x.double()).abs() <= 0.5 * (hi - lo) * s * (1 + 1e-6)).all())
    with pytest.raises(ValueError, match="ceil"):
        reference_codecs.moment4_decode(packed[:-1], scales, 65)
