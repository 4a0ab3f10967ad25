"""Saved per-param state -> ``FusedAdamWMP`` state: ours in any storage kind, or ``torch.optim.AdamW``'s."""

from __future__ import annotations

from typing import Any

import torch

from . import storage

Tensor = torch.Tensor


@torch.no_grad()
def state_from_checkpoint(p: Tensor, src: Any, group: dict[str, Any], kind: storage.MasterKind) -> dict[str, Any]:
    """Our per-param state for ``p`` (master kind ``kind``, moments of ``group["state_dtype"]``)
    from a saved one.

    Every tensor is copied into ``p``'s device and layout; ``step`` becomes a 0-dim fp32 tensor;
    moments take the group's moment kind (8-bit moments saved as such are taken as saved; other
    moments are quantized to the nearest code, and 8-bit ones dequantized for a dense kind, through
    fp32); a master of ``kind`` is taken as saved. A master of
    another kind is converted through the fp32 master it describes with the param as it is now,
    and the saved one is kept beside it until the next step converts it again from the param as
    it is then (the model may be loaded after the optimizer: either order gives the same master).
    No saved master (a plain AdamW checkpoint): the param is the master. Unknown entries are
    cast like ``torch.optim.Optimizer`` does (floating tensors to the param's dtype).
    """
    if not isinstance(src, dict):
        raise ValueError(f"FusedAdamWMP.load_state_dict: per-param state must be a dict, got {type(src).__name__}")
    src = dict(src)
    dev = p.device
    st: dict[str, Any] = {}
    if "step" in src:
        st["step"] = torch.as_tensor(src.pop("step"), dtype=torch.float32).reshape(()).to(dev).clone()
    else:
        st["step"] = torch.zeros((), dtype=torch.float32, device=dev)
    st.update(storage.moments_from_saved(p, src, group["state_dtype"]))
    for key in storage.moment_state_keys():
        src.pop(key, None)
    vm = src.pop("max_exp_avg_sq", None)
    if vm is not None:
        st["max_exp_avg_sq"] = storage.laid(p, vm, torch.float32)
    elif group["amsgrad"]:
        st["max_exp_avg_sq"] = storage.like(p, torch.float32).zero_()
    saved = {k: storage.laid(p, src.pop(k.key), k.state_dtype) for k in storage.STORED_MASTERS if k.key in src}
    if kind.key is None:
        if saved and p.dtype != torch.float32:  # no master kept: the param takes the saved master, rounded
            source, tmp = next(iter(saved.items()))
            p.copy_(source.to_fp32(p, {source.key: tmp}))
    elif kind in saved:
        st[kind.key] = saved[kind]
    elif saved and all(k.describes(p.dtype) for k in saved):
        source, tmp = next(iter(saved.items()))
        st[source.key] = tmp  # kept: converted again at the next step, from the param as it is then
        kind.from_fp32(p, st, source.to_fp32(p, st), write_param=False)
    else:
        st.update(kind.create(p))
    for key, val in src.items():  # entries we do not know: like torch.optim.Optimizer
        if isinstance(val, Tensor):
            val = val.to(device=dev, dtype=p.dtype) if p.is_floating_point() and val.is_floating_point() else \
                val.to(device=dev)
        st[key] = val
    return st


__all__ = ["state_from_checkpoint"]
