"""The tested torch/Python range: pyproject.toml claims exactly mpkern.versions' ranges, and
``mpkern info`` warns when the torch in use lies outside them (torch's version monkeypatched)."""

from __future__ import annotations

import os
import re

import pytest
import torch

from mpkern import versions
from mpkern.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject() -> str:
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        return f.read()


def _upper_exclusive(pair: tuple[int, int]) -> str:
    return f"{pair[0]}.{pair[1] + 1}"


def test_pyproject_claims_the_tested_python():
    lo, hi = versions.TESTED_PYTHON
    m = re.search(r'^requires-python\s*=\s*"([^"]+)"', _pyproject(), re.M)
    assert m is not None
    assert m.group(1).replace(" ", "") == f">={lo[0]}.{lo[1]},<{_upper_exclusive(hi)}"


def test_pyproject_claims_the_tested_torch():
    """Both torch requirements (the build's and the install's) are the tested range, no wider."""
    lo, hi = versions.TESTED_TORCH
    specs = re.findall(r'"torch\s*([<>=!~][^"]*)"', _pyproject())  # a requirement, not "torchao"
    assert len(specs) == 2, specs  # [build-system] requires and [project] dependencies
    for spec in specs:
        assert spec.replace(" ", "") == f">={lo[0]}.{lo[1]},<{_upper_exclusive(hi)}"


def test_tested_range_is_the_one_ci_checks():
    """.ci/run installs the oldest and the newest torch of the range for its extra runs."""
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        ci = f.read()
    for lo_or_hi in versions.TESTED_TORCH:
        assert f'"torch=={lo_or_hi[0]}.{lo_or_hi[1]}.*"' in ci, lo_or_hi


def _info_lines(monkeypatch, capsys, version: str) -> list[str]:
    monkeypatch.setattr(torch, "__version__", version)
    assert main(["info"]) == 0
    return capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("version", ["2.10.1", "2.10.0+cu128", "2.16.0", "2.16.0.dev20261201+cu132", "3.0.0",
                                     "1.13.1", "nightly"])
def test_info_warns_outside_the_tested_torch(monkeypatch, capsys, version):
    lines = _info_lines(monkeypatch, capsys, version)
    warn = [ln for ln in lines if ln.startswith("warning")]
    assert len(warn) == 1, lines
    assert f"torch {version} is outside" in warn[0] and "torch 2.11-2.15" in warn[0]
    assert lines[0].startswith("mpkern ") and f"(torch {version}," in lines[0]


@pytest.mark.parametrize("version", ["2.11.0", "2.11.0+cu130", "2.12.1", "2.13.0+cpu", "2.14.1", "2.15.0",
                                     "2.15.9+cu132"])
def test_info_quiet_inside_the_tested_torch(monkeypatch, capsys, version):
    lines = _info_lines(monkeypatch, capsys, version)
    assert not [ln for ln in lines if "warning" in ln or "outside" in ln], lines
    assert f"(torch {version}," in lines[0]


def test_interpreter_loop_over_loaded_bounds():
    """A loop whose bounds are loaded scalars (every mpkern kernel has one) runs in the Triton
    interpreter -- on Triton 3.6 with NumPy >= 2.4 only with triton_kernels/_interp_compat.py's fix.
    Against a sum computed here in Python."""
    triton = pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("TRITON_INTERPRET is off (a GPU runs compiled kernels, not the interpreter)")
    import triton.language as tl

    from mpkern.triton_kernels import unscale  # noqa: F401 -- applies the fix where it is needed

    @triton.jit
    def _sum_range(bounds_ptr, x_ptr, out_ptr):
        lo = tl.load(bounds_ptr)
        hi = tl.load(bounds_ptr + 1)
        acc = tl.zeros([1], dtype=tl.float64)
        for i in range(lo, hi, 2):
            acc += tl.load(x_ptr + i + tl.arange(0, 1))
        tl.store(out_ptr + tl.arange(0, 1), acc)

    x = torch.arange(20, dtype=torch.float64) * 0.5
    out = torch.zeros(1, dtype=torch.float64)
    _sum_range[(1,)](torch.tensor([3, 14], dtype=torch.int64), x, out)
    assert out.item() == sum(0.5 * i for i in range(3, 14, 2))
