"""Format study for issue 22: 4-bit AdamW moments, several formulations, against fp32 AdamW.

Every formulation is a :class:`mpkern.optim.storage.MomentKind` defined and registered in this
script only (nothing is added to the package). It has no kernel variant: on the ``torch`` backend
the step decodes its moments to fp32, runs the reference AdamW step and encodes them back
(:meth:`FourBit.write_back`), with every code stochastically rounded from the element's one
32-bit random word of the step (``mpkern.reference_codecs.rand_word``; the field each moment reads and
its width are parameters of the kind, see ``--m-bits`` / ``--v-bits``).

A moment is stored as 4-bit indices into a 16-entry codebook of normalised values (two codes per
byte) plus bf16 scales (rounded up, so every normalised value is <= 1). Codebooks:

* ``sq``   signed c^2 companding (``sign(c) c^2 / 49``, c in -7..7): the 8-bit ``exp_avg`` law;
* ``q4``   unsigned c^4 companding (``c^4 / 15^4``, c in 0..15), a positive value at least code 1:
  the 8-bit ``exp_avg_sq`` law;
* ``de``   signed dynamic exponent (bitsandbytes' 4-bit dynamic map, Li et al.'s first-moment map);
* ``lin0`` unsigned linear without zero (``(i + 1) / 16``, Li et al.'s second-moment map);
* ``sq0``  unsigned c^2 companding (``c^2 / 15^2``, c in 0..15; a positive value at least code 1):
  ``sqrt(v)`` linear in the code, finer near the group max than ``q4``;
* ``lt``   unsigned, zero-free: ``lin0``'s 1/16 steps from 5/16 to 1 (12 codes) and a tail of
  halvings 5/32 ... 5/256 (4 codes): ``lin0`` near the max, 1.7 decades of range.

Normalisation: a bf16 scale per group of G consecutive elements of the buffer (``gG``), or rank-1
(``r1``: ``min(row max, column max)`` of a 2-D tensor, bf16 row and column maxima; other tensors fall
back to groups of 128, as in Li et al.). ``v8`` keeps ``exp_avg_sq`` in the shipped 8-bit codec
(``mpkern.reference_codecs.moment8_encode``) -- the fallback of the issue.

    python benchmarks/fourbit_study.py tests            # spike-then-decay, small-update, mixed-scale, bias
    python benchmarks/fourbit_study.py fidelity --steps 300 --finetune-steps 200
    python benchmarks/fourbit_study.py bias             # the random-field width needed (pinned values)
    python benchmarks/fourbit_study.py overshoot        # the update overshoot of a 4-bit v, by regime

Everything runs on the ``torch`` backend (MPKERN_BACKEND=torch is set here): the kernels agree bit
for bit with the reference for the shipped kinds, and these kinds have no kernel.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import sys
import time

os.environ["MPKERN_BACKEND"] = "torch"

import torch

from mpkern import FusedAdamWMP, reference_codecs
from mpkern.optim import storage

Tensor = torch.Tensor
B1, B2, EPS = 0.9, 0.999, 1e-8


# ---- codebooks ------------------------------------------------------------------------------------
def _bnb_dynamic_signed4() -> list[float]:
    """The signed 4-bit dynamic-exponent map (3 exponent levels 1e-2, 1e-1, 1; linear fractions
    between 0.1 and 1 at the midpoints of 1, 2, 4 cells; plus 0 and 1)."""
    out = [0.0, 1.0]
    for i in range(3):
        k = 2**i + 1
        bounds = [0.1 + 0.9 * j / (k - 1) for j in range(k)]
        means = [(a + b) / 2 for a, b in itertools.pairwise(bounds)]
        for mval in means:
            out += [10.0 ** (i - 2) * mval, -(10.0 ** (i - 2)) * mval]
    return sorted(out)


BOOKS = {
    "sq": sorted({math.copysign(c * c / 49.0, c) for c in range(-7, 8)}),  # 15 values (code 15 unused)
    "q4": [c**4 / 15.0**4 for c in range(16)],
    "de": _bnb_dynamic_signed4(),
    "lin0": [(i + 1) / 16.0 for i in range(16)],
    "sq0": [c * c / 225.0 for c in range(16)],  # unsigned c^2: sqrt(v) linear in the code
    # zero-free: linear steps of 1/16 from 5/16 to 1 (12 codes), then halvings down to 5/256 (4 codes)
    "lt": [5.0 / 16 * 2.0**-k for k in (4, 3, 2, 1)] + [(i + 5) / 16.0 for i in range(12)],
}
SIGNED = {"sq": True, "q4": False, "de": True, "lin0": False, "sq0": False, "lt": False}
#: a positive value never rounds to a zero code (q4: at least code 1; lin0 has no zero)
FLOOR = {"q4": True, "lin0": True, "sq0": True, "lt": True, "sq": False, "de": False}


def _book(name: str) -> Tensor:
    return torch.tensor(BOOKS[name], dtype=torch.float32)


def sr_index(x: Tensor, book: Tensor, r: Tensor | float, floor: bool) -> Tensor:
    """Index into sorted ``book`` of normalised ``x`` (|x| <= 1), rounded between the two neighbouring
    entries with P(up) = (x - lo) / (hi - lo) decided by ``r`` in (0, 1) (0.5: nearest, ties down).
    Below the smallest entry: the smallest; ``floor``: a positive x gets at least the smallest
    positive entry (no zero code for it)."""
    k = book.numel()
    hi = torch.searchsorted(book, x.contiguous(), right=False).clamp(1, k - 1)
    lo = hi - 1
    blo, bhi = book[lo], book[hi]
    p = (x - blo) / (bhi - blo)
    idx = torch.where(r < p, hi, lo) if isinstance(r, Tensor) else torch.where(p > r, hi, lo)
    idx = torch.where(x >= book[-1], torch.full_like(idx, k - 1), idx)
    idx = torch.where(x <= book[0], torch.zeros_like(idx), idx)
    if floor:
        pos = int(torch.searchsorted(book, torch.tensor(0.0), right=True))  # first entry > 0
        idx = torch.where((x > 0) & (idx < pos), torch.full_like(idx, pos), idx)
    return idx


def pack4(idx: Tensor) -> Tensor:
    """Two 4-bit codes per byte (element 2i in the low nibble), a short last byte padded with 0."""
    flat = idx.reshape(-1).to(torch.uint8)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    return flat[0::2] | (flat[1::2] << 4)


def unpack4(packed: Tensor, n: int) -> Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1)[:n].to(torch.int64)


def bf16_up(x: Tensor) -> Tensor:
    """fp32 ``x >= 0`` rounded up to bf16 (as the 8-bit moments' scales are)."""
    b = x.contiguous().view(torch.int32).to(torch.int64)
    b = torch.where((b & 0xFFFF) != 0, b + 0x10000, b) >> 16
    return b.to(torch.int16).view(torch.bfloat16)


def _grouped(x: Tensor, g: int) -> Tensor:
    x = x.reshape(-1)
    pad = (-x.numel()) % g
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.reshape(-1, g)


# ---- one moment's codec -------------------------------------------------------------------------
class Codec:
    """How one moment is stored: ``book`` (a codebook name, or "v8" for the shipped 8-bit v codec)
    and ``norm`` ("g32", "g128", ... or "r1")."""

    def __init__(self, book: str, norm: str) -> None:
        self.book, self.norm = book, norm
        self.group = 128 if norm == "r1" else int(norm[1:])

    def label(self) -> str:
        return "8-bit c^4 g32 (shipped)" if self.book == "v8" else f"{self.book}/{self.norm}"

    def rank1(self, shape: torch.Size) -> bool:
        return self.norm == "r1" and len(shape) == 2

    def nominal_bytes(self) -> float:
        if self.book == "v8":
            return 1.0 + 2.0 / 32
        if self.norm == "r1":
            return 0.5  # + (rows + cols) * 2 / numel
        return 0.5 + 2.0 / self.group

    def encode(self, x: Tensor, shape: torch.Size, r: Tensor | float) -> dict[str, Tensor]:
        """fp32 ``x`` (the param's shape, contiguous) -> this codec's tensors."""
        n = x.numel()
        if self.book == "v8":
            r16 = None if not isinstance(r, Tensor) else (r * 65536.0).floor().to(torch.int64)
            codes, scales = reference_codecs.moment8_encode(x.reshape(-1), "exp_avg_sq", r16)
            return {"codes": codes, "scale": scales}
        book = _book(self.book)
        ax = x.abs()
        if self.rank1(shape):
            a2 = ax.reshape(shape)
            row = bf16_up(a2.amax(dim=1))
            col = bf16_up(a2.amax(dim=0))
            s = torch.minimum(row.float()[:, None], col.float()[None, :]).reshape(-1)
            out = {"row": row, "col": col}
        else:
            sg = bf16_up(_grouped(ax, self.group).amax(dim=1))
            s = sg.float().repeat_interleave(self.group)[:n]
            out = {"scale": sg}
        y = torch.where(s > 0, x.reshape(-1) / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(s))
        y = y.clamp(-1.0, 1.0)
        rr = r.reshape(-1) if isinstance(r, Tensor) else r
        out["codes"] = pack4(sr_index(y, book, rr, FLOOR[self.book]))
        return out

    def decode(self, st: dict[str, Tensor], shape: torch.Size) -> Tensor:
        n = math.prod(shape)
        if self.book == "v8":
            return reference_codecs.moment8_decode(st["codes"], st["scale"]).reshape(shape)
        vals = _book(self.book)[unpack4(st["codes"], n)]
        if self.rank1(shape):
            s = torch.minimum(st["row"].float()[:, None], st["col"].float()[None, :]).reshape(-1)
        else:
            s = st["scale"].float().repeat_interleave(self.group)[:n]
        return (vals * s).reshape(shape)


# ---- the moment kind ----------------------------------------------------------------------------
SEED = 1234


class FourBit(storage.MomentKind):
    """A study moment kind: ``exp_avg`` by codec ``m``, ``exp_avg_sq`` by codec ``v``; stochastic
    rounding from fields (shift, width) of the element's random word."""

    amsgrad = False
    amsgrad_why = " (study kind)"

    def __init__(self, name: str, m: Codec, v: Codec, m_field=(10, 11), v_field=(21, 11)) -> None:
        self.name, self.m, self.v = name, m, v
        self.label = f"4-bit study {name}"
        self.m_field, self.v_field = m_field, v_field
        self.keys = (f"{name}:m:codes",)  # the first key says the kind is there; the rest are found by prefix
        self._streams: dict[int, int] = {}

    def _codec(self, key: str) -> Codec:
        return self.m if key == "exp_avg" else self.v

    def bytes_per_element(self) -> float:
        return self.m.nominal_bytes() + self.v.nominal_bytes()

    def _pack(self, key: str, d: dict[str, Tensor]) -> dict[str, Tensor]:
        tag = "m" if key == "exp_avg" else "v"
        return {f"{self.name}:{tag}:{k}": t for k, t in d.items()}

    def _unpack(self, st, key):
        pre = f"{self.name}:{'m' if key == 'exp_avg' else 'v'}:"
        return {k[len(pre):]: t for k, t in st.items() if isinstance(k, str) and k.startswith(pre)}

    def state_bytes(self, st) -> int:
        return sum(t.numel() * t.element_size() for k, t in st.items()
                   if isinstance(k, str) and k.startswith(self.name + ":") and not k.endswith(":shape"))

    def encode(self, p: Tensor, m: Tensor, v: Tensor, rm, rv) -> dict[str, Tensor]:
        shape = p.shape
        out = self._pack("exp_avg", self.m.encode(m.detach().float().contiguous(), shape, rm))
        out.update(self._pack("exp_avg_sq", self.v.encode(v.detach().float().contiguous(), shape, rv)))
        out[f"{self.name}:shape"] = torch.tensor(list(shape), dtype=torch.int64)  # metadata, not counted
        return out

    def create(self, p: Tensor) -> dict[str, Tensor]:
        z = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        return self.encode(p, z, z, 0.5, 0.5)

    def from_fp32(self, p, m, v):  # conversions: nearest code
        return self.encode(p, m.reshape(p.shape), v.reshape(p.shape), 0.5, 0.5)

    def to_fp32(self, st, key):
        shape = torch.Size(st[f"{self.name}:shape"].tolist())
        return self._codec(key).decode(self._unpack(st, key), shape)

    def kernel_tensors(self, st):
        return storage.KernelMoments(self.to_fp32(st, "exp_avg"), self.to_fp32(st, "exp_avg_sq"))

    def write_back(self, p, st, moments, found_inf) -> None:
        if float(found_inf.reshape(())) != 0:
            return
        step = int(st["step"])  # already incremented by the step
        stream = self._streams.setdefault(id(p), len(self._streams))
        elem = torch.arange(p.numel(), dtype=torch.int64)
        word = reference_codecs.rand_word(SEED, stream, elem, step)

        def field(sh_w):
            sh, w = sh_w
            return (((word >> sh) & ((1 << w) - 1)).to(torch.float64) + 0.5) / float(1 << w)  # cell centre

        new = self.encode(p, moments.exp_avg, moments.exp_avg_sq, field(self.m_field).float(),
                          field(self.v_field).float())
        st.update(new)


def make_kinds(m_bits: int = 11, v_bits: int = 11) -> dict[str, FourBit]:
    """The formulations of the study, by name."""
    mf, vf = (10, m_bits), (32 - v_bits, v_bits)
    specs = {
        "comp-g32": (Codec("sq", "g32"), Codec("q4", "g32")),
        "comp-g64": (Codec("sq", "g64"), Codec("q4", "g64")),
        "comp-g128": (Codec("sq", "g128"), Codec("q4", "g128")),
        "de-g32/comp-g32": (Codec("de", "g32"), Codec("q4", "g32")),
        "de-g128/lin0-r1": (Codec("de", "g128"), Codec("lin0", "r1")),  # Li et al.: B128/DE + Rank-1/Linear
        "de-g128/comp-r1": (Codec("de", "g128"), Codec("q4", "r1")),
        "comp-g32/lin0-g32": (Codec("sq", "g32"), Codec("lin0", "g32")),
        "comp-g32/sq0-g32": (Codec("sq", "g32"), Codec("sq0", "g32")),
        "sq-r1/sq0-r1": (Codec("sq", "r1"), Codec("sq0", "r1")),
        "de-g128/sq0-r1": (Codec("de", "g128"), Codec("sq0", "r1")),
        "sq-r1/q4-r1": (Codec("sq", "r1"), Codec("q4", "r1")),
        "comp-g32/lt-g32": (Codec("sq", "g32"), Codec("lt", "g32")),
        "comp-g32/lin0-r1": (Codec("sq", "g32"), Codec("lin0", "r1")),  # isolating m's map / v's normalisation
        "de-g128/lin0-g32": (Codec("de", "g128"), Codec("lin0", "g32")),
        "comp-g32/lt-r1": (Codec("sq", "g32"), Codec("lt", "r1")),
        "comp-g32/v8": (Codec("sq", "g32"), Codec("v8", "g32")),  # fallback: 4-bit m + shipped 8-bit v
    }
    out = {}
    for name, (m, v) in specs.items():
        out[name] = FourBit(name, m, v, mf, vf)
    return out


# ---- tests ----------------------------------------------------------------------------------------
def _kind_state_v(opt, p, kind) -> Tensor:
    if kind is None:
        return storage.moments_fp32(opt.state[p], "exp_avg_sq").double()
    return kind.to_fp32(opt.state[p], "exp_avg_sq").double()


def spike_test(state_dtype: str, kind, n_shape=(64, 64), steps=3000, every=100) -> dict:
    """One grad of 10, then N(0, 0.1^2) grads per element (a (64, 64) bf16 param, lr 0): the stored v
    against float64 AdamW's v along the way. Worst over checkpoints every 100 steps of |mean ratio - 1|
    and |median per-element ratio - 1| (the 8-bit test's statistics; pass: both < 10 % at every
    checkpoint). A 4-bit v of one element is one of two code values at any instant (neighbouring
    codes ~24 % apart near the group max), so the instantaneous per-element median can miss by
    half a gap even when every element is unbiased; ``avg_median`` is the median over elements of
    the ratio of their stored v averaged over the last 500 steps to float64's (unbiasedness per
    element) and ``pass_avg`` uses it in place of the instantaneous median."""
    p = torch.nn.Parameter(torch.zeros(n_shape, dtype=torch.bfloat16))
    opt = FusedAdamWMP([p], lr=0.0, weight_decay=0.0, master_weights=True, state_dtype=state_dtype, seed=2)
    gen = torch.Generator().manual_seed(0)
    v64 = torch.zeros(n_shape, dtype=torch.float64)
    worst_mean = worst_med = 0.0
    final = None
    acc = torch.zeros(n_shape, dtype=torch.float64)
    acc64 = torch.zeros(n_shape, dtype=torch.float64)
    for t in range(steps + 1):
        g = torch.full(n_shape, 10.0) if t == 0 else torch.randn(n_shape, generator=gen) * 0.1
        g16 = g.to(torch.bfloat16)
        v64 = B2 * v64 + (1 - B2) * g16.double() ** 2
        p.grad = g16
        opt.step()
        if t > steps - 500:
            acc += _kind_state_v(opt, p, kind)
            acc64 += v64
        if t % every == 0 or t == steps:
            got = _kind_state_v(opt, p, kind)
            rmean = float(got.mean() / v64.mean()) - 1
            rmed = float((got / v64).median()) - 1
            worst_mean, worst_med = max(worst_mean, abs(rmean)), max(worst_med, abs(rmed))
            final = (rmean, rmed)
    avg_med = float((acc / acc64).median()) - 1
    return {"worst_mean": worst_mean, "worst_median": worst_med, "final_mean": final[0], "final_median": final[1],
            "avg_median": avg_med, "pass": worst_mean < 0.10 and worst_med < 0.10,
            "pass_avg": worst_mean < 0.10 and abs(avg_med) < 0.10}


def _adamw64_const(w0, g, lr, steps):
    w, m, v = w0, 0.0, 0.0
    for t in range(1, steps + 1):
        m = B1 * m + (1 - B1) * g
        v = B2 * v + (1 - B2) * g * g
        w -= lr * (m / (1 - B1**t)) / (math.sqrt(v / (1 - B2**t)) + EPS)
    return w


def small_update_test(state_dtype: str, shape=(32, 64), steps=1000, lr=1e-5, gval=0.1, noisy=False) -> dict:
    """bf16 param at 1.0, lr 1e-5, 1000 steps, 8-bit master: mean movement vs float64 AdamW (pass:
    within 5 %). ``noisy``: grads 0.1 * (1 + N(0, 1)) per element instead of a constant 0.1 (the
    groups then hold different values, so the codes actually round); the reference is then float64
    AdamW on the same grads."""
    p = torch.nn.Parameter(torch.ones(shape, dtype=torch.bfloat16))
    opt = FusedAdamWMP([p], lr=lr, weight_decay=0.0, master_weights="8bit", state_dtype=state_dtype, seed=3)
    gen = torch.Generator().manual_seed(1)
    w64 = torch.ones(shape, dtype=torch.float64)
    m64 = torch.zeros(shape, dtype=torch.float64)
    v64 = torch.zeros(shape, dtype=torch.float64)
    for t in range(1, steps + 1):
        g = torch.full(shape, gval) if not noisy else gval * (1 + torch.randn(shape, generator=gen))
        g16 = g.to(torch.bfloat16)
        gd = g16.double()
        m64 = B1 * m64 + (1 - B1) * gd
        v64 = B2 * v64 + (1 - B2) * gd * gd
        w64 = w64 - lr * (m64 / (1 - B1**t)) / ((v64 / (1 - B2**t)).sqrt() + EPS)
        p.grad = g16
        opt.step()
    moved = 1.0 - float(opt.master_params()[0].double().mean())
    want = 1.0 - float(w64.mean())
    if not noisy:
        want = 1.0 - _adamw64_const(1.0, float(torch.tensor(gval).to(torch.bfloat16)), lr, steps)
    err = moved / want - 1
    return {"moved": moved, "want": want, "err": err, "pass": abs(err) <= 0.05}


def mixed_scale_test(state_dtype: str, kind, shape=(64, 64), steps=1000, decades=3.0) -> dict:
    """A harder diagnostic than the issue's two: every element its own grad scale, log-uniform over
    3 decades (so one group holds values 10^3 apart, 10^6 in v), grads = scale * (0.3 + N(0, 1)).
    lr 0. Reported: the Adam direction u = m_hat / (sqrt(v_hat) + eps) of the stored moments summed
    over the last 500 steps, against float64 AdamW's on the same grads: the median per-element ratio
    of the sums, the 10th-90th percentile band, the largest |u| seen (a v that decodes to ~0 under a
    nonzero m blows it up) and the mean stored-v ratio."""
    p = torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16))
    opt = FusedAdamWMP([p], lr=0.0, weight_decay=0.0, master_weights=True, state_dtype=state_dtype, seed=4)
    gen = torch.Generator().manual_seed(5)
    scale = 10.0 ** (-decades * torch.rand(shape, generator=gen, dtype=torch.float64))
    m64 = torch.zeros(shape, dtype=torch.float64)
    v64 = torch.zeros(shape, dtype=torch.float64)
    su = torch.zeros(shape, dtype=torch.float64)
    su64 = torch.zeros(shape, dtype=torch.float64)
    umax = 0.0
    for t in range(1, steps + 1):
        g = (scale * (0.3 + torch.randn(shape, generator=gen, dtype=torch.float64))).to(torch.bfloat16)
        gd = g.double()
        m64 = B1 * m64 + (1 - B1) * gd
        v64 = B2 * v64 + (1 - B2) * gd * gd
        p.grad = g
        opt.step()
        if t > steps - 500:
            st = opt.state[p]
            if kind is None:
                m, v = storage.moments_fp32(st, "exp_avg").double(), storage.moments_fp32(st, "exp_avg_sq").double()
            else:
                m, v = kind.to_fp32(st, "exp_avg").double(), kind.to_fp32(st, "exp_avg_sq").double()
            u = (m / (1 - B1**t)) / ((v / (1 - B2**t)).sqrt() + EPS)
            u64 = (m64 / (1 - B1**t)) / ((v64 / (1 - B2**t)).sqrt() + EPS)
            su += u
            su64 += u64
            umax = max(umax, float(u.abs().max()))
    ratio = su / su64
    q = torch.quantile(ratio.reshape(-1), torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64))
    return {"u_ratio_p10": float(q[0]), "u_ratio_median": float(q[1]), "u_ratio_p90": float(q[2]),
            "u_max": umax, "v_mean_ratio": float(v.mean() / v64.mean()),
            "pass": abs(float(q[1]) - 1) < 0.10 and umax < 10.0}


def bias_sim(book="q4", widths=(4, 6, 8, 11, 13, 15), n=2000, steps=6000, beta=B2) -> dict:
    """(See below; ``beta`` = 0.9 with a signed book: the first moment.)"""
    return _bias_sim(book, widths, n, steps if beta > 0.95 else 600, beta)


def _bias_sim(book, widths, n, steps, beta) -> dict:
    """How many random bits a 4-bit code's stochastic rounding needs. A v growing from 0 towards a
    constant target x0 (normalised; the group scale held at 1, as when another element holds the
    group max): v <- SR(beta v + (1 - beta) x0), ``n`` independent elements per x0, fresh uniform
    w-bit fields each step, decided at the cell centre as the kernels do. Exact SR keeps the mean
    of the stored v on the float64 recursion at every step; a w-bit field resolves P(up) only to
    2^-w, while the per-step move is (1 - beta) (x0 - v) / gap of a code gap: for beta2 = 0.999 a
    move of 1e-3 gap needs 2^-w well below 1e-3. Reported per w: the worst |mean stored / float64
    - 1| over x0 and over the checkpoints t = 500, 1000, 2000, 4000, 6000 (standard error of the
    mean ~0.3 %)."""
    bk = _book(book)
    gen = torch.Generator().manual_seed(9)
    xs = [0.07, 0.13, 0.3, 0.55, 0.8, 0.97]
    x0 = torch.tensor(xs, dtype=torch.float32).repeat_interleave(n)
    checks = (500, 1000, 2000, 4000, 6000) if beta > 0.95 else (5, 10, 20, 50, 100, 300, 600)
    out = {}
    for w in widths:
        v = torch.zeros_like(x0)
        v64 = 0.0 * x0.double()
        worst, at = 0.0, None
        for t in range(1, steps + 1):
            pre = beta * v + (1 - beta) * x0
            v64 = beta * v64 + (1 - beta) * x0.double()
            f = torch.randint(0, 1 << w, x0.shape, generator=gen).to(torch.float64)
            r = ((f + 0.5) / (1 << w)).float()
            v = bk[sr_index(pre, bk, r, FLOOR[book])]
            if t in checks:
                rel = v.double().reshape(len(xs), -1).mean(1) / v64.reshape(len(xs), -1).mean(1) - 1
                # only where float64's value is >= 2 codes' worth above a floored map's smallest code
                # (below it a zero-free map is biased up by construction, whatever the bits)
                rel = torch.where(v64.reshape(len(xs), -1).mean(1) >= 2 * float(bk[bk > 0][0]), rel, 0 * rel)
                i = int(rel.abs().argmax())
                if abs(float(rel[i])) > worst:
                    worst, at = abs(float(rel[i])), (t, xs[i], round(float(rel[i]), 4))
        out[w] = {"worst": worst, "at (t, x0, err)": at}
    return out


def overshoot_sim(book: str, regime: str, hyst: bool = False, alpha: float = 0.0, n: int = 4096,
                  seed: int = 0) -> float:
    """How much longer than float64 AdamW's the Adam step of a 4-bit v (``book``, a bf16 scale per
    32, groups of equal grad statistics) is -- the v alone. Each step ``v_new = beta2 v_stored +
    (1 - beta2) g^2`` (what the update divides by), then ``v_new`` rounded back stochastically
    (torch.rand bits, not the kernels' words). Returns the mean over elements and a window of steps
    of ``sqrt(v64 / v_den) - 1`` (+0.03: steps 3 % too long), where ``v_den`` is ``v_new`` with the
    stored part taken as ``v_stored (1 + 2 alpha gap_k / value_k)`` (a per-code correction of the
    decode for the update only, gap_k the mean distance to the neighbouring codes) and the EMA kept
    on the uncorrected v. ``hyst``: a group keeps its scale while its new max is in [scale / 2,
    scale] (no re-gridding of the codes when the max moves a little). Regimes: ``"warmup"``
    constant grads 1 from zero state, steps 900-1000 (the small-update test's case); ``"stationary"``
    N(0, 1) grads, steps 5000-8000; ``"mixed"`` the same with each element's grad variance
    log-uniform over one decade (groups hold different levels)."""
    gen = torch.Generator().manual_seed(seed)
    bk = _book(book)
    up = torch.cat([bk[1:] - bk[:-1], bk[-1:] - bk[-2:-1]])
    down = torch.cat([bk[:1], bk[1:] - bk[:-1]])
    corr = 1 + 2 * alpha * (0.5 * (up + down) / bk.clamp(min=1e-9))
    g32 = 32
    const = regime == "warmup"
    steps, window = (1000, 100) if const else (8000, 3000)
    var = 10 ** (-torch.rand(n, generator=gen)) if regime == "mixed" else torch.ones(n)
    idx = torch.zeros(n, dtype=torch.int64)
    scale = torch.zeros(n // g32)
    v64 = torch.zeros(n, dtype=torch.float64)
    acc = []
    for t in range(1, steps + 1):
        g = (torch.ones(n) if const else torch.randn(n, generator=gen)) * var.sqrt()
        vhat = bk[idx] * scale.repeat_interleave(g32)
        vnew = B2 * vhat + (1 - B2) * g * g
        vden = B2 * vhat * corr[idx] + (1 - B2) * g * g
        v64 = B2 * v64 + (1 - B2) * g.double() ** 2
        if t > steps - window:
            acc.append(float((v64 / vden.double()).sqrt().mean()))
        amax = vnew.reshape(-1, g32).amax(1)
        new = bf16_up(amax).float()
        scale = torch.where((amax <= scale) & (amax >= 0.5 * scale), scale, new) if hyst else new
        s = scale.repeat_interleave(g32)
        y = torch.where(s > 0, vnew / s.clamp(min=1e-30), torch.zeros_like(vnew)).clamp(max=1.0)
        idx = sr_index(y, bk, torch.rand(n, generator=gen), FLOOR[book])
    return sum(acc) / len(acc) - 1


def measured_bytes(kind: FourBit, shapes=((512, 128), (128,), (130, 128), (1000, 33))) -> float:
    """Bytes per element of both moments, from the real state tensors of params of ``shapes``."""
    tot = els = 0
    for s in shapes:
        p = torch.zeros(s, dtype=torch.bfloat16)
        st = kind.create(p)
        tot += kind.state_bytes(st)
        els += p.numel()
    return tot / els


# ---- driver --------------------------------------------------------------------------------------
def run_tests(kinds: dict[str, FourBit], which: list[str]) -> dict:
    res = {}
    for name in ["8bit"] + list(kinds):
        if name != "8bit" and name not in which:
            continue
        kind = kinds.get(name)
        t0 = time.perf_counter()
        r = {"bytes_nominal": kind.bytes_per_element() if kind else 2.125,
             "bytes_measured": measured_bytes(kind) if kind else 2.125}
        r["spike"] = spike_test(name, kind)
        r["small"] = small_update_test(name)
        r["small_noisy"] = small_update_test(name, noisy=True)
        r["mixed1"] = mixed_scale_test(name, kind, decades=1.0)
        r["mixed"] = mixed_scale_test(name, kind)
        r["seconds"] = time.perf_counter() - t0
        res[name] = r
        print(json.dumps({name: r}), flush=True)
    return res


def run_fidelity(kinds: dict[str, FourBit], which: list[str], steps: int, ft_steps: int, master: str,
                 phases=("pretrain", "finetune"), ref8: bool = False) -> dict:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import fidelity_compact as fc
    from mpkern import compare

    modes = {"fp32 AdamW": fc.MODES["fp32 AdamW"]}
    if ref8:
        modes["mpkern 8-bit master + 8-bit moments"] = fc.MODES["mpkern 8-bit master + 8-bit moments"]
    for name in which:
        modes[f"{master} master + {name}"] = (torch.bfloat16, dict(master_weights=master, state_dtype=name), None)
    fc.MODES.clear()
    fc.MODES.update(modes)
    cfg = compare.Config(steps=max(steps, ft_steps) + 400)
    task = compare.make_task(cfg)
    torch.manual_seed(cfg.seed)
    base = compare.Classifier(task.vocab, cfg.seq_len, cfg.d_model, cfg.layers, cfg.heads, task.classes)
    nparams = sum(p.numel() for p in base.parameters())
    print(f"# compare task, {nparams} params; pretrain lr 1e-4 {steps} steps, finetune lr 3e-5 {ft_steps} steps",
          flush=True)
    out = {}
    start = fc.train("fp32 AdamW", base, task, cfg, 1e-4, 400, 0)["model"] if "finetune" in phases else None
    for phase, (b, lr, n, offset) in {"pretrain": (base, 1e-4, steps, 0),
                                      "finetune": (start, 3e-5, ft_steps, 400)}.items():
        if phase not in phases:
            continue
        rows = {}
        for name in modes:
            r = fc.train(name, b, task, cfg, lr, n, offset)
            r.pop("model")
            rows[name] = r
            ref = rows["fp32 AdamW"]
            r["ratio"] = r["loss"] / ref["loss"]
            # the issue: final loss within 1 % of fp32 AdamW's (either side), the same val accuracy
            # (here: within half a percentage point of it)
            r["pass"] = abs(r["ratio"] - 1) <= 0.01 and abs(r["val_acc"] - ref["val_acc"]) <= 0.005
            print(json.dumps({phase: {name: r}}), flush=True)
        out[phase] = rows
    return out


def run_lrsweep(steps: int, ft_steps: int, phases) -> dict:
    """fp32 AdamW alone at lr x 1.00 / 1.03 / 1.10 on the fidelity task: how much of a formulation's
    lower loss an effective step-size overshoot of a few percent explains."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import fidelity_compact as fc
    from mpkern import compare

    cfg = compare.Config(steps=max(steps, ft_steps) + 400)
    task = compare.make_task(cfg)
    torch.manual_seed(cfg.seed)
    base = compare.Classifier(task.vocab, cfg.seq_len, cfg.d_model, cfg.layers, cfg.heads, task.classes)
    start = fc.train("fp32 AdamW", base, task, cfg, 1e-4, 400, 0)["model"] if "finetune" in phases else None
    out = {}
    for phase, (b, lr, n, offset) in {"pretrain": (base, 1e-4, steps, 0),
                                      "finetune": (start, 3e-5, ft_steps, 400)}.items():
        if phase not in phases:
            continue
        rows = {}
        for f in (1.0, 1.03, 1.1):
            r = fc.train("fp32 AdamW", b, task, cfg, lr * f, n, offset)
            r.pop("model")
            r["ratio"] = r["loss"] / rows[1.0]["loss"] if rows else 1.0
            rows[f] = r
            print(json.dumps({phase: {f"fp32 AdamW lr x {f}": r}}), flush=True)
        out[phase] = rows
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["tests", "fidelity", "bias", "bytes", "lrsweep", "overshoot"])
    ap.add_argument("--kinds", default="all", help="comma-separated formulation names (default: all)")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--finetune-steps", type=int, default=600)
    ap.add_argument("--master", default="8bit")
    ap.add_argument("--phase", default="pretrain,finetune", help="fidelity: pretrain, finetune or both")
    ap.add_argument("--ref8", action="store_true", help="fidelity: also the shipped 8-bit master + 8-bit moments")
    ap.add_argument("--m-bits", type=int, default=11, help="width of exp_avg's random field (from bit 10)")
    ap.add_argument("--v-bits", type=int, default=11, help="width of exp_avg_sq's random field (ending at bit 31)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kinds = make_kinds(args.m_bits, args.v_bits)
    which = list(kinds) if args.kinds == "all" else args.kinds.split(",")
    for k in kinds.values():
        storage.register_moment_kind(k)
    print(f"# fourbit_study {args.what} -- {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, m field {args.m_bits} bits, v field {args.v_bits} bits", flush=True)
    if args.what == "tests":
        res = run_tests(kinds, which)
    elif args.what == "fidelity":
        res = run_fidelity(kinds, which, args.steps, args.finetune_steps, args.master, args.phase.split(","),
                           args.ref8)
    elif args.what == "lrsweep":
        res = run_lrsweep(args.steps, args.finetune_steps, args.phase.split(","))
    elif args.what == "overshoot":
        res = {}
        for b, hyst, alpha in [(b, h, 0.0) for b in ("lin0", "lt", "sq0", "q4") for h in (False, True)] + \
                [(b, h, 0.4) for b in ("lin0", "lt") for h in (False, True)]:
            row = {r: overshoot_sim(b, r, hyst, alpha) for r in ("warmup", "stationary", "mixed")}
            res[f"{b} hyst={hyst} alpha={alpha}"] = row
            print(f"{b:5s} {'scale hysteresis' if hyst else 'scale every step'}, alpha {alpha}: "
                  + "  ".join(f"{r} {x * 100:+.2f} %" for r, x in row.items()), flush=True)
    elif args.what == "bias":
        res = {f"v {b} beta2": bias_sim(b) for b in ("q4", "sq0", "lin0")}
        res.update({f"m {b} beta1": bias_sim(b, beta=B1) for b in ("sq", "de")})
        print(json.dumps(res, indent=1))
    else:
        from mpkern import compare

        cfg = compare.Config()
        task = compare.make_task(compare.Config(steps=1))
        model = compare.Classifier(task.vocab, cfg.seq_len, cfg.d_model, cfg.layers, cfg.heads, task.classes)
        shapes = [p.shape for p in model.parameters()]
        res = {n: {"nominal": kinds[n].bytes_per_element(), "measured": measured_bytes(kinds[n]),
                   "compare model": measured_bytes(kinds[n], shapes)} for n in which}
        print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
