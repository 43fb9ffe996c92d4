"""Reading a package's imports, for the layer tests of the server and the client."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, *, top_level_only: bool) -> set[str]:
    """Absolute names `path` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    package = module_name(path, path.parents[len(path.relative_to(ROOT).parts) - 2])
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            found |= {f"{base}.{a.name}" for a in node.names}
    return found


def import_cycles(package: Path) -> list[str]:
    """Cycles among `package`'s modules through their import-time (top-level) imports."""
    modules = {module_name(p, package): p for p in package.rglob("*.py")}
    graph = {m: {n for n in (_owner(i, modules) for i in imports(p, top_level_only=True))
                 if n is not None and n != m}
             for m, p in modules.items()}
    cycles: list[str] = []
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(" -> ".join([*stack[stack.index(n):], n]))
            elif n not in state:
                visit(n, [*stack, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return cycles


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The server module an imported name lives in (`a.b.C` -> `a.b`), if any."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None
