"""The codec table (``mpkern/codecs.def``, issue 43 item 7): one declaration read by C++ and Python,
the op's codecs by name on every backend, and a second 8-bit moment format sharing ``int8`` with the
first -- a codec and a storage kind defined in this file alone, run by the torch backend.

``lin8`` keeps ``exp_avg`` as int8 *linear* codes (``q * s``, ``s`` a bf16 per 32 elements, the group
amax / 127) where the built-in ``8bit`` codec keeps int8 *ladder* codes; ``exp_avg_sq`` reuses the
built-in uint8 codes. Both formats are int8 exp_avgs: only the codec's name tells them apart, so a
backend that read the format from the dtype would decode one as the other. The expectations are
float64 computations of AdamW on the decoded codes, written here independently of the kernels.
"""

from __future__ import annotations

import math
from typing import ClassVar

import pytest
import torch

import mpkern
from mpkern import FusedAdamWMP, _backend, _ops, codecs, reference_codecs
from mpkern.optim import storage

GROUP = 32
B1, B2, EPS, LR = 0.9, 0.999, 1e-8, 1e-2


# ---- the table -------------------------------------------------------------------------------------
def test_parser_reads_rows_strings_and_comments():
    """A table written here, with the file's syntax: comments, adjacent literals, parentheses inside strings."""
    text = '''// a comment MPKERN_MASTER_CODEC(kX, "x", 9, Float)
    MPKERN_MASTER_CODEC(kA, "a", 0, Undefined)
    MPKERN_MOMENT_CODEC(kB, "b", 7, Char, Byte, 32, 2)  // trailing
    MPKERN_OP_SCHEMA(f_, "f_(Tensor(a!)[] x, "
                         "int[] y=[]) -> ()")'''
    assert codecs.parse(text) == {"master": [("a", 0, "Undefined")], "moment": [("b", 7, "Char", "Byte", 32, 2)],
                                  "schemas": [("f_", "f_(Tensor(a!)[] x, int[] y=[]) -> ()")]}
    with pytest.raises(ValueError, match="takes 4 arguments"):
        codecs.parse('MPKERN_MASTER_CODEC(kA, "a", 0)')


def test_python_table_is_the_files_rows():
    assert list(codecs.MASTER_CODECS) == ["none", "fp32", "remainder", "8bit"]
    assert [c.state_dtype for c in codecs.MASTER_CODECS.values()] == [None, torch.float32, torch.int16, torch.int8]
    rows = {n: (c.exp_avg_dtype, c.exp_avg_sq_dtype, c.group, c.codes_per_byte, c.native)
            for n, c in codecs.MOMENT_CODECS.items()}
    assert rows == {"float32": (torch.float32, torch.float32, 0, 1, True),
                    "bfloat16": (torch.bfloat16, torch.bfloat16, 0, 1, True),
                    "8bit": (torch.int8, torch.uint8, 32, 1, True), "4bit_m": (torch.uint8, torch.uint8, 32, 2, True)}


@pytest.mark.skipif(_backend.native() is None, reason="needs the native extension")
def test_native_table_is_the_file_and_a_stale_one_is_refused():
    compiled = _backend.native().codec_table()
    codecs.check_native(compiled)  # what _ops does at import
    assert compiled["moment"] == [tuple(r) for r in codecs.parse(codecs.DEF_PATH.read_text())["moment"]]
    stale = dict(compiled, moment=[(*r[:1], r[1] + 1, *r[2:]) for r in compiled["moment"]])
    with pytest.raises(RuntimeError, match="stale build"):
        codecs.check_native(stale)
    with pytest.raises(RuntimeError, match="schemas"):
        codecs.check_native(dict(compiled, schemas={}))


def test_op_schemas_are_the_tables():
    for op, schema in codecs.SCHEMAS.items():
        assert str(getattr(torch.ops.mpkern, op).default._schema) == f"mpkern::{schema}"
    assert str(torch.ops.mpkern_triton.adamw_step_.default._schema) == f"mpkern_triton::{codecs.SCHEMAS['adamw_step_']}"


def test_triton_kernel_modes_are_the_tables():
    pytest.importorskip("triton")
    from mpkern.triton_kernels import adamw

    assert (codecs.MOMENT_CODECS["8bit"].mode, codecs.MOMENT_CODECS["4bit_m"].mode) == (adamw.MOM8, adamw.MOM4)
    assert adamw.GROUP == codecs.MOMENT_CODECS["8bit"].group == reference_codecs.MOM8_GROUP


def test_register_moment_codec_refuses_bad_rows():
    fns = dict(decode_exp_avg=_lin8_decode, decode_exp_avg_sq=_v8_decode, encode_exp_avg=_lin8_encode,
               encode_exp_avg_sq=_v8_encode)
    with pytest.raises(ValueError, match="exists"):
        codecs.register_moment_codec("8bit", torch.int8, torch.uint8, group=GROUP, **fns)
    with pytest.raises(TypeError, match="exp_avg_dtype"):
        codecs.register_moment_codec("x", "int8", torch.uint8, group=GROUP, **fns)
    with pytest.raises(ValueError, match="group"):
        codecs.register_moment_codec("x", torch.int8, torch.uint8, group=-1, **fns)
    with pytest.raises(ValueError, match="codes_per_byte"):
        codecs.register_moment_codec("x", torch.int8, torch.uint8, group=GROUP, codes_per_byte=3, **fns)
    with pytest.raises(TypeError, match="encode_exp_avg"):
        codecs.register_moment_codec("x", torch.int8, torch.uint8, group=GROUP, **dict(fns, encode_exp_avg=1))
    with pytest.raises(ValueError, match="row of"):
        codecs.unregister_moment_codec("8bit")
    assert "x" not in codecs.MOMENT_CODECS


# ---- a second 8-bit format: linear int8 exp_avg codes ------------------------------------------------
def _lin8_encode(x: torch.Tensor, r16: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 q = floor(x / s + r) (r uniform in [0, 1) from the 16 random bits: unbiased), s the bf16 of
    the group amax / 127 (0 for a zero group), |q| <= 127."""
    n = x.numel()
    pad = (-n) % GROUP
    xf = torch.nn.functional.pad(x.reshape(-1).float(), (0, pad)).reshape(-1, GROUP)
    r = torch.nn.functional.pad(r16.reshape(-1).float() / 65536.0, (0, pad)).reshape(-1, GROUP)
    s = (xf.abs().amax(dim=1, keepdim=True) / 127.0).to(torch.bfloat16)
    sf = s.float()
    q = torch.where(sf > 0, torch.floor(xf / torch.where(sf > 0, sf, 1.0) + r), 0.0).clamp(-127, 127)
    return q.to(torch.int8).reshape(-1)[:n].reshape(x.shape), s.reshape(-1)


def _lin8_decode(codes: torch.Tensor, scales: torch.Tensor | None, numel: int) -> torch.Tensor:
    assert scales is not None
    q = codes.reshape(-1).float()
    return q * scales.float().repeat_interleave(GROUP)[:numel]


def _v8_decode(codes: torch.Tensor, scales: torch.Tensor | None, numel: int) -> torch.Tensor:
    assert scales is not None
    return reference_codecs.moment8_decode(codes, scales).reshape(-1)


def _v8_encode(x: torch.Tensor, r16: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return reference_codecs.moment8_encode(x, "exp_avg_sq", r16)


def _lin8_decode64(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The linear codes' values in float64, from their definition."""
    return codes.reshape(-1).double() * scales.double().repeat_interleave(GROUP)[:codes.numel()]


@pytest.fixture
def lin8():
    codec = codecs.register_moment_codec("lin8", torch.int8, torch.uint8, group=GROUP, decode_exp_avg=_lin8_decode,
                                         decode_exp_avg_sq=_v8_decode, encode_exp_avg=_lin8_encode,
                                         encode_exp_avg_sq=_v8_encode)
    try:
        yield codec
    finally:
        codecs.unregister_moment_codec("lin8")


def _op_state(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g), torch.randn(n, generator=g)]
    groups = -(-n // GROUP)
    st = dict(p=p.clone(), m=torch.zeros(n, dtype=torch.int8), v=torch.zeros(n, dtype=torch.uint8),
              sm=torch.zeros(groups, dtype=torch.bfloat16), sv=torch.zeros(groups, dtype=torch.bfloat16),
              step=torch.zeros(()))
    return p, grads, st


def _op_step(backend: str, st: dict, grad: torch.Tensor, codec: str) -> None:
    _ops.adamw_step_(backend, [st["p"]], [grad], [st["m"]], [st["v"]], [], [], [st["step"]], torch.ones(()),
                     torch.zeros(()), None, [st["sm"]], [st["sv"]], lr=LR, beta1=B1, beta2=B2, eps=EPS,
                     weight_decay=0.0, maximize=False, master_codec="none", moment_codec=codec,
                     stochastic_rounding=False, seed=3)


def test_second_int8_format_runs_by_name_on_the_torch_backend(lin8):
    """Two steps of the op with ``moment_codec="lin8"``: the stored codes are linear (within one step of
    the float64 exp_avg), and the second step decodes them as linear codes -- its update is float64
    AdamW on the linear values of the stored codes, not on their ladder values."""
    n = 100  # three full groups and a short one
    p0, grads, st = _op_state(n, 0)
    _op_step("torch", st, grads[0], "lin8")
    assert st["m"].dtype == torch.int8
    g1 = grads[0].double()
    m1 = (1 - B1) * g1
    step1 = _lin8_decode64(torch.ones(GROUP, dtype=torch.int8), st["sm"][:1])[0]  # one code of group 0
    s64 = st["sm"].double().repeat_interleave(GROUP)[:n]
    assert torch.all((_lin8_decode64(st["m"], st["sm"]) - m1).abs() <= s64 * (1 + 1e-9)), "not within one code"
    assert step1 > 0 and st["m"].abs().max() <= 127
    # step 1's update: float64 AdamW from zero moments (fp32 arithmetic: relative 1e-5 of the update, and
    # the fp32 param's rounding: 2.4e-7 absolute for |p| < 4)
    v1 = (1 - B2) * g1 * g1
    upd1 = LR / (1 - B1) * m1 / (v1.sqrt() / math.sqrt(1 - B2) + EPS)
    assert p0.abs().max() < 4
    assert torch.allclose(p0.double() - st["p"].double(), upd1, rtol=1e-5, atol=2.4e-7)
    # step 2 from the stored codes, decoded as linear int8 codes (m) and the built-in uint8 codes (v)
    m1d = _lin8_decode64(st["m"], st["sm"])
    v1d = reference_codecs.moment8_decode(st["v"], st["sv"]).double()
    p1 = st["p"].double().clone()
    _op_step("torch", st, grads[1], "lin8")
    g2 = grads[1].double()
    m2 = m1d + (1 - B1) * (g2 - m1d)
    v2 = v1d * B2 + (1 - B2) * g2 * g2
    upd2 = LR / (1 - B1**2) * m2 / (v2.sqrt() / math.sqrt(1 - B2**2) + EPS)
    assert torch.allclose(p1 - st["p"].double(), upd2, rtol=1e-5, atol=2.4e-7)
    # the same bytes read as the built-in 8-bit (ladder) codes are other values: the name decides
    ladder = reference_codecs.moment8_decode(st["m"], st["sm"]).double()
    assert not torch.allclose(ladder, _lin8_decode64(st["m"], st["sm"]), rtol=0.05)


@pytest.mark.skipif(_backend.native() is None, reason="needs the native extension")
def test_native_kernels_refuse_a_codec_they_do_not_know(lin8):
    _, grads, st = _op_state(64, 1)
    before = st["p"].clone()
    with pytest.raises(ValueError, match="moment_codec must be 'float32', 'bfloat16', '8bit' or '4bit_m', got 'lin8'"):
        _op_step("cpu", st, grads[0], "lin8")
    assert torch.equal(st["p"], before) and st["step"].item() == 0


def test_native_check_takes_a_registered_codecs_row(lin8):
    """The torch backend checks a registered codec's tensors with the native check, given its row."""
    _, grads, st = _op_state(64, 2)
    st["m"] = torch.zeros(64, dtype=torch.uint8)  # lin8 keeps int8 exp_avgs
    with pytest.raises(TypeError, match="moment_codec 'lin8' needs Char exp_avgs"):
        _op_step("torch", st, grads[0], "lin8")
    _, grads, st = _op_state(64, 2)
    st["sm"] = st["sm"][:1]
    with pytest.raises(ValueError, match="exp_avg_scales"):
        _op_step("torch", st, grads[0], "lin8")


class Linear8Moments(storage.Int8Moments):
    """``state_dtype="lin8"``: the 8-bit kind's tensors with linear int8 ``exp_avg`` codes (this file's codec)."""

    name, label, codec = "lin8", "8-bit linear moments", "lin8"
    keys = ("exp_avg_l8", "exp_avg_sq_q8", "exp_avg_scale", "exp_avg_sq_scale")
    kernel_backends = frozenset(("torch",))
    _CODE: ClassVar[dict[str, tuple[str, str]]] = {"exp_avg": ("exp_avg_l8", "exp_avg_scale"),
                                                   "exp_avg_sq": ("exp_avg_sq_q8", "exp_avg_sq_scale")}

    def _encode_m(self, x):
        return _lin8_encode(x, torch.full_like(x, 0x8000, dtype=torch.int64))  # to the nearest code

    def _decode_m(self, codes, scales, numel):
        return _lin8_decode(codes, scales, numel)


@pytest.fixture
def lin8_kind(lin8):
    kind = storage.register_moment_kind(Linear8Moments())
    try:
        yield kind
    finally:
        storage.unregister_moment_kind("lin8")


def test_register_moment_kind_refuses_native_backends_for_a_python_codec(lin8):
    kind = Linear8Moments()
    kind.kernel_backends = storage.ALL_BACKENDS
    with pytest.raises(ValueError, match="torch backend only"):
        storage.register_moment_kind(kind)
    with pytest.raises(ValueError, match="neither"):
        storage.register_moment_kind(type("Nowhere", (Linear8Moments,), {"name": "nowhere", "codec": "nowhere"})())


def test_optimizer_trains_with_the_second_format(lin8_kind):
    """FusedAdamWMP(state_dtype="lin8") on the torch backend: int8 exp_avg state that decodes (float64,
    linear) near fp32 AdamW's exp_avg after 20 steps of the same gradients -- the stochastic rounding
    of each step adds noise of at most a code (variance <= s^2 / 4), decayed by beta1 per step: a
    standard deviation <= 1.15 codes; bounded here by 5 codes per element and 0.5 code on average
    (3.5 sigma for 70 elements) -- and params within 2 % of AdamW's total movement."""
    g = torch.Generator().manual_seed(5)
    w0 = torch.randn(70, generator=g)
    grads = [torch.randn(70, generator=g) for _ in range(20)]
    p = torch.nn.Parameter(w0.clone())
    q = torch.nn.Parameter(w0.clone())
    opt = FusedAdamWMP([p], lr=LR, weight_decay=0.0, master_weights=False, state_dtype="lin8")
    ref = torch.optim.AdamW([q], lr=LR, weight_decay=0.0)
    with mpkern.use_backend("torch"):
        for gr in grads:
            p.grad, q.grad = gr.clone(), gr.clone()
            opt.step()
            ref.step()
    st = opt.state[p]
    assert st["exp_avg_l8"].dtype == torch.int8 and "exp_avg_q8" not in st
    m = _lin8_decode64(st["exp_avg_l8"], st["exp_avg_scale"])
    s64 = st["exp_avg_scale"].double().repeat_interleave(GROUP)[:70]
    err = (m - ref.state[q]["exp_avg"].double()) / s64
    assert err.abs().max() <= 5 and err.mean().abs() <= 0.5
    moved = (q.detach() - w0).abs().sum()
    assert (p.detach() - q.detach()).abs().sum() <= 0.02 * moved
    with pytest.raises(NotImplementedError, match="no kernel for state_dtype='lin8'"), mpkern.use_backend("cpu"):
        p.grad = grads[0].clone()
        opt.step()
