"""``mpkern compare``: train the same small model several ways and report them side by side.

The classic mixed-precision exercise -- train a text classifier in FP32 and in mixed precision,
compare tokens/s, memory and validation accuracy -- as one function (:func:`run`) and one command.
Every run gets the same initial weights, the same data in the same order and the same
hyperparameters; only the precision recipe differs:

==============  ===================================================================================
``fp32``        fp32 params, ``torch.optim.AdamW`` (fused where PyTorch has it), ``clip_grad_norm_``
``bf16``        PyTorch's recipe: fp32 params, ``torch.autocast(bfloat16)``, AdamW, ``clip_grad_norm_``
``fp16``        ``torch.autocast(float16)`` + ``GradScaler`` (``unscale_`` + ``clip_grad_norm_``)
``bf16-naive``  bf16 params, plain AdamW, no master weights (its small updates round away)
``mpkern-bf16`` bf16 params, :class:`mpkern.FusedAdamWMP` (fp32 masters) with ``max_grad_norm`` fused
``mpkern-8bit`` bf16 params, FusedAdamWMP(master_weights="8bit", state_dtype="8bit"): 7.125 B/param
``mpkern-fp16`` fp16 params (:func:`mpkern.nn.convert`), FusedAdamWMP + ``GradScaler`` +
                ``mpkern.unscale_(opt, scaler=scaler, max_norm=...)``
==============  ===================================================================================

``release=True`` (``--release``) adds, right after each mpkern run, the same run with gradient
release (``<run>+release``: ``FusedAdamWMP(release_grads=True)``, the step inside
``opt.backward(loss[, scaler])``), its speed, peak memory and losses set beside the regular run's.

The task (generated in code from ``seed``; no download): each sequence is noise tokens with one
*red* class token, one *blue* class token and one *query* token ("red?" or "blue?") at three
random positions; the label is the class of the token whose colour the query names. The model
(token + position embeddings, pre-LN transformer blocks, mean pooling, linear head) has only
per-token MLPs before the pooling, so combining the query with the right class token *needs*
attention; a model that ignores the query is capped at 50 % accuracy, chance is ``1/classes``.
The validation split is held out (never trained on).

Measurements: tokens/s over the steps after ``warmup`` (the device is synchronised at the timing
boundaries and when the progress bar shows a loss, every ``log_every`` steps -- never inside a
step); peak memory (CUDA: ``torch.cuda.max_memory_allocated`` above what was allocated before
the run; CPU: the run's tensor bytes -- weights, masters and moments plus the peak of the tensors
one steady step creates, activations, grads and every op's temporaries, counted from creation to
free (:class:`.memory.LiveBytes`) -- beside the growth of the process's peak RSS); training-state
bytes per parameter counted from the real tensors (:func:`mpkern.bytemodel.count_state`); final
train loss (mean of the last ``log_every`` steps); validation accuracy; skipped steps and the loss
scale. With a time budget (CPU default), a run the probe finds many times slower than fp32 is
time-boxed (:func:`.budget.fit_budget`): it stops after a fixed window and says so.
"""

from __future__ import annotations

from ..measure import cpu_flags
from .budget import fit_budget, probe_step_seconds, steps_that_fit
from .config import (
    DTYPE_NAME,
    LINEARS,
    OPTIMIZER_STATES,
    PRECISIONS,
    SCHEMA,
    Config,
    default_config,
    default_precisions,
)
from .memory import OthersCpu
from .plot import plot_results
from .probe import CPU_FLAGS, GPU_MIN_CAPABILITY, NATIVE_MIN_SPEED, choose_linear, compute_support, linear_shapes
from .report import format_details, format_header, format_table, lessons, write_outputs
from .runner import run
from .task import Block, Classifier, HFClassifier, Task, make_task
from .train import train_one

__all__ = ["run", "Config", "DTYPE_NAME", "OthersCpu", "PRECISIONS", "OPTIMIZER_STATES", "LINEARS", "SCHEMA",
           "default_config", "default_precisions", "make_task", "Task", "Classifier", "Block", "HFClassifier",
           "compute_support", "choose_linear", "linear_shapes", "probe_step_seconds", "steps_that_fit", "fit_budget",
           "train_one", "lessons", "format_header", "format_table", "format_details", "write_outputs", "plot_results",
           "cpu_flags", "CPU_FLAGS", "GPU_MIN_CAPABILITY", "NATIVE_MIN_SPEED"]
