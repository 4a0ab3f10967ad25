"""How ``FusedAdamWMP`` keeps each part of a param's state: one small description per kind.

A *master kind* says how the fp32 master of a param is kept (``master_weights=``): ``"fp32"`` (an fp32
copy), ``"remainder"`` (bf16 params: the low 16 bits in an int16 tensor), ``"8bit"`` (bf16/fp16
params: a stochastically rounded one-byte correction), ``"none"`` (the param is the value). A
*moment kind* says how ``exp_avg`` / ``exp_avg_sq`` are kept (``state_dtype=``): ``"float32"``,
``"bfloat16"`` (stochastically rounded) or ``"8bit"`` (companded codes + a bf16 scale per 32).
Each description knows its state keys, its bytes per element, the kernel variant it selects, how
its state is created, how it turns into an fp32 master (or fp32 moments) and back -- which is all
that checkpoint conversion, master export, re-seeding after external writes and the byte model
need. Adding a storage mode means adding one description (and its kernel variant), not editing
the optimizer's methods.
"""

from __future__ import annotations

from typing import Any, ClassVar

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
def flat_view(t: Tensor) -> Tensor:
    """A 1-D view of a dense tensor (contiguous up to a permutation of dims) over its memory, in
    memory order (the order the kernels walk a buffer in)."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


#: elements per scale of the 8-bit moments: consecutive elements of a tensor's buffer
MOMENT8_GROUP = reference.MOM8_GROUP
moment8_groups = reference.moment8_groups


class MomentKind:
    """``state_dtype=``: how ``exp_avg`` and ``exp_avg_sq`` are kept (``max_exp_avg_sq`` is fp32)."""

    name: str = ""
    keys: tuple[str, ...] = ()  # the state keys it owns
    code_dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32)  # (exp_avg, exp_avg_sq)

    def bytes_per_element(self) -> float:
        """Resident bytes of both moments per element (with scales: for a numel that is a multiple of
        the group; a short last group costs its whole scale)."""
        raise NotImplementedError

    def has_state(self, st: State) -> bool:
        return self.keys[0] in st

    def create(self, p: Tensor) -> State:
        raise NotImplementedError

    def from_fp32(self, p: Tensor, m: Tensor, v: Tensor) -> State:
        """State for ``p`` holding fp32 moments ``m``, ``v`` (any layout, ``p``'s shape, full or DTensor)."""
        raise NotImplementedError

    def copy_saved(self, p: Tensor, src: State) -> State | None:
        """The saved entries of this kind in ``src`` taken as they are (None: they need converting)."""
        raise NotImplementedError

    def kernel_tensors(self, st: State) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """(exp_avg, exp_avg_sq, exp_avg scales, exp_avg_sq scales) as the kernel takes them."""
        raise NotImplementedError

    def to_fp32(self, st: State, key: str) -> Tensor:
        """Moment ``key`` ("exp_avg" / "exp_avg_sq") of ``st`` as a new fp32 tensor laid out like its state."""
        raise NotImplementedError

    def drop(self, st: State) -> None:
        for key in self.keys:
            st.pop(key, None)

    def from_saved(self, p: Tensor, src: State) -> State:
        """Moments for ``p`` from a checkpoint's entries: this kind's taken as saved, another kind's (or
        ``torch.optim.AdamW``'s, in the param's dtype or fp32) converted through fp32, none: zeros."""
        own = self.copy_saved(p, src)
        if own is not None:
            return own
        saved = saved_kind(src)
        if saved is None:
            return self.create(p)
        return self.from_fp32(p, saved.to_fp32(src, "exp_avg"), saved.to_fp32(src, "exp_avg_sq"))


class DenseMoments(MomentKind):
    """fp32 or bf16 moments, one value per element (bf16 ones stored with stochastic rounding by the kernel)."""

    keys = ("exp_avg", "exp_avg_sq")

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name, self.dtype = name, dtype
        self.code_dtypes = (dtype, dtype)

    def __repr__(self) -> str:
        return f"DenseMoments({self.name!r})"

    def bytes_per_element(self) -> float:
        return 2.0 * self.dtype.itemsize

    def create(self, p: Tensor) -> State:
        return {"exp_avg": like(p, self.dtype).zero_(), "exp_avg_sq": like(p, self.dtype).zero_()}

    def from_fp32(self, p: Tensor, m: Tensor, v: Tensor) -> State:
        return {"exp_avg": laid(p, m, self.dtype), "exp_avg_sq": laid(p, v, self.dtype)}

    def copy_saved(self, p: Tensor, src: State) -> State | None:
        if "exp_avg" not in src and "exp_avg_sq" not in src:
            return None
        out = {}
        for key in self.keys:  # any dtype: AdamW's are the param's dtype or fp32
            val = src.get(key)
            out[key] = laid(p, val, self.dtype) if val is not None else like(p, self.dtype).zero_()
        return out

    def kernel_tensors(self, st: State) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        return st["exp_avg"], st["exp_avg_sq"], None, None

    def to_fp32(self, st: State, key: str) -> Tensor:
        return st[key].float()


class Int8Moments(MomentKind):
    """``state_dtype="8bit"``: each moment as one byte per element plus a bf16 scale per group of
    :data:`MOMENT8_GROUP` consecutive elements of the param's buffer (2.125 B/param for both).

    Companded so that small values keep relative precision: ``exp_avg = sign(c) * s * c^2``
    (int8 ``c`` in [-127, 127]), ``exp_avg_sq = s * c^4`` (uint8 ``c``; a positive value never
    decodes to 0, which keeps ``m / sqrt(v)`` bounded). The kernel decodes, updates and re-encodes
    in registers with value-unbiased stochastic rounding between neighbouring codes (seeded);
    conversions here round to the nearest code. The codec is ``mpkern.reference.moment8_*`` (the
    kernels' math in ``csrc/include/mpkern/math.h``).
    """

    name = "8bit"
    keys = ("exp_avg_code", "exp_avg_sq_code", "exp_avg_scale", "exp_avg_sq_scale")
    code_dtypes = (torch.int8, torch.uint8)
    _CODE: ClassVar[dict[str, tuple[str, str]]] = {"exp_avg": ("exp_avg_code", "exp_avg_scale"),
                                                   "exp_avg_sq": ("exp_avg_sq_code", "exp_avg_sq_scale")}

    def __repr__(self) -> str:
        return "Int8Moments()"

    def bytes_per_element(self) -> float:
        return 2.0 + 2.0 * torch.bfloat16.itemsize / MOMENT8_GROUP

    def _scales(self, p: Tensor) -> Tensor:
        return torch.zeros(moment8_groups(_local(p).numel()), dtype=torch.bfloat16, device=p.device)

    def create(self, p: Tensor) -> State:
        return {"exp_avg_code": like(p, torch.int8).zero_(), "exp_avg_sq_code": like(p, torch.uint8).zero_(),
                "exp_avg_scale": self._scales(p), "exp_avg_sq_scale": self._scales(p)}

    def from_fp32(self, p: Tensor, m: Tensor, v: Tensor) -> State:
        st = self.create(p)
        for key, val in (("exp_avg", m), ("exp_avg_sq", v)):
            ck, sk = self._CODE[key]
            x = _local(laid(p, val, torch.float32))  # laid out like p: its memory order is the kernel's
            codes, scales = moment8_encode(flat_view(x), key)
            flat_view(_local(st[ck])).copy_(codes)
            st[sk] = scales
        return st

    def copy_saved(self, p: Tensor, src: State) -> State | None:
        if self.keys[0] not in src:
            return None
        check_moment8(p, src, "the checkpoint's")
        codes = src["exp_avg_code"]
        want = like(p, torch.int8)
        if (distributed.is_dtensor(p) or distributed.is_dtensor(codes) or codes.shape != p.shape
                or codes.stride() != want.stride()):
            return None  # grouped in another memory order, or to be sharded: through fp32
        dev = p.device
        return {"exp_avg_code": want.copy_(codes), "exp_avg_sq_code": like(p, torch.uint8).copy_(src["exp_avg_sq_code"]),
                "exp_avg_scale": src["exp_avg_scale"].to(dev, torch.bfloat16).reshape(-1).clone(),
                "exp_avg_sq_scale": src["exp_avg_sq_scale"].to(dev, torch.bfloat16).reshape(-1).clone()}

    def kernel_tensors(self, st: State) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        return st["exp_avg_code"], st["exp_avg_sq_code"], st["exp_avg_scale"], st["exp_avg_sq_scale"]

    def to_fp32(self, st: State, key: str) -> Tensor:
        ck, sk = self._CODE[key]
        codes = st[ck]
        out = torch.empty_like(codes, dtype=torch.float32, memory_format=torch.preserve_format)
        flat_view(_local(out)).copy_(moment8_decode(flat_view(_local(codes)), _local(st[sk]).reshape(-1), key))
        return out

    def relay(self, p: Tensor, st: State) -> bool:
        """Follow a param that moved to another device or memory layout (the groups are runs of its
        buffer: another layout regroups, through fp32). True if anything changed."""
        if not self.has_state(st) or distributed.is_dtensor(p):
            return False
        want = like(p, torch.int8)
        codes = st["exp_avg_code"]
        if want.stride() != codes.stride():
            st.update(self.from_fp32(p, self.to_fp32(st, "exp_avg"), self.to_fp32(st, "exp_avg_sq")))
            return True
        if codes.device != p.device:
            for key in self.keys:
                st[key] = st[key].to(p.device)
            return True
        return False


def check_moment8(p: Tensor, st: State, whose: str) -> None:
    """ValueError unless ``st``'s 8-bit moments fit ``p`` (codes of its numel, one scale per group)."""
    n = p.numel()
    groups = moment8_groups(n if not distributed.is_dtensor(st.get("exp_avg_code")) else _local(p).numel())
    for key, want, dtype in (("exp_avg_code", n, torch.int8), ("exp_avg_sq_code", n, torch.uint8),
                             ("exp_avg_scale", groups, torch.bfloat16), ("exp_avg_sq_scale", groups, torch.bfloat16)):
        t = st.get(key)
        if not isinstance(t, Tensor) or t.numel() != want or t.dtype != dtype:
            got = "missing" if not isinstance(t, Tensor) else f"{t.numel()} elements of {t.dtype}"
            raise ValueError(f"FusedAdamWMP.load_state_dict: {whose} {key} is {got}; a param of shape "
                             f"{tuple(p.shape)} needs {want} elements of {dtype} (8-bit moments: one code per "
                             f"element, one bf16 scale per {MOMENT8_GROUP})")


def moment8_encode(values: Tensor, key: str) -> tuple[Tensor, Tensor]:
    """(codes, scales) of the 1-D fp32 ``values`` (a buffer in memory order), to the nearest code."""
    return reference.moment8_encode(values, key)


def moment8_decode(codes: Tensor, scales: Tensor, key: str) -> Tensor:
    """The fp32 values of 1-D ``codes`` (memory order) and their group scales (the codes' dtype says
    which moment: int8 ``exp_avg``, uint8 ``exp_avg_sq``)."""
    return reference.moment8_decode(codes, scales)


MOMENT_KINDS: dict[str, MomentKind] = {"float32": DenseMoments("float32", torch.float32),
                                       "bfloat16": DenseMoments("bfloat16", torch.bfloat16),
                                       "8bit": Int8Moments()}
MOMENT_DTYPE_NAMES: dict[torch.dtype, str] = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
#: every state key a moment kind owns (the byte model counts them as moments)
MOMENT_STATE_KEYS: tuple[str, ...] = tuple(dict.fromkeys(k for mk in MOMENT_KINDS.values() for k in mk.keys))
INT8_MOMENTS = MOMENT_KINDS["8bit"]


def moment_kind(state_dtype: Any) -> MomentKind:
    """The kind for a group's ``state_dtype`` (a name, or a torch dtype from an older checkpoint)."""
    if isinstance(state_dtype, torch.dtype):
        state_dtype = MOMENT_DTYPE_NAMES[state_dtype]
    return MOMENT_KINDS[state_dtype]


def saved_kind(st: State) -> MomentKind | None:
    """The moment kind whose entries ``st`` holds (fp32 for dense moments of any dtype), or None."""
    if INT8_MOMENTS.keys[0] in st:
        return INT8_MOMENTS
    if "exp_avg" in st or "exp_avg_sq" in st:
        return MOMENT_KINDS["float32"]
    return None


def moments_fp32(st: State, key: str) -> Tensor | None:
    """Moment ``key`` of ``st`` as a new fp32 tensor, whatever kind holds it (None: not there)."""
    kind = saved_kind(st)
    if kind is None or (kind is not INT8_MOMENTS and key not in st):
        return None
    return kind.to_fp32(st, key).clone() if kind is not INT8_MOMENTS else kind.to_fp32(st, key)


def state_bytes_per_param(master_weights: Any, state_dtype: Any, param_dtype: torch.dtype, *,
                          amsgrad: bool = False) -> float:
    """Resident optimizer-state bytes per param element (masters + moments), from the descriptions."""
    mk = moment_kind(state_dtype)
    if amsgrad and mk is INT8_MOMENTS:
        raise ValueError("amsgrad is not supported with state_dtype='8bit'")
    return (master_kind(master_weights, param_dtype).bytes_per_element(param_dtype)
            + mk.bytes_per_element() + (4.0 if amsgrad else 0.0))


__all__ = [
    "FP32",
    "INT8",
    "INT8_MOMENTS",
    "MASTER_KINDS",
    "MOMENT8_GROUP",
    "MOMENT_KINDS",
    "MOMENT_STATE_KEYS",
    "NONE",
    "REMAINDER",
    "STORED_MASTERS",
    "DenseMoments",
    "Int8Moments",
    "MasterKind",
    "MomentKind",
    "flat_view",
    "laid",
    "like",
    "master_kind",
    "master_to_remainder",
    "moment8_groups",
    "moment_kind",
    "moments_fp32",
    "remainder_to_master",
    "saved_kind",
    "state_bytes_per_param",
    "stored_kinds",
]
