"""Backend discovery and selection.

Four backends can run an mpkern op:

* ``cuda``   -- the C++/CUDA kernels of the native extension (CUDA tensors);
* ``triton`` -- the Triton kernels (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``);
* ``cpu``    -- the C++ CPU kernels of the native extension (CPU tensors);
* ``torch``  -- the pure-PyTorch reference implementations (any device; always available).

``MPKERN_BACKEND=cuda|triton|cpu|torch`` forces one for every op; a forced backend that cannot
run on the tensors' device is an error that says why. Otherwise each call picks the best backend
available for its device. Importing mpkern never fails because a backend is missing: the reason
is recorded and reported by ``mpkern.info()``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

BACKENDS = ("cuda", "triton", "cpu", "torch")
#: the environment variable that forces a backend (read at every selection)
ENV = "MPKERN_BACKEND"


@dataclass(frozen=True)
class BackendStatus:
    """Whether a backend can run, and if not, why."""

    name: str
    available: bool
    reason: str


@functools.cache
def native():
    """The native extension module ``mpkern._C``, or None if it cannot be imported."""
    try:
        return importlib.import_module("mpkern._C")
    except (ImportError, OSError):
        return None


@functools.cache
def native_error() -> str:
    try:
        importlib.import_module("mpkern._C")
    except (ImportError, OSError) as e:  # pragma: no cover - depends on the install
        return f"native extension mpkern._C not importable ({type(e).__name__}: {e}); " \
               "build it with `pip install --no-build-isolation -e .`"
    return ""


@functools.cache
def triton_error() -> str:
    """Empty if Triton imports, else why not."""
    try:
        import triton  # noqa: F401 -- imported only to learn whether it imports
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        return f"triton not importable ({type(e).__name__}: {e})"
    return ""


def triton_interpret() -> bool:
    """True when Triton kernels run in the interpreter (on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def status(name: str) -> BackendStatus:
    """Availability of backend ``name`` on this machine (for any device it supports)."""
    if name == "torch":
        return BackendStatus(name, True, "pure PyTorch reference (always available)")
    if name == "cpu":
        ext = native()
        if ext is None:
            return BackendStatus(name, False, native_error())
        simd = "AVX2+FMA+F16C" if ext.cpu_simd_level() >= 1 else "scalar (no AVX2 on this CPU or MPKERN_CPU_SIMD=0)"
        return BackendStatus(name, True, f"C++ kernels, {simd}")
    if name == "cuda":
        ext = native()
        if ext is None:
            return BackendStatus(name, False, native_error())
        if not ext.cuda_built:
            return BackendStatus(name, False, "native extension was built without CUDA kernels "
                                              "(torch without CUDA, nvcc not found, or MPKERN_BUILD_CUDA=0)")
        if not torch.cuda.is_available():
            return BackendStatus(name, False, f"CUDA kernels built for sm {ext.cuda_archs}, but no GPU is visible")
        index = torch.cuda.current_device()
        why = cuda_device_problem(index)
        if why:
            return BackendStatus(name, False, why)
        cap = torch.cuda.get_device_capability(index)
        return BackendStatus(name, True, f"CUDA kernels built for {ext.cuda_archs}; this GPU (sm_{cap[0]}{cap[1]}) "
                                         f"runs {arch_match(cap, ext.cuda_archs)[1]}")
    if name == "triton":
        err = triton_error()
        if err:
            return BackendStatus(name, False, err)
        if native() is None:
            return BackendStatus(name, False, "the Triton ops share the argument checks of the native extension: "
                                              + native_error())
        import triton

        if torch.cuda.is_available():
            return BackendStatus(name, True, f"Triton {triton.__version__} on GPU")
        if triton_interpret():
            return BackendStatus(name, True, f"Triton {triton.__version__} interpreter on CPU (TRITON_INTERPRET=1)")
        return BackendStatus(name, False, f"Triton {triton.__version__} installed, but no GPU is visible "
                                          "(set TRITON_INTERPRET=1 to run its kernels on CPU, slowly)")
    raise ValueError(f"unknown backend {name!r}; expected one of {BACKENDS}")


def parse_arch_list(arch_list: str) -> tuple[set[tuple[int, int]], set[tuple[int, int]], set[tuple[int, int]]]:
    """``TORCH_CUDA_ARCH_LIST`` (e.g. ``"8.0;9.0+PTX"``) -> (SASS archs, arch-specific SASS archs
    such as ``9.0a``, PTX archs). Entries that are not ``major.minor`` are ignored."""
    sass: set[tuple[int, int]] = set()
    specific: set[tuple[int, int]] = set()
    ptx: set[tuple[int, int]] = set()
    for item in re.split(r"[;,\s]+", arch_list or ""):
        m = re.fullmatch(r"(\d+)\.(\d+)([af]?)(\+PTX)?", item.strip(), flags=re.IGNORECASE)
        if not m:
            continue
        arch = (int(m.group(1)), int(m.group(2)))
        (specific if m.group(3) else sass).add(arch)
        if m.group(4):
            ptx.add(arch)
    return sass, specific, ptx


def arch_match(capability: tuple[int, int], arch_list: str) -> tuple[bool, str]:
    """Whether kernels built for ``arch_list`` can run on a GPU of ``capability``, and how.

    CUDA's rules: SASS built for sm_XY runs on sm_XZ with Z >= Y (same major only); arch-specific
    SASS (``9.0a``) only on that exact arch; PTX for compute_XY is JIT-compiled by the driver for
    any GPU of capability >= X.Y. Returns ``(True, "SASS sm_80")`` / ``(True, "PTX compute_90 (JIT)")``
    or ``(False, reason)``. An arch list this function cannot read gives ``(True, "unknown")``:
    the driver probe (:func:`cuda_device_problem`) decides then.
    """
    sass, specific, ptx = parse_arch_list(arch_list)
    major, minor = capability
    if not (sass or specific or ptx):
        return True, f"kernels for {arch_list or 'the build machine'} (arch list not parsed)"
    if capability in specific:
        return True, f"SASS sm_{major}{minor}a"
    same_major = [a for a in sass if a[0] == major and a[1] <= minor]
    if same_major:
        a = max(same_major)
        return True, f"SASS sm_{a[0]}{a[1]}"
    older_ptx = [a for a in ptx if a <= capability]
    if older_ptx:
        a = max(older_ptx)
        return True, f"PTX compute_{a[0]}{a[1]} (JIT-compiled by the driver)"
    built = ", ".join([f"sm_{a}{b}" for a, b in sorted(sass)] + [f"sm_{a}{b}a" for a, b in sorted(specific)]) or "none"
    ptxs = ", ".join(f"compute_{a}{b}" for a, b in sorted(ptx)) or "none"
    return False, (f"the CUDA kernels were built for {built} (PTX: {ptxs}), which cannot run on this GPU "
                   f"(sm_{major}{minor}); rebuild with TORCH_CUDA_ARCH_LIST=\"{major}.{minor}\" -- until then "
                   "the triton backend is used")


@functools.cache
def cuda_device_problem(index: int) -> str:
    """Empty if the native CUDA kernels can run on GPU ``index``, else why not (cached per GPU).

    Checks the device's capability against the built arch list, then asks the driver whether it
    has a kernel image for the device (SASS or PTX it can JIT), so a build that cannot run here
    falls back to Triton instead of failing with "no kernel image is available".
    """
    ext = native()
    major, minor = torch.cuda.get_device_capability(index)
    cap = (major, minor)
    ok, why = arch_match(cap, ext.cuda_archs)
    if not ok:
        return why
    probe = getattr(ext, "cuda_kernel_image_error", None)
    err = probe(index) if probe is not None else ""
    if err:
        return (f"the CUDA kernels (built for {ext.cuda_archs}) have no kernel image for GPU {index} "
                f"(sm_{cap[0]}{cap[1]}): {err}")
    return ""


def forced() -> str | None:
    """The backend forced by MPKERN_BACKEND, or None."""
    val = os.environ.get(ENV, "").strip().lower()
    if not val:
        return None
    if val not in BACKENDS:
        raise ValueError(f"{ENV}={val!r} is not a backend; expected one of {', '.join(BACKENDS)}")
    return val


def use_backend(name: str | None) -> contextlib.AbstractContextManager[None]:
    """Run the mpkern ops of the block on backend ``name`` -- ``"cuda"``, ``"triton"``, ``"cpu"`` or
    ``"torch"`` -- as ``MPKERN_BACKEND=name`` would (``None``: the automatic choice); on leaving the
    block the previous setting, or its absence, is restored, also when the block raises.

    ``mpkern.use_backend``. The name is read like the environment variable (case and surrounding
    spaces do not matter). The setting is process-wide (it is the environment variable, which
    subprocesses inherit), not per thread. An unknown name is a ``ValueError`` and a non-string a
    ``TypeError``, raised by this call, before anything changes; a backend that cannot run on an
    op's tensors is refused by that op with the reason (:func:`select`). ``torch.compile`` reads
    the backend once, when it traces.

    >>> import mpkern, torch
    >>> with mpkern.use_backend("torch"):   # the pure-PyTorch reference kernels
    ...     res = mpkern.unscale_([torch.nn.Parameter(torch.ones(3))], max_norm=1.0)
    """
    if name is not None and not isinstance(name, str):
        raise TypeError(f"use_backend: name must be a str or None, got {type(name).__name__}")
    value = None if name is None else name.strip().lower()
    if value is not None and value not in BACKENDS:
        raise ValueError(f"use_backend: {name!r} is not a backend; expected one of {', '.join(BACKENDS)} or None")
    return env_setting(ENV, value)


@contextlib.contextmanager
def env_setting(var: str, value: str | None) -> Iterator[None]:
    """The environment variable ``var`` set to ``value`` (unset for None) within the block, its old
    setting (or absence) restored after it, also when the block raises."""
    old = os.environ.get(var)
    if value is None:
        os.environ.pop(var, None)
    else:
        os.environ[var] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = old


def runs_on(name: str, device: torch.device) -> str:
    """Empty if backend ``name`` can run on ``device`` now, else the reason it cannot."""
    st = status(name)
    if not st.available:
        return st.reason
    if name == "cpu" and device.type != "cpu":
        return f"the cpu backend runs on CPU tensors, got {device}"
    if name == "cuda":
        if device.type != "cuda":
            return f"the cuda backend runs on CUDA tensors, got {device}"
        index = device.index if device.index is not None else torch.cuda.current_device()
        why = cuda_device_problem(index)
        if why:
            return why
    if name == "triton":
        if device.type == "cpu" and not triton_interpret():
            return "Triton runs on CPU tensors only under TRITON_INTERPRET=1"
        if device.type not in ("cpu", "cuda"):
            return f"Triton does not run on {device}"
    return ""


@torch.compiler.assume_constant_result
def select(device: torch.device | str) -> str:
    """The backend an op on ``device`` uses: the forced one, or the best available."""
    device = torch.device(device)
    name = forced()
    if name is not None:
        why = runs_on(name, device)
        if why:
            raise RuntimeError(f"{ENV}={name} cannot run on {device}: {why}")
        return name
    order = ("cuda", "triton", "torch") if device.type == "cuda" else ("cpu", "torch")
    for cand in order:
        if not runs_on(cand, device):
            return cand
    return "torch"
