"""Recipe: Hugging Face accelerate with ``FusedAdamWMP`` (docs/recipes.md).

* ``Accelerator(mixed_precision="bf16")`` autocasts the forward of an fp32 model; FusedAdamWMP
  goes through ``accelerator.prepare`` like any optimizer. ``accelerator.clip_grad_norm_`` is
  torch's ``clip_grad_norm_`` underneath: right for ``.grad`` (checked against a float64 norm), blind to
  ``main_grad`` -- with ``mpkern.nn.convert(fp32_main_grad=True)`` clip with ``max_grad_norm``.
* A bf16 model (no autocast): FusedAdamWMP keeps fp32 masters; ``save_state`` / ``load_state``
  carry them, and a resumed run ends on the uninterrupted run's weights bit for bit.

Skips without accelerate.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mpkern

accelerate = pytest.importorskip("accelerate")

D_IN, CLASSES = 12, 3


@pytest.fixture(autouse=True)
def _fresh_accelerator_state():
    """accelerate keeps one process-wide state: an Accelerator (or a Trainer) made earlier in this
    process fixes mixed_precision for every later one. Start and leave each test with none."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _net(dtype: torch.dtype = torch.float32, convert: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(D_IN, 32), torch.nn.GELU(), torch.nn.Linear(32, CLASSES)).to(dtype)
    return mpkern.nn.convert(net, fp32_main_grad=True) if convert else net


def _loader(n: int = 64) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, D_IN, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16, shuffle=False)


def _norm64(params) -> float:
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.double()) for p in params])))


def test_bf16_autocast_clip_grad_norm_and_step():
    acc = accelerate.Accelerator(mixed_precision="bf16", cpu=True)
    net = _net()
    opt = mpkern.FusedAdamWMP(net.parameters(), lr=1e-2, weight_decay=0.0)
    net, opt, dl = acc.prepare(net, opt, _loader())
    seen: list[torch.dtype] = []
    acc.unwrap_model(net)[0].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    losses = []
    for x, y in dl:
        loss = F.cross_entropy(net(x).float(), y)  # prepare() wrapped the forward in autocast
        assert seen[-1] == torch.bfloat16  # the Linear really ran in bf16
        acc.backward(loss)
        want = _norm64(net.parameters())
        norm = acc.clip_grad_norm_(net.parameters(), 0.5)
        assert float(norm) == pytest.approx(want, rel=1e-5)
        assert _norm64(net.parameters()) == pytest.approx(min(want, 0.5), rel=1e-4)  # torch clipped .grad
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]


def test_clip_grad_norm_does_not_see_main_grad():
    """The pitfall the docs name: with fp32_main_grad, accelerate's (torch's) clip_grad_norm_ misses
    the Linear weights' gradients; FusedAdamWMP(max_grad_norm=...) / mpkern.clip_grad_norm_ see them."""
    acc = accelerate.Accelerator(cpu=True)
    net = _net(torch.bfloat16, convert=True)
    opt = mpkern.FusedAdamWMP(net.parameters(), lr=1e-2, max_grad_norm=1.0)
    net, opt = acc.prepare(net, opt)
    x, y = next(iter(_loader()))
    F.cross_entropy(net(x.to(torch.bfloat16)).float(), y).backward()
    weights = [m.weight for m in net.modules() if isinstance(m, torch.nn.Linear)]
    assert all(w.grad is None and w.main_grad is not None for w in weights)
    full = float(torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm((p.main_grad if getattr(p, "main_grad", None) is not None else p.grad).double())
         for p in net.parameters()])))
    biases_only = _norm64([p for p in net.parameters() if p.grad is not None])
    # (torch computes the norm of bf16 grads in bf16: equal to a bf16 rounding)
    assert float(acc.clip_grad_norm_(net.parameters(), 1e9)) == pytest.approx(biases_only, rel=2**-7)
    assert biases_only < 0.9 * full  # torch's norm misses the weights
    assert float(mpkern.clip_grad_norm_(net.parameters(), 1e9)) == pytest.approx(full, rel=1e-5)


def _run_bf16(tmp_path, steps: int, save_at: int | None = None, load: str | None = None) -> torch.nn.Module:
    acc = accelerate.Accelerator(cpu=True, project_dir=str(tmp_path))
    net = _net(torch.bfloat16)
    opt = mpkern.FusedAdamWMP(net.parameters(), lr=1e-2, weight_decay=0.01, max_grad_norm=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    net, opt, sched = acc.prepare(net, opt, sched)
    batches = list(_loader(16 * steps))
    first = 0
    if load is not None:
        acc.load_state(load)
        first = save_at
    for i in range(first, steps):
        x, y = batches[i]
        acc.backward(F.cross_entropy(net(x.to(torch.bfloat16)).float(), y))
        opt.step()
        sched.step()
        opt.zero_grad()
        if save_at is not None and load is None and i + 1 == save_at:
            acc.save_state(str(tmp_path / "state"))
    return net


def test_bf16_model_save_state_load_state_is_bitwise(tmp_path):
    full = _run_bf16(tmp_path / "a", 6)
    _run_bf16(tmp_path / "b", 6, save_at=3)
    saved = torch.load(tmp_path / "b" / "state" / "optimizer.bin", weights_only=False)["state"]
    assert saved and all(s["master_param"].dtype == torch.float32 for s in saved.values())
    resumed = _run_bf16(tmp_path / "c", 6, save_at=3, load=str(tmp_path / "b" / "state"))
    for (n, a), b in zip(full.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), n
