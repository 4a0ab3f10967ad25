"""How ``FusedAdamWMP`` keeps each part of a param's state: a registry of storage-kind descriptions.

A *master kind* says how the fp32 master of a param is kept (``master_weights=``): ``True`` (an
fp32 copy), ``"remainder"`` (bf16 params: the low 16 bits in an int16 tensor), ``"8bit"`` (bf16 /
fp16 params: a stochastically rounded one-byte correction), ``False`` (the param is the value). A
*moment kind* says how ``exp_avg`` / ``exp_avg_sq`` are kept (``state_dtype=``): ``"float32"``,
``"bfloat16"`` (stochastically rounded), ``"8bit"`` (ladder codes + a power-of-two bf16 scale per
32) or ``"4bit_m"`` (a 4-bit ``exp_avg``, two codes per byte, with the 8-bit ``exp_avg_sq``).
Checkpoints of the first compact codec load through the read-only kinds of :mod:`.legacy_moments`.

Each description (:mod:`.base`, :mod:`.masters`, :mod:`.moments`) says everything about itself;
validation, checkpoint conversion, master export, re-seeding after external writes, byte counts
and labels are driven by this registry, and nothing outside this package names a kind. Adding a
kind is one description plus its kernel variants (:func:`register_moment_kind`; a moment kind
without a kernel variant runs on the ``torch`` backend through its fp32 encode/decode).

The public API (used by the optimizer, ``mpkern plan`` / ``compare`` / ``bench``):
:func:`modes`, :func:`label`, :func:`bytes_per_param`, :func:`master_kind`, :func:`moment_kind`,
:func:`moment_name`, :func:`parse_master`, :func:`parse_moments`, :func:`register_moment_kind` /
:func:`unregister_moment_kind`, :func:`register_master_kind` / :func:`unregister_master_kind`.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import codecs
from .base import (
    ALL_BACKENDS,
    KernelMoments,
    MasterKind,
    MomentKind,
    State,
    flat_view,
    laid,
    like,
    master_to_remainder,
    remainder_to_master,
)
from .legacy_moments import LEGACY_MOMENT_KINDS, legacy_moment4_decode, legacy_moment8_decode
from .masters import Fp32Master, Int8Master, NoMaster, RemainderMaster
from .moments import (
    INT8 as _INT8_KIND,
    MOMENT8_GROUP,
    DenseMoments,
    Int4Moments,
    Int8Moments,
    check_moment8,
    moment8_decode,
    moment8_encode,
    moment8_groups,
)

Tensor = torch.Tensor

#: ``master_weights=`` value -> kind, in registration order (the live registry; fp32 params keep none)
MASTER_KINDS: dict[Any, MasterKind] = {}
#: every master kind that keeps state, in the order a checkpoint's entries are looked for: registration
#: order, the exact ones first (a checkpoint holding several converts from the most precise)
STORED_MASTERS: list[MasterKind] = []
#: ``state_dtype`` name -> kind, in registration order (the live registry)
MOMENT_KINDS: dict[str, MomentKind] = {}
#: torch dtype -> moment kind name (``state_dtype=torch.bfloat16``, older checkpoints)
MOMENT_DTYPE_NAMES: dict[torch.dtype, str] = {}
#: the command-line words of the master kinds (their names and ``words``) -> ``master_weights=`` value
_MASTER_WORDS: dict[str, Any] = {}
#: the label words of the moment names (``fp32``, ``bf16`` moments)
_MOMENT_WORDS = {"fp32": "float32", "bf16": "bfloat16"}


def register_master_kind(kind: MasterKind, words: tuple[str, ...] = ()) -> MasterKind:
    """Add a master kind: ``master_weights=`` selects it by any of ``kind.accepts`` (the first is the
    value groups keep), the command line by its name or any of ``words``; returns it. ValueError when
    a value or word is taken, TypeError for anything but a named :class:`MasterKind` with values."""
    if not isinstance(kind, MasterKind) or not kind.name or not kind.accepts:
        raise TypeError(f"register_master_kind: want a MasterKind with a name and accepts, got {kind!r}")
    taken = [v for v in kind.accepts if any(v is k or (type(v) is type(k) and v == k) for k in MASTER_KINDS)]
    names = [w.lower() for w in (kind.name, *words)]
    if taken or any(w in _MASTER_WORDS for w in names):
        raise ValueError(f"register_master_kind: master_weights={taken or names} is already registered")
    for v in kind.accepts:
        MASTER_KINDS[v] = kind
    if kind.key is not None:
        STORED_MASTERS.append(kind)
    for w in names:
        _MASTER_WORDS[w] = kind.accepts[0]
    return kind


def unregister_master_kind(name: str) -> None:
    """Remove the master kind ``name`` (tests that define their own kind); KeyError if there is none."""
    kind = next(k for k in MASTER_KINDS.values() if k.name == name)
    for v in kind.accepts:
        del MASTER_KINDS[v]
    if kind in STORED_MASTERS:
        STORED_MASTERS.remove(kind)
    for w in [w for w, v in _MASTER_WORDS.items() if any(v is a or (type(v) is type(a) and v == a)
                                                        for a in kind.accepts)]:
        del _MASTER_WORDS[w]


FP32 = register_master_kind(Fp32Master(), ("true",))
REMAINDER = register_master_kind(RemainderMaster())
INT8 = register_master_kind(Int8Master())
NONE = register_master_kind(NoMaster(), ("false",))


def register_moment_kind(kind: MomentKind) -> MomentKind:
    """Add a moment kind (``state_dtype=kind.name``, or any of ``kind.aliases``); returns it."""
    if not isinstance(kind, MomentKind) or not kind.name or not kind.keys:
        raise TypeError(f"register_moment_kind: want a MomentKind with a name and keys, got {kind!r}")
    if kind.name in MOMENT_KINDS:
        raise ValueError(f"register_moment_kind: state_dtype {kind.name!r} is already registered")
    row = codecs.MOMENT_CODECS.get(kind.codec)
    if row is None:
        raise ValueError(f"register_moment_kind: {kind.name!r} stores moment codec {kind.codec!r}, which is neither "
                         f"a row of mpkern/codecs.def nor registered (mpkern.codecs.register_moment_codec)")
    if not row.native and set(kind.kernel_backends) - {"torch"}:
        raise ValueError(f"register_moment_kind: {kind.name!r}'s codec {kind.codec!r} runs on the torch backend only "
                         f"(the native kernels know codecs.def's rows); kernel_backends "
                         f"{sorted(kind.kernel_backends)} must be {{'torch'}}")
    MOMENT_KINDS[kind.name] = kind
    for alias in kind.aliases:
        if isinstance(alias, torch.dtype):
            MOMENT_DTYPE_NAMES.setdefault(alias, kind.name)
    return kind


def unregister_moment_kind(name: str) -> None:
    """Remove the moment kind ``name`` (tests that define their own kind)."""
    kind = MOMENT_KINDS.pop(name)
    for alias in kind.aliases:
        if MOMENT_DTYPE_NAMES.get(alias) == name:
            del MOMENT_DTYPE_NAMES[alias]


register_moment_kind(DenseMoments("float32", torch.float32, "fp32 moments"))
register_moment_kind(DenseMoments("bfloat16", torch.bfloat16, "bf16 moments"))
INT8_MOMENTS = register_moment_kind(_INT8_KIND)
INT4_MOMENTS = register_moment_kind(Int4Moments())


#: the headline storage modes (issue 15), in table order: what bench / compare show by default
DEFAULT_MODES: tuple[tuple[Any, str], ...] = (
    (True, "float32"), ("remainder", "bfloat16"), ("8bit", "bfloat16"), ("8bit", "8bit"), ("remainder", "8bit"),
    ("8bit", "4bit_m"), ("remainder", "4bit_m"))


# ---- names ---------------------------------------------------------------------------------------
def moment_name(state_dtype: Any) -> str | None:
    """The registered name of a ``state_dtype=`` value (a name or a torch dtype), or None."""
    name = MOMENT_DTYPE_NAMES.get(state_dtype) if isinstance(state_dtype, torch.dtype) else state_dtype
    return name if isinstance(name, str) and name in MOMENT_KINDS else None


def check_state_dtype(state_dtype: Any) -> str:
    """``state_dtype`` as the name kept in the param groups; ValueError naming the accepted values."""
    name = moment_name(state_dtype)
    if name is None:
        accepted = [str(a) for k in MOMENT_KINDS.values() for a in k.aliases if isinstance(a, torch.dtype)]
        raise ValueError(f"state_dtype must be {', '.join(accepted)} (or {', '.join(map(repr, MOMENT_KINDS))}), "
                         f"got {state_dtype!r}")
    return name


def check_master_weights(master_weights: Any) -> MasterKind:
    """The kind ``master_weights=`` selects for 16-bit params; ValueError naming the accepted values."""
    if not any(master_weights is v or (type(master_weights) is type(v) and master_weights == v)
               for v in MASTER_KINDS):
        raise ValueError("master_weights must be " + ", ".join(map(repr, MASTER_KINDS))
                         + f", got {master_weights!r}")
    return MASTER_KINDS[master_weights]


def master_kind(master_weights: Any, param_dtype: torch.dtype) -> MasterKind:
    """The kind a param of ``param_dtype`` gets in a group with ``master_weights``."""
    return NONE if param_dtype == torch.float32 else MASTER_KINDS[master_weights]


def moment_kind(state_dtype: Any) -> MomentKind:
    """The kind for a group's ``state_dtype`` (a name, or a torch dtype from an older checkpoint)."""
    if isinstance(state_dtype, torch.dtype):
        state_dtype = MOMENT_DTYPE_NAMES[state_dtype]
    return MOMENT_KINDS[state_dtype]


def parse_master(word: str) -> Any:
    """The ``master_weights=`` value of a command-line word (``fp32``/``true``, ``remainder``, ``8bit``,
    ``none``/``false``); ValueError otherwise."""
    key = str(word).strip().lower()
    if key not in _MASTER_WORDS:
        raise ValueError(f"master kind {word!r}: want one of {sorted(_MASTER_WORDS)}")
    return _MASTER_WORDS[key]


def parse_moments(word: str) -> str:
    """The ``state_dtype`` name of a command-line word (a registered name, ``fp32``, ``bf16``)."""
    key = str(word).strip().lower()
    name = _MOMENT_WORDS.get(key, key)
    if name not in MOMENT_KINDS:
        raise ValueError(f"moment kind {word!r}: want one of {sorted(MOMENT_KINDS) + sorted(_MOMENT_WORDS)}")
    return name


def parse_mode(word: str) -> tuple[Any, str]:
    """``(master_weights, state_dtype)`` of a command-line ``MASTER:MOMENTS`` word (``remainder:bf16``,
    ``8bit:8bit``, ``fp32:fp32``; ``-`` also separates); ValueError naming both halves' words."""
    text = str(word).strip()
    sep = ":" if ":" in text else "-"
    mw, found, sd = text.partition(sep)
    if not found:
        raise ValueError(f"storage mode {word!r}: want MASTER:MOMENTS, e.g. remainder:8bit")
    return parse_master(mw), parse_moments(sd)


# ---- what plan / compare / bench print ----------------------------------------------------------
def label(master_weights: Any, state_dtype: Any) -> str:
    """``"remainder + bf16 moments"`` for ``("remainder", "bfloat16")``."""
    return f"{check_master_weights(master_weights).label} + {moment_kind(check_state_dtype(state_dtype)).label}"


def modes(param_dtype: torch.dtype = torch.bfloat16, *, backend: str | None = None) -> list[tuple[Any, str]]:
    """Every ``(master_weights, state_dtype)`` pair a param of ``param_dtype`` can be stepped with
    (on ``backend``, when given: only the kinds with a kernel there), in registry order."""
    out: list[tuple[Any, str]] = []
    for mw, mk in MASTER_KINDS.items():
        if param_dtype != torch.float32 and param_dtype not in mk.param_dtypes:
            continue
        if backend is not None and backend not in mk.kernel_backends:
            continue
        out.extend((mw, name) for name, k in MOMENT_KINDS.items()
                   if backend is None or backend in k.kernel_backends)
    return out


def bytes_per_param(master_weights: Any, state_dtype: Any, param_dtype: torch.dtype = torch.bfloat16, *,
                    amsgrad: bool = False) -> float:
    """Resident optimizer-state bytes per param element (masters + moments), from the descriptions."""
    mk = moment_kind(check_state_dtype(state_dtype))
    if amsgrad and not mk.amsgrad:
        raise ValueError(f"amsgrad is not supported with state_dtype={mk.name!r}")
    return (master_kind(master_weights, param_dtype).bytes_per_element(param_dtype)
            + mk.bytes_per_element() + (4.0 if amsgrad else 0.0))


state_bytes_per_param = bytes_per_param  # the older name


def check_amsgrad(amsgrad: Any, state_dtype: str, where: str) -> None:
    """ValueError if ``state_dtype``'s moment kind cannot keep ``max_exp_avg_sq``."""
    mk = moment_kind(state_dtype)
    if amsgrad and not mk.amsgrad:
        raise ValueError(f"FusedAdamWMP: amsgrad=True is not supported with state_dtype={mk.name!r}{where}"
                         f"{mk.amsgrad_why}")


def check_backend(master: MasterKind, state_dtype: Any, backend: str) -> None:
    """NotImplementedError unless ``backend`` has a kernel for ``master`` and the group's moment kind."""
    for kind, arg in ((master, "master_weights"), (moment_kind(state_dtype), "state_dtype")):
        if backend not in kind.kernel_backends:
            raise NotImplementedError(
                f"FusedAdamWMP: the {backend!r} backend has no kernel for {arg}={kind.name!r} ({kind.label}); "
                f"it runs on {', '.join(sorted(kind.kernel_backends))}: choose one for the step with "
                f"`with mpkern.use_backend(name):` (or MPKERN_BACKEND=name)")


# ---- saved state --------------------------------------------------------------------------------
def stored_kinds(st: State, but: MasterKind | None = None) -> list[MasterKind]:
    """The master kinds whose state is in ``st`` (other than ``but``)."""
    return [k for k in STORED_MASTERS if k is not but and k.key in st]


def moment_state_keys() -> tuple[str, ...]:
    """Every state key a moment kind owns, registered or of codec 1 (only ever in checkpoints): the
    byte model counts them as moments, a load takes them out of the entries it does not know."""
    kinds = (*MOMENT_KINDS.values(), *LEGACY_MOMENT_KINDS)
    return tuple(dict.fromkeys(k for mk in kinds for k in mk.keys))


def saved_kind(st: State) -> MomentKind | None:
    """The moment kind whose entries ``st`` holds (the first registered that owns them: fp32 for
    dense moments of any dtype; then the codec-1 kinds of old checkpoints), or None."""
    for kind in (*MOMENT_KINDS.values(), *LEGACY_MOMENT_KINDS):
        if kind.has_state(st):
            return kind
    return None


def moments_fp32(st: State, key: str) -> Tensor | None:
    """Moment ``key`` of ``st`` as a new fp32 tensor, whatever kind holds it (None: not there)."""
    kind = saved_kind(st)
    if kind is None or not kind.has_moment(st, key):
        return None
    return kind.to_fp32(st, key)


def moments_from_saved(p: Tensor, src: State, state_dtype: Any) -> State:
    """Moments of ``state_dtype``'s kind for ``p`` from a checkpoint's per-param entries. Grouped codes
    (8-bit, 4-bit, either codec) are checked against ``p`` before anything is decoded: a ValueError
    naming the entry that is missing or of another size or dtype."""
    saved = saved_kind(src)
    if isinstance(saved, Int8Moments):
        check_moment8(p, src, "the checkpoint's", saved)
    return moment_kind(state_dtype).from_saved(p, src, saved)


def moment_reference(st: State) -> Tensor | None:
    """The first moment tensor of ``st`` (any kind): the shape the state was made for."""
    kind = saved_kind(st)
    return None if kind is None else kind.shape_tensor(st)


def relay_moments(p: Tensor, st: State) -> bool:
    """Let the moment kind of ``st`` follow a param that moved (device, layout); True if it changed."""
    kind = saved_kind(st)
    return False if kind is None else kind.relay(p, st)


def export_state(p: Tensor, st: State) -> State:
    """``st`` as ``state_dict()`` saves it (see :meth:`MomentKind.export`)."""
    kind = saved_kind(st)
    return st if kind is None else kind.export(p, st)


__all__ = [
    "ALL_BACKENDS", "DEFAULT_MODES", "FP32", "INT4_MOMENTS", "INT8", "INT8_MOMENTS", "LEGACY_MOMENT_KINDS",
    "MASTER_KINDS", "MOMENT8_GROUP", "MOMENT_DTYPE_NAMES", "MOMENT_KINDS", "NONE", "REMAINDER", "STORED_MASTERS",
    "DenseMoments", "Int4Moments", "Int8Moments", "KernelMoments", "MasterKind", "MomentKind", "bytes_per_param",
    "check_amsgrad", "check_backend", "check_master_weights", "check_moment8", "check_state_dtype", "export_state",
    "flat_view", "label", "laid", "legacy_moment4_decode", "legacy_moment8_decode", "like", "master_kind",
    "master_to_remainder", "modes", "moment8_decode", "moment8_encode", "moment8_groups", "moment_kind", "moment_name",
    "moment_reference", "moment_state_keys", "moments_fp32", "moments_from_saved", "parse_master", "parse_moments",
    "register_master_kind", "register_moment_kind", "relay_moments", "remainder_to_master", "saved_kind",
    "state_bytes_per_param", "stored_kinds", "unregister_master_kind", "unregister_moment_kind",
]
