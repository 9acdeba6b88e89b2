"""yieldproxy uses Twisted's public API only: no private name of Twisted anywhere in ``yieldproxy/``.

Twisted's compatibility policy lets any name with a leading underscore change
in any release, and such a change switches a protection off silently (an
override never called again, an attribute read with a default).  So this
reads every module of the package and fails, naming file and line, on:

* a ``_name`` imported from a ``twisted`` module;
* a ``_name`` attribute read or written on anything but ``self``/``cls`` that
  no yieldproxy module defines (then it can only be someone else's: Twisted's,
  or a library's);
* a method or attribute ``_name`` defined in a class that derives from a
  Twisted class which has that name too (an override of a private hook).

The floor of ``twisted`` in setup.cfg rests on this (CI runs the edge and
hostile-input tests on the floor and on the newest release).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import yieldproxy

PACKAGE = Path(yieldproxy.__file__).parent


def _modules() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text(), str(path))) for path in sorted(PACKAGE.rglob("*.py"))]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_names(trees: list[tuple[Path, ast.Module]]) -> set[str]:
    """Every private name a yieldproxy module defines: functions, classes, attributes set, slots, fields."""
    names: set[str] = set()
    for _path, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif (
                isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets)
                and isinstance(node.value, (ast.Tuple, ast.List))
            ):
                names.update(e.value for e in node.value.elts if isinstance(e, ast.Constant))
    return {n for n in names if _private(n)}


def test_no_private_name_is_imported_from_twisted():
    found = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "twisted":
                if any(part.startswith("_") for part in (node.module or "").split(".")):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: from {node.module}")
                found += [
                    f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {alias.name} from {node.module}"
                    for alias in node.names
                    if _private(alias.name)
                ]
    assert not found, "private Twisted names imported:\n" + "\n".join(found)


def test_no_foreign_private_attribute_is_read_or_written():
    trees = _modules()
    ours = _defined_names(trees)
    found = []
    for path, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                base = node.value
                if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                    continue
                if node.attr not in ours:
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: .{node.attr}")
            elif (
                isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                and _private(node.args[1].value)
                and not (isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls"))
            ):
                # getattr(x, "_name"): only for names of our own.
                name = node.args[1].value
                if name not in ours:
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.func.id}(..., {name!r})")
    assert not found, "private attributes of other packages used:\n" + "\n".join(found)


def _twisted_bases(cls: type) -> list[type]:
    return [base for base in cls.__mro__[1:] if base.__module__.split(".")[0] == "twisted"]


def test_no_private_twisted_method_or_attribute_is_overridden():
    found = []
    for path, tree in _modules():
        module_name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if module_name.endswith(".__init__"):
            module_name = module_name[: -len(".__init__")]
        classes = [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
        if not classes:
            continue
        module = importlib.import_module(module_name)
        for node in classes:
            cls = getattr(module, node.name, None)
            if not isinstance(cls, type):
                continue
            bases = _twisted_bases(cls)
            if not bases:
                continue
            for name, value in vars(cls).items():
                if not _private(name) or name.startswith(f"_{cls.__name__}__"):
                    continue
                if any(name in vars(base) for base in bases):
                    found.append(f"{module_name}.{cls.__name__}.{name} overrides {bases[0].__module__}")
    assert not found, "private Twisted names overridden:\n" + "\n".join(found)


def test_the_checks_see_a_private_name_when_there_is_one():
    """The checks above can fail: each finds the kind of use it exists for in a module written to have it."""
    source = (
        "from twisted.web.http import _ChunkedTransferDecoder\n"
        "def f(request):\n"
        "    return request._disconnected\n"
    )
    tree = ast.parse(source)
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names if _private(a.name)]
    assert imported == ["_ChunkedTransferDecoder"]
    ours = _defined_names(_modules())
    attributes = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and _private(n.attr)]
    assert attributes == ["_disconnected"] and "_disconnected" not in ours
