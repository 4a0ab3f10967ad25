"""Writes to the params by someone other than the optimizer, and how the state follows them.

The optimizer records a *stamp* of every param after its own writes (version counter and data
pointer: host-side integers, no sync). A param whose stamp changed was written or replaced
(``load_state_dict``, ``fill_``, ``copy_``, ``p.data = t``, ``model.to(memory_format=...)``,
``model.to(dtype)``); :func:`conform` then makes its state fit the param as it is now. In-place
writes through a ``.data`` alias change neither number and are not seen
(``FusedAdamWMP.resync_masters`` is the explicit way).

In detail, when a param was written or replaced by someone else since the optimizer's last
write (``model.load_state_dict``, ``fill_``, ``copy_``, re-initialisation,
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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import distributed
from . import storage

Tensor = torch.Tensor

#: a recorded stamp meaning "loaded from a checkpoint since the last step"
LOADED = None


@torch.no_grad()
def conform(kind: storage.MasterKind, p: Tensor, st: dict[str, Any], *, recorded: Any,
            shared: Callable[[], bool]) -> None:
    """Make the state ``st`` of ``p`` fit the param as it is now, for master kind ``kind``.

    * shape changed: ``ValueError`` (nothing can be carried over);
    * layout or device changed: every state tensor is re-laid like the param, values kept by
      index (the kernel pairs flat buffers by memory position, so they must share its strides);
    * master state of another kind (a converted checkpoint, kept until now so that model and
      optimizer may be loaded in either order; or the param's dtype changed): turned into this
      kind through the fp32 master it describes with the param as it is now;
    * a param without master state (fp32 -> bf16 by ``model.to``): the param is the master;
    * ``kind`` is "none" and the param is fp32 now (``model.float()`` after steps): the old
      master restores the param's low bits where the param still is its rounding;
    * otherwise the kind re-seeds itself from the written param (:meth:`MasterKind.reseed`); a
      move to another layout or device counts as a load (the values are the same: remainders and
      corrections are kept).
    ``recorded`` is the stamp recorded at the optimizer's last write (:data:`LOADED` after a
    checkpoint load); ``shared()`` says whether ``p`` shares its storage with other params.
    """
    ref = storage.moment_reference(st)
    if isinstance(ref, Tensor) and tuple(ref.shape) != tuple(p.shape):
        raise ValueError(f"FusedAdamWMP: a param now has shape {tuple(p.shape)}, its optimizer state "
                         f"{tuple(ref.shape)} (it was replaced by a tensor of another shape after the first "
                         "step); rebuild the optimizer or load a matching state dict")
    moved = storage.relay_moments(p, st)  # e.g. 8-bit moments regroup in the new memory order
    if not distributed.is_dtensor(p):
        for key, t in list(st.items()):
            if key == "step" or not isinstance(t, Tensor) or t.shape != p.shape:
                continue
            want = storage.like(p, t.dtype)
            if want.device != t.device or want.stride() != t.stride():
                st[key] = want.copy_(t)
                moved = True
    others = storage.stored_kinds(st, but=kind)
    if kind.key is None:  # no master kept: an fp32 param takes the old master's value
        if p.dtype == torch.float32 and others:
            others[0].restore_param(p, st)
        for k in others:
            k.drop(st)
    elif others:
        master = others[0].to_fp32(p, st)
        for k in others:
            k.drop(st)
        kind.from_fp32(p, st, master)
    elif not kind.has_state(st):
        st.update(kind.create(p))
    else:
        # a move to another layout or device (model.to(memory_format=...), .to(device)) keeps the
        # values: its remainders / corrections are kept like after a load
        kind.reseed(p, st, loaded=recorded is LOADED or moved,
                    shared=shared() if recorded is not LOADED and not moved else False)


@torch.no_grad()
def resync(rt: Any, groups: list[dict[str, Any]], state: Any, params: Any) -> None:
    """``FusedAdamWMP.resync_masters``: conform the state of ``params`` (None: all) as if written
    (``rt``: the optimizer's :class:`~.runtime.Runtime`)."""
    wanted = None if params is None else {id(p) for p in ([params] if isinstance(params, Tensor) else params)}
    rt.reset_storage_count()
    for group in groups:
        for p in group["params"]:
            st = state.get(p)
            if st and "step" in st and (wanted is None or id(p) in wanted):
                rt.versions[id(p)] = -1  # "written"
                rt.conform(storage.master_kind(group["master_weights"], p.dtype), p, st, groups)


__all__ = ["LOADED", "conform", "resync"]
