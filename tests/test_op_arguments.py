"""``mpkern::adamw_step_``'s argument order is written only where the flat schema is unpacked.

The dispatcher needs the flat schema (``mpkern/codecs.def``, ``MPKERN_OP_SCHEMA(adamw_step_, ...)``); the
code that unpacks it -- ``mpkern/_ops.py`` in Python (it builds ``mpkern.op_args.AdamwArgs``, reading the
argument names from the schema) and ``csrc/ops.cpp`` in C++ (the dispatcher's typedef ``AdamwStepOp``,
the C++ bundle ``AdamwArgs`` built from it, a call of the op from one) -- is the only code that knows the
order. Every backend takes the
named bundle and reads its fields by name, so a new op argument touches the schema, the bundle and the
kernels that use it, not every argument list in between.

**A spelling** of the order is a run of at least :data:`MIN_RUN` adjacent positional entries of one list in
the source whose names are arguments of the schema in the schema's order (each later in the schema than the
one before; arguments left out in between are allowed: ``params, exp_avgs, exp_avg_sqs, ...`` without
``grads`` is still the order). Positional: what binds by its place -- keyword arguments and keyword-only
parameters bind by name, in any order, and are not read. The lists, and the name of an entry:

* Python (``ast``): a ``def``'s or ``lambda``'s positional parameters; a call's positional arguments; a
  tuple, list or set display. An entry's name: a name (``lr``), an attribute's last part
  (``lists.params``), a string (``"lr"``), a subscript by a string (``group["eps"]``), and through a call
  of one argument (``list(params)``, ``float(lr)``) that argument's name; anything else (``*args``,
  ``x is None``, ``[]``) breaks the run.
* C++ (a tokenizer: comments dropped, strings kept whole; C++ has only positional arguments): every
  ``( )`` and ``[ ]`` group, every ``{ }`` group that is a braced initializer (no ``;`` at its top: not a
  block or a class body) and every ``#define`` body, split at its top-level commas (a ``;`` ends a run).
  An entry's name: its last identifier or string before a top-level ``=`` (``const at::Tensor&
  grad_factor``, ``b.params``, ``.seed = 1``), or, when it ends in a call of one argument
  (``py::arg("params")``, ``list_or_empty(exp_avg_scales)``), that argument's name.

Not lists: a class body's fields (a ``dataclass`` / ``NamedTuple``), a C++ ``struct``'s members and the
declarations of a C++ block (``const at::TensorList params = a.params, grads = a.grads;``): they name
things one by one, and are read by name -- a positional construction of them is a call or an initializer,
and counted. The sources read: :data:`PY_ROOTS` and every C++/CUDA file under ``csrc/``; the tests are the
op's callers (their own argument helpers in ``conftest.py``) and are not held to it. Allowed:
:data:`ALLOWED_PY`, :data:`ALLOWED_CPP`.
"""

from __future__ import annotations

import ast
import pathlib
import re
from collections.abc import Iterator, Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: a run of this many names of the schema, in its order, is a spelling
MIN_RUN = 6
#: the Python sources read (folders, recursively, and files)
PY_ROOTS = ("mpkern", "triton_kernels", "benchmarks", "tools", "scripts", "setup.py")
#: the Python files that may spell the order: the one unpacking of the flat schema
ALLOWED_PY = frozenset({"mpkern/_ops.py"})
#: the C++ files that may spell the order: the dispatcher's typedef of the schema and the unpacking into the
#: C++ bundle (ops.cpp). Edit here, with the reason, if another file must call the op flat.
ALLOWED_CPP = frozenset({"csrc/ops.cpp"})
CPP_SUFFIXES = (".h", ".hpp", ".cpp", ".cc", ".cu", ".cuh")


# ---- the schema -------------------------------------------------------------------------------------
def schema_arguments(def_text: str, op: str = "adamw_step_") -> list[str]:
    """The argument names of ``op``'s schema in a ``codecs.def`` text, in order."""
    m = re.search(r"MPKERN_OP_SCHEMA\(\s*" + re.escape(op) + r"\s*,((?:\s*\"(?:[^\"\\]|\\.)*\")+)\s*\)", def_text)
    assert m, f"no MPKERN_OP_SCHEMA({op}, ...) in codecs.def"
    schema = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', m.group(1)))
    inner = schema[schema.index("(") + 1:schema.rindex(") ->")]
    names = []
    for part in inner.split(", "):
        if part.strip() != "*":
            names.append(re.fullmatch(r".*?(\w+)(=.*)?", part.strip()).group(1))
    return names


SCHEMA = schema_arguments((ROOT / "mpkern" / "codecs.def").read_text(encoding="utf-8"))


def runs(names: Sequence[str | None], schema: Sequence[str] = SCHEMA, k: int = MIN_RUN) -> list[list[str]]:
    """The runs of at least ``k`` adjacent ``names`` that are ``schema`` arguments in its order."""
    pos = {n: i for i, n in enumerate(schema)}
    found: list[list[str]] = []
    cur: list[str] = []
    for n in [*names, None]:
        if n in pos and (not cur or pos[n] > pos[cur[-1]]):
            cur.append(n)
            continue
        if len(cur) >= k:
            found.append(cur)
        cur = [n] if n in pos else []
    return found


# ---- Python ---------------------------------------------------------------------------------------
def _py_name(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
        return node.slice.value
    if isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords:
        return _py_name(node.args[0])
    return None


def _py_lists(tree: ast.AST) -> Iterator[tuple[int, list[str | None]]]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            yield node.lineno, [x.arg for x in [*a.posonlyargs, *a.args]]
        elif isinstance(node, ast.Call):
            yield node.lineno, [_py_name(x) for x in node.args]
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            yield node.lineno, [_py_name(x) for x in node.elts]


def python_spellings(source: str) -> list[tuple[int, list[str]]]:
    """(line, names) of every spelling of the order in a Python source."""
    return [(line, r) for line, names in _py_lists(ast.parse(source)) for r in runs(names)]


# ---- C++ ------------------------------------------------------------------------------------------
_CPP_TOKEN = re.compile(r'"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'|[A-Za-z_]\w*|\d[\w.]*|::|->|\S')
_STRING, _CHAR = re.compile(r'"(?:[^"\\\n]|\\.)*"'), re.compile(r"'(?:[^'\\\n]|\\.)*'")
_OPEN, _CLOSE = "({[", ")}]"


def _cpp_text(source: str) -> tuple[str, list[str]]:
    """The source without comments and preprocessor lines (each replaced by its newlines), and the
    ``#define`` bodies."""
    out, i, n = [], 0, len(source)
    while i < n:
        c = source[i]
        if source.startswith("//", i):
            j = source.find("\n", i)
            i = n if j < 0 else j
        elif source.startswith("/*", i):
            j = source.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(" " + "\n" * source.count("\n", i, j))
            i = j
        elif c in "\"'":
            m = (_STRING if c == '"' else _CHAR).match(source, i)
            j = m.end() if m else i + 1
            out.append(source[i:j])
            i = j
        else:
            out.append(c)
            i += 1
    text = "".join(out)
    bodies = []
    for m in re.finditer(r"^[ \t]*#[ \t]*define[ \t]+\w+(\([^)]*\))?((?:\\\n|[^\n])*)", text, flags=re.M):
        bodies.append(m.group(2).replace("\\\n", " "))
    return re.sub(r"^[ \t]*#(?:\\\n|[^\n])*", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.M), bodies


def _cpp_groups(tokens: list[tuple[int, str]]) -> Iterator[tuple[int, list[list]]]:
    """(line, entries) of every bracket group that is a list; an entry is a list of tokens and nested
    groups, a ``;`` an empty entry (a break). A ``{ }`` group with a ``;`` at its top is a block or a
    class body -- statements, whose declarations name things rather than list them -- and no list."""
    stack: list[tuple[int, str, list[list]]] = [(1, "", [[]])]
    for line, tok in tokens:
        if tok in _OPEN:
            stack.append((line, tok, [[]]))
        elif tok in _CLOSE and len(stack) > 1:
            gline, opener, entries = stack.pop()
            if not (opener == "{" and [] in entries[:-1]):
                yield gline, entries
            stack[-1][2][-1].append(entries)
        elif tok == ",":
            stack[-1][2].append([])
        elif tok == ";":
            stack[-1][2].extend([[], []])
        else:
            stack[-1][2][-1].append(tok)
    while len(stack) > 1:  # unbalanced: report what is open
        gline, _, entries = stack.pop()
        yield gline, entries


def _cpp_name(entry: list) -> str | None:
    if "=" in entry:
        entry = entry[:entry.index("=")]
    if not entry:
        return None
    last = entry[-1]
    if isinstance(last, list):  # a call / cast / construction of one argument: that argument's name
        if len(entry) >= 2 and isinstance(entry[-2], str) and re.fullmatch(r"\w+|>", entry[-2]) and len(last) == 1:
            return _cpp_name(last[0])
        return None
    if last.startswith('"'):
        return last[1:-1]
    return last if re.fullmatch(r"[A-Za-z_]\w*", last) else None


def _tokens(text: str, first_line: int = 1) -> list[tuple[int, str]]:
    out, line, pos = [], first_line, 0
    for m in _CPP_TOKEN.finditer(text):
        line += text.count("\n", pos, m.start())
        pos = m.start()
        out.append((line, m.group(0)))
    return out


def cpp_spellings(source: str) -> list[tuple[int, list[str]]]:
    """(line, names) of every spelling of the order in a C++/CUDA source (``#define`` bodies: line 0)."""
    text, bodies = _cpp_text(source)
    found = []
    for line, entries in _cpp_groups(_tokens(text)):
        found += [(line, r) for r in runs([_cpp_name(e) for e in entries])]
    for body in bodies:
        for _, entries in _cpp_groups(_tokens("(" + body + ")", 0)):
            found += [(0, r) for r in runs([_cpp_name(e) for e in entries])]
    return found


# ---- the tree -------------------------------------------------------------------------------------
def python_files(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    files: list[pathlib.Path] = []
    for name in PY_ROOTS:
        p = root / name
        files += [p] if p.is_file() else sorted(f for f in p.rglob("*.py") if "__pycache__" not in f.parts)
    return files


def cpp_files(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    return sorted(f for f in (root / "csrc").rglob("*") if f.suffix in CPP_SUFFIXES)


def _report(found: dict[str, list[tuple[int, list[str]]]]) -> str:
    return "\n".join(f"{path}:{line}: {len(r)} arguments in the schema's order: {', '.join(r)}"
                     for path, spellings in found.items() for line, r in spellings)


def _outside(files: list[pathlib.Path], allowed: frozenset[str], spellings) -> dict[str, list]:
    found = {}
    for f in files:
        rel = f.relative_to(ROOT).as_posix()
        if rel not in allowed:
            s = spellings(f.read_text(encoding="utf-8"))
            if s:
                found[rel] = s
    return found


# ---- the tests -------------------------------------------------------------------------------------
def test_the_schema_is_read():
    assert len(SCHEMA) == 24 and SCHEMA[0] == "params" and SCHEMA[-1] == "elem_offsets", SCHEMA
    assert len(set(SCHEMA)) == len(SCHEMA)


def test_python_spells_the_order_only_where_it_unpacks_the_schema():
    files = python_files()
    assert any(f.name == "_ops.py" for f in files) and len(files) > 30, files  # the tree was found
    found = _outside(files, ALLOWED_PY, python_spellings)
    assert not found, ("the op's argument order spelled outside " + ", ".join(sorted(ALLOWED_PY)) + " (take the "
                       "bundle, mpkern.op_args.AdamwArgs, and read its fields by name):\n" + _report(found))


def test_cpp_spells_the_order_only_where_it_unpacks_the_schema():
    files = cpp_files()
    assert any(f.name == "ops.cpp" for f in files), files
    found = _outside(files, ALLOWED_CPP, cpp_spellings)
    assert not found, ("the op's argument order spelled outside " + ", ".join(sorted(ALLOWED_CPP)) + " (take the "
                       "C++ bundle and read its fields by name):\n" + _report(found))


def test_the_allowed_files_exist():
    for rel in (*ALLOWED_PY, *ALLOWED_CPP):
        assert (ROOT / rel).is_file(), rel


def test_the_bundle_has_the_schemas_arguments():
    """The Python bundle's fields are the schema's arguments, and _ops reads the same names."""
    import dataclasses

    from mpkern import _ops, op_args

    assert {f.name for f in dataclasses.fields(op_args.AdamwArgs)} == set(SCHEMA)
    assert list(_ops.ADAMW_ARGUMENTS) == SCHEMA


def test_a_spelling_is_found():
    """The checks find a spelling -- a kernel's parameter list, a forwarding call, a subset in order, values
    converted on the way, a tuple of names, a C++ signature, field accesses, a #define, pybind's argument
    names -- and leave other lists alone (the bundle, keywords, fewer names, comments, a struct)."""
    py = '''
def kernel(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, steps, grad_factor, *, lr):
    backend(lists.params, lists.grads, lists.exp_avgs, lists.exp_avg_sqs, lists.max_exp_avg_sqs, lists.masters)
    cache(params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, steps)          # grads left out: still in order
    f(x, lr, beta1, beta2, eps, weight_decay, maximize, seed=1)
    g(float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), maximize)
    names = ("lr", "beta1", "beta2", "eps", "weight_decay", "maximize")
    fine(args)                                                                     # the bundle
    fine(x, lr=lr, beta1=b1, beta2=b2, eps=e, weight_decay=wd, maximize=False)      # keywords bind by name
    def fine_too(x, *, lr, beta1, beta2, eps, weight_decay, maximize): ...          # keyword-only parameters
    fine(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs)                    # 5: below MIN_RUN
    fine(grads, params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, steps)    # out of order: a run of 6
'''
    found = python_spellings(py)
    lines = sorted(line for line, _ in found)
    assert lines == [2, 3, 4, 5, 6, 7, 12], found
    assert found[[line for line, _ in found].index(2)][1][:2] == ["params", "grads"]
    cpp = r'''
// void commented(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, ...)
void kernel(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
            at::TensorList max_exp_avg_sqs, at::TensorList masters, at::TensorList steps, double lr);
void call() { op(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, b.max_exp_avg_sqs, b.masters, x); }
#define ARGS double lr, double beta1, double beta2, \
             double eps, double weight_decay, bool maximize
m.def("adamw", &f, py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
      py::arg("maximize"));
struct Args { at::TensorList params; at::TensorList grads; at::TensorList exp_avgs; at::TensorList exp_avg_sqs;
              at::TensorList max_exp_avg_sqs; at::TensorList masters; };
void fine(const Args& a) { run(a); }
struct Lists { std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters; };
void unpack(const Args& a) { const at::TensorList params = a.params, grads = a.grads, exp_avgs = a.exp_avgs;
                             const at::TensorList exp_avg_sqs = a.exp_avg_sqs, max_exp_avg_sqs = a.max_exp_avg_sqs,
                                                  masters = a.masters; }
Args b{p, g, m, v, vm, w};
Args c{params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters};
'''
    found = cpp_spellings(cpp)
    assert sorted(line for line, _ in found) == [0, 3, 5, 8, 18], found
    assert not cpp_spellings("void f(at::TensorList params, Args a); /* params, grads, exp_avgs, exp_avg_sqs, "
                             "max_exp_avg_sqs, masters */")
