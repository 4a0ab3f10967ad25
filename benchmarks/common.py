"""Shared benchmark helpers -- re-exported from :mod:`mpkern.bench` (one implementation, importable
by the installed package, used by ``mpkern bench`` and by the scripts in this folder)."""

from __future__ import annotations

import os

from mpkern.bench import (  # noqa: F401
    machine_info,
    measure_bandwidth,
    script_main,
    sync,
    tensor_sizes,
    time_fn,
)

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
