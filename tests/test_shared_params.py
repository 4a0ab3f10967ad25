"""Parameters that share their data: a tied weight (its gradient in ``main_grad`` and ``grad`` at once),
a parameter listed twice in one group, with a dense or a strided layout, and an optimizer with a
repeated parameter given to ``mpkern.unscale_``.

References are float64 computations written here (or bitwise facts: a step at lr 0 must change
nothing), never numbers produced by the code under test.
"""

from __future__ import annotations

import math

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


# ---- tied weights: the gradient is main_grad + grad, for every consumer --------------------------
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


# ---- a param listed twice steps like torch.optim.AdamW -------------------------------------------
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


def test_unscale_of_an_optimizer_with_a_repeated_param_scales_once(backend):
    p = torch.nn.Parameter(torch.ones(4, device=DEVICE))
    with pytest.warns(UserWarning, match="duplicate"):
        opt = torch.optim.SGD([p, p], lr=0.1)
    p.grad = torch.full((4,), 8.0, device=DEVICE)
    res = mpkern.unscale_(opt, 0.5)
    assert torch.equal(p.grad, torch.full((4,), 4.0, device=DEVICE))
    assert float(res.total_norm) == pytest.approx(8.0)
