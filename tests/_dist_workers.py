"""Worker bodies for tests/test_distributed.py (spawned processes, gloo on CPU; NCCL on GPUs).

Each worker asserts on its own; a failed assert in any rank fails the spawning test with its
traceback. Rank 0 writes what the parent needs to compare (full parameters, norms) with
``torch.save``. References are computed in every rank on an unsharded copy of the same model
with the same data -- independent of the distributed code under test.
"""

from __future__ import annotations

import copy
import os
import sys
from contextlib import contextmanager

import torch
import torch.distributed as dist

import mpkern

D_IN, D_HID, D_OUT = 12, 24, 6


def init(rank: int, world: int, store: str, backend: str = "gloo") -> torch.device:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    return torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")


def finish() -> None:
    """End a worker that passed: wait for every rank, then leave without running C++ destructors.

    Tearing down gloo process groups (and DeviceMesh sub-groups) at interpreter exit sometimes
    aborts with "terminate called without an active exception" (a joinable worker thread being
    destroyed) -- after every assertion passed. The results are on disk by now, so the process
    exits directly with status 0; a rank that failed raised before getting here.
    """
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def model(dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(D_IN, D_HID), torch.nn.GELU(), torch.nn.Linear(D_HID, D_HID),
                               torch.nn.GELU(), torch.nn.Linear(D_HID, D_OUT)).to(device=device, dtype=dtype)


def batch(step: int, device: torch.device, dtype: torch.dtype, n: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, D_IN, generator=g).to(device=device, dtype=dtype)


def loss_of(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x).float().pow(2).mean() * 50.0


def shard(m: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


@contextmanager
def count_all_reduce():
    """Counts torch.distributed.all_reduce calls made inside the block."""
    calls = []
    orig = dist.all_reduce

    def counting(*a, **k):
        calls.append(1)
        return orig(*a, **k)

    dist.all_reduce = counting
    try:
        yield calls
    finally:
        dist.all_reduce = orig


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def snapshot(opt: mpkern.FusedAdamWMP, params) -> list[torch.Tensor]:
    out = []
    for p in params:
        st = opt.state[p]
        out += [full(p.detach()).clone()] + [full(st[k]).clone() for k in ("master_param", "exp_avg", "exp_avg_sq",
                                                                          "step")]
    return out


# ---- FSDP2 ----------------------------------------------------------------------------------------
def fsdp2(rank: int, world: int, store: str, out: str, backend: str = "gloo") -> None:
    dev = init(rank, world, store, backend)
    bf16 = torch.bfloat16
    ref = model(bf16, dev)
    fs = shard(copy.deepcopy(ref), dev)

    # 1. unscale_ on DTensor grads: the unsharded model's norm, one all-reduce, grads clipped
    x = batch(0, dev, bf16)
    loss_of(ref, x).backward()
    loss_of(fs, x).backward()  # same batch on every rank: the averaged grads equal ref's
    r_ref = mpkern.unscale_(ref.parameters(), 0.5, max_norm=0.3)
    with count_all_reduce() as calls:
        r = mpkern.unscale_(fs.parameters(), 0.5, max_norm=0.3)
    assert len(calls) == 1, calls
    torch.testing.assert_close(r.total_norm, r_ref.total_norm, rtol=1e-6, atol=0)
    torch.testing.assert_close(r.clip_coef, r_ref.clip_coef, rtol=1e-6, atol=0)
    for a, b in zip(fs.parameters(), ref.parameters()):
        torch.testing.assert_close(full(a.grad), b.grad, rtol=2**-7, atol=0)
    # inf-norm and per-tensor results are global too
    r_inf = mpkern.unscale_(fs.parameters(), 1.0, norm_type=float("inf"), per_tensor=True)
    r_inf_ref = mpkern.unscale_(ref.parameters(), 1.0, norm_type=float("inf"), per_tensor=True)
    assert torch.equal(r_inf.total_norm, r_inf_ref.total_norm)
    assert torch.equal(r_inf.per_tensor_norm, r_inf_ref.per_tensor_norm)
    fs.zero_grad()
    ref.zero_grad()

    # 2. FusedAdamWMP trajectory with fused clipping equals the unsharded one; 1 collective/step
    o_ref = mpkern.FusedAdamWMP(ref.parameters(), lr=1e-2, max_grad_norm=0.5)
    o = mpkern.FusedAdamWMP(fs.parameters(), lr=1e-2, max_grad_norm=0.5)
    for step in range(1, 4):
        x = batch(step, dev, bf16)
        loss_of(ref, x).backward()
        loss_of(fs, x).backward()
        o_ref.step()
        with count_all_reduce() as calls:
            o.step()
        assert len(calls) == 1, calls
        o.zero_grad()
        o_ref.zero_grad()
    torch.testing.assert_close(o.last_grad_norm, o_ref.last_grad_norm, rtol=1e-6, atol=0)
    for p, q in zip(fs.parameters(), ref.parameters()):
        st, st_ref = o.state[p], o_ref.state[q]
        assert type(st["master_param"]).__name__ == "DTensor" and st["master_param"].placements == p.placements
        assert st["master_param"].to_local().numel() * world == q.numel()  # state divides by world size
        torch.testing.assert_close(full(st["master_param"]), st_ref["master_param"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(full(p.detach()), q.detach(), rtol=2**-7, atol=1e-6)

    # 3. an inf on one rank's shard skips the step on every rank, bitwise
    x = batch(9, dev, bf16)
    loss_of(fs, x).backward()
    if rank == world - 1:
        next(iter(fs.parameters())).grad.to_local().view(-1)[-1] = float("inf")
    before = snapshot(o, list(fs.parameters()))
    o.step()
    assert float(o.last_found_inf) == 1.0
    after = snapshot(o, list(fs.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    o.zero_grad()

    # 4. GradScaler (fp16 recipe) + mpkern.unscale_(opt, scaler=): the overflow is global
    scaler = torch.amp.GradScaler(dev.type, init_scale=2.0**10)
    loss = loss_of(fs, batch(10, dev, bf16))
    scaler.scale(loss).backward()
    if rank == 0:
        next(iter(fs.parameters())).grad.to_local().view(-1)[0] = float("nan")
    before = snapshot(o, list(fs.parameters()))
    res = mpkern.unscale_(o, scaler=scaler, max_norm=1.0)
    scaler.step(o)
    scaler.update()
    assert float(res.found_inf) == 1.0 and float(scaler.get_scale()) == 2.0**9
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(o, list(fs.parameters()))))
    o.zero_grad()

    # 5. DCP: save on `world` ranks, then two more steps (the continuation a reload must match)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(fs, o)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out, "ckpt"))
    for step in (20, 21):
        loss_of(fs, batch(step, dev, bf16)).backward()
        o.step()
        o.zero_grad()
    final = [full(p.detach()).cpu() for p in fs.parameters()]
    masters = [full(o.state[p]["master_param"]).cpu() for p in fs.parameters()]
    if rank == 0:
        torch.save({"params": final, "masters": masters}, os.path.join(out, "continuation.pt"))
    finish()


def load_and_continue(m: torch.nn.Module, opt: mpkern.FusedAdamWMP, ckpt: str, dev: torch.device,
                      steps=(20, 21)) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """DCP-load a checkpoint into (model, opt) -- any sharding -- and run the continuation steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(m, opt)  # initialises the optimizer state (a dummy lr=0 step)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=ckpt)
    set_state_dict(m, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    for step in steps:
        loss_of(m, batch(step, dev, torch.bfloat16)).backward()
        opt.step()
        opt.zero_grad()
    return ([full(p.detach()).cpu() for p in m.parameters()],
            [full(opt.state[p]["master_param"]).cpu() for p in m.parameters()])


def fsdp2_load(rank: int, world: int, store: str, ckpt: str, out: str, backend: str = "gloo") -> None:
    """Load a checkpoint saved with another world size into an FSDP2 model; save the continuation."""
    dev = init(rank, world, store, backend)
    fs = shard(model(torch.bfloat16, dev), dev)
    opt = mpkern.FusedAdamWMP(fs.parameters(), lr=1e-2, max_grad_norm=0.5)
    params, masters = load_and_continue(fs, opt, ckpt, dev)
    if rank == 0:
        torch.save({"params": params, "masters": masters}, out)
    finish()


def single_save(ckpt: str, out: str) -> None:
    """One process: the FSDP2 worker's first steps on an unsharded model, then a DCP save and the
    continuation (for the 1 -> N direction)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    dev = torch.device("cpu")
    m = model(torch.bfloat16, dev)
    opt = mpkern.FusedAdamWMP(m.parameters(), lr=1e-2, max_grad_norm=0.5)
    for step in range(1, 4):
        loss_of(m, batch(step, dev, torch.bfloat16)).backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    for step in (20, 21):
        loss_of(m, batch(step, dev, torch.bfloat16)).backward()
        opt.step()
        opt.zero_grad()
    torch.save({"params": [p.detach().clone() for p in m.parameters()],
                "masters": [opt.state[p]["master_param"].clone() for p in m.parameters()]}, out)


# ---- compact state (issue 15): 8-bit master correction + bf16 moments through DCP -----------------
COMPACT = {"master_weights": "8bit", "state_dtype": torch.bfloat16, "seed": 5}
#: the other compact layouts the DCP tests reshard: 8-bit moments with each master kind
COMPACT_MODES = {"8bit-bf16": COMPACT, "8bit-8bit": {"master_weights": "8bit", "state_dtype": "8bit", "seed": 5},
                 "remainder-8bit": {"master_weights": "remainder", "state_dtype": "8bit", "seed": 5},
                 "8bit-4bitm": {"master_weights": "8bit", "state_dtype": "4bit_m", "seed": 5},
                 "remainder-4bitm": {"master_weights": "remainder", "state_dtype": "4bit_m", "seed": 5}}


def _moments(opt: mpkern.FusedAdamWMP, params) -> list[dict]:
    """The fp32 moments of each param, whole tensors (state_dict() dequantizes 8-bit DTensor moments)."""
    sd = opt.state_dict()
    index = dict(zip((id(p) for g in opt.param_groups for p in g["params"]),
                     (i for g in sd["param_groups"] for i in g["params"])))
    out = []
    for p in params:
        st = sd["state"][index[id(p)]]
        out.append({k: full(st[k]).float().cpu() for k in ("exp_avg", "exp_avg_sq")})
    return out


def _compact_steps(m: torch.nn.Module, opt: mpkern.FusedAdamWMP, steps, dev: torch.device) -> None:
    for step in steps:
        loss_of(m, batch(step, dev, torch.bfloat16)).backward()
        opt.step()
        opt.zero_grad()


def _compact_result(m: torch.nn.Module, opt: mpkern.FusedAdamWMP) -> dict:
    return {"params": [full(p.detach()).cpu() for p in m.parameters()],
            "masters": [full(x).cpu() for x in opt.master_params()]}


def compact_save(rank: int, world: int, store: str, out: str, mode: str = "8bit-bf16", backend: str = "gloo") -> None:
    """FSDP2 with a compact layout (``COMPACT_MODES[mode]``): 3 steps, a DCP save, the 2-step continuation."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    kw = COMPACT_MODES[mode]
    dev = init(rank, world, store, backend)
    fs = shard(model(torch.bfloat16, dev), dev)
    opt = mpkern.FusedAdamWMP(fs.parameters(), lr=1e-2, max_grad_norm=0.5, **kw)
    _compact_steps(fs, opt, range(1, 4), dev)
    key = {"8bit": "master_correction", "remainder": "master_remainder"}[kw["master_weights"]]
    for p in fs.parameters():  # the state is compact and sharded like the param
        c = opt.state[p][key]
        assert type(c).__name__ == "DTensor" and c.dtype in (torch.int8, torch.int16) and c.placements == p.placements
        if kw["state_dtype"] == "8bit":  # codes sharded like the param, scales of the local buffer
            code = opt.state[p]["exp_avg_q8"]
            assert type(code).__name__ == "DTensor" and code.dtype == torch.int8
            assert opt.state[p]["exp_avg_scale"].numel() == -(-code._local_tensor.numel() // 32)
        if kw["state_dtype"] == "4bit_m":  # packed codes and scales of the local shard's buffer
            local = opt.state[p]["exp_avg_sq_q8"]._local_tensor.numel()
            assert opt.state[p]["exp_avg_q4"].numel() == -(-local // 2)
            assert opt.state[p]["exp_avg_scale"].numel() == -(-local // 32)
    saved_moments = _moments(opt, list(fs.parameters()))
    msd, osd = get_state_dict(fs, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out, "ckpt"))
    if rank == 0:
        torch.save(saved_moments, os.path.join(out, "saved_moments.pt"))
    _compact_steps(fs, opt, (20, 21), dev)
    res = _compact_result(fs, opt)
    if rank == 0:
        torch.save(res, os.path.join(out, "continuation.pt"))
    finish()


def compact_load(rank: int, world: int, store: str, ckpt: str, out: str, mode: str = "8bit-bf16",
                 backend: str = "gloo") -> None:
    """Load the compact checkpoint on another number of ranks (uneven shards) and continue."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    dev = init(rank, world, store, backend)
    fs = shard(model(torch.bfloat16, dev), dev)
    opt = mpkern.FusedAdamWMP(fs.parameters(), lr=1e-2, max_grad_norm=0.5, **COMPACT_MODES[mode])
    msd, osd = get_state_dict(fs, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=ckpt)
    set_state_dict(fs, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    loaded_moments = _moments(opt, list(fs.parameters()))
    _compact_steps(fs, opt, (20, 21), dev)
    res = _compact_result(fs, opt)
    res["loaded_moments"] = loaded_moments
    if rank == 0:
        torch.save(res, out)
    finish()


# ---- DDP and hand sharding ------------------------------------------------------------------------
def ddp(rank: int, world: int, store: str, out: str, backend: str = "gloo") -> None:
    """DDP with gradient_as_bucket_view and no_sync accumulation == one process on the full batch."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = init(rank, world, store, backend)
    ref = model(torch.float32, dev)
    dm = DDP(copy.deepcopy(ref), gradient_as_bucket_view=True)
    o = mpkern.FusedAdamWMP(dm.parameters(), lr=1e-2, max_grad_norm=1.0)
    o_ref = mpkern.FusedAdamWMP(ref.parameters(), lr=1e-2, max_grad_norm=1.0)
    n = 8 * world
    for step in range(4):
        xs = [batch(100 * step + k, dev, torch.float32, n) for k in range(2)]  # two micro-batches
        for k, x in enumerate(xs):
            mine = x[rank * 8:(rank + 1) * 8]
            if k == 0:
                with dm.no_sync():
                    (loss_of(dm, mine) / 2).backward()
            else:
                (loss_of(dm, mine) / 2).backward()
            (loss_of(ref, x) / 2).backward()
        with count_all_reduce() as calls:
            o.step()
        assert not calls  # DDP grads are already global: no collective from mpkern
        o_ref.step()
        o.zero_grad()
        o_ref.zero_grad()
    for p, q in zip(dm.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    finish()


def hand_sharded(rank: int, world: int, store: str, out: str, backend: str = "gloo") -> None:
    """ZeRO-style flat shards with process_group=: global norm and skip over the group."""
    dev = init(rank, world, store, backend)
    g = torch.Generator().manual_seed(7)
    full_grads = [torch.randn(1000, generator=g) * 3, torch.randn(37, generator=g)]
    chunks = [f.chunk(world) for f in full_grads]
    mine = [torch.nn.Parameter(torch.zeros_like(c[rank])) for c in chunks]
    for p, c in zip(mine, chunks):
        p.grad = c[rank].clone().to(dev)
    ref_norm = torch.cat(full_grads).double().norm() * 0.25
    with count_all_reduce() as calls:
        r = mpkern.unscale_(mine, 0.25, max_norm=1.0, process_group=dist.group.WORLD)
    assert len(calls) == 1
    torch.testing.assert_close(r.total_norm.double(), ref_norm, rtol=1e-6, atol=0)
    coef = 1.0 / (float(ref_norm) + 1e-6)
    for p, c in zip(mine, chunks):
        torch.testing.assert_close(p.grad, c[rank] * 0.25 * coef, rtol=1e-6, atol=1e-7)
    # tensor-parallel placements: Shard(1) summed over ranks, Replicate and a plain (replicated)
    # tensor counted once -- not world-size times
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh(dev.type, (world,))
    a, b = torch.randn(6, 8, generator=g).to(dev), torch.randn(5, 4, generator=g).to(dev)
    pa = torch.nn.Parameter(distribute_tensor(a.clone(), mesh, [Shard(1)]))
    pb = torch.nn.Parameter(distribute_tensor(b.clone(), mesh, [Replicate()]))
    pc = torch.nn.Parameter(torch.ones(3, device=dev))
    pa.grad = distribute_tensor(a * 2, mesh, [Shard(1)])
    pb.grad = distribute_tensor(b * 3, mesh, [Replicate()])
    pc.grad = torch.tensor([1.0, 2.0, 2.0], device=dev)
    with count_all_reduce() as calls:
        r = mpkern.unscale_([pa, pb, pc], 1.0, per_tensor=True)
    assert len(calls) == 1
    want = torch.stack([(a * 2).double().norm(), (b * 3).double().norm(), torch.tensor(3.0, dtype=torch.float64)])
    torch.testing.assert_close(r.per_tensor_norm.double().cpu(), want.cpu(), rtol=1e-6, atol=0)
    torch.testing.assert_close(r.total_norm.double().cpu(), want.norm().cpu(), rtol=1e-6, atol=0)
    # process_group=: a plain param replicated over the group (tensor-parallel LayerNorm weight),
    # marked so, counts once; the sharded one is summed over the ranks
    rep_p = torch.nn.Parameter(torch.ones(4, device=dev))
    rep_p.grad = torch.tensor([1.0, 2.0, 2.0, 4.0], device=dev)  # same on every rank: norm 5
    shard_p = torch.nn.Parameter(torch.ones(2, device=dev))
    shard_p.grad = torch.tensor([3.0, 4.0], device=dev) * (rank + 1)
    mpkern.distributed.mark_replicated(rep_p)
    r = mpkern.unscale_([rep_p, shard_p], 1.0, process_group=dist.group.WORLD)
    want_sq = 25.0 + sum(25.0 * (k + 1) ** 2 for k in range(world))
    torch.testing.assert_close(r.total_norm.double().cpu(), torch.tensor(want_sq, dtype=torch.float64).sqrt(),
                               rtol=1e-6, atol=0)
    # the optimizer carries the group for max_grad_norm; an inf on one rank skips everywhere
    opt = mpkern.FusedAdamWMP(mine, lr=0.1, max_grad_norm=1.0, process_group=dist.group.WORLD)
    for p, c in zip(mine, chunks):
        p.grad = c[rank].clone()
    if rank == 1:
        mine[1].grad[0] = float("inf")
    before = [p.detach().clone() for p in mine]
    opt.step()
    assert float(opt.last_found_inf) == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, mine))
    finish()
