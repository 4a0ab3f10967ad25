"""The op layer: ``torch.ops.mpkern.*`` schemas, fake kernels, and backend routing.

* ``torch.ops.mpkern.<op>`` -- schema from the native extension's ``TORCH_LIBRARY(mpkern)``
  with its CPU and CUDA kernels. When the extension cannot be loaded, the same schemas are
  defined here and the pure-PyTorch reference is registered for them, so the op always exists.
* ``torch.ops.mpkern_triton.<op>`` -- the Triton kernels behind the same schema (a separate
  namespace, because one dispatch key can hold only one kernel per op).
* Fake (meta) kernels for all of them, so ``torch.compile`` and ``opcheck`` work.

The public API calls :func:`grad_stats` / :func:`scale_` here with the backend chosen by
:mod:`mpkern._backend`; nothing below this module calls back up.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from . import _backend, codecs, reference
from .op_args import AdamwArgs
from .triton_kernels.tables import StreamUse

Tensor = torch.Tensor

_ADAMW_SCHEMA = codecs.SCHEMAS["adamw_step_"]  # the one declaration: mpkern/codecs.def

_libs: list[torch.library.Library] = []  # keep registrations alive


# ---- adamw_step_'s flat schema <-> the bundle (mpkern.op_args.AdamwArgs) ---------------------------
# The one place in Python that knows the order of the op's arguments, and it reads it from the schema.
def _schema_signature(schema: str, defaults: dict[str, Any]) -> inspect.Signature:
    """The Python signature of an op schema: its arguments in order, keyword-only after ``*``, and
    ``defaults`` (the bundle's) for those the schema gives a default."""
    inner = schema[schema.index("(") + 1:schema.rindex(") ->")]
    params, keyword_only = [], False
    for arg in inner.split(", "):
        if arg == "*":
            keyword_only = True
            continue
        m = re.fullmatch(r"\S+ (\w+)(=\S+)?", arg)
        if m is None:
            raise RuntimeError(f"{codecs.DEF_PATH.name}: cannot read the argument {arg!r} of {schema!r}")
        name, has_default = m.group(1), m.group(2) is not None
        if has_default != (name in defaults):
            raise RuntimeError(f"{codecs.DEF_PATH.name}: {name} has {'a' if has_default else 'no'} default in the "
                               f"schema but {'none' if has_default else 'one'} in mpkern.op_args.AdamwArgs")
        kind = inspect.Parameter.KEYWORD_ONLY if keyword_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
        params.append(inspect.Parameter(name, kind, **({"default": defaults[name]} if has_default else {})))
    return inspect.Signature(params)


_ADAMW_SIGNATURE = _schema_signature(_ADAMW_SCHEMA, {
    f.name: f.default for f in dataclasses.fields(AdamwArgs) if f.default is not dataclasses.MISSING})
#: adamw_step_'s argument names in the schema's order (mpkern/codecs.def)
ADAMW_ARGUMENTS = tuple(_ADAMW_SIGNATURE.parameters)
_ADAMW_POSITIONAL = tuple(n for n, p in _ADAMW_SIGNATURE.parameters.items() if p.kind is not p.KEYWORD_ONLY)
_ADAMW_KEYWORD = tuple(n for n, p in _ADAMW_SIGNATURE.parameters.items() if p.kind is p.KEYWORD_ONLY)
if set(ADAMW_ARGUMENTS) != {f.name for f in dataclasses.fields(AdamwArgs)}:
    raise RuntimeError(f"{codecs.DEF_PATH.name}: adamw_step_'s arguments {ADAMW_ARGUMENTS} are not the fields of "
                       f"mpkern.op_args.AdamwArgs")


def adamw_args(*args: Any, **kwargs: Any) -> AdamwArgs:
    """The bundle of one ``adamw_step_`` call given in the flat schema's form (as the dispatcher passes
    it to a Python kernel: the tensors positionally, the scalars and codecs by keyword). TypeError, as
    for a Python call, for a missing, unknown or repeated argument."""
    try:
        bound = _ADAMW_SIGNATURE.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"mpkern::adamw_step_: {e}") from None
    return AdamwArgs(**bound.arguments)


def adamw_schema_args(a: AdamwArgs) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``a`` in the flat schema's form: the (positional, keyword) arguments of ``torch.ops.mpkern.adamw_step_``."""
    return tuple(getattr(a, n) for n in _ADAMW_POSITIONAL), {n: getattr(a, n) for n in _ADAMW_KEYWORD}


def _reference_adamw_step_(*args: Any, **kwargs: Any) -> None:
    """``mpkern::adamw_step_``'s schema on :func:`mpkern.reference.adamw_step_`."""
    reference.adamw_step_(adamw_args(*args, **kwargs))


def _define_fallback_schemas() -> None:
    """Without the native extension, define the mpkern schemas here with reference kernels."""
    lib = torch.library.Library("mpkern", "DEF")
    for schema in codecs.SCHEMAS.values():
        lib.define(schema)
    for key in ("CPU", "CUDA"):
        lib.impl("grad_stats", lambda grads, inv_scale: reference.grad_stats(grads, inv_scale), key)
        lib.impl("scale_", lambda tensors, scale: reference.scale_(tensors, scale), key)
        lib.impl("adamw_step_", _reference_adamw_step_, key)
    _libs.append(lib)


if _backend.native() is None:
    _define_fallback_schemas()
else:
    codecs.check_native(_backend.native().codec_table())  # a stale extension is refused, not run


def _fake_grad_stats(grads: Sequence[Tensor], inv_scale: Tensor) -> tuple[Tensor, Tensor]:
    for g in grads:
        torch._check(g.dtype in (torch.float32, torch.float16, torch.bfloat16),
                     functools.partial(lambda g: f"grad_stats: grads must be float32/float16/bfloat16, got {g.dtype}",
                                       g))
    n = len(grads)
    return inv_scale.new_empty(n, dtype=torch.float32), inv_scale.new_empty(n, dtype=torch.float32)


def _fake_scale_(tensors: Sequence[Tensor], scale: Tensor) -> None:
    return None


def _fake_adamw_step_(*args: Any, **kwargs: Any) -> None:
    # the checks that need no data, so a traced call fails like an eager one (the eager kernels
    # run the full check_adamw_args)
    a = adamw_args(*args, **kwargs)
    op = "mpkern::adamw_step_"
    mc, mo = a.master, a.moments  # ValueError naming the codecs
    check_adamw_scalars(a)
    for i, m in enumerate(a.exp_avgs):
        torch._check(m.dtype == mo.exp_avg_dtype, functools.partial(lambda i, m: (
            f"{op}: moment_codec {a.moment_codec!r} needs {mo.exp_avg_dtype} exp_avgs; exp_avgs[{i}] is {m.dtype}"),
            i, m))
        torch._check(a.exp_avg_sqs[i].dtype == mo.exp_avg_sq_dtype, functools.partial(lambda i: (
            f"{op}: moment_codec {a.moment_codec!r} needs {mo.exp_avg_sq_dtype} exp_avg_sqs; exp_avg_sqs[{i}] is "
            f"{a.exp_avg_sqs[i].dtype}"), i))
    sm, sv, n = a.exp_avg_scales, a.exp_avg_sq_scales, len(a.params)
    if mo.grouped:
        torch._check(not a.max_exp_avg_sqs,
                     lambda: f"{op}: amsgrad is not supported with moment_codec {a.moment_codec!r}")
        torch._check(sm is not None and sv is not None and len(sm) == n and len(sv) == n,
                     lambda: f"{op}: moment_codec {a.moment_codec!r} needs exp_avg_scales and exp_avg_sq_scales, "
                             f"one per param")
        assert sm is not None and sv is not None
        for i in range(n):
            torch._check(sm[i].dtype == torch.bfloat16 and sv[i].dtype == torch.bfloat16,
                         lambda: f"{op}: the moment scales must be bfloat16")
    else:
        torch._check(not sm and not sv, lambda: (
            f"{op}: exp_avg_scales and exp_avg_sq_scales must be empty with moment_codec {a.moment_codec!r}"))
    if mc.state_dtype is not None:
        for i, t in enumerate(a.masters):
            torch._check(t.dtype == mc.state_dtype, functools.partial(lambda i, t: (
                f"{op}: master_codec {a.master_codec!r} needs {mc.state_dtype} masters; masters[{i}] is {t.dtype}"),
                i, t))
    if a.master_codec == "8bit":
        for i, p in enumerate(a.params):
            torch._check(p.dtype in (torch.bfloat16, torch.float16), functools.partial(lambda i, p: (
                f"{op}: master_codec '8bit' (8-bit master corrections) needs bfloat16 or float16 params; "
                f"params[{i}] is {p.dtype}"), i, p))


torch.library.register_fake("mpkern::grad_stats")(_fake_grad_stats)
torch.library.register_fake("mpkern::scale_")(_fake_scale_)
torch.library.register_fake("mpkern::adamw_step_")(_fake_adamw_step_)


# ---- argument checks: one implementation (C++, mpkern._C) for every backend ----------------------
def _native_checks():
    """mpkern._C, or None: without it (the Triton backend is then unavailable, see _backend.status)
    and while torch.compile traces (the fake kernels check there; the eager call checks here)."""
    if torch.compiler.is_compiling():
        return None
    return _backend.native()


def check_grad_stats_args(grads: Sequence[Tensor], inv_scale: Tensor) -> None:
    """Raise exactly like the C++ ``mpkern::grad_stats`` kernels do on bad arguments."""
    ext = _native_checks()
    if ext is not None:
        ext.check_grad_stats_args(list(grads), inv_scale)


def check_scale_args(tensors: Sequence[Tensor], scale: Tensor) -> None:
    """Raise exactly like the C++ ``mpkern::scale_`` kernels do on bad arguments."""
    ext = _native_checks()
    if ext is not None:
        ext.check_scale_args(list(tensors), scale)


def check_adamw_scalars(a: AdamwArgs) -> None:
    """Raise like the C++ ``mpkern::adamw_step_`` kernels do on scalars outside torch.optim.AdamW's ranges
    (``csrc/adamw_common.h``, ``check_adamw_scalars``: the one rule, here through the extension)."""
    ext = _native_checks()
    if ext is not None:
        ext.check_adamw_scalars(a.lr_tensor is not None, float(a.lr), float(a.beta1), float(a.beta2), float(a.eps),
                                float(a.weight_decay))


def check_adamw_args(a: AdamwArgs) -> None:
    """Raise exactly like the C++ ``mpkern::adamw_step_`` kernels do (the scalars by
    :func:`check_adamw_scalars`; maximize, seed, ... are not checked). A codec registered from Python
    is checked against its row, the native ones by name."""
    codecs.master_codec(a.master_codec)  # ValueError naming the master codecs (before the moment codec's)
    mo = a.moments
    check_adamw_scalars(a)
    ext = _native_checks()
    if ext is not None:
        sm, sv = a.exp_avg_scales, a.exp_avg_sq_scales
        ext.check_adamw_args(list(a.params), list(a.grads), list(a.exp_avgs), list(a.exp_avg_sqs),
                             list(a.max_exp_avg_sqs), list(a.masters), list(a.steps), a.grad_factor, a.found_inf,
                             a.lr_tensor, None if sm is None else list(sm), None if sv is None else list(sv),
                             master_codec=a.master_codec, moment_codec=a.moment_codec if mo.native else mo.row(),
                             stream_ids=[int(x) for x in a.stream_ids], elem_offsets=[int(x) for x in a.elem_offsets])


def capturing() -> bool:
    """True while the current CUDA stream is being captured into a CUDA graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# ---- device scalars without host synchronisation ---------------------------------------------------
def non_blocking_to(device: torch.device) -> bool:
    """Whether a copy to ``device`` may be asynchronous. Not to the CPU: a device-to-host copy with
    ``non_blocking=True`` returns before the data lands, and a CPU kernel reads it at once (CPU
    code does not wait on a CUDA stream). To a GPU it is ordered on the stream like a kernel."""
    return torch.device(device).type != "cpu"


def copy_f32(t: Tensor, device: torch.device) -> Tensor:
    """``t`` as float32 on ``device`` (detached); asynchronous only where that is safe (see
    :func:`non_blocking_to`)."""
    return t.detach().to(device=device, dtype=torch.float32, non_blocking=non_blocking_to(device))


# Cached device constants, (value, device) -> (tensor, StreamUse or None): least recently used first.
# Constants a captured CUDA graph reads are pinned (moved to _PINNED_CONSTS, never evicted): freeing
# one would let the allocator hand its memory to another tensor while the graph still reads it.
_CONSTS: OrderedDict[tuple[float, torch.device], tuple[Tensor, Any]] = OrderedDict()
_PINNED_CONSTS: dict[tuple[float, torch.device], tuple[Tensor, Any]] = {}
_MAX_CONSTS = 64


def scalar_on(value: Tensor | float, device: torch.device) -> Tensor:
    """``value`` as a 0-dim float32 tensor on ``device``, without synchronising with the host.

    * a tensor on ``device``: itself (reshaped; cast on the device if it is not float32);
    * a tensor on another GPU: a device-to-device copy;
    * a CPU tensor for a GPU: its value is read on the host (a CPU read, not a GPU sync) and
      handled like a float -- a pageable host-to-device copy would block the stream;
    * a float: a cached constant tensor (filled once per (value, device) by a fill kernel, never
      copied from the host). Callers must not write into it. The cache keeps the 64 least
      recently used constants, plus every constant a CUDA graph capture used (never evicted). A
      constant that does not exist yet when a capture asks for it is a fresh tensor filled inside
      the capture, not cached: its fill only runs on replay, so no other call may read it. A cached
      constant used on another CUDA stream than the one that filled it is ordered after its fill.
    """
    device = torch.device(device)
    if isinstance(value, Tensor):
        if value.device == device:
            t = value.detach().reshape(())
            return t if t.dtype == torch.float32 else t.to(torch.float32)
        if value.device.type != "cpu" or device.type == "cpu":
            return copy_f32(value, device).reshape(())
        value = value.item()  # a CPU tensor: a host read, no device involved
    if torch.compiler.is_compiling():  # traced: a fill op in the graph, no global cache
        return torch.full((), float(value), dtype=torch.float32, device=device)
    key = (float(value), device)
    cuda = device.type == "cuda"
    capture = cuda and torch.cuda.is_current_stream_capturing()
    item = _PINNED_CONSTS.get(key)
    if item is None:
        item = _CONSTS.get(key)
        if item is not None:
            if capture:
                _PINNED_CONSTS[key] = _CONSTS.pop(key)
            else:
                _CONSTS.move_to_end(key)
    if item is not None:
        t, use = item
        if use is not None:
            use.use(device, capture)
        return t
    t = torch.full((), key[0], dtype=torch.float32, device=device)
    if capture:
        return t  # filled on replay only (see above)
    _CONSTS[key] = (t, StreamUse([t], device) if cuda else None)
    while len(_CONSTS) > _MAX_CONSTS:
        _CONSTS.popitem(last=False)
    return t


def host_flag(flag: Tensor) -> bool:
    """Read a 0-dim device flag (``found_inf``) back to the host: a synchronisation, so only where a
    host decision cannot be avoided (gradient release skips its second backward pass on an overflow)."""
    return bool(flag.item() != 0.0)


def lr_args(lr: Tensor | float, device: torch.device) -> tuple[Tensor | None, float]:
    """The ``(lr_tensor, lr)`` arguments of ``adamw_step_`` for a group's ``lr`` on ``device``.

    A float stays a float (passed by value, kept in double precision by every backend). A tensor
    on ``device`` is read by the kernel on the device (no sync; a scheduler may update it in
    place, also inside a captured CUDA graph). A CPU tensor for a GPU step is read on the host
    like a float (that is a CPU read; copying it to the GPU every step would block the stream).
    """
    if not isinstance(lr, Tensor):
        return None, float(lr)
    device = torch.device(device)
    if lr.device == device:
        t = lr.detach().reshape(())
        return (t if t.dtype == torch.float32 else t.to(torch.float32)), 0.0
    if lr.device.type == "cpu":
        return None, float(lr.item())
    return copy_f32(lr, device).reshape(()), 0.0


# ---- Triton ops ---------------------------------------------------------------------------------
@torch.library.custom_op("mpkern_triton::grad_stats", mutates_args=())
def _triton_grad_stats(grads: list[Tensor], inv_scale: Tensor) -> tuple[Tensor, Tensor]:
    from mpkern.triton_kernels import unscale

    check_grad_stats_args(grads, inv_scale)
    return unscale.grad_stats(grads, inv_scale)


@torch.library.custom_op("mpkern_triton::scale_", mutates_args=("tensors",))
def _triton_scale_(tensors: list[Tensor], scale: Tensor) -> None:
    from mpkern.triton_kernels import unscale

    check_scale_args(tensors, scale)
    unscale.scale_(tensors, scale)


_triton_grad_stats.register_fake(_fake_grad_stats)
_triton_scale_.register_fake(_fake_scale_)

_triton_lib = torch.library.Library("mpkern_triton", "FRAGMENT")
_triton_lib.define(_ADAMW_SCHEMA)
_libs.append(_triton_lib)


def _triton_adamw_step_(*args: Any, **kwargs: Any) -> None:
    from mpkern.triton_kernels import adamw

    a = adamw_args(*args, **kwargs)
    check_adamw_args(a)
    adamw.adamw_step_(a)


for _key in ("CPU", "CUDA"):
    _triton_lib.impl("adamw_step_", _triton_adamw_step_, _key)
torch.library.register_fake("mpkern_triton::adamw_step_")(_fake_adamw_step_)


# ---- routing ------------------------------------------------------------------------------------
def grad_stats(grads: Sequence[Tensor], inv_scale: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    """Run the statistics pass on ``backend`` (see :func:`mpkern.reference.grad_stats`)."""
    if backend in ("cpu", "cuda"):
        return torch.ops.mpkern.grad_stats(list(grads), inv_scale)
    if backend == "triton":
        return torch.ops.mpkern_triton.grad_stats(list(grads), inv_scale)
    check_grad_stats_args(grads, inv_scale)
    return reference.grad_stats(grads, inv_scale)


def adamw_step_(backend: str, *args: Any, **kwargs: Any) -> None:
    """Run the fused AdamW step on ``backend``; ``args`` / ``kwargs`` follow the ``adamw_step_``
    schema (tensor lists and tensors positional, the scalars and codecs by keyword)."""
    if backend in ("cpu", "cuda"):
        torch.ops.mpkern.adamw_step_(*args, **kwargs)
    elif backend == "triton":
        torch.ops.mpkern_triton.adamw_step_(*args, **kwargs)
    else:
        run_adamw_step_(backend, adamw_args(*args, **kwargs))


def run_adamw_step_(backend: str, a: AdamwArgs) -> None:
    """Run the fused AdamW step of the bundle ``a`` on ``backend`` (the registered op for a kernel
    backend, the reference after the argument checks for "torch")."""
    if backend in ("cpu", "cuda"):
        args, kwargs = adamw_schema_args(a)
        torch.ops.mpkern.adamw_step_(*args, **kwargs)
    elif backend == "triton":
        args, kwargs = adamw_schema_args(a)
        torch.ops.mpkern_triton.adamw_step_(*args, **kwargs)
    else:
        check_adamw_args(a)
        reference.adamw_step_(a)


def scale_(tensors: Sequence[Tensor], scale: Tensor, backend: str) -> None:
    """Multiply every tensor in place by the one-element fp32 ``scale`` on ``backend``."""
    if backend in ("cpu", "cuda"):
        torch.ops.mpkern.scale_(list(tensors), scale)
    elif backend == "triton":
        torch.ops.mpkern_triton.scale_(list(tensors), scale)
    else:
        check_scale_args(tensors, scale)
        reference.scale_(tensors, scale)
