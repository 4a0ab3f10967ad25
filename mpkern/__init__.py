"""mpkern: fused mixed-precision training kernels for PyTorch.

* :func:`unscale_` -- unscale + inf/NaN check + global-norm clip in one fused pass, no host sync.
* :class:`FusedAdamWMP` -- drop-in AdamW with fp32 master weights, one fused kernel per group.
* :func:`matmul` / :func:`linear` / :mod:`mpkern.nn` -- fp16/bf16 GEMM with fp32 accumulation.
* :func:`diagnose` -- where fp16/bf16 breaks a model, why, and the fix (:mod:`mpkern.doctor`).
* :func:`info` / :func:`bf16_supported` -- what this machine and build can run, and why not.

Backends: ``cuda`` (C++/CUDA), ``triton``, ``cpu`` (C++), ``torch`` (pure PyTorch reference);
``MPKERN_BACKEND`` forces one. See ``mpkern info``.
"""

from __future__ import annotations

from typing import Any

import torch

from . import (
    _backend,
    _ops,  # noqa: F401 -- imported for its effect: it registers the op schemas and fakes
    launch_shape,
    nn,
    reference,
    versions,
)
from ._backend import BACKENDS, use_backend
from .amp import UnscaleResult, clip_grad_norm_, unscale_
from .doctor import Diagnosis, NonfiniteEntry, NonfiniteReport, diagnose, nonfinite_report
from .matmul import linear, matmul, matmul_accumulate_, routes as matmul_routes_for, use_route
from .optim import FusedAdamWMP

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "FusedAdamWMP",
    "linear",
    "matmul",
    "matmul_accumulate_",
    "matmul_routes_for",
    "nn",
    "bf16_supported",
    "clip_grad_norm_",
    "diagnose",
    "Diagnosis",
    "NonfiniteEntry",
    "NonfiniteReport",
    "info",
    "nonfinite_report",
    "reference",
    "unscale_",
    "use_backend",
    "BACKENDS",
    "use_route",
    "UnscaleResult",
]


def bf16_supported(device: torch.device | str | int | None = None) -> bool:
    """Whether ``device`` computes in bfloat16 natively.

    CUDA: compute capability >= 8.0 (Ampere and newer). CPU: True (PyTorch runs bf16 on any CPU;
    it is fast with AVX-512-BF16/AMX, emulated in fp32 otherwise). ``None``: the current CUDA
    device if there is one, else the CPU.
    """
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    elif isinstance(device, int):
        device = torch.device("cuda", device)
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False
        major, _ = torch.cuda.get_device_capability(device)
        return major >= 8
    return device.type == "cpu"


def info() -> dict[str, Any]:
    """What mpkern can run here: device, capability, dtype support, and each backend's status.

    Returns a dict with ``version``, ``torch``, ``device`` (name), ``capability`` (``(major, minor)``
    or None), ``bf16``/``fp16`` support, ``forced_backend``, ``backends``:
    ``{name: {"available": bool, "reason": str}}``, ``torch_tested`` (the torch range mpkern is
    tested on, :mod:`mpkern.versions`) and ``torch_warning`` (a line when torch lies outside it,
    else None), ``native``: the compiled extension (``imported``, ``error`` when it is not,
    ``cuda_built``, ``cuda_archs``, ``cuda_problem``: why its CUDA kernels cannot run on this GPU, ""
    when they can), ``selected_backend``: the backend an op on this device takes now (``"error: ..."``
    when a forced one cannot run here), ``adamw_launch_shape``: the CUDA AdamW kernel's launch shape on
    this GPU (``block``, ``grid_per_sm``, ``chunk``, ``source``: :mod:`mpkern.launch_shape`; None
    without a GPU the CUDA kernels run on).
    """
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda") if cuda else torch.device("cpu")
    if cuda:
        name = torch.cuda.get_device_name(dev)
        cap = torch.cuda.get_device_capability(dev)
        fp16 = True
    else:
        import platform

        name = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, " \
               f"ATen capability {torch.backends.cpu.get_cpu_capability()})"
        cap = None
        fp16 = True
    ext = _backend.native()
    try:
        forced = _backend.forced()
    except ValueError as e:
        forced = f"invalid: {e}"
    cuda_built = bool(getattr(ext, "cuda_built", False))
    native = {"imported": ext is not None, "error": "" if ext is not None else _backend.native_error(),
              "cuda_built": cuda_built, "cuda_archs": getattr(ext, "cuda_archs", None),
              "cuda_problem": (_backend.cuda_device_problem(dev.index or 0) if cuda_built else "not built")
              if cuda else "no CUDA GPU"}
    try:
        selected = _backend.select(dev)
    except (RuntimeError, ValueError) as e:
        selected = f"error: {e}"
    shape = None  # the CUDA AdamW kernel's launch shape on this GPU (mpkern.launch_shape) and where it comes from
    if cuda and cuda_built and not native["cuda_problem"]:
        shape = launch_shape.adamw_shape(dev)._asdict()
    return {
        "version": __version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "device": name,
        "capability": cap,
        "bf16": bf16_supported(dev),
        "fp16": fp16,
        "native_built_against_torch": getattr(ext, "torch_version", None),
        "torch_tested": versions.tested_torch_label(),
        "torch_warning": versions.torch_warning(torch.__version__),
        "forced_backend": forced,
        "native": native,
        "selected_backend": selected,
        "adamw_launch_shape": shape,
        "backends": {b: {"available": s.available, "reason": s.reason}
                     for b, s in ((b, _backend.status(b)) for b in _backend.BACKENDS)},
        "matmul": dict(_matmul_notes()),
        "matmul_routes": _matmul_routes(dev),
        "matmul_chosen": _matmul_chosen(dev),
    }


def _matmul_notes() -> dict[str, str]:
    from .matmul import NOTES

    return NOTES


def _matmul_routes(dev: torch.device) -> dict[str, dict[str, str]]:
    """Per operand dtype and epilogue, each route's reason it cannot run here ("" when it can)."""
    from .matmul import routes

    out: dict[str, dict[str, str]] = {}
    for dt in (torch.bfloat16, torch.float16):
        for label, od, epilogue in (("", dt, "none"), (" -> fp32", torch.float32, "none"),
                                    (" += fp32", torch.float32, "accumulate")):
            try:
                out[f"{str(dt).removeprefix('torch.')}{label}"] = routes(dev, dt, od, epilogue)
            except (RuntimeError, ValueError) as e:  # a forced backend that cannot run here
                out[f"{str(dt).removeprefix('torch.')}{label}"] = {"error": str(e)}
    return out


def _matmul_chosen(dev: torch.device) -> list[dict[str, Any]]:
    """The route choices remembered on disk for this device type (``mpkern.route_cache``)."""
    from . import route_cache

    return [{"problem": dict(e["problem"]._asdict()), "route": e["route"], "ms": e["ms"]}
            for e in route_cache.entries(dev.type)]
