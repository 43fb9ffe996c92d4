"""A class's source text, as `inspect.getsource` gives it, with each file parsed once.

The fingerprint's code digest is the source of every class of the model's module tree,
base classes included: for a Hugging Face model that is ~25 classes from a few large files
(`transformers.modeling_utils` alone is ~5,000 lines). `inspect.getsource` (Python 3.11 and
3.12) parses the class's whole file again for every class it is asked for, which made the
fingerprint of a GPT-2 ~0.5 s of a new machine's `torch.compile` call. Here the file is
parsed once and the first line of every class in it kept; the block is then cut exactly as
`inspect` cuts it (`inspect.getblock`), so the digest, and every key made before, stay the
same. Python 3.13 finds a class by its `__firstlineno__` without parsing: there `inspect`
is used as it is.
"""

from __future__ import annotations

import ast
import inspect
import linecache
import sys
import threading

_INDEX: dict[str, tuple[list[str], dict[str, int]]] = {}
_LOCK = threading.Lock()


def class_source(cls: type) -> str | None:
    """`inspect.getsource(cls)`, or None where this cannot tell (the caller asks `inspect`)."""
    if sys.version_info >= (3, 13):
        return None
    try:
        filename = inspect.getsourcefile(cls)
    except TypeError:
        return None
    if not filename:
        return None
    linecache.checkcache(filename)
    module = inspect.getmodule(cls, filename)
    lines = linecache.getlines(filename, module.__dict__) if module else \
        linecache.getlines(filename)
    if not lines:
        return None
    first = _first_lines(filename, lines).get(cls.__qualname__)
    if first is None:
        return None
    return "".join(inspect.getblock(lines[first:]))


def _first_lines(filename: str, lines: list[str]) -> dict[str, int]:
    """Qualified name -> 0-based first line (its first decorator's) of each class in the
    file, the first definition of a name winning, in the order `inspect`'s class finder
    walks the tree (functions' classes under `<locals>`). Kept while linecache keeps the
    same lines."""
    with _LOCK:
        cached = _INDEX.get(filename)
        if cached is not None and cached[0] is lines:
            return cached[1]
    starts: dict[str, int] = {}

    def walk(node: ast.AST, scope: tuple[str, ...]) -> None:
        for child in _statements(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                walk(child, (*scope, child.name, "<locals>"))
            elif isinstance(child, ast.ClassDef):
                name = ".".join((*scope, child.name))
                first = child.decorator_list[0].lineno if child.decorator_list \
                    else child.lineno
                starts.setdefault(name, first - 1)
                walk(child, (*scope, child.name))
            else:
                walk(child, scope)

    walk(ast.parse("".join(lines)), ())
    with _LOCK:
        _INDEX[filename] = (lines, starts)
    return starts


def _statements(node: ast.AST) -> list[ast.AST]:
    """The statements (and handlers, match cases) directly under `node`, in the order of its
    fields: a class is a statement, so expressions need no walk."""
    out: list[ast.AST] = []
    for _, value in ast.iter_fields(node):
        if isinstance(value, list):
            out += [v for v in value
                    if isinstance(v, (ast.stmt, ast.excepthandler, ast.match_case))]
    return out
