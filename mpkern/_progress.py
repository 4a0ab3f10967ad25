"""A progress bar for long work: tqdm when it is installed, else a plain fallback on stderr."""

from __future__ import annotations

import sys
import time
from typing import Any


class _Plain:
    """Minimal stand-in for ``tqdm``: prints a line roughly every 10 % (and at the end)."""

    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc, self.n = max(int(total), 1), desc, 0
        self._postfix = ""
        self._next = 0.1
        self._t0 = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n / self.total >= self._next or self.n >= self.total:
            self._next = (self.n / self.total) + 0.1
            self._print()

    def set_postfix_str(self, s: str, refresh: bool = True) -> None:
        self._postfix = s

    def _print(self) -> None:
        el = time.perf_counter() - self._t0
        print(f"{self.desc}: {self.n}/{self.total} steps [{el:5.1f}s] {self._postfix}", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


class _Off:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str, refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


def bar(total: int, desc: str, enabled: bool = True) -> Any:
    """A progress bar over ``total`` steps with ``update``, ``set_postfix_str`` and ``close``."""
    if not enabled:
        return _Off()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _Plain(total, desc)
    return tqdm(total=total, desc=desc, unit="step", leave=True, dynamic_ncols=True, file=sys.stderr)
