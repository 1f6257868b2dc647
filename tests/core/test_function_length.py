"""No function of the product (``coldsnap_core``, ``coldsnap_vllm``, ``coldsnap_sglang``) is longer than
:data:`MAX_LINES` lines (its ``def`` line to its last line, docstring included) unless it is listed in
:data:`LONG_FUNCTIONS` and its docstring says why it is long.

A long function usually holds several jobs; splitting it is the fix. The few listed here keep one job whose
steps read best in one place, and say so in a docstring paragraph that starts with ``Long:``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import coldsnap_core

PACKAGE_DIR = Path(coldsnap_core.__file__).parent
PACKAGES = (PACKAGE_DIR, PACKAGE_DIR.parent / "coldsnap_vllm", PACKAGE_DIR.parent / "coldsnap_sglang")
"""The product's packages (the engine plugins are read from their source: neither engine is imported)."""
MAX_LINES = 80

LONG_FUNCTIONS: frozenset[str] = frozenset()
"""``module.qualified_name`` (module relative to ``coldsnap_core``; ``coldsnap_vllm.`` or ``coldsnap_sglang.`` and the
module in an engine plugin) of each function allowed over :data:`MAX_LINES`."""


def _functions() -> dict[str, tuple[int, str | None]]:
    """``module.qualified_name`` -> (lines, docstring) of every function and method in :data:`PACKAGES`."""
    found: dict[str, tuple[int, str | None]] = {}
    paths = [(path, PACKAGE_DIR) for path in sorted(PACKAGE_DIR.rglob("*.py"))]
    paths += [(path, package.parent) for package in PACKAGES[1:] for path in sorted(package.rglob("*.py"))]
    for path, base in paths:
        parts = path.relative_to(base).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

        def visit(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = f"{prefix}{child.name}"
                    start = child.decorator_list[0].lineno if child.decorator_list else child.lineno
                    found[name] = (child.end_lineno - start + 1, ast.get_docstring(child))  # type: ignore[operator]
                    visit(child, f"{name}.")
                elif isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.")

        visit(ast.parse(path.read_text(encoding="utf-8")), f"{module}." if module else "")
    return found


def test_no_function_is_longer_than_the_limit_unless_listed() -> None:
    """Fails naming each function over :data:`MAX_LINES` lines that :data:`LONG_FUNCTIONS` does not list (a
    function grown past the limit, or a new long one)."""
    functions = _functions()
    too_long = sorted(
        f"{name}: {lines} lines" for name, (lines, _) in functions.items() if lines > MAX_LINES and name not in LONG_FUNCTIONS
    )
    assert too_long == []


def test_each_listed_long_function_says_why_and_is_still_long() -> None:
    """Fails naming each listed function whose docstring has no ``Long:`` paragraph, that no longer exists, or
    that is now within the limit (so the list cannot go stale and hide the next one)."""
    functions = _functions()
    wrong = []
    for name in sorted(LONG_FUNCTIONS):
        if name not in functions:
            wrong.append(f"{name}: no such function")
            continue
        lines, doc = functions[name]
        if "\nLong: " not in f"\n{doc or ''}":
            wrong.append(f"{name}: its docstring has no 'Long:' paragraph saying why")
        if lines <= MAX_LINES:
            wrong.append(f"{name}: {lines} lines, within the limit; remove it from LONG_FUNCTIONS")
    assert wrong == []
