"""The layering of ``dht/p2p``, read from the source with ``ast`` (nothing is imported or run).

What is checked, exactly:

1. No import cycle among the files of ``dht/p2p``. An edge A -> B is any import statement in
   A that names module B of the package: ``from .B import x``, ``from . import B``,
   ``import dht.p2p.B``, ``from dht.p2p.B import x``, ``from dht.p2p import B``, wherever the
   statement sits (module level, inside a function, under ``if TYPE_CHECKING:``). Importing a
   name from the package itself (``from . import x`` where x is not a module,
   ``from dht.p2p import x``) is an edge to ``__init__``, which is a node like any other.
2. ``host.py`` imports none of the protocols built on it: ``relay``, ``dcutr``, ``autonat``.
3. No module other than ``host.py`` touches a private attribute of a Host, where "private"
   means a name starting with one underscore and not a dunder (``_conns``, ``_open``...):
   a. no ``from .host import _x`` (or ``from dht.p2p.host import _x``);
   b. no ``X._y`` where X is a name called ``host``, an attribute called ``host``
      (``self.host._y``), or a function parameter annotated with ``Host`` (``Host``,
      ``"Host"``, ``Host | None``...);
   c. no ``X._y`` on any other object but ``self``/``cls`` where ``_y`` is one of the Host's
      own private names (its methods, class attributes and the ``self._y`` attributes it
      assigns) and not a private name of a class defined in the same module (``memory.py``
      has its own ``_listeners``), so that aliasing the Host under another name does not
      slip past (b).
"""

from __future__ import annotations

import ast
from pathlib import Path

P2P = Path(__file__).resolve().parents[2] / "dht" / "p2p"
PACKAGE = "dht.p2p"
PROTOCOLS = {"relay", "dcutr", "autonat"}


def _modules() -> dict[str, ast.Module]:
    return {
        path.stem: ast.parse(path.read_text(encoding="utf-8"), str(path))
        for path in sorted(P2P.glob("*.py"))
    }


def _imported_modules(tree: ast.Module, known: set[str]) -> set[str]:
    """The modules of the package that ``tree`` imports (see the docstring, point 1)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE + "."):
                    out.add(alias.name[len(PACKAGE) + 1 :].split(".")[0])
                elif alias.name == PACKAGE:
                    out.add("__init__")
        elif isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                out.add(node.module.split(".")[0])
            elif node.module and node.module.startswith(PACKAGE + "."):
                out.add(node.module[len(PACKAGE) + 1 :].split(".")[0])
            elif (node.level == 1 and not node.module) or node.module == PACKAGE:
                for alias in node.names:
                    out.add(alias.name if alias.name in known else "__init__")
    return out & known


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_names(tree: ast.Module, only: str | None = None) -> set[str]:
    """Private methods, class attributes and ``self._x`` attributes of the module's classes
    (of class ``only``, if given)."""
    names: set[str] = set()
    for cls in tree.body:
        if isinstance(cls, ast.ClassDef) and only in (None, cls.name):
            for item in ast.walk(cls):
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(item.name)
                elif isinstance(item, ast.Assign | ast.AnnAssign):
                    targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                    for target in targets:
                        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                            if target.value.id == "self":
                                names.add(target.attr)
                        elif isinstance(target, ast.Name) and item in cls.body:
                            names.add(target.id)  # class-level aliases (_best_connection = ...)
    return {name for name in names if _is_private(name)}


def _annotated_host(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return False
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return False
    return any(isinstance(n, ast.Name) and n.id == "Host" for n in ast.walk(annotation))


def _host_typed_params(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            args = node.args
            for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
                if _annotated_host(arg.annotation):
                    names.add(arg.arg)
    return names


def _private_host_accesses(name: str, tree: ast.Module, host_private: set[str]) -> list[str]:
    """Violations of point 3 in one module, as ``file:line text``."""
    found: list[str] = []
    typed = _host_typed_params(tree)
    host_private = host_private - _private_names(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            from_host = (node.level == 1 and node.module == "host") or (
                node.module == f"{PACKAGE}.host"
            )
            if from_host:
                for alias in node.names:
                    if _is_private(alias.name):
                        found.append(f"{name}.py:{node.lineno} imports {alias.name} from host")
        if not isinstance(node, ast.Attribute) or not _is_private(node.attr):
            continue
        base = node.value
        is_host = (isinstance(base, ast.Name) and (base.id == "host" or base.id in typed)) or (
            isinstance(base, ast.Attribute) and base.attr == "host"
        )
        is_self = isinstance(base, ast.Name) and base.id in ("self", "cls")
        if is_host or (not is_self and node.attr in host_private):
            found.append(f"{name}.py:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_import_cycle_in_dht_p2p():
    modules = _modules()
    known = set(modules)
    graph = {name: _imported_modules(tree, known) - {name} for name, tree in modules.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_host_does_not_import_the_protocols_built_on_it():
    modules = _modules()
    assert not _imported_modules(modules["host"], set(modules)) & PROTOCOLS


def test_only_host_py_touches_private_attributes_of_a_host():
    modules = _modules()
    host_private = _private_names(modules["host"], "Host")
    assert {"_conns", "_register", "_make_room", "_inbound_claims"} <= host_private  # sanity
    found = [
        violation
        for name, tree in modules.items()
        if name != "host"
        for violation in _private_host_accesses(name, tree, host_private)
    ]
    assert not found, "\n".join(found)


def test_the_checks_catch_what_they_are_meant_to():
    """The checker itself, on made-up code: a circle, a reach-in, a private import."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    code = ast.parse(
        "from .host import Host, _reason\n"
        "def f(h: 'Host | None', host, other):\n"
        "    h._x; host._y; self.host._z; other._conns; self._mine; other._fine\n"
    )
    found = _private_host_accesses("m", code, {"_conns"})
    assert [v.split(" ", 1)[1] for v in found] == [
        "imports _reason from host",
        "h._x",
        "host._y",
        "self.host._z",
        "other._conns",
    ]
