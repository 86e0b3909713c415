"""The library's layers hold: no import cycles, no imports hidden in functions, no private names
borrowed across modules. Parsed from the source (``ast``), so a violation fails here with its file
and line, whatever is imported at run time."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "ckptlib"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _imports(module: str) -> list[tuple[ast.stmt, str, list[str], bool]]:
    """(statement, imported ckptlib module, names taken from it, inside a function?) per import."""
    tree = ast.parse(MODULES[module].read_text())
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
            )
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.split(".")[0] == "ckptlib":
                        found.append((child, alias.name, [], in_function))
            elif isinstance(child, ast.ImportFrom):
                target = _resolve(module, child)
                if target.split(".")[0] == "ckptlib":
                    for alias in child.names:
                        submodule = f"{target}.{alias.name}"
                        if submodule in MODULES:  # `from ckptlib import rng`: the module
                            found.append((child, submodule, [], in_function))
                        else:
                            found.append((child, target, [alias.name], in_function))
            visit(child, inner)

    visit(tree, False)
    return found


def _line(module: str, lineno: int) -> str:
    return MODULES[module].read_text().splitlines()[lineno - 1]


def _edges() -> dict[str, set[str]]:
    """module -> the ckptlib modules it imports at import time (parents packages left out: importing
    ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first, which is not an edge of the graph)."""
    graph: dict[str, set[str]] = {}
    for module in MODULES:
        targets = set()
        for _, target, _, in_function in _imports(module):
            if (
                not in_function
                and target in MODULES
                and not module.startswith(target + ".")
                and target != module
            ):
                targets.add(target)
        graph[module] = targets
    return graph


def test_no_import_cycles():
    graph = _edges()
    cycles, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(path[path.index(target) :] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_ckptlib_imports_inside_functions():
    """A function-level import of a ckptlib module hides a cycle; heavy optional packages
    (matplotlib, ipywidgets, transformers, graphviz) may still be imported lazily, and so may a
    ckptlib module that is optional by design, said on the line (``# lazy import: <why>``)."""
    hidden = [
        f"{MODULES[module].relative_to(ROOT.parent)}:{statement.lineno} imports {target}"
        for module in MODULES
        for statement, target, _, in_function in _imports(module)
        if in_function and "# lazy import:" not in _line(module, statement.lineno)
    ]
    assert not hidden, "imports inside functions:\n" + "\n".join(hidden)


def test_no_private_names_borrowed_across_modules():
    borrowed = [
        f"{MODULES[module].relative_to(ROOT.parent)}:{statement.lineno} takes {name} from {target}"
        for module in MODULES
        for statement, target, names, _ in _imports(module)
        for name in names
        if name.startswith("_") and not name.startswith("__") and target != module
    ]
    assert not borrowed, "private names imported from another module:\n" + "\n".join(borrowed)


@pytest.mark.parametrize(
    "package",
    [
        "ckptlib.core",
        "ckptlib.graph",
        "ckptlib.inspect",
        "ckptlib.memory",
        "ckptlib.selective",
        "ckptlib.schedules",
        "ckptlib.widgets",
    ],
)
def test_packages_have_a_reading_order(package):
    """Each package's ``__init__`` docstring names its modules (where to start reading)."""
    doc = ast.get_docstring(ast.parse(MODULES[package].read_text())) or ""
    members = [
        m.rpartition(".")[2]
        for m in MODULES
        if m.startswith(package + ".") and m.count(".") == package.count(".") + 1
    ]
    missing = [m for m in members if not m.startswith("_") and m not in doc]
    assert not missing, f"{package}/__init__.py does not mention {missing}"
