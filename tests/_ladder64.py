"""The compact moments' ladder codec (csrc/include/mpkern/math.h, "codec 2") written again in float64
for the tests, from its definition and independently of the kernels and of mpkern.reference_codecs:

* a ladder with ``b`` mantissa bits maps a magnitude code q to u(q) = 2^(q >> b) (1 + (q mod 2^b) / 2^b) - 1;
* a group's scale is the smallest power of two s = 2^e, e >= -126, with amax / s <= u(q_max) (0 for a
  group of zeros);
* an element is stored as +-u(q) s; the sign is the top bit of the code (exp_avg), none for exp_avg_sq.
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor
GROUP = 32
#: name: (mantissa bits, top magnitude code, bit of the sign or None)
LADDERS = {"m8": (4, 127, 7), "v8": (4, 255, None), "m4": (1, 7, 3)}


def u64(q: Tensor, mbits: int) -> Tensor:
    """u(q) in float64 for integer magnitude codes q."""
    q = q.to(torch.int64)
    return torch.pow(2.0, (q >> mbits).double()) * (1.0 + (q & ((1 << mbits) - 1)).double() / 2**mbits) - 1.0


def umax(ladder: str) -> float:
    mbits, qmax, _ = LADDERS[ladder]
    return float(u64(torch.tensor([qmax]), mbits))


def scale64(amax: Tensor, ladder: str) -> Tensor:
    """The groups' scales (float64) for their maxima ``amax`` (float64, finite)."""
    top = umax(ladder)
    out = []
    for a in amax.tolist():
        if a == 0:
            out.append(0.0)
            continue
        e = max(math.ceil(math.log2(a / top)), -126)
        while a / 2.0**e > top:  # log2 rounding
            e += 1
        while e > -126 and a / 2.0 ** (e - 1) <= top:
            e -= 1
        out.append(2.0**e)
    return torch.tensor(out, dtype=torch.float64)


def decode64(codes: Tensor, scales: Tensor, ladder: str, numel: int | None = None) -> Tensor:
    """float64 values of per-element codes (int8 / uint8 bytes, or for "m4" the packed nibbles of
    ``numel`` elements) with their per-group scales."""
    mbits, _, sign_at = LADDERS[ladder]
    b = codes.reshape(-1).cpu().view(torch.uint8).to(torch.int64)
    if ladder == "m4":
        b = torch.stack([b & 0xF, b >> 4], dim=1).reshape(-1)[:numel]
    mag = b if sign_at is None else b & ((1 << sign_at) - 1)
    s = scales.reshape(-1).cpu().double().repeat_interleave(GROUP)[:b.numel()]
    x = u64(mag, mbits) * s
    if sign_at is not None:
        x = torch.where(((b >> sign_at) & 1) == 1, -x, x)
    return x


def neighbours64(y: Tensor, mbits: int) -> tuple[Tensor, Tensor]:
    """The two ladder values (in scale units) around y >= 0: lo <= y < hi (hi = lo + the step)."""
    z = y + 1.0
    k = torch.floor(torch.log2(z))
    k = torch.where(torch.pow(2.0, k) > z, k - 1, k)
    k = torch.where(torch.pow(2.0, k + 1) <= z, k + 1, k)
    step = torch.pow(2.0, k - mbits)
    lo = torch.floor(z / step) * step - 1.0
    return lo, lo + step
