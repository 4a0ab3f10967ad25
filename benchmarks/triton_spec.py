"""The Triton mechanics of ``benchmarks/triton_aot.py``: launches recorded instead of run, each launch
specialised by Triton's own JIT binder for a CUDA target without a GPU, compiled and timed, and (Triton 3.6)
the C launcher Triton builds per signature, built and timed the way Triton's runtime builds it."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple


@contextlib.contextmanager
def recording(modules: list[Any]) -> Iterator[list[tuple[Any, tuple, dict]]]:
    """Within the block, a launch ``kernel[grid](*args, **kwargs)`` of any Triton JIT function of ``modules``
    is recorded as ``(kernel, args, kwargs)`` and not run. mpkern's triton backend takes CPU tensors only
    with ``TRITON_INTERPRET=1``: it is set inside the block (the kernels, imported before, stay JIT functions)."""
    from triton.runtime.jit import JITFunction

    calls: list[tuple[Any, tuple, dict]] = []
    kernels = {id(o): o for m in modules for o in vars(m).values() if isinstance(o, JITFunction)}

    def recorder(fn: Any) -> Callable[..., None]:
        def run(*args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
            calls.append((fn, args, kwargs))
        return run

    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    for fn in kernels.values():
        fn.run = recorder(fn)
    try:
        yield calls
    finally:
        for fn in kernels.values():
            del fn.run
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


class Seconds(NamedTuple):
    """Wall-clock seconds and CPU seconds (this process and the children it waited for: ptxas, the C compiler)
    of one piece of work: on a busy machine the CPU time is what the work costs on an idle core."""

    wall: float
    cpu: float


def _cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@contextlib.contextmanager
def clock() -> Iterator[list[Seconds]]:
    """``with clock() as took: ...`` -- ``took[0]`` is the block's :class:`Seconds` after it."""
    took: list[Seconds] = []
    w0, c0 = time.perf_counter(), _cpu()
    yield took
    took.append(Seconds(time.perf_counter() - w0, _cpu() - c0))


class Spec:
    """One distinct specialisation of a kernel for one target: what the JIT would compile once."""

    def __init__(self, kernel: Any, sm: int, key: str, src: Any, options: Any, constexprs: dict, signature: dict):
        self.kernel, self.sm, self.key, self.src, self.options = kernel, sm, key, src, options
        self.constexprs, self.signature = constexprs, signature  # name -> value; name -> type (+ "/16")
        self.needed_by: list[str] = []  # "stage: step" of each launch that needs it, first first
        self.seconds: Seconds | None = None
        self.launcher: str | None = None  # the C launcher's source (Triton 3.6), None where prebuilt
        self.error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"kernel": self.kernel.__name__, "sm": self.sm, "constexprs": self.constexprs,
                "signature": self.signature, "num_warps": self.options.num_warps,
                "num_stages": self.options.num_stages, "seconds": self.seconds and self.seconds._asdict(),
                "needed_by": self.needed_by,
                "error": self.error}


def specialise(fn: Any, args: tuple, kwargs: dict, sm: int, binders: dict) -> Spec:
    """The JIT's specialisation of ``fn[grid](*args, **kwargs)`` for GPU ``sm``, by Triton's own binder (as
    ``JITFunction.run`` computes it before its cache lookup)."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    if (id(fn), sm) not in binders:
        backend = make_backend(GPUTarget("cuda", sm, 32))
        binders[id(fn), sm] = backend, create_function_from_signature(fn.signature, fn.params, backend)
    backend, binder = binders[id(fn), sm]
    kw = dict(kwargs)
    kw["debug"] = kw.get("debug", fn.debug) or knobs.runtime.debug
    if hasattr(knobs.compilation, "instrumentation_mode"):
        kw["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    bound, spec, opts = binder(*args, **kw)
    signature, constexprs, shown, attrs = {}, {}, {}, {}
    for i, (p, (ty, sp)) in enumerate(zip(fn.params, spec)):
        if isinstance(ty, tuple):
            raise NotImplementedError(f"{fn.__name__}: tuple argument {p.name}")
        signature[p.name] = ty
        if ty == "constexpr":
            constexprs[(i,)] = shown[p.name] = bound[p.name]
        elif isinstance(sp, str):
            attrs[(i,)] = backend.parse_attr(sp)
    key = f"{fn.__module__}.{fn.__name__} sm{sm} {spec}{opts}"
    runtime = {n: t + ("/16" if attrs.get((i,)) else "") for i, (n, t) in enumerate(signature.items())
               if t != "constexpr"}
    return Spec(fn, sm, key, ASTSource(fn, signature, constexprs, attrs), backend.parse_options(kw),
                {n: v if isinstance(v, (bool, int, float, str)) else str(v) for n, v in shown.items()}, runtime)


def _nvidia_driver() -> Any:
    from triton.backends.nvidia import driver

    return driver


def launcher_source(spec: Spec, compiled: Any) -> str | None:
    """The C source of the launcher Triton builds for ``spec`` (Triton <= 3.6), None where it has a prebuilt one."""
    make = getattr(_nvidia_driver(), "make_launcher", None)
    if make is None:
        return None
    names = spec.src.fn.arg_names
    consts = {(names.index(k),) if isinstance(k, str) else k: v for k, v in spec.src.constants.items()}
    return make(consts, dict(spec.src.signature), getattr(compiled.metadata, "tensordesc_meta", None))


def build_seconds(c_source: str, name: str) -> Seconds:
    """Seconds to build ``c_source`` as Triton's runtime builds its modules (``triton.runtime.build``: the host
    C compiler, -O3 -shared -fPIC, Triton's CUDA headers and Python's), minus linking libcuda (no driver here)."""
    import shutil
    import subprocess
    import sysconfig

    drv = _nvidia_driver()
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("no C compiler (CC, gcc, clang) for Triton's launcher")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, f"{name}.c")
        with open(path, "w") as f:
            f.write(c_source)
        incs = [*drv.include_dirs, d, sysconfig.get_paths()["include"]]
        cmd = [cc, path, "-O3", "-shared", "-fPIC", "-Wno-psabi", "-o", os.path.join(d, f"{name}.so"),
               f"-L{drv.libdevice_dir}", *(f"-I{i}" for i in incs)]
        with clock() as took:
            subprocess.run(cmd, check=True, capture_output=True)
        return took[0]


def warmup_seconds(sm: int) -> Seconds:
    """Seconds of a fresh process's first compile (a one-store kernel): what every stage pays once."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget

    def _aot_warmup(x_ptr):
        tl.store(x_ptr, 1.0)

    fn = triton.jit(_aot_warmup)
    with clock() as took:
        triton.compile(triton.compiler.ASTSource(fn, {"x_ptr": "*fp32"}), target=GPUTarget("cuda", sm, 32))
    return took[0]


def compile_spec(spec: Spec) -> Any:
    """Compile ``spec`` (its seconds or error on it); the compiled kernel or None."""
    import triton
    from triton.backends.compiler import GPUTarget

    try:
        with clock() as took:
            compiled = triton.compile(spec.src, target=GPUTarget("cuda", spec.sm, 32), options=spec.options.__dict__)
        spec.seconds = took[0]
        return compiled
    except Exception as e:  # noqa: BLE001 -- a failed compile is a row of the report (and a non-zero exit)
        spec.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
        return None


def runtime_module() -> str | None:
    """The C source of Triton's ``cuda_utils`` module, built at a process's first launch where Triton builds
    its modules from source (3.6; cached in TRITON_CACHE_DIR); None where it is prebuilt (3.8)."""
    drv = _nvidia_driver()
    path = os.path.join(os.path.dirname(drv.__file__), "driver.c")
    if getattr(drv, "make_launcher", None) is None or not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read()


def ptxas_version() -> str:
    """The release of the ptxas Triton compiles with (the one it ships), or ``missing``."""
    import re
    import subprocess

    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.isfile(path):
        return "missing"
    out = subprocess.run([path, "--version"], capture_output=True, text=True, check=False).stdout
    m = re.search(r"release ([\d.]+)", out)
    return m.group(1) if m else "?"
