"""The pre-checks of ``scripts/gpu_check.sh``, before anything is built: is ninja there, does torch's
CUDA version fit the local ``nvcc``, which GPU is this and what is its compute capability.

Run as ``python -m tools.gpu_check.precheck OUTDIR`` from the repository root. It must work before
mpkern is built, so it imports the standard library only, and torch inside :func:`precheck` (what
it checks; a torch that fails to import is a problem it reports). Writes
``OUTDIR/precheck.json`` and ``OUTDIR/arch.txt`` (the ``TORCH_CUDA_ARCH_LIST`` value for this GPU
alone, e.g. ``9.0``; empty without a GPU) and prints one line per check. Exit status 0 when a CUDA
build can be attempted, 3 when no GPU is visible, 4 when the toolchain cannot build (the script
then skips the build and still runs the Triton paths).
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from typing import Any

__all__ = ["parse_nvcc_version", "cuda_version_problem", "arch_string", "precheck", "main"]

_NVCC_RELEASE = re.compile(r"release\s+(\d+)\.(\d+)")


def parse_nvcc_version(text: str) -> str | None:
    """``"12.8"`` from ``nvcc --version`` output (``Cuda compilation tools, release 12.8, V12.8.93``),
    None if the text has no release line."""
    m = _NVCC_RELEASE.search(text or "")
    return f"{m.group(1)}.{m.group(2)}" if m else None


def _major_minor(version: str) -> tuple[int, int]:
    m = re.match(r"^\s*(\d+)(?:\.(\d+))?", str(version))
    if not m:
        raise ValueError(f"not a CUDA version: {version!r}")
    return int(m.group(1)), int(m.group(2) or 0)


def cuda_version_problem(torch_cuda: str | None, nvcc: str | None) -> tuple[str, bool]:
    """``(message, fatal)`` for torch's CUDA version against nvcc's, by torch's own rule
    (``torch.utils.cpp_extension``: a different major version refuses to build, a different minor
    version only warns). ``("", False)`` when they agree."""
    if not torch_cuda:
        return "torch has no CUDA (a CPU-only torch build): no CUDA kernels can be built", True
    if not nvcc:
        return "nvcc not found (PATH / CUDA_HOME): the CUDA kernels cannot be built", True
    t, n = _major_minor(torch_cuda), _major_minor(nvcc)
    if t[0] != n[0]:
        return (f"torch was built with CUDA {torch_cuda} but nvcc is {nvcc}: a different major version "
                "cannot build the extension"), True
    if t != n:
        return f"torch CUDA {torch_cuda} vs nvcc {nvcc}: same major version, the build only warns", False
    return "", False


def arch_string(capability: tuple[int, int] | list[int] | None) -> str:
    """``TORCH_CUDA_ARCH_LIST`` for one GPU: ``(9, 0)`` -> ``"9.0"``; ``""`` for None."""
    if capability is None:
        return ""
    major, minor = (int(x) for x in capability)
    if major < 1 or minor < 0:
        raise ValueError(f"not a compute capability: {capability!r}")
    return f"{major}.{minor}"


def _run(cmd: list[str], timeout: float = 10.0) -> str:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"<{type(e).__name__}>"
    return (p.stdout or "") + (p.stderr or "")


def _ninja_version() -> str | None:
    exe = shutil.which("ninja")
    if exe:
        out = _run([exe, "--version"]).strip()
        return out or exe
    try:
        from torch.utils.cpp_extension import is_ninja_available
    except ImportError:
        return None
    return "found by torch" if is_ninja_available() else None


def _nvcc() -> tuple[str | None, str]:
    cands = [shutil.which("nvcc")]
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        cands.append(os.path.join(home, "bin", "nvcc"))
    cands.append("/usr/local/cuda/bin/nvcc")
    for exe in cands:
        if exe and os.path.exists(exe):
            return parse_nvcc_version(_run([exe, "--version"])), exe
    return None, ""


def precheck() -> dict[str, Any]:
    """Every check as a dict (what ``precheck.json`` holds); ``problems`` lists what is wrong."""
    res: dict[str, Any] = {"python": platform.python_version(), "problems": []}
    try:
        import torch
    except Exception as e:  # noqa: BLE001 -- said in the summary, not raised
        res["problems"].append(f"import torch failed: {type(e).__name__}: {e}")
        res["gpu"] = None
        return res
    res["torch"], res["torch_cuda"] = torch.__version__, torch.version.cuda
    for mod in ("triton", "numpy"):
        try:
            res[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001 -- a module that fails to import in any way is reported, not raised
            res[mod] = f"not importable ({type(e).__name__})"
    res["ninja"] = _ninja_version()
    if not res["ninja"]:
        res["problems"].append("ninja is missing: torch builds serially without it (pip install ninja)")
    res["nvcc"], res["nvcc_path"] = _nvcc()
    msg, fatal = cuda_version_problem(torch.version.cuda, res["nvcc"])
    res["cuda_match"], res["can_build_cuda"] = msg or "ok", not fatal
    if msg:
        res["problems"].append(msg)
    res["gpu"], res["arch"] = None, ""
    if torch.cuda.is_available():
        idx = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        cap = torch.cuda.get_device_capability(idx)
        res["arch"] = arch_string(cap)
        res["gpu"] = {"name": props.name, "capability": list(cap), "arch": res["arch"],
                      "sms": props.multi_processor_count, "memory_bytes": props.total_memory,
                      "l2_bytes": getattr(props, "L2_cache_size", None), "count": torch.cuda.device_count()}
        smi = _run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem",
                    "--format=csv,noheader"]).strip().splitlines()
        res["driver"] = smi[0] if smi else "?"
    else:
        res["problems"].append("torch.cuda.is_available() is False: no GPU to check")
    return res


def main(argv: list[str] | None = None) -> int:
    """``python -m tools.gpu_check.precheck OUTDIR``: write ``precheck.json`` and ``arch.txt`` there,
    print the checks; the exit status of the module docstring (2: a bad command line)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m tools.gpu_check.precheck OUTDIR", file=sys.stderr)
        return 2
    out = args[0]
    os.makedirs(out, exist_ok=True)
    res = precheck()
    with open(os.path.join(out, "precheck.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(out, "arch.txt"), "w") as f:
        f.write(res.get("arch") or "")
    for key in ("python", "torch", "torch_cuda", "triton", "numpy", "ninja", "nvcc", "cuda_match", "arch", "gpu"):
        print(f"{key}: {res.get(key)}")
    for p in res["problems"]:
        print(f"PROBLEM: {p}")
    if not res.get("gpu"):
        return 3
    return 0 if res.get("can_build_cuda") else 4


if __name__ == "__main__":
    sys.exit(main())
