"""``FusedAdamWMP``: a drop-in ``torch.optim.AdamW`` for fp16/bf16 models with fp32 master weights.

One fused multi-tensor kernel per (param group, device, master mode) reads the 16-bit grad (or the
fp32 ``main_grad``), multiplies it by ``inv_scale * clip_coef`` in registers, updates the fp32
master (or bf16 param + int16 remainder), ``exp_avg``, ``exp_avg_sq`` and writes the rounded
16-bit param -- 28 B/param for bf16 params with fp32 master and moments. Grads are never
written. Loss-scale, clip coefficient, found_inf, step counters (and lr when it is a tensor) stay
on the device: ``step()`` never synchronises with the host.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from . import _backend, _ops, amp
from .amp import _grad_of
from .reference import MASTER_F32, MASTER_NONE, MASTER_REMAINDER

Tensor = torch.Tensor
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class FusedAdamWMP(torch.optim.Optimizer):
    """AdamW with fp32 master weights for 16-bit params, fused into one kernel per group and device.

    Args:
        params: parameters or param groups, as for ``torch.optim.AdamW``.
        lr, betas, eps, weight_decay, amsgrad, maximize: exactly as ``torch.optim.AdamW``
            (``lr`` may be a float or a one-element tensor).
        max_grad_norm: clip the global grad norm to this value inside ``step()`` (a read-only
            statistics pre-pass, the coefficient applied in the update). A non-finite grad found
            by that pass skips the step like a GradScaler overflow.
        master_weights: ``True`` (fp32 master in state), ``"remainder"`` (bf16 params only: an int16
            remainder so that param + remainder is the exact fp32 master) or ``False`` (update the
            16-bit params directly).
        state_dtype: dtype of ``exp_avg``/``exp_avg_sq``: ``torch.float32`` or ``torch.bfloat16``.
        stochastic_rounding: with ``master_weights=False`` and bf16 params, round the updated
            params stochastically (unbiased) instead of to nearest.
        capturable: keep every per-step scalar on the device (lr as a tensor if you pass one).
        seed: seed of the stochastic-rounding bit stream.

    Overflow: ``_step_supports_amp_scaling = True`` -- ``GradScaler.step`` hands over ``grad_scale``
    and ``found_inf``; when found_inf is set nothing changes (params, masters, moments, steps).
    ``mpkern.unscale_(opt, ...)`` does not touch the grads: its factor (inv_scale * clip_coef) is
    applied in the next ``step()``; a second call before that step replaces the first, and
    ``zero_grad()`` drops it.
    """

    _step_supports_amp_scaling = True
    _mpkern_fuses_unscale = True

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        amsgrad: bool = False,
        maximize: bool = False,
        max_grad_norm: float | None = None,
        master_weights: bool | str = True,
        state_dtype: torch.dtype = torch.float32,
        stochastic_rounding: bool = False,
        capturable: bool = False,
        seed: int = 0,
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
        if master_weights not in (True, False, "remainder"):
            raise ValueError(f"master_weights must be True, False or 'remainder', got {master_weights!r}")
        if state_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"state_dtype must be torch.float32 or torch.bfloat16, got {state_dtype}")
        if max_grad_norm is not None and not (max_grad_norm > 0 and math.isfinite(max_grad_norm)):
            raise ValueError(f"max_grad_norm must be a positive finite float or None, got {max_grad_norm!r}")
        if stochastic_rounding and master_weights is not False:
            raise ValueError("stochastic_rounding applies to 16-bit params without master weights: "
                             "use it with master_weights=False")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        master_weights=master_weights, state_dtype=state_dtype,
                        stochastic_rounding=stochastic_rounding, capturable=capturable)
        self.max_grad_norm = max_grad_norm
        self.seed = int(seed)
        self._pending: tuple[Tensor, Tensor, Tensor] | None = None
        self.last_grad_norm: Tensor | None = None
        self.last_found_inf: Tensor | None = None
        super().__init__(params, defaults)

    # ---- param groups -------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for i, p in enumerate(group["params"]):
            if p.is_complex():
                raise ValueError(f"FusedAdamWMP: param {i} of group {len(self.param_groups) - 1} is complex; "
                                 "complex params are not supported")
            if p.dtype not in _FLOATS:
                raise TypeError(f"FusedAdamWMP: param {i} has dtype {p.dtype}; expected float32, float16 or bfloat16")
            if group["master_weights"] == "remainder" and p.dtype not in (torch.bfloat16, torch.float32):
                raise ValueError(f"FusedAdamWMP: master_weights='remainder' needs bfloat16 params, param {i} is "
                                 f"{p.dtype}")
            if group["stochastic_rounding"] and p.dtype == torch.float16:
                raise ValueError(f"FusedAdamWMP: stochastic_rounding supports bfloat16 params, param {i} is float16")

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
        state["exp_avg"] = torch.zeros_like(p, dtype=sdt, memory_format=torch.contiguous_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=sdt, memory_format=torch.contiguous_format)
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        mode = self._mode(group, p)
        if mode == MASTER_F32:
            state["master_param"] = p.detach().to(torch.float32, memory_format=torch.contiguous_format).clone()
        elif mode == MASTER_REMAINDER:
            state["master_remainder"] = torch.zeros_like(p, dtype=torch.int16, memory_format=torch.contiguous_format)
        return state

    # ---- the unscale_/clip hand-off -----------------------------------------------------------
    def _mpkern_set_pending_unscale(self, factor: Tensor, found_inf: Tensor, total_norm: Tensor) -> None:
        """Called by :func:`mpkern.unscale_`: apply ``factor`` to the grads in the next step."""
        self._pending = (factor, found_inf, total_norm)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the grads' global norm in the next ``step()`` (grads are not modified); return the norm.

        For fp16 with a GradScaler use ``mpkern.unscale_(opt, scaler=scaler, max_norm=...)`` instead:
        this method sees the grads as they are (scaled, if a scaler scaled the loss).
        """
        res = amp.unscale_(self, 1.0, max_norm=max_norm, norm_type=norm_type)
        return res.total_norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Like ``Optimizer.zero_grad``; also zeroes ``p.main_grad`` buffers (kept allocated) and
        drops a factor left by ``mpkern.unscale_`` / ``clip_grad_norm_`` for the discarded grads."""
        super().zero_grad(set_to_none=set_to_none)
        self._pending = None
        mains = [p.main_grad for g in self.param_groups for p in g["params"]
                 if getattr(p, "main_grad", None) is not None]
        if mains:
            torch._foreach_zero_(mains)

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
                        and g.shape == p.shape and g.device == p.device and p.is_contiguous()):
                    self._raise_bad_grad(f"group {gi} param {pi}", p, g)
                buckets.setdefault((p.device, self._mode(group, p)), []).append((p, g))
            for (dev, mode), pairs in buckets.items():
                work.append((group, dev, mode, pairs))
        for dev in {w[1] for w in work}:
            _backend.select(dev)
        return work

    @staticmethod
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
            raise ValueError(f"FusedAdamWMP: gradient of {where} has shape {tuple(g.shape)}, param has "
                             f"{tuple(p.shape)}")
        if g.device != p.device:
            raise ValueError(f"FusedAdamWMP: gradient of {where} is on {g.device}, param on {p.device}")
        raise ValueError(f"FusedAdamWMP: {where} is not contiguous; the fused kernel updates params in place "
                         "as flat buffers")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One AdamW step over all param groups (skipped bitwise when an overflow was found)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = self._collect()
        pending, self._pending = self._pending, None
        grad_scale = getattr(self, "grad_scale", None)  # set by GradScaler.step (amp-scaling protocol)
        found_ext = getattr(self, "found_inf", None)
        if not work:
            return loss
        out_dev = work[0][1]
        if pending is None and self.max_grad_norm is not None:
            inv = (grad_scale.double().reciprocal().float() if grad_scale is not None
                   else torch.ones((), dtype=torch.float32, device=out_dev))
            amp.unscale_(self, inv, max_norm=self.max_grad_norm)
            pending, self._pending = self._pending, None
        if pending is not None:
            factor, found, total_norm = pending
            self.last_grad_norm = total_norm
        else:
            factor = (grad_scale.double().reciprocal().float().reshape(()) if grad_scale is not None
                      else torch.ones((), dtype=torch.float32, device=out_dev))
            found = torch.zeros((), dtype=torch.float32, device=factor.device)
        if found_ext is not None:
            found = torch.maximum(found, found_ext.to(found.device, torch.float32).reshape(()))
        self.last_found_inf = found
        per_dev: dict[torch.device, tuple[Tensor, Tensor]] = {}
        for group, dev, mode, pairs in work:
            if dev not in per_dev:
                per_dev[dev] = (factor.to(dev, torch.float32, non_blocking=True).reshape(()),
                                found.to(dev, torch.float32, non_blocking=True).reshape(()))
            f_dev, found_dev = per_dev[dev]
            params, grads, ms, vs, vmaxs, masters, steps = [], [], [], [], [], [], []
            for p, g in pairs:
                st = self._init_state(group, p)
                params.append(p)
                grads.append(g if g.is_contiguous() else g.contiguous())
                ms.append(st["exp_avg"])
                vs.append(st["exp_avg_sq"])
                steps.append(st["step"])
                if group["amsgrad"]:
                    vmaxs.append(st["max_exp_avg_sq"])
                if mode == MASTER_F32:
                    masters.append(st["master_param"])
                elif mode == MASTER_REMAINDER:
                    masters.append(st["master_remainder"])
            lr = group["lr"]
            lr_tensor = lr.to(dev, torch.float32).reshape(()) if isinstance(lr, Tensor) else None
            beta1, beta2 = group["betas"]
            _ops.adamw_step_(
                _backend.select(dev), params, grads, ms, vs, vmaxs, masters, steps, f_dev, found_dev, lr_tensor,
                float(lr) if lr_tensor is None else 0.0, float(beta1), float(beta2), float(group["eps"]),
                float(group["weight_decay"]), bool(group["maximize"]), mode, bool(group["stochastic_rounding"]),
                self.seed)
        return loss

    # ---- checkpoints --------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load our own or a plain ``torch.optim.AdamW`` state dict, keeping our state dtypes.

        From an AdamW checkpoint, fp32 masters are taken from the (16-bit) params and remainders
        start at zero; moments keep full precision (the base class would cast them to the param
        dtype).
        """
        saved = {k: dict(v) for k, v in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for key, val in self.defaults.items():
                group.setdefault(key, val)
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                src = saved.get(index)
                index += 1
                if src is None:
                    continue
                st: dict[str, Any] = {}
                st["step"] = torch.as_tensor(src["step"], dtype=torch.float32).reshape(()).to(p.device).clone()
                for key in ("exp_avg", "exp_avg_sq"):
                    st[key] = src[key].to(p.device, group["state_dtype"]).contiguous().clone()
                if group["amsgrad"]:
                    vm = src.get("max_exp_avg_sq")
                    st["max_exp_avg_sq"] = (vm.to(p.device, torch.float32).contiguous().clone() if vm is not None
                                            else torch.zeros_like(p, dtype=torch.float32))
                mode = self._mode(group, p)
                if mode == MASTER_F32:
                    mp = src.get("master_param")
                    st["master_param"] = (mp.to(p.device, torch.float32).contiguous().clone() if mp is not None
                                          else p.detach().float().contiguous().clone())
                elif mode == MASTER_REMAINDER:
                    rem = src.get("master_remainder")
                    mp = src.get("master_param")
                    if rem is not None:
                        st["master_remainder"] = rem.to(p.device, torch.int16).contiguous().clone()
                    elif mp is not None:  # fp32 master -> bf16 param + remainder, exactly
                        u = mp.to(p.device, torch.float32).contiguous().view(torch.int32)
                        p.copy_((((u + 0x8000) >> 16) & 0xFFFF).to(torch.int16).view(torch.bfloat16))
                        st["master_remainder"] = (u & 0xFFFF).to(torch.int16)
                    else:
                        st["master_remainder"] = torch.zeros_like(p, dtype=torch.int16)
                self.state[p] = st
