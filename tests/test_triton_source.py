"""A rule of the Triton kernels' source, kept by a test: no unary minus on a value in a ``@triton.jit``
function. Triton 3.6 (the GPU machine's, and the CI's torch 2.11 run) lowers ``-x`` to ``0 - x``, which
keeps a NaN's sign and gives +0 for -(+0) where a negation gives -0; Triton 3.8 lowers it to a negation.
The kernels negate with ``_common.neg_f32`` (a sign-bit flip), the same bits on every Triton; a constant
(``-1``) is folded and allowed.
"""

from __future__ import annotations

import ast
import os
import pathlib
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def unary_minus_in_jit(source: str) -> list[tuple[int, str]]:
    """(line, expression) of every unary minus on a non-constant inside a function decorated with
    something named ``jit``."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef):
            continue
        if not any("jit" in ast.unparse(d) for d in fn.decorator_list):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) \
                    and not isinstance(node.operand, ast.Constant):
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_triton_kernels_negate_by_the_sign_bit():
    files = sorted(pathlib.Path(ROOT, "triton_kernels").glob("*.py"))
    assert len(files) >= 5, files  # the kernels' folder was found
    bad = [f"{f.relative_to(ROOT)}:{line}: {expr} (use neg_f32)"
           for f in files for line, expr in unary_minus_in_jit(f.read_text(encoding="utf-8"))]
    assert not bad, "\n".join(bad)


def test_the_check_sees_a_unary_minus():
    src = textwrap.dedent("""
        import triton

        @triton.jit
        def k(x, y):
            a = -x
            b = -1.0 * y
            return tl.fma(a, b, -(x * y))

        def host(x):
            return -x
        """)
    assert unary_minus_in_jit(src) == [(6, "-x"), (8, "-(x * y)")]
