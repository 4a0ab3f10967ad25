"""The launch shape of the CUDA AdamW kernel: threads per block, grid blocks per SM (the grid is
``min(chunks, SMs x grid_per_sm)`` blocks striding over the chunks), elements per chunk, and the
compact-moment kernels' load stages (1: each warp pass's loads held in registers; 2: the next pass's
loads copied into shared memory while the current pass updates -- twice the bytes in flight per SM,
at a few more instructions per element; the fp32 / bf16-moment kernels ignore it).

Each GPU arch takes its shape from the table in ``csrc/cuda/adamw_cuda.cu`` (``kArchConfigs``: the
measured best, with the run that measured it; the built-in default for an arch no run has swept).
:func:`adamw_shape_set` overrides it for every device while it is open -- the sweep stage of
``scripts/gpu_check.sh`` (``tools/gpu_check/sweep.py``) times the shapes that way. Every shape gives
the same results bit for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch

from . import _backend


class LaunchShape(NamedTuple):
    """A launch shape and where it comes from (the table row's source, or ``"set_adamw_config"``)."""

    block: int
    grid_per_sm: int
    chunk: int
    stages: int
    source: str


def _cuda_ext():
    ext = _backend.native()
    if ext is None or not getattr(ext, "cuda_built", False):
        raise RuntimeError("mpkern.launch_shape: needs mpkern's CUDA kernels (the native extension built with CUDA)")
    return ext


def adamw_shape(device: torch.device | str | int | None = None) -> LaunchShape:
    """The shape the AdamW kernel launches with on ``device`` (default: the current CUDA device)."""
    if device is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"adamw_shape: device must be a CUDA device, got {dev}")
    block, grid, chunk, stages, source = _cuda_ext().cuda_adamw_config(dev.index if dev.index is not None else 0)
    return LaunchShape(int(block), int(grid), int(chunk), int(stages), str(source))


@contextlib.contextmanager
def adamw_shape_set(block: int, grid_per_sm: int, chunk: int, stages: int = 1) -> Iterator[None]:
    """Launch the AdamW kernel with this shape on every device inside the block, then go back to each
    arch's shape. ValueError (before anything changes) unless ``block`` is a multiple of 32 in [32, 256],
    ``grid_per_sm`` in [1, 64], ``chunk`` a multiple of 256 in [256, 65536] and ``stages`` 1 or 2."""
    for name, v in (("block", block), ("grid_per_sm", grid_per_sm), ("chunk", chunk), ("stages", stages)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"adamw_shape_set: {name} must be an int, got {v!r}")
    ext = _cuda_ext()
    ext.set_cuda_adamw_config(block, grid_per_sm, chunk, stages)
    try:
        yield
    finally:
        ext.clear_cuda_adamw_config()
