"""How ``FusedAdamWMP`` keeps each part of a param's state: one small description per kind.

A *master kind* says how the fp32 master of a param is kept (``master_weights=``): ``"fp32"`` (an fp32
copy), ``"remainder"`` (bf16 params: the low 16 bits in an int16 tensor), ``"8bit"`` (bf16/fp16
params: a stochastically rounded one-byte correction), ``"none"`` (the param is the value). A *moment kind* says how ``exp_avg`` / ``exp_avg_sq`` are kept (``state_dtype=``).
Each description knows its state keys, its bytes per element, the kernel variant it selects, how
its state is created, how it turns into an fp32 master (or fp32 moments) and back -- which is all
that checkpoint conversion, master export, re-seeding after external writes and the byte model
need. Adding a storage mode means adding one description (and its kernel variant), not editing
the optimizer's methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import distributed, reference
from ..distributed import local as _local
from ..reference import MASTER_8BIT, MASTER_F32, MASTER_NONE, MASTER_REMAINDER

Tensor = torch.Tensor
State = dict[str, Any]


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


# ---- master kinds ---------------------------------------------------------------------------------
class MasterKind:
    """One way of keeping a param's fp32 master. Subclasses fill in the class attributes and methods."""

    name: str = ""
    mode: int = MASTER_NONE  # the kernel variant (mpkern.reference.MASTER_*)
    key: str | None = None  # the state key of its tensor (None: no master state)
    state_dtype: torch.dtype | None = None

    def bytes_per_element(self, param_dtype: torch.dtype) -> float:
        """Resident bytes of master state per element of a param of ``param_dtype``."""
        return 0.0 if self.state_dtype is None else float(self.state_dtype.itemsize)

    def has_state(self, st: State) -> bool:
        return self.key is not None and self.key in st

    def create(self, p: Tensor) -> State:
        """The master state of a param that has none yet (the param is the master)."""
        return {}

    def to_fp32(self, p: Tensor, st: State) -> Tensor:
        """The fp32 master this state and the param as it is now describe (a new tensor)."""
        raise NotImplementedError

    def from_fp32(self, p: Tensor, st: State, master: Tensor, *, write_param: bool = True) -> None:
        """Store ``master`` (an fp32 tensor laid out like ``p``) in ``st``; the param takes its
        16-bit rounding (as the kernel would write it) unless ``write_param=False`` (a checkpoint
        load: the model may still be loaded, and the next step converts again)."""
        raise NotImplementedError

    def reseed(self, p: Tensor, st: State, *, loaded: bool, shared: bool) -> None:
        """``p`` was written by someone else (``loaded``: or a checkpoint was loaded since the last
        step, so the param may or may not be the checkpoint's): make the master follow it.
        ``shared``: ``p`` shares its storage (and version counter) with other params."""

    def drop(self, st: State) -> None:
        if self.key is not None:
            st.pop(self.key, None)

    def kernel_tensor(self, st: State) -> Tensor | None:
        return None if self.key is None else st[self.key]


class Fp32Master(MasterKind):
    """``master_weights=True``: an fp32 copy; the param is its round-to-nearest-even."""

    name, mode, key, state_dtype = "fp32", MASTER_F32, "master_param", torch.float32

    def create(self, p: Tensor) -> State:
        return {self.key: like(p, torch.float32).copy_(p.detach())}

    def to_fp32(self, p: Tensor, st: State) -> Tensor:
        m, pl = _local(st[self.key]), _local(p.detach())
        return distributed.wrap_like(p, torch.where(pl == m.to(pl.dtype), m, pl.float()))

    def from_fp32(self, p: Tensor, st: State, master: Tensor, *, write_param: bool = True) -> None:
        st[self.key] = like(p, torch.float32).copy_(master)
        if write_param:
            p.copy_(master)

    def reseed(self, p: Tensor, st: State, *, loaded: bool, shared: bool) -> None:
        # elementwise: keep the master where the param still is its rounding, else take the param
        m, pl = _local(st[self.key]), _local(p.detach())
        m.copy_(torch.where(pl == m.to(pl.dtype), m, pl.float()))


class RemainderMaster(MasterKind):
    """``master_weights="remainder"`` (bf16 params): the master's low 16 bits in an int16 tensor;
    param and remainder together are the fp32 master exactly."""

    name, mode, key, state_dtype = "remainder", MASTER_REMAINDER, "master_remainder", torch.int16

    def create(self, p: Tensor) -> State:
        return {self.key: like(p, torch.int16).zero_()}

    def to_fp32(self, p: Tensor, st: State) -> Tensor:
        hi = p.detach() if p.dtype == torch.bfloat16 else p.detach().to(torch.bfloat16)
        return remainder_to_master(hi, st[self.key])

    def from_fp32(self, p: Tensor, st: State, master: Tensor, *, write_param: bool = True) -> None:
        hi, low = master_to_remainder(master)
        if write_param:
            _local(p).copy_(_local(hi))
        st[self.key] = like(p, torch.int16).copy_(low)

    def reseed(self, p: Tensor, st: State, *, loaded: bool, shared: bool) -> None:
        # a written param's value is its master (remainder 0). Kept after a load (the remainder
        # belongs to the checkpoint's param) and for views of one buffer: their shared version
        # counter cannot tell which one was written, and the others' low bits must survive.
        rem = _local(st[self.key])
        if not loaded and not shared:
            rem.zero_()
            return
        # a kept remainder must still describe a value next to the param: below +-0 it would borrow
        # into the sign (NaN), and an inf/NaN param has no low bits
        bits = _local(p.detach())
        bits = (bits if bits.dtype == torch.bfloat16 else bits.to(torch.bfloat16)).view(torch.int16).to(torch.int32)
        bad = ((bits & 0x7FFF) == 0) | ((bits & 0x7F80) == 0x7F80)
        rem.masked_fill_(bad, 0)


class Int8Master(MasterKind):
    """``master_weights="8bit"`` (bf16 / fp16 params): a one-byte correction ``c`` of the param's
    rounding error in units of ``ulp(p) / 256``; the master is ``p + c * ulp(p) / 256`` (exact in
    fp32). The kernel re-encodes ``c`` with stochastic rounding (seeded), so an update smaller than
    the correction's resolution still moves the master in expectation; conversions here round to
    nearest."""

    name, mode, key, state_dtype = "8bit", MASTER_8BIT, "master_correction", torch.int8

    def create(self, p: Tensor) -> State:
        return {self.key: like(p, torch.int8).zero_()}

    def to_fp32(self, p: Tensor, st: State) -> Tensor:
        pl, c = _local(p.detach()), _local(st[self.key])
        if pl.dtype == torch.float32:  # the param became fp32 holding its 16-bit value: take it as it is
            return distributed.wrap_like(p, pl.clone())
        return distributed.wrap_like(p, reference.master8_decode(pl, c))

    def from_fp32(self, p: Tensor, st: State, master: Tensor, *, write_param: bool = True) -> None:
        pl, m = _local(p), _local(master)
        half = torch.full(pl.shape, 0x8000, dtype=torch.int32, device=pl.device)  # floor(x + 1/2): nearest
        hi, c = reference.master8_encode(m, pl.dtype, half)
        if write_param:
            pl.copy_(hi)
        st[self.key] = like(p, torch.int8).copy_(distributed.wrap_like(p, c))

    def reseed(self, p: Tensor, st: State, *, loaded: bool, shared: bool) -> None:
        # like the remainder: a written param is its own master (correction 0), except after a
        # load or for views of one buffer (the write cannot be attributed)
        if not loaded and not shared:
            _local(st[self.key]).zero_()


class NoMaster(MasterKind):
    """fp32 params, or ``master_weights=False``: the param itself is updated."""

    name, mode = "none", MASTER_NONE

    def to_fp32(self, p: Tensor, st: State) -> Tensor:
        return p.detach().float()

    def from_fp32(self, p: Tensor, st: State, master: Tensor, *, write_param: bool = True) -> None:
        if write_param:
            p.copy_(master)

    def bytes_per_element(self, param_dtype: torch.dtype) -> float:
        return 0.0


FP32, REMAINDER, INT8, NONE = Fp32Master(), RemainderMaster(), Int8Master(), NoMaster()
#: every master kind that keeps state, in the order a checkpoint's entries are looked for (the
#: exact ones first: a checkpoint holding several converts from the most precise)
STORED_MASTERS: tuple[MasterKind, ...] = (FP32, REMAINDER, INT8)
#: ``master_weights=`` value -> kind for 16-bit params
MASTER_KINDS: dict[Any, MasterKind] = {True: FP32, "remainder": REMAINDER, "8bit": INT8, False: NONE}


def master_kind(master_weights: Any, param_dtype: torch.dtype) -> MasterKind:
    """The kind a param of ``param_dtype`` gets in a group with ``master_weights``."""
    return NONE if param_dtype == torch.float32 else MASTER_KINDS[master_weights]


def stored_kinds(st: State, but: MasterKind | None = None) -> list[MasterKind]:
    """The master kinds whose state is in ``st`` (other than ``but``)."""
    return [k for k in STORED_MASTERS if k is not but and k.key in st]


# ---- moment kinds ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class MomentKind:
    """``state_dtype=``: how ``exp_avg`` and ``exp_avg_sq`` are kept (``max_exp_avg_sq`` is fp32)."""

    name: str
    dtype: torch.dtype

    def bytes_per_element(self) -> float:
        """Resident bytes of both moments per element."""
        return 2.0 * self.dtype.itemsize

    def create(self, p: Tensor) -> State:
        return {"exp_avg": like(p, self.dtype).zero_(), "exp_avg_sq": like(p, self.dtype).zero_()}

    def from_saved(self, p: Tensor, src: State) -> State:
        """Moments from a checkpoint's entries (any dtype; AdamW's are the param's dtype or fp32)."""
        out = {}
        for key in ("exp_avg", "exp_avg_sq"):
            val = src.get(key)
            out[key] = laid(p, val, self.dtype) if val is not None else like(p, self.dtype).zero_()
        return out

    def to_fp32(self, st: State, key: str) -> Tensor:
        return st[key].float()


MOMENT_KINDS: dict[str, MomentKind] = {"float32": MomentKind("float32", torch.float32),
                                       "bfloat16": MomentKind("bfloat16", torch.bfloat16)}
MOMENT_DTYPE_NAMES: dict[torch.dtype, str] = {k.dtype: name for name, k in MOMENT_KINDS.items()}


def moment_kind(state_dtype: Any) -> MomentKind:
    """The kind for a group's ``state_dtype`` (a name, or a torch dtype from an older checkpoint)."""
    if isinstance(state_dtype, torch.dtype):
        state_dtype = MOMENT_DTYPE_NAMES[state_dtype]
    return MOMENT_KINDS[state_dtype]


def state_bytes_per_param(master_weights: Any, state_dtype: Any, param_dtype: torch.dtype, *,
                          amsgrad: bool = False) -> float:
    """Resident optimizer-state bytes per param element (masters + moments), from the descriptions."""
    return (master_kind(master_weights, param_dtype).bytes_per_element(param_dtype)
            + moment_kind(state_dtype).bytes_per_element() + (4.0 if amsgrad else 0.0))


__all__ = [
    "FP32",
    "INT8",
    "MASTER_KINDS",
    "MOMENT_KINDS",
    "NONE",
    "REMAINDER",
    "STORED_MASTERS",
    "MasterKind",
    "MomentKind",
    "laid",
    "like",
    "master_kind",
    "master_to_remainder",
    "moment_kind",
    "remainder_to_master",
    "state_bytes_per_param",
    "stored_kinds",
]
