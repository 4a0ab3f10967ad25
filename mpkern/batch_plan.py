"""The largest batch a memory budget holds, per recipe: sizes, a measured step, the estimate.

The lessons' exercise ("your FP32 run uses ~14 GB for batch size 16: estimate a reasonable batch
size with mixed precision, and a safety margin") from measurements instead of a rule of thumb:

* the persistent state of each recipe (weights, grads, masters, moments) in bytes per parameter,
  counted from real tensors (:func:`mpkern.plan.plan_table`);
* the activation bytes per sample, from a *measured* forward + backward of the model at two batch
  sizes (:func:`measure_step`): every tensor the step creates is counted from creation to free
  (:class:`mpkern.compare.memory.LiveBytes`), on the meta device where the model builds there
  (nothing allocated, any size) -- the peak grows with the batch by ``per_sample`` bytes;
* ``max batch = (budget * (1 - margin) - state - fixed) / per_sample``, the margin (default 10 %)
  left for what a step does not show: allocator fragmentation and caching, library workspaces,
  the optimizer step's temporaries.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, TypedDict

import torch

from .measure import fmt_size

#: the share of the budget left unused by the estimate (fragmentation, workspaces, optimizer temporaries)
SAFETY_MARGIN = 0.10


class StepBytes(TypedDict):
    """What :func:`measure_step` measured: the two ``batches``, their ``peaks`` (bytes), and the line
    through them -- ``per_sample`` bytes per sample and the batch-independent ``fixed`` bytes."""

    batches: list[int]
    peaks: list[int]
    per_sample: float
    fixed: float


class Compute(TypedDict, total=False):
    """:func:`measure_step`'s ``dtype`` / ``autocast`` arguments of one compute kind (:data:`COMPUTE`)."""

    dtype: torch.dtype
    autocast: torch.dtype


def measure_step(make_model: Callable[[], torch.nn.Module], make_batch: Callable[[int], tuple[Any, ...]],
                 loss_fn: Callable[..., torch.Tensor], *, dtype: torch.dtype = torch.float32,
                 autocast: torch.dtype | None = None, batches: tuple[int, int] = (32, 64),
                 device: str = "meta") -> StepBytes:
    """Peak bytes of the tensors one forward + backward creates, at two batch sizes; the per-sample
    slope and the batch-independent rest (grads, the step's fixed temporaries).

    ``make_model()`` builds the model (called under ``torch.device(device)``; cast to ``dtype``);
    ``make_batch(b)`` the inputs of a batch of ``b``; ``loss_fn(model, *inputs)`` the loss.
    ``autocast``: run the forward under ``torch.autocast("cpu", dtype=autocast)`` (fp32 params).
    """
    from .compare.memory import live_peak

    with torch.device(device):
        model = make_model().to(dtype)
    peaks = []
    for b in batches:
        inputs = make_batch(b)

        def step(inputs: Any = inputs) -> None:  # bound: right even if live_peak ever kept the closure
            ctx = torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
            with ctx:
                loss = loss_fn(model, *inputs)
            loss.backward()

        _, peak = live_peak(step)
        for p in model.parameters():
            p.grad = None
        peaks.append(peak)
    (b1, b2), (p1, p2) = batches, peaks
    per_sample = max(0.0, (p2 - p1) / (b2 - b1))
    return {"batches": list(batches), "peaks": peaks, "per_sample": per_sample, "fixed": p1 - per_sample * b1}


def estimate_batch(budget: int, state_bytes: float, step: StepBytes, *,
                   margin: float = SAFETY_MARGIN) -> dict[str, Any]:
    """The largest batch whose predicted peak -- ``state_bytes`` (persistent state without grads) +
    ``step["fixed"]`` + ``batch * step["per_sample"]`` -- stays within ``budget * (1 - margin)``."""
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin!r}")
    usable = budget * (1 - margin)
    room = usable - state_bytes - step["fixed"]
    per_sample = step["per_sample"]
    batch = max(0, int(room // per_sample)) if per_sample > 0 else (0 if room < 0 else None)
    predicted = None if batch is None else state_bytes + step["fixed"] + batch * per_sample
    return {"max_batch_size": batch, "budget_bytes": budget, "margin": margin, "usable_bytes": usable,
            "state_bytes": state_bytes, "fixed_bytes": step["fixed"], "per_sample_bytes": step["per_sample"],
            "predicted_peak_bytes": predicted}


# ---- the models a step is measured on -----------------------------------------------------------
def _compare_model(seq_len: int) -> tuple[Callable[[], torch.nn.Module], Callable[[int], tuple[Any, ...]],
                                           Callable[..., torch.Tensor], str]:
    """``mpkern compare``'s default CPU model (measured on CPU: it is small, and autocast runs there)."""
    import torch.nn.functional as F

    from .compare.config import Config
    from .compare.task import Classifier

    c = Config()
    vocab = 2 * c.classes + 2 + c.noise_vocab

    def make_model() -> torch.nn.Module:
        torch.manual_seed(0)
        return Classifier(vocab, seq_len, c.d_model, c.layers, c.heads, c.classes)

    def make_batch(b: int) -> tuple[Any, ...]:
        g = torch.Generator().manual_seed(b)
        return torch.randint(0, vocab, (b, seq_len), generator=g), torch.randint(0, c.classes, (b,), generator=g)

    def loss_fn(model: torch.nn.Module, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(ids).float(), y)

    return make_model, make_batch, loss_fn, (f"mpkern compare's model (d_model {c.d_model}, {c.layers} layers), "
                                              f"seq {seq_len}, measured on CPU")


def _hf_model(path: str, seq_len: int) -> tuple[Callable[[], torch.nn.Module], Callable[[int], tuple[Any, ...]],
                                                Callable[..., torch.Tensor], str]:
    """The ``transformers`` model of a config (:func:`mpkern.plan.hf_meta_model`), measured on the meta device."""
    from transformers import AutoConfig

    from .plan import hf_meta_model

    config = AutoConfig.from_pretrained(path)
    vocab = getattr(config, "vocab_size", 1000) or 1000

    def make_model() -> torch.nn.Module:
        return hf_meta_model(config)

    def make_batch(b: int) -> tuple[Any, ...]:
        return (torch.zeros(b, seq_len, dtype=torch.long, device="meta") % vocab,)

    def loss_fn(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=ids)
        logits = out.logits if hasattr(out, "logits") else out[0]
        return logits.float().square().mean()  # any scalar of the logits: backward runs through the whole model

    return make_model, make_batch, loss_fn, f"{type(config).__name__} from {path}, seq {seq_len}, meta device"


#: how each plan row computes: fp32 params, fp32 params under bf16 autocast, 16-bit params
COMPUTE: dict[str, Compute] = {"fp32": Compute(dtype=torch.float32),
                               "autocast": Compute(dtype=torch.float32, autocast=torch.bfloat16),
                               "bf16": Compute(dtype=torch.bfloat16)}


def row_compute(row: dict[str, Any]) -> str:
    """The compute kind of a :func:`mpkern.plan.plan_table` row, from its measured weight bytes."""
    if row["weights_B"] < 4:
        return "bf16"
    return "autocast" if "autocast" in row.get("note", "") else "fp32"


def plan_batches(budget: int, *, hf_config: str | None = None, seq_len: int | None = None,
                 margin: float = SAFETY_MARGIN, rows: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The largest batch per recipe of :func:`mpkern.plan.plan_table` within ``budget`` bytes.

    The step is measured on ``mpkern compare``'s model (``seq_len`` default 16) or on the model of
    ``hf_config`` (default 512 tokens, meta device -- there autocast does not apply, so the autocast
    row uses the fp32 measurement, an upper bound). ``rows``: plan_table rows (measured when None).
    """
    from .plan import plan_table

    if hf_config is not None:
        seq_len = seq_len or 512
        make_model, make_batch, loss_fn, what = _hf_model(hf_config, seq_len)
        device = "meta"
    else:
        seq_len = seq_len or 16
        make_model, make_batch, loss_fn, what = _compare_model(seq_len)
        device = "cpu"
    with torch.device("meta"):
        params = sum(p.numel() for p in make_model().parameters())
    rows = rows if rows is not None else plan_table(params)
    steps: dict[str, StepBytes] = {}
    out_rows = []
    for row in rows:
        kind = row_compute(row)
        if kind not in steps:
            kw = COMPUTE[kind].copy()
            if device == "meta":
                kw.pop("autocast", None)
            steps[kind] = measure_step(make_model, make_batch, loss_fn, device=device, **kw)
        state = (row["total_B"] - row["grads_B"]) * params
        out_rows.append({"recipe": row["recipe"], "compute": kind, "state_B_per_param": row["total_B"],
                         **estimate_batch(budget, state, steps[kind], margin=margin)})
    return {"model": what, "params": params, "seq_len": seq_len, "budget_bytes": budget, "margin": margin,
            "steps": steps, "rows": out_rows}


def format_batches(plan: dict[str, Any]) -> str:
    """The estimate as a markdown table, with what it rests on."""
    lines = [f"Largest batch within {fmt_size(plan['budget_bytes'])} per recipe: {plan['model']}, "
             f"{plan['params']:,} params; safety margin {100 * plan['margin']:.0f} % of the budget "
             f"(usable {fmt_size(plan['budget_bytes'] * (1 - plan['margin']))}).",
             "Activations per sample measured from one forward + backward at batch 32 and 64 "
             "(every tensor the step creates, creation to free): "
             + ", ".join(f"{k} {fmt_size(s['per_sample'])}/sample + {fmt_size(s['fixed'])} fixed"
                         for k, s in plan["steps"].items()) + ".", "",
             "| recipe | compute | state B/param | state | per sample | largest batch | predicted peak |",
             "|---|---|---|---|---|---|---|"]
    ref = next((r["max_batch_size"] for r in plan["rows"] if r["compute"] == "fp32"), None)
    for r in plan["rows"]:
        b = r["max_batch_size"]
        rel = f" ({b / ref:.2f}x fp32)" if ref and b is not None and r["compute"] != "fp32" else ""
        lines.append(f"| {r['recipe']} | {r['compute']} | {r['state_B_per_param']:.4g} | {fmt_size(r['state_bytes'])} "
                     f"| {fmt_size(r['per_sample_bytes'])} | {'unbounded' if b is None else b}{rel} | "
                     f"{fmt_size(r['predicted_peak_bytes'])} |")
    return "\n".join(lines)
