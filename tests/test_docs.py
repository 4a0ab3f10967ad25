"""README.md and docs/ checked against the code (issue 29, item 7).

Every ``mpkern.X`` name and every ``opt.X`` attribute the pages use exists, every ``mpkern <command>
--flag`` they show parses, every relative link points at a file (and heading) that is there, the
README's Python examples run as written, and no long paragraph is said twice (moved, not copied).
"""

from __future__ import annotations

import glob
import importlib
import itertools
import os
import re
from typing import Any

import pytest
import torch

import mpkern

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
PAGES = [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)


def _text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


def _resolve(dotted: str) -> bool:
    """Whether ``mpkern.a.b`` names something: attributes first, else a submodule to import."""
    parts = dotted.split(".")
    obj: Any = mpkern
    for i in range(1, len(parts)):
        if hasattr(obj, parts[i]):
            obj = getattr(obj, parts[i])
            continue
        try:
            obj = importlib.import_module(".".join(parts[: i + 1]))
        except ImportError:
            return False
    return True


def test_readme_is_the_front_door():
    """At most 250 lines, and the two commands for a fresh machine exactly as they are."""
    text = _text(README)
    assert len(text.splitlines()) <= 250
    assert "```bash\nbash scripts/setup.sh && .venv/bin/mpkern compare\n```" in text
    assert "```bash\nbash scripts/setup.sh && .venv/bin/python -m pytest -q\n```" in text


def test_every_mpkern_name_the_docs_use_exists():
    name = re.compile(r"(?<![\w./-])mpkern(?:\.[A-Za-z_]\w*)+")  # not torch.ops.mpkern.x, not paths
    used = {(m.group(0), _rel(p)) for p in PAGES for m in name.finditer(_text(p))}
    assert len({n for n, _ in used}) > 15  # the pattern finds the names at all
    missing = sorted((n, p) for n, p in used if not _resolve(n))
    assert missing == [], f"names the docs use that mpkern does not have: {missing}"


def test_every_optimizer_attribute_the_docs_use_exists():
    """``opt.X`` in the pages is a FusedAdamWMP method or attribute (torch.optim.Optimizer's included)."""
    w = torch.nn.Parameter(torch.randn(8, 4, dtype=torch.bfloat16))
    opt = mpkern.FusedAdamWMP([w], lr=1e-3)
    used = {(m.group(1), _rel(p)) for p in PAGES for m in re.finditer(r"\bopt\.(\w+)", _text(p))}
    assert {"step", "master_params"} <= {a for a, _ in used}
    missing = sorted((a, p) for a, p in used if not hasattr(opt, a))
    assert missing == [], f"optimizer attributes the docs use that FusedAdamWMP does not have: {missing}"


def _command_texts() -> list[tuple[str, str]]:
    """(page, text) of every inline code span (line breaks folded) and every command line of a shell block
    (in a transcript, the ``$ `` lines; never ```text blocks: they hold what commands print)."""
    out = []
    for p in PAGES:
        text = _text(p)
        for lang, body in FENCE.findall(text):
            if lang in ("bash", "sh", "console", ""):
                lines = body.splitlines()
                if any(line.startswith("$ ") for line in lines):  # a transcript: the commands and their output
                    lines = [line[2:] for line in lines if line.startswith("$ ")]
                out += [(_rel(p), line.split("#")[0]) for line in lines]
        out += [(_rel(p), " ".join(span.split())) for span in re.findall(r"`([^`]+)`", FENCE.sub("", text))]
    return out


def test_every_command_and_flag_the_docs_show_exists():
    """``mpkern CMD --flag ...`` shown in the pages: CMD is a subcommand and each flag one of its flags."""
    from mpkern.cli import build_parser

    help_text = build_parser().format_help()
    commands = set(re.search(r"\{([\w,-]+)\}", help_text).group(1).split(","))  # argparse's {info,compare,...}
    flags: dict[str, set[str]] = {}
    call = re.compile(r"(?:^|[\s/(])mpkern ([a-z][\w-]*)(.*)")
    seen, bad = set(), []
    for page, text in _command_texts():
        for m in call.finditer(text):
            cmd = m.group(1)
            if cmd not in commands:
                bad.append((page, text, f"no subcommand {cmd!r}"))
                continue
            seen.add(cmd)
            if cmd not in flags:
                flags[cmd] = set(re.findall(r"--[a-z][\w-]*", _subcommand_help(cmd)))
            bad += [(page, text, f"{cmd} has no {f}") for f in re.findall(r"--[a-z][\w-]*", m.group(2))
                    if f not in flags[cmd]]
    assert {"info", "compare", "bench", "plan"} <= seen
    assert bad == [], bad


def _subcommand_help(cmd: str) -> str:
    """``mpkern CMD --help`` as printed (every flag of the subcommand)."""
    import contextlib
    import io

    from mpkern.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit):
        main([cmd, "--help"])
    return buf.getvalue()


def test_readme_commands_parse():
    """Every ``mpkern ...`` command line of the README's bash blocks parses, values included."""
    import shlex

    from mpkern.cli import build_parser

    lines = [cmd.strip() for lang, body in FENCE.findall(_text(README)) if lang == "bash"
             for line in body.splitlines() for cmd in line.split("#")[0].split("&&")]
    argvs = [shlex.split(c)[1:] for c in lines if c and shlex.split(c)[0].endswith("mpkern")]
    assert len(argvs) >= 5
    for argv in argvs:
        args = build_parser().parse_args(argv)  # a bad flag or value exits with status 2 here
        assert callable(args.func), argv


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_resolve():
    bad = []
    for p in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", _text(p)):
            if re.match(r"[a-z]+:", target):
                continue  # http(s):, mailto:
            path, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(p), path)) if path else p
            if not os.path.exists(dest):
                bad.append((_rel(p), target, "no such file"))
            elif anchor and dest.endswith(".md"):
                heads = {_slug(h) for h in re.findall(r"^#+ (.*)$", FENCE.sub("", _text(dest)), re.M)}
                if anchor not in heads:
                    bad.append((_rel(p), target, "no such heading"))
    assert bad == [], bad


def test_readme_examples_run_as_written():
    """The README's ```python blocks, run in order in one namespace (as the README says), on the CPU."""
    blocks = [body for lang, body in FENCE.findall(_text(README)) if lang == "python"]
    assert len(blocks) >= 5
    ns: dict[str, Any] = {"__name__": "readme"}
    for i, body in enumerate(blocks):
        try:
            exec(compile(body, f"README.md python block {i + 1}", "exec"), ns)
        except Exception as e:
            raise AssertionError(f"README python block {i + 1} fails:\n{body}") from e
    assert ns["layer"].weight.main_grad.dtype == torch.float32 and ns["layer"].weight.grad is None
    assert float(ns["res"].found_inf) in (0.0, 1.0) and ns["res"].total_norm.dim() == 0


def _paragraphs(path: str) -> set[str]:
    text = FENCE.sub("", _text(path))
    return {" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if len(" ".join(p.split())) >= 160}


def test_no_long_paragraph_is_in_two_pages():
    """The walkthroughs and references moved out of the README; none is kept in two places."""
    paras = {p: _paragraphs(p) for p in PAGES}
    assert sum(map(len, paras.values())) > 50
    twice = [(_rel(a), _rel(b), sorted(paras[a] & paras[b])[0][:80])
             for a, b in itertools.combinations(PAGES, 2) if paras[a] & paras[b]]
    assert twice == [], twice


@pytest.mark.parametrize("page", ["docs/api.md", "docs/compare.md"])
def test_moved_pages_are_linked_from_the_readme(page):
    assert f"]({page})" in _text(README)
