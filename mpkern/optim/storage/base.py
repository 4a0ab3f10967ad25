"""What every storage kind is made of: tensor helpers, and the two description base classes.

A :class:`MasterKind` says how the fp32 master of a param is kept (``master_weights=``), a
:class:`MomentKind` how ``exp_avg`` / ``exp_avg_sq`` are kept (``state_dtype=``). A description
knows everything about itself -- the names it accepts, the param dtypes it supports and why not,
amsgrad support, bytes per element, creation, conversion to and from fp32, its label, the kernel
variant and extra tensors it selects -- so that nothing outside :mod:`mpkern.optim.storage` needs
to know which kinds exist (see :mod:`mpkern.optim.storage` for the registry).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ... import distributed
from ...distributed import local as _local

Tensor = torch.Tensor
State = dict[str, Any]
#: every backend that has a native kernel (the built-in kinds have a variant on each of them)
ALL_BACKENDS = frozenset(("cpu", "cuda", "triton", "torch"))


def like(p: Tensor, dtype: torch.dtype) -> Tensor:
    """An empty state tensor laid out like ``p`` (same strides when ``p`` is dense, else contiguous)."""
    return torch.empty_like(p, dtype=dtype, memory_format=torch.preserve_format)


def laid(p: Tensor, value: Tensor, dtype: torch.dtype) -> Tensor:
    """``value`` (any layout/device, ``p``'s shape or numel, a DTensor or a full tensor) copied into a
    new tensor of ``dtype`` laid out like ``p`` (a DTensor placed like ``p`` when ``p`` is one)."""
    value = value.to(p.device)
    if value.shape != p.shape:
        value = value.reshape(p.shape)
    return like(p, dtype).copy_(distributed.like_param(p, value))


def flat_view(t: Tensor) -> Tensor:
    """A 1-D view of a dense tensor (contiguous up to a permutation of dims) over its memory, in
    memory order (the order the kernels walk a buffer in)."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


#: what :meth:`MomentKind.kernel_tensors` returns: a :class:`KernelMoments`, or (kinds with a
#: kernel variant) a plain tuple in its order
KernelTensors = tuple[Tensor, Tensor, "Tensor | None", "Tensor | None"]


class KernelMoments(NamedTuple):
    """The moment tensors one param hands the kernel (scales: None unless the kind has them)."""

    exp_avg: Tensor
    exp_avg_sq: Tensor
    exp_avg_scale: Tensor | None = None
    exp_avg_sq_scale: Tensor | None = None


class MasterKind:
    """One way of keeping a param's fp32 master. Subclasses fill in the class attributes and methods."""

    name: str = ""
    accepts: tuple[Any, ...] = ()  # the ``master_weights=`` values that select it
    label: str = ""  # what plan / compare / bench print
    mode: int = 0  # the reference kernel's variant (mpkern.reference.MASTER_*); ``name`` is the op's ``master_codec``
    kernel_backends: frozenset[str] = ALL_BACKENDS
    key: str | None = None  # the state key of its tensor (None: no master state)
    state_dtype: torch.dtype | None = None
    #: 16-bit param dtypes it can keep a master for (fp32 params never get one), and why not others
    param_dtypes: frozenset[torch.dtype] = frozenset((torch.bfloat16, torch.float16))
    why_not: str = ""
    #: the step reads the 16-bit param (it holds part of the value) -- the byte model counts it
    reads_param: bool = True
    #: stochastic rounding of the updated 16-bit params (only without a master)
    stochastic_rounding: bool = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def bytes_per_element(self, param_dtype: torch.dtype) -> float:
        """Resident bytes of master state per element of a param of ``param_dtype``."""
        return 0.0 if self.state_dtype is None else float(self.state_dtype.itemsize)

    def check_param_dtype(self, dtype: torch.dtype, where: str) -> None:
        """ValueError if a 16-bit param of ``dtype`` cannot keep this kind of master."""
        if dtype != torch.float32 and dtype not in self.param_dtypes:
            raise ValueError(f"FusedAdamWMP: master_weights={self.accepts[0]!r} needs "
                             f"{' or '.join(sorted(str(d).replace('torch.', '') for d in self.param_dtypes))} "
                             f"params, {where} is {dtype}{self.why_not}")

    def check_group(self, dtypes: list[torch.dtype], where: str) -> None:
        """ValueError if a whole group of params of ``dtypes`` makes no sense with this kind."""

    def describes(self, param_dtype: torch.dtype) -> bool:
        """Whether saved state of this kind describes a master next to a param of ``param_dtype``."""
        return True

    def has_state(self, st: State) -> bool:
        return self.key is not None and self.key in st

    def create(self, p: Tensor) -> State:
        """The master state of a param that has none yet (the param is the master)."""
        return {}

    def to_fp32(self, p: Tensor, st: State) -> Tensor:
        """The fp32 master this state and the param as it is now describe (a new tensor)."""
        raise NotImplementedError

    def live_fp32(self, st: State) -> Tensor | None:
        """The state tensor that *is* the fp32 master (writing into it changes it), or None."""
        return None

    def from_fp32(self, p: Tensor, st: State, master: Tensor, *, write_param: bool = True) -> None:
        """Store ``master`` (an fp32 tensor laid out like ``p``) in ``st``; the param takes its
        16-bit rounding (as the kernel would write it) unless ``write_param=False`` (a checkpoint
        load: the model may still be loaded, and the next step converts again)."""
        raise NotImplementedError

    def restore_param(self, p: Tensor, st: State) -> None:
        """``p`` became fp32 (``model.float()``) while ``st`` still holds this kind: give it the master."""
        _local(p.detach()).copy_(_local(self.to_fp32(p, st)))

    def reseed(self, p: Tensor, st: State, *, loaded: bool, shared: bool) -> None:
        """``p`` was written by someone else (``loaded``: or a checkpoint was loaded since the last
        step, so the param may or may not be the checkpoint's): make the master follow it.
        ``shared``: ``p`` shares its storage (and version counter) with other params."""

    def drop(self, st: State) -> None:
        if self.key is not None:
            st.pop(self.key, None)

    def kernel_tensor(self, st: State) -> Tensor | None:
        return None if self.key is None else st[self.key]


class MomentKind:
    """``state_dtype=``: how ``exp_avg`` and ``exp_avg_sq`` are kept (``max_exp_avg_sq`` is fp32).

    A kind without a native kernel variant needs only :meth:`create`, :meth:`from_fp32` (encode),
    :meth:`to_fp32` (decode) and its ``keys``: on the ``torch`` backend the step decodes its moments
    to fp32, runs the reference step on them and encodes them back (see :meth:`kernel_tensors`);
    a native backend asked for it raises, naming the kind.
    """

    name: str = ""
    aliases: tuple[Any, ...] = ()  # other accepted ``state_dtype=`` values (torch dtypes)
    label: str = ""
    keys: tuple[str, ...] = ()  # the state keys it owns (the first one says the kind is there)
    kernel_backends: frozenset[str] = frozenset(("torch",))  # where it has a kernel (torch: via fp32)
    amsgrad: bool = True
    amsgrad_why: str = ""
    #: a note for the load warning when a torch.optim.AdamW checkpoint is converted into it (lossy)
    adamw_conversion: str | None = None
    #: the step stores its moments through :meth:`write_back` (no kernel variant of its own)
    needs_write_back: bool = True
    #: how the kernel reads the tensors of :meth:`kernel_tensors` (``moment_codec`` of
    #: ``mpkern::adamw_step_``): a kind without a kernel variant hands it fp32 copies
    codec: str = "float32"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def bytes_per_element(self) -> float:
        """Resident bytes of both moments per element."""
        raise NotImplementedError

    def has_state(self, st: State) -> bool:
        return self.keys[0] in st

    def has_moment(self, st: State, key: str) -> bool:
        """Whether ``st`` holds moment ``key`` ("exp_avg" / "exp_avg_sq") of this kind."""
        return self.has_state(st)

    def create(self, p: Tensor) -> State:
        raise NotImplementedError

    def from_fp32(self, p: Tensor, m: Tensor, v: Tensor) -> State:
        """State for ``p`` holding fp32 moments ``m``, ``v`` (any layout, ``p``'s shape, full or DTensor)."""
        raise NotImplementedError

    def to_fp32(self, st: State, key: str) -> Tensor:
        """Moment ``key`` ("exp_avg" / "exp_avg_sq") of ``st`` as a new fp32 tensor laid out like its state."""
        raise NotImplementedError

    def copy_saved(self, p: Tensor, src: State) -> State | None:
        """The saved entries of this kind in ``src`` taken as they are (None: they need converting)."""
        if not self.has_state(src) or any(not isinstance(src.get(k), Tensor) for k in self.keys):
            return None
        return {k: laid(p, src[k], src[k].dtype) for k in self.keys}

    def kernel_tensors(self, st: State) -> KernelTensors:
        """The tensors the kernel updates, in :class:`KernelMoments`' order (kinds with a kernel
        variant may return a plain tuple: this runs per param per step). Without a kernel variant:
        fp32 copies, stored back by :meth:`write_back` after the reference step."""
        return KernelMoments(self.to_fp32(st, "exp_avg"), self.to_fp32(st, "exp_avg_sq"))

    def write_back(self, p: Tensor, st: State, moments: KernelMoments, found_inf: Tensor) -> None:
        """Encode the fp32 moments the reference step updated into ``st`` (nothing when ``found_inf``)."""
        new = self.from_fp32(p, moments.exp_avg, moments.exp_avg_sq)
        keep = found_inf.reshape(()) != 0
        for k, t in new.items():
            st[k].copy_(torch.where(keep, st[k], t))

    def export(self, p: Tensor, st: State) -> State:
        """``st`` as ``state_dict()`` saves it (a new dict if anything differs; default: as it is)."""
        return st

    def relay(self, p: Tensor, st: State) -> bool:
        """Follow a param that moved to another device or memory layout; True if anything changed."""
        return False

    def drop(self, st: State) -> None:
        for key in self.keys:
            st.pop(key, None)

    def shape_tensor(self, st: State) -> Tensor | None:
        """A state tensor of ``st`` laid out like the param it was made for (its shape is the param's)."""
        return next((st[k] for k in self.keys if isinstance(st.get(k), Tensor)), None)

    def from_saved(self, p: Tensor, src: State, saved: MomentKind | None) -> State:
        """Moments for ``p`` from a checkpoint's entries: this kind's taken as saved, another kind's
        (``saved``: the kind that holds them, or None) converted through fp32, none: zeros."""
        own = self.copy_saved(p, src)
        if own is not None:
            return own
        if saved is None:
            return self.create(p)
        return self.from_fp32(p, saved.to_fp32(src, "exp_avg"), saved.to_fp32(src, "exp_avg_sq"))


def remainder_to_master(p: Tensor, rem: Tensor) -> Tensor:
    """fp32 master from a bf16 param and its int16 remainder (exact; DTensors shard by shard)."""
    hi = _local(p).view(torch.int16).to(torch.int32) & 0xFFFF
    return distributed.wrap_like(p, ((hi << 16) + _local(rem).to(torch.int32)).view(torch.float32))


def master_to_remainder(master: Tensor) -> tuple[Tensor, Tensor]:
    """(bf16 param, int16 remainder) that reconstruct ``master`` exactly (DTensors shard by shard).
    The bf16 half is rounded to nearest with ties away from zero (see ``math.h``)."""
    u = _local(master).view(torch.int32)
    hi = (((u + 0x8000) >> 16) & 0xFFFF).to(torch.int16).view(torch.bfloat16)
    return distributed.wrap_like(master, hi), distributed.wrap_like(master, (u & 0xFFFF).to(torch.int16))
