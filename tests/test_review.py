"""Issue 13: silent wrongness found by a review of main -- each test failed before its fix.

References are float64 computations written here (or bitwise facts: a step at lr 0 must change
nothing), never numbers produced by the code under test.
"""

from __future__ import annotations

import copy
import math
import os
import warnings

import pytest
import torch

import mpkern
from conftest import DEVICE
from mpkern import FusedAdamWMP

B1, B2, EPS = 0.9, 0.999, 1e-8


def _adamw64_first_step(w: torch.Tensor, g: torch.Tensor, lr: float, wd: float) -> torch.Tensor:
    """float64 AdamW after one step from zero moments."""
    w, g = w.double(), g.double()
    m, v = (1 - B1) * g, (1 - B2) * g * g
    denom = v.sqrt() / math.sqrt(1 - B2) + EPS
    return w * (1 - lr * wd) - lr / (1 - B1) * m / denom


# ---- 1: tied weights: the gradient is main_grad + grad, for every consumer --------------------------
class _TiedLM(torch.nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 16) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, dim)
        self.mix = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, like GPT-2's lm_head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.wte(ids))))


def _tied_pair(seed: int):
    torch.manual_seed(seed)
    ref = _TiedLM().double().to(DEVICE)
    model = _TiedLM().to(DEVICE)
    model.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
    model = mpkern.nn.convert(model.to(torch.bfloat16), fp32_main_grad=True)
    ids = torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(seed + 1)).to(DEVICE)
    tgt = torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(seed + 2)).to(DEVICE)
    for m in (ref, model):
        torch.nn.functional.cross_entropy(m(ids).float().flatten(0, 1), tgt.flatten()).backward()
    return ref, model


def test_tied_weight_gradient_is_the_sum_everywhere(backend):
    ref, model = _tied_pair(0)
    w = model.wte.weight
    assert w.main_grad is not None and w.grad is not None  # both parts are there before a consumer runs
    want = ref.wte.weight.grad  # float64 autograd: embedding part + head part
    # unscale_ (norm) and mpkern.clip_grad_norm_ see the whole gradient
    res = mpkern.unscale_([w])
    assert float(res.total_norm) == pytest.approx(float(want.norm()), rel=2e-2)
    assert w.grad is None  # folded: a second consumer cannot add it twice
    torch.testing.assert_close(w.main_grad.double(), want, rtol=3e-2, atol=2e-3)
    norm = mpkern.clip_grad_norm_([w], max_norm=1e9)
    assert float(norm) == pytest.approx(float(want.norm()), rel=2e-2)


def test_tied_weight_optimizer_steps_with_the_sum(backend):
    ref, model = _tied_pair(1)
    w = model.wte.weight
    g = w.main_grad.double() + w.grad.double()  # what the step must use
    torch.testing.assert_close(g, ref.wte.weight.grad, rtol=3e-2, atol=2e-3)
    w0 = w.detach().clone()
    opt = FusedAdamWMP(model.parameters(), lr=1e-3, weight_decay=0.0)
    opt.step()
    # exp_avg after one step is (1 - beta1) * grad: the embedding part must not be dropped
    torch.testing.assert_close(opt.state[w]["exp_avg"].double(), (1 - B1) * g, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(opt.state[w]["master_param"].double(), _adamw64_first_step(w0, g, 1e-3, 0.0),
                               rtol=1e-6, atol=1e-7)


def test_tied_weight_under_max_grad_norm(backend):
    ref, model = _tied_pair(2)
    want = ref.wte.weight.grad.norm()
    opt = FusedAdamWMP([model.wte.weight], lr=1e-3, max_grad_norm=1e9)
    opt.step()
    assert float(opt.last_grad_norm) == pytest.approx(float(want), rel=2e-2)


# ---- 2: writes through .data -----------------------------------------------------------------------
def _bf16_step_model(seed: int, master=True):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(8, 4).to(DEVICE).to(torch.bfloat16)
    opt = FusedAdamWMP(lin.parameters(), lr=1e-2, weight_decay=0.0, master_weights=master)
    for p in lin.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return lin, opt


@pytest.mark.parametrize("master", [True, "remainder"])
def test_data_assignment_is_seen(backend, master):
    lin, opt = _bf16_step_model(0, master)
    new = torch.full_like(lin.weight, 3.0)
    lin.weight.data = new  # no version bump: only the data pointer tells
    g = torch.randn_like(lin.weight)
    lin.weight.grad = g
    lin.bias.grad = torch.randn_like(lin.bias)
    st = opt.state[lin.weight]
    m0, v0 = st["exp_avg"].double(), st["exp_avg_sq"].double()
    opt.step()
    m = B1 * m0 + (1 - B1) * g.double()
    v = B2 * v0 + (1 - B2) * g.double() ** 2
    want = 3.0 - 1e-2 * (m / (1 - B1**2)) / ((v / (1 - B2**2)).sqrt() + EPS)
    torch.testing.assert_close(opt.master_params()[0].double(), want, rtol=0, atol=1e-5)


def test_data_inplace_write_needs_resync(backend):
    # writes through a .data alias bypass every counter PyTorch keeps; resync_masters() is the way
    lin, opt = _bf16_step_model(1)
    lin.weight.data.fill_(3.0)
    opt.resync_masters()
    assert torch.equal(opt.master_params()[0], torch.full_like(opt.master_params()[0], 3.0))
    lin.weight.grad = torch.randn_like(lin.weight)
    opt.step()
    assert (opt.master_params()[0] - 3.0).abs().max() < 0.05  # one lr-sized step from 3, not the old master


# ---- 3: layout and dtype changes after the first step -------------------------------------------------
def test_channels_last_after_first_step_changes_nothing_at_lr0(backend):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 8, 3).to(DEVICE).to(torch.bfloat16)
    opt = FusedAdamWMP(conv.parameters(), lr=1e-2, weight_decay=0.0)
    for p in conv.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    conv.to(memory_format=torch.channels_last)
    assert not conv.weight.is_contiguous()
    before = conv.weight.detach().clone()
    master = opt.state[conv.weight]["master_param"].clone()
    for group in opt.param_groups:
        group["lr"] = 0.0
    for p in conv.parameters():
        p.grad = torch.randn_like(p).contiguous(memory_format=torch.channels_last) if p.dim() == 4 else \
            torch.randn_like(p)
    opt.step()
    assert torch.equal(conv.weight, before)
    assert torch.equal(opt.state[conv.weight]["master_param"], master)


def test_model_to_bf16_after_fp32_steps(backend):
    torch.manual_seed(1)
    lin = torch.nn.Linear(8, 4).to(DEVICE)
    opt = FusedAdamWMP(lin.parameters(), lr=1e-2, weight_decay=0.0)
    for p in lin.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    lin.to(torch.bfloat16)  # was a bare KeyError: 'master_param'
    for p in lin.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    st = opt.state[lin.weight]
    assert st["master_param"].dtype == torch.float32
    assert torch.equal(lin.weight, st["master_param"].to(torch.bfloat16))


def test_model_float_after_bf16_steps_gets_the_masters_back(backend):
    lin, opt = _bf16_step_model(2)
    masters = [m.clone() for m in opt.master_params()]
    lin.float()
    for p, m in zip(lin.parameters(), masters):
        assert not torch.equal(p, m)  # p.float() of bf16: the low bits are gone ...
    for p in lin.parameters():
        p.grad = torch.zeros_like(p)
    for group in opt.param_groups:
        group["lr"] = 0.0
    opt.step()
    for p, m in zip(lin.parameters(), masters):
        assert torch.equal(p, m)  # ... and the optimizer's masters put them back


def test_shape_change_is_a_clear_error_and_nothing_is_stepped(backend):
    torch.manual_seed(3)
    a, b = torch.nn.Linear(4, 4).to(DEVICE), torch.nn.Linear(4, 4).to(DEVICE)
    opt = FusedAdamWMP([{"params": a.parameters()}, {"params": b.parameters(), "lr": 1e-3}], lr=1e-2)
    for p in [*a.parameters(), *b.parameters()]:
        p.grad = torch.randn_like(p)
    opt.step()
    b.weight.data = torch.randn(5, 4, device=DEVICE)
    b.weight.grad = torch.randn(5, 4, device=DEVICE)
    snap = [p.detach().clone() for p in a.parameters()]
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in a.parameters()]
    with pytest.raises(ValueError, match="shape"):
        opt.step()
    # group 0 comes first and must not have been stepped (no half-taken step)
    for p, s, st in zip(a.parameters(), snap, state):
        assert torch.equal(p, s)
        for k, v in st.items():
            assert torch.equal(opt.state[p][k], v)


# ---- 4: GradScaler misses an overflow in main_grad -------------------------------------------------
def _scaled_setup(max_grad_norm=None, dtype=torch.float16):
    torch.manual_seed(4)
    lin = torch.nn.Linear(8, 4, bias=True).to(DEVICE).to(dtype)
    opt = FusedAdamWMP(lin.parameters(), lr=1e-2, max_grad_norm=max_grad_norm)
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=2.0**10)
    scaler.scale(torch.ones((), device=DEVICE))  # creates the scale
    return lin, opt, scaler


@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_scaler_step_sees_main_grad_overflow(backend, max_grad_norm):
    lin, opt, scaler = _scaled_setup(max_grad_norm)
    opt.attach_grad_scaler(scaler)  # the protocol that lets the step record a main_grad overflow (issue 19)
    for p in lin.parameters():  # warm-up step: state exists
        p.grad = torch.randn_like(p)
    scaler.step(opt)
    scaler.update()
    before = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in lin.parameters()}
    params = [p.detach().clone() for p in lin.parameters()]
    lin.weight.grad = None
    lin.weight.main_grad = torch.randn(lin.weight.shape, device=DEVICE)
    lin.weight.main_grad[1, 2] = float("inf")
    lin.bias.grad = torch.randn_like(lin.bias)  # finite: GradScaler's own check finds nothing
    scale = float(scaler.get_scale())
    scaler.step(opt)
    scaler.update()
    assert float(scaler.get_scale()) == scale * 0.5  # backed off
    for p, p0 in zip(lin.parameters(), params):
        assert torch.equal(p, p0)
        for k, v in before[id(p)].items():
            assert torch.equal(opt.state[p][k], v)


def test_torch_scaler_unscale_with_main_grad_is_an_error(backend):
    lin, opt, scaler = _scaled_setup(dtype=torch.bfloat16)  # torch's unscale_ refuses fp16 grads
    lin.weight.main_grad = torch.randn(lin.weight.shape, device=DEVICE)
    lin.bias.grad = torch.randn_like(lin.bias)
    scaler.unscale_(opt)  # unscales .grad only: main_grad would be stepped at 1024x
    with pytest.raises(ValueError, match=r"mpkern\.unscale_"):
        scaler.step(opt)


# ---- 5: every clip applies ---------------------------------------------------------------------------
def _clip_case(seed: int):
    torch.manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(300, device=DEVICE).to(torch.bfloat16))
    g = (torch.randn(300, device=DEVICE) * 20).to(torch.bfloat16)
    return p, g


@pytest.mark.parametrize("how", ["unscale_scaler", "unscale_inv", "clip_method_larger", "clip_method_smaller"])
def test_max_grad_norm_and_pending_factor_both_apply(backend, how):
    p, g = _clip_case(5)
    scale = 2.0**8
    opt = FusedAdamWMP([p], lr=1e-3, max_grad_norm=1.0)
    p.grad = g
    g64 = g.double()
    if how == "unscale_scaler":
        scaler = torch.amp.GradScaler(DEVICE.type, init_scale=scale)
        scaler.scale(torch.ones((), device=DEVICE))
        p.grad = (g64 * scale).to(torch.bfloat16)
        mpkern.unscale_(opt, scaler=scaler)  # no max_norm: the optimizer's own threshold must still apply
        scaler.step(opt)
        want_coef = min(1.0, 1.0 / (float(g64.norm()) + 1e-6))
    elif how == "unscale_inv":
        p.grad = (g64 * scale).to(torch.bfloat16)
        mpkern.unscale_(opt, 1 / scale, max_norm=5.0)
        opt.step()
        want_coef = min(1.0, 1.0 / (float(g64.norm()) + 1e-6))
    else:
        thr = 5.0 if how == "clip_method_larger" else 0.25
        norm = opt.clip_grad_norm_(thr)
        assert float(norm) == pytest.approx(float(g64.norm()), rel=1e-3)
        opt.step()
        want_coef = min(1.0, min(thr, 1.0) / (float(g64.norm()) + 1e-6))
    torch.testing.assert_close(opt.state[p]["exp_avg"].double(), (1 - B1) * g64 * want_coef, rtol=2e-3, atol=1e-7)


def test_clip_grad_norm_after_scaler_unscale_sees_unscaled_grads(backend):
    p, g = _clip_case(6)
    scale = 2.0**8
    opt = FusedAdamWMP([p], lr=1e-3)
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=scale)
    scaler.scale(torch.ones((), device=DEVICE))
    p.grad = (g.double() * scale).to(torch.bfloat16)
    mpkern.unscale_(opt, scaler=scaler)
    norm = opt.clip_grad_norm_(1.0)  # used to replace the pending unscale with factor 1: grads 256x
    assert float(norm) == pytest.approx(float(g.double().norm()), rel=1e-3)
    scaler.step(opt)
    coef = 1.0 / (float(g.double().norm()) + 1e-6)
    torch.testing.assert_close(opt.state[p]["exp_avg"].double(), (1 - B1) * g.double() * coef, rtol=2e-3,
                               atol=1e-7)


def _remainder_run(seed: int, shape: tuple[int, int], steps: int):
    """A bf16 Linear stepped ``steps`` times with master_weights="remainder" (random grads)."""
    torch.manual_seed(seed)
    src = torch.nn.Linear(*shape).to(DEVICE).to(torch.bfloat16)
    opt = FusedAdamWMP(src.parameters(), lr=1e-2, master_weights="remainder")
    for _ in range(steps):
        for p in src.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    return src, opt


def _load_into_fp32_master(shape: tuple[int, int], model_sd, opt_sd, optimizer_first: bool) -> FusedAdamWMP:
    """A fresh bf16 Linear + FusedAdamWMP(master_weights=True) loaded from the two state dicts in
    the given order; returns the optimizer."""
    dst = torch.nn.Linear(*shape).to(DEVICE).to(torch.bfloat16)
    new = FusedAdamWMP(dst.parameters(), lr=1e-2, master_weights=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "converted" (layout differs)
        if optimizer_first:
            new.load_state_dict(opt_sd)
            dst.load_state_dict(model_sd)
        else:
            dst.load_state_dict(model_sd)
            new.load_state_dict(opt_sd)
    return new


# ---- 7: a "remainder" checkpoint into master_weights=True, either load order -----------------------
@pytest.mark.parametrize("optimizer_first", [True, False])
def test_remainder_checkpoint_to_fp32_master_any_order(backend, optimizer_first):
    src, opt = _remainder_run(7, (40, 104), 3)
    model_sd = {k: v.clone() for k, v in src.state_dict().items()}
    opt_sd = opt.state_dict()
    # the exact fp32 masters, rebuilt here from the bits (bf16 high half + int16 low half)
    want = []
    for p in src.parameters():
        hi = p.detach().view(torch.int16).to(torch.int64) & 0xFFFF
        lo = opt.state[p]["master_remainder"].to(torch.int64)
        want.append(((hi << 16) + lo).to(torch.int32).view(torch.float32))
    torch.manual_seed(8)
    new = _load_into_fp32_master((40, 104), model_sd, opt_sd, optimizer_first)
    for m, w in zip(new.master_params(), want):
        assert torch.equal(m, w)


# ---- 12: a param listed twice in one group steps like torch.optim.AdamW -----------------------------
def test_duplicate_param_in_group_matches_adamw(backend):
    torch.manual_seed(12)
    a = torch.nn.Parameter(torch.randn(33, device=DEVICE))
    b = torch.nn.Parameter(a.detach().clone())
    with pytest.warns(UserWarning, match="duplicate"):
        ref = torch.optim.AdamW([b, b], lr=1e-2, foreach=False)
    with pytest.warns(UserWarning, match="duplicate"):
        opt = FusedAdamWMP([a, a], lr=1e-2)
    for i in range(3):
        g = torch.randn(33, generator=torch.Generator().manual_seed(i)).to(DEVICE)
        a.grad, b.grad = g.clone(), g.clone()
        ref.step()
        opt.step()
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert float(opt.state[a]["step"]) == float(ref.state[b]["step"]) == 6.0


# ---- 14: "remainder" masters of params that share one storage ----------------------------------------
def test_remainder_of_views_survives_a_write_to_another_view(backend):
    torch.manual_seed(14)
    flat = torch.randn(64 + 96, device=DEVICE).to(torch.bfloat16)
    a, b = torch.nn.Parameter(flat[:64]), torch.nn.Parameter(flat[64:])
    opt = FusedAdamWMP([a, b], lr=1e-3, weight_decay=0.0, master_weights="remainder")
    for _ in range(3):
        a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
        opt.step()
    want_b = opt.master_params()[1].clone()
    assert torch.count_nonzero(opt.state[b]["master_remainder"]) > 0
    with torch.no_grad():
        a.fill_(0.5)  # bumps the version counter that a and b share
    assert torch.equal(opt.master_params()[1], want_b)  # b's fp32 low bits are kept
    assert (opt.master_params()[0] - 0.5).abs().max() <= 2.0**-9  # a: the written value, within half a bf16 ulp


# ---- 13 and 6: distributed state dicts and Partial grads (a one-rank gloo group in this process) -----
@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    store = dist.FileStore(os.fspath(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("opts", [{"full_state_dict": True}, {"cpu_offload": True}])
def test_dcp_full_and_offloaded_optimizer_state_dict(one_rank_group, opts):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    torch.manual_seed(13)
    model = torch.nn.Linear(8, 4).to(torch.bfloat16)
    opt = FusedAdamWMP(model.parameters(), lr=1e-2, state_dtype=torch.bfloat16)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    sd = get_optimizer_state_dict(model, opt, options=StateDictOptions(**opts))  # raised on torch.dtype values
    for group in sd["param_groups"]:
        assert not any(isinstance(v, torch.dtype) for v in group.values())
    assert sd["state"]["weight"]["exp_avg"].dtype == torch.bfloat16
    assert torch.equal(sd["state"]["weight"]["master_param"], opt.state[model.weight]["master_param"])


def test_partial_dtensor_grad_is_refused(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    p = torch.nn.Parameter(distribute_tensor(torch.randn(16), mesh, [Replicate()]))
    opt = FusedAdamWMP([p], lr=1e-2)
    p.grad = DTensor.from_local(torch.randn(16), mesh, [Partial()])
    before = p.detach().full_tensor().clone()
    with pytest.raises(ValueError, match="Partial"):
        opt.step()
    assert torch.equal(p.detach().full_tensor(), before)
    assert not opt.state.get(p)


# ---- 11: fp32_main_grad with FSDP2 is refused (the grad would land on the unsharded param) ----------
def test_convert_main_grad_refuses_sharded_params(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    lin = torch.nn.Linear(4, 4).to(torch.bfloat16)
    lin.weight = torch.nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [Shard(0)]))
    with pytest.raises(ValueError, match="FSDP2"):
        mpkern.nn.convert(torch.nn.Sequential(lin), fp32_main_grad=True)
    assert type(lin) is torch.nn.Linear  # nothing converted


# ---- issue 14's first point, on the nn side: autocast no longer silently drops fp32_main_grad -------
def test_autocast_over_bf16_weights_keeps_main_grad():
    torch.manual_seed(15)
    lin = mpkern.nn.convert(torch.nn.Linear(8, 4).to(DEVICE).to(torch.bfloat16), fp32_main_grad=True)
    x = torch.randn(6, 8, device=DEVICE)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert lin.weight.grad is None and lin.weight.main_grad is not None
    want = torch.ones(6, 4, dtype=torch.float64).t() @ x.to(torch.bfloat16).double()  # dW = dY^T X
    torch.testing.assert_close(lin.weight.main_grad.double(), want, rtol=1e-5, atol=1e-5)


def test_main_grad_layer_over_fp32_weights_warns_once():
    lin = mpkern.nn.convert(torch.nn.Linear(8, 4).to(DEVICE), fp32_main_grad=True)
    x = torch.randn(3, 8, device=DEVICE)
    with pytest.warns(UserWarning, match="not main_grad"), torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        lin(x).float().sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            lin(x)
    assert lin.weight.grad is not None and getattr(lin.weight, "main_grad", None) is None


# ---- issue 15: opt.adamw_state_dict() is what torch.optim.AdamW loads ----------------------------------
@pytest.mark.parametrize("master,state_dtype", [(True, torch.float32), ("remainder", torch.bfloat16)])
def test_adamw_state_dict_continues_in_torch_adamw(master, state_dtype):
    torch.manual_seed(20)
    model = torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.Linear(8, 3)).to(torch.bfloat16)
    groups = [{"params": model[0].parameters()}, {"params": model[1].parameters(), "weight_decay": 0.0}]
    opt = FusedAdamWMP(groups, lr=1e-2, master_weights=master, state_dtype=state_dtype, max_grad_norm=5.0)
    gen = torch.Generator().manual_seed(21)
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
        opt.step()
    sd = opt.adamw_state_dict()
    masters = [torch.nn.Parameter(m.detach().clone()) for m in opt.master_params()]
    ref = torch.optim.AdamW([{"params": masters[:2]}, {"params": masters[2:], "weight_decay": 0.0}], lr=1.0)
    ref.load_state_dict(sd)  # must not raise; lr etc. come from the checkpoint
    assert ref.param_groups[0]["lr"] == 1e-2 and ref.param_groups[1]["weight_decay"] == 0.0
    for p, m in zip(model.parameters(), masters):
        st = ref.state[m]
        assert st["exp_avg"].dtype == torch.float32
        torch.testing.assert_close(st["exp_avg"], opt.state[p]["exp_avg"].float(), rtol=0, atol=0)
        assert float(st["step"]) == 3.0
    # one more step in both, from the same grads (no clipping at norm < 5): the same masters
    for p, m in zip(model.parameters(), masters):
        g = torch.randn(p.shape, generator=gen) * 0.01
        p.grad, m.grad = g.to(torch.bfloat16), g.to(torch.bfloat16).float()
    opt.step()
    ref.step()
    for a, b in zip(opt.master_params(), masters):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)


def test_convert_reports_transformers_conv1d():
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Conv1D(8, 4))
    _, rep = mpkern.nn.convert(model, report=True)
    assert rep.converted == ["0"] and "Conv1D" in rep.skipped["1"]


# ---- fixes after a second review --------------------------------------------------------------------
def test_kept_remainder_of_a_zeroed_view_is_not_nan(backend):
    torch.manual_seed(40)
    buf = torch.randn(64, device=DEVICE).to(torch.bfloat16)
    a, b = torch.nn.Parameter(buf[:32]), torch.nn.Parameter(buf[32:])
    opt = FusedAdamWMP([a, b], lr=1e-3, master_weights="remainder")
    for _ in range(3):
        a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
        opt.step()
    with torch.no_grad():
        a.zero_()  # a view of a shared buffer: its remainders are kept -- but not below +-0
    m = opt.master_params()[0]
    assert torch.isfinite(m).all() and (m.abs() <= 2.0**-133).all()


@pytest.mark.parametrize("master", ["remainder", "8bit"])
def test_a_move_to_channels_last_keeps_the_low_bits(backend, master):
    torch.manual_seed(41)
    conv = torch.nn.Conv2d(4, 8, 3).to(DEVICE).to(torch.bfloat16)
    opt = FusedAdamWMP(conv.parameters(), lr=1e-2, master_weights=master)
    for _ in range(3):
        for p in conv.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    before = [m.clone() for m in opt.master_params()]
    conv.to(memory_format=torch.channels_last)
    for a, b in zip(opt.master_params(), before):
        assert torch.equal(a, b)


@pytest.mark.parametrize("optimizer_first", [True, False])
def test_remainder_ties_convert_the_same_in_either_order(backend, optimizer_first):
    src, opt = _remainder_run(42, (16, 8), 1)
    w = src.weight
    opt.state[w]["master_remainder"][:, :4] = -32768  # exact ties: the bf16 half was rounded away from zero
    hi = w.detach().view(torch.int16).to(torch.int64) & 0xFFFF
    want = ((hi << 16) + opt.state[w]["master_remainder"].to(torch.int64)).to(torch.int32).view(torch.float32)
    model_sd, opt_sd = {k: v.clone() for k, v in src.state_dict().items()}, copy.deepcopy(opt.state_dict())
    new = _load_into_fp32_master((16, 8), model_sd, opt_sd, optimizer_first)
    assert torch.equal(new.master_params()[0], want)


def test_repeated_strided_param_steps_twice_like_adamw(backend):
    base = torch.arange(16, dtype=torch.float32, device=DEVICE).reshape(4, 4)
    p = torch.nn.Parameter(base.clone()[:, ::2])  # not one dense block: the contiguous-copy path
    q = torch.nn.Parameter(base.clone()[:, ::2])
    with pytest.warns(UserWarning, match="duplicate"):
        opt = FusedAdamWMP([p, p], lr=0.1, weight_decay=0.0)
    with pytest.warns(UserWarning, match="duplicate"):
        ref = torch.optim.AdamW([q, q], lr=0.1, weight_decay=0.0, foreach=False)
    for _ in range(2):
        p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
        opt.step()
        ref.step()
    torch.testing.assert_close(p.detach(), q.detach())


def test_param_turned_fp16_in_a_remainder_group_is_an_error_before_any_update(backend):
    a = torch.nn.Parameter(torch.randn(8, device=DEVICE).to(torch.bfloat16))
    b = torch.nn.Parameter(torch.randn(8, device=DEVICE).to(torch.bfloat16))
    opt = FusedAdamWMP([{"params": [a]}, {"params": [b], "master_weights": "remainder"}], lr=1e-2)
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    opt.step()
    b.data = b.data.half()
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    a0 = a.detach().clone()
    with pytest.raises(ValueError, match="remainder"):
        opt.step()
    assert torch.equal(a, a0)


def test_unscale_of_an_optimizer_with_a_repeated_param_scales_once(backend):
    p = torch.nn.Parameter(torch.ones(4, device=DEVICE))
    with pytest.warns(UserWarning, match="duplicate"):
        opt = torch.optim.SGD([p, p], lr=0.1)
    p.grad = torch.full((4,), 8.0, device=DEVICE)
    res = mpkern.unscale_(opt, 0.5)
    assert torch.equal(p.grad, torch.full((4,), 4.0, device=DEVICE))
    assert float(res.total_norm) == pytest.approx(8.0)


def test_master_params_between_optimizer_and_model_load_keeps_the_conversion(backend):
    src, opt = _remainder_run(43, (24, 16), 2)
    want = [m.clone() for m in opt.master_params()]
    model_sd, opt_sd = {k: v.clone() for k, v in src.state_dict().items()}, copy.deepcopy(opt.state_dict())
    dst = torch.nn.Linear(24, 16).to(DEVICE).to(torch.bfloat16)
    new = FusedAdamWMP(dst.parameters(), lr=1e-2, master_weights=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        new.load_state_dict(opt_sd)
    new.master_params()  # e.g. an EMA initialised right after the optimizer load
    dst.load_state_dict(model_sd)
    for a, b in zip(new.master_params(), want):
        assert torch.equal(a, b)
