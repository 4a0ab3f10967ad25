"""Count the mpkern modules a call runs code in, and its calls of each function (``sys.setprofile``).

``modules_run(opt.step)`` says which modules of mpkern one step enters and how often each of their
functions is called: ``benchmarks/seam_trace.py`` prints it for a first and a cached step, and
``tests/test_step_cache_dispatch.py`` checks with it that the backend is chosen once and later steps
take the cached path. A subpackage of ``mpkern.optim`` (``optim.storage``) counts as one module.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple


class Run(NamedTuple):
    """``modules``: module name -> Python calls into it; ``calls``: ``module.function`` -> calls."""

    modules: dict[str, int]
    calls: dict[str, int]
    result: Any


def module_key(name: str) -> str:
    """The unit counted for a module name: ``mpkern.optim.<subpackage>`` for anything below one."""
    parts = name.split(".")
    if len(parts) > 3 and parts[:2] == ["mpkern", "optim"]:
        return ".".join(parts[:3])
    return name


def modules_run(fn: Callable[[], Any]) -> Run:
    """Call ``fn()`` under ``sys.setprofile`` and count the Python calls into mpkern's modules."""
    modules: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    this = __name__

    def prof(frame: Any, event: str, _arg: Any) -> None:
        if event != "call":
            return
        name = frame.f_globals.get("__name__", "")
        if name == "mpkern" or (name.startswith("mpkern.") and name != this):
            modules[module_key(name)] += 1
            calls[f"{name}.{frame.f_code.co_name}"] += 1

    old = sys.getprofile()
    sys.setprofile(prof)
    try:
        result = fn()
    finally:
        sys.setprofile(old)
    return Run(dict(modules), dict(calls), result)


__all__ = ["Run", "module_key", "modules_run"]
