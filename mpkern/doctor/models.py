"""The models ``mpkern doctor`` diagnoses: the compare task's classifier and Hugging Face models
built from a config (random weights, no download), each with its inputs and loss."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Tensor = torch.Tensor

MODELS = ("compare", "gpt2", "bert", "lse", "cancel", "tiny", "gradscale")


@dataclass
class Case:
    """A model to diagnose, what to feed it and how its loss is computed."""

    name: str
    model: nn.Module
    inputs: Any
    loss_fn: Callable[[Any], Tensor]
    describe: str
    loss_scale: float | None = None  # the scale its gradients are judged at (None: GradScaler's first)


def compare_case(device: str = "cpu", seed: int = 0) -> Case:
    """The built-in ``mpkern compare`` classifier (default CPU size) on a batch of its task."""
    from ..compare.config import default_config
    from ..compare.task import Classifier, make_task

    cfg = default_config("cpu")
    cfg.steps, cfg.val_size, cfg.seed = 1, cfg.batch_size, seed
    task = make_task(cfg)
    torch.manual_seed(seed)
    model = Classifier(task.vocab, cfg.seq_len, cfg.d_model, cfg.layers, cfg.heads, task.classes).to(device)
    x, y = task.x_val.to(device), task.y_val.to(device)
    return Case("compare", model, x, lambda out: F.cross_entropy(out.float(), y),
                f"compare classifier: {cfg.layers} blocks, d_model {cfg.d_model}, batch {cfg.batch_size} x "
                f"{cfg.seq_len} tokens")


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
    """The :class:`Case` named ``kind`` (one of :data:`MODELS`)."""
    if kind == "compare":
        return compare_case(device, seed)
    if kind in ("gpt2", "bert"):
        return hf_case(kind, device, full=full, seed=seed)
    from .examples import example_case

    return example_case(kind, device, seed)


def run_recipe(name: str) -> tuple[torch.dtype, str] | None:
    """The dtype and :func:`~mpkern.diagnose` recipe of ``mpkern compare`` run ``name`` (None for fp32):
    ``bf16`` / ``fp16`` are autocast over fp32 params; every other run keeps 16-bit params."""
    if name == "fp32":
        return None
    dtype = torch.float16 if "fp16" in name else torch.bfloat16
    return dtype, ("autocast" if name in ("bf16", "fp16") else "params")


def diagnose_compare_runs(model: nn.Module, ids: Tensor, labels: Tensor, names: list[str]) -> list[dict[str, Any]]:
    """``mpkern compare --doctor``: the compare model (its initial weights) diagnosed in each 16-bit run's
    dtype and recipe on one batch of the task, with its cross-entropy loss. Returns one entry per run:
    ``{"run", "dtype", "recipe", "diagnosis" (to_dict), "text" (the table)}``."""
    from .run import diagnose

    out = []
    for name in names:
        rr = run_recipe(name)
        if rr is None:
            continue
        d = diagnose(model, ids, dtype=rr[0], recipe=rr[1], loss_fn=lambda o: F.cross_entropy(o.float(), labels))
        out.append({"run": name, "dtype": str(rr[0]).replace("torch.", ""), "recipe": rr[1],
                    "diagnosis": d.to_dict(), "text": str(d)})
    return out
