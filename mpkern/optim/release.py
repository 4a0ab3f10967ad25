"""Gradient release: ``FusedAdamWMP(release_grads=True)`` steps inside backward and frees each grad.

The regular loop keeps every gradient alive from the end of backward to ``step()`` -- 2 B/param for
bf16 grads, 4 with an fp32 ``main_grad``. With release, a post-accumulate-grad hook on every param
collects ready grads into buckets of about ``release_bucket_bytes``; a full bucket is stepped with
the same fused multi-tensor kernel as ``step()`` (the lists prepared by :func:`.buckets.prepare`,
run by :func:`.buckets.run`) and its grads are dropped. The gradient bytes alive at once stay
under ``release_bucket_bytes`` + the largest param's grad.

Two ways through, chosen by :func:`backward` (``opt.backward(loss, scaler=None)``):

* **one pass** (no ``max_grad_norm``, no scaler): the step factor is 1, known before backward, so
  each bucket is stepped as it fills. A plain ``loss.backward()`` does the same (the hooks are
  always there; the last bucket is flushed by an autograd end-of-backward callback).
* **two passes** (clip and/or loss scaling): the factor depends on the global norm and the inf
  check, known only once every grad exists. Pass 1 (graph retained) only runs the statistics
  kernel of ``step()`` over each bucket and drops the grads; the per-tensor statistics are put in
  the order ``step()`` would have them (:func:`.buckets.step_order`) and finished by the same
  :func:`mpkern.optim.step_plan.plan_step`, so norm, clip coefficient and ``found_inf`` are bit-identical to
  ``loss.backward(); opt.step()``. On an overflow pass 2 never runs (one host read of the flag,
  between the passes: the only one) and nothing changes; the GradScaler is told, so its
  ``update()`` backs off. Else pass 2 steps the buckets with the known factor.

The per-element update is elementwise and each param keeps its random stream (its position
among the optimizer's params) and its step counter, so stepping it in a release bucket instead of
its group's bucket gives the same bits, for every storage mode.

Refused (before anything changes): gradient accumulation (a param holding a grad when backward
starts), a pending ``mpkern.unscale_`` / ``clip_grad_norm_``, distributed training (DDP's and
FSDP2's hooks reduce the grads after ours would have stepped), params on several devices, weights
whose grad goes to ``main_grad`` (``mpkern.nn`` ``fp32_main_grad=True``: no AccumulateGrad, so no
hook), a param listed twice, and a plain ``loss.backward()`` when the step must clip or scale.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from .. import _backend, _grads, _ops, _scaler_internals, distributed
from . import buckets, step_plan, storage
from .runtime import Runtime

Tensor = torch.Tensor

#: default ``release_bucket_bytes``: 32 MiB of grads per fused kernel call (benchmarks/RESULTS.md,
#: "Gradient release": the one-pass step costs the same from 8 MiB up on the CPU, and a bucket of
#: 32 MiB bf16 grads is 16M params, ~0.15 ms of an H200's bandwidth -- well above launch cost)
DEFAULT_BUCKET_BYTES = 32 << 20


def check_bucket_bytes(value: Any) -> int:
    """``release_bucket_bytes`` validated, as an int: bytes of grads per fused kernel call (a whole
    number >= 0; 0 steps every grad the moment it arrives)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"release_bucket_bytes must be a number of bytes (int), got {type(value).__name__}")
    if not (value >= 0 and value == int(value)):
        raise ValueError(f"release_bucket_bytes must be a whole number of bytes >= 0, got {value!r}")
    return int(value)


class Release:
    """What one release optimizer keeps for its in-backward steps (held by its :class:`Runtime`).

    ``mode``: None between backwards, "plain" inside a plain ``loss.backward()``, "stats" in pass 1,
    "step" in the one pass or pass 2. ``bucket``: the (param, grad) pairs waiting for the next
    flush; ``stats``: pass 1's per-bucket (params, sumsq, amax); ``done``: a backward stepped, so
    the next ``step()`` is a no-op. ``where``: id(param) -> (group, random-stream id), made when a
    backward starts."""

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = check_bucket_bytes(bucket_bytes)
        self.handles: dict[int, Any] = {}
        self.mode: str | None = None
        self.bucket: list[tuple[Tensor, Tensor]] = []
        self.nbytes = 0
        self.peak_bytes = 0  # the most grad bytes the buckets held at once in the last backward
        self.stats: list[tuple[list[Tensor], Tensor, Tensor]] = []
        self.where: dict[int, tuple[dict[str, Any], int]] = {}
        self.backend = "cpu"
        self.task = -1  # the graph task of the plain backward in progress
        self.inv: Tensor | None = None
        self.factor: Tensor | None = None
        self.found: Tensor | None = None
        self.passes = 0  # backward passes the last opt.backward ran (1 or 2; 1 on an overflow)
        self.done = False
        self.perm: tuple[tuple[int, ...], Tensor] | None = None

    def reset(self) -> None:
        """Back to "between backwards": nothing pending, no grad held."""
        self.mode, self.bucket, self.nbytes, self.stats = None, [], 0, []
        self.inv = self.factor = self.found = None

    def take_done(self) -> bool:
        """True (once) when a backward has stepped since the last ``step()``."""
        done, self.done = self.done, False
        return done

    # ---- hooks ------------------------------------------------------------------------------
    def hook_params(self, groups: list[dict[str, Any]], on_grad: Callable[[Tensor], None]) -> None:
        """Register ``on_grad`` as the post-accumulate-grad hook of every param of ``groups`` that
        requires grad and has none yet (kept weakly: a dead optimizer's hooks do nothing)."""
        ref = weakref.WeakMethod(on_grad) if hasattr(on_grad, "__self__") else (lambda: on_grad)
        for group in groups:
            for p in group["params"]:
                if id(p) in self.handles or not p.requires_grad:
                    continue
                self.handles[id(p)] = p.register_post_accumulate_grad_hook(_weak_hook(ref))


def _weak_hook(ref: Callable[[], Any]) -> Callable[[Tensor], None]:
    def hook(p: Tensor) -> None:
        fn = ref()
        if fn is not None:
            fn(p)
    return hook


# ---- starting a backward -----------------------------------------------------------------------
def begin(rel: Release, rt: Runtime, groups: list[dict[str, Any]], just_now: Tensor | None = None) -> torch.device:
    """Check that a released backward may start and index the params; return their device.
    Raises (naming why) before anything is modified. ``just_now``: the param whose hook is running
    (a plain backward), whose grad is this backward's."""
    if rt.pending is not None:
        raise ValueError("FusedAdamWMP(release_grads=True): mpkern.unscale_ / clip_grad_norm_ left a factor for a "
                         "step, but the release step runs inside backward, before they could see the grads; pass "
                         "the scaler to opt.backward(loss, scaler=scaler) and set max_grad_norm instead")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        raise RuntimeError("FusedAdamWMP(release_grads=True) is single-process: with torch.distributed initialized "
                           "(DDP, FSDP2) the grads are reduced by hooks that run after the release step would have "
                           "used them; use release_grads=False")
    where: dict[int, tuple[dict[str, Any], int]] = {}
    devices: set[torch.device] = set()
    sid = -1
    for gi, group in enumerate(groups):
        for pi, p in enumerate(group["params"]):
            sid += 1
            name = f"param {pi} of group {gi}"
            if id(p) in where:
                raise ValueError(f"FusedAdamWMP(release_grads=True): {name} is listed twice; each param's hook "
                                 "steps it once")
            if distributed.is_dtensor(p):
                raise RuntimeError(f"FusedAdamWMP(release_grads=True): {name} is a DTensor (FSDP2 / tensor parallel); "
                                   "its grad is reduced after the release step would use it -- use "
                                   "release_grads=False")
            if _grads.feeds_main_grad(p):
                raise ValueError(f"FusedAdamWMP(release_grads=True): {name} accumulates its grad in main_grad "
                                 "(mpkern.nn fp32_main_grad=True), which no autograd hook announces; use "
                                 "fp32_main_grad=False with release_grads=True")
            if p is not just_now and (p.grad is not None or getattr(p, "main_grad", None) is not None):
                raise ValueError(f"FusedAdamWMP(release_grads=True): {name} already holds a grad when backward "
                                 "starts. Gradient accumulation cannot work with release: each grad is stepped and "
                                 "freed inside backward. Call opt.zero_grad() first, or use release_grads=False to "
                                 "accumulate micro-batches")
            where[id(p)] = (group, sid)
            if p.requires_grad:
                devices.add(p.device)
    if len(devices) > 1:
        raise ValueError(f"FusedAdamWMP(release_grads=True): params on several devices ({sorted(map(str, devices))}); "
                         "release steps one device")
    device = devices.pop() if devices else torch.device("cpu")
    backend = _backend.select(device)
    for gi, group in enumerate(groups):  # what collect() checks per grad, checked for every param up front
        for dtype in {p.dtype for p in group["params"]}:
            buckets.check_param_dtype(group, dtype, f"a {dtype} param of group {gi}")
            storage.check_backend(storage.master_kind(group["master_weights"], dtype), group["state_dtype"], backend)
    rel.reset()
    rel.where, rel.backend, rel.peak_bytes = where, backend, 0
    return device


def must_split(max_grad_norm: float | None, scaler: Any) -> bool:
    """Whether the step needs the two-pass backward (a clip or an enabled GradScaler)."""
    return max_grad_norm is not None or (scaler is not None and scaler.is_enabled())


# ---- a grad arrives ----------------------------------------------------------------------------
def on_grad(rel: Release, rt: Runtime, groups: list[dict[str, Any]], state: Any, p: Tensor) -> None:
    """The hook's work for ``p``: take its grad into the bucket (``p.grad`` becomes None) and flush
    a full bucket. In a plain ``loss.backward()`` the first hook starts the one-pass mode."""
    if rel.mode is None or (rel.mode == "plain" and rel.task != _graph_task()):
        # a plain backward starts (or one that died before its end-of-backward callback is left behind)
        _start_plain(rel, rt, groups, state, p)
    g = p.grad
    if g is None or id(p) not in rel.where:  # a param no longer in the groups keeps its grad, as without release
        return
    p.grad = None
    rel.bucket.append((p, g))
    rel.nbytes += g.numel() * g.element_size()
    rel.peak_bytes = max(rel.peak_bytes, rel.nbytes)
    if rel.nbytes >= rel.bucket_bytes:
        try:
            flush(rel, rt, groups, state)
        except BaseException:
            if rel.mode == "plain":  # opt.backward resets itself; a plain backward ends here
                rel.reset()
            raise


def _graph_task() -> int:
    """The id of the backward pass running now (autograd's graph task; -1 outside one)."""
    fn = getattr(torch._C, "_current_graph_task_id", None)  # noqa: SLF001 -- autograd's only way to tell
    return -1 if fn is None else int(fn())


def _start_plain(rel: Release, rt: Runtime, groups: list[dict[str, Any]], state: Any, p: Tensor) -> None:
    """A plain ``loss.backward()`` reached the hooks: step in one pass if the step needs no clip
    and no scale, else refuse (the grad just accumulated is dropped: nothing else was touched)."""
    why = None
    if groups and groups[0]["max_grad_norm"] is not None:
        why = "max_grad_norm is set"
    elif rt.scaler is not None:
        why = "a GradScaler is attached"
    elif any(q.dtype == torch.float16 for group in groups for q in group["params"]):
        why = "fp16 params need a loss scale"
    try:
        if why is not None:
            raise RuntimeError(f"loss.backward() on FusedAdamWMP(release_grads=True) when {why}: the clip / unscale "
                               "factor needs every grad before the first step, so call opt.backward(loss) (or "
                               "opt.backward(loss, scaler=scaler)) instead -- it runs the two backward passes")
        device = begin(rel, rt, groups, just_now=p)
    except Exception:
        p.grad = None
        raise
    plan = step_plan.plan_step(None, max_norm=None, grad_scale=None, found_inf=None, device=device, stats=None)
    rel.mode, rel.factor, rel.found, rel.task = "plain", plan.factor, plan.found_inf, _graph_task()
    rt.record(plan)
    # autograd's end-of-backward callback (what DDP and FSDP use) steps the last bucket
    engine = torch.autograd.Variable._execution_engine  # noqa: SLF001 -- what DDP/FSDP use: no public form
    engine.queue_callback(lambda: _finish_plain(rel, rt, groups, state))


def _finish_plain(rel: Release, rt: Runtime, groups: list[dict[str, Any]], state: Any) -> None:
    try:
        flush(rel, rt, groups, state)
        rel.done = True
    finally:
        rel.reset()


# ---- a bucket is full --------------------------------------------------------------------------
@torch.no_grad()
def flush(rel: Release, rt: Runtime, groups: list[dict[str, Any]], state: Any) -> None:
    """Run the bucket -- pass 1's statistics, or the fused step -- then drop its grads. Either way
    its params' state is prepared first, as ``step()`` prepares it before its kernels (created on
    the first step, conformed to writes by others), so that a skipped step leaves the same state."""
    pairs, rel.bucket, rel.nbytes = rel.bucket, [], 0
    if not pairs:
        return
    prepared = _prepare(rel, rt, groups, state, pairs)
    if rel.mode == "stats":
        del prepared
        params, grads = [p for p, _ in pairs], [g for _, g in pairs]
        del pairs
        assert rel.inv is not None  # set with the mode, before the first bucket
        sumsq, amax = step_plan.stats_pass(grads, params, None, {grads[0].device: rel.backend})(rel.inv)
        rel.stats.append((params, sumsq, amax))
        return
    del pairs
    assert rel.factor is not None and rel.found is not None  # planned with the mode, before the first bucket
    buckets.run(rt, prepared, rel.factor, rel.found, True)


def _prepare(rel: Release, rt: Runtime, groups: list[dict[str, Any]], state: Any,
             pairs: list[tuple[Tensor, Tensor]]) -> list[buckets.Prepared]:
    """The kernel lists of ``pairs``: one bucket per (group, master kind), as ``step()`` makes them."""
    split: dict[tuple[int, storage.MasterKind], tuple[dict[str, Any], list[tuple[Tensor, Tensor, int]]]] = {}
    for p, g in pairs:
        group, sid = rel.where[id(p)]
        if not (_grads.acceptable(g) and g.shape == p.shape and g.device == p.device):
            _grads.raise_bad_grad("FusedAdamWMP", f"param {sid}", g, p)
        kind = storage.master_kind(group["master_weights"], p.dtype)
        split.setdefault((id(group), kind), (group, []))[1].append((p, g, sid))
    work = [buckets.Bucket(group, bpairs[0][0].device, kind, bpairs, rel.backend)
            for (_, kind), (group, bpairs) in split.items()]
    # check_writes as in an eager step(): writes by others since the last step are seen
    return buckets.prepare_all(rt, groups, state, work, True)


# ---- opt.backward ------------------------------------------------------------------------------
def backward(rel: Release, rt: Runtime, groups: list[dict[str, Any]], state: Any, optimizer: Any, loss: Tensor,
             scaler: torch.amp.GradScaler | None) -> None:
    """``opt.backward(loss, scaler)`` (see the module docs). ``optimizer`` is only handed to the
    GradScaler (its per-optimizer record) -- nothing here reads it."""
    if not isinstance(loss, Tensor):
        raise TypeError(f"opt.backward: loss must be a tensor, got {type(loss).__name__}")
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"opt.backward: scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}")
    if not loss.requires_grad:
        raise ValueError("opt.backward: loss does not require grad (computed under torch.no_grad(), or from no param)")
    mgn = groups[0]["max_grad_norm"] if groups else None
    device = begin(rel, rt, groups)
    enabled = scaler if scaler is not None and scaler.is_enabled() else None
    if enabled is not None:
        _scaler_internals.check_unscale_stage(enabled, optimizer)
    scaled = enabled.scale(loss) if enabled is not None else loss
    rel.passes = 0
    try:
        if not must_split(mgn, enabled):
            plan = step_plan.plan_step(None, max_norm=None, grad_scale=None, found_inf=None, device=device, stats=None)
            _run_pass(rel, rt, groups, state, scaled, "step", plan, retain=False)
            rt.record(plan)
            rel.done = True
            return
        grad_scale = _scaler_internals.scaler_internals(enabled).scale if enabled is not None else None
        rel.inv = step_plan.step_inverse(grad_scale, device)
        _run_pass(rel, rt, groups, state, scaled, "stats", None, retain=True)
        sumsq, amax = _ordered_stats(rel, groups, device)
        plan = step_plan.plan_step(None, max_norm=mgn, grad_scale=grad_scale, found_inf=None, device=device,
                             stats=lambda inv: (sumsq, amax))
        if mgn is None:  # step() reports a norm only when it clips
            plan = plan._replace(norm=None)
        rt.record(plan)
        if enabled is not None:
            _scaler_internals.record_found_inf(enabled, optimizer, plan.found_inf, unscaled=True)
        rel.done = True
        if _ops.host_flag(plan.found_inf):  # the one host read: an overflow skips pass 2 entirely
            return
        _run_pass(rel, rt, groups, state, scaled, "step", plan, retain=False)
    finally:
        rel.reset()


def _run_pass(rel: Release, rt: Runtime, groups: list[dict[str, Any]], state: Any, loss: Tensor, mode: str,
              plan: step_plan.StepPlan | None, *, retain: bool) -> None:
    rel.mode = mode
    if plan is not None:
        rel.factor, rel.found = plan.factor, plan.found_inf
    try:
        loss.backward(retain_graph=retain)
        rel.passes += 1
        flush(rel, rt, groups, state)
    except BaseException:
        rel.bucket, rel.nbytes = [], 0
        raise


def _ordered_stats(rel: Release, groups: list[dict[str, Any]], device: torch.device) -> tuple[Tensor, Tensor]:
    """Pass 1's per-tensor statistics in the order ``step()``'s statistics pass has them."""
    got: dict[int, int] = {}
    parts_s, parts_a = [], []
    for params, s, a in rel.stats:
        for p in params:
            got[id(p)] = len(got)
        parts_s.append(s)
        parts_a.append(a)
    if not got:
        empty = torch.zeros(0, dtype=torch.float32, device=device)
        return empty, empty.clone()
    order = tuple(got[id(p)] for p in buckets.step_order(groups, got))
    sumsq = torch.cat(parts_s) if len(parts_s) > 1 else parts_s[0]
    amax = torch.cat(parts_a) if len(parts_a) > 1 else parts_a[0]
    if order == tuple(range(len(order))):
        return sumsq, amax
    if rel.perm is None or rel.perm[0] != order or rel.perm[1].device != sumsq.device:
        # built once per order (the hooks fire in the same order every step), not per step
        rel.perm = (order, torch.tensor(order, dtype=torch.int64).to(sumsq.device))
    perm = rel.perm[1]
    return sumsq[perm], amax[perm]


__all__ = ["DEFAULT_BUCKET_BYTES", "Release", "backward", "begin", "check_bucket_bytes", "flush", "must_split",
           "on_grad"]
