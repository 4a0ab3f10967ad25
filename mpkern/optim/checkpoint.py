"""Checkpoints of ``FusedAdamWMP``: load (ours in any storage kind, or ``torch.optim.AdamW``'s),
export (``state_dict``, ``adamw_state_dict``, ``master_params``) and pickling.

The storage kinds say how each of their states converts (:mod:`.storage`); this module is the
plumbing around them: the ``Optimizer.load_state_dict`` sequence, group keys, warnings.
"""

from __future__ import annotations

import itertools
import uuid
import warnings
import weakref
from itertools import chain
from typing import TYPE_CHECKING, Any

import torch

from . import storage, writes
from .runtime import LIVE_KEYS, stamp

if TYPE_CHECKING:
    from typing_extensions import TypeIs

Tensor = torch.Tensor
# mpkern's own param-group keys; the storage-layout ones are the constructor's choice even when a
# checkpoint says otherwise (the state is converted, with a warning)
OWN_KEYS = ("max_grad_norm", "master_weights", "state_dtype", "stochastic_rounding", "seed")
LAYOUT_KEYS = ("master_weights", "state_dtype")


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
    saved: dict[storage.MasterKind, Tensor] = {}
    for k in storage.STORED_MASTERS:
        if k.key in src:
            # a stored master kind has a state key (register_master_kind) and a state tensor dtype
            assert k.key is not None and k.state_dtype is not None, f"master kind {k!r} stores no tensor"
            saved[k] = storage.laid(p, src.pop(k.key), k.state_dtype)
    if kind.key is None:
        if saved and p.dtype != torch.float32:  # no master kept: the param takes the saved master, rounded
            source, tmp = next(iter(saved.items()))
            assert source.key is not None  # a stored master kind (above)
            p.copy_(source.to_fp32(p, {source.key: tmp}))
    elif kind in saved:
        st[kind.key] = saved[kind]
    elif saved and all(k.describes(p.dtype) for k in saved):
        source, tmp = next(iter(saved.items()))
        assert source.key is not None  # a stored master kind (above)
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


def _same_structure(saved_groups: Any, groups: list[dict[str, Any]]) -> TypeIs[list[dict[str, Any]]]:
    """Whether ``saved_groups`` has this optimizer's number of groups with its group sizes (what
    ``torch.optim.Optimizer.load_state_dict`` validates; when not, it raises, with its own message)."""
    return (isinstance(saved_groups, list) and len(saved_groups) == len(groups)
            and all(isinstance(s, dict) and len(s.get("params", ())) == len(g["params"])
                    for g, s in zip(groups, saved_groups)))


def _merge_groups(groups: list[dict[str, Any]], saved_groups: list[dict[str, Any]], state: dict[Any, Any]
                  ) -> tuple[list[dict[str, Any]], list[str]]:
    """Copies of the saved groups with mpkern's keys filled in (a plain AdamW checkpoint has none) and this
    optimizer's storage layout; and what was converted (for the warning). ``params`` stay the saved ids:
    ``torch.optim.Optimizer.load_state_dict`` maps them to this optimizer's params."""
    merged, converted = [], []
    for gi, (g, saved) in enumerate(zip(groups, saved_groups)):
        ng = dict(saved)
        note = storage.moment_kind(g["state_dtype"]).adamw_conversion
        if "state_dtype" not in ng and note and any("exp_avg" in state.get(k, {}) for k in ng["params"]):
            converted.append(f"group {gi}: torch.optim.AdamW moments -> state_dtype={g['state_dtype']!r} ({note})")
        for key in OWN_KEYS:
            ng.setdefault(key, g[key])
        if isinstance(ng["state_dtype"], torch.dtype):  # saved by an older mpkern
            ng["state_dtype"] = storage.MOMENT_DTYPE_NAMES.get(ng["state_dtype"], ng["state_dtype"])
        for key in LAYOUT_KEYS:
            if ng[key] != g[key]:
                converted.append(f"group {gi}: {key}={ng[key]!r} -> {g[key]!r}")
                ng[key] = g[key]
        merged.append(ng)
    return merged, converted


class _Load:
    """The two hooks :func:`load` puts around ``torch.optim.Optimizer.load_state_dict`` for one call.

    :meth:`before` runs after every load pre-hook of the user (their edits count): it converts each
    param's saved state into this optimizer's storage layout (:func:`state_from_checkpoint`), keeps it
    here, and hands the base class an empty dict in its place -- so the base never casts a master or a
    coded moment to the param's dtype -- and the saved groups with mpkern's keys. A conversion that
    fails raises here, before the base has changed anything. :meth:`after` runs before every load
    post-hook of the user (they see the loaded state): it puts the converted state in.
    """

    def __init__(self, rt: Any) -> None:
        self.rt = rt
        self.converted: list[str] = []
        self.states: list[tuple[Tensor, dict[str, Any]]] = []

    def before(self, opt: Any, state_dict: dict[str, Any]) -> dict[str, Any] | None:
        groups = opt.param_groups
        saved_groups = state_dict.get("param_groups")
        saved_state = state_dict.get("state")
        if not isinstance(saved_state, dict) or not _same_structure(saved_groups, groups):
            return None  # the base class's validation raises (or loads it like any Optimizer does)
        merged, self.converted = _merge_groups(groups, saved_groups, saved_state)
        group_of = {}
        for g, ng in zip(groups, merged):
            for sid, p in zip(ng["params"], g["params"]):
                group_of[sid] = (p, ng)
        placeholders: dict[Any, Any] = {}
        for sid, saved in saved_state.items():
            if sid in group_of:
                p, ng = group_of[sid]
                self.states.append((p, state_from_checkpoint(p, saved, ng, storage.master_kind(ng["master_weights"],
                                                                                              p.dtype))))
                placeholders[sid] = {}
            else:
                placeholders[sid] = saved  # not a param's: kept as it is, like the base class does
        return {**state_dict, "state": placeholders, "param_groups": merged}

    def after(self, opt: Any) -> None:
        for p, st in self.states:
            opt.state[p] = st
        # a master loaded here is checked against its param at the next step (elementwise, on the
        # device), whichever of model and optimizer was loaded first
        self.rt.mark_loaded(opt.state)


def load(opt: Any, state_dict: dict[str, Any], rt: Any) -> None:
    """``FusedAdamWMP.load_state_dict``: ``torch.optim.Optimizer.load_state_dict`` itself, with two hooks.

    The base class runs as it is -- the user's load pre-hooks, its validation, the strict mapping of
    the saved ids to this optimizer's params, the groups, ``__setstate__``, the user's post-hooks --
    with :class:`_Load`'s pre-hook last and its post-hook first. What the base would do wrong for us,
    cast every floating state tensor to the param's dtype (an fp32 master to bf16), it never gets to
    do: the per-param state is converted by the pre-hook instead. So moments keep ``state_dtype`` and
    masters stay fp32; an AdamW checkpoint's masters are taken from the params (remainders start at
    zero); the storage layout (``master_weights``, ``state_dtype``) is this optimizer's, and a
    checkpoint saved with another layout is converted exactly (with a warning).
    """
    hooks = _Load(rt)
    pre = opt.register_load_state_dict_pre_hook(hooks.before)
    post = opt.register_load_state_dict_post_hook(hooks.after, prepend=True)
    try:
        torch.optim.Optimizer.load_state_dict(opt, state_dict)
    finally:
        pre.remove()
        post.remove()
    if hooks.converted:
        # stacklevel: this function, FusedAdamWMP.load_state_dict, its torch.compiler.disable wrapper, the caller
        warnings.warn("FusedAdamWMP.load_state_dict: the checkpoint's state layout differs from this optimizer's; "
                      "converted (" + "; ".join(hooks.converted) + ")", UserWarning, stacklevel=4)


def export(groups: list[dict[str, Any]], sd: dict[str, Any]) -> dict[str, Any]:
    """``Optimizer.state_dict()``'s result ``sd`` with each state as its storage kind saves it
    (:func:`mpkern.optim.storage.export_state`: new dicts; the optimizer's own state is untouched)."""
    for group, saved in zip(groups, sd["param_groups"]):
        for p, i in zip(group["params"], saved["params"]):
            st = sd["state"].get(i)
            if st is not None:
                sd["state"][i] = storage.export_state(p, st)
    return sd


@torch.no_grad()
def adamw_state_dict(opt: Any) -> dict[str, Any]:
    """``FusedAdamWMP.adamw_state_dict`` (see there): fp32 moments, AdamW's group keys."""
    sd = opt.state_dict()
    groups = []
    for g in sd["param_groups"]:
        ng = {k: v for k, v in g.items() if k not in OWN_KEYS}
        for key, val in (("foreach", None), ("differentiable", False), ("fused", None),
                         ("decoupled_weight_decay", True)):
            ng.setdefault(key, val)
        groups.append(ng)
    state = {}
    for i, st in sd["state"].items():
        out = {"step": torch.as_tensor(st["step"], dtype=torch.float32).detach().clone()}
        for key in ("exp_avg", "exp_avg_sq"):
            moment = storage.moments_fp32(st, key)
            if moment is not None:
                out[key] = moment.detach()
        if "max_exp_avg_sq" in st:
            out["max_exp_avg_sq"] = st["max_exp_avg_sq"].detach().to(torch.float32).clone()
        state[i] = out
    return {"state": state, "param_groups": groups}


def master_params(rt: Any, groups: list[dict[str, Any]], state: Any) -> list[Tensor]:
    """``FusedAdamWMP.master_params`` (see there; ``rt``: the optimizer's :class:`~.runtime.Runtime`)."""
    out = []
    rt.reset_storage_count()
    for group in groups:
        for p in group["params"]:
            st = state.get(p, {})
            kind = storage.master_kind(group["master_weights"], p.dtype)
            rec = rt.versions.get(id(p), -1)
            if "step" in st and rec is writes.LOADED:
                # a checkpoint was loaded and the model may still be: read, do not conform (the
                # step converts from the param as it is then)
                others = storage.stored_kinds(st, but=kind)
                if others:
                    out.append(others[0].to_fp32(p, st))
                    continue
            elif "step" in st and rec != stamp(p):
                rt.conform(kind, p, st, groups)  # written since our last step
            live = kind.live_fp32(st)
            if live is not None:
                out.append(live)  # writing into it changes the master
            elif kind.has_state(st):
                out.append(kind.to_fp32(p, st))
            else:
                out.append(p.detach() if p.dtype == torch.float32 else p.detach().float())
    return out


@torch.no_grad()
def copy_masters_to(opt: Any, target: Any) -> None:
    """``FusedAdamWMP.copy_master_params_to`` (see there)."""
    dst = list(target.parameters()) if isinstance(target, torch.nn.Module) else list(target)
    src = opt.master_params()
    if len(dst) != len(src):
        raise ValueError(f"copy_master_params_to: target has {len(dst)} tensors, the optimizer has {len(src)} "
                         "params")
    for i, (d, s) in enumerate(zip(dst, src)):
        if not isinstance(d, Tensor) or d.shape != s.shape:
            raise ValueError(f"copy_master_params_to: target tensor {i} has shape "
                             f"{tuple(getattr(d, 'shape', ()))}, param {i} has {tuple(s.shape)}")
    for d, s in zip(dst, src):
        d.copy_(s)


# ---- pickling: process groups do not pickle -----------------------------------------------------
_PROCESS = uuid.uuid4().hex  # tokens of another process are never found here
_TOKENS = itertools.count()
_GROUP_TOKEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # process group -> its token
_GROUPS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # token -> process group
_STRONG: dict[str, Any] = {}  # groups that take no weak reference (kept: such objects are rare)


def group_token(pg: Any) -> str:
    """A token for ``pg`` valid in this process while ``pg`` lives (never reused for another group)."""
    try:
        token = _GROUP_TOKEN.get(pg)
    except TypeError:  # cannot be weakly referenced
        token = next((t for t, g in _STRONG.items() if g is pg), None)
        if token is None:
            token = f"{_PROCESS}:{next(_TOKENS)}"
            _STRONG[token] = pg
        return token
    if token is None:
        token = _GROUP_TOKEN[pg] = f"{_PROCESS}:{next(_TOKENS)}"
        _GROUPS[token] = pg
    return token


def group_of_token(token: Any) -> Any:
    """The process group of ``token``; RuntimeError when it is gone or from another process."""
    pg = _GROUPS.get(token, _STRONG.get(token)) if isinstance(token, str) else None
    if pg is None:
        raise RuntimeError("FusedAdamWMP: this optimizer was pickled with a process_group, which only exists in "
                           "the process that created it (and while it lives); build the optimizer anew here")
    return pg


def getstate(rt: Any, state: dict[str, Any]) -> dict[str, Any]:
    """``Optimizer.__getstate__``'s ``state`` plus what a step left (``rt``: the optimizer's
    :class:`~.runtime.Runtime`), and a token for the process group (they do not pickle)."""
    state.update({k: rt.live[k] for k in LIVE_KEYS})
    if rt.process_group is not None:
        state["_mpkern_process_group_token"] = group_token(rt.process_group)
    if rt.release is not None:  # the gradient release setting (the hooks are made anew on the copy's params)
        state["_mpkern_release_bucket_bytes"] = rt.release.bucket_bytes
    return state


def restore(state: dict[str, Any]) -> tuple[dict[str, Any], Any, int | None]:
    """Take what :func:`getstate` added out of an unpickled / copied ``state``: (what a step left,
    the process group, the gradient release's bucket bytes or None)."""
    live = {k: state.pop(k, None) for k in LIVE_KEYS}
    token = state.pop("_mpkern_process_group_token", None)
    return live, None if token is None else group_of_token(token), state.pop("_mpkern_release_bucket_bytes", None)


def upgrade_groups(defaults: dict[str, Any], groups: list[dict[str, Any]]) -> None:
    """Groups (and defaults) saved by older versions given today's keys."""
    for key, val in (("max_grad_norm", None), ("master_weights", True), ("state_dtype", "float32"),
                     ("stochastic_rounding", False), ("seed", 0)):
        defaults.setdefault(key, val)
    for group in chain(groups, [defaults]):
        for key, val in (("amsgrad", False), ("maximize", False), ("capturable", False)):
            group.setdefault(key, val)  # groups saved before a flag existed: AdamW's fallbacks
        if isinstance(group.get("state_dtype"), torch.dtype):  # saved by an older mpkern
            group["state_dtype"] = storage.MOMENT_DTYPE_NAMES.get(group["state_dtype"], group["state_dtype"])


__all__ = [
    "adamw_state_dict",
    "copy_masters_to",
    "export",
    "getstate",
    "group_of_token",
    "group_token",
    "load",
    "master_params",
    "restore",
    "upgrade_groups",
    "state_from_checkpoint",
]
