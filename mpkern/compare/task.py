"""The synthetic task (generated from the seed, no download) and the models trained on it."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .config import Config

Tensor = torch.Tensor



# ---- data ---------------------------------------------------------------------------------------
@dataclass
class Task:
    """Token ids and labels of the synthetic task (train in training order, held-out validation)."""

    x_train: Tensor
    y_train: Tensor
    x_val: Tensor
    y_val: Tensor
    vocab: int
    classes: int


def make_task(cfg: Config) -> Task:
    """Generate ``steps * batch_size`` training and ``val_size`` validation sequences from ``seed``.

    Vocabulary: ``[0, C)`` red class tokens, ``[C, 2C)`` blue class tokens, ``2C`` = "red?",
    ``2C + 1`` = "blue?", then ``noise_vocab`` noise tokens. Both splits come from one stream
    and are disjoint slices of it.
    """
    c, n_train, length = cfg.classes, cfg.steps * cfg.batch_size, cfg.seq_len
    n = n_train + cfg.val_size
    g = torch.Generator().manual_seed(cfg.seed)
    vocab = 2 * c + 2 + cfg.noise_vocab
    x = torch.randint(2 * c + 2, vocab, (n, length), generator=g)
    pos = torch.rand(n, length, generator=g).argsort(dim=1)[:, :3]
    red = torch.randint(0, c, (n,), generator=g)
    blue = torch.randint(0, c, (n,), generator=g)
    ask_blue = torch.randint(0, 2, (n,), generator=g)
    rows = torch.arange(n)
    x[rows, pos[:, 0]] = 2 * c + ask_blue
    x[rows, pos[:, 1]] = red
    x[rows, pos[:, 2]] = c + blue
    y = torch.where(ask_blue.bool(), blue, red)
    return Task(x[:n_train], y[:n_train], x[n_train:], y[n_train:], vocab, c)


# ---- model --------------------------------------------------------------------------------------
def _attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """``scaled_dot_product_attention``; for 16-bit CPU tensors through its math backend. PyTorch's CPU
    flash-attention kernel (SDPA's choice there) takes 10.2 ms for one bf16 forward + backward at this
    model's shape (batch 32, 4 heads, 16 tokens, head dim 32) on an AMX Xeon vs 0.9 ms in fp32 and
    1.4 ms through the math backend: with it every bf16 run spent 60 % of its step in attention. The
    math backend is the same attention (the product, softmax and product as separate ops), so all
    runs compare their recipes, not that kernel."""
    if q.device.type == "cpu" and q.dtype != torch.float32:
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v)
    return F.scaled_dot_product_attention(q, k, v)


class Block(nn.Module):
    """Pre-LN transformer block: self-attention (``scaled_dot_product_attention``) and a GELU MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = _attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Classifier(nn.Module):
    """Token + learned position embeddings, ``layers`` blocks, final LayerNorm, mean pool, head."""

    def __init__(self, vocab: int, seq_len: int, d_model: int, layers: int, heads: int, classes: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq_len, d_model) * 0.02)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, classes)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.tok(ids) + self.pos
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.ln(h).mean(dim=1))


class HFClassifier(nn.Module):
    """A ``transformers`` sequence classifier built from a local config (random init, no download).

    The config's vocabulary, positions and labels are set to the task's (``vocab_size`` = task
    vocabulary + 1 for a padding id that never occurs, ``num_labels`` = classes); ``forward``
    returns the logits. Needs ``transformers``.
    """

    def __init__(self, config_path: str, vocab: int, seq_len: int, classes: int) -> None:
        super().__init__()
        try:
            from transformers import AutoConfig, AutoModelForSequenceClassification
        except ImportError as e:
            raise ValueError(f"hf_model needs the optional dependency transformers ({e})") from e
        if not os.path.exists(config_path):
            raise ValueError(f"hf_model: {config_path!r} does not exist (a config.json or a folder holding one)")
        config = AutoConfig.from_pretrained(config_path)
        config.vocab_size = vocab + 1
        config.pad_token_id = vocab
        config.num_labels = classes
        for name in ("max_position_embeddings", "n_positions"):
            if getattr(config, name, None) is not None:
                setattr(config, name, max(getattr(config, name), seq_len))
        self.name = type(config).__name__
        self.model = AutoModelForSequenceClassification.from_config(config)

    def forward(self, ids: Tensor) -> Tensor:
        return self.model(input_ids=ids).logits
