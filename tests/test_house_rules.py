"""The code's size rules, read from the source with ``ast`` (nothing is imported or run).

1. No module of ``moshpit/``, ``dht/`` or ``compression/`` over ``MAX_FILE_LINES`` lines
   unless its module docstring says why ("... lines"), and no function over
   ``MAX_FUNCTION_LINES`` unless its docstring says why. The ones that break the rule today
   are listed below with their size when they were listed: the list may only shrink (a listed
   one that grows fails, and so does one that has come under the limit and is still listed,
   so that the entry goes). An entry is raised only with its reason beside it.
2. No import cycle among the modules of ``moshpit/cli`` (each command's module is read by
   itself; shared helpers live in their own small modules).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("moshpit", "dht", "compression")
MAX_FILE_LINES = 900
MAX_FUNCTION_LINES = 80
SAYS_WHY = re.compile(r"\blines\b")  # a docstring that talks about its own length

# path -> lines when listed (none today). To split, not to grow; an entry needs its reason.
LONG_FILES: dict[str, int] = {}
# "path:function" -> lines when listed (constructors taking many options, argument parsers, a
# CLI's reporting steps). To split, not to grow.
LONG_FUNCTIONS: dict[str, int] = {}


def _sources() -> dict[str, ast.Module]:
    return {
        path.relative_to(ROOT).as_posix(): ast.parse(path.read_text(encoding="utf-8"), str(path))
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
    }


def _check(found: dict[str, int], listed: dict[str, int], limit: int, what: str) -> list[str]:
    problems = []
    for name, lines in sorted(found.items()):
        if name not in listed:
            problems.append(
                f"{name}: {what} of {lines} lines (limit {limit}): split it, or say why in its docstring"
            )
        elif lines > listed[name]:
            problems.append(
                f"{name}: grew from {listed[name]} to {lines} lines (listed to shrink, not grow)"
            )
    for name in sorted(set(listed) - set(found)):
        problems.append(f"{name}: no longer over {limit} lines (or gone): remove it from the list")
    return problems


def test_no_long_module_or_function_without_a_reason() -> None:
    long_files: dict[str, int] = {}
    long_functions: dict[str, int] = {}
    for path, tree in _sources().items():
        lines = max((getattr(node, "end_lineno", 0) or 0) for node in ast.walk(tree))
        if lines > MAX_FILE_LINES and not SAYS_WHY.search(ast.get_docstring(tree) or ""):
            long_files[path] = lines
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > MAX_FUNCTION_LINES and not SAYS_WHY.search(ast.get_docstring(node) or ""):
                    name = f"{path}:{node.name}"
                    long_functions[name] = max(size, long_functions.get(name, 0))
    problems = _check(long_files, LONG_FILES, MAX_FILE_LINES, "module")
    problems += _check(long_functions, LONG_FUNCTIONS, MAX_FUNCTION_LINES, "function")
    assert not problems, "\n".join(problems)


def _cli_imports(tree: ast.Module, modules: set[str]) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "moshpit.cli":
                out |= {alias.name for alias in node.names} & modules
            elif node.module.startswith("moshpit.cli."):
                out.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("moshpit.cli."):
                    out.add(alias.name.split(".")[2])
    return out & modules


def test_the_cli_modules_import_each_other_without_a_cycle() -> None:
    trees = {
        path.stem: ast.parse(path.read_text(encoding="utf-8"))
        for path in sorted((ROOT / "moshpit" / "cli").glob("*.py"))
        if path.stem != "__init__"  # the dispatcher imports every command
    }
    graph = {name: _cli_imports(tree, set(trees)) - {name} for name, tree in trees.items()}
    # every module reachable from each one must not reach back
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            name = todo.pop()
            assert name != start, f"import cycle through moshpit/cli/{start}.py"
            if name not in seen:
                seen.add(name)
                todo.extend(graph[name])
