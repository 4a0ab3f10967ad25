"""Grads that are views at an element offset (DDP ``gradient_as_bucket_view``, flat grad buffers)
next to aligned params and state.

On every kernel path here (C++ CPU AVX-512 / AVX2 / scalar, Triton, CUDA when present) a step with
grads at offsets 1, 3, 5 and 8 elements into a buffer gives exactly the bits of the same step with
the same grad values in fresh (aligned) tensors, and the paths agree with each other bit for bit --
for fp32 / bf16 moments and the 8-bit and 4-bit compact moments, fp32 / bf16 / fp16 grads. (The CUDA
kernel loads such a grad through aligned 16-byte blocks and shifts instead of dropping the tensor to
its scalar path; this is what checks it on a GPU. The Triton plan keeps such a tensor's aligned
rows, only its grad loses the 16-byte hint: checked on its plan below.)
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from conftest import DEVICE, available_backends, call_adamw_op, kernel_path
from mpkern import _ops, reference

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
SIZES = (300, 1000, 4099)
OFFSETS = (1, 3, 5, 8)


def _paths():
    bs = [b for b in ("cpu", "cpu-scalar", "triton", "cuda") if b in available_backends()]
    if "cpu" in bs:
        bs.insert(bs.index("cpu") + 1, "cpu-avx2")
    return bs


def _state(mode, pdt, kind, gen):
    """params, grads (views at OFFSETS into one buffer per tensor), moments, masters, steps, scales."""
    st = {k: [] for k in ("p", "g", "m", "v", "w", "t", "sm", "sv")}
    for k, n in enumerate(SIZES):
        gdt = (F32, BF16, F16)[k % 3]
        p = torch.randn(n, generator=gen).to(pdt)
        off = OFFSETS[k % len(OFFSETS)] if k < len(SIZES) - 1 else OFFSETS[-2]
        buf = (torch.randn(n + 16, generator=gen) * 0.1).to(gdt).to(DEVICE)
        st["p"].append(p.to(DEVICE))
        st["g"].append(buf[off:off + n])
        groups = (n + 31) // 32
        if kind == "f32":
            st["m"].append((torch.randn(n, generator=gen) * 0.01).to(DEVICE))
            st["v"].append((torch.randn(n, generator=gen) * 0.01).pow(2).to(DEVICE))
        elif kind == "bf16":
            st["m"].append((torch.randn(n, generator=gen) * 0.01).to(BF16).to(DEVICE))
            st["v"].append((torch.randn(n, generator=gen) * 0.01).pow(2).to(BF16).to(DEVICE))
        else:
            if kind == "8bit":
                st["m"].append(torch.randint(-127, 128, (n,), generator=gen, dtype=torch.int8).to(DEVICE))
            else:  # 4bit_m: two codes per byte, an odd tail's high nibble 0
                cm = torch.randint(0, 256, ((n + 1) // 2,), generator=gen).to(torch.uint8)
                if n % 2:
                    cm[-1] &= 0xF
                st["m"].append(cm.to(DEVICE))
            st["v"].append(torch.randint(0, 256, (n,), generator=gen).to(torch.uint8).to(DEVICE))
            st["sm"].append((torch.rand(groups, generator=gen) * 1e-6).to(BF16).to(DEVICE))
            st["sv"].append((torch.rand(groups, generator=gen) * 1e-13 + 1e-20).to(BF16).to(DEVICE))
        if mode == reference.MASTER_F32:
            st["w"].append(st["p"][-1].float() + 1e-4)
        elif mode == reference.MASTER_8BIT:
            st["w"].append(torch.randint(-128, 128, (n,), generator=gen, dtype=torch.int8).to(DEVICE))
        st["t"].append(torch.full((), float(k + 2), device=DEVICE))
    return st


def _step(path, st, mode, sr):
    with kernel_path(path) as backend:
        scales = (st["sm"], st["sv"]) if st["sm"] else (None, None)
        call_adamw_op(partial(_ops.adamw_step_, backend), st["p"], st["g"], st["m"], st["v"], [],
                      st["w"], st["t"], torch.tensor(0.5, device=DEVICE), torch.tensor(0.0, device=DEVICE), None,
                      1e-3, 0.9, 0.999, 1e-8, 0.01, False, mode, sr, 99, list(range(5, 5 + len(SIZES))),
                      [0, 2**32 - 600, 17], *scales)
    return st


def _copy(st, aligned_grads=False):
    out = {k: [t.clone() for t in v] for k, v in st.items()}
    if not aligned_grads:  # the views themselves, at their offsets into their buffers
        out["g"] = list(st["g"])
    return out


def _bits(t):
    t = t.cpu()
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32) if t.element_size() == 4 else t


CASES = [(reference.MASTER_F32, BF16, "f32", False), (reference.MASTER_NONE, BF16, "bf16", True),
         (reference.MASTER_NONE, F32, "f32", False), (reference.MASTER_8BIT, BF16, "8bit", False),
         (reference.MASTER_8BIT, F16, "4bit_m", False), (reference.MASTER_NONE, BF16, "8bit", True)]


@pytest.mark.parametrize("mode,pdt,kind,sr", CASES, ids=lambda x: str(x).replace("torch.", ""))
def test_offset_grads_same_bits_as_aligned_on_every_path(mode, pdt, kind, sr):
    paths = _paths()
    if not paths:
        pytest.skip("no kernel path")
    st0 = _state(mode, pdt, kind, torch.Generator().manual_seed(mode * 10 + len(kind)))
    assert any(g.data_ptr() % 16 for g in st0["g"])  # the views are misaligned
    first = None
    for path in paths:
        views = _step(path, _copy(st0), mode, sr)
        fresh = _step(path, _copy(st0, aligned_grads=True), mode, sr)
        for key in ("p", "m", "v", "w", "sm", "sv"):
            for i, (a, b) in enumerate(zip(views[key], fresh[key])):
                assert torch.equal(_bits(a), _bits(b)), f"{path}: {key}[{i}] with the grad view differs"
        if first is None:
            first = (path, views)
            assert not torch.equal(_bits(views["p"][0]), _bits(st0["p"][0]))  # the step moved the params
            continue
        for key in ("p", "m", "v", "w", "sm", "sv"):
            for i, (a, b) in enumerate(zip(first[1][key], views[key])):
                assert torch.equal(_bits(a), _bits(b)), f"{path} vs {first[0]}: {key}[{i}] differs"


@pytest.mark.parametrize("sdt", [F32, torch.int8])
def test_triton_plan_keeps_the_aligned_rows_of_a_misaligned_grad(sdt):
    pytest.importorskip("triton")
    from mpkern.triton_kernels import adamw as tadamw

    n = 4096
    p = torch.zeros(n, dtype=BF16)
    g = torch.zeros(n + 8, dtype=BF16)[3:3 + n]  # 6 bytes past a 16-byte boundary
    m = torch.zeros(n, dtype=sdt)
    v = torch.zeros(n, dtype=F32 if sdt == F32 else torch.uint8)
    w = torch.zeros(n, dtype=F32)
    scales = (torch.zeros(n // 32, dtype=BF16), torch.zeros(n // 32, dtype=BF16)) if sdt == torch.int8 else (None, None)
    mode = tadamw.MOM8 if sdt == torch.int8 else 0  # the moment mode (mpkern/codecs.def) the op passes
    bufs = [tadamw._ParamBuffers(p, g, m, v, None, w, *scales)]
    _table, launches = tadamw._build_plan(bufs, (), (), mode, torch.device("cpu"))
    aligned = [(al, gal, rows) for *_k, al, gal, _first, rows in launches if al]
    assert aligned and all(not gal for _al, gal, _rows in aligned)  # the body stays aligned, its grad is not
    bufs = [tadamw._ParamBuffers(p, g.clone(), m, v, None, w, *scales)]
    _table, launches = tadamw._build_plan(bufs, (), (), mode, torch.device("cpu"))
    assert all(gal == al for *_k, al, gal, _first, _rows in launches)
