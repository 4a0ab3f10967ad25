"""benchmarks/RESULTS.md stays one page of current numbers, and the benchmark pages name only files that exist.

The page's rule (written at its top and in benchmarks/README.md): later work replaces its question's
section and moves the old one, verbatim, to benchmarks/history/. These tests hold what a reader relies
on: the page is at most 400 lines, and every script or document that RESULTS.md and benchmarks/README.md
name -- a repository path under one of CHECKED_ROOTS (``benchmarks/host_time.py``, ``scripts/gpu_check.sh``,
``tests/test_math.py::test_x``) or a name relative to the page's own folder (``host_time.py``,
``history/issue-43.md``) -- exists. Paths under csrc/ (being split into files) and absolute paths
(``/tmp/...``, scratch scripts of a sitting) are not checked.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
RESULTS = BENCH / "RESULTS.md"
BENCH_README = BENCH / "README.md"

MAX_LINES = 400
#: top-level folders whose paths a page must not name unless they exist
CHECKED_ROOTS = ("benchmarks", "scripts", "tools", "tests", "docs", "mpkern")
#: what counts as a named file: scripts and documents
EXTENSIONS = ("py", "sh", "md", "c")

# A path: segments of word characters, dots and dashes joined by '/', ending in a checked extension; not
# preceded by a path character (so '/tmp/x.py' does not yield 'tmp/x.py' or 'x.py') and not followed by
# one (so 'mpkern.nn.convert' does not yield 'mpkern.nn.c').
_PATH = re.compile(
    r"(?<![\w./~-])((?:\.\./|[\w-][\w.-]*/)*[\w-][\w.-]*\.(?:" + "|".join(EXTENSIONS) + r"))(?![\w/-])"
)


def named_paths(text):
    """Every file path the markdown text names, as written, in order of first appearance."""
    seen = {}
    for m in _PATH.finditer(text):
        seen.setdefault(m.group(1), None)
    return list(seen)


def resolve(path, page_dir, root=ROOT):
    """The repository file a named path means, or None when the rule does not check it.

    A path whose first folder is a top-level folder of the repository is repository-relative (checked only
    under CHECKED_ROOTS); any other relative name is relative to the page's folder, and a bare file name
    may also be a top-level file of the repository (``setup.py``, ``README.md``).
    """
    first = path.split("/", 1)[0]
    if "/" in path and first in CHECKED_ROOTS:
        return [root / path]
    if "/" in path and (root / first).is_dir() and not (page_dir / first).exists():
        return None  # another top-level folder (csrc/, triton_kernels/, .ci/): not this page's to check
    candidates = [page_dir / path]
    if "/" not in path:
        candidates.append(root / path)
    inside = [c for c in candidates if c.resolve().is_relative_to(root)]
    return inside or None


def missing_paths(text, page_dir, root=ROOT):
    """The named paths of ``text`` that the rule checks and that do not exist."""
    missing = []
    for path in named_paths(text):
        candidates = resolve(path, page_dir, root)
        if candidates is not None and not any(c.is_file() for c in candidates):
            missing.append(path)
    return missing


def test_results_page_is_at_most_400_lines():
    n = len(RESULTS.read_text().splitlines())
    assert n <= MAX_LINES, (
        f"benchmarks/RESULTS.md has {n} lines (at most {MAX_LINES}): replace the question's section and move "
        "the old one to benchmarks/history/ (the rule at the top of the page)"
    )


def test_the_rule_is_written_on_both_pages():
    for page in (RESULTS, BENCH_README):
        text = " ".join(page.read_text().split())
        assert "replaces its question's section" in text and "history/" in text, page


def test_results_page_names_only_files_that_exist():
    text = RESULTS.read_text()
    found = named_paths(text)
    # the parser really finds the page's scripts, documents and history files
    for expected in ("benchmarks/cuda_sass_count.py", "benchmarks/adamw_compact_cpu.py",
                     "scripts/gpu_check.sh", "history/README.md"):
        assert expected in found, (expected, found)
    assert len(found) >= 20, found
    assert missing_paths(text, BENCH) == []


def test_benchmarks_readme_names_only_files_that_exist():
    text = BENCH_README.read_text()
    found = named_paths(text)
    # its table names the scripts relative to benchmarks/
    for expected in ("host_time.py", "op_throughput.c", "scripts/gpu_check.sh", "RESULTS.md"):
        assert expected in found, (expected, found)
    assert len(found) >= 15, found
    assert missing_paths(text, BENCH) == []


def test_benchmarks_readme_points_to_sections_that_exist():
    headings = {line[3:].strip() for line in RESULTS.read_text().splitlines() if line.startswith("## ")}
    rows = [line for line in BENCH_README.read_text().splitlines() if line.startswith("| `")]
    assert len(rows) >= 10, rows
    for row in rows:
        sections = re.findall(r'"([^"]+)"', row.rstrip("|").rsplit("|", 1)[-1])
        assert sections, row
        for section in sections:
            assert section in headings, (section, sorted(headings))


def test_a_missing_path_is_caught(tmp_path):
    root = tmp_path
    (root / "benchmarks" / "history").mkdir(parents=True)
    (root / "scripts").mkdir()
    (root / "csrc").mkdir()
    (root / "benchmarks" / "here.py").write_text("")
    (root / "benchmarks" / "history" / "issue-1.md").write_text("")
    (root / "scripts" / "run.sh").write_text("")
    (root / "setup.py").write_text("")
    text = (
        "Command: `python benchmarks/here.py` and `bash scripts/run.sh`, history in `history/issue-1.md`;\n"
        "`setup.py` builds it. Gone: `python benchmarks/bench_unscale.py --quick`, `scripts/old.sh`,\n"
        "`tests/test_gone.py::test_x`, the bare `vanished.py`, [a link](history/issue-2.md).\n"
        "Not checked: `csrc/cuda/adamw_cuda.cu`, `csrc/gone.c`, `/tmp/pair.sh`, `/tmp/kern/perf1.py`,\n"
        "`mpkern.nn.convert`, attn.c_attn, `ld/st.global.cg`, `../../outside.py` (outside the repository).\n"
    )
    assert named_paths(text) == [
        "benchmarks/here.py", "scripts/run.sh", "history/issue-1.md", "setup.py",
        "benchmarks/bench_unscale.py", "scripts/old.sh", "tests/test_gone.py", "vanished.py",
        "history/issue-2.md", "csrc/gone.c", "../../outside.py",
    ]
    assert missing_paths(text, root / "benchmarks", root) == [
        "benchmarks/bench_unscale.py", "scripts/old.sh", "tests/test_gone.py", "vanished.py",
        "history/issue-2.md",
    ]
