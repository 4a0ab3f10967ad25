"""The models ``mpkern doctor`` builds itself: Hugging Face models built from a config (random weights,
no download) and the examples of docs/doctor.md, each as a :class:`~mpkern.doctor.case.Case` with its
inputs and loss."""

from __future__ import annotations

from typing import Any

import torch

from .case import Case
from .examples import EXAMPLES, example_case

__all__ = ["MODELS", "Case", "build", "hf_case"]

MODELS = ("gpt2", "bert", *EXAMPLES)
"""The models :func:`build` knows: Hugging Face models from their configs and the examples of docs/doctor.md
(``mpkern doctor --model compare``, ``mpkern compare``'s classifier, is built by :mod:`mpkern.compare.diagnosis`)."""


def _no_dropout(config: Any) -> Any:
    for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout_prob", "attention_probs_dropout_prob",
              "summary_first_dropout", "classifier_dropout"):
        if hasattr(config, k):
            setattr(config, k, 0.0)
    return config


def hf_case(kind: str, device: str = "cpu", *, full: bool = False, seed: int = 0, batch: int | None = None,
            seq_len: int | None = None) -> Case:
    """A GPT-2 (LM head, its own loss on the inputs) or BERT (sequence classifier) built from a config.

    Default size: 2 layers, 128 wide, vocabulary 1024 -- seconds on a CPU. ``full=True``: the real
    GPT-2 small / BERT-base configuration (12 layers, 768 wide, their vocabularies). Dropout is 0 and
    attention is the eager implementation (its product and softmax are separate ops, measured one by one).
    """
    try:
        import transformers
    except ImportError as e:
        raise ValueError(f"the {kind} model needs the optional dependency transformers ({e})") from e
    torch.manual_seed(seed)
    cfg: Any
    model: Any
    if kind == "gpt2":
        cfg = transformers.GPT2Config() if full else transformers.GPT2Config(
            n_layer=2, n_embd=128, n_head=4, vocab_size=1024, n_positions=256, bos_token_id=0, eos_token_id=0)
        cfg.use_cache = False
        model = transformers.GPT2LMHeadModel(_no_dropout(cfg))
        b, t = batch or (2 if full else 4), seq_len or (128 if full else 64)
        ids = torch.randint(0, cfg.vocab_size, (b, t))
        inputs = {"input_ids": ids.to(device), "labels": ids.to(device)}
        what = f"GPT-2 {'small' if full else '(2 layers, 128 wide)'} from its config"
    elif kind == "bert":
        cfg = transformers.BertConfig() if full else transformers.BertConfig(
            num_hidden_layers=2, hidden_size=128, num_attention_heads=4, intermediate_size=512, vocab_size=1024)
        cfg.num_labels = 2
        model = transformers.BertForSequenceClassification(_no_dropout(cfg))
        b, t = batch or (2 if full else 4), seq_len or (128 if full else 64)
        ids = torch.randint(0, cfg.vocab_size, (b, t))
        inputs = {"input_ids": ids.to(device), "labels": torch.randint(0, 2, (b,)).to(device)}
        what = f"BERT {'base' if full else '(2 layers, 128 wide)'} sequence classifier from its config"
    else:
        raise ValueError(f"unknown model {kind!r}: expected one of {MODELS}")
    try:
        model.set_attn_implementation("eager")
    except (AttributeError, ValueError):
        # transformers < 4.50 reads it from the config (and has no public setter)
        model.config._attn_implementation = "eager"  # noqa: SLF001 -- as above
    model.to(device)
    return Case(kind, model, inputs, lambda out: out.loss, f"{what}, batch {b} x {t} tokens, random weights")


def build(kind: str, device: str = "cpu", *, full: bool = False, seed: int = 0) -> Case:
    """The :class:`Case` named ``kind`` (one of :data:`MODELS`); ValueError for another name."""
    if kind not in MODELS:
        raise ValueError(f"unknown model {kind!r}: expected one of {MODELS}")
    if kind in ("gpt2", "bert"):
        return hf_case(kind, device, full=full, seed=seed)
    return example_case(kind, device, seed)
