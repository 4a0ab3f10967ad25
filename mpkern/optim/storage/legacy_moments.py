"""Codec 1 of the compact moments, read-only: checkpoints saved before codec 2 (issue 43) load.

Codec 1 stored the 8-bit moments under the keys ``exp_avg_code`` (int8, two's complement ``c`` in
[-127, 127]) / ``exp_avg_sq_code`` (uint8 ``c``) and the 4-bit ``exp_avg`` under ``exp_avg_code4``
(two's complement nibbles ``c`` in [-7, 7], two per byte, element 2j in the low nibble of byte j),
each with a bf16 scale ``s`` per group of 32 consecutive elements of the buffer (``exp_avg_scale``,
``exp_avg_sq_scale``, the same keys as today's)::

    exp_avg    = sign(c) * s * c^2      (8 bits and 4 bits)
    exp_avg_sq = (s * c^2) * c^2

(exact in fp32; a NaN scale decodes its group as NaN). Codec 2 keeps other codes under other keys
(:class:`~.moments.Int8Moments`), so a checkpoint says which codec it holds.

The two kinds here are never kept by an optimizer: :func:`mpkern.optim.storage.saved_kind` finds
them in a checkpoint's per-param state after the registered kinds, and the load converts them once
through fp32 (:meth:`~.base.MomentKind.from_saved`): into ``"8bit"`` / ``"4bit_m"`` to the nearest
codec-2 code, into a dense kind exactly as decoded. Their entries are checked against the param
first (:func:`~.moments.check_moment8`: a ValueError naming the entry).
"""

from __future__ import annotations

from typing import ClassVar, NoReturn

import torch

from ... import codecs
from ...reference_codecs import grouped
from .base import State, Tensor
from .moments import Int8Moments, moment8_groups


def _check_scales(scales: Tensor, numel: int, where: str) -> None:
    if not isinstance(scales, Tensor) or scales.dtype != torch.bfloat16 or scales.numel() != moment8_groups(numel):
        got = f"{scales.dtype} with {scales.numel()}" if isinstance(scales, Tensor) else type(scales).__name__
        raise ValueError(f"{where}: scales must be bfloat16 with ceil(numel / 32) = {moment8_groups(numel)} "
                         f"elements, got {got}")


def legacy_moment8_decode(codes: Tensor, scales: Tensor) -> Tensor:
    """The fp32 moment of codec-1 8-bit ``codes`` and their bf16 ``scales`` (one per 32 consecutive
    elements of the flattened codes): a float32 tensor of ``codes.shape`` on ``codes``' device.

    int8 codes (``exp_avg``): ``sign(c) * s * c^2``; uint8 codes (``exp_avg_sq``): ``(s * c^2) * c^2``
    (fp32, exact: ``c^2 <= 65025`` and ``s`` has 8 significant bits). TypeError for other code dtypes,
    ValueError for scales of another dtype or count."""
    if not isinstance(codes, Tensor) or codes.dtype not in (torch.int8, torch.uint8):
        got = codes.dtype if isinstance(codes, Tensor) else type(codes).__name__
        raise TypeError(f"legacy_moment8_decode: codes must be int8 (exp_avg) or uint8 (exp_avg_sq), got {got}")
    _check_scales(scales, codes.numel(), "legacy_moment8_decode")
    n = codes.numel()
    s = scales.reshape(-1, 1).to(torch.float32)
    c = grouped(codes.reshape(-1).to(torch.float32))
    c2 = c * c
    x = s * (c * c.abs()) if codes.dtype == torch.int8 else (s * c2) * c2
    return x.reshape(-1)[:n].reshape(codes.shape)


def legacy_moment4_decode(packed: Tensor, scales: Tensor, numel: int) -> Tensor:
    """The fp32 ``exp_avg`` (1-D, ``numel`` elements) of codec-1 4-bit codes: uint8 ``packed`` of
    ``ceil(numel / 2)`` bytes, element 2j in the low nibble of byte j and 2j + 1 in the high one,
    each a two's complement nibble ``c``; ``sign(c) * s * c^2`` with the bf16 scale ``s`` of its
    group of 32. ValueError for codes or scales of another dtype or count."""
    numel = int(numel)
    if not isinstance(packed, Tensor) or packed.dtype != torch.uint8 or packed.numel() != (numel + 1) // 2:
        got = f"{packed.dtype} with {packed.numel()}" if isinstance(packed, Tensor) else type(packed).__name__
        raise ValueError(f"legacy_moment4_decode: packed must be uint8 with ceil(numel / 2) = {(numel + 1) // 2} "
                         f"bytes, got {got}")
    _check_scales(scales, numel, "legacy_moment4_decode")
    b = packed.reshape(-1).to(torch.int32)
    nib = torch.stack([b & 0xF, b >> 4], dim=1).reshape(-1)[:numel]
    c = grouped(torch.where(nib >= 8, nib - 16, nib).to(torch.float32))
    x = scales.reshape(-1, 1).to(torch.float32) * (c * c.abs())
    return x.reshape(-1)[:numel]


class Codec1Moments(Int8Moments):
    """Codec-1 8-bit moments in a checkpoint (``exp_avg_code`` / ``exp_avg_sq_code`` + the scales):
    read and checked like today's 8-bit kind, decoded by :func:`legacy_moment8_decode`; never kept
    (:meth:`create` and :meth:`from_fp32` raise, :meth:`copy_saved` takes nothing as saved)."""

    name, label = "8bit-codec1", "8-bit moments of codec 1 (checkpoints only)"
    codec = ""  # no kernel reads it
    kernel_backends: frozenset[str] = frozenset()
    keys = ("exp_avg_code", "exp_avg_sq_code", "exp_avg_scale", "exp_avg_sq_scale")
    _CODE: ClassVar[dict[str, tuple[str, str]]] = {"exp_avg": ("exp_avg_code", "exp_avg_scale"),
                                                   "exp_avg_sq": ("exp_avg_sq_code", "exp_avg_sq_scale")}

    @property
    def row(self) -> codecs.MomentCodec:
        """Codec 1 kept its codes in the tensors of codec 2's kind (dtypes, sizes, groups): that row."""
        return codecs.moment_codec("8bit")

    def _decode_m(self, codes: Tensor, scales: Tensor, numel: int) -> Tensor:
        return legacy_moment8_decode(codes, scales)

    def _decode_v(self, codes: Tensor, scales: Tensor) -> Tensor:
        return legacy_moment8_decode(codes, scales)

    def _read_only(self) -> NoReturn:
        raise NotImplementedError(f"{self.label}: checkpoints of codec 1 are converted when loaded, never stored")

    def create(self, p: Tensor) -> State:
        self._read_only()

    def from_fp32(self, p: Tensor, m: Tensor, v: Tensor) -> State:
        self._read_only()

    def copy_saved(self, p: Tensor, src: State) -> State | None:
        return None  # never taken as saved: converted by the kind that loads it


class Codec1Moments4(Codec1Moments):
    """Codec-1 4-bit ``exp_avg`` (``exp_avg_code4``, two nibbles per byte) with the codec-1 8-bit
    ``exp_avg_sq`` in a checkpoint, decoded by :func:`legacy_moment4_decode`; never kept."""

    name, label = "4bit_m-codec1", "4-bit m + 8-bit v moments of codec 1 (checkpoints only)"
    keys = ("exp_avg_code4", "exp_avg_sq_code", "exp_avg_scale", "exp_avg_sq_scale")
    m_code_bytes: ClassVar[float] = 0.5
    _CODE: ClassVar[dict[str, tuple[str, str]]] = {"exp_avg": ("exp_avg_code4", "exp_avg_scale"),
                                                   "exp_avg_sq": ("exp_avg_sq_code", "exp_avg_sq_scale")}

    @property
    def row(self) -> codecs.MomentCodec:
        return codecs.moment_codec("4bit_m")

    def _decode_m(self, codes: Tensor, scales: Tensor, numel: int) -> Tensor:
        return legacy_moment4_decode(codes, scales, numel)


#: the codec-1 kinds a checkpoint may hold, in the order they are looked for
LEGACY_MOMENT_KINDS: tuple[Int8Moments, ...] = (Codec1Moments(), Codec1Moments4())

__all__ = ["LEGACY_MOMENT_KINDS", "Codec1Moments", "Codec1Moments4", "legacy_moment4_decode",
           "legacy_moment8_decode"]
