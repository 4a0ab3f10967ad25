"""The arguments of one ``mpkern::adamw_step_`` call as one named bundle, :class:`AdamwArgs`.

The dispatcher takes the op's flat schema (``mpkern/codecs.def``); :mod:`mpkern._ops` unpacks it once
(``_ops.adamw_args``, which reads the argument names from the schema) into this bundle, and every
Python backend -- the reference, the Triton kernel, the fake kernel, the argument checks -- takes the
bundle and reads its fields by name. The fields are keyword-only: nothing but the schema depends on
their order. A new argument of the op: the schema, a field here, and the kernels that use it (see
``docs/design.md``, "Adding an argument to adamw_step_").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import codecs

Tensor = torch.Tensor


@dataclass(frozen=True, kw_only=True, slots=True)
class AdamwArgs:
    """One ``mpkern::adamw_step_`` call: the fused AdamW step over one param group on one device.

    Tensor lists, one entry per param (``max_exp_avg_sqs``: amsgrad, else empty; ``masters``: as
    ``master_codec`` says, empty for ``"none"``; ``exp_avg_scales`` / ``exp_avg_sq_scales``: the bf16
    group scales of a grouped ``moment_codec``, else None); the 0-dim tensors ``grad_factor`` (the grads
    are multiplied by it in registers), ``found_inf`` (nothing is written when it is non-zero) and
    ``lr_tensor`` (the lr read on the device; None: the float ``lr``); the hyperparameters; the codecs
    by name (rows of :data:`mpkern.codecs.MASTER_CODECS` / :data:`mpkern.codecs.MOMENT_CODECS`); the
    random streams (``stream_ids`` / ``elem_offsets``: one per tensor, or empty for index and 0).
    Values are kept as the caller gave them (lists or tuples, SymInts while tracing).
    """

    params: Sequence[Tensor]
    grads: Sequence[Tensor]
    exp_avgs: Sequence[Tensor]
    exp_avg_sqs: Sequence[Tensor]
    max_exp_avg_sqs: Sequence[Tensor]
    masters: Sequence[Tensor]
    steps: Sequence[Tensor]
    grad_factor: Tensor
    found_inf: Tensor
    lr_tensor: Tensor | None
    exp_avg_scales: Sequence[Tensor] | None = None
    exp_avg_sq_scales: Sequence[Tensor] | None = None
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    maximize: bool
    master_codec: str
    moment_codec: str
    stochastic_rounding: bool
    seed: int
    stream_ids: Sequence[int] = ()
    elem_offsets: Sequence[int] = ()

    @property
    def master(self) -> codecs.MasterCodec:
        """The master codec's row (ValueError naming the codecs for an unknown name)."""
        return codecs.master_codec(self.master_codec)

    @property
    def moments(self) -> codecs.MomentCodec:
        """The moment codec's row (ValueError naming the codecs for an unknown name)."""
        return codecs.moment_codec(self.moment_codec)

    @property
    def master_mode(self) -> int:
        """The kernels' master mode (the row's ``mode`` in ``mpkern/codecs.def``)."""
        return self.master.mode

    @property
    def moment_mode(self) -> int:
        """The kernels' moment mode (the row's ``mode``)."""
        return self.moments.mode


__all__ = ["AdamwArgs"]
