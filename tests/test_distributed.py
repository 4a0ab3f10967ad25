"""Issue 10: mpkern inside torch.distributed -- FSDP2 (DTensor), DDP, hand sharding, DCP.

CPU tests spawn gloo process groups on this machine (2 ranks; the checkpoint is also loaded on
1 rank and saved from 1 rank for 2); NCCL versions run the same workers on >= 2 GPUs and skip
otherwise. The workers (tests/_dist_workers.py) assert in every rank against an unsharded
reference model computed in the same process.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
import _dist_workers as W
import _ladder64

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2


def _spawn(fn, world: int, tmp_path, *args, backend: str = "gloo") -> None:
    store = str(tmp_path / f"store-{fn.__name__}-{world}")
    mp.spawn(fn, args=(world, store, *args, backend), nprocs=world, join=True)


def _assert_same_continuation(got: dict, want: dict) -> None:
    """Masters to fp32 rounding of the norm reduction order; bf16 params to one rounding."""
    n = len(list(W.model(torch.bfloat16, torch.device("cpu")).parameters()))
    assert len(got["masters"]) == len(want["masters"]) == n and len(got["params"]) == len(want["params"]) == n
    for a, b in zip(got["masters"], want["masters"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(got["params"], want["params"]):
        torch.testing.assert_close(a, b, rtol=2**-8, atol=0)


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory):
    """One 2-rank FSDP2 run (norm, trajectory, skip, scaler, DCP save); its files for the others."""
    out = tmp_path_factory.mktemp("fsdp2")
    _spawn(W.fsdp2, 2, out, str(out))
    return out


def test_fsdp2_norm_trajectory_skip_scaler_and_save(fsdp2_run):
    # every assertion ran inside the ranks; here: the run finished and left its checkpoint
    assert (fsdp2_run / "ckpt").is_dir() and (fsdp2_run / "continuation.pt").is_file()


def test_dcp_two_ranks_to_one_continues_the_same_trajectory(fsdp2_run):
    dev = torch.device("cpu")
    m = W.model(torch.bfloat16, dev)
    opt = __import__("mpkern").FusedAdamWMP(m.parameters(), lr=1e-2, max_grad_norm=0.5)
    params, masters = W.load_and_continue(m, opt, str(fsdp2_run / "ckpt"), dev)
    _assert_same_continuation({"params": params, "masters": masters}, torch.load(fsdp2_run / "continuation.pt"))


def test_dcp_two_ranks_to_four_continues_the_same_trajectory(fsdp2_run, tmp_path):
    # 4 ranks on this 2-core machine: uneven shards (6 output rows over 4 ranks)
    store = str(tmp_path / "store-load4")
    mp.spawn(W.fsdp2_load, args=(4, store, str(fsdp2_run / "ckpt"), str(tmp_path / "loaded4.pt"), "gloo"),
             nprocs=4, join=True)
    _assert_same_continuation(torch.load(tmp_path / "loaded4.pt"), torch.load(fsdp2_run / "continuation.pt"))


def test_dcp_one_rank_to_two_continues_the_same_trajectory(tmp_path):
    W.single_save(str(tmp_path / "ckpt1"), str(tmp_path / "single.pt"))
    store = str(tmp_path / "store-load")
    mp.spawn(W.fsdp2_load, args=(2, store, str(tmp_path / "ckpt1"), str(tmp_path / "loaded.pt"), "gloo"),
             nprocs=2, join=True)
    _assert_same_continuation(torch.load(tmp_path / "loaded.pt"), torch.load(tmp_path / "single.pt"))


@pytest.mark.parametrize("world", [1, 3])
def test_dcp_compact_state_reshards_2_to_1_and_3(tmp_path, world):
    # master_weights="8bit" + bf16 moments: the int8 corrections and moments are DTensors laid out
    # like the params, so DCP reshards them (3 ranks: uneven shards); each shard draws the random
    # bits of its elements in the whole tensor, so the continuation matches the uninterrupted run
    # up to the rounding of the grad reduction order: a rounding it flips can move a param by one
    # bf16 ulp per continuation step (2 here), and a flipped bf16 moment rounding changes that
    # step's update (|update| <= ~3 lr early on) by one part in 2^8
    _spawn(W.compact_save, 2, tmp_path, str(tmp_path), "8bit-bf16")
    store = str(tmp_path / f"store-compact-load{world}")
    out = tmp_path / f"compact{world}.pt"
    mp.spawn(W.compact_load, args=(world, store, str(tmp_path / "ckpt"), str(out), "8bit-bf16", "gloo"), nprocs=world,
             join=True)
    got, want = torch.load(out), torch.load(tmp_path / "continuation.pt")
    assert len(got["params"]) == len(want["params"]) > 0
    for a, b in zip(got["params"], want["params"]):
        ulp = b.float().abs().clamp(min=2**-126) * 2.0**-7  # >= the bf16 spacing at b
        assert ((a.float() - b.float()).abs() <= 2 * ulp + 2 * 3e-2 * 2.0**-8).all()
        assert (a == b).float().mean() > 0.9  # the same streams: most stay bitwise equal
    for a, b in zip(got["masters"], want["masters"]):
        ulp = b.abs().clamp(min=2**-126) * 2.0**-7
        assert ((a - b).abs() <= 2 * ulp + 2 * 3e-2 * 2.0**-8).all()


@pytest.mark.parametrize("mode, world", [("8bit-8bit", 3), ("remainder-8bit", 1), ("8bit-4bitm", 3),
                                         ("remainder-4bitm", 1)])
def test_dcp_8bit_moments_reshard_within_the_requantization_bound(tmp_path, mode, world):
    # 8-bit moments of DTensor params are saved dequantized (their scales belong to the local
    # buffer) and quantized again for the new shards on load: each value within half a code step
    # of its new group's largest magnitude -- bounded here by the largest of the whole tensor
    # (3.2 %: half the top binade's step 2^-4 (u_max + 1) against a group max of at least u_max / 2
    # scale units, tests/_ladder64.py; the 4-bit exp_avg 30 %). Masters (exact remainder / 8-bit
    # corrections) reshard exactly.
    _spawn(W.compact_save, 2, tmp_path, str(tmp_path), mode)
    store = str(tmp_path / f"store-m8-load{world}")
    out = tmp_path / f"m8-{world}.pt"
    mp.spawn(W.compact_load, args=(world, store, str(tmp_path / "ckpt"), str(out), mode, "gloo"), nprocs=world,
             join=True)
    got, want = torch.load(out), torch.load(tmp_path / "continuation.pt")
    saved = torch.load(tmp_path / "saved_moments.pt")
    assert len(saved) == len(got["loaded_moments"]) > 0
    for s, lo in zip(saved, got["loaded_moments"]):
        for key in ("exp_avg", "exp_avg_sq"):
            ladder = ("m4" if "4bit" in mode else "m8") if key == "exp_avg" else "v8"
            step = 2.0 ** -_ladder64.LADDERS[ladder][0] * (1 + 2 / _ladder64.umax(ladder))
            bound = 0.5 * step * s[key].abs().max()
            assert ((lo[key] - s[key]).abs() <= bound).all(), key
    # the continuation (2 steps) stays close to the uninterrupted run: requantized 8-bit moments
    # change each update by a few % of lr at most; a requantized 4-bit exp_avg (a step of up to 30 %
    # of its group's max) by up to about one lr (Adam's updates are bounded by ~lr)
    frac = 1.0 if "4bit" in mode else 0.2
    for a, b in zip(got["masters"], want["masters"]):
        ulp = b.abs().clamp(min=2**-126) * 2.0**-7
        assert ((a - b).abs() <= 2 * ulp + 2 * frac * 1e-2).all()


def test_ddp_bucket_views_and_no_sync_equal_full_batch(tmp_path):
    _spawn(W.ddp, 2, tmp_path, str(tmp_path))


def test_hand_sharded_process_group(tmp_path):
    _spawn(W.hand_sharded, 2, tmp_path, str(tmp_path))


def test_dtensor_without_process_group_is_a_clear_error():
    from torch.distributed.device_mesh import DeviceMesh  # noqa: F401 -- DTensor needs a group

    import mpkern

    p = torch.nn.Parameter(torch.randn(4))
    p.grad = torch.randn(4)
    with pytest.raises(RuntimeError, match="process_group= needs an initialised"):
        mpkern.unscale_([p], 1.0, process_group=object())


@pytest.mark.skipif(not TWO_GPUS, reason="needs >= 2 CUDA GPUs (NCCL)")
def test_fsdp2_nccl(tmp_path):
    _spawn(W.fsdp2, 2, tmp_path, str(tmp_path), backend="nccl")


@pytest.mark.skipif(not TWO_GPUS, reason="needs >= 2 CUDA GPUs (NCCL)")
def test_ddp_nccl(tmp_path):
    _spawn(W.ddp, 2, tmp_path, str(tmp_path), backend="nccl")


def test_dcp_dummy_init_step_changes_nothing_and_keeps_tensor_lr():
    """get_optimizer_state_dict on an empty optimizer runs step() with zero grads and lr=0."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    import mpkern

    m = W.model(torch.bfloat16, torch.device("cpu"))
    before = [p.detach().clone() for p in m.parameters()]
    lr = torch.tensor(1e-2)
    opt = mpkern.FusedAdamWMP(m.parameters(), lr=lr, max_grad_norm=1.0)
    osd = get_optimizer_state_dict(m, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
    for p in m.parameters():
        assert torch.equal(opt.state[p]["master_param"], p.detach().float())
    group_lr = opt.param_groups[0]["lr"]
    assert isinstance(group_lr, torch.Tensor) and torch.equal(group_lr, torch.tensor(1e-2))
    assert opt.state[next(m.parameters())]["master_param"].dtype == torch.float32
    assert len(osd["state"]) == len(before)
