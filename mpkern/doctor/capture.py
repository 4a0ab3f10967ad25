"""Recording a model's two runs: what each module saw and made in fp32, and in the 16-bit recipe.

* :class:`Recorder` -- forward pre/post hooks on every module. In the fp32 run it keeps each call's
  inputs and outputs (detached clones, shared between modules that pass the same tensor on); in the
  16-bit run it compares each call's outputs with the fp32 run's as they come (nothing kept).
* :class:`OpWatch` -- a ``TorchFunctionMode`` for the 16-bit run: every fp16/bf16 tensor a torch
  function makes is measured (largest finite |value|), and an inf/NaN that an op makes from finite
  inputs is attributed to the innermost module running it; that op is recomputed in fp32 to learn
  how large the value that overflowed really was.
* :func:`rerun` -- one module alone on its fp32-run input (cast to the dtypes the 16-bit run gave
  it), in the recipe, to measure the error the module itself introduces.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from . import stats

Tensor = torch.Tensor


def map_floats(x: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """``x`` rebuilt with ``fn`` applied to each floating tensor (tuples, lists, dicts, namedtuples)."""
    if isinstance(x, Tensor):
        return fn(x) if x.is_floating_point() else x
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(map_floats(v, fn) for v in x))
    if isinstance(x, (tuple, list)):
        return type(x)(map_floats(v, fn) for v in x)
    if type(x) is dict:
        return {k: map_floats(v, fn) for k, v in x.items()}
    return x


@dataclass
class RefCall:
    """One call of a module in the fp32 run."""

    args: tuple
    kwargs: dict
    ins: list[Tensor]
    outs: list[Tensor]


@dataclass
class LowCall:
    """One call of a module in the 16-bit run, measured against the same call in the fp32 run."""

    in_dtypes: list[torch.dtype]
    same_inputs: bool  # its inputs equal the fp32 run's cast to these dtypes: its own error is its run error
    out_dtypes: list[torch.dtype]
    acc_err: float | None
    new_nonfinite: int
    passthrough: bool  # its output is a tensor one of its submodules returned


@dataclass
class OpStats:
    """What the ops run directly by one module (not by its submodules) made in the 16-bit run."""

    max_abs: float = 0.0  # largest finite |value| of a 16-bit op output (sentinels left out)
    any16: bool = False  # some op output was 16-bit
    overflow: int = 0  # inf/NaN elements made by an op from finite inputs
    overflow_fp32_max: float = 0.0  # how large those values were, recomputed in fp32
    first_overflow_seq: int | None = None


class _Clones:
    """Detached clones, one per (tensor, version): modules that pass a tensor on share its copy."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[Tensor, int, Tensor]] = {}

    def __call__(self, t: Tensor) -> Tensor:
        hit = self._seen.get(id(t))
        if hit is not None and hit[0] is t and hit[1] == t._version:  # noqa: SLF001 -- torch's write counter: no public accessor
            return hit[2]
        c = t.detach().clone()
        self._seen[id(t)] = (t, t._version, c)  # noqa: SLF001 -- torch's write counter: no public accessor
        return c

    def clear(self) -> None:
        self._seen.clear()


class Recorder(AbstractContextManager):
    """Hooks on every module of ``model`` (qualified names as in ``named_modules()``).

    ``ref=None``: the fp32 run -- ``calls[name]`` lists each call's :class:`RefCall`.
    ``ref=<the fp32 Recorder>``: the 16-bit run -- ``low[name]`` lists each call's :class:`LowCall`.
    ``stack`` holds the names of the modules running now (innermost last); ``order`` the names in
    the order their calls finished (first call of each).
    """

    def __init__(self, model: nn.Module, ref: Recorder | None = None) -> None:
        self.model = model
        self.ref = ref
        self.calls: dict[str, list[RefCall]] = {}
        self.low: dict[str, list[LowCall]] = {}
        self.order: list[str] = []
        self.stack: list[str] = []
        self._starts: list[int] = []
        self._made: dict[int, int] = {}  # id(output tensor) -> sequence number of the hook that made it
        self._seq = 0
        self._clones = _Clones()
        self._handles: list[Any] = []
        self._pending_in: dict[tuple[str, int], Any] = {}
        self.enabled = True
        self.busy = False  # inside one of its own hooks: its measuring ops are not the model's

    def __enter__(self) -> Recorder:
        for name, m in self.model.named_modules():
            self._handles.append(m.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._post(name), with_kwargs=True, always_call=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._clones.clear()
        self._made.clear()

    def _pre(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not self.enabled:
                return
            self.stack.append(name)
            self._starts.append(self._seq)
            if self.ref is None:
                self._pending_in[(name, len(self._starts))] = (map_floats(args, self._clones),
                                                               map_floats(kwargs, self._clones))
            else:
                self.busy = True
                ins = stats.floats((args, kwargs))
                ref_calls = self.ref.calls.get(name, [])
                k = len(self.low.get(name, [])) + sum(1 for (n, _) in self._pending_in if n == name)
                ref_ins = ref_calls[k].ins if k < len(ref_calls) else None
                same = ref_ins is not None and len(ref_ins) == len(ins) and all(
                    a.shape == r.shape and torch.equal(a.detach(), r.to(a.dtype)) for a, r in zip(ins, ref_ins))
                self._pending_in[(name, len(self._starts))] = ([t.dtype for t in ins], same)
                self.busy = False
        return hook

    def _post(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if not self.enabled or not self.stack or self.stack[-1] != name:
                return
            depth = len(self._starts)
            start = self._starts.pop()
            self.stack.pop()
            pending = self._pending_in.pop((name, depth))
            self._seq += 1
            outs = stats.floats(output)
            if name not in self.calls and name not in self.low:
                self.order.append(name)
            if self.ref is None:
                cargs, ckwargs = pending
                self.calls.setdefault(name, []).append(
                    RefCall(cargs, ckwargs, stats.floats((cargs, ckwargs)), [self._clones(t) for t in outs]))
            else:
                self.busy = True
                k = len(self.low.get(name, []))
                ref_calls = self.ref.calls.get(name, [])
                ref_outs = ref_calls[k].outs if k < len(ref_calls) else None
                passthrough = any(self._made.get(id(t), -1) > start for t in outs)
                self.low.setdefault(name, []).append(LowCall(
                    in_dtypes=pending[0], same_inputs=pending[1], out_dtypes=[t.dtype for t in outs],
                    acc_err=None if ref_outs is None else stats.rel_err(outs, ref_outs),
                    new_nonfinite=0 if ref_outs is None else stats.new_nonfinite(outs, ref_outs),
                    passthrough=passthrough))
                self.busy = False
            for t in outs:
                self._made[id(t)] = self._seq
        return hook


_INPLACE_DUNDERS = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ipow__", "__setitem__"}


class OpWatch(TorchFunctionMode):
    """Measures every fp16/bf16 tensor a torch function makes while a module of ``recorder`` runs.

    ``ops[name]`` is the :class:`OpStats` of the ops run directly by module ``name``;
    ``first_overflow`` the module whose op first made an inf/NaN from finite inputs.
    """

    def __init__(self, recorder: Recorder, dtype: torch.dtype) -> None:
        super().__init__()
        self.recorder = recorder
        self.dtype = dtype
        self.ops: dict[str, OpStats] = {}
        self.first_overflow: str | None = None
        self._seq = 0
        self._seen: set[tuple[int, int, int]] = set()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.recorder.stack and self.recorder.enabled and not self.recorder.busy:
            self._inspect(func, args, kwargs, out)
        return out

    def _inspect(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        made = [t for t in stats.floats(out) if t.dtype == self.dtype and t.numel() and not t.is_meta]
        if not made:
            return
        st = self.ops.setdefault(self.recorder.stack[-1], OpStats())
        st.any16 = True
        for t in made:
            key = (t.data_ptr(), t._version, t.numel())  # noqa: SLF001 -- torch's write counter: no public accessor
            if key in self._seen or t._is_view():  # noqa: SLF001 -- Tensor._is_view: torch has no public test
                continue  # the same values measured already (a view, or a tensor returned twice)
            self._seen.add(key)
            st.max_abs = max(st.max_abs, stats.abs_max([t], self.dtype))
            bad = int((~torch.isfinite(t.detach())).sum())
            if bad and all(bool(torch.isfinite(x.detach()).all()) for x in stats.floats((args, kwargs))):
                self._seq += 1
                st.overflow += bad
                if st.first_overflow_seq is None:
                    st.first_overflow_seq = self._seq
                if self.first_overflow is None:
                    self.first_overflow = self.recorder.stack[-1]
                st.overflow_fp32_max = max(st.overflow_fp32_max, self._fp32_magnitude(func, args, kwargs))

    def _fp32_magnitude(self, func: Any, args: tuple, kwargs: dict) -> float:
        """The largest |value| ``func`` makes when its 16-bit inputs are given in fp32 (0.0 if it can't be)."""
        name = getattr(func, "__name__", "")
        if name in _INPLACE_DUNDERS or (name.endswith("_") and not name.endswith("__")):
            return 0.0  # an in-place op: recomputing it would write into its fp32 operands
        def up(t: Tensor) -> Tensor:
            return t.detach().float() if t.dtype in stats.LOW_DTYPES else t.detach()

        try:
            with torch.no_grad(), _autocast_off():
                res = func(*map_floats(args, up), **map_floats(kwargs, up))
        except Exception:  # noqa: BLE001 -- a magnitude we cannot recompute is reported as unknown
            return 0.0
        return stats.abs_max(stats.floats(res))


class _autocast_off(AbstractContextManager):
    def __enter__(self) -> _autocast_off:
        self._ctxs = []
        for dev in ("cpu", "cuda"):
            if torch.is_autocast_enabled(dev):
                c = torch.autocast(dev, enabled=False)
                c.__enter__()
                self._ctxs.append(c)
        return self

    def __exit__(self, *exc: Any) -> None:
        for c in reversed(self._ctxs):
            c.__exit__(None, None, None)


@dataclass
class Rerun:
    """A module run alone on its fp32-run input: its own error (None with ``error`` if it can't run alone)."""

    rel_err: float | None
    error: str | None = None


def rerun(module: nn.Module, call: RefCall, low: LowCall, recipe_ctx: Callable[[], Any],
          reset_rng: Callable[[], None]) -> Rerun:
    """Run ``module`` on ``call``'s fp32 input, each floating input cast to the dtype the 16-bit
    run gave it (``low.in_dtypes``), inside ``recipe_ctx()``; compare with ``call.outs``."""
    if len(low.in_dtypes) != len(call.ins):
        return Rerun(None, "its inputs differ between the two runs")
    dtypes: Iterator[torch.dtype] = iter(low.in_dtypes)

    def cast(t: Tensor) -> Tensor:
        return t.to(next(dtypes))

    args, kwargs = map_floats((call.args, call.kwargs), cast)
    reset_rng()
    try:
        with torch.no_grad(), recipe_ctx():
            out = module(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 -- a module that can't run alone is reported, not fatal
        return Rerun(None, f"{type(e).__name__}: {e}")
    outs = stats.floats(out)
    return Rerun(stats.rel_err(outs, call.outs))


@dataclass
class Preserved:
    """What :func:`diagnose` puts back: grads, ``main_grad`` contents, buffers, dropout rates."""

    grads: dict[int, tuple[Tensor, Tensor | None]] = field(default_factory=dict)
    main_grads: list[tuple[Tensor, bool, Any, Tensor | None]] = field(default_factory=list)  # p, had, value, copy
    buffers: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    dropout: list[tuple[Any, float]] = field(default_factory=list)  # (a dropout module of _DROPOUTS, its p)


_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def preserve(model: nn.Module) -> Preserved:
    """Stash ``model``'s grads (set to None), ``main_grad``s, buffers; switch dropout off (p = 0)."""
    keep = Preserved()
    for p in model.parameters():
        if id(p) in keep.grads:
            continue
        keep.grads[id(p)] = (p, p.grad)
        p.grad = None
        had = hasattr(p, "main_grad")
        mg = getattr(p, "main_grad", None)
        keep.main_grads.append((p, had, mg, mg.detach().clone() if isinstance(mg, Tensor) else None))
    for b in model.buffers():
        keep.buffers.append((b, b.detach().clone()))
    for m in model.modules():
        if isinstance(m, _DROPOUTS) and m.p != 0:
            keep.dropout.append((m, m.p))
            m.p = 0.0
    return keep


def restore(keep: Preserved) -> None:
    """Put back what :func:`preserve` stashed."""
    for p, g in keep.grads.values():
        p.grad = g
    for p, had, mg, saved in keep.main_grads:
        if not had:
            if hasattr(p, "main_grad"):
                delattr(p, "main_grad")
            continue
        if saved is not None:
            with torch.no_grad():
                mg.copy_(saved)
        p.main_grad = mg  # type: ignore[attr-defined]  # mpkern.nn's fp32 grad attribute on a weight
    with torch.no_grad():
        for b, saved_b in keep.buffers:
            b.copy_(saved_b)
    for m, rate in keep.dropout:
        m.p = rate
