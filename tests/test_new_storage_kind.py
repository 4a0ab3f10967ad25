"""Adding a storage kind = one description (+ its kernel variants): a moment kind defined here alone.

``Fp16Moments`` keeps ``exp_avg`` as float16 and ``exp_avg_sq`` as float16 times 2^10 (a power of two,
so that small second moments stay normal numbers; decoding is exact). It has no kernel variant: on
the ``torch`` backend the step decodes it to fp32, runs the reference step and encodes it back; a
native backend refuses it by name. Registered for each test by a fixture and removed afterwards,
so no other test sees it.
"""

from __future__ import annotations

import contextlib
import io
import math

import pytest
import torch

import mpkern
from mpkern import FusedAdamWMP, cli as mpkern_cli, plan
from mpkern.optim import storage

V_SCALE = 2.0**10
KEYS = ("exp_avg_f16", "exp_avg_sq_f16")


def encode(x: torch.Tensor, key: str) -> torch.Tensor:
    """The reference encoding of this kind: fp32 -> fp16 (round to nearest), v scaled by 2^10."""
    return (x * V_SCALE if key == "exp_avg_sq" else x).to(torch.float16)


def decode(t: torch.Tensor, key: str) -> torch.Tensor:
    x = t.to(torch.float32)
    return x / V_SCALE if key == "exp_avg_sq" else x


class Fp16Moments(storage.MomentKind):
    name, label = "float16-test", "fp16 moments"
    keys = KEYS

    def bytes_per_element(self) -> float:
        return 4.0

    def create(self, p):
        return {k: storage.like(p, torch.float16).zero_() for k in self.keys}

    def from_fp32(self, p, m, v):
        return {KEYS[0]: storage.laid(p, encode(m.float(), "exp_avg"), torch.float16),
                KEYS[1]: storage.laid(p, encode(v.float(), "exp_avg_sq"), torch.float16)}

    def to_fp32(self, st, key):
        return decode(st[KEYS[0] if key == "exp_avg" else KEYS[1]], key)


@pytest.fixture
def kind():
    k = storage.register_moment_kind(Fp16Moments())
    try:
        yield k
    finally:
        storage.unregister_moment_kind(k.name)


@pytest.fixture
def torch_backend(monkeypatch):
    monkeypatch.setenv("MPKERN_BACKEND", "torch")


def _problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w_true = torch.randn(16, 4, generator=g)
    x = torch.randn(64, 16, generator=g)
    y = x @ w_true
    w = torch.nn.Parameter((torch.randn(16, 4, generator=g) * 0.1).to(torch.bfloat16))
    return w, x, y


def _loss(w, x, y):
    return ((x.to(w.dtype) @ w).float() - y).square().mean()


def _train(opt, w, x, y, steps):
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = _loss(w, x, y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def test_registry_lists_the_new_kind(kind):
    assert (True, kind.name) in storage.modes()
    assert storage.label(True, kind.name) == "fp32 master + fp32 moments".replace("fp32 moments", "fp16 moments")
    assert storage.bytes_per_param(True, kind.name) == 4 + 4  # fp32 master + two fp16 moments
    assert storage.parse_moments(kind.name) == kind.name


def test_not_registered_outside_the_fixture():
    assert "float16-test" not in storage.MOMENT_KINDS
    with pytest.raises(ValueError, match="state_dtype"):
        FusedAdamWMP([torch.nn.Parameter(torch.randn(3))], state_dtype="float16-test")


def test_first_step_matches_float64_adamw(kind, torch_backend):
    w, x, y = _problem()
    opt = FusedAdamWMP([w], lr=1e-2, weight_decay=0.0, state_dtype=kind.name)
    _loss(w, x, y).backward()
    g = w.grad.double()
    opt.step()
    st = opt.state[w]
    assert set(KEYS) <= set(st) and "exp_avg" not in st
    # float64 AdamW's first moments, then this kind's encoding (fp16 rounding: half an ulp, 2^-11)
    m64, v64 = 0.1 * g, 0.001 * g * g
    torch.testing.assert_close(decode(st[KEYS[0]], "exp_avg").double(), m64, rtol=2.0**-10, atol=0)
    torch.testing.assert_close(decode(st[KEYS[1]], "exp_avg_sq").double(), v64, rtol=2.0**-10, atol=0)


def test_trains_loss_falls(kind, torch_backend):
    w, x, y = _problem()
    losses = _train(FusedAdamWMP([w], lr=3e-2, state_dtype=kind.name), w, x, y, 40)
    assert losses[-1] < 0.2 * losses[0]


def test_state_dict_round_trip_is_bit_identical(kind, torch_backend):
    w, x, y = _problem()
    opt = FusedAdamWMP([w], lr=1e-2, state_dtype=kind.name)
    _train(opt, w, x, y, 5)
    sd = opt.state_dict()
    assert set(KEYS) <= set(sd["state"][0]) and sd["param_groups"][0]["state_dtype"] == kind.name
    w2 = torch.nn.Parameter(w.detach().clone())
    opt2 = FusedAdamWMP([w2], lr=1e-2, state_dtype=kind.name)
    opt2.load_state_dict(sd)
    _train(opt, w, x, y, 3)
    _train(opt2, w2, x, y, 3)
    assert torch.equal(w, w2)
    for k in (*KEYS, "master_param", "step"):
        assert torch.equal(opt.state[w][k], opt2.state[w2][k]), k


def test_loads_a_plain_adamw_checkpoint(kind, torch_backend):
    w, x, y = _problem()
    w32 = torch.nn.Parameter(w.detach().float())
    ref = torch.optim.AdamW([w32], lr=1e-2)
    _train(ref, w32, x.float(), y, 3)
    opt = FusedAdamWMP([w], lr=1e-2, state_dtype=kind.name)
    opt.load_state_dict(ref.state_dict())
    st, rst = opt.state[w], ref.state[w32]
    assert torch.equal(st[KEYS[0]], rst["exp_avg"].to(torch.float16))  # independent of the kind's code
    assert torch.equal(st[KEYS[1]], (rst["exp_avg_sq"] * V_SCALE).to(torch.float16))
    assert float(st["step"]) == 3
    _train(opt, w, x, y, 2)  # and it steps on


@pytest.mark.parametrize("other", ["float32", "bfloat16", "8bit"])
def test_converts_to_and_from_another_kind(kind, torch_backend, other):
    w, x, y = _problem()
    opt = FusedAdamWMP([w], lr=1e-2, state_dtype=kind.name)
    _train(opt, w, x, y, 3)
    m16 = opt.state[w][KEYS[0]].float()
    v16 = opt.state[w][KEYS[1]].float() / V_SCALE
    # ours -> other: the other kind's moments are ours decoded, in its own storage
    w2 = torch.nn.Parameter(w.detach().clone())
    opt2 = FusedAdamWMP([w2], lr=1e-2, state_dtype=other)
    with pytest.warns(UserWarning, match="state_dtype"):
        opt2.load_state_dict(opt.state_dict())
    m_o = storage.moments_fp32(opt2.state[w2], "exp_avg")
    v_o = storage.moments_fp32(opt2.state[w2], "exp_avg_sq")
    tol = {"float32": 0.0, "bfloat16": 2.0**-8, "8bit": 0.02}[other]
    torch.testing.assert_close(m_o, m16, rtol=tol, atol=tol * float(m16.abs().max()))
    torch.testing.assert_close(v_o, v16, rtol=tol, atol=tol * float(v16.abs().max()))
    # other -> ours: back into fp16 storage
    w3 = torch.nn.Parameter(w.detach().clone())
    opt3 = FusedAdamWMP([w3], lr=1e-2, state_dtype=kind.name)
    with pytest.warns(UserWarning, match="state_dtype"):
        opt3.load_state_dict(opt2.state_dict())
    assert torch.equal(opt3.state[w3][KEYS[0]], m_o.to(torch.float16))
    assert torch.equal(opt3.state[w3][KEYS[1]], (v_o * V_SCALE).to(torch.float16))
    if other == "float32":  # fp16 -> fp32 -> fp16 is exact
        assert torch.equal(opt3.state[w3][KEYS[0]], opt.state[w][KEYS[0]])


def test_plan_lists_it_with_its_bytes(kind):
    rows = plan.plan_table(7e9)
    row = next(r for r in rows if "fp16 moments" in r["recipe"])
    assert row["moments_B"] == 4.0 and row["masters_B"] == 4.0
    assert row["total_B"] == 2 + 2 + 4 + 4  # bf16 weight + grad, fp32 master, two fp16 moments
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert mpkern_cli.main(["plan", "--params", "7e9"]) == 0
    assert "fp16 moments" in out.getvalue()


@pytest.mark.parametrize("native", ["cpu"])
def test_native_backend_has_no_kernel_for_it(kind, native):
    w, x, y = _problem()
    opt = FusedAdamWMP([w], lr=1e-2, state_dtype=kind.name)
    w0 = w.detach().clone()
    _loss(w, x, y).backward()
    with mpkern.use_backend(native), pytest.raises(NotImplementedError) as e:
        opt.step()
    assert f"'{native}' backend has no kernel for state_dtype='float16-test'" in str(e.value)
    # the refusal names the API that picks another backend, and that API exists
    assert "mpkern.use_backend(name)" in str(e.value) and callable(mpkern.use_backend)
    assert torch.equal(w, w0) and not opt.state  # refused before anything was touched
    with mpkern.use_backend("torch"):  # the backend the message points to: it runs there
        opt.step()
    assert not torch.equal(w, w0)


def test_compare_and_bench_take_it_by_name(kind, torch_backend):
    """``mpkern compare --optimizer-state MASTER:MOMENTS`` and ``bench --modes`` read the registry:
    the new kind trains in compare with its bytes, without an edit to compare or bench."""
    from mpkern import compare
    from mpkern.bench.modes import adamw_modes

    assert adamw_modes(f"remainder:{kind.name}") == [("remainder", kind.name)]
    tiny = dict(steps=4, warmup=1, log_every=2, batch_size=4, seq_len=8, d_model=16, heads=2, layers=1, classes=5,
                noise_vocab=7, val_size=40)
    res = compare.run("mpkern-bf16", device="cpu", progress=False, plot=False, linear="torch",
                      optimizer_state=f"fp32:{kind.name}", **tiny)
    run = res["runs"][0]
    assert f"state_dtype={kind.name}" in run["optimizer"]
    assert run["state_bytes_per_param"]["moments"] == pytest.approx(4.0)
    assert all(math.isfinite(x) for x in run["losses"])
    with pytest.raises(ValueError, match="MASTER:MOMENTS"):
        compare.run("mpkern-bf16", device="cpu", progress=False, plot=False, optimizer_state="fp32:nope", **tiny)


# ---- master kinds register the same way ---------------------------------------------------------
class OtherFp32Master(storage.MasterKind):
    """A master kind defined here alone (its registry behaviour is what is tested, not a step): an fp32
    master under another name, with no kernel variant."""

    name, accepts, label = "fp32-test", ("fp32-test",), "fp32 master (test)"
    key, state_dtype = "master_fp32_test", torch.float32
    kernel_backends = frozenset()


def test_a_master_kind_registers_lists_parses_counts_and_leaves_no_trace():
    before = (dict(storage.MASTER_KINDS), list(storage.STORED_MASTERS), storage.modes())
    kind = storage.register_master_kind(OtherFp32Master(), ("halved",))
    try:
        assert storage.MASTER_KINDS["fp32-test"] is kind and storage.STORED_MASTERS[-1] is kind
        assert storage.check_master_weights("fp32-test") is kind
        assert storage.parse_master("HALVED") == "fp32-test" == storage.parse_master("fp32-test")
        assert storage.parse_mode("fp32-test:8bit") == ("fp32-test", "8bit")
        # every moment kind pairs with it; 4 bytes of master + the moment kind's own
        assert [m for m in storage.modes() if m[0] == "fp32-test"] == [("fp32-test", n) for n in storage.MOMENT_KINDS]
        assert storage.bytes_per_param("fp32-test", "8bit") == 4.0 + storage.bytes_per_param(False, "8bit")
        assert storage.label("fp32-test", "float32") == "fp32 master (test) + fp32 moments"
        assert storage.modes(backend="cpu") == before[2]  # no kernel: not a mode of a native backend
        with pytest.raises(NotImplementedError, match="no kernel for master_weights='fp32-test'"):
            storage.check_backend(kind, "float32", "cpu")
        # a value or a word already taken is refused, and the registry is left as it was
        for dup, words in ((OtherFp32Master(), ()), (storage.Fp32Master(), ("other",)),
                           (type("Other", (OtherFp32Master,), {"accepts": ("x",)})(), ("true",))):
            with pytest.raises(ValueError, match="already registered"):
                storage.register_master_kind(dup, words)
        assert storage.MASTER_KINDS["fp32-test"] is kind and "x" not in storage.MASTER_KINDS
        with pytest.raises(TypeError, match="want a MasterKind"):
            storage.register_master_kind(storage.MomentKind())
    finally:
        storage.unregister_master_kind("fp32-test")
    assert (dict(storage.MASTER_KINDS), list(storage.STORED_MASTERS), storage.modes()) == before
    with pytest.raises(ValueError, match="master kind 'halved'"):
        storage.parse_master("halved")
