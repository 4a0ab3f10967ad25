"""The torch and Python versions mpkern is tested on -- the one place that says so.

``pyproject.toml``'s ``requires-python`` and its torch requirement claim exactly these ranges
(``tests/test_versions.py`` checks that), CI runs the suite on the oldest and the newest torch of
the range beside the pinned one (``.ci/run``), and ``mpkern info`` warns when the torch in use lies
outside it. Ranges are inclusive ``(major, minor)`` pairs: every patch release of a listed minor
is covered; a pre-release or nightly of a newer minor is not.
"""

from __future__ import annotations

import re

TESTED_TORCH = ((2, 11), (2, 15))
TESTED_PYTHON = ((3, 10), (3, 13))


def minor_of(version: str) -> tuple[int, int] | None:
    """``"2.11.0+cu130"`` -> ``(2, 11)``; None for a string that does not start ``<major>.<minor>``."""
    m = re.match(r"\s*(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _label(pair: tuple[int, int]) -> str:
    return f"{pair[0]}.{pair[1]}"


def tested_torch_label() -> str:
    """``"2.11-2.15"``."""
    return f"{_label(TESTED_TORCH[0])}-{_label(TESTED_TORCH[1])}"


def torch_warning(version: str) -> str | None:
    """A one-line warning when torch ``version`` lies outside :data:`TESTED_TORCH`, else None."""
    minor = minor_of(version)
    lo, hi = TESTED_TORCH
    if minor is not None and lo <= minor <= hi:
        return None
    return (f"torch {version} is outside mpkern's tested range (torch {tested_torch_label()}): "
            "its kernels, optimizer and compiled step may fail or give other results")
