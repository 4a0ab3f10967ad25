"""Small labelled calls of every CUDA kernel of mpkern, for compute-sanitizer (:mod:`.sanitizer`).

``python -m tools.gpu_check.sanitizer_workload --device cuda|cpu [--only FAMILIES] [--sizes all|few]``

Through the public API only, on the ``cuda`` backend (``cpu`` with ``--device cpu``, where a test
runs every call to prove each one valid):

* ``unscale``: :func:`mpkern.unscale_` with clipping -- grad_stats' two kernels and scale_'s -- for
  each grad dtype, grads that are whole tensors or views starting at element 1 or 3 of a larger
  tensor, at one element, the 16-byte vector width +-1, the norm chunk and the multi-tensor chunk
  +-1; a list of all of them in one call (chunk bookkeeping across tensors), a list of mixed dtypes,
  an inf grad, and a scale of exactly 1.
* ``grad_stats``: ``mpkern.unscale_(optimizer)`` (its factor deferred to the step: the statistics
  kernels alone) and :func:`mpkern.clip_grad_norm_` with the inf norm.
* ``adamw``: one :class:`mpkern.FusedAdamWMP` step per storage mode that has a CUDA kernel (the
  storage registry's list, for bf16, fp16 and fp32 params, plus fp32 grads on bf16 params and
  amsgrad where a moment kind keeps it) over a list of sizes around the vector width, the compact
  moments' warp pass and the chunk, with param and grad aligned or at element offsets.
* ``adamw_staged``: the compact moment modes (codes with a scale per group) under two load stages
  (:func:`mpkern.launch_shape.adamw_shape_set` with ``stages=2``: each lane copies the warp's next pass
  into shared memory while it updates the current one), on aligned bf16 and fp16 params and grads --
  the calls that reach that loop, for racecheck as well as memcheck. Each grad's first warp pass is zero
  (a zero v: the pass takes the IEEE step, the block outside the main loop; the other passes the main
  loop's step). With ``--device cpu`` the same calls without the shape (a CUDA setting).

Every view ends at the end of its allocation, so that a read past a tensor's last element leaves
the allocation (with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1``, which the stage sets, each tensor is its
own ``cudaMalloc`` and memcheck sees its exact size). Each call prints a marker line before it and
after it (the device synchronised), so an error report maps to the call that caused it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

import mpkern
from mpkern.optim import storage

from .sanitizer_report import CALL, DONE, END, FAIL, NOGPU, PLAN

Call = tuple[str, Callable[[], Any]]
#: (rank, label, call): rank 0 reaches every kernel variant once through an offset view, 1 the
#: boundary sizes one call each and the second view, 2 the aligned calls -- so a run cut off by its
#: limit has covered each kernel before it repeats one
Ranked = tuple[int, str, Callable[[], Any]]

#: elements per multi-tensor work item (csrc/cuda/multi_tensor.cuh kChunk)
CHUNK = 1 << 16
#: elements per grad_stats norm chunk (csrc/include/mpkern/norm.h kChunk)
NORM_CHUNK = 16384
#: bytes of the kernels' vector loads (multi_tensor.cuh Vec: 16-byte uint4)
VEC_BYTES = 16
#: AdamW elements per thread-iteration (csrc/cuda/adamw_lanes.cuh kVE) and per compact-moment warp pass (kMomSpan)
ADAM_VE, MOM_SPAN = 8, 256
#: 8-bit moments: elements per bf16 scale (math.h kMom8Group)
MOM_GROUP = 32
GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: (param dtype, grad dtype) pairs the AdamW calls step
PARAM_GRAD = ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.float32, torch.float32),
              (torch.bfloat16, torch.float32))
#: AdamW views: (label, param offset, grad offset); the most error-prone first
ADAM_VIEWS = (("p@1 g@3", 1, 3), ("p@0 g@1", 0, 1), ("aligned", 0, 0))
FAMILIES = ("unscale", "grad_stats", "adamw", "adamw_staged")
SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def vec_width(dtype: torch.dtype) -> int:
    """Elements of ``dtype`` in one 16-byte vector load (4 fp32, 8 fp16/bf16)."""
    return VEC_BYTES // torch.empty((), dtype=dtype).element_size()


def unscale_sizes(dtype: torch.dtype, few: bool) -> list[int]:
    """Grad sizes for the unscale calls: 1, the vector width +-1, the norm chunk +-1, the chunk +-1
    (``few``: 1, vector width + 1, norm chunk + 1, chunk + 1)."""
    v = vec_width(dtype)
    if few:
        return [1, v + 1, NORM_CHUNK + 1, CHUNK + 1]
    return [1, v - 1, v, v + 1, NORM_CHUNK - 1, NORM_CHUNK, NORM_CHUNK + 1, CHUNK - 1, CHUNK, CHUNK + 1]


def adam_sizes(few: bool) -> list[int]:
    """Param sizes of one AdamW call: 1, the vector step +-1, a scale group + 1, a warp pass +-1,
    the chunk +-1 (``few``: 1, 9, 257, chunk + 1)."""
    if few:
        return [1, ADAM_VE + 1, MOM_SPAN + 1, CHUNK + 1]
    return [1, ADAM_VE - 1, ADAM_VE, ADAM_VE + 1, MOM_GROUP + 1, MOM_SPAN - 1, MOM_SPAN, MOM_SPAN + 1,
            CHUNK - 1, CHUNK, CHUNK + 1]


def view_label(offset: int) -> str:
    return "aligned" if offset == 0 else f"@{offset}"


class Maker:
    """Tensors for the calls on one device, from one seeded generator."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.gen = torch.Generator(device=device).manual_seed(0)

    def values(self, n: int, dtype: torch.dtype, scale: float, offset: int = 0) -> torch.Tensor:
        """``n`` random values of ``dtype``: elements ``offset..`` of a tensor of ``n + offset``, so
        the view ends where its allocation ends."""
        base = torch.randn(n + offset, generator=self.gen, device=self.device) * scale
        return base.to(dtype)[offset:]

    def param(self, n: int, dtype: torch.dtype, grad_dtype: torch.dtype, p_off: int = 0,
              g_off: int = 0) -> torch.nn.Parameter:
        """A param of ``n`` elements (at ``p_off`` of its storage) with a grad at ``g_off`` of its own."""
        p = torch.nn.Parameter(self.values(n, dtype, 0.1, p_off))
        g = self.values(n, grad_dtype, 0.01, g_off)
        if grad_dtype == dtype:
            p.grad = g
        else:  # a grad of another dtype (fp32 grads of bf16 params) goes in main_grad
            p.main_grad = g  # type: ignore[attr-defined]
        return p


def unscale_calls(mk: Maker, few: bool) -> Iterator[Ranked]:
    """The ``unscale`` family: grad_stats + scale_ through :func:`mpkern.unscale_`."""
    offsets = (3, 0) if few else (3, 1, 0)
    for dt in GRAD_DTYPES:
        for off in offsets:
            for n in unscale_sizes(dt, few):
                yield (2 if off == 0 else 1, f"unscale g={SHORT[dt]} n={n} view={view_label(off)} clip",
                       lambda dt=dt, n=n, off=off: mpkern.unscale_([mk.param(n, dt, dt, 0, off)], 0.5, max_norm=1.0))
        sizes = unscale_sizes(dt, few)
        yield (0, f"unscale g={SHORT[dt]} list={len(sizes)} views=mixed clip",
               lambda dt=dt, sizes=sizes: mpkern.unscale_(
                   [mk.param(n, dt, dt, 0, (1, 3, 0)[i % 3]) for i, n in enumerate(sizes)], 0.5, max_norm=1.0))

    def mixed() -> Any:
        ps = [mk.param(n, dt, dt, 0, off) for dt in GRAD_DTYPES for n, off in ((CHUNK + 1, 1), (9, 3))]
        return mpkern.unscale_(ps, 0.25, max_norm=2.0, per_tensor=True)

    def inf_grad() -> Any:
        p = mk.param(CHUNK + 1, torch.bfloat16, torch.bfloat16, 0, 3)
        p.grad[-1] = float("inf")  # type: ignore[index]
        return mpkern.unscale_([p], 0.5, max_norm=1.0)

    yield (0, "unscale g=mixed list=6 views=@1,@3 clip per_tensor", mixed)
    yield (1, "unscale g=bf16 n=65537 view=@3 inf", inf_grad)
    yield (1, "unscale g=fp32 n=65537 view=@1 scale=1", lambda: mpkern.unscale_([mk.param(CHUNK + 1, torch.float32,
                                                                                       torch.float32, 0, 1)], 1.0))


def grad_stats_calls(mk: Maker, few: bool) -> Iterator[Ranked]:
    """The ``grad_stats`` family: the statistics kernels without scale_."""
    for dt in GRAD_DTYPES:
        for off in (3, 0):
            def deferred(dt: torch.dtype = dt, off: int = off) -> Any:
                ps = [mk.param(n, dt, dt, 0, off) for n in unscale_sizes(dt, few)]
                opt = mpkern.FusedAdamWMP(ps, lr=1e-3)
                return mpkern.unscale_(opt, 0.5, max_norm=1.0)  # grads only read: the factor waits for step()

            label = f"grad_stats g={SHORT[dt]} view={view_label(off)} unscale_(optimizer) deferred"
            yield 0 if off else 2, label, deferred
    yield (1, "grad_stats g=bf16 view=@1 clip_grad_norm_ inf-norm",
           lambda: mpkern.clip_grad_norm_([mk.param(n, torch.bfloat16, torch.bfloat16, 0, 1)
                                           for n in unscale_sizes(torch.bfloat16, few)], 1.0, norm_type=float("inf")))


def adam_modes(param_dtype: torch.dtype, backend: str) -> list[tuple[Any, str, str]]:
    """``(master_weights, state_dtype, "master:moments")`` of every storage mode with a kernel on
    ``backend`` for ``param_dtype`` params (the registry's list; fp32 params keep no master, so
    their modes differ by moments only)."""
    out: dict[str, tuple[Any, str, str]] = {}
    for mw, sd in storage.modes(param_dtype, backend=backend):
        name = f"{storage.master_kind(mw, param_dtype).name}:{sd}"
        out.setdefault(name, (mw, sd, name))
    return list(out.values())


def adam_step(mk: Maker, pdt: torch.dtype, gdt: torch.dtype, mw: Any, sd: str, p_off: int, g_off: int, few: bool,
              **kw: Any) -> Any:
    """One ``FusedAdamWMP`` step over params of :func:`adam_sizes` (stochastic rounding of the params
    where the master kind asks for it and the params are bf16, as ``mpkern bench`` runs the modes)."""
    zero_pass = kw.pop("zero_pass", False)
    ps = [mk.param(n, pdt, gdt, p_off, g_off) for n in adam_sizes(few)]
    if zero_pass:  # the first warp pass's grads 0 (adamw_staged_calls)
        for p in ps:
            (p.grad if p.grad is not None else p.main_grad)[:MOM_SPAN].zero_()  # type: ignore[attr-defined]
    sr = storage.check_master_weights(mw).stochastic_rounding and pdt == torch.bfloat16
    opt = mpkern.FusedAdamWMP(ps, lr=kw.pop("lr", 1e-3), weight_decay=0.01, master_weights=mw, state_dtype=sd,
                              stochastic_rounding=sr, **kw)
    opt.step()
    return opt


def adamw_calls(mk: Maker, few: bool, backend: str) -> Iterator[Ranked]:
    """The ``adamw`` family: every storage mode with a CUDA kernel, each view (see the module doc)."""
    views = ADAM_VIEWS[::2] if few else ADAM_VIEWS
    for rank, (vlabel, p_off, g_off) in enumerate(views):
        for pdt, gdt in PARAM_GRAD:
            for mw, sd, name in adam_modes(pdt, "cuda"):
                if gdt != pdt and mw is not True:  # fp32 grads on bf16 params: the fp32-master modes only
                    continue
                label = f"adamw p={SHORT[pdt]} g={SHORT[gdt]} mode={name} view={vlabel}"
                if (mw, sd) not in storage.modes(pdt, backend=backend):
                    print(f"note: {label} skipped: the {backend} backend has no kernel for this mode", flush=True)
                    continue
                yield rank, label, lambda a=(pdt, gdt, mw, sd, p_off, g_off): adam_step(mk, *a, few)
    amsgrad = [sd for _, sd, _ in adam_modes(torch.bfloat16, "cuda") if storage.moment_kind(sd).amsgrad]
    for sd in dict.fromkeys(amsgrad):
        yield (0, f"adamw p=bf16 g=bf16 mode=fp32:{sd} view=p@1 g@3 amsgrad",
               lambda sd=sd: adam_step(mk, torch.bfloat16, torch.bfloat16, True, sd, 1, 3, few, amsgrad=True))
    yield (1, "adamw p=bf16 g=bf16 mode=fp32:float32 view=p@1 g@3 lr=tensor maximize",
           lambda: adam_step(mk, torch.bfloat16, torch.bfloat16, True, "float32", 1, 3, few, maximize=True,
                             lr=torch.tensor(1e-3, device=mk.device)))


def adamw_staged_calls(mk: Maker, few: bool, backend: str) -> Iterator[Ranked]:
    """The ``adamw_staged`` family (see the module doc): one step per compact moment mode with a kernel
    on ``backend``, params and grads aligned, every size of :func:`adam_sizes` (whole warp passes and the
    per-element tail after them)."""
    from mpkern import codecs, launch_shape

    for pdt in (torch.bfloat16, torch.float16):
        for mw, sd, name in adam_modes(pdt, "cuda"):
            if not codecs.MOMENT_CODECS[storage.moment_kind(sd).codec].grouped:
                continue
            label = f"adamw_staged p={SHORT[pdt]} g={SHORT[pdt]} mode={name} view=aligned stages=2"
            if (mw, sd) not in storage.modes(pdt, backend=backend):
                print(f"note: {label} skipped: the {backend} backend has no kernel for this mode", flush=True)
                continue

            def step(pdt: torch.dtype = pdt, mw: Any = mw, sd: str = sd) -> Any:
                if backend != "cuda":
                    return adam_step(mk, pdt, pdt, mw, sd, 0, 0, few, zero_pass=True)
                with launch_shape.adamw_shape_set(256, 8, CHUNK, stages=2):
                    return adam_step(mk, pdt, pdt, mw, sd, 0, 0, few, zero_pass=True)

            yield 0, label, step


def calls(device: torch.device, only: tuple[str, ...] = FAMILIES, few: bool = False) -> list[Call]:
    """The labelled calls of the families in ``only``, by rank (see :data:`Ranked`), then family."""
    mk = Maker(device)
    backend = "cuda" if device.type == "cuda" else "cpu"
    ranked: list[Ranked] = []
    if "unscale" in only:
        ranked += unscale_calls(mk, few)
    if "grad_stats" in only:
        ranked += grad_stats_calls(mk, few)
    if "adamw" in only:
        ranked += adamw_calls(mk, few, backend)
    if "adamw_staged" in only:
        ranked += adamw_staged_calls(mk, few, backend)
    return [(label, fn) for _, label, fn in sorted(ranked, key=lambda r: r[0])]


def run(device: torch.device, only: tuple[str, ...], few: bool) -> int:
    """Make every call, marked; 0 if all ran, 1 if one failed (a CUDA error stops the rest: the
    context is gone)."""
    backend = "cuda" if device.type == "cuda" else "cpu"
    todo = calls(device, only, few)
    print(f"{PLAN}{len(todo)} calls on {device} ({backend} backend)", flush=True)
    failed = 0
    with mpkern.use_backend(backend):
        for label, fn in todo:
            print(f"{CALL}{label}", flush=True)
            try:
                fn()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            except Exception as e:  # noqa: BLE001 -- any failure of a call is reported by label, then judged
                failed += 1
                print(f"{FAIL}{label} :: {type(e).__name__}: {str(e).strip().splitlines()[0][:300]}", flush=True)
                if device.type == "cuda" and ("CUDA" in str(e) or "AcceleratorError" in type(e).__name__):
                    break
                continue
            print(f"{DONE}{label}", flush=True)
    print(f"{END} calls={len(todo)} failed={failed}", flush=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (the CUDA kernels) or cpu (proves every call valid)")
    ap.add_argument("--only", default=",".join(FAMILIES), help=f"comma list of families: {', '.join(FAMILIES)}")
    ap.add_argument("--sizes", choices=("all", "few"), default="all", help="every boundary size, or a few")
    args = ap.parse_args(argv)
    only = tuple(x.strip() for x in args.only.split(",") if x.strip())
    bad = [x for x in only if x not in FAMILIES]
    if bad or not only:
        ap.error(f"--only: unknown families {bad}; want a comma list of {', '.join(FAMILIES)}")
    device = torch.device(args.device)
    if device.type not in ("cuda", "cpu"):
        ap.error(f"--device: want cuda or cpu, got {args.device!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print(f"{NOGPU} torch sees no CUDA GPU", flush=True)
            return 3
        torch.cuda.init()  # the CUDA context first: the sanitizer attaches at CUDA's start
    return run(device, only, args.sizes == "few")


if __name__ == "__main__":
    sys.exit(main())
