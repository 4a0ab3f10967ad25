#!/usr/bin/env python3
"""The import half of "no reaching into another module's privates" (ruff's SLF001 is the other half).

ruff flags ``obj._name`` outside ``obj``'s class (SLF001), but not ``from .matmul import _fold``:
its private-import rule (PLC2701) ignores imports inside one's own package. This check flags, in
the files under ``[tool.mpkern.private-names] paths`` of ``pyproject.toml``:

* a private name (``_x``, not a dunder) imported from another module of ours -- mpkern's
  ``mpkern.*`` / ``mpkern.triton_kernels.*`` (the ``triton_kernels/`` folder) or a sibling script --
  unless ``_x`` is itself a module (``from . import _ops`` imports a module, not a name);
* a private module (``mpkern._ops``) imported from outside its parent package (a benchmark
  importing ``mpkern._backend``): inside the package, a private module is the package's own;
* a relative import that climbs above the top folder of the file (``from .. import measure`` in
  ``triton_kernels/``): it resolves only through a name the folder has elsewhere (the kernels'
  folder is ``mpkern.triton_kernels``; import-linter's contract that the kernels import nothing of
  mpkern catches that one as well), so the module is to be imported by its name.

Each exception is an ``allow`` entry ``{file, name, issue}`` in the same table: the issue that
removes it. An entry that no longer matches anything is an error too, so the list only shrinks.
Standard library only; run from the repository root: ``python scripts/lint_private_names.py``.
Exit status 0 when clean, 1 with one line per finding.
"""

from __future__ import annotations

import ast
import os
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the test extra installs tomli
    try:
        import tomli as tomllib
    except ModuleNotFoundError:
        tomllib = None  # type: ignore[assignment]

#: our packages: import name -> folder in the repository
PACKAGES = {"mpkern": "mpkern", "mpkern.triton_kernels": "triton_kernels", "triton_kernels": "triton_kernels"}


@dataclass(frozen=True)
class Finding:
    file: str
    line: int
    name: str  # the dotted name reached: module.private_name
    why: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.name}: {self.why}"


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def module_name(path: str) -> str | None:
    """The import name of a file of ours (``mpkern/optim/buckets.py`` -> ``mpkern.optim.buckets``)."""
    parts = os.path.normpath(path)[:-3].split(os.sep)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if parts[0] == "mpkern":
        return ".".join(parts)
    if parts[0] == "triton_kernels":
        return ".".join(["mpkern", *parts])
    return None  # a script: benchmarks/x.py, scripts/x.py


def module_path(name: str, root: str, script_dir: str | None) -> str | None:
    """The file or package folder of module ``name`` in this tree (None: not ours)."""
    for prefix in sorted(PACKAGES, key=len, reverse=True):
        if name == prefix or name.startswith(prefix + "."):
            rest = name[len(prefix):].lstrip(".").split(".") if name != prefix else []
            base = os.path.join(root, PACKAGES[prefix], *rest)
            break
    else:
        if script_dir is None or "." in name:
            return None
        base = os.path.join(script_dir, name)  # a sibling script imported by name (sys.path[0])
    if os.path.isdir(base) and os.path.isfile(os.path.join(base, "__init__.py")):
        return base
    if os.path.isfile(base + ".py"):
        return base + ".py"
    return None


def resolve_from(node: ast.ImportFrom, here: str | None, is_package: bool) -> str | None:
    """The absolute module of ``from X import ...`` in module ``here`` (None: unresolvable, e.g. a
    relative import in a script, or one that climbs above the top package)."""
    if not node.level:
        return node.module
    if here is None:
        return None
    base = here.split(".")
    # in a package's __init__.py `here` is the package itself: one level less to climb
    keep = len(base) - node.level + (1 if is_package else 0)
    if keep < 1:
        return None
    return ".".join(base[:keep] + ([node.module] if node.module else []))


def climbs_out(node: ast.ImportFrom, rel: str) -> bool:
    """A relative import in ``rel`` (a path) that leaves the top folder it lives in: level 1 is the
    file's own folder (for an ``__init__.py`` too: the package), each level more one folder up."""
    depth = len(os.path.normpath(rel).split(os.sep)) - 1  # the folders the file is in
    return node.level > depth


def check_file(path: str, root: str) -> Iterator[Finding]:
    rel = os.path.relpath(path, root)
    here = module_name(rel)
    script_dir = os.path.dirname(path) if here is None else None
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), rel)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if here is not None and climbs_out(node, rel):
                yield Finding(rel, node.lineno, "." * node.level + (node.module or ""),
                              f"relative import out of {rel.split(os.sep)[0]}/ (import the module by its name)")
                continue
            src = resolve_from(node, here, rel.endswith("__init__.py"))
            if src is None or module_path(src, root, script_dir) is None:
                continue  # not one of ours
            mod_parts = src.split(".")
            for alias in node.names:
                target = f"{src}.{alias.name}"
                if module_path(target, root, script_dir) is not None:
                    yield from _check_module(rel, node.lineno, target, here)
                elif is_private(alias.name):
                    yield Finding(rel, node.lineno, target, f"private name of {src} imported from another module")
                elif any(is_private(p) for p in mod_parts):
                    yield from _check_module(rel, node.lineno, src, here)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if module_path(alias.name, root, script_dir) is not None:
                    yield from _check_module(rel, node.lineno, alias.name, here)


def _check_module(rel: str, line: int, target: str, here: str | None) -> Iterator[Finding]:
    """A private module (or one inside a private module) imported from outside its parent package."""
    parts = target.split(".")
    for i, p in enumerate(parts):
        if is_private(p):
            owner = ".".join(parts[:i])  # the package the private module belongs to
            if here is None or not (here == owner or here.startswith(owner + ".")):
                yield Finding(rel, line, target, f"private module of {owner} imported from outside it")
            return


def python_files(root: str, paths: list[str]) -> Iterator[str]:
    for p in paths:
        full = os.path.join(root, p)
        if os.path.isfile(full):
            yield full
            continue
        for d, dirs, files in os.walk(full):
            dirs[:] = sorted(x for x in dirs if x != "__pycache__")
            for f in sorted(files):
                if f.endswith(".py"):
                    yield os.path.join(d, f)


def load_config(root: str) -> dict:
    if tomllib is None:
        raise SystemExit("lint_private_names: reading pyproject.toml needs Python >= 3.11 or tomli")
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        cfg = tomllib.load(f)
    try:
        return cfg["tool"]["mpkern"]["private-names"]
    except KeyError as e:
        raise SystemExit("lint_private_names: pyproject.toml has no [tool.mpkern.private-names] table") from e


def run(root: str, paths: list[str], allow: list[dict]) -> list[str]:
    """Every finding not allowed, and every allow entry that matched nothing, as lines."""
    allowed = {(a["file"], a["name"]): a for a in allow}
    used: set[tuple[str, str]] = set()
    counts = Counter((a["file"], a["name"]) for a in allow)
    out = [f"{f}: allow entry for {n} is listed twice" for (f, n), k in counts.items() if k > 1]
    for path in python_files(root, paths):
        for f in check_file(path, root):
            key = (f.file, f.name)
            if key in allowed:
                used.add(key)
            else:
                out.append(str(f))
    for key, a in allowed.items():
        if key not in used:
            out.append(f"{a['file']}: allow entry for {a['name']} (issue {a.get('issue')}) matches nothing: remove it")
    return out


def main(argv: list[str] | None = None) -> int:
    root = os.getcwd() if not argv else argv[0]
    cfg = load_config(root)
    lines = run(root, list(cfg.get("paths", ["mpkern"])), list(cfg.get("allow", [])))
    for line in lines:
        print(line)
    n_allow = len(cfg.get("allow", []))
    print(f"lint_private_names: {len(lines)} finding(s); {n_allow} allow-listed, each with the issue that removes it",
          file=sys.stderr)
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
