"""Every test file the project names exists, so that renaming or splitting one cannot leave a list behind.

The lists: the GPU check's (``GPU_TESTS`` and ``NOT_ON_GPU`` in ``scripts/gpu_check.sh`` -- which skips a
listed file that is missing without a word, so a stale name silently drops tests from the GPU run) and
CI's subset (``SUBSET`` in ``.ci/run``, run on the oldest and newest torch). The mentions: every
``tests/test_*.py`` (or bare ``test_*.py``) in the pages (README.md, docs/, benchmarks/README.md and
RESULTS.md) and in the code outside tests/ (scripts, tools, benchmarks, the package, .ci). The tests'
own sources are not read: they name made-up test files on purpose. benchmarks/history/ is a record and
keeps the names of its day.
"""

from __future__ import annotations

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MENTION = re.compile(r"(?<![\w/])(?:tests/)?(test_\w+\.py)\b")


def _text(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def _bash_array(text: str, name: str) -> list[str]:
    """The words of the bash array ``name=( ... )`` (quoted words kept whole, quotes dropped)."""
    m = re.search(rf"^{name}=\((.*?)\)\s*$", text, re.M | re.S)
    assert m, f"no {name}=( ... ) array"
    return [a or b for a, b in re.findall(r'"([^"]*)"|(\S+)', m.group(1))]


def _missing(names) -> list[str]:
    return sorted({n for n in names if not os.path.isfile(os.path.join(ROOT, "tests", n))})


def test_the_gpu_checks_lists_name_existing_test_files():
    text = _text("scripts/gpu_check.sh")
    gpu = _bash_array(text, "GPU_TESTS")
    assert len(gpu) >= 20 and all(re.fullmatch(r"test_\w+:(all|k)", e) for e in gpu), gpu
    off = _bash_array(text, "NOT_ON_GPU")
    assert off and all(re.match(r"test_\w+: \S", e) for e in off), off
    names = [e.split(":")[0] + ".py" for e in gpu + off]
    assert len(names) == len(set(names)), "a test file listed twice"
    assert _missing(names) == []


def test_ci_subset_names_existing_test_files():
    subset = _bash_array(_text(".ci/run"), "SUBSET")
    assert len(subset) >= 5 and all(re.fullmatch(r"tests/test_\w+\.py", f) for f in subset), subset
    assert _missing(os.path.basename(f) for f in subset) == []


def _sources() -> list[str]:
    pages = ["README.md", "benchmarks/README.md", "benchmarks/RESULTS.md", *glob.glob("docs/**/*.md", root_dir=ROOT,
                                                                                   recursive=True)]
    code = [f for pattern in ("scripts/**/*", "tools/**/*.py", "benchmarks/*.py", "mpkern/**/*.py", ".ci/*",
                              "triton_kernels/*.py", "setup.py", "pyproject.toml")
            for f in glob.glob(pattern, root_dir=ROOT, recursive=True)]
    return sorted(f for f in set(pages + code) if os.path.isfile(os.path.join(ROOT, f)))


def test_every_test_file_a_page_or_a_script_mentions_exists():
    sources = _sources()
    assert "docs/design.md" in sources and "scripts/gpu_check.sh" in sources, sources
    bad = []
    for rel in sources:
        try:
            text = _text(rel)
        except UnicodeDecodeError:
            continue  # a binary file (none is expected)
        bad += [f"{rel}: {n}" for n in sorted(set(MENTION.findall(text))) if _missing([n])]
    assert bad == [], "test files named but not there (renamed? split?):\n" + "\n".join(bad)


def test_the_mention_pattern_finds_the_forms_in_use():
    text = ("see `tests/test_a.py::test_x`, test_b.py, (tests/test_c.py) and tests/test_d.py; "
            "not mytest_e.py, other/test_f.py or test_g.pyc")
    assert MENTION.findall(text) == ["test_a.py", "test_b.py", "test_c.py", "test_d.py"]
