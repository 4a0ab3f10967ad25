"""The runtime state of one ``FusedAdamWMP`` and its cached eager step.

:class:`Runtime` is the one owner of what an optimizer keeps between steps besides
``param_groups`` / ``state``: the stamps of the params after its own writes, the flat offsets of
DTensor shards, the storage-sharing count, the step cache, the unscale/clip left by
``mpkern.unscale_`` / ``clip_grad_norm_`` (:class:`mpkern._fused_unscale.Pending`), what the last step
reported (``last_grad_norm`` / ``last_found_inf``) and the attached GradScaler. The optimizer
holds one (``opt.mpkern_runtime``) and hands it, with its param groups and state, to the helpers
of :mod:`mpkern.optim`; nothing else reaches into the optimizer.

Every mutable piece lives in a dict (``live``, ``versions``, ``offsets``, ``work``) that is
mutated, never rebound: ``torch.compile`` replays dict mutations inside a compiled step, but not
attribute stores on objects it did not create.

The cached step: after a full step whose buckets are plain, dense, contiguous tensors on one
device with a native (C++/CUDA) backend, :func:`build` hands the kernel lists to
``mpkern._C.StepCache`` (csrc/fastpath.cpp). Each later eager step :func:`refresh` re-checks, in
O(groups) Python and one C++ loop over the params, that nothing the full step looks at has
changed, and :func:`fast_step` plans the step's factor (:func:`mpkern.optim.step_plan.plan_step`, as the full
path does) and runs the registered ``mpkern::adamw_step_`` op through the dispatcher with the
cached lists -- bitwise the same step. Anything else takes the full path, which rebuilds it.
"""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Any, NamedTuple

import torch

from .. import _backend, _fused_unscale, _ops, _scaler_internals, distributed
from . import step_plan, writes
from .functional import group_scalars

Tensor = torch.Tensor
Parameter = torch.nn.Parameter
_PLAIN = (Parameter, Tensor)

#: what a step leaves for the next one or for the caller (saved by pickling and ``deepcopy``)
LIVE_KEYS = ("_pending", "last_grad_norm", "last_found_inf")
_MAX_MISSES = 4  # cache invalidations in a row after which builds back off (every 64th full step)


def stamp(t: Tensor) -> Any:
    """What tells, on the host and without a sync, that ``t`` was written or replaced since the
    stamp was taken: its version counter (in-place writes through ``t`` or its views) and its data
    pointer (``t.data = other``, ``Module._apply`` / ``.to()``, ``set_``, swaps). Writes through a
    ``.data`` alias (``t.data.fill_(x)``) change neither -- PyTorch gives ``.data`` its own
    version counter -- and cannot be seen here. DTensors: the wrapper's and the local shard's."""
    if type(t) not in _PLAIN and distributed.is_dtensor(t):
        lt = distributed.local(t)
        return (t._version, lt._version, lt.data_ptr())  # noqa: SLF001 -- torch's write counter: no public accessor
    return (t._version, t.data_ptr())  # noqa: SLF001 -- torch's write counter: no public accessor


class Runtime:
    """The runtime state of one optimizer (see the module docs). ``process_group`` is fixed at
    construction; everything else is in the dicts ``live``, ``versions``, ``offsets``, ``work``."""

    def __init__(self, process_group: Any = None, live: dict[str, Any] | None = None) -> None:
        self.process_group = process_group
        #: what a step leaves (LIVE_KEYS), ``traced`` (a compiled step ran) and ``scaler`` (a weakref)
        self.live: dict[str, Any] = dict.fromkeys((*LIVE_KEYS, "traced", "scaler"))
        self.live.update(live or {})
        #: id(param) -> its stamp after our last write (writes.LOADED: loaded since the last step)
        self.versions: dict[int, Any] = {}
        self.offsets: dict[int, int] = {}  # id(DTensor param) -> flat offset of its local shard
        #: ``cache``: the StepCache or None; ``misses``: invalidations in a row; ``storage``: see shares_storage;
        #: ``release``: the gradient release's :class:`~.release.Release` (None: steps run in ``step()``)
        self.work: dict[str, Any] = {"cache": None, "misses": 0, "storage": None, "release": None}

    @classmethod
    def resumed(cls, rt: Runtime | None, live: dict[str, Any], process_group: Any, params: Any) -> Runtime:
        """The runtime after ``Optimizer.__setstate__``: for a copy or an unpickle (``rt`` None) a new
        one with what the step left (``live``); for ``Optimizer.load_state_dict``'s own call ``rt``
        itself, what a step left replaced by ``live``, shard offsets dropped (the process group and
        the attached scaler stay). Either way every param of ``params`` is taken as written by us
        (params and masters were copied together: they agree now)."""
        if rt is None:
            rt = cls(process_group, live)
        else:
            rt.live.update(dict.fromkeys(LIVE_KEYS))
            rt.live.update(live)
            rt.offsets.clear()
        rt.stamp_all(params)
        return rt

    # ---- what mpkern.unscale_ / clip_grad_norm_ leave, what a step reports ---------------------
    @property
    def pending(self) -> _fused_unscale.Pending | None:
        """The unscale/clip left for the next step (None: none)."""
        return self.live["_pending"]

    def leave(self, pending: _fused_unscale.Pending | None) -> None:
        """Leave ``pending`` for the next step (replacing what was there; None drops it)."""
        self.live["_pending"] = pending

    def take_pending(self) -> _fused_unscale.Pending | None:
        """The pending unscale/clip, consumed (a step applies it once)."""
        pending = self.live["_pending"]
        self.live["_pending"] = None
        return pending

    def record(self, plan: step_plan.StepPlan) -> None:
        """What a step reports: ``last_found_inf``, and ``last_grad_norm`` when it computed a norm."""
        if plan.norm is not None:
            self.live["last_grad_norm"] = plan.norm
        self.live["last_found_inf"] = plan.found_inf

    def attach_scaler(self, scaler: torch.amp.GradScaler) -> None:
        self.live["scaler"] = weakref.ref(scaler)

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The attached GradScaler, if it is still alive."""
        ref = self.live["scaler"]
        return None if ref is None else ref()

    def tell_scaler(self, optimizer: Any, found: Tensor) -> None:
        """Record ``found`` (which includes what GradScaler found in ``.grad``) for ``optimizer`` in the
        attached GradScaler, so that ``scaler.update()`` backs off on an overflow only ``main_grad`` held."""
        scaler = self.scaler
        if scaler is None:
            warnings.warn("FusedAdamWMP.step: a GradScaler stepped this optimizer with main_grad present, but none "
                          "is attached; an overflow in main_grad skips the step but cannot back off the scale -- call "
                          "opt.attach_grad_scaler(scaler) once, or mpkern.unscale_(opt, scaler=scaler) before "
                          "scaler.step(opt)", UserWarning, stacklevel=4)
            return
        _scaler_internals.record_found_inf(scaler, optimizer, found, unscaled=False)

    # ---- stamps: writes by others -----------------------------------------------------------
    def stamp_all(self, params: Any) -> None:
        """Take every param of ``params`` (the optimizer's ``state`` keys) as written by us now."""
        self.versions.clear()
        self.versions.update((id(p), stamp(p)) for p in params if isinstance(p, Tensor))
        self.drop_cache()

    def mark_loaded(self, params: Any) -> None:
        """After a checkpoint load: each master is checked against its param at the next step."""
        self.versions.clear()
        self.versions.update((id(p), writes.LOADED) for p in params if isinstance(p, Tensor))
        self.drop_cache()

    def restamp_after_compiled(self, params: Any) -> None:
        """The first eager step after compiled ones takes the params as the optimizer wrote them
        (writes between compiled steps are not seen, as documented): their stamps moved with the
        compiled step's own writes, and taking them for external writes would reset remainders and
        8-bit corrections. A "just loaded" mark is kept."""
        self.live["traced"] = False
        versions = self.versions
        for p in params:
            if isinstance(p, Tensor) and versions.get(id(p), -1) is not writes.LOADED:
                versions[id(p)] = stamp(p)

    def conform(self, kind: Any, p: Tensor, st: dict[str, Any], groups: list[dict[str, Any]]) -> None:
        """Make the state of ``p`` fit the param as it is now (:func:`.writes.conform`); record its stamp."""
        self.drop_cache()
        writes.conform(kind, p, st, recorded=self.versions.get(id(p), -1),
                       shared=lambda: self.shares_storage(groups, p))
        self.versions[id(p)] = stamp(p)

    def reset_storage_count(self) -> None:
        self.work["storage"] = None

    def shares_storage(self, groups: list[dict[str, Any]], p: Tensor) -> bool:
        """True if ``p``'s storage also holds another param of ``groups`` (views of one flat buffer
        share one version counter, so a write to one of them cannot be told apart). The count is
        kept until :meth:`reset_storage_count` (every step)."""
        count = self.work["storage"]
        if count is None:
            count = {}
            for group in groups:
                for q in group["params"]:
                    key = distributed.local(q).untyped_storage().data_ptr()
                    count[key] = count.get(key, 0) + 1
            self.work["storage"] = count
        return count.get(distributed.local(p).untyped_storage().data_ptr(), 0) > 1

    def shard_offset(self, p: Tensor) -> int:
        """Where the random stream of DTensor ``p``'s local shard starts (computed once per param)."""
        off = self.offsets.get(id(p))
        if off is None:
            off = self.offsets[id(p)] = distributed.shard_offset(p)
        return off

    @property
    def release(self) -> Any:
        """The :class:`~.release.Release` of an optimizer built with ``release_grads=True``, else None."""
        return self.work["release"]

    # ---- the step cache --------------------------------------------------------------------
    @property
    def cache(self) -> StepCache | None:
        """The step cache (None: the next eager step takes the full path)."""
        return self.work["cache"]

    def drop_cache(self) -> None:
        self.work["cache"] = None


class CachedBucket(NamedTuple):
    """One cached kernel call: its group, its params, and ``scalars``: [the group values its kernel
    scalars were made from, those scalars by their argument names] (remade when a value changes, e.g. a
    scheduled weight decay)."""

    group: dict[str, Any]
    params: list[Tensor]
    scalars: list


def _scalar_inputs(group: dict[str, Any]) -> tuple:
    return (group["betas"], group["eps"], group["weight_decay"], group["maximize"], group["stochastic_rounding"],
            group["seed"])


class StepCache(NamedTuple):
    """What :func:`refresh` checks besides the C++ cache (``cache``, ``mpkern._C.StepCache``): the
    objects the cached lists were built from."""

    cache: Any
    groups_list: list
    groups: list  # (group dict, its params list, cache_flags(group))
    state: Any
    device: torch.device
    forced: str | None  # MPKERN_BACKEND when it was built (a change re-selects the backend)
    buckets: list[CachedBucket]  # in kernel order


def cache_flags(group: dict[str, Any]) -> tuple:
    """The group settings that decide its buckets and state tensors (a change takes the full path)."""
    return (group["amsgrad"], group["master_weights"], group["state_dtype"], group["stochastic_rounding"])


def _device_if_cacheable(rt: Runtime, prepared: list) -> torch.device | None:
    """The device when every prepared bucket may be cached, else None."""
    if rt.process_group is not None:
        return None
    work = rt.work
    if work["misses"] >= _MAX_MISSES:  # a cache that keeps being invalidated: rebuilt every 64th full step
        work["misses"] += 1
        if work["misses"] % 64:
            return None
    ext = _backend.native()
    if ext is None or not hasattr(ext, "StepCache"):
        return None
    dev = prepared[0].bucket.device
    if any(prep.bucket.backend != dev.type or prep.bucket.backend not in ("cpu", "cuda") for prep in prepared):
        return None
    return dev


def _param_index(prepared: list, dev: torch.device) -> dict[int, tuple[int, int]] | None:
    """id(param) -> (bucket, position), or None when a bucket is not plain (copies, another device,
    a repeated param, a subclass, a non-contiguous param or grad)."""
    index: dict[int, tuple[int, int]] = {}
    for bi, prep in enumerate(prepared):
        if prep.copies or prep.bucket.device != dev:
            return None
        for pos, (p, g, _sid) in enumerate(prep.bucket.pairs):
            if (id(p) in index or type(p) not in _PLAIN or type(g) is not Tensor or not p.is_contiguous()
                    or not g.is_contiguous()):
                return None
            index[id(p)] = (bi, pos)
    return index


def build(rt: Runtime, groups: list[dict[str, Any]], state: Any, prepared: list, uses_main: bool,
          check_writes: bool) -> None:
    """After a full step: cache its kernel argument lists when every bucket qualifies (one device
    with a native backend, plain dense contiguous params and grads, no repeated param, no
    ``main_grad``, no process group, eager with the write check on)."""
    if not check_writes:  # compiling, capturing or the write check off: the cache stays as it is
        return            # (a later eager step re-validates it in full)
    rt.drop_cache()
    dev = None if uses_main else _device_if_cacheable(rt, prepared)
    if dev is None:
        return
    index = _param_index(prepared, dev)
    if index is None:
        return
    versions = rt.versions
    params, pdicts, sdicts, bucket_of, pos_of = [], [], [], [], []
    for group in groups:
        for p in group["params"]:
            if type(p) not in _PLAIN:
                return
            bi, pos = index.get(id(p), (-1, 0))
            st = None if bi < 0 else state.get(p)
            if bi >= 0 and (st is None or versions.get(id(p), -1) != stamp(p)):
                return
            bucket_of.append(bi)
            pos_of.append(pos)
            sdicts.append(st)
            params.append(p)
            pdicts.append(p.__dict__)
    cache = _backend.native().StepCache([g["params"] for g in groups], params, pdicts, sdicts, state, bucket_of,
                                        pos_of)
    cached = []
    for prep in prepared:
        ls, b = prep.lists, prep.bucket
        cache.add_bucket(ls, b.kind.name)
        scalars = [_scalar_inputs(b.group), group_scalars(b.group)._asdict()]
        cached.append(CachedBucket(b.group, [p for p, *_ in b.pairs], scalars))
    rt.work["cache"] = StepCache(cache, groups, [(g, g["params"], cache_flags(g)) for g in groups], state, dev,
                                 os.environ.get(_backend.ENV), cached)


def refresh(rt: Runtime, groups: list[dict[str, Any]], state: Any) -> StepCache | None:
    """The step cache, re-validated (grads gathered), or None: take the full path (also while
    compiling or capturing a CUDA graph: those trace or record the full path). O(groups)
    Python checks here, then one C++ loop over the params (csrc/fastpath.cpp: param identities and
    stamps, grad presence/dtype/shape/contiguity, no main_grad, state dicts unchanged)."""
    fc = rt.work["cache"]
    if fc is None or torch.compiler.is_compiling() or _ops.capturing():
        return None
    ok = (groups is fc.groups_list and len(groups) == len(fc.groups) and state is fc.state
          and os.environ.get(_backend.ENV) == fc.forced)
    if ok:
        for group, (g0, plist, flags) in zip(groups, fc.groups):
            if group is not g0 or group["params"] is not plist or cache_flags(group) != flags:
                ok = False
                break
    work = rt.work
    if not ok or not fc.cache.refresh():
        work["cache"] = None
        work["misses"] += 1
        return None
    work["misses"] = 0
    return fc


def fast_step(rt: Runtime, fc: StepCache, max_norm: float | None, grad_scale: Tensor | None,
              found_inf: Tensor | None) -> None:
    """``step()`` over the cached lists: the same plan and kernels as the full path (the statistics
    pass and the fused update run as the registered ops, called from C++ with the cached lists)."""
    dev = fc.device
    rt.reset_storage_count()
    lrs = [_ops.lr_args(b.group["lr"], dev) for b in fc.buckets]
    plan = step_plan.plan_step(rt.take_pending(), max_norm=max_norm, grad_scale=grad_scale, found_inf=found_inf,
                         device=dev, stats=fc.cache.grad_stats if max_norm is not None else None)
    rt.record(plan)
    factor = plan.factor if plan.factor.device == dev else _ops.copy_f32(plan.factor, dev)
    found = plan.found_inf if plan.found_inf.device == dev else _ops.copy_f32(plan.found_inf, dev)
    versions = rt.versions
    for bi, (b, (lr_tensor, lr_value)) in enumerate(zip(fc.buckets, lrs)):
        inputs = _scalar_inputs(b.group)
        if inputs != b.scalars[0]:
            b.scalars[:] = [inputs, group_scalars(b.group)._asdict()]
        if fc.cache.adamw(bi, factor, found, lr_tensor, lr_value, b.scalars[1]):
            # a kernel that bumps versions (as in the full path): take the params as ours again
            for p in b.params:
                versions[id(p)] = stamp(p)
            rt.drop_cache()


__all__ = ["LIVE_KEYS", "Runtime", "StepCache", "build", "cache_flags", "fast_step", "refresh", "stamp"]
