"""The master kinds: fp32 copy, int16 remainder, 8-bit correction, none (see :mod:`.base`)."""

from __future__ import annotations

import torch

from ... import distributed, reference, reference_codecs
from ...distributed import local as _local
from .base import MasterKind, State, Tensor, like, master_to_remainder, remainder_to_master


class Fp32Master(MasterKind):
    """``master_weights=True``: an fp32 copy; the param is its round-to-nearest-even."""

    name, accepts, label = "fp32", (True,), "fp32 master"
    mode, key, state_dtype = reference.MASTER_F32, "master_param", torch.float32
    reads_param = False  # the master holds the whole value

    def create(self, p: Tensor) -> State:
        return {self.key: like(p, torch.float32).copy_(p.detach())}

    def to_fp32(self, p: Tensor, st: State) -> Tensor:
        m, pl = _local(st[self.key]), _local(p.detach())
        return distributed.wrap_like(p, torch.where(pl == m.to(pl.dtype), m, pl.float()))

    def live_fp32(self, st: State) -> Tensor | None:
        return st.get(self.key)

    def from_fp32(self, p: Tensor, st: State, master: Tensor, *, write_param: bool = True) -> None:
        st[self.key] = like(p, torch.float32).copy_(master)
        if write_param:
            p.copy_(master)

    def restore_param(self, p: Tensor, st: State) -> None:
        # the param's old 16-bit dtype is gone: it still is its rounding if either rounding matches
        m, pl = _local(st[self.key]), _local(p.detach())
        same = (m.to(torch.bfloat16).float() == pl) | (m.to(torch.float16).float() == pl)
        pl.copy_(torch.where(same, m, pl))

    def reseed(self, p: Tensor, st: State, *, loaded: bool, shared: bool) -> None:
        # elementwise: keep the master where the param still is its rounding, else take the param
        m, pl = _local(st[self.key]), _local(p.detach())
        m.copy_(torch.where(pl == m.to(pl.dtype), m, pl.float()))


class RemainderMaster(MasterKind):
    """``master_weights="remainder"`` (bf16 params): the master's low 16 bits in an int16 tensor;
    param and remainder together are the fp32 master exactly."""

    name, accepts, label = "remainder", ("remainder",), "remainder"
    mode, key, state_dtype = reference.MASTER_REMAINDER, "master_remainder", torch.int16
    param_dtypes = frozenset((torch.bfloat16,))

    def describes(self, param_dtype: torch.dtype) -> bool:
        return param_dtype == torch.bfloat16  # the low half of a bf16 param's value

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
    rounding error in units of ``ulp(p) / 256`` -- bf16: the master's fp32 bits are
    ``(bits(p) << 16) + 256 c``; fp16: the master is ``p + c * ulp(p) / 256`` (math.h
    ``master8_*``). The kernel re-encodes with stochastic rounding (seeded), so an update smaller
    than the correction's resolution still moves the master in expectation; conversions here round
    to nearest."""

    name, accepts, label = "8bit", ("8bit",), "8-bit master"
    mode, key, state_dtype = reference.MASTER_8BIT, "master_correction", torch.int8

    def check_group(self, dtypes: list[torch.dtype], where: str) -> None:
        if dtypes and all(d == torch.float32 for d in dtypes):
            raise ValueError(f"FusedAdamWMP: master_weights='8bit' is not needed for float32 params (param 0 "
                             f"of {where}): they are their own fp32 master -- use master_weights=True "
                             "(or keep the 8-bit masters for the 16-bit params' group)")

    def create(self, p: Tensor) -> State:
        return {self.key: like(p, torch.int8).zero_()}

    def to_fp32(self, p: Tensor, st: State) -> Tensor:
        pl, c = _local(p.detach()), _local(st[self.key])
        if pl.dtype == torch.float32:  # the param became fp32 holding its 16-bit value: take it as it is
            return distributed.wrap_like(p, pl.clone())
        return distributed.wrap_like(p, reference_codecs.master8_decode(pl, c))

    def from_fp32(self, p: Tensor, st: State, master: Tensor, *, write_param: bool = True) -> None:
        pl, m = _local(p), _local(master)
        hi, c = reference_codecs.master8_encode(m, pl.dtype)  # no random word: to nearest
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

    name, accepts, label = "none", (False,), "no master (SR params)"
    mode = reference.MASTER_NONE
    param_dtypes = frozenset((torch.bfloat16, torch.float16))
    stochastic_rounding = True

    def to_fp32(self, p: Tensor, st: State) -> Tensor:
        return p.detach().float()

    def from_fp32(self, p: Tensor, st: State, master: Tensor, *, write_param: bool = True) -> None:
        if write_param:
            p.copy_(master)

    def bytes_per_element(self, param_dtype: torch.dtype) -> float:
        return 0.0
