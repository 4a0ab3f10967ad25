"""The optimizer's documented switches the benchmarks flip, set through one checked helper: a
switch the optimizer does not have is an error, never a silently ignored attribute (which would
time the same thing twice and report a difference of noise)."""

from __future__ import annotations

from typing import Any


def set_switch(optimizer: Any, name: str, value: bool) -> None:
    """``optimizer.<name> = value`` for a public boolean switch of ``FusedAdamWMP``
    (``check_external_writes``, ``step_cache``); AttributeError if the optimizer has no such switch."""
    if not hasattr(optimizer, name):
        raise AttributeError(f"{type(optimizer).__name__} has no public switch {name!r}")
    setattr(optimizer, name, bool(value))
