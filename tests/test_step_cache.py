"""FusedAdamWMP's step cache (the eager fast path, csrc/fastpath.cpp): every change the full path
would see invalidates it, and a cached step is bitwise the step of an optimizer without the cache
(``_mpkern_step_cache = False``), in every storage mode."""

from __future__ import annotations

import pytest
import torch

import mpkern
from conftest import DEVICE
from mpkern import _backend

pytestmark = pytest.mark.skipif(
    _backend.native() is None or not hasattr(_backend.native(), "StepCache"),
    reason="no native step cache in this build")

MODES = [(mw, sd) for mw in (True, "remainder", "8bit", False) for sd in ("float32", "bfloat16", "8bit")]
SHAPES = [(7, 5), (64,), (3, 4, 33), (1,), (40, 3)]


def _params(seed: int, dtype=torch.bfloat16) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype).to(DEVICE)) for s in SHAPES]


def _pair(mw="remainder", sd="bfloat16", clip=1.0, **kw):
    """Two optimizers over equal params: ``fast`` (cache on) and ``ref`` (cache off)."""
    a, b = _params(0), _params(0)
    kw = {"lr": 1e-2, "max_grad_norm": clip, "master_weights": mw, "state_dtype": sd,
          "stochastic_rounding": mw is False, **kw}
    fast = mpkern.FusedAdamWMP(a, **kw)
    if isinstance(kw["lr"], torch.Tensor):
        kw["lr"] = kw["lr"].clone()  # each optimizer its own (updated in place below)
    ref = mpkern.FusedAdamWMP(b, **kw)
    ref._mpkern_step_cache = False
    return fast, ref, a, b


class _Counter:
    def __init__(self, opt):
        self.hits = 0
        real = opt._fast_step

        def counted(fc):
            self.hits += 1
            return real(fc)

        opt._fast_step = counted


def _grads(ps_a, ps_b, seed, dtype=None, skip=()):
    g = torch.Generator().manual_seed(seed)
    for i, (a, b) in enumerate(zip(ps_a, ps_b)):
        if i in skip:
            a.grad = b.grad = None
            continue
        x = (torch.randn(a.shape, generator=g) * 3).to(dtype or a.dtype).to(DEVICE)
        if x.dtype != a.dtype:
            a.grad_dtype = b.grad_dtype = None  # allow an fp32 grad on a 16-bit param
        a.grad, b.grad = x.clone(), x.clone()


def _bits(x):
    return x.detach().reshape(-1).contiguous().view(torch.uint8)


def _same(opt_a, opt_b, ps_a, ps_b, norms=True):
    for a, b in zip(ps_a, ps_b):
        assert a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))
        sa, sb = opt_a.state[a], opt_b.state[b]
        assert sa.keys() == sb.keys()
        for k in sa:
            x, y = sa[k], sb[k]
            if isinstance(x, torch.Tensor):
                assert x.dtype == y.dtype and x.shape == y.shape, k
                assert torch.equal(_bits(x), _bits(y)), k
            else:
                assert x == y, k
    pairs = ((opt_a.last_grad_norm, opt_b.last_grad_norm), (opt_a.last_found_inf, opt_b.last_found_inf))
    for x, y in pairs[:2 * norms]:
        assert (x is None) == (y is None)
        if x is not None:
            assert torch.equal(_bits(x), _bits(y))


def _steps(fast, ref, a, b, n, seed0=0, **kw):
    for s in range(n):
        _grads(a, b, seed0 + s, **kw)
        fast.step()
        ref.step()
        _same(fast, ref, a, b)


@pytest.mark.parametrize("mw,sd", MODES, ids=[f"{m}-{s}" for m, s in MODES])
@pytest.mark.parametrize("clip", [None, 1.0])
def test_cached_steps_bitwise(mw, sd, clip):
    fast, ref, a, b = _pair(mw, sd, clip, weight_decay=0.1)
    c = _Counter(fast)
    _steps(fast, ref, a, b, 4)
    assert c.hits == 3  # the first step builds the cache, the others use it
    assert all(g is None for g in fast.mpkern_runtime.cache.cache.grads())  # no grad kept alive between steps


def test_tensor_lr_and_hyperparameter_changes():
    fast, ref, a, b = _pair(lr=torch.tensor(1e-2, device=DEVICE))
    c = _Counter(fast)
    _steps(fast, ref, a, b, 2)
    for opt in (fast, ref):
        opt.param_groups[0]["lr"].fill_(3e-3)  # a scheduler updating a tensor lr in place
        opt.param_groups[0]["betas"] = (0.8, 0.95)
        opt.param_groups[0]["weight_decay"] = 0.0
    _steps(fast, ref, a, b, 2, seed0=10)
    assert c.hits == 3


@pytest.mark.parametrize("write", ["data", "fill", "copy", "to_dtype"])
def test_param_write_invalidates(write):
    fast, ref, a, b = _pair()
    c = _Counter(fast)
    _steps(fast, ref, a, b, 2)
    for ps in (a, b):
        with torch.no_grad():
            if write == "data":
                ps[1].data = torch.full_like(ps[1], 0.25)
            elif write == "fill":
                ps[0].fill_(0.5)
            elif write == "copy":
                ps[2].copy_(torch.ones_like(ps[2]))
            else:
                ps[3].data = ps[3].data.float()
    hits = c.hits
    _steps(fast, ref, a, b, 3, seed0=20)
    assert c.hits == hits + 2  # the first step after the write takes the full path


def test_grad_changes_invalidate():
    fast, ref, a, b = _pair()
    c = _Counter(fast)
    _steps(fast, ref, a, b, 2)
    _steps(fast, ref, a, b, 1, seed0=30, dtype=torch.float32)  # a new grad dtype
    g = torch.randn(3, 40).to(DEVICE).t()  # a non-contiguous grad for the (40, 3) param
    _grads(a, b, 31)
    a[4].grad, b[4].grad = g.to(torch.bfloat16), g.to(torch.bfloat16)
    assert not a[4].grad.is_contiguous()
    fast.step()
    ref.step()
    _same(fast, ref, a, b)
    _steps(fast, ref, a, b, 2, seed0=32, skip=(1,))  # a param without grad (zero_grad(set_to_none))
    for opt in (fast, ref):
        opt.zero_grad(set_to_none=True)
    for opt in (fast, ref):
        opt.step()  # no grads at all
    _same(fast, ref, a, b)
    _steps(fast, ref, a, b, 3, seed0=40)
    assert c.hits >= 3


def test_main_grad_invalidates():
    fast, ref, a, b = _pair()
    c = _Counter(fast)
    _steps(fast, ref, a, b, 2)
    hits = c.hits
    _grads(a, b, 50)
    g = torch.randn(a[0].shape, device=DEVICE)
    a[0].main_grad, b[0].main_grad = g.clone(), g.clone()
    fast.step()
    ref.step()
    _same(fast, ref, a, b)
    assert c.hits == hits
    assert a[0].main_grad is None  # consumed like the full path does
    _steps(fast, ref, a, b, 3, seed0=51)


def test_param_groups_and_state_changes_invalidate():
    fast, ref, a, b = _pair()
    c = _Counter(fast)
    _steps(fast, ref, a, b, 2)
    extra_a, extra_b = _params(7), _params(7)
    fast.add_param_group({"params": extra_a, "lr": 3e-3})
    ref.add_param_group({"params": extra_b, "lr": 3e-3})
    _steps(fast, ref, a + extra_a, b + extra_b, 3, seed0=60)
    # load_state_dict (of the other one's state): the next step takes the full path
    sd = ref.state_dict()
    fast.load_state_dict(sd)
    ref.load_state_dict(sd)
    hits = c.hits
    _steps(fast, ref, a + extra_a, b + extra_b, 3, seed0=70)
    assert c.hits == hits + 2
    # a state tensor replaced by hand
    for opt, ps in ((fast, a), (ref, b)):
        opt.state[ps[0]]["exp_avg_sq"] = opt.state[ps[0]]["exp_avg_sq"].clone().fill_(1e-4)
    hits = c.hits
    _steps(fast, ref, a + extra_a, b + extra_b, 2, seed0=80)
    assert c.hits == hits + 1
    # the group layout changed by hand
    for opt in (fast, ref):
        opt.param_groups[1]["amsgrad"] = True
    _steps(fast, ref, a + extra_a, b + extra_b, 2, seed0=90)


def test_pending_unscale_and_grad_scale():
    fast, ref, a, b = _pair(clip=0.5)
    c = _Counter(fast)
    _steps(fast, ref, a, b, 2)
    for s in range(3):
        _grads(a, b, 100 + s)
        for opt in (fast, ref):
            mpkern.unscale_(opt, 0.25, max_norm=2.0)
            opt.step()
        _same(fast, ref, a, b)
        for opt in (fast, ref):  # the GradScaler protocol's attributes
            opt.grad_scale = torch.tensor(4.0, device=DEVICE)
            opt.found_inf = torch.tensor(1.0 if s == 1 else 0.0, device=DEVICE)
            opt.step()
            del opt.grad_scale, opt.found_inf
        _same(fast, ref, a, b)
    assert c.hits >= 6


def test_inf_grad_skips_like_full_path():
    fast, ref, a, b = _pair()
    _steps(fast, ref, a, b, 2)
    _grads(a, b, 200)
    a[2].grad[0, 0, 0] = b[2].grad[0, 0, 0] = float("inf")
    fast.step()
    ref.step()
    _same(fast, ref, a, b)
    assert fast.last_found_inf.item() == 1.0


def test_repeated_param_is_never_cached():
    p = torch.nn.Parameter(torch.randn(8, device=DEVICE).to(torch.bfloat16))
    q = torch.nn.Parameter(torch.randn(8, device=DEVICE).to(torch.bfloat16))
    with pytest.warns(UserWarning):
        opt = mpkern.FusedAdamWMP([p, q, p], lr=1e-2)
    for _ in range(2):
        p.grad = torch.randn(8, device=DEVICE).to(torch.bfloat16)
        q.grad = torch.randn(8, device=DEVICE).to(torch.bfloat16)
        opt.step()
    assert opt.mpkern_runtime.cache is None


def test_compiled_step_after_cached_steps():
    # a compiled step never uses the cache (it traces the full path); eager steps around it do.
    # The reference runs the same eager / compiled sequence without the cache.
    torch._dynamo.reset()  # every optimizer compiled earlier in the session holds an entry of the shared step wrapper
    fast, ref, a, b = _pair("8bit", "8bit")
    c = _Counter(fast)
    _steps(fast, ref, a, b, 2)
    compiled = [torch.compile(o.step, fullgraph=True, backend="aot_eager") for o in (fast, ref)]
    for s in range(2):
        _grads(a, b, 300 + s)
        for step in compiled:
            step()
        # (last_grad_norm of a compiled step is not refreshed -- a compile-path matter, cache or not)
        _same(fast, ref, a, b, norms=False)
    hits = c.hits
    _steps(fast, ref, a, b, 3, seed0=310)
    assert c.hits == hits + 2


def test_write_check_off_takes_full_path():
    fast, ref, a, b = _pair()
    fast._mpkern_check_writes = ref._mpkern_check_writes = False
    c = _Counter(fast)
    _steps(fast, ref, a, b, 3)
    assert c.hits == 0
