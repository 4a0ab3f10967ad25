"""The moment kinds: fp32 / bf16 (one value per element), 8-bit companded, 4-bit exp_avg + 8-bit
exp_avg_sq (see :mod:`.base`)."""

from __future__ import annotations

from typing import ClassVar

import torch

from ... import codecs, distributed, reference_codecs
from ...distributed import local as _local
from .base import ALL_BACKENDS, KernelTensors, MomentKind, State, Tensor, flat_view, laid, like

#: elements per scale of the 8-bit moments: consecutive elements of a tensor's buffer
_PLAIN = (torch.nn.Parameter, torch.Tensor)
MOMENT8_GROUP = reference_codecs.MOM8_GROUP
moment8_groups = reference_codecs.moment8_groups


def _local_numel(p: Tensor) -> int:
    """Elements of the shard the kernel steps (a plain tensor's own: state creation runs per param)."""
    return p.numel() if type(p) in _PLAIN else _local(p).numel()


class DenseMoments(MomentKind):
    """fp32 or bf16 moments, one value per element (bf16 ones stored with stochastic rounding by the kernel)."""

    keys = ("exp_avg", "exp_avg_sq")
    kernel_backends = ALL_BACKENDS
    needs_write_back = False

    def __init__(self, name: str, dtype: torch.dtype, label: str) -> None:
        self.name, self.dtype, self.label, self.aliases = name, dtype, label, (dtype,)
        self.codec = name  # "float32" / "bfloat16": the op's moment_codec

    def bytes_per_element(self) -> float:
        return 2.0 * self.dtype.itemsize

    def has_state(self, st: State) -> bool:
        return "exp_avg" in st or "exp_avg_sq" in st

    def has_moment(self, st: State, key: str) -> bool:
        return key in st

    def create(self, p: Tensor) -> State:
        return {"exp_avg": like(p, self.dtype).zero_(), "exp_avg_sq": like(p, self.dtype).zero_()}

    def from_fp32(self, p: Tensor, m: Tensor, v: Tensor) -> State:
        return {"exp_avg": laid(p, m, self.dtype), "exp_avg_sq": laid(p, v, self.dtype)}

    def copy_saved(self, p: Tensor, src: State) -> State | None:
        if not self.has_state(src):
            return None
        out = {}
        for key in self.keys:  # any dtype: AdamW's are the param's dtype or fp32
            val = src.get(key)
            out[key] = laid(p, val, self.dtype) if val is not None else like(p, self.dtype).zero_()
        return out

    def kernel_tensors(self, st: State) -> KernelTensors:
        return st["exp_avg"], st["exp_avg_sq"], None, None  # a plain tuple: this runs per param per step

    def to_fp32(self, st: State, key: str) -> Tensor:
        return st[key].to(torch.float32, copy=True)


class Int8Moments(MomentKind):
    """``state_dtype="8bit"``: each moment as one byte per element plus a bf16 scale per group of
    :data:`MOMENT8_GROUP` consecutive elements of the param's buffer (2.125 B/param for both).

    Codec 2, "ladder" codes (``csrc/include/mpkern/math.h``): a magnitude code ``q`` stands for
    ``u(q) = F(q) - 1``, ``F(q)`` the fp32 number with bit pattern ``bits(1.0) + (q << 19)`` -- the
    values 0, 1/16, 2/16, ... in steps of 1/16 up to 1, then doubling every 16 codes (4 mantissa
    bits), so that small values keep relative precision -- and an element is ``u(q) * s``, ``s`` its
    group's scale, the smallest power of two that puts the group's largest magnitude at or below the
    top code's value (stored as bf16, exactly). ``exp_avg``: an int8 sign-magnitude byte (bit 7 the
    sign, ``q`` in [0, 127], ``u`` up to 247), state ``exp_avg_q8``; ``exp_avg_sq``: a uint8 ``q`` in
    [0, 255] (``u`` up to 63487; a positive value never decodes to 0, which keeps ``m / sqrt(v)``
    bounded), state ``exp_avg_sq_q8``. The kernel decodes, updates and re-encodes in registers with
    value-unbiased stochastic rounding between neighbouring codes (seeded); conversions here round to
    the nearest code. The codec is ``mpkern.reference_codecs.moment8_*``. Checkpoints of the first
    codec (keys ``exp_avg_code`` / ``exp_avg_sq_code``) are converted when loaded (:mod:`.legacy_moments`).

    ``keys`` are, in this order: the exp_avg codes, the exp_avg_sq codes, their two scales.
    Subclasses change how ``exp_avg`` is coded (:meth:`_m_code`, :meth:`_encode_m`,
    :meth:`_decode_m`, the ``exp_avg`` code key and its bytes); ``exp_avg_sq`` (uint8, laid out like
    the param) and the scales are the same for all (their decoding: :meth:`_decode_v`).
    """

    name, label = "8bit", "8-bit moments"
    codec = "8bit"
    keys = ("exp_avg_q8", "exp_avg_sq_q8", "exp_avg_scale", "exp_avg_sq_scale")
    kernel_backends = ALL_BACKENDS
    needs_write_back = False
    amsgrad = False
    amsgrad_why = (" (max_exp_avg_sq would need its own 8-bit codec); use state_dtype=torch.bfloat16 or "
                   "amsgrad=False")
    adamw_conversion = "to the nearest code"
    #: bytes of one element's exp_avg code
    m_code_bytes: ClassVar[float] = 1.0
    _CODE: ClassVar[dict[str, tuple[str, str]]] = {"exp_avg": ("exp_avg_q8", "exp_avg_scale"),
                                                   "exp_avg_sq": ("exp_avg_sq_q8", "exp_avg_sq_scale")}

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def bytes_per_element(self) -> float:
        """Both moments with their scales, for a numel that is a multiple of the group (a short last
        group costs its whole scale)."""
        return self.m_code_bytes + 1.0 + 2.0 * torch.bfloat16.itemsize / MOMENT8_GROUP

    @property
    def row(self) -> codecs.MomentCodec:
        """The op's codec of this kind (its tensors' dtypes and layout): :attr:`codec`'s row of
        :data:`mpkern.codecs.MOMENT_CODECS`."""
        return codecs.moment_codec(self.codec)

    # ---- how exp_avg is coded (the 8-bit kind: one code per element, laid out like the param) ----
    def _m_code(self, p: Tensor) -> Tensor:
        """An empty exp_avg code tensor for ``p``."""
        return like(p, self.row.exp_avg_dtype)

    def _encode_m(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(codes, scales) of 1-D fp32 ``x`` (a buffer in memory order), to the nearest code."""
        return moment8_encode(x, "exp_avg")

    def _decode_m(self, codes: Tensor, scales: Tensor, numel: int) -> Tensor:
        """The 1-D fp32 exp_avg of ``numel`` elements of 1-D ``codes`` (memory order)."""
        return moment8_decode(codes, scales, "exp_avg")

    def _decode_v(self, codes: Tensor, scales: Tensor) -> Tensor:
        """The 1-D fp32 exp_avg_sq of 1-D uint8 ``codes`` (memory order) and their scales."""
        return moment8_decode(codes, scales, "exp_avg_sq")

    def _scales(self, p: Tensor) -> Tensor:
        return torch.zeros(moment8_groups(_local_numel(p)), dtype=torch.bfloat16, device=p.device)

    def create(self, p: Tensor) -> State:
        mk, vk, ms, vs = self.keys
        return {mk: self._m_code(p).zero_(), vk: like(p, self.row.exp_avg_sq_dtype).zero_(), ms: self._scales(p),
                vs: self._scales(p)}

    def from_fp32(self, p: Tensor, m: Tensor, v: Tensor) -> State:
        st = self.create(p)
        for key, val in (("exp_avg", m), ("exp_avg_sq", v)):
            ck, sk = self._CODE[key]
            x = flat_view(_local(laid(p, val, torch.float32)))  # laid out like p: its memory order is the kernel's
            codes, scales = self._encode_m(x) if key == "exp_avg" else moment8_encode(x, key)
            flat_view(_local(st[ck])).copy_(codes)
            st[sk] = scales
        return st

    def copy_saved(self, p: Tensor, src: State) -> State | None:
        if self.keys[0] not in src:
            return None
        check_moment8(p, src, "the checkpoint's", self)
        mk, vk, ms, vs = self.keys
        codes = src[vk]
        want = like(p, torch.uint8)
        if (distributed.is_dtensor(p) or distributed.is_dtensor(codes) or codes.shape != p.shape
                or codes.stride() != want.stride()):
            return None  # grouped in another memory order, or to be sharded: through fp32
        dev = p.device
        return {mk: self._m_code(p).copy_(src[mk]), vk: want.copy_(codes),
                ms: src[ms].to(dev, torch.bfloat16).reshape(-1).clone(),
                vs: src[vs].to(dev, torch.bfloat16).reshape(-1).clone()}

    def kernel_tensors(self, st: State) -> KernelTensors:
        mk, vk, ms, vs = self.keys
        return st[mk], st[vk], st[ms], st[vs]

    def shape_tensor(self, st: State) -> Tensor | None:
        return st.get(self.keys[1])  # the exp_avg_sq codes: laid out like the param (the exp_avg ones may be packed)

    def to_fp32(self, st: State, key: str) -> Tensor:
        ck, sk = self._CODE[key]
        shape = st[self.keys[1]]  # the exp_avg_sq codes: laid out like the param (and a DTensor like it)
        out = torch.empty_like(shape, dtype=torch.float32, memory_format=torch.preserve_format)
        flat = flat_view(_local(st[ck]))
        scales = _local(st[sk]).reshape(-1)
        val = self._decode_m(flat, scales, _local(shape).numel()) if key == "exp_avg" else self._decode_v(flat, scales)
        flat_view(_local(out)).copy_(val)
        return out

    def export(self, p: Tensor, st: State) -> State:
        """DTensor params (FSDP2, tensor parallel): the scales belong to the local shard's buffer and
        cannot be resharded, so the moments are saved dequantized as fp32 DTensors ``exp_avg`` /
        ``exp_avg_sq`` (quantized again when loaded, to the nearest code of the new shard's groups)."""
        if not distributed.is_dtensor(p) or not self.has_state(st):
            return st
        out = {k: v for k, v in st.items() if k not in self.keys}
        for key in ("exp_avg", "exp_avg_sq"):
            out[key] = self.to_fp32(st, key)
        return out

    def relay(self, p: Tensor, st: State) -> bool:
        """Follow a param that moved to another device or memory layout (the groups are runs of its
        buffer: another layout regroups, through fp32). True if anything changed."""
        if not self.has_state(st) or distributed.is_dtensor(p):
            return False
        want = like(p, torch.uint8)
        codes = st[self.keys[1]]
        if want.stride() != codes.stride():
            st.update(self.from_fp32(p, self.to_fp32(st, "exp_avg"), self.to_fp32(st, "exp_avg_sq")))
            return True
        if codes.device != p.device:
            for key in self.keys:
                st[key] = st[key].to(p.device)
            return True
        return False


class Int4Moments(Int8Moments):
    """``state_dtype="4bit_m"``: ``exp_avg`` in 4 bits, two codes per byte, ``exp_avg_sq`` as the
    8-bit kind's; a bf16 scale per group of :data:`MOMENT8_GROUP` for each (1.625 B/param for both;
    6.625 B/param with the 8-bit master, bf16 param and grad).

    ``exp_avg``: a sign-magnitude nibble (bit 3 the sign) whose 3-bit magnitude code is on the ladder
    of 1 mantissa bit -- ``u`` in {0, 1/2, 1, 2, 3, 5, 7, 11} -- times the group's power-of-two scale
    (the smallest that puts the group's largest magnitude at or below 11), stochastically rounded by
    the kernels from the same random field; the codes (state ``exp_avg_q4``) are a 1-D uint8 tensor of
    ``ceil(numel / 2)`` bytes over the param's buffer in memory order (element 2j in the low nibble
    of byte j). ``exp_avg_sq`` stays 8-bit (``exp_avg_sq_q8``): every 4-bit ``exp_avg_sq``
    formulation measured trains outside 1 % of fp32 AdamW (``docs/fourbit_study.md``). Codec:
    ``mpkern.reference_codecs.moment4_*`` (``math.h`` ``mom4_*``).
    """

    name, label = "4bit_m", "4-bit m + 8-bit v moments"
    codec = "4bit_m"
    keys = ("exp_avg_q4", "exp_avg_sq_q8", "exp_avg_scale", "exp_avg_sq_scale")
    amsgrad_why = (" (max_exp_avg_sq would need its own compact codec); use state_dtype=torch.bfloat16 or "
                   "amsgrad=False")
    m_code_bytes: ClassVar[float] = 0.5
    _CODE: ClassVar[dict[str, tuple[str, str]]] = {"exp_avg": ("exp_avg_q4", "exp_avg_scale"),
                                                   "exp_avg_sq": ("exp_avg_sq_q8", "exp_avg_sq_scale")}

    def _m_code(self, p: Tensor) -> Tensor:
        return torch.empty((_local_numel(p) + 1) // 2, dtype=torch.uint8, device=p.device)

    def _encode_m(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return reference_codecs.moment4_encode(x)

    def _decode_m(self, codes: Tensor, scales: Tensor, numel: int) -> Tensor:
        return reference_codecs.moment4_decode(codes, scales, numel)


def check_moment8(p: Tensor, st: State, whose: str, kind: Int8Moments | None = None) -> None:
    """ValueError unless ``st``'s 8-bit (or ``kind``'s) moments fit ``p`` (codes of its numel, one
    scale per group), naming the first entry that does not: missing, or of another size or dtype."""
    kind = kind if kind is not None else INT8
    mk, vk, ms, vs = kind.keys
    row = kind.row
    n = p.numel()
    local = _local(p).numel() if distributed.is_dtensor(st.get(vk)) else n
    groups = -(-local // row.group)
    m4 = row.codes_per_byte == 2
    for key, want, dtype in ((mk, row.exp_avg_numel(local) if m4 else n, row.exp_avg_dtype),
                             (vk, n, row.exp_avg_sq_dtype), (ms, groups, torch.bfloat16), (vs, groups, torch.bfloat16)):
        t = st.get(key)
        if not isinstance(t, Tensor) or t.numel() != want or t.dtype != dtype:
            got = "missing" if not isinstance(t, Tensor) else f"{t.numel()} elements of {t.dtype}"
            what = ("4-bit exp_avg: two codes per byte, 8-bit exp_avg_sq" if m4 else "8-bit moments: one code per "
                    "element")
            raise ValueError(f"FusedAdamWMP.load_state_dict: {whose} {key} is {got}; a param of shape "
                             f"{tuple(p.shape)} needs {want} elements of {dtype} ({kind.label}; {what}, one bf16 "
                             f"scale per {row.group})")


INT8 = Int8Moments()


def moment8_encode(values: Tensor, key: str) -> tuple[Tensor, Tensor]:
    """(codes, scales) of the 1-D fp32 ``values`` (a buffer in memory order), to the nearest code."""
    return reference_codecs.moment8_encode(values, key)


def moment8_decode(codes: Tensor, scales: Tensor, key: str) -> Tensor:
    """The fp32 values of 1-D ``codes`` (memory order) and their group scales (the codes' dtype says
    which moment: int8 ``exp_avg``, uint8 ``exp_avg_sq``)."""
    return reference_codecs.moment8_decode(codes, scales)
