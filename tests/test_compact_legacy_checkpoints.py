"""Checkpoints of the first compact moment codec ("codec 1", issue 43 item 1) load into today's optimizer.

Codec 1 stored ``exp_avg = sign(c) s c^2`` (int8 ``exp_avg_code``; 4-bit: two's complement nibbles in
``exp_avg_code4``) and ``exp_avg_sq = s c^4`` (uint8 ``exp_avg_sq_code``), a bf16 scale per 32
elements. The checkpoints here are built by the tests from codes and scales they choose, their values
computed in float64 from those laws (not by mpkern); loading converts them once: into
``"8bit"`` / ``"4bit_m"`` to codec 2's nearest code (``mpkern.reference_codecs``, checked bit for bit,
and against the float64 values within half a codec-2 step computed here from the ladder's
definition), into a dense kind as decoded. A converted optimizer steps like one loaded from the
codec-2 checkpoint of the same values, and saves the new keys only. A truncated, mistyped or
incomplete codec-1 entry is a ValueError naming it, and the optimizer keeps its state.
"""

from __future__ import annotations

import copy
import math
import re
import warnings

import pytest
import torch

from conftest import DEVICE
from mpkern import FusedAdamWMP, reference_codecs
from mpkern.optim import storage
from mpkern.optim.storage import legacy_moment4_decode, legacy_moment8_decode

#: the parameters of the checkpoints: odd numels (a short last group; a 4-bit tail of one nibble)
SHAPES = ((5, 13), (77,))
OLD_KEYS = {"8bit": ("exp_avg_code", "exp_avg_sq_code", "exp_avg_scale", "exp_avg_sq_scale"),
            "4bit_m": ("exp_avg_code4", "exp_avg_sq_code", "exp_avg_scale", "exp_avg_sq_scale")}
#: codec 2's ladders (csrc/include/mpkern/math.h): mantissa bits, the top code's value u_max
LADDER = {"m8": (4, 247.0), "v8": (4, 63487.0), "m4": (1, 11.0)}


# ---- codec 1, written here from its definition ------------------------------------------------------
def _scales(groups: int, lo: int, hi: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 scales of random magnitudes 2^[lo, hi) (not powers of two); the second group's is 0."""
    e = torch.randint(lo, hi, (groups,), generator=gen).double()
    s = (torch.rand(groups, generator=gen, dtype=torch.float64) + 1.0) * torch.pow(2.0, e)
    s = s.to(torch.bfloat16)
    if groups > 1:
        s[1] = 0.0
    return s


def _per_element(s: torch.Tensor, n: int) -> torch.Tensor:
    return s.double().repeat_interleave(32)[:n]


def _codec1(kind: str, n: int, gen: torch.Generator) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(codec-1 entries of a flat param of ``n`` elements, their float64 values {exp_avg, exp_avg_sq})."""
    g = math.ceil(n / 32)
    sm, sv = _scales(g, -30, -5, gen), _scales(g, -60, -30, gen)
    cv = torch.randint(0, 256, (n,), generator=gen)
    top = 127 if kind == "8bit" else 7
    cm = torch.randint(-top, top + 1, (n,), generator=gen)
    m64 = _per_element(sm, n) * cm.double().sign() * cm.double() ** 2
    v64 = _per_element(sv, n) * cv.double() ** 4
    entries = {"exp_avg_sq_code": cv.to(torch.uint8), "exp_avg_scale": sm, "exp_avg_sq_scale": sv}
    if kind == "8bit":
        entries["exp_avg_code"] = cm.to(torch.int8)
    else:
        nib = torch.cat([cm & 0xF, cm.new_zeros(n % 2)])  # two's complement nibbles; an odd tail's high one 0
        entries["exp_avg_code4"] = (nib[0::2] | (nib[1::2] << 4)).to(torch.uint8)
    return entries, {"exp_avg": m64, "exp_avg_sq": v64}


def _checkpoint(kind: str, seed: int = 0):
    """(params, a codec-1 state_dict of an optimizer with ``state_dtype=kind``, float64 moments per param)."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(torch.bfloat16).to(DEVICE)) for s in SHAPES]
    opt = FusedAdamWMP(params, lr=1e-3, state_dtype=kind, seed=5)
    for p in params:
        p.grad = torch.full_like(p, 0.25)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    values = []
    for i, p in enumerate(params):
        st = sd["state"][i]
        for key in storage.moment_kind(kind).keys:
            del st[key]
        entries, vals = _codec1(kind, p.numel(), gen)
        if "exp_avg_code" in entries:  # codes laid out like the param
            entries["exp_avg_code"] = entries["exp_avg_code"].reshape(p.shape)
        entries["exp_avg_sq_code"] = entries["exp_avg_sq_code"].reshape(p.shape)
        st.update(entries)
        values.append(vals)
    return params, sd, values


def _fresh(params, state_dtype: str) -> FusedAdamWMP:
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    return FusedAdamWMP(twins, lr=1e-3, state_dtype=state_dtype, seed=5)


def _load(opt: FusedAdamWMP, sd) -> None:
    with warnings.catch_warnings():  # another state_dtype than the checkpoint's: converted, with a warning
        warnings.simplefilter("ignore")
        opt.load_state_dict(sd)


# ---- codec 2's bound, from the ladder's definition --------------------------------------------------
def _half_step64(x64: torch.Tensor, ladder: str) -> torch.Tensor:
    """Half of codec 2's code step at each element of flat float64 ``x64`` (its group's power-of-two scale
    s, the smallest with max |x| / s <= u_max; steps 2^-b s below s, doubling every binade of
    |x| / s + 1), plus the fp32 roundings of the value and of |x| / s + 1; a positive exp_avg_sq below
    one step is stored as one step."""
    b, umax = LADDER[ladder]
    n = x64.numel()
    ax = x64.float().double().abs()  # what the codec sees
    amax = torch.nn.functional.pad(ax, (0, (-n) % 32)).reshape(-1, 32).amax(1)
    e = torch.ceil(torch.log2(amax / umax)).clamp(min=-126)
    s = torch.where(amax > 0, torch.pow(2.0, e), torch.ones_like(amax)).repeat_interleave(32)[:n]
    s = torch.where(s * umax < ax, s * 2, s)  # log2 rounding at an exact power of two
    k = torch.floor(torch.log2(ax / s + 1.0))
    step = torch.pow(2.0, k - b) * s
    bound = 0.5 * step + torch.pow(2.0, k - 23) * s + ax * 2.0**-23
    if ladder == "v8":
        bound = torch.where((ax > 0) & (ax < 2.0**-b * s), 2.0**-b * s + ax * 2.0**-23, bound)
    return bound


def _codec2_nearest(x32: torch.Tensor, kind: str, key: str) -> torch.Tensor:
    """The fp32 value of codec 2's nearest code of flat fp32 ``x32`` (mpkern.reference_codecs)."""
    if key == "exp_avg" and kind == "4bit_m":
        packed, s = reference_codecs.moment4_encode(x32)
        return reference_codecs.moment4_decode(packed, s, x32.numel())
    return reference_codecs.moment8_decode(*reference_codecs.moment8_encode(x32, key))


# ---- the decoders ------------------------------------------------------------------------------------
def test_legacy_decoders_follow_the_square_laws():
    gen = torch.Generator().manual_seed(1)
    n = 69  # three groups, the last one short and of scale NaN (it decodes as NaN)
    s = _scales(3, -20, 3, gen)
    s[2] = float("nan")
    c8 = torch.randint(-127, 128, (n,), generator=gen)
    got = legacy_moment8_decode(c8.to(torch.int8).reshape(3, 23), s)
    want = (_per_element(s, n) * c8.double().sign() * c8.double() ** 2).float()
    assert got.dtype == torch.float32 and got.shape == (3, 23)
    assert torch.equal(got.reshape(-1)[:64], want[:64]) and got.reshape(-1)[64:].isnan().all()
    cv = torch.randint(0, 256, (n,), generator=gen)
    got = legacy_moment8_decode(cv.to(torch.uint8), s)
    assert torch.equal(got[:64], (_per_element(s, n) * cv.double() ** 4).float()[:64])  # s c^4 rounded once
    nib = torch.randint(0, 16, (n + 1,), generator=gen)
    nib[-1] = 0
    packed = (nib[0::2] | (nib[1::2] << 4)).to(torch.uint8)
    c4 = torch.where(nib[:n] >= 8, nib[:n] - 16, nib[:n]).double()  # -8 too: sign(c) s c^2 = -64 s
    got = legacy_moment4_decode(packed, s, n)
    assert torch.equal(got[:64], (_per_element(s, n) * c4.sign() * c4**2).float()[:64])
    with pytest.raises(TypeError, match="codes"):
        legacy_moment8_decode(c8.float(), s)
    with pytest.raises(ValueError, match="scales"):
        legacy_moment8_decode(c8.to(torch.int8), s[:2])
    with pytest.raises(ValueError, match="packed"):
        legacy_moment4_decode(packed[:-1], s, n)


# ---- loading --------------------------------------------------------------------------------------
@pytest.mark.parametrize("saved, target", [("8bit", "8bit"), ("4bit_m", "4bit_m"), ("4bit_m", "8bit"),
                                           ("8bit", "4bit_m")])
def test_codec1_checkpoint_converts_to_the_nearest_codec2_code(saved, target):
    params, sd, values = _checkpoint(saved)
    opt = _fresh(params, target)
    _load(opt, sd)
    adamw = opt.adamw_state_dict()["state"]
    for i, p in enumerate(opt.param_groups[0]["params"]):
        st = opt.state[p]
        assert not {"exp_avg_code", "exp_avg_code4", "exp_avg_sq_code"} & set(st)
        assert set(storage.moment_kind(target).keys) <= set(st)
        for key, ladder in (("exp_avg", "m4" if target == "4bit_m" else "m8"), ("exp_avg_sq", "v8")):
            x64 = values[i][key]
            got = adamw[i][key].reshape(-1).cpu()
            assert torch.equal(got, _codec2_nearest(x64.float(), target, key)), (i, key)
            err = (got.double() - x64).abs()
            assert (err <= _half_step64(x64, ladder)).all(), (i, key, float(err.max()))
            assert (got[32:64] == 0).all()  # the group of scale 0


@pytest.mark.parametrize("saved", ["8bit", "4bit_m"])
@pytest.mark.parametrize("target", ["float32", "bfloat16"])
def test_codec1_checkpoint_into_dense_moments_decodes_exactly(saved, target):
    params, sd, values = _checkpoint(saved)
    opt = _fresh(params, target)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        opt.load_state_dict(sd)
    assert any("state_dtype" in str(w.message) for w in rec)
    dtype = torch.float32 if target == "float32" else torch.bfloat16
    for i, p in enumerate(opt.param_groups[0]["params"]):
        st = opt.state[p]
        assert set(st) & set(OLD_KEYS[saved]) == set()
        for key in ("exp_avg", "exp_avg_sq"):
            assert st[key].dtype == dtype and st[key].shape == p.shape
            # float32: the values exactly (exp_avg_sq: s c^4 rounded once to fp32); bf16: rounded to nearest
            assert torch.equal(st[key].reshape(-1).cpu(), values[i][key].float().to(dtype)), (i, key)


@pytest.mark.parametrize("kind", ["8bit", "4bit_m"])
def test_converted_optimizer_steps_as_the_codec2_checkpoint_and_saves_new_keys(kind):
    params, sd, values = _checkpoint(kind)
    # the codec-2 checkpoint of the same values, built from mpkern.reference_codecs' encoders
    sd2 = copy.deepcopy(sd)
    new = storage.moment_kind(kind).keys
    for i, p in enumerate(params):
        st = sd2["state"][i]
        for key in OLD_KEYS[kind]:
            del st[key]
        m32, v32 = values[i]["exp_avg"].float(), values[i]["exp_avg_sq"].float()
        if kind == "8bit":
            cm, sm = reference_codecs.moment8_encode(m32, "exp_avg")
            st[new[0]] = cm.reshape(p.shape)
        else:
            st[new[0]], sm = reference_codecs.moment4_encode(m32)
        cv, sv = reference_codecs.moment8_encode(v32, "exp_avg_sq")
        st.update({new[1]: cv.reshape(p.shape), new[2]: sm, new[3]: sv})
    a, b = _fresh(params, kind), _fresh(params, kind)
    _load(a, sd)
    _load(b, sd2)
    for opt in (a, b):
        for p in opt.param_groups[0]["params"]:
            p.grad = torch.full_like(p, -0.5)
        opt.step()
    sa, sb = a.state_dict(), b.state_dict()
    masters = {k.key for k in storage.STORED_MASTERS}
    for i in sa["state"]:
        keys = set(sa["state"][i])
        assert set(new) <= keys and keys <= {"step", *new, *masters}, keys
        assert keys == set(sb["state"][i])
        for key in keys:
            ta, tb = torch.as_tensor(sa["state"][i][key]).cpu(), torch.as_tensor(sb["state"][i][key]).cpu()
            assert torch.equal(ta, tb), (i, key)


# ---- refusals ---------------------------------------------------------------------------------------
def _want(kind: str, key: str, n: int) -> tuple[int, torch.dtype]:
    """What a param of ``n`` elements needs in codec-1 entry ``key``: (elements, dtype)."""
    return {"exp_avg_code": (n, torch.int8), "exp_avg_code4": ((n + 1) // 2, torch.uint8),
            "exp_avg_sq_code": (n, torch.uint8), "exp_avg_scale": (math.ceil(n / 32), torch.bfloat16),
            "exp_avg_sq_scale": (math.ceil(n / 32), torch.bfloat16)}[key]


def _snapshot(opt: FusedAdamWMP) -> list[dict]:
    return [{k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[p].items()}
            for p in opt.param_groups[0]["params"]]


BAD = [("8bit", "exp_avg_code", "truncated"), ("8bit", "exp_avg_sq_code", "truncated"),
       ("8bit", "exp_avg_code", "uint8"), ("8bit", "exp_avg_sq_code", "int8"), ("8bit", "exp_avg_scale", "missing"),
       ("8bit", "exp_avg_sq_scale", "float32"), ("4bit_m", "exp_avg_code4", "truncated"),
       ("4bit_m", "exp_avg_code4", "int8"), ("4bit_m", "exp_avg_sq_scale", "missing"),
       ("4bit_m", "exp_avg_scale", "truncated"), ("4bit_m", "exp_avg_sq_code", "missing")]


@pytest.mark.parametrize("kind, key, how", BAD)
@pytest.mark.parametrize("into", ["same", "bfloat16"])
def test_bad_codec1_entry_is_refused_naming_it_and_nothing_changes(kind, key, how, into):
    params, sd, _ = _checkpoint(kind)
    opt = _fresh(params, kind if into == "same" else into)
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.full_like(p, 0.125)
    opt.step()
    before = _snapshot(opt)
    st = sd["state"][1]  # the last param: the first one converts before the bad entry is met
    if how == "missing":
        del st[key]
    elif how == "truncated":
        st[key] = st[key].reshape(-1)[:-1]
    else:
        st[key] = st[key].to(getattr(torch, how))
    n = params[1].numel()
    want, dtype = _want(kind, key, n)
    with pytest.raises(ValueError, match=re.escape(f"checkpoint's {key} is")) as e:
        _load(opt, sd)
    assert f"needs {want} elements of {dtype}" in str(e.value)
    after = _snapshot(opt)
    assert opt.param_groups[0]["state_dtype"] == (kind if into == "same" else into)
    assert [set(s) for s in after] == [set(s) for s in before]
    for sa, sb in zip(after, before):
        for k in sb:
            assert torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])), k
