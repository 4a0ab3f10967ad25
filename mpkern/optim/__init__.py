"""``FusedAdamWMP``: a drop-in ``torch.optim.AdamW`` for fp16/bf16 models with fp32 master weights.

One fused multi-tensor kernel per (param group, device, master kind) reads the 16-bit grad (or the
fp32 ``main_grad``), multiplies it by ``inv_scale * clip_coef`` in registers, updates the fp32
master (or bf16 param + int16 remainder), ``exp_avg``, ``exp_avg_sq`` and writes the rounded
16-bit param -- 28 B/param for bf16 params with fp32 master and moments. Grads are never
written. Loss-scale, clip coefficient, found_inf, step counters (and lr when it is a tensor) stay
on the device: ``step()`` never synchronises with the host.

The package has the shape of ``torch/optim/adamw.py``:

* this module: the optimizer object -- arguments, param groups, lazy state, hooks, the
  unscale/clip hand-off, ``state_dict`` plumbing through the base class;
* :mod:`.functional`: the functional step over prepared lists (:func:`~.functional.fused_adamw_mp`);
* :mod:`.storage`: one small description per storage kind (masters fp32 / remainder / none,
  moments fp32 / bf16): bytes, creation, conversion to and from fp32 -- read by checkpoints, the
  write check and :mod:`mpkern.bytemodel`;
* :mod:`.writes`: external writes to params (stamps) and how the state follows them;
* :mod:`.checkpoint`: the one place a saved per-param state is turned into ours.
"""

from __future__ import annotations

import copy
import math
import sys
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any, NamedTuple

import torch

from .. import _backend, _ops, amp, distributed
from ..amp import _flat, _main_grad_of, _to_device
from ..distributed import local as _local
from . import storage, writes
from .checkpoint import state_from_checkpoint
from .functional import fused_adamw_mp
from .storage import like as _like
from .storage import master_kind, moment_kind
from .writes import stamp as _stamp

Tensor = torch.Tensor
Parameter = torch.nn.Parameter
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
# mpkern's own param-group keys; the storage-layout ones are the constructor's choice even when a
# checkpoint says otherwise (the state is converted, with a warning)
_GROUPS: dict[int, Any] = {}  # process groups of pickled optimizers (see __getstate__)
_OWN_KEYS = ("max_grad_norm", "master_weights", "state_dtype", "stochastic_rounding", "seed")
_LAYOUT_KEYS = ("master_weights", "state_dtype")
_LIVE_KEYS = ("_pending", "last_grad_norm", "last_found_inf")


class _Pending(NamedTuple):
    """What :func:`mpkern.unscale_` / ``clip_grad_norm_`` left for the next ``step()``.

    ``inv`` and ``coef`` are still to be applied to the grads (both 1 when ``apply=True`` wrote
    them already); ``norm`` is the norm of ``grads * inv`` (what the step sees before ``coef``),
    ``reported`` the norm the caller got back (``last_grad_norm``), ``inf_norm`` which norm it is.
    """

    inv: Tensor
    coef: Tensor
    found: Tensor
    norm: Tensor
    reported: Tensor
    inf_norm: bool


_flat_view = storage.flat_view


def _live_attr(key: str, doc: str) -> property:
    """An attribute kept in the optimizer's ``_live`` dict (see ``FusedAdamWMP.__init__``)."""

    def get(self: Any) -> Any:
        return self._live[key]

    def put(self: Any, value: Any) -> None:
        self._live[key] = value

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

    Distributed: DTensor params (FSDP2 ``fully_shard``, tensor parallel) are updated shard by
    shard; masters and moments are DTensors laid out like their params (state memory divides by
    the number of shards, and ``torch.distributed.checkpoint`` can reshard them), and clipping
    uses the global norm (see :mod:`mpkern.distributed`).

    Params may have any layout: dense ones (contiguous, channels_last, permuted) are updated in
    place as flat buffers with state laid out like the param; other strided views go through a
    contiguous copy (correct, slower).

    Writes to the params are kept: when a param was written or replaced by someone else since the
    optimizer's last write (``model.load_state_dict``, ``fill_``, ``copy_``, re-initialisation,
    ``p.data = t``, ``model.to(memory_format=...)``, ``model.to(dtype)``; seen from the param's version
    counter and data pointer, host-side integers, so no sync), its state is made to fit before the
    next update: state re-laid like the param (values kept by index), the master re-seeded
    elementwise (kept where the param still equals the rounded master, else the param's value),
    a master built or dropped when the param's dtype changed (``model.float()`` after steps gives the
    params their fp32 masters back). With ``"remainder"`` the remainder of a written param is reset,
    except for params that share one storage (views of a flat buffer share a version counter, so
    the written one cannot be told apart: remainders are kept, the written param's master is then
    within half a bf16 ulp of the written value). **Not seen**: in-place writes through a ``.data``
    alias (``p.data.fill_(x)``, ``p.data.copy_(ema)``) -- PyTorch gives ``.data`` its own version
    counter; call :meth:`resync_masters` after such writes.

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

    Host time: after an eager step whose params are plain dense contiguous tensors on one device
    with the native CPU or CUDA backend (no ``main_grad``, no DTensor, no repeated param, no
    ``process_group``), the kernel argument lists are cached; each later eager step re-checks in
    one C++ loop that nothing the full step looks at has changed (group lists, each param's stamp
    and layout, each grad's presence, dtype, shape and contiguity, no ``main_grad``, the state
    dicts) and calls the kernels with the cached lists -- bitwise the same step. Anything else
    (a write, a new grad dtype, a load, an added group, compiling, a CUDA graph capture) takes the
    full path, which rebuilds the cache. ``FusedAdamWMP._mpkern_step_cache = False`` turns it off.
    """

    _step_supports_amp_scaling = True
    _mpkern_fuses_unscale = True
    _mpkern_check_writes = True  # the external-write check (benchmarks switch it off to time it)
    # the eager fast path: the prepared kernel lists cached and re-validated in C++ each step
    # (see _fast_refresh); False always takes the full path (tests compare the two)
    _mpkern_step_cache = True

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
        state_dtype = _check_own_args(master_weights, state_dtype, max_grad_norm, stochastic_rounding)
        _check_amsgrad(amsgrad, state_dtype, "")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        capturable=capturable, max_grad_norm=max_grad_norm, master_weights=master_weights,
                        state_dtype=state_dtype, stochastic_rounding=stochastic_rounding, seed=int(seed))
        # what a step leaves for the next one or for the caller, kept in a dict: a compiled step
        # (torch.compile) replays mutations of a dict, but not attribute stores on the optimizer
        self._live: dict[str, Any] = dict.fromkeys(_LIVE_KEYS)
        self._versions: dict[int, Any] = {}  # id(param) -> its stamp (version, data pointer) after our last write
        self._mpkern_process_group = process_group
        self._storage_count: dict[int, int] | None = None  # see _shares_storage (rebuilt every step)
        self._offsets: dict[int, int] = {}  # id(DTensor param) -> flat offset of its local shard
        self._fast: _StepCache | None = None  # see _build_step_cache
        self._fast_misses = 0  # cache invalidations in a row (builds back off after a few)
        super().__init__(params, defaults)

    # ---- what a step leaves (see _live) --------------------------------------------------------
    _pending = _live_attr("_pending", "What mpkern.unscale_ / clip_grad_norm_ left for the next step (a _Pending).")
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
        _check_own_args(True, torch.float32, value, False)
        self.defaults["max_grad_norm"] = value
        for group in self.param_groups:
            group["max_grad_norm"] = value

    @property
    def seed(self) -> int:
        return int(self.defaults["seed"])

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._fast = None
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        gi = len(self.param_groups) - 1
        try:
            group["state_dtype"] = _check_own_args(group["master_weights"], group["state_dtype"],
                                                   group["max_grad_norm"], group["stochastic_rounding"])
            _check_amsgrad(group["amsgrad"], group["state_dtype"], f" (group {gi})")
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
                _check_param_dtype(group, p.dtype, f"param {i} of group {gi}")
            storage.MASTER_KINDS[group["master_weights"]].check_group([p.dtype for p in group["params"]],
                                                                      f"group {gi}")
        except (ValueError, TypeError):
            self.param_groups.pop()  # nothing half-added
            raise

    @staticmethod
    def _kind(group: dict[str, Any], p: Tensor) -> storage.MasterKind:
        """The master kind of ``p`` in ``group`` (fp32 params keep none)."""
        return master_kind(group["master_weights"], p.dtype)

    def _init_state(self, group: dict[str, Any], p: Tensor) -> dict[str, Any]:
        self._fast = None
        state = self.state[p]
        if "step" in state:
            return state
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        state.update(moment_kind(group["state_dtype"]).create(p))
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = _like(p, torch.float32).zero_()
        state.update(self._kind(group, p).create(p))
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
        self.__dict__["_live"] = {k: self.__dict__.pop(k, None) for k in _LIVE_KEYS}
        for key in ("_mpkern_process_group", "_storage_count"):
            self.__dict__.setdefault(key, None)
        self._offsets = {}
        self._fast = None  # a load or a copy: the next step takes the full path
        self.__dict__.setdefault("_fast_misses", 0)
        token = self.__dict__.pop("_mpkern_process_group_token", None)
        if token is not None:
            if token not in _GROUPS:
                raise RuntimeError("FusedAdamWMP: this optimizer was pickled with a process_group, which only "
                                   "exists in the process that created it; build the optimizer anew in this process")
            self._mpkern_process_group = _GROUPS[token]
        for key, val in (("max_grad_norm", None), ("master_weights", True), ("state_dtype", "float32"),
                         ("stochastic_rounding", False), ("seed", 0)):
            self.defaults.setdefault(key, val)
        for group in chain(self.param_groups, [self.defaults]):
            for key, val in (("amsgrad", False), ("maximize", False), ("capturable", False)):
                group.setdefault(key, val)  # groups saved before a flag existed: AdamW's fallbacks
            if isinstance(group.get("state_dtype"), torch.dtype):  # saved by an older mpkern
                group["state_dtype"] = storage.MOMENT_DTYPE_NAMES.get(group["state_dtype"], group["state_dtype"])
        # params and masters were copied together: they agree now
        self._versions = {id(p): _stamp(p) for p in self.state if isinstance(p, Tensor)}

    # ---- the unscale_/clip hand-off -----------------------------------------------------------
    def _mpkern_set_pending_unscale(self, factor: Tensor, found_inf: Tensor, total_norm: Tensor, *,
                                    inv: Tensor | None = None, coef: Tensor | None = None,
                                    applied: bool = False, inf_norm: bool = False) -> None:
        """Called by :func:`mpkern.unscale_`: apply ``inv * coef`` (= ``factor``) in the next step.

        ``applied=True``: the grads were already multiplied (``unscale_(..., apply=True)``); only the
        skip decision and the norm are left for the step."""
        if applied or inv is None or coef is None:
            one = torch.ones_like(factor)
            seen = total_norm if coef is None or not applied else total_norm * coef
            self._pending = _Pending(one, one, found_inf, seen, total_norm, inf_norm)
        else:
            self._pending = _Pending(inv, coef, found_inf, total_norm, total_norm, inf_norm)

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
        prev = self._pending
        res = amp.unscale_(self, prev.inv if prev is not None else 1.0, max_norm=max_norm, norm_type=norm_type)
        if prev is not None and self._pending is not None:
            new = self._pending
            self._pending = new._replace(coef=torch.minimum(prev.coef, new.coef),
                                         found=torch.maximum(prev.found, new.found))
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
        self._storage_count = None
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p, {})
                kind = self._kind(group, p)
                rec = self._versions.get(id(p), -1)
                if "step" in st and rec is writes.LOADED:
                    # a checkpoint was loaded and the model may still be: read, do not conform (the
                    # step converts from the param as it is then)
                    others = storage.stored_kinds(st, but=kind)
                    if others:
                        out.append(others[0].to_fp32(p, st))
                        continue
                elif "step" in st and rec != _stamp(p):
                    self._conform(kind, p, st)  # written since our last step
                live = kind.live_fp32(st)
                if live is not None:
                    out.append(live)  # writing into it changes the master
                elif kind.has_state(st):
                    out.append(kind.to_fp32(p, st))
                else:
                    out.append(p.detach() if p.dtype == torch.float32 else p.detach().float())
        return out

    @torch.no_grad()
    def adamw_state_dict(self) -> dict[str, Any]:
        """A state dict that ``torch.optim.AdamW.load_state_dict`` accepts, whatever the storage kinds.

        Per param: ``step`` and fp32 ``exp_avg`` / ``exp_avg_sq`` (``max_exp_avg_sq`` with amsgrad),
        decoded from this optimizer's storage; param groups with AdamW's keys (mpkern's own keys
        dropped). The params it belongs to are the fp32 masters of :meth:`master_params`: build the
        AdamW over fp32 copies of them (``[torch.nn.Parameter(m.detach().clone()) for m in
        opt.master_params()]``), in the same group structure, then load this. New tensors: the
        optimizer's state is not shared.
        """
        sd = self.state_dict()
        groups = []
        for g in sd["param_groups"]:
            ng = {k: v for k, v in g.items() if k not in _OWN_KEYS}
            for key, val in (("foreach", None), ("differentiable", False), ("fused", None),
                             ("decoupled_weight_decay", True)):
                ng.setdefault(key, val)
            groups.append(ng)
        state = {}
        for i, st in sd["state"].items():
            out = {"step": torch.as_tensor(st["step"], dtype=torch.float32).detach().clone()}
            for key in ("exp_avg", "exp_avg_sq"):
                val = storage.moments_fp32(st, key)
                if val is not None:
                    out[key] = val.detach()
            if "max_exp_avg_sq" in st:
                out["max_exp_avg_sq"] = st["max_exp_avg_sq"].detach().to(torch.float32).clone()
            state[i] = out
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def resync_masters(self, params: Iterable[Tensor] | None = None) -> None:
        """Re-seed the masters of ``params`` (default: every param) from the params as they are now.

        Writes the optimizer cannot see need this: writes through a ``.data`` alias
        (``p.data.fill_(x)``, ``p.data.copy_(ema)``; old ``_init_weights`` code) bypass the version
        counter the automatic check reads. Masters are re-seeded elementwise (kept where the param
        still equals the rounded master, else the param's value); remainders are reset (except for
        params sharing one storage, see the class docs). Params without state are ignored.
        """
        wanted = None if params is None else {id(p) for p in ([params] if isinstance(params, Tensor) else params)}
        self._storage_count = None
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p)
                if st and "step" in st and (wanted is None or id(p) in wanted):
                    self._versions[id(p)] = -1  # "written"
                    self._conform(self._kind(group, p), p, st)

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
    def _collect(self) -> tuple[list[tuple[dict[str, Any], torch.device, storage.MasterKind,
                                          list[tuple[Tensor, Tensor]]]], bool]:
        """(work per (group, device, master kind), whether any grad is a ``main_grad``), validated;
        raises before any param or state is modified.

        A param listed twice in one group (``torch.optim`` warns about it) is stepped twice, like
        ``torch.optim.AdamW`` does on its single-tensor path: each repeat goes to a later pass.
        A param with both ``main_grad`` and ``.grad`` (a tied weight) gets their sum.
        """
        work = []
        uses_main = False
        sid = -1  # the param's random-stream id: its position among all params of the optimizer
        for gi, group in enumerate(self.param_groups):
            passes: list[dict[tuple[torch.device, storage.MasterKind], list[tuple[Tensor, Tensor, int]]]] = [{}]
            plist = group["params"]
            seen: dict[int, int] | None = {} if len(set(map(id, plist))) != len(plist) else None  # C-level test
            kinds: dict[torch.dtype, storage.MasterKind] = {}
            for pi, p in enumerate(plist):
                sid += 1
                g = getattr(p, "main_grad", None)
                if g is None:
                    g = p.grad
                    if g is None:
                        continue
                else:
                    uses_main = True
                    if p.grad is not None:
                        g = _main_grad_of(p, g)
                # one cheap combined test per param; the detailed message only on failure
                if not (isinstance(g, Tensor) and g.layout == torch.strided and g.dtype in _FLOATS
                        and g.shape == p.shape and g.device == p.device):
                    _raise_bad_grad(f"group {gi} param {pi}", p, g)
                if type(g) is not Tensor:
                    distributed.check_reduced(g, f"FusedAdamWMP: group {gi} param {pi}")
                kind = kinds.get(p.dtype)
                if kind is None:  # once per dtype and group: a param may have changed dtype since
                    _check_param_dtype(group, p.dtype, f"param {pi} of group {gi}")
                    kind = kinds[p.dtype] = self._kind(group, p)
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
                    work.append((group, dev, kind, pairs))
        for dev in {w[1] for w in work}:
            _backend.select(dev)
        return work, uses_main

    def _shares_storage(self, p: Tensor) -> bool:
        """True if ``p``'s storage also holds another param of this optimizer (views of one flat
        buffer share one version counter, so a write to one of them cannot be told apart)."""
        if self._storage_count is None:
            count: dict[int, int] = {}
            for group in self.param_groups:
                for q in group["params"]:
                    key = _local(q).untyped_storage().data_ptr()
                    count[key] = count.get(key, 0) + 1
            self._storage_count = count
        return self._storage_count.get(_local(p).untyped_storage().data_ptr(), 0) > 1

    def _conform(self, kind: storage.MasterKind, p: Tensor, st: dict[str, Any]) -> None:
        """Make the state of ``p`` fit the param as it is now (see :func:`.writes.conform`); record
        its stamp."""
        self._fast = None
        writes.conform(kind, p, st, recorded=self._versions.get(id(p), -1), shared=lambda: self._shares_storage(p))
        self._versions[id(p)] = _stamp(p)

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
            for p, *_ in pairs:
                if "step" not in self.state[p]:
                    raise RuntimeError("FusedAdamWMP: a param has no optimizer state yet; run one eager step "
                                       "(warm-up) before capturing step() in a CUDA graph")

    def _own_clip(self, pend: _Pending) -> _Pending:
        """``pend`` with ``max_grad_norm`` applied too: the smaller clip coefficient wins."""
        mgn = self.max_grad_norm
        if pend.inf_norm:  # the pending norm is the inf-norm: max_grad_norm needs the L2 norm
            amp.unscale_(self, pend.inv, max_norm=mgn)
            l2, self._pending = self._pending, None
            assert l2 is not None
            return pend._replace(coef=torch.minimum(pend.coef, l2.coef), found=torch.maximum(pend.found, l2.found))
        one = torch.ones_like(pend.coef)
        coef = torch.where(pend.found > 0, one, torch.clamp(mgn / (pend.norm + 1e-6), max=1.0))
        return pend._replace(coef=torch.minimum(pend.coef, coef))

    def _tell_scaler(self, found: Tensor) -> None:
        """Record ``found`` (which includes what GradScaler found in ``.grad``) in the GradScaler that
        is stepping this optimizer, so that ``scaler.update()`` backs off on an overflow only
        ``main_grad`` held. GradScaler hands the optimizer its scale but not itself: it is found as
        the caller of this ``step()``."""
        frame = sys._getframe(1)
        scaler = None
        for _ in range(12):
            frame = frame.f_back
            if frame is None:
                break
            cand = frame.f_locals.get("self")
            if isinstance(cand, torch.amp.GradScaler) and frame.f_locals.get("optimizer") is self:
                scaler = cand
                break
        if scaler is None:
            warnings.warn("FusedAdamWMP.step: got a grad_scale but no calling GradScaler; an overflow in main_grad "
                          "skips the step but cannot back off the scale -- use mpkern.unscale_(opt, scaler=scaler) "
                          "before scaler.step(opt)", UserWarning, stacklevel=3)
            return
        dev = scaler._scale.device
        scaler._per_optimizer_states[id(self)]["found_inf_per_device"] = {dev: _to_device(found, dev)}

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One AdamW step over all param groups (skipped bitwise when an overflow was found).

        Everything that can fail (grads, state layout, lr, capture rules) is checked and prepared
        for every group before the first kernel runs: an error leaves no group half-stepped."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if torch.compiler.is_compiling():
            # replayed by every compiled call: compiled steps write the params through functionalized
            # copies (their version counters move) and record no stamps
            self._live["traced"] = True
        elif self._live.get("traced"):  # a compiled step ran since the last eager one
            self._restamp_after_compiled()
        fast = self._fast_refresh()
        if fast is not None:
            try:
                self._fast_step(fast)
            finally:
                fast.cache.release()  # the cache never keeps grads alive between steps
            return loss
        work, uses_main = self._collect()
        self._check_capture(work)
        grad_scale = getattr(self, "grad_scale", None)  # set by GradScaler.step (amp-scaling protocol)
        found_ext = getattr(self, "found_inf", None)
        if uses_main and self._pending is None and grad_scale is None and found_ext is not None:
            raise ValueError("FusedAdamWMP.step: GradScaler.unscale_(optimizer) was called, which unscales .grad only; "
                             "the main_grad buffers (mpkern.nn fp32_main_grad=True) are still scaled -- call "
                             "mpkern.unscale_(optimizer, scaler=scaler) instead of scaler.unscale_(optimizer)")
        if not work:
            self._pending = None
            return loss
        # the external-write check is host-side: it runs in eager steps (not while compiling or
        # capturing a CUDA graph, whose replays run no Python)
        check_writes = self._mpkern_check_writes and not torch.compiler.is_compiling() and not _ops.capturing()
        self._storage_count = None
        prepared = [(group, dev, kind, pairs, *self._prepare(group, kind, pairs, check_writes),
                     _ops.lr_args(group["lr"], dev)) for group, dev, kind, pairs in work]
        # GradScaler checked .grad only: a main_grad needs our own check (the stats pass)
        own_check = self._pending is None and grad_scale is not None and uses_main

        def stats(inv: Tensor) -> None:
            seen: set[int] = set()  # a repeated param counts once in the norm, as in torch's clip
            firsts = [x for w in work for x in w[3] if not (id(x[0]) in seen or seen.add(id(x[0])))]
            amp.unscale_(self, inv, max_norm=self.max_grad_norm, _collected=([x[0] for x in firsts],
                                                                               [x[1] for x in firsts]))

        # after everything that can fail: the pending unscale is kept on an error
        factor, found = self._step_factor(work[0][1], stats if self.max_grad_norm is not None or own_check else None)
        if own_check:
            self._tell_scaler(found)
        per_dev: dict[torch.device, tuple[Tensor, Tensor]] = {}
        versions = self._versions
        for group, dev, kind, pairs, lists, copies, (lr_tensor, lr_value) in prepared:
            if dev not in per_dev:
                per_dev[dev] = (_to_device(factor, dev, torch.float32).reshape(()),
                                _to_device(found, dev, torch.float32).reshape(()))
            f_dev, found_dev = per_dev[dev]
            for p, tmp in copies:  # not one dense block: (re)take the copy now -- a repeat of the
                tmp.copy_(p)       # param in a later pass must see the earlier pass's update
            *tensors, sids, offsets, scales = lists
            fused_adamw_mp(_backend.select(dev), *tensors, f_dev, found_dev, lr_tensor, lr_value, group, kind.mode,
                           sids, offsets, *(scales or ()))
            for p, tmp in copies:  # params that are not one dense block went through a copy
                p.copy_(tmp)
            if check_writes:
                # _prepare recorded each param's stamp before the kernel. The native and Triton
                # kernels write through data pointers (no version bump): nothing to do. A backend
                # that bumps (the torch reference, the contiguous-copy path) is seen on the param
                # it touched and recorded again -- one host read per bucket in the common case.
                p0 = pairs[0][0]
                if copies or versions.get(id(p0)) != _stamp(p0):
                    for p, *_ in pairs:
                        versions[id(p)] = _stamp(p)
        self._consume_main_grads(work)
        self._build_step_cache(prepared, uses_main, check_writes)
        return loss

    # ---- the eager fast path: cached kernel lists --------------------------------------------------
    def _build_step_cache(self, prepared: list, uses_main: bool, check_writes: bool) -> None:
        """After a full step: cache its kernel argument lists when every bucket qualifies -- one
        device with a native (C++/CUDA) backend, plain dense contiguous params and grads, no
        repeated param, no ``main_grad``, no process group, eager with the write check on. Every
        other case keeps taking the full path. A cache that keeps being invalidated (grads that
        come and go, params written every step) is rebuilt only every 64th full step."""
        if not check_writes:  # compiling, capturing or the write check off: the cache stays as it is
            return            # (a later eager step re-validates it in full)
        self._fast = None
        if not self._mpkern_step_cache or uses_main or self._mpkern_process_group is not None:
            return
        if self._fast_misses >= 4:
            self._fast_misses += 1
            if self._fast_misses % 64:
                return
        ext = _backend.native()
        if ext is None or not hasattr(ext, "StepCache") or not ext.step_cache_supported():
            return
        dev = prepared[0][1]
        backend = _backend.select(dev)
        if backend not in ("cpu", "cuda") or backend != dev.type:
            return
        index: dict[int, tuple[int, int]] = {}
        plain = (Parameter, Tensor)
        for bi, (_group, bdev, _kind, pairs, _lists, copies, _lr) in enumerate(prepared):
            if copies or bdev != dev:
                return
            for pos, (p, g, _sid) in enumerate(pairs):
                if (id(p) in index or type(p) not in plain or type(g) is not Tensor or not p.is_contiguous()
                        or not g.is_contiguous()):
                    return
                index[id(p)] = (bi, pos)
        versions, state = self._versions, self.state
        params, pdicts, sdicts, bucket_of, pos_of = [], [], [], [], []
        for group in self.param_groups:
            for p in group["params"]:
                if type(p) not in plain:
                    return
                where = index.get(id(p))
                if where is None:
                    bucket_of.append(-1)
                    pos_of.append(0)
                    sdicts.append(None)
                else:
                    st = state.get(p)
                    if st is None or versions.get(id(p), -1) != _stamp(p):
                        return
                    bucket_of.append(where[0])
                    pos_of.append(where[1])
                    sdicts.append(st)
                params.append(p)
                pdicts.append(p.__dict__)
        cache = ext.StepCache([g["params"] for g in self.param_groups], params, pdicts, sdicts, state, bucket_of,
                              pos_of, dev.type == "cuda")
        buckets = []
        for group, _dev, kind, pairs, lists, _copies, _lr in prepared:
            ps, _grads, ms, vs, vmaxs, masters, steps, sids, offsets, scales = lists
            cache.add_bucket(ps, ms, vs, vmaxs, masters, steps, scales[0] if scales else None,
                             scales[1] if scales else None, sids, offsets, kind.mode)
            buckets.append((group, [p for p, *_ in pairs]))
        self._fast = _StepCache(cache, self.param_groups, [(g, g["params"], _cache_flags(g)) for g in self.param_groups],
                                state, versions, dev, backend, buckets)

    def _fast_refresh(self) -> _StepCache | None:
        """The step cache, re-validated (grads gathered), or None: take the full path. O(groups)
        Python checks here, then one C++ loop over the params (csrc/fastpath.cpp: param
        identities and stamps, grad presence/dtype/shape/contiguity, no main_grad, state dicts
        unchanged)."""
        if torch.compiler.is_compiling() or _ops.capturing():
            return None
        fc = self._fast
        if fc is None or not (self._mpkern_step_cache and self._mpkern_check_writes):
            return None
        groups = self.param_groups
        ok = (groups is fc.groups_list and len(groups) == len(fc.groups) and self.state is fc.state
              and self._versions is fc.versions and self._mpkern_process_group is None)
        if ok:
            for group, (g0, plist, flags) in zip(groups, fc.groups):
                if group is not g0 or group["params"] is not plist or _cache_flags(group) != flags:
                    ok = False
                    break
        if not ok or _backend.select(fc.device) != fc.backend or not fc.cache.refresh():
            self._fast = None
            self._fast_misses += 1
            return None
        self._fast_misses = 0
        return fc

    def _fast_step(self, fc: _StepCache) -> None:
        """``step()`` over the cached lists: the same scalars and kernels as the full path (the
        statistics pass and the fused update called directly from C++ with the cached lists)."""
        dev = fc.device
        self._storage_count = None
        lrs = [_ops.lr_args(group["lr"], dev) for group, _ps in fc.buckets]

        def stats(inv: Tensor) -> None:
            amp._unscale_cached(self, inv, self.max_grad_norm, dev, fc.cache.grad_stats)

        factor, found = self._step_factor(dev, stats if self.max_grad_norm is not None else None)
        f_dev = _to_device(factor, dev, torch.float32).reshape(())
        found_dev = _to_device(found, dev, torch.float32).reshape(())
        versions = self._versions
        for bi, ((group, ps), (lr_tensor, lr_value)) in enumerate(zip(fc.buckets, lrs)):
            beta1, beta2 = group["betas"]
            fc.cache.adamw(bi, f_dev, found_dev, lr_tensor, lr_value, float(beta1), float(beta2), float(group["eps"]),
                           float(group["weight_decay"]), bool(group["maximize"]), bool(group["stochastic_rounding"]),
                           int(group["seed"]))
            p0 = ps[0]
            if versions.get(id(p0)) != _stamp(p0):  # as in the full path (a kernel that bumps versions)
                for p in ps:
                    versions[id(p)] = _stamp(p)
                self._fast = None

    def _step_factor(self, dev: torch.device, stats: Callable[[Tensor], None] | None) -> tuple[Tensor, Tensor]:
        """(grad factor, found_inf) of this step, for the full and the cached path alike.

        Takes the pending unscale/clip (or GradScaler's ``grad_scale``: its reciprocal in fp64 like
        GradScaler; else the cached constant 1 on ``dev``), runs ``stats(inv)`` -- the statistics
        pass that leaves a pending clip -- when there was none and it is given, applies
        ``max_grad_norm`` to a pending one, folds in GradScaler's ``found_inf``; records
        ``last_grad_norm`` / ``last_found_inf``."""
        grad_scale = getattr(self, "grad_scale", None)  # set by GradScaler.step (amp-scaling protocol)
        found_ext = getattr(self, "found_inf", None)
        pending, self._pending = self._pending, None
        if pending is None:
            inv = (grad_scale.double().reciprocal().float().reshape(()) if grad_scale is not None
                   else _ops.scalar_on(1.0, dev))
            if stats is not None:
                stats(inv)
                pending, self._pending = self._pending, None
        elif self.max_grad_norm is not None:
            pending = self._own_clip(pending)
        if pending is not None:
            factor, found = pending.inv * pending.coef, pending.found
            self.last_grad_norm = pending.reported
        else:
            factor = inv
            found = torch.zeros((), dtype=torch.float32, device=factor.device)
        if found_ext is not None:
            found = torch.maximum(found, _to_device(found_ext, found.device, torch.float32).reshape(()))
        self.last_found_inf = found
        return factor, found

    def _restamp_after_compiled(self) -> None:
        """The first eager step after compiled ones takes the params as this optimizer wrote them
        (writes between compiled steps are not seen, as documented): their stamps moved with the
        compiled step's own writes, and taking them for external writes would reset remainders and
        8-bit corrections. A "just loaded" mark is kept."""
        self._live["traced"] = False
        versions = self._versions
        for p in self.state:
            if isinstance(p, Tensor) and versions.get(id(p), -1) is not writes.LOADED:
                versions[id(p)] = _stamp(p)

    def _prepare(self, group: dict[str, Any], kind: storage.MasterKind, pairs: list[tuple[Tensor, Tensor, int]],
                 check_writes: bool):
        """Kernel argument lists for one bucket: flat views of dense params/grads/state, and each
        param's random stream (id, offset of its local shard in the whole tensor)."""
        params, grads, ms, vs, vmaxs, masters, steps = [], [], [], [], [], [], []
        sids, offsets = [], []
        copies: list[tuple[Tensor, Tensor]] = []
        amsgrad = group["amsgrad"]
        mkey = kind.key
        moments = moment_kind(group["state_dtype"])
        scaled: bool | None = None  # whether this kind's kernel tensors carry scales (from the first)
        mscales: list[Tensor] = []
        vscales: list[Tensor] = []
        versions = self._versions
        for p, g, sid in pairs:
            sids.append(sid)
            st = self.state.get(p)
            if st is None or "step" not in st:
                st = self._init_state(group, p)
                if check_writes:
                    versions[id(p)] = _stamp(p)
            elif check_writes and versions.get(id(p), -1) != (
                    (p._version, p.data_ptr()) if type(p) is Parameter else _stamp(p)):
                self._conform(kind, p, st)  # written or replaced: records the stamp
            elif mkey not in st if mkey is not None else storage.stored_kinds(st):
                self._conform(kind, p, st)  # a converted checkpoint or a new param dtype
            if amsgrad and "max_exp_avg_sq" not in st:
                st["max_exp_avg_sq"] = _like(p, torch.float32).zero_()
            m, v, m_scale, v_scale = moments.kernel_tensors(st)
            if scaled is None:
                scaled = m_scale is not None
            if scaled:
                mscales.append(m_scale)
                vscales.append(v_scale)
            ts = [m, v]
            if amsgrad:
                ts.append(st["max_exp_avg_sq"])
            if mkey is not None:
                ts.append(st[mkey])
            if type(p) is not Parameter and distributed.is_dtensor(p):
                # FSDP2 / tensor parallel: the kernel updates the local shard, drawing the random
                # bits the whole tensor would draw at its elements
                off = self._offsets.get(id(p))
                if off is None:
                    off = self._offsets[id(p)] = distributed.shard_offset(p)
                offsets.append(off)
                p, g, ts = _local(p), _local(g), [_local(t) for t in ts]
            else:
                offsets.append(0)
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
        return (params, grads, ms, vs, vmaxs, masters, steps, sids, offsets,
                (mscales, vscales) if scaled else None), copies

    @staticmethod
    def _consume_main_grads(work) -> None:
        """Set every ``main_grad`` that fed this step to None -- or, inside a CUDA graph capture,
        zero it in place (a replay must find the same buffers, and the zeroing is captured)."""
        mains = [p for _group, _dev, _mode, pairs in work for p, *_ in pairs
                 if getattr(p, "main_grad", None) is not None]
        if not mains:
            return
        if _ops.capturing():
            torch._foreach_zero_([p.main_grad for p in mains])
            return
        for p in mains:
            p.main_grad = None

    # ---- checkpoints --------------------------------------------------------------------------
    @torch.no_grad()
    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.Optimizer.state_dict()``: every storage kind in its compact form (checkpoint bytes
        = state bytes, and a resume continues bit-identically), except 8-bit moments of DTensor params
        (FSDP2, tensor parallel): their scales belong to the local shard's buffer and cannot be
        resharded, so they are saved dequantized as fp32 DTensors ``exp_avg`` / ``exp_avg_sq`` (what
        ``torch.distributed.checkpoint`` reshards) and quantized again when loaded (to the nearest
        code of the new shard's groups: each value within half a code step, at most 0.8 % of its
        group's largest magnitude, of the saved one)."""
        sd = super().state_dict()
        for group, saved in zip(self.param_groups, sd["param_groups"]):
            for p, i in zip(group["params"], saved["params"]):
                st = sd["state"].get(i)
                if st is not None:
                    sd["state"][i] = storage.export_state(p, st)  # a new dict if it differs
        return sd

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
            note = storage.moment_kind(g["state_dtype"]).adamw_conversion
            if "state_dtype" not in ng and note and any(
                    "exp_avg" in state_dict["state"].get(k, {}) for k in ng["params"]):
                converted.append(f"group {gi}: torch.optim.AdamW moments -> state_dtype={g['state_dtype']!r} ({note})")
            ng["params"] = g["params"]
            if "param_names" in g and "param_names" not in ng:
                ng["param_names"] = g["param_names"]
            for key in _OWN_KEYS:
                ng.setdefault(key, g[key])  # a plain AdamW checkpoint has none of them
            if isinstance(ng["state_dtype"], torch.dtype):  # saved by an older mpkern
                ng["state_dtype"] = storage.MOMENT_DTYPE_NAMES.get(ng["state_dtype"], ng["state_dtype"])
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
                state[p] = state_from_checkpoint(p, v, group_of[id(p)], self._kind(group_of[id(p)], p))
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


class _StepCache(NamedTuple):
    """What ``FusedAdamWMP._fast_refresh`` checks besides the C++ cache (``cache``,
    ``mpkern._C.StepCache``): the objects the cached lists were built from."""

    cache: Any
    groups_list: list
    groups: list  # (group dict, its params list, _cache_flags(group))
    state: Any
    versions: dict
    device: torch.device
    backend: str
    buckets: list  # (group, its params) per cached bucket, in kernel order


def _cache_flags(group: dict[str, Any]) -> tuple:
    """The group settings that decide its buckets and state tensors (a change takes the full path)."""
    return (group["amsgrad"], group["master_weights"], group["state_dtype"], group["stochastic_rounding"])


def _check_own_args(master_weights: Any, state_dtype: Any, max_grad_norm: Any, stochastic_rounding: Any) -> str:
    """Validate mpkern's own arguments; return ``state_dtype`` as the name kept in the groups."""
    master = storage.check_master_weights(master_weights)
    name = storage.check_state_dtype(state_dtype)
    if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))
                                      or not (max_grad_norm > 0 and math.isfinite(max_grad_norm))):
        raise ValueError(f"max_grad_norm must be a positive finite float or None, got {max_grad_norm!r}")
    if stochastic_rounding and not master.stochastic_rounding:
        raise ValueError("stochastic_rounding applies to 16-bit params without master weights: "
                         "use it with master_weights=False")
    return name


def _check_amsgrad(amsgrad: Any, state_dtype: str, where: str) -> None:
    storage.check_amsgrad(amsgrad, state_dtype, where)


def _check_param_dtype(group: dict[str, Any], dtype: torch.dtype, where: str) -> None:
    """Raise if a param of ``dtype`` cannot be stepped by ``group``'s storage mode."""
    storage.MASTER_KINDS[group["master_weights"]].check_param_dtype(dtype, where)
    if group["stochastic_rounding"] and dtype == torch.float16:
        raise ValueError(f"FusedAdamWMP: stochastic_rounding supports bfloat16 params, {where} is float16")


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
