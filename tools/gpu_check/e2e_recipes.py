"""The end-to-end stages' problems: the models, the fixed batch and the recipes (issue 42, point 3).

Two stages, each a table of recipes trained on one ``transformers`` causal LM (random init, no
download):

* ``gpt2`` -- the lessons' mini challenge (FP32 vs mixed precision, tokens/s and peak memory, same
  hyper-parameters) on GPT-2 small (``GPT2Config()``: 12 layers, 768 wide, 50257 tokens), seq 1024;
* ``llama7b`` -- the seeds' 7B sentence ("a 7B-parameter model in FP32 alone takes 28 GB") on a
  Llama-7B-shaped model (4096 hidden, 32 layers, 11008 MLP, 32000 tokens, 32 heads), built straight
  on the device in its recipe's param dtype, activation checkpointing on, batch 1 x 2048.

``--size tiny`` is the same code on a 2-layer, 64-wide config at seq 32 (a CPU runs it in seconds).

Every recipe is one of ``mpkern compare``'s runs, built by :func:`mpkern.compare.recipes.build_recipe`
(model copy, optimizer, step function: clip 1.0 everywhere, the same lr and weight decay), so these
stages and ``mpkern compare`` cannot drift apart. The planned bytes of a recipe are ``mpkern plan``'s
(:func:`mpkern.plan.plan_table`): its persistent training state for the model's parameter count,
plus, for a gradient-release row, the grad bytes it holds only inside backward (its bucket, at most
all the grads).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mpkern import plan
from mpkern.compare.config import Config
from mpkern.compare.recipes import Recipe, build_recipe, param_dtype

Tensor = torch.Tensor

__all__ = ["STAGES", "SIZES", "LR", "Spec", "RECIPES", "AMP_RECIPE", "spec", "Shape", "shape", "CausalLMLogits",
           "build_base", "make_batch", "build", "enable_checkpointing", "param_count", "planned"]

STAGES = ("gpt2", "llama7b")
SIZES = ("tiny", "full")
#: the learning rate of every recipe (the same hyper-parameters for all, as the lessons ask)
LR = 3e-4


@dataclass(frozen=True)
class Spec:
    """One recipe of a stage: ``mpkern compare``'s run and optimizer state, and ``mpkern plan``'s row."""

    name: str
    run: str               # a run of mpkern.compare (PRECISIONS, or an mpkern run + "+release")
    optimizer_state: str   # FusedAdamWMP's MASTER:MOMENTS (compare's --optimizer-state)
    plan_row: str          # the recipe of mpkern.plan.plan_table with the same persistent state
    what: str


_AMP = "AMP (fp32 params + autocast)"
_RELEASE_8_4 = Spec("mpkern-8bit-4bitm-release", "mpkern-bf16+release", "8bit:4bit_m",
                    "mpkern 8-bit master + 4-bit m + 8-bit v moments + release",
                    "bf16 params, FusedAdamWMP 8-bit master + 4-bit m, release_grads=True: opt.backward(loss)")
_MP_FP32 = Spec("mpkern-fp32-master", "mpkern-bf16", "fp32:fp32", "mpkern master_weights=True",
                "bf16 params, FusedAdamWMP fp32 master + fp32 moments, clip fused into the step")

#: stage -> its recipes, in table order (the first is the stage's reference, "amp" the AMP one)
RECIPES: dict[str, tuple[Spec, ...]] = {
    "gpt2": (
        Spec("fp32", "fp32", "fp32:fp32", "fp32 AdamW", "fp32 params, torch AdamW(fused) + clip_grad_norm_"),
        Spec("amp-bf16", "bf16", "fp32:fp32", _AMP, "fp32 params, autocast bf16, torch AdamW(fused) + clip_grad_norm_"),
        Spec("fp16-scaler", "fp16", "fp32:fp32", _AMP,
             "fp32 params, autocast fp16 + GradScaler, unscale_ + clip_grad_norm_"),
        _MP_FP32,
        _RELEASE_8_4,
    ),
    "llama7b": (
        Spec("amp", "bf16", "fp32:fp32", _AMP, "fp32 params, autocast bf16, torch AdamW(fused) + clip_grad_norm_"),
        Spec("bf16-adamw", "bf16-naive", "fp32:fp32", "bf16 params, AdamW, no masters",
             "bf16 params, torch AdamW(fused) (bf16 moments, no master) + clip_grad_norm_"),
        _MP_FP32,
        Spec("mpkern-8bit-8bit", "mpkern-bf16", "8bit:8bit", "mpkern 8-bit master + 8-bit moments",
             "bf16 params, FusedAdamWMP 8-bit master + 8-bit moments, clip fused into the step"),
        _RELEASE_8_4,
    ),
}
#: the AMP recipe of each stage (the ratios' second reference)
AMP_RECIPE = {"gpt2": "amp-bf16", "llama7b": "amp"}


def spec(stage: str, name: str) -> Spec:
    """The recipe ``name`` of ``stage``; ValueError naming the known ones."""
    if stage not in RECIPES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    for s in RECIPES[stage]:
        if s.name == name:
            return s
    raise ValueError(f"recipe: {stage} has {[s.name for s in RECIPES[stage]]}, got {name!r}")


@dataclass(frozen=True)
class Shape:
    """A stage's model config, sequence length and whether it checkpoints activations, at one size
    (the default batch and steps are the driver's, :data:`tools.gpu_check.e2e.DEFAULTS`)."""

    config: Any            # a transformers GPT2Config / LlamaConfig
    seq: int
    checkpointing: bool
    what: str


def shape(stage: str, size: str) -> Shape:
    """The model of ``stage`` at ``size`` (``full``: the issue's; ``tiny``: 2 layers, 64 wide, seq 32)."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    if stage == "gpt2":
        return _gpt2_shape(size == "tiny")
    if stage == "llama7b":
        return _llama_shape(size == "tiny")
    raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")


def _gpt2_shape(tiny: bool) -> Shape:
    from transformers import GPT2Config

    seq = 32 if tiny else 1024
    dims: dict[str, Any] = {}
    if tiny:
        dims = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=512, bos_token_id=511, eos_token_id=511)
    # no dropout: every recipe sees the same function, so their losses after N steps compare
    cfg = GPT2Config(n_positions=seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **dims)
    what = f"GPT-2 {'tiny' if tiny else 'small'} ({cfg.n_layer} layers, {cfg.n_embd} wide, vocab {cfg.vocab_size})"
    return Shape(cfg, seq, False, what)


def _llama_shape(tiny: bool) -> Shape:
    from transformers import LlamaConfig

    seq = 32 if tiny else 2048
    dims: dict[str, Any] = dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=11008, vocab_size=32000,
                                num_attention_heads=32)
    if tiny:
        dims = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=176, vocab_size=512, num_attention_heads=4)
    cfg = LlamaConfig(max_position_embeddings=seq, use_cache=False, **dims)
    what = (f"Llama-7B-shaped{' (tiny)' if tiny else ''} ({cfg.num_hidden_layers} layers, {cfg.hidden_size} wide, "
            f"MLP {cfg.intermediate_size}, vocab {cfg.vocab_size}), activation checkpointing")
    return Shape(cfg, seq, True, what)


class CausalLMLogits(nn.Module):
    """A ``transformers`` causal LM as ``mpkern compare``'s step wants it: ids -> logits ``(B*T, V)``
    (the step takes ``cross_entropy(logits.float(), y)`` with ``y`` the next tokens, flattened)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: Tensor) -> Tensor:
        return self.lm(input_ids=ids, use_cache=False).logits.flatten(0, 1)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def build_base(stage: str, sh: Shape, dtype: torch.dtype, device: torch.device, seed: int = 0) -> CausalLMLogits:
    """The stage's model, random init (seed ``seed``) made directly on ``device`` in ``dtype`` (no CPU
    copy of a 7B model), in training mode, activation checkpointing on where the stage asks."""
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    cls = GPT2LMHeadModel if stage == "gpt2" else LlamaForCausalLM
    torch.manual_seed(seed)
    with torch.device(device), _default_dtype(dtype):
        lm: nn.Module = cls(sh.config)
    lm = lm.to(dtype)  # a no-op unless the library kept some parameter in another dtype
    lm.train()
    return CausalLMLogits(lm)


def make_batch(sh: Shape, batch: int, device: torch.device, seed: int = 1234) -> tuple[Tensor, Tensor]:
    """The fixed batch: ``batch`` random token streams of ``seq + 1`` tokens -> ids ``(batch, seq)``
    and their next tokens flattened ``(batch * seq,)`` (made on the CPU from ``seed``, then moved)."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, sh.config.vocab_size, (batch, sh.seq + 1), generator=g)
    return s[:, :-1].contiguous().to(device), s[:, 1:].reshape(-1).to(device)


def _config(s: Spec, linear: str) -> Config:
    return Config(lr=LR, weight_decay=0.01, max_grad_norm=1.0, optimizer_state=s.optimizer_state, linear=linear,
                  hf_model="transformers")


def build(stage: str, name: str, sh: Shape, device: torch.device, linear: str = "torch") -> Recipe:
    """Recipe ``name`` of ``stage`` on ``device``: the base model made in the recipe's param dtype,
    then ``build_recipe``'s copy, optimizer and step (the base freed before this returns).

    ``linear``: ``torch`` keeps the model's own layers (ATen GEMMs: no route timing or Triton
    compile inside the timed stage); ``mpkern`` / ``auto`` as ``mpkern compare --linear``."""
    s = spec(stage, name)
    base = build_base(stage, sh, param_dtype(s.run), device)
    r = build_recipe(s.run, _config(s, linear), base, device)
    del base
    if sh.checkpointing:
        enable_checkpointing(r.model.get_submodule("lm"))
    r.model.train()
    return r


def enable_checkpointing(lm: nn.Module) -> None:
    """Activation checkpointing on a ``transformers`` model, non-reentrant (gradient release's two
    passes run backward twice over the retained graph): ``activation_checkpointing_enable`` where the
    library has it (transformers >= 5.x), else ``gradient_checkpointing_enable``."""
    kw = {"use_reentrant": False}
    enable = getattr(lm, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kw)
    else:
        getattr(lm, "gradient_checkpointing_enable")(gradient_checkpointing_kwargs=kw)  # noqa: B009 -- not on nn.Module


def param_count(stage: str, sh: Shape) -> int:
    """Parameters of the stage's model (tied weights once), counted on the meta device."""
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    cls = GPT2LMHeadModel if stage == "gpt2" else LlamaForCausalLM
    with torch.device("meta"):
        return sum(p.numel() for p in cls(sh.config).parameters())


def planned(stage: str, name: str, sh: Shape, cap_bytes: int | None) -> dict[str, Any]:
    """``mpkern plan``'s prediction for recipe ``name`` on the stage's model and a card of ``cap_bytes``:
    ``planned_bytes`` = persistent state (B/param x params, what ``mpkern plan --gpu-mem`` prints per
    rank) + a release row's transient grad bytes; activations and temporaries are not in it."""
    s = spec(stage, name)
    n = param_count(stage, sh)
    rows = {r["recipe"]: r for r in plan.plan_table(n, gpu_mem=cap_bytes / plan.GB if cap_bytes else None)}
    if s.plan_row not in rows:
        raise ValueError(f"mpkern plan has no row {s.plan_row!r} (rows: {list(rows)})")
    row = rows[s.plan_row]
    state = row["total_B"] * n
    # the release bucket holds at most every grad (bf16, 2 B/param): the bound matters on small models only
    transient = min(row.get("transient_grad_bytes") or 0, 2 * n)
    return {"plan_row": s.plan_row, "params": n, "planned_B_per_param": row["total_B"],
            "planned_state_bytes": int(state), "planned_transient_bytes": int(transient),
            "planned_bytes": int(state + transient), "plan_fits": row.get("fits")}
