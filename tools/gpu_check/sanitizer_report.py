"""Reading for the sanitizer stage (:mod:`.sanitizer`) -- standard library only, no GPU needed.

* :func:`scan_kernels`: mpkern's CUDA kernels from the source (``__global__`` functions of
  ``csrc/cuda``) and which of them use shared memory (a ``__shared__`` in the kernel's body) -- the
  kernels memcheck checks and the ones racecheck (shared-memory hazards only) is worth running on.
* :func:`parse_report`: compute-sanitizer's text output (its report lines, prefixed ``=========``,
  interleaved with the workload's marker lines) -> findings ``{tool, kernel, label, kind, count,
  hazards, first_lines}``, each error attributed to the labelled call whose marker preceded it,
  plus the tool's summary count and how far the workload got.

The report format read here is compute-sanitizer's own (CUDA 11.x-13.x): an error is a block of
lines starting with an unindented line (``Invalid __global__ read of size 4 bytes``, ``Error: Race
reported between ...``, ``Program hit cudaErrorX (error N) ...``) followed by indented ``at`` / ``by
thread`` / ``Address`` / ``and ...`` / frame lines, ended by a bare prefix line; the run ends with
``ERROR SUMMARY: N errors`` (memcheck) or ``RACECHECK SUMMARY: N hazards displayed (E errors, W
warnings)``. tests/test_gpu_sanitizer.py holds samples of each shape with where they come from.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["CALL", "DONE", "END", "FAIL", "NOGPU", "PLAN", "PREFIX", "error_kind", "kernel_of", "parse_report",
           "scan_kernels", "scan_source_tree"]

#: compute-sanitizer's default line prefix (its ``--prefix`` option)
PREFIX = "========="
#: the workload's marker lines (tools/gpu_check/sanitizer_workload.py prints them, flushed)
PLAN, CALL, DONE, FAIL, END, NOGPU = ("@@sanitizer-plan ", "@@sanitizer-call ", "@@sanitizer-done ",
                                      "@@sanitizer-fail ", "@@sanitizer-end", "@@sanitizer-nogpu")

_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_GLOBAL = re.compile(r"\b__global__\b")
#: what may stand between ``__global__ void`` and a kernel's name, with arguments of its own
_ATTRIBUTES = ("__launch_bounds__", "__attribute__", "__cluster_dims__", "__maxnreg__")
_NAME_PAREN = re.compile(r"([A-Za-z_]\w*)\s*\(")
#: unindented report lines about the run, not errors of the checked code (kept as notes)
_NOTES = ("Target application returned an error", "Error: process didn't terminate",
          "Error: No attachable process", "Default timeout can be adjusted", "Warning: Maximum number of",
          "Error: Target application terminated before first instrumented API call", "Internal Sanitizer Error")
#: unindented report lines that are neither errors nor notes
_NOT_ERRORS = ("COMPUTE-SANITIZER", "ERROR SUMMARY", "RACECHECK SUMMARY", "LEAK SUMMARY", "INITCHECK SUMMARY",
               "SYNCCHECK SUMMARY", *_NOTES)
#: continuation lines of an error block, whatever their indentation
_CONTINUATION = ("at ", "by thread", "Address ", "Access ", "and ", "Saved host backtrace", "Host Frame",
                 "Device Frame", "in block", "Write Thread", "Read Thread", "Current Value", "Previous Value",
                 "...")
_ERROR_SUMMARY = re.compile(r"ERROR SUMMARY:\s*(\d+) errors?\b")
_RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY:\s*(\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")
_HAZARDS = re.compile(r"\[(\d+) hazards?\]")


# ---- the kernels, from the source ------------------------------------------------------------------
def _matching(text: str, start: int, open_c: str, close_c: str) -> int:
    """Index just past the bracket closing the one at ``start`` (len(text) if it never closes)."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_c:
            depth += 1
        elif text[i] == close_c:
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _scan(source: str) -> tuple[dict[str, bool], bool]:
    """(the kernels defined in ``source`` -> a ``__shared__`` in the body, whether ``source`` has a
    ``__shared__`` outside every kernel body)."""
    text = _COMMENT.sub(" ", source)
    kernels: dict[str, bool] = {}
    bodies: list[tuple[int, int]] = []
    for m in _GLOBAL.finditer(text):
        pos, name = m.end(), None
        while (name := _NAME_PAREN.search(text, pos)) is not None and name.group(1) in _ATTRIBUTES:
            pos = _matching(text, name.end() - 1, "(", ")")  # __launch_bounds__(...) before the name
        if name is None:
            continue
        params_end = _matching(text, name.end() - 1, "(", ")")
        brace = text.find("{", params_end)
        semi = text.find(";", params_end)
        if brace < 0 or (0 <= semi < brace):  # a declaration, not a definition
            continue
        end = _matching(text, brace, "{", "}")
        bodies.append((brace, end))
        kernels[name.group(1)] = kernels.get(name.group(1), False) or "__shared__" in text[brace:end]
    stray = any(not any(b <= m.start() < e for b, e in bodies) for m in re.finditer(r"\b__shared__\b", text))
    return kernels, stray


def scan_kernels(source: str) -> dict[str, bool]:
    """The ``__global__`` functions defined in one CUDA source text -> whether each uses shared
    memory: a ``__shared__`` inside its body, or anywhere in the file outside every kernel body (a
    device function's static shared array, an ``extern __shared__`` at file scope: then every kernel
    of the file counts, to be safe)."""
    kernels, stray = _scan(source)
    return dict.fromkeys(kernels, True) if stray else kernels


def scan_source_tree(root: str) -> dict[str, bool]:
    """:func:`scan_kernels` over ``root/csrc/cuda/*.cu`` and ``*.cuh`` (a kernel defined in two
    files uses shared memory if either says so; a ``__shared__`` outside any kernel in a file that
    defines none -- a header's device function -- makes every kernel count)."""
    found: dict[str, bool] = {}
    header_shared = False
    for path in sorted(glob.glob(os.path.join(root, "csrc", "cuda", "*.cu*"))):
        if not path.endswith((".cu", ".cuh")):
            continue
        with open(path, encoding="utf-8") as f:
            kernels, stray = _scan(f.read())
        header_shared = header_shared or (stray and not kernels)
        for name, shared in kernels.items():
            found[name] = found.get(name, False) or shared or stray
    return dict.fromkeys(found, True) if header_shared else found


# ---- one error block ----------------------------------------------------------------------------
def _name_pattern(name: str) -> re.Pattern[str]:
    # a demangled name (``adamw_kernel<``) or a mangled one (``12adamw_kernelILi``), never a longer
    # identifier that contains it (``fused_scale_kernel``)
    return re.compile(rf"(?<![A-Za-z_]){re.escape(name)}(?![a-z0-9_])")


def _function_of(at_line: str) -> str:
    """The function named by an ``at ...`` line, without namespaces, template arguments or
    parameters (``at 0x3b0 in void ns::k<int>(int*)``, ``at k(int*)+0x70 in f.cu:8``,
    ``at k():0x160 in f.cu:6`` -> ``k``); '' if none."""
    text = at_line.strip()
    text = text[3:] if text.startswith("at ") else text
    text = re.sub(r"^0x[0-9a-fA-F]+ in ", "", text)
    text = re.sub(r"^\S+\.\w+:\d+:", "", text)  # cuda-memcheck: "file.cu:75:void k<double>(...)"
    text = text.replace("(anonymous namespace)", "anon")
    out, depth = [], 0
    for ch in text:  # drop template arguments, which may hold parentheses: k<(int)2>
        if ch == "<":
            depth += 1
        elif ch == ">" and depth:
            depth -= 1
        elif depth == 0:
            out.append(ch)
    m = _NAME_PAREN.search("".join(out))
    return m.group(1) if m else ""


def kernel_of(lines: Sequence[str], kernels: Iterable[str]) -> str:
    """The kernel an error block is about: the outermost of ``kernels`` it names (device frames list
    callers last), else the function of its ``at`` line; ``"?"`` if neither."""
    pats = [(k, _name_pattern(k)) for k in kernels]
    for line in reversed(lines):
        for k, pat in pats:
            if pat.search(line):
                return k
    for line in lines:
        if line.strip().startswith("at ") or " at " in line:
            name = _function_of(line.strip()[line.strip().find("at "):])
            if name:
                return name
    return "?"


def error_kind(lines: Sequence[str]) -> str:
    """A short name for the error a block reports (its first line, normalised): ``Invalid
    __global__ read (out of bounds)``, ``race error: Write/Read``, ``CUDA API error
    cudaErrorIllegalAddress``, ``Malloc/Free error: Double free``, ``leak``."""
    first = lines[0].strip()
    rest = " ".join(x.strip() for x in lines[1:])
    m = re.match(r"(Invalid __\w+__ (?:read|write|atomic))", first)
    if m:
        why = "out of bounds" if "out of bounds" in rest else "misaligned" if "misaligned" in rest else ""
        return f"{m.group(1)} ({why})" if why else m.group(1)
    m = re.match(r"(Error|Warning|ERROR|WARN|WARNING|Info|INFO)\s*(?:\([^)]*\))?:\s*(.*)", first)
    if m:
        sev = {"WARN": "warning", "WARNING": "warning", "ERROR": "error", "INFO": "info"}.get(m.group(1),
                                                                                          m.group(1).lower())
        if "Race reported between" in m.group(2):
            acc = re.findall(r"\b(Read|Write|Atomic)\s+access", first + " " + rest)
            return f"race {sev}: {'/'.join(acc[:2]) or '?'}"
        hz = re.search(r"Potential (\w+) hazard", m.group(2))
        if hz:
            return f"race {sev}: {hz.group(1)} hazard"
        return f"{sev}: {m.group(2)[:60]}"
    m = re.match(r"Program hit (\S+)(?: \(error (\d+)\))?", first)
    if m:
        return f"CUDA API error {m.group(1)}"
    m = re.match(r"Malloc/Free error encountered\s*:\s*(.*)", first)
    if m:
        return f"Malloc/Free error: {m.group(1).strip()}"
    if first.startswith("Leaked "):
        return "leak"
    return re.split(r" at |:", first, maxsplit=1)[0][:60] or "?"


# ---- a whole run's output -----------------------------------------------------------------------
def _start_block(body: str) -> bool:
    """Whether a prefixed line's text (prefix removed) starts an error block."""
    if not body or body[0].isspace():
        return False
    text = body.strip()
    return not text.startswith(_NOT_ERRORS) and not text.startswith(_CONTINUATION)


def parse_report(text: str, tool: str, kernels: Iterable[str], prefix: str = PREFIX) -> dict[str, Any]:
    """compute-sanitizer's combined output (with the workload's markers) -> ``{"findings": [...],
    "summary": line or None, "errors": int or None, "warnings": int or None, "planned", "calls",
    "done", "failed": [labels], "ended": bool, "nogpu": bool, "notes": [lines]}``.

    ``errors`` is the tool's summary count (racecheck: its error-level hazards, ``warnings`` the
    rest), None when the output has no summary (the run was cut off, or the tool never attached).
    Each finding groups the blocks of one (kernel, call label, kind): ``count`` blocks, ``hazards``
    (racecheck's ``[N hazards]``, else the block count), ``first_lines`` of the first block."""
    kernels = list(kernels)
    out: dict[str, Any] = {"findings": [], "summary": None, "errors": None, "warnings": None, "planned": None,
                           "calls": 0, "done": 0, "failed": [], "ended": False, "nogpu": False, "notes": []}
    groups: dict[tuple[str, str, str], dict[str, Any]] = {}
    label, block = "(before the first call)", None

    def close() -> None:
        nonlocal block
        if block:
            lines = [x.strip() for x in block]
            key = (kernel_of(lines, kernels), label, error_kind(lines))
            hz = sum(int(h) for h in _HAZARDS.findall(" ".join(lines))) or 1
            g = groups.setdefault(key, {"tool": tool, "kernel": key[0], "label": key[1], "kind": key[2],
                                        "count": 0, "hazards": 0, "first_lines": lines[:8]})
            g["count"] += 1
            g["hazards"] += hz
        block = None

    for raw in text.splitlines():
        line = raw.rstrip("\n")
        if line.startswith("@@sanitizer-"):
            close()
            if line.startswith(PLAN):
                out["planned"] = int(line[len(PLAN):].split()[0])
            elif line.startswith(CALL):
                label = line[len(CALL):].strip()
                out["calls"] += 1
            elif line.startswith(DONE):
                out["done"] += 1
            elif line.startswith(FAIL):
                out["failed"].append(line[len(FAIL):].strip())
            elif line.startswith(END):
                out["ended"], label = True, "(after the last call)"
            elif line.startswith(NOGPU):
                out["nogpu"] = True
            continue
        if not line.startswith(prefix):
            continue
        body = line[len(prefix):]
        body = body[1:] if body.startswith(" ") else body  # the one space after the prefix; more: a continuation
        text_ = body.strip()
        if not text_:
            close()
            continue
        m = _ERROR_SUMMARY.search(text_)
        if m and "not printed" not in text_ and out["summary"] is None:
            out["summary"], out["errors"] = text_, int(m.group(1))
        m = _RACE_SUMMARY.search(text_)
        if m:
            out["summary"], out["errors"], out["warnings"] = text_, int(m.group(2)), int(m.group(3))
        if _start_block(body):
            close()
            block = [body]
        elif block is not None and not text_.startswith(_NOT_ERRORS):
            block.append(body)
        if text_.startswith(_NOTES):
            out["notes"].append(text_)
    close()
    out["findings"] = list(groups.values())
    return out
