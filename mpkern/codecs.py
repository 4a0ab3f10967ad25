"""The codecs of ``mpkern::adamw_step_`` and the op schemas, from their one declaration,
``mpkern/codecs.def``.

The C++ kernels compile that file (``csrc/include/mpkern/codecs.h``); this module parses it, so the
table exists without the native extension, and :func:`check_native` refuses an extension compiled
from another table. Every backend takes a call's codecs from here by name -- the op's
``master_codec`` / ``moment_codec`` strings -- never from a tensor's dtype, so two formats may share
a dtype:

* :data:`MASTER_CODECS`: ``master_codec`` -> :class:`MasterCodec` (the kernels' mode, the master
  tensor's dtype);
* :data:`MOMENT_CODECS`: ``moment_codec`` -> :class:`MomentCodec` (mode, the moment tensors' dtypes,
  the scale group, codes per byte, and the torch backend's decoders and encoders). Rows from the file
  are ``native`` (every C++ backend knows them); :func:`register_moment_codec` adds a codec that only
  the torch backend runs (a format being tried out, a test's second format);
* :data:`SCHEMAS`: op name -> schema string.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import reference_codecs

Tensor = torch.Tensor
#: the table's file
DEF_PATH = Path(__file__).with_name("codecs.def")
#: the table's dtype names (c10::ScalarType's) -> torch dtypes
DTYPES: dict[str, torch.dtype | None] = {"Undefined": None, "Float": torch.float32, "Half": torch.float16,
                                         "BFloat16": torch.bfloat16, "Char": torch.int8, "Byte": torch.uint8,
                                         "Short": torch.int16}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items() if v is not None}
#: the first mode a codec registered from Python gets (the file's modes stay below it)
FIRST_PYTHON_MODE = 100

#: (codes, scales or None, numel) -> the 1-D fp32 moment of ``numel`` elements
Decoder = Callable[[Tensor, "Tensor | None", int], Tensor]
#: (fp32 values, int64 random 16 bits of their shape) -> (codes as stored, 1-D bf16 scales or None)
Encoder = Callable[[Tensor, Tensor], "tuple[Tensor, Tensor | None]"]


@dataclass(frozen=True)
class MasterCodec:
    """A ``master_codec`` of ``adamw_step_``: its ``mode`` (the kernels' MasterMode) and the dtype of
    the per-param master tensor (None: no master tensor)."""

    name: str
    mode: int
    state_dtype: torch.dtype | None


@dataclass(frozen=True)
class MomentCodec:
    """A ``moment_codec`` of ``adamw_step_``: the tensors it keeps and how the torch backend reads them.

    ``exp_avg_dtype`` / ``exp_avg_sq_dtype``: the moment tensors' dtypes; ``group``: elements per bf16
    scale in ``exp_avg_scales`` / ``exp_avg_sq_scales`` (0: no scales); ``codes_per_byte``: 2 when
    the ``exp_avg`` codes are packed nibbles (``ceil(numel / 2)`` bytes); ``native``: a row of
    ``codecs.def``, which the C++ / CUDA kernels implement. The decoders and encoders (see
    :data:`Decoder`, :data:`Encoder`) are the torch backend's codec.
    """

    name: str
    mode: int
    exp_avg_dtype: torch.dtype
    exp_avg_sq_dtype: torch.dtype
    group: int
    codes_per_byte: int
    decode_exp_avg: Decoder
    decode_exp_avg_sq: Decoder
    encode_exp_avg: Encoder
    encode_exp_avg_sq: Encoder
    native: bool = True

    @property
    def grouped(self) -> bool:
        """Whether the moments are codes with a bf16 scale per :attr:`group` elements."""
        return self.group > 0

    def exp_avg_numel(self, numel: int) -> int:
        """Elements of the ``exp_avg`` tensor of a param of ``numel`` elements."""
        return -(-int(numel) // self.codes_per_byte)

    def row(self) -> tuple[str, str, str, int, int]:
        """The row as the native argument check takes it: (name, exp_avg dtype, exp_avg_sq dtype,
        group, codes per byte), the dtypes by their table names."""
        return (self.name, _DTYPE_NAMES[self.exp_avg_dtype], _DTYPE_NAMES[self.exp_avg_sq_dtype], self.group,
                self.codes_per_byte)


# ---- the file ------------------------------------------------------------------------------------
_CALL = re.compile(r"\bMPKERN_(MASTER_CODEC|MOMENT_CODEC|OP_SCHEMA)\(")
_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')


def _arguments(text: str, start: int) -> tuple[list[str], int]:
    """The comma-separated arguments of the macro call whose "(" is at ``start - 1``, and the index
    after its ")" (strings and nested parentheses kept whole)."""
    args, cur, depth, i = [], [], 0, start
    while i < len(text):
        c = text[i]
        if c == '"':
            m = _STRING.match(text, i)
            if m is None:
                raise ValueError(f"{DEF_PATH.name}: unterminated string at offset {i}")
            cur.append(m.group(0))
            i = m.end()
            continue
        if c == "(":
            depth += 1
        elif c == ")":
            if depth == 0:
                args.append("".join(cur).strip())
                return args, i + 1
            depth -= 1
        elif c == "," and depth == 0:
            args.append("".join(cur).strip())
            cur = []
            i += 1
            continue
        cur.append(c)
        i += 1
    raise ValueError(f"{DEF_PATH.name}: unclosed macro call at offset {start}")


def _value(arg: str) -> str | int:
    """A row's argument: adjacent string literals joined, an integer, or an identifier."""
    if arg.startswith('"'):
        return "".join(m.group(1) for m in _STRING.finditer(arg))
    return int(arg) if re.fullmatch(r"-?\d+", arg) else arg


def parse(text: str) -> dict[str, list[tuple[Any, ...]]]:
    """The rows of a ``codecs.def`` text: ``{"master": [(name, mode, state dtype name)], "moment":
    [(name, mode, exp_avg dtype name, exp_avg_sq dtype name, group, codes per byte)], "schemas":
    [(op, schema)]}`` -- the form of ``mpkern._C.codec_table()`` (the C++ identifiers dropped)."""
    text = re.sub(r"//[^\n]*", "", text)
    out: dict[str, list[tuple[Any, ...]]] = {"master": [], "moment": [], "schemas": []}
    arity = {"MASTER_CODEC": 4, "MOMENT_CODEC": 7, "OP_SCHEMA": 2}
    for m in _CALL.finditer(text):
        args, _ = _arguments(text, m.end())
        if len(args) != arity[m.group(1)]:
            raise ValueError(f"{DEF_PATH.name}: MPKERN_{m.group(1)} takes {arity[m.group(1)]} arguments, got "
                             f"{len(args)}: {args}")
        vals = [_value(a) for a in args]
        if m.group(1) == "MASTER_CODEC":
            out["master"].append(tuple(vals[1:]))
        elif m.group(1) == "MOMENT_CODEC":
            out["moment"].append(tuple(vals[1:]))
        else:
            out["schemas"].append((vals[0], vals[1]))
    return out


_TABLE = parse(DEF_PATH.read_text())

#: ``master_codec`` -> :class:`MasterCodec`, in the file's order
MASTER_CODECS: dict[str, MasterCodec] = {
    name: MasterCodec(name, mode, DTYPES[dtype]) for name, mode, dtype in _TABLE["master"]}
#: op name -> its schema (``torch.ops.mpkern.<op>``)
SCHEMAS: dict[str, str] = dict(_TABLE["schemas"])


def _native_row(name: str, mode: int, m: str, v: str, group: int, per_byte: int) -> MomentCodec:
    fns = reference_codecs.REFERENCE_MOMENT_CODECS.get(name)
    if fns is None:
        raise RuntimeError(f"{DEF_PATH.name}: moment codec {name!r} has no torch-backend codec in "
                           f"mpkern.reference_codecs.REFERENCE_MOMENT_CODECS")
    mt, vt = DTYPES[m], DTYPES[v]
    assert mt is not None and vt is not None, f"{DEF_PATH.name}: moment codec {name!r} needs dtypes"
    return MomentCodec(name, mode, mt, vt, group, per_byte, *fns)


#: ``moment_codec`` -> :class:`MomentCodec`: the file's rows, then the registered ones (the live registry)
MOMENT_CODECS: dict[str, MomentCodec] = {row[0]: _native_row(*row) for row in _TABLE["moment"]}


def _quoted(names: list[str]) -> str:
    q = [f"'{n}'" for n in names]
    return q[0] if len(q) == 1 else ", ".join(q[:-1]) + " or " + q[-1]


def master_codec(name: str, op: str = "mpkern::adamw_step_") -> MasterCodec:
    """The master codec called ``name``; ValueError naming the codecs otherwise (the native check's words)."""
    codec = MASTER_CODECS.get(name) if isinstance(name, str) else None
    if codec is None:
        raise ValueError(f"{op}: master_codec must be {_quoted(list(MASTER_CODECS))}, got {name!r}")
    return codec


def moment_codec(name: str, op: str = "mpkern::adamw_step_") -> MomentCodec:
    """The moment codec called ``name``; ValueError naming the codecs otherwise (the native check's words)."""
    codec = MOMENT_CODECS.get(name) if isinstance(name, str) else None
    if codec is None:
        raise ValueError(f"{op}: moment_codec must be {_quoted(list(MOMENT_CODECS))}, got {name!r}")
    return codec


def register_moment_codec(name: str, exp_avg_dtype: torch.dtype, exp_avg_sq_dtype: torch.dtype, *, group: int,
                          codes_per_byte: int = 1, decode_exp_avg: Decoder, decode_exp_avg_sq: Decoder,
                          encode_exp_avg: Encoder, encode_exp_avg_sq: Encoder) -> MomentCodec:
    """Add a moment codec that the torch backend runs (``moment_codec=name`` of ``adamw_step_``);
    returns it, with the next free mode from :data:`FIRST_PYTHON_MODE`. The native kernels know only
    ``codecs.def``'s rows: a kind storing this codec declares ``kernel_backends = {"torch"}``.

    ValueError for a taken name or a bad group / codes per byte, TypeError for a non-dtype or a
    non-callable codec function."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_moment_codec: name must be a non-empty str, got {name!r}")
    if name in MOMENT_CODECS:
        raise ValueError(f"register_moment_codec: moment codec {name!r} exists")
    for arg, dt in (("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
        if dt not in _DTYPE_NAMES:
            raise TypeError(f"register_moment_codec: {arg} must be one of {sorted(map(str, _DTYPE_NAMES))}, "
                            f"got {dt!r}")
    if not isinstance(group, int) or group < 0:
        raise ValueError(f"register_moment_codec: group must be an int >= 0 (elements per scale, 0: none), "
                         f"got {group!r}")
    if codes_per_byte not in (1, 2):
        raise ValueError(f"register_moment_codec: codes_per_byte must be 1 or 2, got {codes_per_byte!r}")
    fns = (decode_exp_avg, decode_exp_avg_sq, encode_exp_avg, encode_exp_avg_sq)
    for arg, fn in zip(("decode_exp_avg", "decode_exp_avg_sq", "encode_exp_avg", "encode_exp_avg_sq"), fns):
        if not callable(fn):
            raise TypeError(f"register_moment_codec: {arg} must be callable, got {fn!r}")
    mode = max([FIRST_PYTHON_MODE - 1, *(c.mode for c in MOMENT_CODECS.values())]) + 1
    codec = MomentCodec(name, mode, exp_avg_dtype, exp_avg_sq_dtype, group, codes_per_byte, *fns, native=False)
    MOMENT_CODECS[name] = codec
    return codec


def unregister_moment_codec(name: str) -> None:
    """Remove a codec :func:`register_moment_codec` added (the file's rows stay: ValueError)."""
    codec = moment_codec(name)
    if codec.native:
        raise ValueError(f"unregister_moment_codec: {name!r} is a row of {DEF_PATH.name}, not a registered codec")
    del MOMENT_CODECS[name]


def check_native(compiled: dict[str, Any]) -> None:
    """RuntimeError unless the native extension's table (``mpkern._C.codec_table()``) is this file's:
    an extension built from another ``codecs.def`` would run other codecs than the ones named."""
    mine = {"master": [tuple(r) for r in _TABLE["master"]], "moment": [tuple(r) for r in _TABLE["moment"]],
            "schemas": dict(_TABLE["schemas"])}
    theirs = {"master": [tuple(r) for r in compiled.get("master", ())],
              "moment": [tuple(r) for r in compiled.get("moment", ())], "schemas": dict(compiled.get("schemas", {}))}
    if mine != theirs:
        diff = [k for k in mine if mine[k] != theirs[k]]
        raise RuntimeError(f"mpkern._C was compiled from another {DEF_PATH} (its {', '.join(diff)} differ): a stale "
                           f"build; rebuild it (pip install --no-build-isolation -e .)")
