"""FusedAdamWMP's state dicts read by PyTorch's own tools: ``opt.adamw_state_dict()`` is what
``torch.optim.AdamW`` loads and continues from, and ``torch.distributed.checkpoint``'s
``get_optimizer_state_dict`` (full and CPU-offloaded) takes the optimizer (a one-rank gloo group in
this process: conftest's ``one_rank_group``).
"""

from __future__ import annotations

import pytest
import torch

from mpkern import FusedAdamWMP


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
