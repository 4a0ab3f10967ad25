"""The ``FusedAdamWMP`` class: arguments, param groups, lazy state, ``step()``, public helpers.

It has the shape of ``torch/optim/adamw.py``; its parts live in the modules beside it:
:mod:`.runtime` (the state an optimizer keeps between steps, one :class:`~.runtime.Runtime`, and the
cached eager step), :mod:`.buckets` (collect and prepare the kernel lists), :mod:`.functional` (the
fused step), :mod:`.writes` (external writes), :mod:`.checkpoint` (load / export / pickling) and
:mod:`.storage` (the storage kinds); the step's factor is planned by :func:`mpkern.optim.step_plan.plan_step`.
The helpers get the runtime, ``param_groups`` and ``state``, never the optimizer. See
docs/design.md for how a step flows through them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .. import _fused_unscale, amp
from . import args, buckets, checkpoint, release, runtime, storage, writes
from .functional import fused_adamw_mp
from .runtime import Runtime

Tensor = torch.Tensor


def _live_attr(key: str, doc: str) -> property:
    """An attribute kept in the runtime's ``live`` dict (a compiled step replays dict mutations)."""

    def get(self: Any) -> Any:
        return self._rt.live[key]

    def put(self: Any, value: Any) -> None:
        self._rt.live[key] = value

    return property(get, put, doc=doc)


class FusedAdamWMP(torch.optim.Optimizer):
    """AdamW with fp32 master weights for 16-bit params, fused into one kernel per group and device.

    Args (``torch.optim.AdamW``'s, in its order):
        params: parameters or param groups, as for ``torch.optim.AdamW``.
        lr, betas, eps, weight_decay, amsgrad, maximize: exactly as ``torch.optim.AdamW``
            (``lr`` may be a float or a one-element tensor).
        foreach, fused: accepted for compatibility; mpkern is always one fused multi-tensor
            kernel, so a value other than None only triggers a warning.
        capturable: allow ``step()`` to be captured in a CUDA graph (``torch.cuda.graph``) and
            replayed. Every per-step scalar already lives on the device (found_inf, grad factor,
            step counters; lr when it is a tensor on the params' device -- a float lr is frozen
            into the graph, as in ``torch.optim``); the kernels' metadata tables are built by an
            eager warm-up step and reused. With ``capturable=False`` a capture raises.
        differentiable: must be False (the fused step is not differentiable; True raises).

    mpkern's own keyword arguments (also stored in every param group, so in ``state_dict()``):
        max_grad_norm: clip the global grad norm to this value inside ``step()`` (a read-only
            statistics pre-pass, the coefficient applied in the update). A non-finite grad found
            by that pass skips the step like a GradScaler overflow. Global: every group has the
            same value (``opt.max_grad_norm = x`` sets it everywhere).
        master_weights: ``True`` (fp32 master in state), ``"remainder"`` (bf16 params only: an int16
            remainder so that param + remainder is the exact fp32 master), ``"8bit"`` (bf16/fp16
            params: a one-byte stochastically rounded correction of the param's rounding error) or
            ``False`` (update the 16-bit params directly).
        state_dtype: how ``exp_avg``/``exp_avg_sq`` are kept: ``torch.float32``, ``torch.bfloat16``
            (stored with stochastic rounding) or ``"8bit"`` (one byte per element per moment plus a bf16
            scale per 32 elements, companded, stochastically rounded: 2.125 B/param for both; not with
            amsgrad). See docs/storage.md for how each mode differs from fp32 AdamW.
        stochastic_rounding: with ``master_weights=False`` and bf16 params, round the updated
            params stochastically (unbiased) instead of to nearest.
        seed: seed of the stochastic-rounding bit stream.
        process_group: a ``torch.distributed`` group over which the grads are sharded by hand
            (ZeRO-style flat shards, Megatron tensor parallel): ``max_grad_norm`` and
            ``mpkern.unscale_(opt)`` combine the local norms over it (one all-reduce). Not needed
            for FSDP2 / DTensor params, whose mesh says it. Not saved in ``state_dict()``.
        release_grads: step inside backward (:meth:`backward`), freeing each grad once stepped; the
            whole gradient is never alive. ``release_bucket_bytes``: grads stepped together (default
            32 MiB). Single-process, one device. Not saved in ``state_dict()`` (the constructor's wins).

    Beyond ``torch.optim.AdamW`` -- DTensor params (FSDP2, tensor parallel; state laid out like the
    params, the global norm for clipping), any param layout, writes to the params by others (seen from
    version counters; :meth:`resync_masters` after writes through a ``.data`` alias), GradScaler and
    overflow (``_step_supports_amp_scaling``; :meth:`attach_grad_scaler`), the deferred
    ``mpkern.unscale_(opt)``, ``last_grad_norm`` / ``last_found_inf`` (device tensors, no sync;
    ``last_grad_norm`` is None until a norm was computed: clipping, ``clip_grad_norm_`` or ``unscale_``), the
    consumed ``main_grad`` and the cached eager step (``opt.step_cache``): ``docs/api.md``, "FusedAdamWMP".
    """

    _step_supports_amp_scaling = True
    _mpkern_check_writes = True  # the external-write check (benchmarks switch it off to time it)
    # the eager fast path: the prepared kernel lists cached and re-validated in C++ each step
    # (see .runtime); False always takes the full path (tests compare the two)
    _mpkern_step_cache = True
    _mpkern_warned_autocast = False  # step() inside autocast is told once per optimizer

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        max_grad_norm: float | None = None,
        master_weights: bool | str = True,
        state_dtype: torch.dtype | str = torch.float32,
        stochastic_rounding: bool = False,
        seed: int = 0,
        process_group: Any = None,
        release_grads: bool = False,
        release_bucket_bytes: int | None = None,
    ) -> None:
        args.check_adamw_args(lr, betas, eps, weight_decay, differentiable)
        ignored = [f"{k}={v!r}" for k, v in (("foreach", foreach), ("fused", fused)) if v is not None]
        if ignored:
            warnings.warn(f"FusedAdamWMP ignores {', '.join(ignored)}: it always runs one fused multi-tensor "
                          "kernel", UserWarning, stacklevel=2)
        state_dtype = args.check_own_args(master_weights, state_dtype, max_grad_norm, stochastic_rounding)
        storage.check_amsgrad(amsgrad, state_dtype, "")
        rel = args.check_release_args(release_grads, release_bucket_bytes, process_group)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        capturable=capturable, max_grad_norm=max_grad_norm, master_weights=master_weights,
                        state_dtype=state_dtype, stochastic_rounding=stochastic_rounding, seed=int(seed))
        self._rt = Runtime(process_group)  # everything kept between steps (see .runtime)
        self._rt.work["release"] = rel
        super().__init__(params, defaults)
        if rel is not None:
            rel.hook_params(self.param_groups, self._on_grad_ready)

    @property
    def mpkern_runtime(self) -> Runtime:
        """The optimizer's runtime state (:class:`mpkern.optim.runtime.Runtime`): stamps, the step cache,
        what ``mpkern.unscale_`` left for the next step. mpkern's own helpers use it (see
        :mod:`mpkern._fused_unscale`); training code has no need to."""
        return self._rt

    # ---- what a step leaves ---------------------------------------------------------------------
    last_grad_norm = _live_attr("last_grad_norm", "The global grad norm of the last step() (a device tensor; "
                                                  "None until a norm was computed).")
    last_found_inf = _live_attr("last_found_inf", "1.0 if the last step() was skipped for a non-finite grad, "
                                                  "else 0.0 (a device tensor).")

    # ---- settings ----------------------------------------------------------------------------
    @property
    def max_grad_norm(self) -> float | None:
        """Global-norm clipping threshold applied in ``step()`` (None: no clipping)."""
        return self.param_groups[0]["max_grad_norm"] if self.param_groups else self.defaults["max_grad_norm"]

    @max_grad_norm.setter
    def max_grad_norm(self, value: float | None) -> None:
        args.check_own_args(True, torch.float32, value, False)
        self.defaults["max_grad_norm"] = value
        for group in self.param_groups:
            group["max_grad_norm"] = value

    @property
    def seed(self) -> int:
        return int(self.defaults["seed"])

    @property
    def step_cache(self) -> bool:
        """Whether eager steps may reuse the kernel lists of the last full step (see the class docs;
        benchmarks and tests switch it off to time or compare the full path)."""
        return bool(self._mpkern_step_cache)

    @step_cache.setter
    def step_cache(self, value: bool) -> None:
        self._mpkern_step_cache = bool(value)
        self._rt.drop_cache()

    @property
    def check_external_writes(self) -> bool:
        """Whether each step checks the params for writes by others (stamps); benchmarks time it."""
        return bool(self._mpkern_check_writes)

    @check_external_writes.setter
    def check_external_writes(self, value: bool) -> None:
        self._mpkern_check_writes = bool(value)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._rt.drop_cache()
        super().add_param_group(param_group)
        try:
            args.check_group(self.param_groups[-1], len(self.param_groups) - 1, self.param_groups[0])
        except (ValueError, TypeError):
            self.param_groups.pop()  # nothing half-added
            raise
        rel = self._rt.release
        if rel is not None:  # None inside __init__: its params are hooked once it has made the groups
            rel.hook_params(self.param_groups[-1:], self._on_grad_ready)

    # ---- gradient release ---------------------------------------------------------------------
    @property
    def release_grads(self) -> bool:
        """Whether the step runs inside backward (``release_grads=True``; see :meth:`backward`)."""
        return self._rt.release is not None

    @property
    def release_bucket_bytes(self) -> int | None:
        """Bytes of grads stepped together inside backward (None without ``release_grads``)."""
        rel = self._rt.release
        return None if rel is None else rel.bucket_bytes

    def backward(self, loss: Tensor, scaler: torch.amp.GradScaler | None = None) -> None:
        """``loss.backward()`` with the step inside it (``release_grads=True``): grads are stepped bucket by
        bucket and freed, bit-identical to ``loss.backward(); opt.step()`` (with ``scaler``, the *unscaled*
        loss: to ``scaler.scale(loss).backward(); scaler.step(opt)``; call ``scaler.update()`` after it).
        One backward pass, or two when ``max_grad_norm`` or ``scaler`` needs the global statistics first
        (an overflow then skips the second: nothing changes). Afterwards every ``.grad`` is None and the
        next ``step()`` is a no-op. What it refuses and why: :mod:`mpkern.optim.release`, docs/api.md."""
        rel = self._rt.release
        if rel is None:
            raise ValueError("FusedAdamWMP.backward needs release_grads=True (the step inside backward); with "
                             "release_grads=False call loss.backward() and opt.step()")
        rel.hook_params(self.param_groups, self._on_grad_ready)  # params that require grad since the last call
        release.backward(rel, self._rt, self.param_groups, self.state, self, loss, scaler)

    def _on_grad_ready(self, p: Tensor) -> None:
        """The post-accumulate-grad hook of every param of a release optimizer (held weakly)."""
        release.on_grad(self._rt.release, self._rt, self.param_groups, self.state, p)

    def attach_grad_scaler(self, scaler: torch.amp.GradScaler) -> None:
        """Attach the ``GradScaler`` that steps this optimizer (kept weakly), so that an overflow only
        a ``main_grad`` holds backs off its scale (``mpkern.unscale_(opt, scaler=scaler)`` attaches it
        too). Needed only with ``main_grad`` and plain ``scaler.step(opt)``; see :mod:`mpkern._fused_unscale`."""
        _fused_unscale.attach_scaler(self, scaler)

    # ---- copies and pickling -----------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        return checkpoint.getstate(self._rt, super().__getstate__())

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy, an unpickle (a new runtime with what the step left) or a load (the runtime kept,
        what a step left dropped); groups saved by older versions given today's keys; every param
        taken as written by us (params and masters were copied together: they agree now)."""
        live, process_group, release_bytes = checkpoint.restore(state)
        super().__setstate__(state)
        checkpoint.upgrade_groups(self.defaults, self.param_groups)
        rt = self.__dict__.get("_rt")
        self._rt = Runtime.resumed(rt, live, process_group, self.state)
        if rt is None and release_bytes is not None:  # a copy or an unpickle of a release optimizer
            self._rt.work["release"] = release.Release(release_bytes)
            self._rt.release.hook_params(self.param_groups, self._on_grad_ready)

    # ---- grads: clip, zero ---------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the grads' global norm in the next ``step()`` (grads are not modified); return the norm.

        Composes with what is already pending: after ``mpkern.unscale_(opt, scaler=scaler)`` the
        norm is that of the *unscaled* grads and the unscale factor stays; every clip threshold
        applies (``max_grad_norm``, an earlier ``unscale_(max_norm=)``, this one): the smallest
        coefficient wins. Without a pending unscale it sees the grads as they are (scaled, if a
        scaler scaled the loss: use ``mpkern.unscale_(opt, scaler=scaler, max_norm=...)`` then).
        ``clip_grad_norm`` is the same method under the name some wrappers (sharded optimizers,
        older ``transformers.Trainer``) look for.
        """
        prev = self._rt.pending
        res = amp.unscale_(self, prev.inv if prev is not None else 1.0, max_norm=max_norm, norm_type=norm_type)
        if prev is not None and self._rt.pending is not None:  # the unscale factor stays
            self._rt.leave(self._rt.pending.tightened(prev))
        return res.total_norm

    clip_grad_norm = clip_grad_norm_

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Like ``Optimizer.zero_grad``, for ``p.main_grad`` too (set to None, or zeroed in place when
        ``set_to_none=False``); drops a factor left by ``mpkern.unscale_`` / ``clip_grad_norm_``."""
        super().zero_grad(set_to_none=set_to_none)
        self._rt.leave(None)
        buckets.zero_main_grads(self.param_groups, set_to_none)

    # ---- masters out --------------------------------------------------------------------------
    def master_params(self) -> list[Tensor]:
        """The fp32 value of every param, in param-group order (what the next step starts from).

        * ``master_weights=True``: the master state tensor itself (live: writing into it changes
          the optimizer's master);
        * ``"remainder"`` / ``"8bit"``: a new fp32 tensor rebuilt from the 16-bit param and its state;
        * fp32 params: the param itself; 16-bit params without master state (``False``, or before
          the first step): ``p.float()`` (a copy).
        Use it for an fp32 export, EMA or evaluation; see :meth:`copy_master_params_to`.
        """
        return checkpoint.master_params(self._rt, self.param_groups, self.state)

    def adamw_state_dict(self) -> dict[str, Any]:
        """A state dict that ``torch.optim.AdamW.load_state_dict`` accepts, whatever the storage kinds.

        Per param: ``step`` and fp32 ``exp_avg`` / ``exp_avg_sq`` (``max_exp_avg_sq`` with amsgrad),
        decoded from this optimizer's storage; param groups with AdamW's keys (mpkern's own keys
        dropped). The params it belongs to are the fp32 masters of :meth:`master_params`: build the
        AdamW over fp32 copies of them (``[torch.nn.Parameter(m.detach().clone()) for m in
        opt.master_params()]``), in the same group structure, then load this. New tensors: the
        optimizer's state is not shared.
        """
        return checkpoint.adamw_state_dict(self)

    @torch.no_grad()
    def resync_masters(self, params: Iterable[Tensor] | None = None) -> None:
        """Re-seed the masters of ``params`` (default: every param) from the params as they are now.

        Writes the optimizer cannot see need this: writes through a ``.data`` alias
        (``p.data.fill_(x)``, ``p.data.copy_(ema)``; old ``_init_weights`` code) bypass the version
        counter the automatic check reads. Masters are re-seeded elementwise (kept where the param
        still equals the rounded master, else the param's value); remainders are reset (except for
        params sharing one storage, see the class docs). Params without state are ignored.
        """
        writes.resync(self._rt, self.param_groups, self.state, params)

    @torch.no_grad()
    def copy_master_params_to(self, target: torch.nn.Module | Iterable[Tensor]) -> None:
        """Write the fp32 masters into ``target``: a module whose ``parameters()`` (or an iterable of
        tensors) correspond one to one, in order, to this optimizer's params (e.g. an fp32 copy of
        the model made before ``.to(torch.bfloat16)``). Values are cast to each target's dtype."""
        checkpoint.copy_masters_to(self, target)

    # ---- step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One AdamW step over all param groups (skipped bitwise when an overflow was found).

        Everything that can fail (grads, state layout, lr, capture rules) is checked and prepared
        for every group before the first kernel runs: an error leaves no group half-stepped."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        rel = self._rt.release
        if rel is not None and rel.take_done():  # a released backward has stepped already
            return loss
        if not self._mpkern_warned_autocast and not torch.compiler.is_compiling():
            self._mpkern_warned_autocast = _warn_if_autocast()
        rt = self._rt
        if torch.compiler.is_compiling():
            # replayed by every compiled call: compiled steps write the params through functionalized
            # copies (their version counters move) and record no stamps
            rt.live["traced"] = True
        elif rt.live["traced"]:  # a compiled step ran since the last eager one
            rt.restamp_after_compiled(self.state)
        fast = (runtime.refresh(rt, self.param_groups, self.state)
                if self._mpkern_step_cache and self._mpkern_check_writes else None)
        if fast is not None:
            try:
                self._fast_step(fast)
            finally:
                fast.cache.release()  # the cache never keeps grads alive between steps
            return loss
        self._full_step()
        return loss

    def _fast_step(self, fc: runtime.StepCache) -> None:
        runtime.fast_step(self._rt, fc, self.max_grad_norm, getattr(self, "grad_scale", None),
                          getattr(self, "found_inf", None))

    def _full_step(self) -> None:
        """``step()`` without the cache (:func:`.buckets.full_step`); GradScaler's amp-scaling protocol
        hands ``grad_scale`` / ``found_inf`` over as attributes of the optimizer."""
        buckets.full_step(self._rt, self.param_groups, self.state, self, max_grad_norm=self.max_grad_norm,
                          grad_scale=getattr(self, "grad_scale", None), found_inf=getattr(self, "found_inf", None),
                          check_writes=self._mpkern_check_writes, cache=self._mpkern_step_cache)

    # ---- checkpoints --------------------------------------------------------------------------
    @torch.no_grad()
    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.Optimizer.state_dict()``: every storage kind in its compact form (checkpoint bytes
        = state bytes, and a resume continues bit-identically), except where a kind exports itself
        otherwise (:meth:`mpkern.optim.storage.MomentKind.export`: 8-bit moments of DTensor params
        are saved as fp32 DTensors, which ``torch.distributed.checkpoint`` can reshard)."""
        return checkpoint.export(self.param_groups, super().state_dict())

    @torch.compiler.disable  # like torch.optim.Optimizer.load_state_dict: never traced by dynamo
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load our own or a plain ``torch.optim.AdamW`` state dict through ``torch.optim.Optimizer``'s own
        ``load_state_dict`` (hooks, validation, strict id mapping), except that the state keeps this
        optimizer's storage layout (``master_weights``, ``state_dtype``; another layout is converted, with
        a warning) instead of being cast to the param dtype. See :func:`mpkern.optim.checkpoint.load`."""
        checkpoint.load(self, state_dict, self._rt)


def step_parts(opt: FusedAdamWMP) -> dict[str, Callable[[], object]]:
    """Callables that each run one host-side part of a full-path ``step()`` of ``opt``, for
    benchmarks (which then never call the optimizer's private methods): ``"collect"`` (every
    grad), ``"prepare"`` (the first bucket's lists) and ``"kernel call"`` (the first bucket's fused
    kernel with factor 1 and lr 1e-3: it really steps those params). Call after one step."""
    rt, groups, state = opt.mpkern_runtime, opt.param_groups, opt.state
    work, _ = buckets.collect(groups)
    if not work:
        raise ValueError("step_parts: no param has a grad")
    first = work[0]
    lists, _copies = buckets.prepare(rt, groups, state, first, True)
    dev = first.device
    one, zero = torch.ones((), device=dev), torch.zeros((), device=dev)
    return {"collect": lambda: buckets.collect(groups),
            "prepare": lambda: buckets.prepare(rt, groups, state, first, True),
            "kernel call": lambda: fused_adamw_mp(first.backend, lists, one, zero, None, 1e-3, first.group,
                                                  first.kind.name)}


def _warn_if_autocast() -> bool:
    """Warn (and return True) when ``step()`` runs inside an autocast region -- the lessons' "optimizer
    math outside autocast". Host-side flags only, no sync."""
    on = [d for d in ("cuda", "cpu") if torch.is_autocast_enabled(d)]
    if on:
        warnings.warn(
            f"FusedAdamWMP.step() called inside a torch.autocast region ({', '.join(on)}): the optimizer step "
            "belongs outside autocast -- end the `with torch.autocast(...)` block after the forward pass and the "
            "loss, then call backward, (scaler.)step and scaler.update() outside it. mpkern's kernels compute in "
            "fp32 either way, but a closure, LR scheduler or other optimizer step under autocast would not. "
            "(Told once per optimizer.)", UserWarning, stacklevel=5)
    return bool(on)


__all__ = ["FusedAdamWMP", "step_parts"]
