"""The stage harness of ``scripts/gpu_check.sh`` -- standard library only, no GPU needed.

:class:`StageFile` is one stage's JSON file, rewritten atomically after every row, so a stage cut
off by its limit keeps what it measured; :func:`run_stage` is every stage process's ending: SIGTERM
as ``KeyboardInterrupt``, the stack dump before the limit (:func:`dump_stacks_later`), and the stage
files still ``running`` marked ``interrupted`` or ``failed`` (:func:`mark_ended`) with the exit code
the script records.
"""

from __future__ import annotations

import json
import os
import signal
import traceback
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any

__all__ = ["StageFile", "dump_stacks_later", "mark_ended", "now_iso", "run_stage", "short_error", "stage_limit"]

#: the environment variable gpu_check.sh sets: seconds after which a stage dumps its stacks
DUMP_AFTER_ENV = "MPKERN_STAGE_DUMP_AFTER"
#: the environment variable gpu_check.sh sets: the seconds the stage has before its SIGINT
LIMIT_ENV = "MPKERN_STAGE_LIMIT"


def stage_limit(default: float) -> float:
    """The seconds this stage process has (``MPKERN_STAGE_LIMIT``, set by gpu_check.sh for each stage,
    the profile's deadline and the time earlier stages left included), else ``default``: what a stage
    that plans its own work by time (one recipe after another) divides."""
    value = os.environ.get(LIMIT_ENV, "")
    return float(value) if value.isdigit() and int(value) > 0 else default


def now_iso() -> str:
    """The current UTC time, ISO 8601 to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def short_error(e: BaseException) -> str:
    """``"TypeName: first line of the message"`` (at most 200 characters of it)."""
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"


class StageFile:
    """One stage's JSON file, rewritten (atomically: a temporary file, then ``os.replace``) after
    every change: ``{"stage", "status", "started", "updated", "meta", "planned", "rows", "error", ...}``.
    ``status``: ``running`` until :meth:`finish` sets ``done``, ``failed`` or ``interrupted``."""

    def __init__(self, path: str, stage: str, **extra: Any) -> None:
        if not path.endswith(".json"):
            raise ValueError(f"StageFile: the path must end in .json, got {path!r}")
        self.path = path
        self.data: dict[str, Any] = {"stage": stage, "status": "running", "started": now_iso(), "updated": now_iso(),
                                     "meta": {}, "planned": [], "rows": [], "error": None, **extra}
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.write()

    def write(self) -> None:
        self.data["updated"] = now_iso()
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, self.path)

    def set(self, **items: Any) -> None:
        self.data.update(items)
        self.write()

    def add_row(self, row: dict[str, Any]) -> int:
        """Append ``row`` (written at once); returns its index for :meth:`replace_row`."""
        self.data["rows"].append(row)
        self.write()
        return len(self.data["rows"]) - 1

    def replace_row(self, index: int, row: dict[str, Any]) -> None:
        """Put ``row`` in place of row ``index`` (a provisional row completed) and write."""
        if not 0 <= index < len(self.data["rows"]):
            raise IndexError(f"StageFile.replace_row: no row {index} (the stage has {len(self.data['rows'])})")
        self.data["rows"][index] = row
        self.write()

    def finish(self, status: str = "done", error: str | None = None) -> None:
        if status not in ("done", "failed", "interrupted"):
            raise ValueError(f"StageFile.finish: status must be done, failed or interrupted, got {status!r}")
        self.data["status"] = status
        if error is not None:
            self.data["error"] = error
        self.write()


def dump_stacks_later() -> None:
    """With ``MPKERN_STAGE_DUMP_AFTER=SECONDS`` (set by gpu_check.sh), dump the main thread's Python
    stack to stderr after that long: a stage stuck in native code (a compile, a kernel) shows where.

    The dump is faulthandler's SIGUSR1 handler, raised by a timer thread: it runs on the main thread
    and reads that thread's own frames. (``faulthandler.dump_traceback_later`` reads every thread's
    frames from its watchdog thread while they run, and crashed a stage process in 2 of 3 tries here.)"""
    import faulthandler
    import threading

    after = os.environ.get(DUMP_AFTER_ENV, "")
    if after.isdigit() and int(after) > 0:
        faulthandler.register(signal.SIGUSR1, all_threads=False)
        timer = threading.Timer(int(after), os.kill, (os.getpid(), signal.SIGUSR1))
        timer.daemon = True
        timer.start()


def _sigterm_as_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def mark_ended(out: str, files: Sequence[str], why: str, status: str = "interrupted") -> None:
    """Set ``status`` (``interrupted``: the stage was cut off; ``failed``) and the reason in the
    stage files under ``out`` still ``running``."""
    for fname in files:
        path = os.path.join(out, fname)
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if data.get("status") == "running":
            data["status"], data["error"] = status, why
            tmp = f"{path}.tmp"
            with open(tmp, "w") as f:
                json.dump(data, f, indent=1, default=str)
            os.replace(tmp, path)


def run_stage(out: str, files: Sequence[str], body: Callable[[], int]) -> int:
    """Run one stage process's ``body`` -> its exit status: 0 done, what ``body`` returns, 130 when
    interrupted (SIGINT from ``timeout``, or SIGTERM), 3 when it found no CUDA GPU, 1 on any other
    failure; the files of ``files`` still ``running`` say which."""
    os.makedirs(out, exist_ok=True)
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    dump_stacks_later()
    try:
        return body()
    except KeyboardInterrupt as e:
        mark_ended(out, files, f"interrupted ({e or 'SIGINT'}: the stage's time limit)")
        return 130
    except Exception as e:  # noqa: BLE001 -- a stage process: any failure is written down and becomes its exit code
        traceback.print_exc()
        mark_ended(out, files, short_error(e), "failed")
        return 3 if "no CUDA GPU" in str(e) else 1
