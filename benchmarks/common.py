"""Shared benchmark helpers for the scripts in this folder -- one implementation, importable from the
installed package: the measurement helpers of :mod:`mpkern.measure` (shared with ``mpkern compare``)
and the command line of :mod:`mpkern.bench` (what ``mpkern bench`` runs)."""

from __future__ import annotations

import os

from mpkern.bench import script_main, tensor_sizes  # noqa: F401 -- re-exported for the scripts
from mpkern.measure import machine_info, measure_bandwidth, sync, time_fn  # noqa: F401 -- re-exported for the scripts

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
