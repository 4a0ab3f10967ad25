"""DTensor parameters the optimizer and ``mpkern.nn.convert`` cannot handle are refused, and nothing
changes: a ``Partial`` gradient (a pending reduction) and ``fp32_main_grad`` on FSDP2-sharded params
(the gradient would land on the unsharded param). A one-rank gloo group in this process
(conftest's ``one_rank_group``).
"""

from __future__ import annotations

import pytest
import torch

import mpkern
from mpkern import FusedAdamWMP


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


def test_convert_main_grad_refuses_sharded_params(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    lin = torch.nn.Linear(4, 4).to(torch.bfloat16)
    lin.weight = torch.nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [Shard(0)]))
    with pytest.raises(ValueError, match="FSDP2"):
        mpkern.nn.convert(torch.nn.Sequential(lin), fp32_main_grad=True)
    assert type(lin) is torch.nn.Linear  # nothing converted
