"""Bytes per parameter, in one place: what each optimizer recipe *moves* per step and *keeps*.

Two kinds of numbers, used by ``mpkern bench``, ``mpkern plan`` and ``mpkern compare``:

* **Traffic** (the performance model of DESIGN.md): bytes read + written per parameter by one
  optimizer-side step of each recipe -- :data:`UNSCALE_TRAFFIC`, :data:`STEP_TRAFFIC`. The
  byte-model limit of a speed ratio is ``peer bytes / mpkern bytes`` (:func:`limit`): both sides
  are memory-bound, so no kernel can beat its peer by more than that.
* **Footprint**: bytes of the persistent training state per parameter (weights, grads, master
  weights, optimizer moments), never typed in: :func:`count_state` sums the real tensors of a
  model and its optimizer, and :func:`measure_recipes` builds each recipe on a small model, takes
  one step and counts -- so the numbers cannot drift from the code. Every mpkern storage mode has
  a second row with gradient release (``FusedAdamWMP(release_grads=True)``, ``opt.backward(loss)``),
  counted after that backward: its grads are freed bucket by bucket inside it, so none persists.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from .optim import storage as _storage
from .optim.release import DEFAULT_BUCKET_BYTES

Tensor = torch.Tensor

#: unscale + inf check + global-norm clip over bf16 grads, bytes per parameter.
#: mpkern: read-only stats pass (2) + one in-place scale pass (2 + 2).
#: PyTorch: ``_amp_foreach_non_finite_check_and_unscale_`` (r/w 4) + ``clip_grad_norm_`` (norm
#: read 2, clip r/w 4).
UNSCALE_TRAFFIC = {"mpkern": 6, "torch": 10}

#: one loss-scaled, clipped AdamW step, bytes per parameter.
#: mpkern (bf16 params): stats pre-pass 2 + fused step 28 (g 2, master 4+4, m 4+4, v 4+4, param 2).
#: amp_fp32: fp32 params/grads: unscale r/w 8, norm 4, clip r/w 8, fused AdamW 28.
#: bf16_masters: bf16 params + hand-kept fp32 masters: 52 as DESIGN.md counts it. Itemised pass by
#: pass (grad copy 6, unscale 8, norm 4, clip 8, AdamW 28, param copy 6) it is 60, so the limit
#: 52/30 printed beside the measured ratio is the conservative one.
STEP_TRAFFIC = {"mpkern": 30, "amp_fp32": 48, "bf16_masters": 52}


def limit(peer_bytes: float, our_bytes: float) -> float:
    """The byte-model limit of ``peer time / our time`` for two memory-bound implementations."""
    if our_bytes <= 0:
        raise ValueError(f"our_bytes must be positive, got {our_bytes}")
    return peer_bytes / our_bytes


# ---- footprint ----------------------------------------------------------------------------------
CATEGORIES = ("weights", "grads", "masters", "moments")
# the optimizer's storage descriptions say which state keys hold masters
_MASTER_KEYS = tuple(k.key for k in _storage.STORED_MASTERS)



@dataclass
class StateBytes:
    """Bytes of training state by category, and the parameter count they belong to."""

    params: int
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def per_param(self) -> dict[str, float]:
        """Bytes per parameter for each category and ``total``."""
        n = max(self.params, 1)
        out = {k: v / n for k, v in self.bytes.items()}
        out["total"] = self.total / n
        return out


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def count_state(params: Iterable[Tensor], optimizer: torch.optim.Optimizer | None = None, *,
                masters: Iterable[Tensor] = ()) -> StateBytes:
    """Count the bytes of the persistent training state, from the tensors themselves.

    Args:
        params: the model's parameters (the tensors the forward pass reads).
        optimizer: its optimizer; its per-param state tensors are classified by key:
            ``master_param``/``master_remainder`` -> masters, ``exp_avg``/``exp_avg_sq``/
            ``max_exp_avg_sq`` -> moments (0-dim tensors such as ``step`` are not counted).
        masters: hand-kept fp32 master params (a recipe that keeps them outside the optimizer);
            their ``.grad`` counts as grads, and ``optimizer`` state of them is counted too.

    Grads are ``p.main_grad`` and ``p.grad`` of every param (both, when both exist).
    Every storage is counted once (shared tensors are not double counted).
    """
    params = list(params)
    masters = list(masters)
    seen: set[int] = set()
    acc = StateBytes(params=sum(p.numel() for p in params))

    def add(cat: str, t: object) -> None:
        if not isinstance(t, Tensor) or t.dim() == 0:
            return
        key = t.untyped_storage().data_ptr() if t.numel() else id(t)
        if key in seen:
            return
        seen.add(key)
        acc.bytes[cat] += _nbytes(t)

    for p in params:
        add("weights", p)
        add("grads", getattr(p, "main_grad", None))
        add("grads", p.grad)
    for m in masters:
        add("masters", m)
        add("grads", m.grad)
    if optimizer is not None:
        moment_keys = _storage.moment_state_keys() + ("max_exp_avg_sq",)
        for st in optimizer.state.values():
            for k, v in st.items():
                if k in _MASTER_KEYS:
                    add("masters", v)
                elif k in moment_keys:
                    add("moments", v)
    return acc


# ---- the recipes, measured ----------------------------------------------------------------------
#: recipe name -> description; the order is the order of the tables.
RECIPES = {
    "fp32 AdamW": "fp32 params and grads, torch.optim.AdamW (fp32 moments)",
    "AMP (fp32 params + autocast)": "same persistent state as fp32; autocast's 16-bit copies are transient",
    "bf16 params + fp32 masters (by hand)": "bf16 params/grads, fp32 master params/grads, AdamW on the masters",
    "bf16 params, AdamW, no masters": "bf16 params/grads, torch.optim.AdamW keeps bf16 moments (the naive recipe)",
    "mpkern master_weights=True": "bf16 params/grads, FusedAdamWMP: fp32 master + fp32 moments in its state",
    "mpkern master_weights='remainder'": "bf16 params/grads, FusedAdamWMP: int16 remainder + fp32 moments",
    "mpkern bf16 moments": "bf16 params/grads, FusedAdamWMP: fp32 master, state_dtype=bfloat16",
    "mpkern remainder + bf16 moments": "bf16 params/grads, FusedAdamWMP: int16 remainder, bf16 moments",
    "mpkern 8-bit master + bf16 moments": "bf16 params/grads, FusedAdamWMP: int8 master correction (stochastic), "
                                          "bf16 moments (stochastic)",
    "mpkern remainder + 8-bit moments": "bf16 params/grads, FusedAdamWMP: int16 remainder (exact master), "
                                        "8-bit companded moments + a bf16 scale per 32",
    "mpkern 8-bit master + 8-bit moments": "bf16 params/grads, FusedAdamWMP: int8 master correction, 8-bit "
                                           "companded moments + a bf16 scale per 32 (stochastic)",
    "mpkern remainder + 4-bit m + 8-bit v moments": "bf16 params/grads, FusedAdamWMP: int16 remainder, 4-bit "
                                                    "exp_avg (two per byte) + 8-bit exp_avg_sq, bf16 scales per 32",
    "mpkern 8-bit master + 4-bit m + 8-bit v moments": "bf16 params/grads, FusedAdamWMP: int8 master correction, "
                                                       "4-bit exp_avg + 8-bit exp_avg_sq, bf16 scales per 32",
}


def _probe_model(dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return m.to(dtype)


#: an mpkern row's FusedAdamWMP arguments: (master_weights, state_dtype)
Mode = tuple[bool | str, torch.dtype | str]

#: the mpkern rows of :data:`RECIPES`: recipe name -> (master_weights, state_dtype)
_MPKERN_RECIPES: dict[str, Mode] = {
    "mpkern master_weights=True": (True, torch.float32),
    "mpkern master_weights='remainder'": ("remainder", torch.float32),
    "mpkern bf16 moments": (True, torch.bfloat16),
    "mpkern remainder + bf16 moments": ("remainder", torch.bfloat16),
    "mpkern 8-bit master + bf16 moments": ("8bit", torch.bfloat16),
    "mpkern remainder + 8-bit moments": ("remainder", "8bit"),
    "mpkern 8-bit master + 8-bit moments": ("8bit", "8bit"),
    "mpkern remainder + 4-bit m + 8-bit v moments": ("remainder", "4bit_m"),
    "mpkern 8-bit master + 4-bit m + 8-bit v moments": ("8bit", "4bit_m"),
}


def _extra_recipes() -> dict[str, Mode]:
    """One row per registered moment kind that no row of :data:`RECIPES` uses (fp32 masters)."""
    used = {_storage.moment_name(sd) for _mw, sd in _MPKERN_RECIPES.values()}
    return {f"mpkern {_storage.label(True, name)}": (True, name) for name in _storage.MOMENT_KINDS if name not in used}


@contextlib.contextmanager
def _backend_with_kernel(kind: _storage.MomentKind):
    """The probe step on the CPU: on the ``torch`` backend when the selected one has no kernel
    variant for ``kind`` (a kind that runs through its fp32 encode/decode only)."""
    from . import _backend

    if _backend.select("cpu") in kind.kernel_backends:
        yield
        return
    with _backend.use_backend("torch"):
        yield


def _mpkern_modes() -> dict[str, Mode]:
    """Every mpkern row (:data:`_MPKERN_RECIPES` and :func:`_extra_recipes`): name -> (master_weights, state_dtype)."""
    return {**_MPKERN_RECIPES, **_extra_recipes()}


#: the name of an mpkern row's gradient-release twin is the row's name + this
RELEASE = " + release"


def transient_grad_bytes(name: str) -> int | None:
    """Grad bytes recipe ``name`` holds only inside backward, not per parameter: for a release row
    the optimizer's default ``release_bucket_bytes`` (plus the largest param's grad, which a
    parameter count does not give); None for every other row (all its grads are alive at once and
    counted per parameter)."""
    return DEFAULT_BUCKET_BYTES if name.endswith(RELEASE) else None


def recipes() -> dict[str, str]:
    """:data:`RECIPES`, a row for every other registered moment kind, then the gradient-release
    twin (name + :data:`RELEASE`) of every mpkern row (name -> description)."""
    out = dict(RECIPES)
    for name, (mw, sd) in _extra_recipes().items():
        out[name] = (f"bf16 params/grads, FusedAdamWMP: {_storage.label(mw, sd)} "
                     f"({_storage.bytes_per_param(mw, sd):g} B/param of state)")
    for name in _mpkern_modes():
        out[name + RELEASE] = (f"the state of {name}, with release_grads=True: opt.backward(loss) steps bucket by "
                               "bucket inside backward and frees each grad, so no grad persists; transient: "
                               f"release_bucket_bytes ({DEFAULT_BUCKET_BYTES >> 20} MiB) + the largest param's grad")
    return out


def build_recipe(name: str, seed: int = 0) -> tuple[list[Tensor], torch.optim.Optimizer, list[Tensor]]:
    """Build recipe ``name`` (any name of :func:`recipes`) on a small model and take one optimizer step.

    Returns ``(params, optimizer, masters)`` as :func:`count_state` takes them; the state is
    fully materialised (grads present, optimizer state initialised). A release row (name +
    :data:`RELEASE`) builds its mode with ``release_grads=True`` and steps with
    ``opt.backward(loss)``: what remains of its grads afterwards is what persists (none).
    """
    from .optim import FusedAdamWMP

    modes = _mpkern_modes()
    release = name.endswith(RELEASE) and name[: -len(RELEASE)] in modes
    mode = name[: -len(RELEASE)] if release else name
    if mode not in RECIPES and mode not in modes:
        raise ValueError(f"recipe must be one of {list(recipes())}, got {name!r}")
    fp32 = name.startswith(("fp32", "AMP"))
    model = _probe_model(torch.float32 if fp32 else torch.bfloat16, seed)
    params: list[Tensor] = list(model.parameters())
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(seed + 1)).to(params[0].dtype)
    loss = model(x).float().square().mean()
    if not release:
        loss.backward()
    masters: list[Tensor] = []
    if fp32 or name.startswith("bf16 params, AdamW"):
        opt: torch.optim.Optimizer = torch.optim.AdamW(params, lr=1e-3)
    elif name.startswith("bf16 params + fp32 masters"):
        masters = [torch.nn.Parameter(p.detach().float()) for p in params]
        for m, p in zip(masters, params):
            assert p.grad is not None  # loss.backward() above
            m.grad = p.grad.float()
        opt = torch.optim.AdamW(masters, lr=1e-3)
    else:
        mw, sdt = modes[mode]
        opt = FusedAdamWMP(params, lr=1e-3, master_weights=mw, state_dtype=sdt, release_grads=release)
        with _backend_with_kernel(_storage.moment_kind(sdt)):
            if release:
                opt.backward(loss)  # the step runs inside backward, each grad freed after its bucket
            else:
                opt.step()
        return params, opt, masters
    opt.step()
    return params, opt, masters


def measure_recipes() -> dict[str, dict[str, float]]:
    """Bytes per parameter (weights, grads, masters, moments, total) of every recipe in :func:`recipes`,
    counted from the tensors of a small model after one step."""
    out = {}
    for name in recipes():
        params, opt, masters = build_recipe(name)
        out[name] = count_state(params, opt, masters=masters).per_param()
    return out
