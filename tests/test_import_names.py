"""The Triton kernels have one import name: ``mpkern.triton_kernels`` (docs/design.md, "Rules kept by tools").

The folder ``triton_kernels/`` sits at the top of the repository and is the package ``mpkern.triton_kernels``
both in the source tree (the link ``mpkern/triton_kernels``) and once installed (setup.py's ``package_dir``).
Imported as ``triton_kernels`` it would be a second copy of every module -- its own ``TABLES`` cache, its own
interpreter patches -- that exists only where the repository root is on ``sys.path``; and a ``triton_kernels``
package on PyPI (Triton's own) would be shadowed by it or shadow it. This test reads every Python file of the
repository (syntax trees, no imports) and fails on an absolute import of the bare name.
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BARE = "triton_kernels"
_IMPORT_FUNCS = {"import_module", "__import__", "importorskip"}  # importlib's, the builtin, pytest's


def _bare(name: str | None) -> bool:
    return name is not None and (name == BARE or name.startswith(BARE + "."))


def bare_imports(source: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """(line, module) of each absolute import of ``triton_kernels`` in ``source``: ``import triton_kernels[.x]``,
    ``from triton_kernels[.x] import ...``, and ``importlib.import_module`` / ``__import__`` /
    ``pytest.importorskip`` called with such a name as a string literal. Relative imports (``from . import x``
    inside the kernels' folder) are not imports of the bare name."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if _bare(a.name)]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and _bare(node.module):
                found.append((node.lineno, node.module or ""))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            arg = node.args[0]
            if name in _IMPORT_FUNCS and isinstance(arg, ast.Constant) and isinstance(arg.value, str) \
                    and _bare(arg.value):
                found.append((node.lineno, arg.value))
    return found


def python_files() -> list[str]:
    """The repository's Python files: every ``*.py`` below the root, outside hidden folders (``.venv``, ``.git``)
    and build outputs; links to folders are not followed (``mpkern/triton_kernels`` is read as
    ``triton_kernels/``)."""
    skip = {"build", "dist", "__pycache__"}
    out = []
    for dirpath, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in skip and not d.endswith(".egg-info"))
        out += [os.path.join(dirpath, f) for f in sorted(files) if f.endswith(".py")]
    return out


def test_the_check_finds_each_form_of_a_bare_import():
    src = (
        "import triton_kernels\n"
        "import triton_kernels.adamw as ta\n"
        "from triton_kernels import matmul\n"
        "from triton_kernels.tables import TABLES\n"
        "def f():\n"
        "    import importlib, pytest\n"
        "    importlib.import_module('triton_kernels.unscale')\n"
        "    pytest.importorskip('triton_kernels')\n"
        "    return __import__('triton_kernels')\n"
        # none of these is the bare name
        "import mpkern.triton_kernels\n"
        "from mpkern.triton_kernels import adamw\n"
        "from . import _common\n"
        "from .triton_kernels import tables\n"
        "import triton_kernels_extra, triton\n"
        "importlib.import_module('mpkern.triton_kernels.matmul')\n"
    )
    assert bare_imports(src) == [
        (1, "triton_kernels"), (2, "triton_kernels.adamw"), (3, "triton_kernels"), (4, "triton_kernels.tables"),
        (7, "triton_kernels.unscale"), (8, "triton_kernels"), (9, "triton_kernels"),
    ]


def test_no_python_file_imports_the_kernels_by_their_bare_name():
    files = python_files()
    assert any(f.endswith(os.path.join("triton_kernels", "adamw.py")) for f in files), "the walk missed the kernels"
    assert any(f.endswith(os.path.join("benchmarks", "matmul_sass.py")) for f in files), "the walk missed benchmarks"
    bad = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            source = f.read()
        rel = os.path.relpath(path, ROOT)
        bad += [f"{rel}:{line}: {mod}" for line, mod in bare_imports(source, rel)]
    assert bad == [], "import the Triton kernels as mpkern.triton_kernels:\n" + "\n".join(bad)


def test_the_kernels_folder_is_the_package_mpkern_triton_kernels_in_the_tree():
    link = os.path.join(ROOT, "mpkern", "triton_kernels")
    assert os.path.islink(link) and os.readlink(link) == os.path.join("..", "triton_kernels"), \
        "mpkern/triton_kernels must be a link to ../triton_kernels (git clone with core.symlinks=true)"
    assert os.path.samefile(os.path.join(link, "__init__.py"), os.path.join(ROOT, "triton_kernels", "__init__.py"))
