"""From param groups to kernel buckets: collect the grads, prepare the kernel lists, capture rules.

A *bucket* is what one kernel call steps: one param group, one device, one master kind.
:func:`collect` validates every grad (raising before any param or state is touched) and sorts the
params into buckets; :func:`prepare` builds a bucket's :class:`~.functional.KernelLists` (creating
or conforming state on the way); :func:`run` calls one fused kernel per bucket. They take the
optimizer's ``param_groups`` / ``state`` and its :class:`~.runtime.Runtime`, never the optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .. import _backend, _grads, _ops, distributed
from ..distributed import local as _local
from . import step_plan, storage
from .functional import KernelLists, fused_adamw_mp
from .runtime import Runtime, build as build_cache, stamp

Tensor = torch.Tensor
Parameter = torch.nn.Parameter
_flat_view = storage.flat_view


class Bucket(NamedTuple):
    """One kernel call's params: ``pairs`` of (param, grad, random-stream id); ``backend``: the
    backend that steps it (chosen once per device in :func:`collect`)."""

    group: dict[str, Any]
    device: torch.device
    kind: storage.MasterKind
    pairs: list[tuple[Tensor, Tensor, int]]
    backend: str


def collect(groups: list[dict[str, Any]]) -> tuple[list[Bucket], bool]:
    """(buckets, whether any grad is a ``main_grad``), validated; raises before any param or state is
    modified.

    A param listed twice in one group (``torch.optim`` warns about it) is stepped twice, like
    ``torch.optim.AdamW`` does on its single-tensor path: each repeat goes to a later pass.
    A param with both ``main_grad`` and ``.grad`` (a tied weight) gets their sum.
    """
    found: list[tuple[dict[str, Any], torch.device, storage.MasterKind, list[tuple[Tensor, Tensor, int]]]] = []
    uses_main = False
    strided, floats = torch.strided, _grads.FLOATS
    sid = -1  # the param's random-stream id: its position among all params of the optimizer
    for gi, group in enumerate(groups):
        passes: list[dict[tuple[torch.device, storage.MasterKind], list[tuple[Tensor, Tensor, int]]]] = [{}]
        plist = group["params"]
        seen: dict[int, int] | None = {} if len(set(map(id, plist))) != len(plist) else None  # C-level test
        kinds: dict[torch.dtype, storage.MasterKind] = {}
        for pi, p in enumerate(plist):
            sid += 1
            g = getattr(p, "main_grad", None)  # _grads.grad_of, inlined: this loop runs per param
            if g is None:
                g = p.grad
                if g is None:
                    continue
            else:
                uses_main = True
                if p.grad is not None:
                    g = _grads.main_grad_of(p, g)
            # one cheap combined test per param; the detailed message only on failure
            if not (isinstance(g, Tensor) and g.layout == strided and g.dtype in floats
                    and g.shape == p.shape and g.device == p.device):
                _grads.raise_bad_grad("FusedAdamWMP", f"group {gi} param {pi}", g, p)
            if type(g) is not Tensor:
                distributed.check_reduced(g, f"FusedAdamWMP: group {gi} param {pi}")
            kind = kinds.get(p.dtype)
            if kind is None:  # once per dtype and group: a param may have changed dtype since
                check_param_dtype(group, p.dtype, f"param {pi} of group {gi}")
                kind = kinds[p.dtype] = storage.master_kind(group["master_weights"], p.dtype)
            if seen is None:
                passes[0].setdefault((p.device, kind), []).append((p, g, sid))
                continue
            k = seen.get(id(p), -1) + 1  # a repeated param: a later pass
            seen[id(p)] = k
            if k == len(passes):
                passes.append({})
            passes[k].setdefault((p.device, kind), []).append((p, g, sid))
        for buckets in passes:
            for (dev, kind), pairs in buckets.items():
                found.append((group, dev, kind, pairs))
    backends = {dev: _backend.select(dev) for dev in {b[1] for b in found}}
    work = [Bucket(group, dev, kind, pairs, backends[dev]) for group, dev, kind, pairs in found]
    for b in work:
        storage.check_backend(b.kind, b.group["state_dtype"], b.backend)
    return work, uses_main


def step_order(groups: list[dict[str, Any]], present: Any) -> list[Tensor]:
    """The params of ``groups`` whose id is in ``present``, in the order :func:`collect` puts them when
    exactly those have grads -- so the order of the step's statistics pass (:func:`stats_pass`): group
    by group, and in a group bucket by bucket, the (device, master kind) buckets in order of first
    appearance. For params listed once (gradient release, which needs it, refuses repeats)."""
    out: list[Tensor] = []
    for group in groups:
        found: dict[tuple[torch.device, storage.MasterKind], list[Tensor]] = {}
        for p in group["params"]:
            if id(p) in present:
                found.setdefault((p.device, storage.master_kind(group["master_weights"], p.dtype)), []).append(p)
        for params in found.values():
            out.extend(params)
    return out


def check_param_dtype(group: dict[str, Any], dtype: torch.dtype, where: str) -> None:
    """Raise if a param of ``dtype`` cannot be stepped by ``group``'s storage mode."""
    storage.MASTER_KINDS[group["master_weights"]].check_param_dtype(dtype, where)
    if group["stochastic_rounding"] and dtype == torch.float16:
        raise ValueError(f"FusedAdamWMP: stochastic_rounding supports bfloat16 params, {where} is float16")


class Prepared(NamedTuple):
    """A bucket ready for its kernel: its lists, its contiguous copies, its ``(lr_tensor, lr)``."""

    bucket: Bucket
    lists: KernelLists
    copies: list[tuple[Tensor, Tensor]]
    lr: tuple[Tensor | None, float]


def prepare(rt: Runtime, groups: list[dict[str, Any]], state: Any, bucket: Bucket, check_writes: bool
            ) -> tuple[KernelLists, list[tuple[Tensor, Tensor]]]:
    """Kernel argument lists for one bucket: flat views of dense params/grads/state, and each
    param's random stream (id, offset of its local shard in the whole tensor); plus the
    (param, contiguous copy) pairs of params that are not one dense block. (The loop runs per
    param on the full path: list appends are bound once, the common case is tested first.)"""
    group, kind = bucket.group, bucket.kind
    params, grads, ms, vs, vmaxs, masters, steps, sids, offsets = [], [], [], [], [], [], [], [], []
    mscales: list[Tensor] = []
    vscales: list[Tensor] = []
    write_backs: list[tuple[Any, Tensor, dict, Any]] = []
    copies: list[tuple[Tensor, Tensor]] = []
    amsgrad = group["amsgrad"]
    mkey = kind.key
    moments = storage.moment_kind(group["state_dtype"])
    kernel_tensors, write_back = moments.kernel_tensors, moments.needs_write_back
    versions = rt.versions
    for p, g, sid in bucket.pairs:
        sids.append(sid)
        st = state.get(p)
        if st is None or "step" not in st:
            rt.drop_cache()
            st = init_state(state, group, p)
            if check_writes:
                versions[id(p)] = stamp(p)
        elif check_writes and versions.get(id(p), -1) != (
                (p._version, p.data_ptr()) if type(p) is Parameter else stamp(p)):  # noqa: SLF001 -- torch's write counter: no public accessor
            rt.conform(kind, p, st, groups)  # written or replaced: records the stamp
        elif mkey not in st if mkey is not None else storage.stored_kinds(st):
            rt.conform(kind, p, st, groups)  # a converted checkpoint or a new param dtype
        if amsgrad and "max_exp_avg_sq" not in st:
            st["max_exp_avg_sq"] = storage.like(p, torch.float32).zero_()
        km = kernel_tensors(st)
        m, v, m_scale, v_scale = km
        if m_scale is not None:
            assert v_scale is not None  # a kind with scales has both
            mscales.append(m_scale)
            vscales.append(v_scale)
        if write_back:
            write_backs.append((moments, p, st, km))
        ts = [m, v]
        if amsgrad:
            ts.append(st["max_exp_avg_sq"])
        if mkey is not None:
            ts.append(st[mkey])
        if type(p) is not Parameter and distributed.is_dtensor(p):
            # FSDP2 / tensor parallel: the kernel updates the local shard, drawing the random
            # bits the whole tensor would draw at its elements
            offsets.append(rt.shard_offset(p))
            p, g, ts = _local(p), _local(g), [_local(t) for t in ts]
        else:
            offsets.append(0)
        if p.is_contiguous():
            if not g.is_contiguous():
                g = g.contiguous()
        else:
            p, g, ts = _dense(p, g, ts, copies)
        params.append(p)
        grads.append(g)
        ms.append(ts[0])
        vs.append(ts[1])
        if amsgrad:
            vmaxs.append(ts[2])
        if mkey is not None:
            masters.append(ts[-1])
        steps.append(st["step"])
    scaled = len(mscales) > 0  # not bool(list): dynamo 2.11 cannot trace it here
    return KernelLists(params, grads, ms, vs, vmaxs, masters, steps, sids, offsets, mscales if scaled else None,
                       vscales if scaled else None, moments.codec, write_backs), copies


def prepare_all(rt: Runtime, groups: list[dict[str, Any]], state: Any, work: list[Bucket], check_writes: bool
                ) -> list[Prepared]:
    """Every bucket of ``work`` ready for its kernel (:func:`prepare`, and its lr arguments)."""
    rt.reset_storage_count()
    return [Prepared(b, *prepare(rt, groups, state, b, check_writes), _ops.lr_args(b.group["lr"], b.device))
            for b in work]


def full_step(rt: Runtime, groups: list[dict[str, Any]], state: Any, optimizer: Any, *, max_grad_norm: float | None,
              grad_scale: Tensor | None, found_inf: Tensor | None, check_writes: bool, cache: bool) -> None:
    """``step()`` without the step cache: collect, prepare every bucket, plan the factor, run the
    kernels (and build the cache when ``cache``). ``grad_scale`` / ``found_inf``: what GradScaler handed
    over; ``optimizer`` is only named to the attached GradScaler (its per-optimizer record)."""
    work, uses_main = collect(groups)
    check_capture(groups, state, work)
    own_check = step_plan.check_step_scaler(rt.pending, grad_scale, found_inf, uses_main)
    if not work:
        rt.leave(None)
        return
    # the external-write check is host-side: it runs in eager steps (not while compiling or
    # capturing a CUDA graph, whose replays run no Python)
    check_writes = check_writes and not torch.compiler.is_compiling() and not _ops.capturing()
    prepared = prepare_all(rt, groups, state, work, check_writes)
    stats = stats_pass(work, rt.process_group) if max_grad_norm is not None or own_check else None
    # after everything that can fail: the pending unscale is kept on an error
    plan = step_plan.plan_step(rt.take_pending(), max_norm=max_grad_norm, grad_scale=grad_scale, found_inf=found_inf,
                         device=work[0].device, stats=stats)
    rt.record(plan)
    if own_check:
        rt.tell_scaler(optimizer, plan.found_inf)
    run(rt, prepared, plan.factor, plan.found_inf, check_writes)
    consume_main_grads(work)
    if cache:
        build_cache(rt, groups, state, prepared, uses_main, check_writes)


def init_state(optimizer_state: Any, group: dict[str, Any], p: Tensor) -> dict[str, Any]:
    """``p``'s state on its first step: step 0, zero moments of the group's kind, its master."""
    state = optimizer_state[p]
    if "step" in state:
        return state
    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
    state.update(storage.moment_kind(group["state_dtype"]).create(p))
    if group["amsgrad"]:
        state["max_exp_avg_sq"] = storage.like(p, torch.float32).zero_()
    state.update(storage.master_kind(group["master_weights"], p.dtype).create(p))
    return state


def _dense(p: Tensor, g: Tensor, ts: list[Tensor], copies: list[tuple[Tensor, Tensor]]
           ) -> tuple[Tensor, Tensor, list[Tensor]]:
    """(param, grad, state tensors) of a non-contiguous param as flat dense buffers of one memory order."""
    if _grads.is_flat(p):  # dense in another memory format: flat views, state laid out like p
        if g.stride() != p.stride():
            g = storage.like(p, g.dtype).copy_(g)
        return _flat_view(p), _flat_view(g), [_flat_view(t) for t in ts]
    # not one dense block: update a contiguous copy, written back after the kernel
    pp = p.contiguous()
    copies.append((p, pp))
    return pp, g.contiguous(), ts


def check_capture(groups: list[dict[str, Any]], state: Any, work: list[Bucket]) -> None:
    """During a CUDA graph capture, raise (naming the reason) unless the step can be captured:
    ``capturable=True``, state initialised by an eager warm-up step, lr a float or a tensor on
    the params' device (a CPU tensor's value would be frozen into the graph)."""
    if not _ops.capturing():
        return
    for gi, group in enumerate(groups):
        if not group["capturable"]:
            raise RuntimeError(f"FusedAdamWMP.step() is being captured in a CUDA graph, but param group {gi} "
                               "has capturable=False; construct the optimizer with capturable=True")
        lr = group["lr"]
        if isinstance(lr, Tensor) and lr.device.type == "cpu":
            raise RuntimeError(f"FusedAdamWMP: param group {gi} has a CPU tensor lr; in a captured CUDA graph "
                               "its value would be frozen -- use a float or a tensor on the params' device")
    for b in work:
        for p, *_ in b.pairs:
            if "step" not in state[p]:
                raise RuntimeError("FusedAdamWMP: a param has no optimizer state yet; run one eager step "
                                   "(warm-up) before capturing step() in a CUDA graph")


def consume_main_grads(work: list[Bucket]) -> None:
    """Set every ``main_grad`` that fed this step to None -- or, inside a CUDA graph capture,
    zero it in place (a replay must find the same buffers, and the zeroing is captured)."""
    mains = [p for b in work for p, *_ in b.pairs if getattr(p, "main_grad", None) is not None]
    if not mains:
        return
    if _ops.capturing():
        # main_grad: mpkern.nn's fp32 grad attribute on a weight (not one torch declares)
        torch._foreach_zero_([p.main_grad for p in mains])  # type: ignore[attr-defined]
        return
    for p in mains:
        p.main_grad = None  # type: ignore[attr-defined]  # as above


def run(rt: Runtime, prepared: list[Prepared], factor: Tensor, found: Tensor, check_writes: bool) -> None:
    """One fused kernel per prepared bucket; record the stamps the kernels moved."""
    per_dev: dict[torch.device, tuple[Tensor, Tensor]] = {}
    versions = rt.versions
    for bucket, lists, copies, (lr_tensor, lr_value) in prepared:
        dev = bucket.device
        if dev not in per_dev:
            per_dev[dev] = (factor if factor.device == dev else _ops.copy_f32(factor, dev),
                            found if found.device == dev else _ops.copy_f32(found, dev))
        f_dev, found_dev = per_dev[dev]
        for p, tmp in copies:  # not one dense block: (re)take the copy now -- a repeat of the
            tmp.copy_(p)       # param in a later pass must see the earlier pass's update
        fused_adamw_mp(bucket.backend, lists, f_dev, found_dev, lr_tensor, lr_value, bucket.group, bucket.kind.name)
        for p, tmp in copies:  # params that are not one dense block went through a copy
            p.copy_(tmp)
        if check_writes:
            # prepare recorded each param's stamp before the kernel. The native and Triton
            # kernels write through data pointers (no version bump): nothing to do. A backend
            # that bumps (the torch reference, the contiguous-copy path) is seen on the param
            # it touched and recorded again -- one host read per bucket in the common case.
            p0 = bucket.pairs[0][0]
            if copies or versions.get(id(p0)) != stamp(p0):
                for p, *_ in bucket.pairs:
                    versions[id(p)] = stamp(p)


def zero_main_grads(groups: list[dict[str, Any]], set_to_none: bool) -> None:
    """``zero_grad`` for ``p.main_grad`` of every param of ``groups`` (None, or zeroed in place)."""
    mains = []
    for g in groups:
        for p in g["params"]:
            if getattr(p, "main_grad", None) is not None:
                if set_to_none:
                    p.main_grad = None
                else:
                    mains.append(p.main_grad)
    if mains:
        torch._foreach_zero_(mains)


def stats_pass(work: list[Bucket], process_group: Any) -> Callable[[Tensor], tuple[Tensor, Tensor]]:
    """The step's statistics pass over the grads of ``work`` (a repeated param counted once, as in
    torch's clip), for :func:`mpkern.optim.step_plan.plan_step`: the stages of ``mpkern.unscale_``
    (:func:`mpkern.optim.step_plan.stats_pass`) on each bucket's backend."""
    seen: set[int] = set()
    firsts = []
    for b in work:
        for x in b.pairs:
            if id(x[0]) not in seen:
                seen.add(id(x[0]))
                firsts.append(x)
    backends = {b.device: b.backend for b in work}
    return step_plan.stats_pass([x[1] for x in firsts], [x[0] for x in firsts], process_group, backends)


__all__ = ["Bucket", "Prepared", "check_capture", "check_param_dtype", "collect", "consume_main_grads", "full_step",
           "prepare", "prepare_all", "run", "stats_pass", "step_order", "zero_main_grads"]
