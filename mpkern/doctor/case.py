"""A model to diagnose, as ``mpkern doctor`` runs it: the model, its inputs, its loss and the loss scale
its gradients are judged at. The built-in models (:mod:`.models`, :mod:`.examples`) and
``mpkern.compare``'s classifier (:func:`mpkern.compare.diagnosis.compare_case`) each build one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

Tensor = torch.Tensor


@dataclass
class Case:
    """A model to diagnose, what to feed it and how its loss is computed."""

    name: str
    model: nn.Module
    inputs: Any
    loss_fn: Callable[[Any], Tensor]
    describe: str
    loss_scale: float | None = None  # the scale its gradients are judged at (None: GradScaler's first)


CaseBuilder = Callable[[str, int], Case]
"""Builds a :class:`Case` from ``(device, seed)``: how ``mpkern doctor`` is given a model its own
package does not build (:func:`mpkern.doctor.command.run`'s ``builders``)."""
