"""The package's layers: a module imports from its own layer and the layers below it, never above.

The table is :data:`LAYERS` (docs/architecture.md shows it; each package's
docstring says its layer and what it may import).  An import counts wherever it is: at the top, inside a function (a
lazy import), or under ``if TYPE_CHECKING:``.  The package root
(``yieldproxy/__init__.py``, the public face) is above every layer, and any
module may take ``__version__`` from it, nothing else (a name taken through
the root would be a way up that no table shows).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "yieldproxy"

#: Lowest first: (what the layer is, the modules and packages in it).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core: names, text, clocks, callbacks, named states", ("names", "text", "clock", "periodic", "callbacks", "states")),
    ("servers: what each server is", ("servers",)),
    ("core: errors, config", ("errors", "config")),
    ("observe: metrics, history, the request log", ("observe",)),
    ("edge: HTTP/1.1 server and client, listeners", ("edge",)),
    ("lot: yield state, classes, parking, replay", ("lot",)),
    ("upstream: attempt, verdict, health, pool, fallback", ("upstream",)),
    ("watchers, and the scheduler: admission, the choice of member, release", ("watchers", "schedule")),
    ("proxy: the proxy listener's application", ("proxy",)),
    ("lifecycle: drain, holds store, sd_notify, limits, succession", ("lifecycle",)),
    ("admin: the admin API and the status page", ("admin",)),
    ("composition roots", ("service", "tap")),
    ("tools: cli, demo, sim, the broker library", ("tools",)),
)
#: At most this many modules at the top of the package (issue 27): the rest live in packages.
MAX_TOP_MODULES = 12


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__.py``)."""
    found = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def layer_of(name: str) -> int | None:
    """The index in :data:`LAYERS` of module ``name`` (dotted, ``yieldproxy.`` first); None: no layer."""
    rest = name.split(".")[1:]
    for index, (_, members) in enumerate(LAYERS):
        if rest and rest[0] in members:
            return index
    return None


def imports(name: str, is_package: bool, source: str, known: set[str]) -> list[tuple[int, str, tuple[str, ...]]]:
    """``(line, module, names)`` for each import of one of ``known`` in module ``name``'s ``source``.

    ``from .x import y`` counts as an import of ``.x.y`` when that is a module,
    else of ``.x`` (taking ``names``).
    """
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, ()) for alias in node.names if alias.name in known]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            rest = []
            for alias in node.names:
                if f"{target}.{alias.name}" in known:
                    found.append((node.lineno, f"{target}.{alias.name}", ()))
                else:
                    rest.append(alias.name)
            if rest and target in known:
                found.append((node.lineno, target, tuple(rest)))
    return found


def violations(name: str, is_package: bool, source: str, known: set[str]) -> list[str]:
    """What in module ``name`` breaks the layers: an import from a layer above, or through the root."""
    own = layer_of(name)
    problems = []
    for line, target, names in imports(name, is_package, source, known):
        if target == "yieldproxy":
            if name != "yieldproxy" and set(names) - {"__version__"}:
                problems.append(f"{name}:{line} takes {', '.join(names)} from the package root (only __version__)")
            continue
        theirs = layer_of(target)
        if name == "yieldproxy" or theirs is None or own is None:
            continue
        if theirs > own:
            problems.append(
                f"{name}:{line} imports {target}: layer {theirs} ({LAYERS[theirs][0]}) "
                f"is above its own, {own} ({LAYERS[own][0]})"
            )
    return problems


def test_every_module_has_a_layer():
    found = modules()
    assert "yieldproxy.lot.replay" in found and "yieldproxy.tools.sim.server" in found
    assert sorted(name for name in found if name != "yieldproxy" and layer_of(name) is None) == []
    named = [m for _, members in LAYERS for m in members]
    assert len(named) == len(set(named)), "a module or package in two layers"


def test_imports_go_down_the_layers_only():
    found = modules()
    known = set(found)
    problems = []
    for name, path in sorted(found.items()):
        problems += violations(name, path.name == "__init__.py", path.read_text(encoding="utf-8"), known)
    assert problems == []


def test_the_checker_sees_an_import_upward():
    """The checks above can fail: an import from a layer above is found, at the top, lazy or for the
    type checker alone, and so is a name taken through the package root; one from below is not."""
    known = {"yieldproxy", "yieldproxy.lot", "yieldproxy.lot.replay", "yieldproxy.upstream", "yieldproxy.upstream.pool",
             "yieldproxy.upstream.pool.routing", "yieldproxy.config", "yieldproxy.names", "yieldproxy.tools",
             "yieldproxy.tools.broker"}
    upward = "from ..upstream.pool.routing import make_members\n"
    lazy = "def f():\n    from ..upstream.pool import routing\n    return routing\n"
    typing = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import yieldproxy.upstream.pool.routing\n"
    through_root = "from .. import Admin, __version__\n"
    down = "from ..config import Config\nfrom ..names import CLASS_NAMES\nfrom .. import __version__\n"
    for source in (upward, lazy, typing):
        [problem] = violations("yieldproxy.lot.replay", False, source, known)
        assert "imports yieldproxy.upstream.pool.routing: layer 6" in problem and "its own, 5" in problem
    assert violations("yieldproxy.lot.replay", False, through_root, known) == [
        "yieldproxy.lot.replay:1 takes Admin, __version__ from the package root (only __version__)"
    ]
    assert violations("yieldproxy.lot.replay", False, down, known) == []
    # Within a layer, any way: the tools may import each other, and the root may import anything.
    assert violations("yieldproxy.tools.cli", False, "from .broker import Admin\n", known) == []
    assert violations("yieldproxy", True, "from .tools.broker import Admin\n", known) == []


def test_at_most_twelve_modules_at_the_top():
    top = sorted(path.name for path in ROOT.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top
