"""The eager fast path of ``FusedAdamWMP.step``: the kernel lists of a full step, cached.

After a full step whose buckets are plain, dense, contiguous tensors on one device with a native
(C++/CUDA) backend, :func:`build` hands the lists to ``mpkern._C.StepCache`` (csrc/fastpath.cpp).
Each later eager step :func:`refresh` re-checks, in O(groups) Python and one C++ loop over the
params, that nothing the full step looks at has changed, and :func:`fast_step` calls the kernels
with the cached lists -- bitwise the same step. Anything else takes the full path, which rebuilds it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .. import _backend, _ops, amp
from .._grads import to_device
from . import scaling
from .functional import group_scalars
from .writes import stamp as _stamp

Tensor = torch.Tensor
Parameter = torch.nn.Parameter


class StepCache(NamedTuple):
    """What :func:`refresh` checks besides the C++ cache (``cache``, ``mpkern._C.StepCache``): the
    objects the cached lists were built from."""

    cache: Any
    groups_list: list
    groups: list  # (group dict, its params list, cache_flags(group))
    state: Any
    versions: dict
    device: torch.device
    backend: str
    buckets: list  # (group, its params) per cached bucket, in kernel order


def cache_flags(group: dict[str, Any]) -> tuple:
    """The group settings that decide its buckets and state tensors (a change takes the full path)."""
    return (group["amsgrad"], group["master_weights"], group["state_dtype"], group["stochastic_rounding"])


def _device_if_cacheable(opt: Any, prepared: list) -> tuple[torch.device, str] | None:
    """(device, backend) when every prepared bucket may be cached, else None."""
    if not opt._mpkern_step_cache or opt._mpkern_process_group is not None:
        return None
    if opt._fast_misses >= 4:  # a cache that keeps being invalidated: rebuilt every 64th full step
        opt._fast_misses += 1
        if opt._fast_misses % 64:
            return None
    ext = _backend.native()
    if ext is None or not hasattr(ext, "StepCache") or not ext.step_cache_supported():
        return None
    dev = prepared[0].bucket.device
    backend = _backend.select(dev)
    if backend not in ("cpu", "cuda") or backend != dev.type:
        return None
    return dev, backend


def _param_index(prepared: list, dev: torch.device) -> dict[int, tuple[int, int]] | None:
    """id(param) -> (bucket, position), or None when a bucket is not plain (copies, another device,
    a repeated param, a subclass, a non-contiguous param or grad)."""
    index: dict[int, tuple[int, int]] = {}
    plain = (Parameter, Tensor)
    for bi, prep in enumerate(prepared):
        if prep.copies or prep.bucket.device != dev:
            return None
        for pos, (p, g, _sid) in enumerate(prep.bucket.pairs):
            if (id(p) in index or type(p) not in plain or type(g) is not Tensor or not p.is_contiguous()
                    or not g.is_contiguous()):
                return None
            index[id(p)] = (bi, pos)
    return index


def build(opt: Any, prepared: list, uses_main: bool, check_writes: bool) -> None:
    """After a full step: cache its kernel argument lists when every bucket qualifies (one device
    with a native backend, plain dense contiguous params and grads, no repeated param, no
    ``main_grad``, no process group, eager with the write check on)."""
    if not check_writes:  # compiling, capturing or the write check off: the cache stays as it is
        return            # (a later eager step re-validates it in full)
    opt._fast = None
    where = None if uses_main else _device_if_cacheable(opt, prepared)
    if where is None:
        return
    dev, backend = where
    index = _param_index(prepared, dev)
    if index is None:
        return
    versions, state = opt._versions, opt.state
    params, pdicts, sdicts, bucket_of, pos_of = [], [], [], [], []
    for group in opt.param_groups:
        for p in group["params"]:
            if type(p) not in (Parameter, Tensor):
                return
            bi, pos = index.get(id(p), (-1, 0))
            st = None if bi < 0 else state.get(p)
            if bi >= 0 and (st is None or versions.get(id(p), -1) != _stamp(p)):
                return
            bucket_of.append(bi)
            pos_of.append(pos)
            sdicts.append(st)
            params.append(p)
            pdicts.append(p.__dict__)
    cache = _backend.native().StepCache([g["params"] for g in opt.param_groups], params, pdicts, sdicts, state,
                                        bucket_of, pos_of, dev.type == "cuda")
    buckets = []
    for prep in prepared:
        ls = prep.lists
        cache.add_bucket(ls.params, ls.exp_avgs, ls.exp_avg_sqs, ls.max_exp_avg_sqs, ls.masters, ls.steps,
                         ls.exp_avg_scales, ls.exp_avg_sq_scales, ls.stream_ids, ls.elem_offsets, prep.bucket.kind.mode)
        buckets.append((prep.bucket.group, [p for p, *_ in prep.bucket.pairs]))
    opt._fast = StepCache(cache, opt.param_groups, [(g, g["params"], cache_flags(g)) for g in opt.param_groups],
                          state, versions, dev, backend, buckets)


def refresh(opt: Any) -> StepCache | None:
    """The step cache, re-validated (grads gathered), or None: take the full path. O(groups)
    Python checks here, then one C++ loop over the params (csrc/fastpath.cpp: param identities and
    stamps, grad presence/dtype/shape/contiguity, no main_grad, state dicts unchanged)."""
    if torch.compiler.is_compiling() or _ops.capturing():
        return None
    fc = opt._fast
    if fc is None or not (opt._mpkern_step_cache and opt._mpkern_check_writes):
        return None
    groups = opt.param_groups
    ok = (groups is fc.groups_list and len(groups) == len(fc.groups) and opt.state is fc.state
          and opt._versions is fc.versions and opt._mpkern_process_group is None)
    if ok:
        for group, (g0, plist, flags) in zip(groups, fc.groups):
            if group is not g0 or group["params"] is not plist or cache_flags(group) != flags:
                ok = False
                break
    if not ok or _backend.select(fc.device) != fc.backend or not fc.cache.refresh():
        opt._fast = None
        opt._fast_misses += 1
        return None
    opt._fast_misses = 0
    return fc


def fast_step(opt: Any, fc: StepCache) -> None:
    """``step()`` over the cached lists: the same scalars and kernels as the full path (the
    statistics pass and the fused update called directly from C++ with the cached lists)."""
    dev = fc.device
    opt._storage_count = None
    lrs = [_ops.lr_args(group["lr"], dev) for group, _ps in fc.buckets]

    def stats(inv: Tensor) -> None:
        amp.unscale_cached(opt, inv, opt.max_grad_norm, dev, fc.cache.grad_stats)

    factor, found = scaling.step_factor(opt, dev, stats if opt.max_grad_norm is not None else None)
    f_dev = to_device(factor, dev, torch.float32).reshape(())
    found_dev = to_device(found, dev, torch.float32).reshape(())
    versions = opt._versions
    for bi, ((group, ps), (lr_tensor, lr_value)) in enumerate(zip(fc.buckets, lrs)):
        fc.cache.adamw(bi, f_dev, found_dev, lr_tensor, lr_value, *group_scalars(group))
        p0 = ps[0]
        if versions.get(id(p0)) != _stamp(p0):  # as in the full path (a kernel that bumps versions)
            for p in ps:
                versions[id(p)] = _stamp(p)
            opt._fast = None


__all__ = ["StepCache", "build", "cache_flags", "fast_step", "refresh"]
