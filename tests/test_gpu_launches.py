"""The launches of a CUDA optimizer step (issue 43 item 5): the prep launch plus one per dtype
combination of the tensor lists, nothing per tensor -- counted by ``torch.profiler`` on the device.

The host cost per tensor of the cached step is a timing and lives in ``mpkern bench adamw`` (its
host-time rows); what a test can pin is that the number of kernels does not grow with the number of
tensors, and that it stays at the design's count for a step without clipping or a scaler.
"""

from __future__ import annotations

import pytest
import torch

import mpkern
from conftest import HAS_CUDA

pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def _opt(n_bf16: int, n_f32: int, state_dtype: str, master: object):
    """An optimizer over ``n_bf16`` bf16 params with bf16 grads and ``n_f32`` fp32 params with fp32
    grads (two dtype combinations when both are present), grads set, warmed up (layout tables and
    the step cache built)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(257 + 64 * k, device="cuda", generator=gen).to(torch.bfloat16))
              for k in range(n_bf16)]
    params += [torch.nn.Parameter(torch.randn(129 + 32 * k, device="cuda", generator=gen)) for k in range(n_f32)]
    opt = mpkern.FusedAdamWMP(params, lr=1e-3, master_weights=master, state_dtype=state_dtype)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    for _ in range(3):
        opt.step()
    torch.cuda.synchronize()
    return opt


def _kernels_of_one_step(opt) -> list[str]:
    """The names of the device kernels one ``opt.step()`` runs (memcpy / memset excluded)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        opt.step()
        torch.cuda.synchronize()
    names = []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        low = e.name.lower()
        if "memcpy" in low or "memset" in low:
            continue
        names.append(e.name)
    return names


@pytest.mark.parametrize("state_dtype, master", [("float32", True), ("8bit", "8bit"), ("4bit_m", "8bit"),
                                                 ("bfloat16", "remainder")])
def test_step_launches_do_not_grow_with_the_tensors(state_dtype, master):
    few = _kernels_of_one_step(_opt(10, 0, state_dtype, master))
    many = _kernels_of_one_step(_opt(300, 0, state_dtype, master))
    assert len(few) == len(many), (few, many)
    # the prep launch (per-tensor constants, step counters) and one AdamW launch for the one dtype
    # combination (its aligned rows; a second for unaligned heads and tails at most)
    assert 2 <= len(many) <= 3, many


def test_one_launch_more_per_dtype_combination():
    one = _kernels_of_one_step(_opt(50, 0, "8bit", "8bit"))
    two = _kernels_of_one_step(_opt(50, 20, "8bit", "8bit"))
    assert len(two) - len(one) in (1, 2), (one, two)  # the fp32 params' combination: its own launch(es)
