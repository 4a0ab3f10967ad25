"""The house's rules are kept by tools (issue 40): these tests show that the tools see what they are
for -- an upward import or a cycle breaks the layer contracts, each form of private reach is found --
and that their configuration covers the whole package. CI runs the tools themselves on the tree
(`.ci/run`'s lint step); here they run on scratch copies, so a test can break a copy on purpose.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the test extra installs tomli
    tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml needs tomllib (3.11+) or tomli")


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _lint_imports() -> str:
    pytest.importorskip("importlinter", reason="import-linter is in the test extra (.ci/run installs it)")
    exe = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    if not os.path.exists(exe):
        pytest.skip("import-linter's lint-imports script is not beside this Python")
    return exe


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A copy of the package sources and pyproject.toml, to break on purpose."""
    base = tmp_path_factory.mktemp("tree")
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc")
    for d in ("mpkern", "triton_kernels"):
        # symlinks=True: mpkern/triton_kernels stays the link to ../triton_kernels it is in the tree
        shutil.copytree(os.path.join(ROOT, d), base / d, ignore=ignore, symlinks=True)
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), base / "pyproject.toml")
    return base


def _run_lint_imports(tree) -> subprocess.CompletedProcess:
    # from the copy's folder: grimp finds the packages on the working directory first
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([_lint_imports(), "--no-cache"], cwd=tree, capture_output=True, text=True, timeout=300,
                          env=env, check=False)


def _with_line(path, line: str):
    """Append ``line`` to ``path``; return a function that restores the file."""
    old = path.read_text(encoding="utf-8")
    path.write_text(old + "\n" + line + "\n", encoding="utf-8")
    return lambda: path.write_text(old, encoding="utf-8")


def test_layer_contracts_keep_on_an_unchanged_copy(scratch):
    r = _run_lint_imports(scratch)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 kept, 0 broken" in r.stdout, r.stdout


@pytest.mark.parametrize("where,line,expect", [
    # the optimizer reaching up into the CLI: an upward import across four layers
    ("mpkern/optim/functional.py", "from .. import cli  # noqa", "mpkern.optim.functional -> mpkern.cli"),
    # the ops importing the optimizer
    ("mpkern/_ops.py", "def _late():\n    from .optim import buckets  # noqa", "mpkern._ops -> mpkern.optim.buckets"),
    # a Triton kernel importing the library above it: a module, the package itself, a relative climb
    ("triton_kernels/matmul.py", "import mpkern.measure  # noqa", "mpkern.triton_kernels.matmul -> mpkern.measure"),
    ("triton_kernels/unscale.py", "import mpkern  # noqa", "mpkern.triton_kernels.unscale -> mpkern"),
    ("triton_kernels/tables.py", "from .. import reference  # noqa",
     "mpkern.triton_kernels.tables -> mpkern.reference"),
])
def test_an_upward_import_breaks_the_layers(scratch, where, line, expect):
    restore = _with_line(scratch / where, line)
    try:
        r = _run_lint_imports(scratch)
    finally:
        restore()
    assert r.returncode != 0, r.stdout
    assert "BROKEN" in r.stdout and expect in r.stdout, r.stdout


def test_a_cycle_between_siblings_breaks_the_acyclic_contract(scratch):
    # base -> moments, where moments already imports base: the storage package cycles
    restore = _with_line(scratch / "mpkern/optim/storage/base.py", "from . import moments  # noqa")
    try:
        r = _run_lint_imports(scratch)
    finally:
        restore()
    assert r.returncode != 0, r.stdout
    assert "no import cycle" in r.stdout and "mpkern.optim.storage" in r.stdout, r.stdout


def test_every_module_of_mpkern_sits_in_a_layer():
    contracts = _pyproject()["tool"]["importlinter"]["contracts"]
    (layers,) = [c for c in contracts if c["type"] == "layers"]
    placed = {m.strip() for layer in layers["layers"] for m in layer.replace("|", ":").split(":")}
    pkg = os.path.join(ROOT, "mpkern")
    modules = {"mpkern." + (f[:-3] if f.endswith(".py") else f) for f in os.listdir(pkg)
               if (f.endswith(".py") and f != "__init__.py")
               or os.path.isfile(os.path.join(pkg, f, "__init__.py"))}
    assert modules - placed == set(), "modules in no layer of [tool.importlinter] (place them)"
    assert placed - modules == set(), "layers name modules that do not exist"


# ---- scripts/lint_private_names.py --------------------------------------------------------------

def _private_names(tree, allow=()) -> subprocess.CompletedProcess:
    entries = ", ".join(f'{{ file = "{f}", name = "{n}", issue = 1 }}' for f, n in allow)
    (tree / "pyproject.toml").write_text(textwrap.dedent(f"""\
        [tool.mpkern.private-names]
        paths = ["mpkern", "triton_kernels", "benchmarks"]
        allow = [{entries}]
        """), encoding="utf-8")
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "lint_private_names.py"), str(tree)],
                          capture_output=True, text=True, timeout=60, check=False)


def test_private_name_check_finds_each_form(tmp_path):
    pkg = tmp_path / "mpkern"
    (pkg / "sub").mkdir(parents=True)
    (tmp_path / "benchmarks").mkdir()
    (pkg / "__init__.py").write_text("from . import _hidden_mod, a\n")
    (pkg / "_hidden_mod.py").write_text("X = 1\n")
    (pkg / "a.py").write_text("_secret = shown = _late = 1\nfrom ._hidden_mod import X as _X\n")
    (pkg / "sub" / "__init__.py").write_text("from .. import _hidden_mod\n")  # a private module: the package's own
    (pkg / "sub" / "b.py").write_text("from ..a import _secret, shown\n\ndef f():\n    from mpkern.a import _late\n")
    (tmp_path / "benchmarks" / "bench.py").write_text("from mpkern import _hidden_mod\nimport mpkern._hidden_mod\n")
    # the kernels' folder is installed as mpkern.triton_kernels: a relative import out of it reaches mpkern
    (tmp_path / "triton_kernels").mkdir()
    (tmp_path / "triton_kernels" / "__init__.py").write_text("")
    (tmp_path / "triton_kernels" / "k.py").write_text("from . import _ok\nfrom .. import a\n")
    (tmp_path / "triton_kernels" / "_ok.py").write_text("")
    r = _private_names(tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = sorted(r.stdout.splitlines())
    assert lines == [
        "benchmarks/bench.py:1: mpkern._hidden_mod: private module of mpkern imported from outside it",
        "benchmarks/bench.py:2: mpkern._hidden_mod: private module of mpkern imported from outside it",
        "mpkern/sub/b.py:1: mpkern.a._secret: private name of mpkern.a imported from another module",
        "mpkern/sub/b.py:4: mpkern.a._late: private name of mpkern.a imported from another module",
        "triton_kernels/k.py:2: ..: relative import out of triton_kernels/ (import the module by its name)",
    ], r.stdout


def test_private_name_allow_list_allows_and_must_shrink(tmp_path):
    pkg = tmp_path / "mpkern"
    pkg.mkdir()
    (tmp_path / "benchmarks").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("_x = 1\n")
    (pkg / "b.py").write_text("from .a import _x\n")
    assert _private_names(tmp_path, [("mpkern/b.py", "mpkern.a._x")]).returncode == 0
    stale = _private_names(tmp_path, [("mpkern/b.py", "mpkern.a._x"), ("mpkern/b.py", "mpkern.a._gone")])
    assert stale.returncode == 1 and "mpkern.a._gone (issue 1) matches nothing" in stale.stdout, stale.stdout
    twice = _private_names(tmp_path, [("mpkern/b.py", "mpkern.a._x")] * 2)
    assert twice.returncode == 1 and "mpkern.a._x is listed twice" in twice.stdout, twice.stdout


def test_private_name_allow_list_names_an_open_issue_for_each_entry():
    allow = _pyproject()["tool"]["mpkern"]["private-names"]["allow"]
    assert all(isinstance(a.get("issue"), int) and a["issue"] > 40 for a in allow), allow
