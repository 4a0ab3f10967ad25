"""Shared test setup.

* Without a GPU, Triton kernels run in the interpreter: TRITON_INTERPRET=1 is set here, before
  anything imports triton.
* ``backend`` fixture: every backend that can run on this machine's test device, plus the C++ CPU
  kernels with SIMD switched off ("cpu-scalar"), so both CPU code paths are covered.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import mpkern  # noqa: E402
from mpkern import _backend  # noqa: E402

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


def available_backends(device: torch.device = DEVICE) -> list[str]:
    names = []
    for b in _backend.BACKENDS:
        if not _backend._runs_on(b, device):
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


requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
