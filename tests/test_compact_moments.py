"""Issue 15 at the optimizer level: ``state_dtype="8bit"`` (companded 8-bit moments, a bf16 scale
per 32 elements), alone and with ``master_weights="8bit"`` / ``"remainder"``.

The kernels' bit-identity across backends and the codec statistics are in
test_compact_kernels.py; here the public API against float64 references written in the tests:
the constant-grad small-update case of the issue, checkpoints (compact, resume bit-identical,
conversions from AdamW and our other modes, bad shapes), layout changes, ``adamw_state_dict``,
bytes, errors. The spike-then-decay case and the bitwise overflow skip are test_compact_master's,
run for both compact moment kinds; so is the float64 decoding of the documented format (not the
code under test).
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

import _ladder64
from conftest import DEVICE
from mpkern import FusedAdamWMP
from mpkern.optim import storage

# float64 AdamW path; a small bf16 Linear trained; the float64 decoding of 8-bit moments
from test_compact_master import _adamw64_path, _decode64, _run

B1, B2, EPS = 0.9, 0.999, 1e-8
#: every compact moment kind with group scales: the 8-bit one and the 4-bit exp_avg + 8-bit exp_avg_sq
KINDS = ("8bit", "4bit_m")


@pytest.fixture(params=KINDS)
def kind(request) -> str:
    return request.param


def _mom(kind: str) -> dict:
    return {"state_dtype": kind}


def _m_key(kind: str) -> str:
    """The state key of the exp_avg codes."""
    return storage.moment_kind(kind).keys[0]


def _half_step(x: torch.Tensor, key: str, per_tensor: bool = False, kind: str = "8bit") -> torch.Tensor:
    """The requantization bound of ``x`` (float64, flat memory order): half of the largest code step of
    each element's group (tests/_ladder64.py: the top binade's step 2^-b (u_max + 1) against a group
    maximum of at least u_max / 2 scale units): 3.2 % of the group's largest magnitude (the 4-bit
    exp_avg: 30 %) (``per_tensor``: of the tensor's largest, for values regrouped in another memory order)."""
    flat = x.reshape(-1).abs()
    pad = (-flat.numel()) % 32
    if per_tensor:
        gmax = flat.max().expand(flat.numel())
    else:
        gmax = torch.nn.functional.pad(flat, (0, pad)).reshape(-1, 32).amax(1).repeat_interleave(32)[: flat.numel()]
    ladder = ("m4" if kind == "4bit_m" else "m8") if key == "exp_avg" else "v8"
    top = _ladder64.umax(ladder)
    step = 2.0 ** -_ladder64.LADDERS[ladder][0] * (1 + 2 / top)
    return (0.5 * step * gmax + 1e-30).reshape(x.shape)


# ---- the two small-update cases -----------------------------------------------------------
@pytest.mark.parametrize("master", ["8bit", "remainder"])
def test_small_updates_move_the_master_with_8bit_moments(master, kind):
    # bf16 param at 1.0, lr 1e-5, constant grad: each update is 1/780 of the param's ulp
    n, steps, lr = 2048, 1000, 1e-5
    p = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16, device=DEVICE))
    opt = FusedAdamWMP([p], lr=lr, weight_decay=0.0, master_weights=master, seed=3, **_mom(kind))
    g = torch.full((n,), 0.3, dtype=torch.bfloat16, device=DEVICE)
    for _ in range(steps):
        p.grad = g
        opt.step()
    moved = 1.0 - float(opt.master_params()[0].double().mean())
    want = 1.0 - _adamw64_path(1.0, float(g[0]), lr, steps)
    assert abs(moved - want) <= 0.05 * want, (moved, want)


# ---- one step against float64 AdamW ---------------------------------------------------------------
@pytest.mark.parametrize("flags", [{}, {"maximize": True}, {"lr": "tensor"}, {"main_grad": True}])
def test_steps_follow_float64_adamw_within_the_quantization(backend, flags, kind):
    # 5 steps from zero state: the master follows float64 AdamW on the same grads up to the 8-bit
    # moments' quantization
    torch.manual_seed(4)
    w0 = torch.randn(97, 33).to(torch.bfloat16)
    lr = 1e-2
    p = torch.nn.Parameter(w0.clone().to(DEVICE))
    lr_arg = torch.tensor(lr, device=DEVICE) if flags.get("lr") == "tensor" else lr
    opt = FusedAdamWMP([p], lr=lr_arg, weight_decay=0.0, maximize=flags.get("maximize", False), **_mom(kind))
    w, m, v = w0.double(), torch.zeros_like(w0, dtype=torch.float64), torch.zeros_like(w0, dtype=torch.float64)
    sign = -1.0 if flags.get("maximize") else 1.0
    gen = torch.Generator().manual_seed(5)
    for t in range(1, 6):
        g = torch.randn(w0.shape, generator=gen).to(torch.bfloat16)
        if flags.get("main_grad"):
            p.main_grad = g.float().to(DEVICE)
        else:
            p.grad = g.to(DEVICE)
        opt.step()
        gd = sign * g.double()
        m = B1 * m + (1 - B1) * gd
        v = B2 * v + (1 - B2) * gd * gd
        w = w - lr * (m / (1 - B1**t)) / ((v / (1 - B2**t)).sqrt() + EPS)
    got = opt.master_params()[0].double().cpu()
    moved = (w - w0.double()).abs()
    err = (got - w).abs()
    # measured (cpu): max 0.10 lr, mean 0.66 % of the mean movement (fp32 moments: 4e-5 lr, 2e-6).
    # A small moment far below its group's largest value has a coarse code (relative step 2/c),
    # but the noise is zero-mean and each update stays below ~lr: bounded with 2.5x / 3x margins
    # The 4-bit exp_avg (codes 0..7, a step up to 13 % of the group max; measured: max 1.97 lr, mean
    # 11 % of the mean movement after 5 steps from zero state) -- zero-mean noise, bounded with 2x margins
    max_lr, mean_frac = (0.25, 0.02) if kind == "8bit" else (4.0, 0.25)
    assert float(err.max()) <= max_lr * lr, float(err.max())
    assert float(err.mean()) <= mean_frac * float(moved.mean())


# ---- checkpoints ----------------------------------------------------------------------------------
@pytest.mark.parametrize("master", ["8bit", "remainder", True])
def test_checkpoint_is_compact_and_resumes_bit_identically(backend, master, kind):
    kw = dict(master_weights=master, seed=11, **_mom(kind))
    lin, opt = _run(kw, 0, 2)
    sd = copy.deepcopy(opt.state_dict())
    st = sd["state"][0]
    if kind == "8bit":
        assert st["exp_avg_q8"].dtype == torch.int8
    else:  # two 4-bit codes per byte, over the buffer in memory order
        assert st["exp_avg_q4"].dtype == torch.uint8 and st["exp_avg_q4"].numel() == math.ceil(33 * 31 / 2)
    assert st["exp_avg_sq_q8"].dtype == torch.uint8
    assert st["exp_avg_scale"].dtype == torch.bfloat16 and st["exp_avg_scale"].numel() == math.ceil(33 * 31 / 32)
    assert "exp_avg" not in st
    saved = sum(t.numel() * t.element_size() for s in sd["state"].values() for t in s.values() if t.dim())
    live = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim())
    assert saved == live  # checkpoint bytes = state bytes
    model_sd = {k: v.clone() for k, v in lin.state_dict().items()}
    gen = torch.Generator().manual_seed(101)
    for _ in range(2):
        for p in lin.parameters():
            p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16).to(DEVICE)
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # our own mode: nothing to warn about
        lin2, opt2 = _run(kw, 5, 2, sd=sd, model_sd=model_sd)
    for a, b in zip(lin.parameters(), lin2.parameters()):
        assert torch.equal(a, b)
        for k, t in opt.state[a].items():
            assert torch.equal(t, opt2.state[b][k]), k


def test_adamw_checkpoint_is_quantized_on_load_with_one_warning(kind):
    torch.manual_seed(2)
    lin = torch.nn.Linear(70, 9).to(torch.bfloat16)
    ref = torch.optim.AdamW(lin.parameters(), lr=1e-3)
    for _ in range(3):
        for p in lin.parameters():
            p.grad = torch.randn_like(p)
        ref.step()
    sd = ref.state_dict()
    opt = FusedAdamWMP(lin.parameters(), lr=1e-3, master_weights="8bit", **_mom(kind))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        opt.load_state_dict(sd)
    msgs = [str(w.message) for w in rec if kind in str(w.message)]
    assert len(msgs) == 1 and "nearest code" in msgs[0], [str(w.message) for w in rec]
    for p, (_, s) in zip(lin.parameters(), sorted(sd["state"].items())):
        for key in ("exp_avg", "exp_avg_sq"):
            want = s[key].double()
            got = _decode64(opt.state[p], key)
            assert ((got - want).abs() <= _half_step(want, key, kind=kind)).all(), key
        assert float(opt.state[p]["step"]) == 3.0


def test_8bit_moments_into_fp32_moments_and_adamw_state_dict_decode_exactly(backend, kind):
    lin, opt = _run(dict(master_weights=True, **_mom(kind)), 3, 3)
    dec = {id(p): {k: _decode64(opt.state[p], k) for k in ("exp_avg", "exp_avg_sq")} for p in lin.parameters()}
    # adamw_state_dict: fp32 moments torch.optim.AdamW takes
    asd = opt.adamw_state_dict()
    ref = torch.optim.AdamW([torch.nn.Parameter(m.detach().clone()) for m in opt.master_params()], lr=1.0)
    ref.load_state_dict(asd)
    for i, p in enumerate(lin.parameters()):
        for k in ("exp_avg", "exp_avg_sq"):
            assert asd["state"][i][k].dtype == torch.float32
            # exp_avg is exact in fp32; exp_avg_sq = (s c^2) c^2 is one fp32 rounding of the exact value
            assert torch.equal(asd["state"][i][k].cpu(), dec[id(p)][k].float())
    # into an optimizer with fp32 moments: decoded exactly, with the layout warning
    opt32 = FusedAdamWMP(lin.parameters(), lr=1e-3, master_weights=True)
    with pytest.warns(UserWarning, match="state_dtype"):
        opt32.load_state_dict(opt.state_dict())
    for p in lin.parameters():
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt32.state[p][k].cpu(), dec[id(p)][k].float())
    # and back into 8 bits: within half a code step (the scales are recomputed from the decoded values)
    opt8 = FusedAdamWMP(lin.parameters(), lr=1e-3, master_weights=True, **_mom(kind))
    with pytest.warns(UserWarning, match="state_dtype"):
        opt8.load_state_dict(opt32.state_dict())
    for p in lin.parameters():
        for k in ("exp_avg", "exp_avg_sq"):
            want = dec[id(p)][k]
            assert ((_decode64(opt8.state[p], k) - want).abs() <= _half_step(want, k, kind=kind)).all()


def test_bf16_moments_checkpoint_into_8bit_within_half_a_step(kind):
    lin, opt = _run(dict(master_weights="remainder", state_dtype=torch.bfloat16), 6, 3)
    sd = opt.state_dict()
    opt8 = FusedAdamWMP(lin.parameters(), lr=1e-3, master_weights="remainder", **_mom(kind))
    with pytest.warns(UserWarning, match="state_dtype"):
        opt8.load_state_dict(sd)
    for i, p in enumerate(lin.parameters()):
        for k in ("exp_avg", "exp_avg_sq"):
            want = sd["state"][i][k].double().cpu()
            assert ((_decode64(opt8.state[p], k) - want).abs() <= _half_step(want, k, kind=kind)).all()


@pytest.mark.parametrize("src, dst", [("8bit", "4bit_m"), ("4bit_m", "8bit")])
def test_one_grouped_kind_into_the_other_with_one_warning(src, dst):
    # through fp32: the decoded source values, quantized again to the nearest code of the new kind
    lin, opt = _run(dict(master_weights="8bit", state_dtype=src), 9, 3)
    sd = opt.state_dict()
    dec = [{k: _decode64(opt.state[p], k) for k in ("exp_avg", "exp_avg_sq")} for p in lin.parameters()]
    opt2 = FusedAdamWMP(lin.parameters(), lr=1e-3, master_weights="8bit", state_dtype=dst)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        opt2.load_state_dict(sd)
    assert len([w for w in rec if "state_dtype" in str(w.message)]) == 1, [str(w.message) for w in rec]
    for p, want in zip(lin.parameters(), dec):
        assert storage.moment_kind(dst).has_state(opt2.state[p])
        for k, w in want.items():
            assert ((_decode64(opt2.state[p], k) - w).abs() <= _half_step(w, k, kind=dst)).all(), k


def test_checkpoint_with_wrong_scale_shape_is_refused_and_nothing_changes(kind):
    _, opt = _run({"master_weights": "8bit", **_mom(kind)}, 7, 2)
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["exp_avg_scale"] = sd["state"][0]["exp_avg_scale"][:-1]
    lin2, opt2 = _run({"master_weights": "8bit", **_mom(kind)}, 8, 1)
    before = {id(p): {k: v.clone() for k, v in opt2.state[p].items()} for p in lin2.parameters()}
    params_before = [p.detach().clone() for p in lin2.parameters()]
    with pytest.raises(ValueError, match="exp_avg_scale"):
        opt2.load_state_dict(sd)
    for p, p0 in zip(lin2.parameters(), params_before):
        assert torch.equal(p, p0)
        for k, v in before[id(p)].items():
            assert torch.equal(opt2.state[p][k], v)


# ---- layouts, bytes, errors ------------------------------------------------------------------------
def test_layout_change_regroups_the_moments(kind):
    # groups are runs of the param's buffer: channels_last regroups them (through fp32, to the
    # nearest code), values kept by index within half a step
    torch.manual_seed(3)
    conv = torch.nn.Conv2d(6, 8, 3).to(torch.bfloat16)
    opt = FusedAdamWMP(conv.parameters(), lr=1e-3, master_weights="8bit", **_mom(kind))
    for _ in range(2):
        for p in conv.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    w = conv.weight
    before = {k: _decode64(opt.state[w], k) for k in ("exp_avg", "exp_avg_sq")}
    conv.to(memory_format=torch.channels_last)
    w = conv.weight
    assert not w.is_contiguous()
    opt.param_groups[0]["lr"] = 0.0
    for p in conv.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    st = opt.state[w]
    assert st["exp_avg_sq_q8"].stride() == w.stride()
    for k, b in before.items():
        decay = B1 if k == "exp_avg" else B2  # one step of a zero grad
        after = _decode64(st, k)
        # regrouped to the nearest code (half a step), then one step's stochastic rounding (one step)
        assert ((after - decay * b).abs() <= 3 * _half_step(b, k, per_tensor=True, kind=kind)).all(), k


def test_bytes_per_param_from_the_descriptions_match_the_state(kind):
    p = torch.nn.Parameter(torch.randn(1024).to(torch.bfloat16))
    # + the bf16 param and its bf16 grad: 7.125 / 8.125 B/param (8-bit), 6.625 / 7.625 (4-bit exp_avg)
    saved = 0.5 if kind == "4bit_m" else 0.0
    for master, want in (("8bit", 7.125 - 4 - saved), ("remainder", 8.125 - 4 - saved)):
        opt = FusedAdamWMP([p], master_weights=master, **_mom(kind))
        p.grad = torch.randn_like(p)
        opt.step()
        got = sum(t.numel() * t.element_size() for k, t in opt.state[p].items() if k != "step") / p.numel()
        assert got == storage.state_bytes_per_param(master, kind, torch.bfloat16) == want


def test_errors_name_the_argument(kind):
    p = torch.nn.Parameter(torch.randn(40).to(torch.bfloat16))
    with pytest.raises(ValueError, match="amsgrad"):
        FusedAdamWMP([p], amsgrad=True, **_mom(kind))
    with pytest.raises(ValueError, match="amsgrad"):
        FusedAdamWMP([p]).add_param_group({"params": [torch.nn.Parameter(torch.randn(3))], "amsgrad": True,
                                           "state_dtype": kind})
    with pytest.raises(ValueError, match="state_dtype"):
        FusedAdamWMP([p], state_dtype="int8")
    with pytest.raises(ValueError, match="amsgrad"):
        storage.state_bytes_per_param(True, kind, torch.bfloat16, amsgrad=True)


def test_modes_may_differ_per_group(backend, kind):
    a = torch.nn.Parameter(torch.randn(300, device=DEVICE).to(torch.bfloat16))
    b = torch.nn.Parameter(torch.randn(300, device=DEVICE).to(torch.bfloat16))
    opt = FusedAdamWMP([{"params": [a], **_mom(kind)}, {"params": [b], "state_dtype": torch.bfloat16}], lr=1e-2)
    a.grad = torch.randn_like(a)
    b.grad = a.grad.clone()
    opt.step()
    assert _m_key(kind) in opt.state[a] and opt.state[b]["exp_avg"].dtype == torch.bfloat16
    assert not torch.equal(a, a.detach().clone().zero_())


def test_compiled_step_fullgraph_equals_eager(backend, kind):
    # the 8-bit state (codes and scales) goes through the same registered op and fake kernel
    torch._dynamo.reset()  # the Optimizer step wrapper is shared: a long session hits its recompile limit
    torch.manual_seed(12)
    w = [torch.randn(10), torch.randn(300)]
    p1 = [torch.nn.Parameter(t.to(torch.bfloat16).to(DEVICE)) for t in w]
    p2 = [torch.nn.Parameter(p.detach().clone()) for p in p1]
    kw = dict(lr=1e-2, max_grad_norm=1.0, master_weights="8bit", seed=4, **_mom(kind))
    o1, o2 = FusedAdamWMP(p1, **kw), FusedAdamWMP(p2, **kw)
    compiled = torch.compile(o2.step, fullgraph=True, backend="aot_eager")
    gen = torch.Generator().manual_seed(13)
    for _ in range(3):
        for a, b in zip(p1, p2):
            g = (torch.randn(a.shape, generator=gen) * 5).to(torch.bfloat16).to(DEVICE)
            a.grad, b.grad = g, g.clone()
        o1.step()
        compiled()
    for a, b in zip(p1, p2):
        assert torch.equal(a, b)
        for k, t in o1.state[a].items():
            assert torch.equal(t, o2.state[b][k]), k


def test_checkpoint_of_another_shape_same_numel_goes_through_fp32(kind):
    # a param saved as (31, 33) and loaded as (33, 31) (a reshaped model): values by flat index
    torch.manual_seed(14)
    a = torch.nn.Parameter(torch.randn(31, 33).to(torch.bfloat16))
    opt = FusedAdamWMP([a], lr=1e-3, **_mom(kind))
    a.grad = torch.randn_like(a)
    opt.step()
    sd = opt.state_dict()
    want = {k: _decode64(opt.state[a], k).reshape(33, 31) for k in ("exp_avg", "exp_avg_sq")}
    b = torch.nn.Parameter(a.detach().reshape(33, 31).clone())
    opt2 = FusedAdamWMP([b], lr=1e-3, **_mom(kind))
    opt2.load_state_dict(sd)
    for k, w in want.items():
        assert ((_decode64(opt2.state[b], k) - w).abs() <= _half_step(w, k, kind=kind)).all()
