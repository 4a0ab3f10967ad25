"""``benchmarks/triton_aot.py`` -- Triton's cold start ahead of time -- in its smoke mode.

The script runs in a subprocess with TRITON_INTERPRET unset (conftest sets it on a machine without a GPU,
and kernels imported under it cannot be compiled) and a fresh Triton cache. Its smoke stage is
``scale_`` over the tensors of ``SMOKE_TENSORS``, compiled for sm_90. Checked against counts made here,
independently of the script and of Triton's binder: the launches ``scale_`` makes for the same tensors
(its kernel replaced by a recorder) and the distinct constexpr combinations among them -- one compile
each, since every pointer the launcher passes is 16-byte aligned and it passes no other integer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import triton_cuda_compiler_missing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "triton_aot.py")


def _smoke_tensors() -> list[tuple[str, int]]:
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        from triton_aot import SMOKE_TENSORS
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    return list(SMOKE_TENSORS)


class _Recorder:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **kwargs)`` is recorded, nothing runs."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def _launches_here(monkeypatch) -> list[tuple[tuple, dict]]:
    """The launches ``scale_`` makes for the smoke tensors, recorded in this process."""
    from mpkern.triton_kernels import unscale

    rec = _Recorder()
    monkeypatch.setattr(unscale, "_scale_kernel", rec)
    tensors = [torch.empty(n, dtype=getattr(torch, dt)) for dt, n in _smoke_tensors()]
    unscale.scale_(tensors, torch.tensor(0.5))
    return rec.calls


def test_smoke_counts_the_launchers_specialisations_and_times_them(tmp_path, monkeypatch):
    why = triton_cuda_compiler_missing()
    if why:
        pytest.skip(why)
    out = tmp_path / "aot.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # the script makes its own fresh one too
    res = subprocess.run([sys.executable, SCRIPT, "--smoke", "--json", str(out)], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300, check=False)
    assert out.exists(), f"exit {res.returncode}\n{res.stdout}\n{res.stderr[-3000:]}"
    report = json.loads(out.read_text())
    assert res.returncode == 0, res.stderr

    calls = _launches_here(monkeypatch)
    combos = {tuple(sorted((k, str(v)) for k, v in kw.items())) for _, kw in calls}
    assert len({kw["DT"] for _, kw in calls}) == 2  # the two dtypes of the smoke list: not a trivial count
    specs = report["specs"]
    assert len(specs) == len(combos)
    assert {s["kernel"] for s in specs} == {"_scale_kernel"} and {s["sm"] for s in specs} == {90}
    assert sum(len(s["needed_by"]) for s in specs) == len(calls)  # every launch the launcher made
    for s in specs:
        assert s["error"] is None, s["error"]
        assert s["seconds"]["wall"] > 0 and s["seconds"]["cpu"] > 0, s
    (stage,) = report["stages"]
    assert stage["stage"] == "smoke" and stage["specialisations"] == len(combos)
    assert stage["cold"]["cpu"] >= stage["compile"]["cpu"] > 0
    assert "_scale_kernel" in res.stdout and "cold" in res.stdout  # the printed table
