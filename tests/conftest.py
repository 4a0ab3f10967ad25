"""Shared test setup.

* Without a GPU, Triton kernels run in the interpreter: TRITON_INTERPRET=1 is set here, before
  anything imports triton.
* The matmul route cache (``mpkern.route_cache``) of the test run lives in a folder of its own, not
  the user's cache folder.
* ``backend`` fixture: every backend that can run on this machine's test device, plus the C++ CPU
  kernels with SIMD switched off ("cpu-scalar"), so both CPU code paths are covered.
* ``one_rank_group`` fixture: a one-rank gloo process group in this process (state dicts and DTensors
  without a second process).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import tempfile

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("MPKERN_CACHE_DIR", tempfile.mkdtemp(prefix="mpkern-test-cache-"))

from mpkern import _backend, codecs  # noqa: E402 -- imported after TRITON_INTERPRET is set above

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


@functools.cache
def libm_fmaf():
    """The C library's fmaf (an IEEE fma: one rounding) -- the independent check of the kernels' fmas."""
    libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    libm.fmaf.restype = ctypes.c_float
    libm.fmaf.argtypes = [ctypes.c_float] * 3
    return libm.fmaf


def fma_np(x, y, z):
    """Elementwise float32 fma of NumPy arrays / scalars by the C library's fmaf."""
    import numpy as np

    return np.vectorize(libm_fmaf(), otypes=[np.float32])(x, y, z)


def available_backends(device: torch.device = DEVICE) -> list[str]:
    names = []
    for b in _backend.BACKENDS:
        if not _backend.runs_on(b, device):
            names.append(b)
            if b == "cpu":
                names.append("cpu-scalar")
    return names


@pytest.fixture(params=available_backends())
def backend(request, monkeypatch):
    """Force one backend for the test (MPKERN_BACKEND); yields its name."""
    name = request.param
    ext = _backend.native()
    if name == "cpu-scalar":
        monkeypatch.setenv("MPKERN_BACKEND", "cpu")
        ext.set_cpu_simd(False)
        yield name
        ext.set_cpu_simd(True)
    else:
        monkeypatch.setenv("MPKERN_BACKEND", name)
        yield name


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-rank gloo process group in this process, for the duration of the test."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    store = dist.FileStore(os.fspath(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def triton_cuda_compiler_missing() -> str | None:
    """Why Triton cannot compile for CUDA ahead of time here, no GPU needed (None when it can): the
    ahead-of-time tests (SASS of the GEMM, compile times) skip with this reason."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401 -- the ahead-of-time compile needs it
    except ImportError as e:
        return f"triton's compiler cannot be imported: {e}"
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    if not os.path.isfile(os.path.join(bindir, "ptxas")) and not os.environ.get("TRITON_PTXAS_PATH"):
        return f"Triton's CUDA backend has no ptxas ({bindir})"
    return None


_MASTER_CODECS = {c.mode: name for name, c in codecs.MASTER_CODECS.items()}
# the built-in moment codec of each exp_avg dtype (the first row of mpkern/codecs.def that stores it)
_MOMENT_CODECS: dict = {}
for _name, _codec in codecs.MOMENT_CODECS.items():
    _MOMENT_CODECS.setdefault(_codec.exp_avg_dtype, _name)


def moment_codec_for(exp_avgs) -> str:
    """The built-in moment codec whose exp_avg dtype ``exp_avgs`` have (``"float32"`` for none): what the
    kernel tests, which build their moment tensors by dtype, pass as ``moment_codec``."""
    return _MOMENT_CODECS.get(exp_avgs[0].dtype, "float32") if len(exp_avgs) else "float32"


def adamw_op_args(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, steps, grad_factor, found_inf,
                  lr_tensor, lr, beta1, beta2, eps, weight_decay, maximize, master_mode, stochastic_rounding, seed,
                  stream_ids=(), elem_offsets=(), exp_avg_scales=None, exp_avg_sq_scales=None):
    """The kernel tests' arguments, in the order of ``mpkern.reference.adamw_step_`` (master mode as
    its number, moment codec from the moment dtype), as the ``mpkern::adamw_step_`` op takes them:
    ``(positional, keywords)``."""
    codec = moment_codec_for(exp_avgs)
    return ((params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, steps, grad_factor, found_inf, lr_tensor,
             exp_avg_scales, exp_avg_sq_scales),
            dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, maximize=maximize,
                 master_codec=_MASTER_CODECS.get(master_mode, str(master_mode)), moment_codec=codec,
                 stochastic_rounding=stochastic_rounding, seed=seed, stream_ids=list(stream_ids),
                 elem_offsets=list(elem_offsets)))


def call_adamw_op(op, *legacy):
    """``op`` (``torch.ops.mpkern.adamw_step_``, or ``functools.partial(mpkern._ops.adamw_step_,
    backend)``) called with :func:`adamw_op_args`."""
    args, kwargs = adamw_op_args(*legacy)
    return op(*args, **kwargs)


@contextlib.contextmanager
def kernel_path(path: str):
    """Select a kernel path by name and yield its backend: "cpu-scalar" (the C++ CPU kernel without
    SIMD), "cpu-avx2" (MPKERN_CPU_AVX512=0, read by the kernel on every call), or any backend name
    as it is ("cpu": AVX-512 where the CPU has it). The previous setting is restored."""
    ext = _backend.native()
    old = os.environ.get("MPKERN_CPU_AVX512")
    if path == "cpu-scalar":
        ext.set_cpu_simd(False)
    elif path == "cpu-avx2":
        os.environ["MPKERN_CPU_AVX512"] = "0"
    try:
        yield "cpu" if path.startswith("cpu") else path
    finally:
        if path == "cpu-scalar":
            ext.set_cpu_simd(True)
        elif path == "cpu-avx2":
            if old is None:
                del os.environ["MPKERN_CPU_AVX512"]
            else:
                os.environ["MPKERN_CPU_AVX512"] = old


class OpsSeen(TorchDispatchMode):
    """A dispatch mode that records the name of every op it sees (``.ops``) and runs it."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))
