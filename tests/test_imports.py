"""
The package's modules import each other without cycles.

A cycle (cli imports demo, demo imports cli) means neither module can be read,
tested or changed alone; it also hides behind function-level imports and
behind imports only a type checker runs (``if TYPE_CHECKING:``), so those
count here too (issue 17).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "yieldproxy"


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports, wherever in the module, ``if TYPE_CHECKING:`` included."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # "from . import x" imports the submodule x, not the package's own code.
            candidates = ([target] if node.module else []) + [f"{target}.{a.name}" for a in node.names]
        else:
            continue
        out.update(c for c in candidates if c in modules and c != name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    modules = _modules()
    assert "yieldproxy.tools.cli" in modules and "yieldproxy.tools.sim.server" in modules
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert "yieldproxy.tools.broker" in graph["yieldproxy.tools.demo"]
    assert _cycles(graph) == []


def _outside_imports(path: Path) -> set[str]:
    """Every module outside the package that the file imports, wherever in it (``a.b.c`` also counts as ``a.b``
    and ``a``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            parts = name.split(".")
            out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return out


#: Each HTTP client library the package uses, and the one module that may import it (docs/architecture.md, "The
#: card's packages"): the admin API has one client, the broker library; treq and Twisted's Agent are the demo's
#: client of the proxy.  The proxy's own calls to its upstreams (the hop, the control plane) go through its lean
#: edge/h1client.py, which imports none of them.
HTTP_CLIENTS = {
    "treq": ["yieldproxy.tools.demo"],
    "twisted.web.client": ["yieldproxy.tools.demo"],
    "urllib.request": ["yieldproxy.tools.broker"],
    "http.client": ["yieldproxy.tools.broker"],
}


def test_one_admin_client_and_each_http_client_library_in_one_place() -> None:
    """A second client of the admin API (over treq, Twisted's Agent or urllib), or the proxy's upstream calls on a
    general client, would import one of these libraries somewhere else."""
    modules = _modules()
    imported = {name: _outside_imports(path) for name, path in modules.items()}
    found = {library: sorted(name for name, names in imported.items() if library in names) for library in HTTP_CLIENTS}
    assert found == HTTP_CLIENTS
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert {"yieldproxy.tools.cli", "yieldproxy.tools.demo"} <= {n for n, g in graph.items() if "yieldproxy.tools.broker" in g}


def test_type_checking_imports_count(tmp_path: Path) -> None:
    """An import a type checker alone runs is still a dependency: it is in the graph."""
    path = tmp_path / "a.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n", encoding="utf-8")
    assert _imports("pkg.a", path, {"pkg.a": path, "pkg.b": tmp_path / "b.py"}) == {"pkg.b"}


#: The modules that may use the global reactor: the twistd plugin's service maker.  Every
#: other part takes the reactor (or a test's clock) as an argument (issue 11).
GLOBAL_REACTOR_USERS = {"yieldproxy.tap"}


def _imports_global_reactor(path: Path) -> bool:
    """Whether ``path`` imports ``twisted.internet.reactor``, anywhere in the module."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module == "twisted.internet":
            if any(alias.name == "reactor" for alias in node.names):
                return True
        if isinstance(node, ast.Import) and any(alias.name == "twisted.internet.reactor" for alias in node.names):
            return True
    return False


def test_only_the_plugin_imports_the_global_reactor() -> None:
    users = {name for name, path in _modules().items() if _imports_global_reactor(path)}
    assert users == GLOBAL_REACTOR_USERS
