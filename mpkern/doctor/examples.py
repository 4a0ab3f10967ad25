"""Four small models that break in 16 bits the way real ones do -- the cases of docs/doctor.md,
runnable as ``mpkern doctor --model lse|cancel|tiny|gradscale``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .case import Case

Tensor = torch.Tensor

EXAMPLES = ("lse", "cancel", "tiny", "gradscale")


class NaiveLogSumExp(nn.Module):
    """``log(sum(exp(x)))`` written out: exp overflows fp16 (max 65504) as soon as some x > 11.09."""

    def forward(self, x: Tensor) -> Tensor:
        return x.exp().sum(-1, keepdim=True).log()


class CenteredByOffset(nn.Module):
    """Adds a large calibration offset and takes it away again: ``(x + 256) - 256`` -- exact in fp32,
    but bf16's spacing at 256 is 2, so every digit of an O(1) input cancels."""

    def forward(self, x: Tensor) -> Tensor:
        return (x + 256.0) - 256.0


class Scorer(nn.Module):
    """A projection and a scoring head (the shape of a logit head or a reward model)."""

    def __init__(self, d: int = 64, out: int = 8, mid: nn.Module | None = None) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.mid = mid if mid is not None else nn.GELU()
        self.head = nn.Linear(d if not isinstance(mid, NaiveLogSumExp) else 1, out)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.mid(self.proj(x)))


def example_case(kind: str, device: str = "cpu", seed: int = 0) -> Case:
    """The example model ``kind`` (one of :data:`EXAMPLES`) with its inputs, loss and loss scale."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    x = torch.randn(32, 64, generator=g)
    y = torch.randint(0, 8, (32,), generator=g)
    scale = None
    m: nn.Module
    if kind == "lse":
        scorer = m = Scorer(mid=NaiveLogSumExp())
        with torch.no_grad():
            scorer.proj.weight.mul_(12.0)  # pre-activations up to ~20: exp(20) = 4.9e8
        what = "a naive log-sum-exp after a wide projection"
    elif kind == "cancel":
        m = Scorer(mid=CenteredByOffset())
        what = "an offset added and taken away again ((x + 256) - 256)"
    elif kind == "tiny":
        badly_scaled = nn.Linear(64, 64, bias=False)
        m = nn.Sequential(nn.Linear(64, 64), badly_scaled, nn.ReLU(), nn.Linear(64, 8))
        with torch.no_grad():
            badly_scaled.weight.mul_(1e-5)  # a badly scaled layer: outputs ~1e-5, below fp16's smallest normal 6.1e-5
        what = "a badly scaled layer (weights ~1e-6) making activations ~1e-5"
    elif kind == "gradscale":
        m = Scorer()
        scale = 1.0  # fp16 gradients at loss scale 1 -- GradScaler switched off (enabled=False)
        what = "a model whose loss is averaged over many tokens, trained at loss scale 1"
    else:
        raise ValueError(f"unknown example {kind!r}: expected one of {EXAMPLES}")
    m.to(device)
    x, y = x.to(device), y.to(device)
    weight = 1e-4 if kind == "gradscale" else 1.0  # the loss of one token among 10^4
    return Case(kind, m, x, lambda out: F.cross_entropy(out.float(), y) * weight, what, loss_scale=scale)
