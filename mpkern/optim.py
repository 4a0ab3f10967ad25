"""``FusedAdamWMP``: a drop-in ``torch.optim.AdamW`` for fp16/bf16 models with fp32 master weights.

One fused multi-tensor kernel per (param group, device, master mode) reads the 16-bit grad (or the
fp32 ``main_grad``), multiplies it by ``inv_scale * clip_coef`` in registers, updates the fp32
master (or bf16 param + int16 remainder), ``exp_avg``, ``exp_avg_sq`` and writes the rounded
16-bit param -- 28 B/param for bf16 params with fp32 master and moments. Grads are never
written. Loss-scale, clip coefficient, found_inf, step counters (and lr when it is a tensor) stay
on the device: ``step()`` never synchronises with the host.

Layout of this module (the shape of ``torch/optim/adamw.py``): the optimizer object keeps
arguments, lazy state and param groups; :func:`_fused_adamw_mp` is the functional step over
prepared lists; :func:`_state_from_checkpoint` is the one place a saved per-param state is turned
into ours (own checkpoints, plain AdamW ones, other master modes).
"""

from __future__ import annotations

import copy
import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any

import torch

from . import _backend, _ops, amp, distributed
from .amp import _flat, _grad_of
from .distributed import local as _local
from .distributed import version as _ver
from .reference import MASTER_F32, MASTER_NONE, MASTER_REMAINDER

Tensor = torch.Tensor
Parameter = torch.nn.Parameter
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
# mpkern's own param-group keys; the storage-layout ones are the constructor's choice even when a
# checkpoint says otherwise (the state is converted, with a warning)
_GROUPS: dict[int, Any] = {}  # process groups of pickled optimizers (see __getstate__)
_OWN_KEYS = ("max_grad_norm", "master_weights", "state_dtype", "stochastic_rounding", "seed")
_LAYOUT_KEYS = ("master_weights", "state_dtype")


def _flat_view(t: Tensor) -> Tensor:
    """A 1-D view of a dense tensor (contiguous up to a permutation of dims) over its memory."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def _like(p: Tensor, dtype: torch.dtype) -> Tensor:
    """An empty state tensor laid out like ``p`` (same strides when ``p`` is dense, else contiguous)."""
    return torch.empty_like(p, dtype=dtype, memory_format=torch.preserve_format)


def _remainder_to_master(p: Tensor, rem: Tensor) -> Tensor:
    """fp32 master from a bf16 param and its int16 remainder (exact; DTensors shard by shard)."""
    hi = _local(p).view(torch.int16).to(torch.int32) & 0xFFFF
    return distributed.wrap_like(p, ((hi << 16) + _local(rem).to(torch.int32)).view(torch.float32))


def _master_to_remainder(master: Tensor) -> tuple[Tensor, Tensor]:
    """(bf16 param, int16 remainder) that reconstruct ``master`` exactly (DTensors shard by shard)."""
    u = _local(master).view(torch.int32)
    hi = (((u + 0x8000) >> 16) & 0xFFFF).to(torch.int16).view(torch.bfloat16)
    return distributed.wrap_like(master, hi), distributed.wrap_like(master, (u & 0xFFFF).to(torch.int16))


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
            remainder so that param + remainder is the exact fp32 master) or ``False`` (update the
            16-bit params directly).
        state_dtype: dtype of ``exp_avg``/``exp_avg_sq``: ``torch.float32`` or ``torch.bfloat16``.
        stochastic_rounding: with ``master_weights=False`` and bf16 params, round the updated
            params stochastically (unbiased) instead of to nearest.
        seed: seed of the stochastic-rounding bit stream.
        process_group: a ``torch.distributed`` group over which the grads are sharded by hand
            (ZeRO-style flat shards, Megatron tensor parallel): ``max_grad_norm`` and
            ``mpkern.unscale_(opt)`` combine the local norms over it (one all-reduce). Not needed
            for FSDP2 / DTensor params, whose mesh says it. Not saved in ``state_dict()``.

    Distributed: DTensor params (FSDP2 ``fully_shard``, tensor parallel) are updated shard by
    shard; masters and moments are DTensors laid out like their params (state memory divides by
    the number of shards, and ``torch.distributed.checkpoint`` can reshard them), and clipping
    uses the global norm (see :mod:`mpkern.distributed`).

    Params may have any layout: dense ones (contiguous, channels_last, permuted) are updated in
    place as flat buffers with state laid out like the param; other strided views go through a
    contiguous copy (correct, slower).

    Writes to the params are kept: when a 16-bit param was written by someone else since the
    optimizer's last write (``model.load_state_dict``, ``fill_``, ``copy_``, re-initialisation; seen
    from the param's version counter, a host-side integer, so no sync), its master is re-seeded
    from it before the next update -- elementwise, keeping the master's low bits where the param
    still equals the rounded master. With ``"remainder"`` the remainder of such a param is reset.

    Overflow: ``_step_supports_amp_scaling = True`` -- ``GradScaler.step`` hands over ``grad_scale``
    and ``found_inf``; when found_inf is set nothing changes (params, masters, moments, steps).
    ``mpkern.unscale_(opt, ...)`` does not touch the grads (unless ``apply=True``): its factor
    (inv_scale * clip_coef) is applied in the next ``step()``; a second call before that step
    replaces the first, and ``zero_grad()`` drops it.

    ``last_grad_norm`` / ``last_found_inf``: device tensors from the last ``step()`` (no sync).
    ``last_grad_norm`` is None until a norm was computed: by ``max_grad_norm``, ``clip_grad_norm_``
    or ``mpkern.unscale_(opt, ...)`` (without clipping no norm pass runs: it would cost a read
    of every grad).

    ``main_grad`` (fp32 grads from ``mpkern.nn`` with ``fp32_main_grad=True``) is consumed by
    ``step()``: it is set to None after every step (taken or skipped; zeroed in place inside a CUDA
    graph capture), so ``model.zero_grad()``, ``opt.zero_grad()`` or no zero_grad at all cannot
    make it accumulate across steps.
    """

    _step_supports_amp_scaling = True
    _mpkern_fuses_unscale = True
    _mpkern_check_writes = True  # the external-write check (benchmarks switch it off to time it)

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
        state_dtype: torch.dtype = torch.float32,
        stochastic_rounding: bool = False,
        seed: int = 0,
        process_group: Any = None,
    ) -> None:
        if isinstance(lr, Tensor):
            if lr.numel() != 1:
                raise ValueError("Tensor lr must be 1-element")
        elif not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if differentiable:
            raise ValueError("FusedAdamWMP: differentiable=True is not supported (the fused step is not "
                             "differentiable); use torch.optim.AdamW(differentiable=True)")
        ignored = [f"{k}={v!r}" for k, v in (("foreach", foreach), ("fused", fused)) if v is not None]
        if ignored:
            warnings.warn(f"FusedAdamWMP ignores {', '.join(ignored)}: it always runs one fused multi-tensor "
                          "kernel", UserWarning, stacklevel=2)
        _check_own_args(master_weights, state_dtype, max_grad_norm, stochastic_rounding)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        capturable=capturable, max_grad_norm=max_grad_norm, master_weights=master_weights,
                        state_dtype=state_dtype, stochastic_rounding=stochastic_rounding, seed=int(seed))
        self._pending: tuple[Tensor, Tensor, Tensor] | None = None
        self.last_grad_norm: Tensor | None = None
        self.last_found_inf: Tensor | None = None
        self._versions: dict[int, Any] = {}  # id(param) -> its version after our last write
        self._mpkern_process_group = process_group
        super().__init__(params, defaults)

    # ---- settings ----------------------------------------------------------------------------
    @property
    def max_grad_norm(self) -> float | None:
        """Global-norm clipping threshold applied in ``step()`` (None: no clipping)."""
        return self.param_groups[0]["max_grad_norm"] if self.param_groups else self.defaults["max_grad_norm"]

    @max_grad_norm.setter
    def max_grad_norm(self, value: float | None) -> None:
        _check_own_args(True, torch.float32, value, False)
        self.defaults["max_grad_norm"] = value
        for group in self.param_groups:
            group["max_grad_norm"] = value

    @property
    def seed(self) -> int:
        return int(self.defaults["seed"])

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        gi = len(self.param_groups) - 1
        try:
            _check_own_args(group["master_weights"], group["state_dtype"], group["max_grad_norm"],
                            group["stochastic_rounding"])
            if group["max_grad_norm"] != self.param_groups[0]["max_grad_norm"]:
                raise ValueError(f"FusedAdamWMP: max_grad_norm is a global norm threshold; group {gi} has "
                                 f"{group['max_grad_norm']!r}, group 0 has {self.param_groups[0]['max_grad_norm']!r}")
            for i, p in enumerate(group["params"]):
                if p.is_complex():
                    raise ValueError(f"FusedAdamWMP: param {i} of group {gi} is complex; complex params are not "
                                     "supported")
                if p.dtype not in _FLOATS:
                    raise TypeError(f"FusedAdamWMP: param {i} of group {gi} has dtype {p.dtype}; expected float32, "
                                    "float16 or bfloat16")
                if group["master_weights"] == "remainder" and p.dtype not in (torch.bfloat16, torch.float32):
                    raise ValueError(f"FusedAdamWMP: master_weights='remainder' needs bfloat16 params, param {i} "
                                     f"of group {gi} is {p.dtype}")
                if group["stochastic_rounding"] and p.dtype == torch.float16:
                    raise ValueError(f"FusedAdamWMP: stochastic_rounding supports bfloat16 params, param {i} of "
                                     f"group {gi} is float16")
        except (ValueError, TypeError):
            self.param_groups.pop()  # nothing half-added
            raise

    @staticmethod
    def _mode(group: dict[str, Any], p: Tensor) -> int:
        if p.dtype == torch.float32 or group["master_weights"] is False:
            return MASTER_NONE
        return MASTER_REMAINDER if group["master_weights"] == "remainder" else MASTER_F32

    def _init_state(self, group: dict[str, Any], p: Tensor) -> dict[str, Any]:
        state = self.state[p]
        if "step" in state:
            return state
        sdt = group["state_dtype"]
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        state["exp_avg"] = _like(p, sdt).zero_()
        state["exp_avg_sq"] = _like(p, sdt).zero_()
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = _like(p, torch.float32).zero_()
        mode = self._mode(group, p)
        if mode == MASTER_F32:
            state["master_param"] = _like(p, torch.float32).copy_(p.detach())
        elif mode == MASTER_REMAINDER:
            state["master_remainder"] = _like(p, torch.int16).zero_()
        return state

    # ---- copies and pickling -----------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(_pending=self._pending, last_grad_norm=self.last_grad_norm, last_found_inf=self.last_found_inf)
        pg = self.__dict__.get("_mpkern_process_group")
        if pg is not None:  # process groups do not pickle: a token valid in this process
            _GROUPS[id(pg)] = pg
            state["_mpkern_process_group_token"] = id(pg)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for key in ("_pending", "last_grad_norm", "last_found_inf", "_mpkern_process_group"):
            self.__dict__.setdefault(key, None)
        token = self.__dict__.pop("_mpkern_process_group_token", None)
        if token is not None:
            if token not in _GROUPS:
                raise RuntimeError("FusedAdamWMP: this optimizer was pickled with a process_group, which only "
                                   "exists in the process that created it; build the optimizer anew in this process")
            self._mpkern_process_group = _GROUPS[token]
        for key, val in (("max_grad_norm", None), ("master_weights", True), ("state_dtype", torch.float32),
                         ("stochastic_rounding", False), ("seed", 0)):
            self.defaults.setdefault(key, val)
        for group in self.param_groups:  # groups saved before a flag existed: AdamW's fallbacks
            for key, val in (("amsgrad", False), ("maximize", False), ("capturable", False)):
                group.setdefault(key, val)
        # params and masters were copied together: they agree now
        self._versions = {id(p): _ver(p) for p in self.state if isinstance(p, Tensor)}

    # ---- the unscale_/clip hand-off -----------------------------------------------------------
    def _mpkern_set_pending_unscale(self, factor: Tensor, found_inf: Tensor, total_norm: Tensor) -> None:
        """Called by :func:`mpkern.unscale_`: apply ``factor`` to the grads in the next step."""
        self._pending = (factor, found_inf, total_norm)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the grads' global norm in the next ``step()`` (grads are not modified); return the norm.

        For fp16 with a GradScaler use ``mpkern.unscale_(opt, scaler=scaler, max_norm=...)`` instead:
        this method sees the grads as they are (scaled, if a scaler scaled the loss).
        ``clip_grad_norm`` is the same method under the name some wrappers (sharded optimizers,
        older ``transformers.Trainer``) look for.
        """
        res = amp.unscale_(self, 1.0, max_norm=max_norm, norm_type=norm_type)
        return res.total_norm

    clip_grad_norm = clip_grad_norm_

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Like ``Optimizer.zero_grad``, for ``p.main_grad`` too (set to None, or zeroed in place when
        ``set_to_none=False``); drops a factor left by ``mpkern.unscale_`` / ``clip_grad_norm_``."""
        super().zero_grad(set_to_none=set_to_none)
        self._pending = None
        mains = []
        for g in self.param_groups:
            for p in g["params"]:
                if getattr(p, "main_grad", None) is not None:
                    if set_to_none:
                        p.main_grad = None
                    else:
                        mains.append(p.main_grad)
        if mains:
            torch._foreach_zero_(mains)

    # ---- masters out --------------------------------------------------------------------------
    def master_params(self) -> list[Tensor]:
        """The fp32 value of every param, in param-group order (what the next step starts from).

        * ``master_weights=True``: the master state tensor itself (live: writing into it changes
          the optimizer's master);
        * ``"remainder"``: a new fp32 tensor rebuilt exactly from the bf16 param and its remainder;
        * fp32 params: the param itself; 16-bit params without master state (``False``, or before
          the first step): ``p.float()`` (a copy).
        Use it for an fp32 export, EMA or evaluation; see :meth:`copy_master_params_to`.
        """
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p, {})
                if "master_param" in st:
                    self._reseed_if_written(p, st)
                    out.append(st["master_param"])
                elif "master_remainder" in st:
                    self._reseed_if_written(p, st)
                    out.append(_remainder_to_master(p.detach(), st["master_remainder"]))
                else:
                    out.append(p.detach() if p.dtype == torch.float32 else p.detach().float())
        return out

    @torch.no_grad()
    def copy_master_params_to(self, target: torch.nn.Module | Iterable[Tensor]) -> None:
        """Write the fp32 masters into ``target``: a module whose ``parameters()`` (or an iterable of
        tensors) correspond one to one, in order, to this optimizer's params (e.g. an fp32 copy of
        the model made before ``.to(torch.bfloat16)``). Values are cast to each target's dtype."""
        dst = list(target.parameters()) if isinstance(target, torch.nn.Module) else list(target)
        src = self.master_params()
        if len(dst) != len(src):
            raise ValueError(f"copy_master_params_to: target has {len(dst)} tensors, the optimizer has {len(src)} "
                             "params")
        for i, (d, s) in enumerate(zip(dst, src)):
            if not isinstance(d, Tensor) or d.shape != s.shape:
                raise ValueError(f"copy_master_params_to: target tensor {i} has shape "
                                 f"{tuple(getattr(d, 'shape', ()))}, param {i} has {tuple(s.shape)}")
        for d, s in zip(dst, src):
            d.copy_(s)

    # ---- step ---------------------------------------------------------------------------------
    def _collect(self):
        """Validated work per (group, device, mode); raises before anything is modified."""
        work = []
        for gi, group in enumerate(self.param_groups):
            buckets: dict[tuple[torch.device, int], list[tuple[Tensor, Tensor]]] = {}
            for pi, p in enumerate(group["params"]):
                g = _grad_of(p)
                if g is None:
                    continue
                # one cheap combined test per param; the detailed message only on failure
                if not (isinstance(g, Tensor) and g.layout == torch.strided and g.dtype in _FLOATS
                        and g.shape == p.shape and g.device == p.device):
                    _raise_bad_grad(f"group {gi} param {pi}", p, g)
                buckets.setdefault((p.device, self._mode(group, p)), []).append((p, g))
            for (dev, mode), pairs in buckets.items():
                work.append((group, dev, mode, pairs))
        for dev in {w[1] for w in work}:
            _backend.select(dev)
        return work

    def _reseed_if_written(self, p: Tensor, st: dict[str, Any]) -> None:
        """Re-seed the master of ``p`` if the param was written since the optimizer's last write."""
        rec = self._versions.get(id(p), -1)
        if rec == _ver(p):
            return
        if "master_param" in st:
            # elementwise: keep the master where the param is still its rounding, else take the param
            m, pl = _local(st["master_param"]), _local(p.detach())
            m.copy_(torch.where(pl == m.to(pl.dtype), m, pl.float()))
        elif "master_remainder" in st and rec is not None:
            _local(st["master_remainder"]).zero_()  # the written bf16 value is the master now
        self._versions[id(p)] = _ver(p)

    def _check_capture(self, work: list) -> None:
        """During a CUDA graph capture, raise (naming the reason) unless the step can be captured:
        ``capturable=True``, state initialised by an eager warm-up step, lr a float or a tensor on
        the params' device (a CPU tensor's value would be frozen into the graph)."""
        if not _ops.capturing():
            return
        for gi, group in enumerate(self.param_groups):
            if not group["capturable"]:
                raise RuntimeError(f"FusedAdamWMP.step() is being captured in a CUDA graph, but param group {gi} "
                                   "has capturable=False; construct the optimizer with capturable=True")
            lr = group["lr"]
            if isinstance(lr, Tensor) and lr.device.type == "cpu":
                raise RuntimeError(f"FusedAdamWMP: param group {gi} has a CPU tensor lr; in a captured CUDA graph "
                                   "its value would be frozen -- use a float or a tensor on the params' device")
        for group, _dev, _mode, pairs in work:
            for p, _g in pairs:
                if "step" not in self.state[p]:
                    raise RuntimeError("FusedAdamWMP: a param has no optimizer state yet; run one eager step "
                                       "(warm-up) before capturing step() in a CUDA graph")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One AdamW step over all param groups (skipped bitwise when an overflow was found)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = self._collect()
        self._check_capture(work)
        pending, self._pending = self._pending, None
        grad_scale = getattr(self, "grad_scale", None)  # set by GradScaler.step (amp-scaling protocol)
        found_ext = getattr(self, "found_inf", None)
        if not work:
            return loss
        out_dev = work[0][1]
        if pending is None:
            # GradScaler's scale (amp-scaling protocol): its reciprocal in fp64 like GradScaler,
            # on the scale's device; else the cached constant 1 (read-only)
            inv = (grad_scale.double().reciprocal().float().reshape(()) if grad_scale is not None
                   else _ops.scalar_on(1.0, out_dev))
            if self.max_grad_norm is not None:
                amp.unscale_(self, inv, max_norm=self.max_grad_norm)
                pending, self._pending = self._pending, None
        if pending is not None:
            factor, found, total_norm = pending
            self.last_grad_norm = total_norm
        else:
            factor = inv
            found = torch.zeros((), dtype=torch.float32, device=factor.device)
        if found_ext is not None:
            found = torch.maximum(found, found_ext.to(found.device, torch.float32).reshape(()))
        self.last_found_inf = found
        # the external-write check is host-side: it runs in eager steps (not while compiling or
        # capturing a CUDA graph, whose replays run no Python)
        check_writes = self._mpkern_check_writes and not torch.compiler.is_compiling() and not _ops.capturing()
        per_dev: dict[torch.device, tuple[Tensor, Tensor]] = {}
        for group, dev, mode, pairs in work:
            if dev not in per_dev:
                per_dev[dev] = (factor.to(dev, torch.float32, non_blocking=True).reshape(()),
                                found.to(dev, torch.float32, non_blocking=True).reshape(()))
            f_dev, found_dev = per_dev[dev]
            lists, copies = self._prepare(group, mode, pairs, check_writes)
            lr_tensor, lr_value = _ops.lr_args(group["lr"], dev)  # no host-to-device copy, no sync
            _fused_adamw_mp(_backend.select(dev), *lists, f_dev, found_dev, lr_tensor, lr_value, group, mode)
            for p, tmp in copies:  # params that are not one dense block went through a copy
                p.copy_(tmp)
            if check_writes and mode != MASTER_NONE:
                # _prepare recorded each param's version before the kernel. The native and Triton
                # kernels write through data pointers (no version bump): nothing to do. A backend
                # that bumps (the torch reference, the contiguous-copy path) is seen on the param
                # it touched and recorded again -- one host read per bucket in the common case.
                versions = self._versions
                p0 = pairs[0][0]
                if copies or versions.get(id(p0)) != _ver(p0):
                    for p, _ in pairs:
                        versions[id(p)] = _ver(p)
        self._consume_main_grads(work)
        return loss

    def _prepare(self, group: dict[str, Any], mode: int, pairs: list[tuple[Tensor, Tensor]], check_writes: bool):
        """Kernel argument lists for one bucket: flat views of dense params/grads/state."""
        params, grads, ms, vs, vmaxs, masters, steps = [], [], [], [], [], [], []
        copies: list[tuple[Tensor, Tensor]] = []
        amsgrad = group["amsgrad"]
        mkey = "master_param" if mode == MASTER_F32 else "master_remainder" if mode == MASTER_REMAINDER else None
        for p, g in pairs:
            st = self.state.get(p)
            if st is None or "step" not in st:
                st = self._init_state(group, p)
                if check_writes and mode != MASTER_NONE:
                    self._versions[id(p)] = _ver(p)
            elif check_writes and mode != MASTER_NONE and self._versions.get(id(p), -1) != (
                    p._version if type(p) is Parameter else _ver(p)):
                self._reseed_if_written(p, st)  # records the version
            ts = [st["exp_avg"], st["exp_avg_sq"]]
            if amsgrad:
                ts.append(st["max_exp_avg_sq"])
            if mkey is not None:
                ts.append(st[mkey])
            if type(p) is not Parameter and distributed.is_dtensor(p):
                # FSDP2 / tensor parallel: the kernel updates the local shard
                p, g, ts = _local(p), _local(g), [_local(t) for t in ts]
            if p.is_contiguous():
                pp, gg = p, (g if g.is_contiguous() else g.contiguous())
            elif _flat(p):  # dense in another memory format: flat views, state laid out like p
                if g.stride() != p.stride():
                    g = _like(p, g.dtype).copy_(g)
                pp, gg = _flat_view(p), _flat_view(g)
                ts = [_flat_view(t) for t in ts]
            else:  # not one dense block: update a contiguous copy, write it back after the kernel
                pp, gg = p.contiguous(), g.contiguous()
                copies.append((p, pp))
            params.append(pp)
            grads.append(gg)
            ms.append(ts[0])
            vs.append(ts[1])
            if amsgrad:
                vmaxs.append(ts[2])
            if mkey is not None:
                masters.append(ts[-1])
            steps.append(st["step"])
        return (params, grads, ms, vs, vmaxs, masters, steps), copies

    @staticmethod
    def _consume_main_grads(work) -> None:
        """Set every ``main_grad`` that fed this step to None -- or, inside a CUDA graph capture,
        zero it in place (a replay must find the same buffers, and the zeroing is captured)."""
        mains = [p for _group, _dev, _mode, pairs in work for p, _g in pairs
                 if getattr(p, "main_grad", None) is not None]
        if not mains:
            return
        if _ops.capturing():
            torch._foreach_zero_([p.main_grad for p in mains])
            return
        for p in mains:
            p.main_grad = None

    # ---- checkpoints --------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load our own or a plain ``torch.optim.AdamW`` state dict, the way ``Optimizer`` does.

        Same order as the base class: load pre-hooks (their edits count), validation, the saved
        group ``params`` ids mapped to this optimizer's params, per-param state converted, groups
        replaced, post-hooks. Differences from the base class, all in :func:`_state_from_checkpoint`:
        moments keep ``state_dtype`` and masters stay fp32 (the base class would cast them to the
        16-bit param dtype); an AdamW checkpoint's masters are taken from the params (remainders
        start at zero). The storage layout (``master_weights``, ``state_dtype``) is this optimizer's:
        a checkpoint saved with another layout is converted exactly (with a warning).
        """
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            hook_result = pre_hook(self, state_dict)
            if hook_result is not None:
                state_dict = hook_result
        groups = self.param_groups
        saved_groups = copy.deepcopy(state_dict["param_groups"])
        if len(groups) != len(saved_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
            raise ValueError("loaded state dict contains a parameter group that doesn't match the size of "
                             "optimizer's group")
        id_map = dict(zip(chain.from_iterable(g["params"] for g in saved_groups),
                          chain.from_iterable(g["params"] for g in groups)))
        converted = []
        new_groups = []
        for gi, (g, ng) in enumerate(zip(groups, saved_groups)):
            ng["params"] = g["params"]
            if "param_names" in g and "param_names" not in ng:
                ng["param_names"] = g["param_names"]
            for key in _OWN_KEYS:
                ng.setdefault(key, g[key])  # a plain AdamW checkpoint has none of them
            for key in _LAYOUT_KEYS:
                if ng[key] != g[key]:
                    converted.append(f"group {gi}: {key}={ng[key]!r} -> {g[key]!r}")
                    ng[key] = g[key]
            new_groups.append(ng)
        group_of = {id(p): ng for ng in new_groups for p in ng["params"]}
        state: defaultdict[Any, dict[Any, Any]] = defaultdict(dict)
        for k, v in state_dict["state"].items():
            if k in id_map:
                p = id_map[k]
                state[p] = _state_from_checkpoint(p, v, group_of[id(p)], self._mode(group_of[id(p)], p))
            else:
                state[k] = v
        self.__setstate__({"state": state, "param_groups": new_groups})
        # a master loaded here is checked against its param at the next step (elementwise, on the
        # device), whichever of model and optimizer was loaded first
        self._versions = {id(p): None for p in state if isinstance(p, Tensor)}
        if converted:
            warnings.warn("FusedAdamWMP.load_state_dict: the checkpoint's state layout differs from this optimizer's; "
                          "converted (" + "; ".join(converted) + ")", UserWarning, stacklevel=2)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)


def _check_own_args(master_weights: Any, state_dtype: Any, max_grad_norm: Any, stochastic_rounding: Any) -> None:
    if master_weights not in (True, False, "remainder") or isinstance(master_weights, int) and not isinstance(
            master_weights, bool):
        raise ValueError(f"master_weights must be True, False or 'remainder', got {master_weights!r}")
    if state_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"state_dtype must be torch.float32 or torch.bfloat16, got {state_dtype}")
    if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))
                                      or not (max_grad_norm > 0 and math.isfinite(max_grad_norm))):
        raise ValueError(f"max_grad_norm must be a positive finite float or None, got {max_grad_norm!r}")
    if stochastic_rounding and master_weights is not False:
        raise ValueError("stochastic_rounding applies to 16-bit params without master weights: "
                         "use it with master_weights=False")


def _raise_bad_grad(where: str, p: Tensor, g: Any) -> None:
    if not isinstance(g, Tensor):
        raise TypeError(f"FusedAdamWMP: gradient of {where} is not a tensor")
    if g.is_sparse or g.layout != torch.strided:
        raise RuntimeError(f"FusedAdamWMP does not support sparse gradients ({where})")
    if g.is_complex():
        raise RuntimeError(f"FusedAdamWMP does not support complex gradients ({where})")
    if g.dtype not in _FLOATS:
        raise TypeError(f"FusedAdamWMP: gradient of {where} has dtype {g.dtype}")
    if g.shape != p.shape:
        raise ValueError(f"FusedAdamWMP: gradient of {where} has shape {tuple(g.shape)}, param has {tuple(p.shape)}")
    raise ValueError(f"FusedAdamWMP: gradient of {where} is on {g.device}, param on {p.device}")


def _fused_adamw_mp(backend: str, params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                    exp_avg_sqs: list[Tensor], max_exp_avg_sqs: list[Tensor], masters: list[Tensor],
                    steps: list[Tensor], grad_factor: Tensor, found_inf: Tensor, lr_tensor: Tensor | None,
                    lr: float, group: dict[str, Any], mode: int) -> None:
    """The functional step: one fused kernel over prepared, layout-matched lists of one device."""
    beta1, beta2 = group["betas"]
    _ops.adamw_step_(
        backend, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, steps, grad_factor, found_inf,
        lr_tensor, lr, float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
        bool(group["maximize"]), mode, bool(group["stochastic_rounding"]), int(group["seed"]))


@torch.no_grad()
def _state_from_checkpoint(p: Tensor, src: Any, group: dict[str, Any], mode: int) -> dict[str, Any]:
    """Our per-param state for ``p`` from a saved one (ours in any master mode, or AdamW's).

    Every tensor is copied into ``p``'s device and layout; ``step`` becomes a 0-dim fp32 tensor;
    moments take ``state_dtype``; masters stay fp32 (or int16 remainders); a master mode other
    than ``mode`` is converted exactly. Unknown entries are cast like ``torch.optim.Optimizer``
    does (floating tensors to the param's dtype).
    """
    if not isinstance(src, dict):
        raise ValueError(f"FusedAdamWMP.load_state_dict: per-param state must be a dict, got {type(src).__name__}")
    src = dict(src)
    dev = p.device
    st: dict[str, Any] = {}

    def laid(val: Tensor, dtype: torch.dtype) -> Tensor:
        val = val.to(dev)
        if val.shape != p.shape:
            val = val.reshape(p.shape)
        return _like(p, dtype).copy_(distributed.like_param(p, val))

    if "step" in src:
        st["step"] = torch.as_tensor(src.pop("step"), dtype=torch.float32).reshape(()).to(dev).clone()
    else:
        st["step"] = torch.zeros((), dtype=torch.float32, device=dev)
    for key in ("exp_avg", "exp_avg_sq"):
        val = src.pop(key, None)
        st[key] = laid(val, group["state_dtype"]) if val is not None else _like(p, group["state_dtype"]).zero_()
    vm = src.pop("max_exp_avg_sq", None)
    if vm is not None:
        st["max_exp_avg_sq"] = laid(vm, torch.float32)
    elif group["amsgrad"]:
        st["max_exp_avg_sq"] = _like(p, torch.float32).zero_()
    master = src.pop("master_param", None)
    rem = src.pop("master_remainder", None)
    if master is None and rem is not None and p.dtype == torch.bfloat16:
        master = _remainder_to_master(p.detach().to(dev), laid(rem, torch.int16))
    if mode == MASTER_F32:
        st["master_param"] = laid(master, torch.float32) if master is not None else _like(p, torch.float32).copy_(p)
    elif mode == MASTER_REMAINDER:
        if rem is not None:
            st["master_remainder"] = laid(rem, torch.int16)
        elif master is not None:  # fp32 master -> bf16 param + remainder, exactly
            hi, low = _master_to_remainder(laid(master, torch.float32))
            p.copy_(hi)
            st["master_remainder"] = laid(low, torch.int16)
        else:
            st["master_remainder"] = _like(p, torch.int16).zero_()
    elif master is not None and p.dtype != torch.float32:
        p.copy_(master.to(dev))  # no master kept: the param takes the checkpoint's master, rounded
    for key, val in src.items():  # entries we do not know: like torch.optim.Optimizer
        if isinstance(val, Tensor):
            val = val.to(device=dev, dtype=p.dtype) if p.is_floating_point() and val.is_floating_point() else \
                val.to(device=dev)
        st[key] = val
    return st
