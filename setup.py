"""Build of mpkern's native extension ``mpkern._C``.

* The C++ CPU kernels are always built (baseline x86-64; AVX2 code is chosen at run time).
* The CUDA kernels are built when ``MPKERN_BUILD_CUDA`` is ``auto`` (default) and torch has CUDA
  and nvcc is found, or always with ``MPKERN_BUILD_CUDA=1`` (which fails loudly if it cannot);
  ``MPKERN_BUILD_CUDA=0`` skips them. ``TORCH_CUDA_ARCH_LIST`` is honoured; with no GPU visible it
  defaults to ``8.0;9.0``. PTX of the newest listed arch is embedded too (``+PTX``), so GPUs newer
  than every listed arch can JIT-compile the kernels instead of failing with "no kernel image".
  ``MPKERN_PTXAS_VERBOSE=1`` prints ptxas' register and spill counts per kernel.
* ``CUDA_HOME`` unset: taken from ``nvcc --dryrun`` (``TOP=``), which sees through wrapper
  scripts on PATH. CUDA math headers missing from that toolkit are taken from the
  ``nvidia/cu13/include`` (or ``cu12``) folder of the pip CUDA packages, searched after the
  toolkit's own headers (``-isystem``), so a pip CUDA newer than nvcc cannot shadow them.

Build in place with ``pip install --no-build-isolation -e .`` once torch is installed.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _log(msg: str) -> None:
    print(f"[mpkern setup] {msg}", file=sys.stderr)


def _toolkit_root_from_nvcc() -> str | None:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    try:
        out = subprocess.run(
            [nvcc, "--dryrun", "-x", "cu", "-c", os.devnull],
            capture_output=True, text=True, timeout=60, check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"TOP=(\S+)", out.stdout + out.stderr)
    return os.path.realpath(m.group(1)) if m else os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))


def _pip_cuda_include() -> str | None:
    try:
        import nvidia  # type: ignore

        roots = list(nvidia.__path__)
    except ImportError:
        return None
    for root in roots:
        for sub in ("cu13", "cu12"):
            inc = os.path.join(root, sub, "include")
            if os.path.isfile(os.path.join(inc, "cusparse.h")):
                return inc
    return None


def _want_cuda() -> tuple[bool, str]:
    mode = os.environ.get("MPKERN_BUILD_CUDA", "auto").lower()
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"MPKERN_BUILD_CUDA must be auto, 0 or 1, got {mode!r}")
    if mode == "0":
        return False, "MPKERN_BUILD_CUDA=0"
    import torch

    reasons = []
    if torch.version.cuda is None:
        reasons.append("torch was built without CUDA")
    if os.environ.get("CUDA_HOME") is None:
        root = _toolkit_root_from_nvcc()
        if root is None:
            reasons.append("nvcc not found on PATH and CUDA_HOME unset")
        else:
            os.environ["CUDA_HOME"] = root
            _log(f"CUDA_HOME={root} (from nvcc --dryrun)")
    if reasons:
        if mode == "1":
            raise SystemExit("MPKERN_BUILD_CUDA=1 but the CUDA build is impossible: " + "; ".join(reasons))
        return False, "; ".join(reasons)
    return True, ""


def _with_ptx(arch_list: str) -> str:
    """``TORCH_CUDA_ARCH_LIST`` with PTX embedded for its newest arch (unless it has PTX already).

    SASS runs only on its own major architecture; PTX is JIT-compiled by the driver for any newer
    GPU. ``"8.0;9.0"`` -> ``"8.0;9.0+PTX"``. An empty list stays empty (torch then picks the
    visible GPUs' archs and adds PTX itself).
    """
    items = [a.strip() for a in arch_list.replace(",", ";").replace(" ", ";").split(";") if a.strip()]
    if not items or any(a.upper().endswith("+PTX") for a in items):
        return ";".join(items)

    def key(a: str) -> tuple[int, int]:
        m = re.match(r"(\d+)\.(\d+)", a)
        return (int(m.group(1)), int(m.group(2))) if m else (0, 0)

    newest = max(range(len(items)), key=lambda i: key(items[i]))
    items[newest] += "+PTX"
    return ";".join(items)


def _extensions(with_cuda: bool, why_not: str):
    import torch
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    include_dirs = [os.path.join(ROOT, "csrc"), os.path.join(ROOT, "csrc", "include")]
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")) + glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    # -fopenmp: at::parallel_for is a header template that uses OpenMP pragmas in torch's
    # OpenMP builds; without the flag the loops silently run on one thread.
    # -ffp-contract=off / --fmad=false: no silent a*b+c -> fma contraction (only math.h's explicit fmaf),
    # so the scalar CPU path, the AVX2 path and the GPU round the shared math identically.
    cxx = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-Wall", "-Wno-unused-function",
           f'-DMPKERN_TORCH_VERSION="{torch.__version__}"']
    if not with_cuda:
        _log(f"building CPU kernels only ({why_not})")
        return [CppExtension("mpkern._C", sources, include_dirs=include_dirs, extra_compile_args={"cxx": cxx},
                             extra_link_args=["-fopenmp"])]

    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        visible = torch.cuda.is_available() and torch.cuda.device_count() > 0
        if not visible:
            os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0"
            _log("no GPU visible: TORCH_CUDA_ARCH_LIST=8.0;9.0")
    archs = _with_ptx(os.environ.get("TORCH_CUDA_ARCH_LIST", ""))
    if archs:
        os.environ["TORCH_CUDA_ARCH_LIST"] = archs
    else:  # torch derives the list from the visible GPUs (and adds +PTX itself)
        archs = ";".join(f"{a}.{b}" for a, b in sorted({torch.cuda.get_device_capability(i)
                                                        for i in range(torch.cuda.device_count())})) + "+PTX"
    cuda_home = os.environ["CUDA_HOME"]
    # Headers the local toolkit lacks come from the pip CUDA packages' folder, searched *after* the
    # toolkit's own include (-isystem comes after every -I): that folder also holds the CUDA
    # runtime headers of the pip CUDA version (13.2 with torch 2.15), which nvcc refuses beside an
    # older nvcc ("CUDA compiler and CUDA toolkit headers are incompatible") if they come first.
    system_includes = []
    if not os.path.isfile(os.path.join(cuda_home, "include", "cusparse.h")):
        extra = _pip_cuda_include()
        if extra is not None:
            system_includes = ["-isystem", extra]
            _log(f"CUDA math headers the toolkit lacks from {extra} (after the toolkit's own)")
    sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu"))
                      + glob.glob(os.path.join("csrc", "cuda", "*.cpp")))
    defs = ["-DMPKERN_WITH_CUDA=1", f'-DMPKERN_CUDA_ARCHS="{archs}"']
    nvcc = ["-O3", "--fmad=false", "-lineinfo", "--expt-relaxed-constexpr"] + defs + system_includes
    if os.environ.get("MPKERN_PTXAS_VERBOSE") == "1":
        nvcc.append("-Xptxas=-v")
    _log(f"building CPU + CUDA kernels (archs {archs}, CUDA_HOME {cuda_home})")
    return [CUDAExtension("mpkern._C", sources, include_dirs=include_dirs,
                          extra_compile_args={"cxx": cxx + defs + system_includes, "nvcc": nvcc},
                          extra_link_args=["-fopenmp"])]


def main() -> None:
    # Decide (and set CUDA_HOME) before torch.utils.cpp_extension is imported: it reads
    # CUDA_HOME once, at import.
    with_cuda, why_not = _want_cuda()
    from torch.utils.cpp_extension import BuildExtension

    packages = find_packages(include=["mpkern", "mpkern.*"])
    setup(
        packages=packages + ["mpkern.triton_kernels"],
        package_dir={"mpkern.triton_kernels": "triton_kernels"},
        # the codec table: compiled into the extension and read by mpkern.codecs at import
        package_data={"mpkern": ["codecs.def"]},
        ext_modules=_extensions(with_cuda, why_not),
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    )


if __name__ == "__main__":
    main()
