"""``mpkern plan``: how much memory each mixed-precision recipe needs for a model of N parameters.

The lessons' memory exercise ("a 7B model in FP32 takes 28 GB for the weights alone") as a table:
per recipe, bytes per parameter of weights, grads, master weights and optimizer moments, the
total in GB (optionally sharded FSDP2-style over ``world_size`` ranks: every one of those tensors
is split evenly, so per-rank bytes are total / N -- the transient all-gathered layer params of
FSDP are not counted), and what is left of ``gpu_mem`` for activations.

The bytes per parameter are not typed in: :func:`mpkern.bytemodel.measure_recipes` builds every
recipe on a small model, takes one optimizer step and counts its real tensors. Every mpkern storage
mode also has a ``+ release`` row (``FusedAdamWMP(release_grads=True)``, ``opt.backward(loss)``):
its grads are stepped and freed bucket by bucket inside backward, so none persists (grads 0); the
bucket it holds meanwhile is a constant, not per parameter (``transient_grad_bytes``).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from . import bytemodel

GB = 1e9


def params_from_hf_config(path: str) -> int:
    """Parameter count of the ``transformers`` model a user trains from the ``config.json`` at
    ``path`` (a file or a directory holding one), built on the meta device (no weights, no
    download). Needs ``transformers``. Which model is built: see :func:`hf_config_count`."""
    return hf_config_count(path)[0]


def hf_config_count(path: str) -> tuple[int, str]:
    """``(parameter count, model class name)`` for the ``config.json`` at ``path``.

    The model counted is the one a user trains, head included: the class the config names in
    ``architectures`` (what ``save_pretrained`` of a trained model writes, e.g.
    ``LlamaForCausalLM``); without that, the causal-LM class of the config's model type
    (``AutoModelForCausalLM``); for a config that has none (e.g. an encoder-only or seq2seq
    type), the bare ``AutoModel``. Tied weights (``tie_word_embeddings``: the LM head shares the
    embedding matrix) count once -- ``Module.parameters()`` yields a shared ``Parameter`` once.
    """
    if not os.path.exists(path):
        raise ValueError(f"hf_config: {path!r} does not exist")
    try:
        from transformers import AutoConfig
    except ImportError as e:
        raise ValueError(f"hf_config needs the optional dependency transformers ({e}); "
                         "pip install transformers") from e
    cfg_path = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(path):
        with open(path) as f:
            json.load(f)  # a clear error for a file that is not JSON
        config = AutoConfig.from_pretrained(path)
    else:
        config = AutoConfig.from_pretrained(cfg_path)
    model = hf_meta_model(config)
    return sum(p.numel() for p in model.parameters()), type(model).__name__


def hf_meta_model(config: Any) -> Any:
    """The model a user trains from a ``transformers`` config (see :func:`hf_config_count`), built on
    the meta device: shapes and dtypes, no memory (``mpkern plan --memory-budget`` runs a step on it)."""
    import torch
    import transformers

    with torch.device("meta"):
        return _hf_model_builder(transformers, config)(config)


def _hf_model_builder(transformers: Any, config: Any) -> Any:
    """``config -> model`` for the model a user trains (see :func:`hf_config_count`)."""
    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls  # the constructor takes the config (and ties the head, like from_config)
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoModel, AutoModelForCausalLM

    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return AutoModelForCausalLM.from_config
    return AutoModel.from_config


def plan_table(params: float, *, world_size: int = 1, gpu_mem: float | None = None,
               measured: dict[str, dict[str, float]] | None = None) -> list[dict[str, Any]]:
    """One row per recipe: bytes/param by category, per-rank GB, and GB left for activations.

    Args:
        params: number of model parameters (e.g. ``7e9``).
        world_size: ranks the state is sharded over (FSDP2-style full sharding); 1 = unsharded.
        gpu_mem: memory per device in GB; when given, each row has ``left_GB`` (may be negative:
            does not fit) and ``fits``.
        measured: the output of :func:`mpkern.bytemodel.measure_recipes` (measured when None).

    A gradient-release row also has ``transient_grad_bytes``: the grads it holds only inside
    backward (``release_bucket_bytes``, plus the largest param's grad), in no per-param column.
    Release is single-process, so with ``world_size`` > 1 its rows are left out.
    """
    if not (isinstance(params, (int, float)) and math.isfinite(params) and params > 0):
        raise ValueError(f"params must be a positive number, got {params!r}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if gpu_mem is not None and not (math.isfinite(gpu_mem) and gpu_mem > 0):
        raise ValueError(f"gpu_mem must be a positive number of GB, got {gpu_mem!r}")
    measured = measured if measured is not None else bytemodel.measure_recipes()
    rows = []
    notes = bytemodel.recipes()
    for name, bpp in measured.items():
        transient = bytemodel.transient_grad_bytes(name)
        if transient is not None and world_size > 1:
            continue  # release_grads=True cannot run sharded
        row: dict[str, Any] = {"recipe": name, "note": notes.get(name, "")}
        row.update({f"{k}_B": v for k, v in bpp.items() if k != "total"})
        row["total_B"] = bpp["total"]
        if transient is not None:
            row["transient_grad_bytes"] = transient
        row["world_size"] = world_size
        row["per_rank_GB"] = bpp["total"] * params / world_size / GB
        row["weights_GB"] = bpp["weights"] * params / world_size / GB
        if gpu_mem is not None:
            row["left_GB"] = gpu_mem - row["per_rank_GB"]
            row["fits"] = row["left_GB"] > 0
        rows.append(row)
    return rows


def _fmt_gb(v: float) -> str:
    return f"{v:,.2f} GB" if abs(v) >= 1 else f"{v * 1e3:,.3g} MB"


def format_plan(rows: list[dict[str, Any]]) -> str:
    """The plan as a markdown table (and, when it has release rows, a line on their transient grads)."""
    has_left = bool(rows) and "left_GB" in rows[0]
    cols = ["recipe", "weights", "grads", "masters", "moments", "B/param", "per rank"]
    if has_left:
        cols.append("left for activations")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [r["recipe"]] + [f"{r[k]:g}" for k in ("weights_B", "grads_B", "masters_B", "moments_B", "total_B")]
        cells.append(_fmt_gb(r["per_rank_GB"]))
        if has_left:
            cells.append(_fmt_gb(r["left_GB"]) if r["fits"] else f"does not fit ({_fmt_gb(r['left_GB'])})")
        lines.append("| " + " | ".join(cells) + " |")
    transient = max((r["transient_grad_bytes"] for r in rows if "transient_grad_bytes" in r), default=None)
    if transient is not None:
        lines.append(f"\n`{bytemodel.RELEASE.strip()}`: FusedAdamWMP(release_grads=True) + opt.backward(loss) steps "
                     "and frees the grads bucket by bucket inside backward, so none persists (grads 0); meanwhile "
                     f"it holds up to {transient / 2**20:g} MiB (release_bucket_bytes) + the largest param's grad.")
    return "\n".join(lines)
