"""What the prose cites exists: no path or Python name of ours that has gone.

The pages (``README.md``, ``docs/*.md``, ``bench/README.md``) and the package's
prose (every docstring and comment under ``yieldproxy/``) cite files
(``yieldproxy/upstream/verdict.py``, ``tests/test_docs.py::test_metric_found``,
``yieldproxy/edge/reader.py:120``) and names (``upstream.verdict.verdict``,
``UpstreamHealth.judge``, ``:class:`~yieldproxy.lot.parking.ParkingLot```).  A rename
leaves them behind in silence; here it fails.

A citation is ours when its path starts with one of :data:`OUR_DIRS`, or its
first dotted part is ``yieldproxy``, a module of the package (by its name, as
``verdict`` or ``lot.parking``), a module that has left it
(:data:`GONE_MODULES`), or a class of the package.  Everything else (Ollama's
``server/routes.go``, Twisted's ``_newclient.py``, a config key such as
``proxy.upstream``) is someone else's and is not looked at.  Names are resolved
by reading the source, not by importing it: a module's names, a class's
methods, class attributes, fields and ``self.x`` assignments, through its bases
in the package.

:data:`ALLOWED` lists the rotten citations in files this check may not fix
yet, each with the file it waits on; an entry that no longer rots fails too.
"""

from __future__ import annotations

import ast
import builtins
import functools
import io
import re
import tokenize
from pathlib import Path
from typing import Iterator

import attrs
import pytest

from test_docs import config_keys

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "yieldproxy"
PAGES = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", *(ROOT / "docs").glob("*.md")])

#: Top-level directories of this repository: a path under one of them is ours.
OUR_DIRS = ("yieldproxy", "tests", "docs", "etc", "bench", ".ci", "scripts", "tools", "twisted_plugins")
#: Modules that have left the package: a name cited through one of them has rotted.  (Only names no one
#: else uses as a word or a variable; ``client`` or ``routes`` would catch other projects' citations.)
GONE_MODULES = frozenset({"adminclient", "forward", "httpserver", "ollama_errors", "proxyresource", "translate"})
#: File name endings: ``errors.py`` is a file, not the name ``py`` of module ``errors``.
EXTENSIONS = frozenset(
    "py md toml cfg ini txt go c cc cpp h hpp rs js css html json yaml yml sh service pid log lock socket "
    "sock in gz whl conf".split()
)

#: ``(where, citation)``: rotten citations in files someone else is changing now, to fix when they are merged.
#: Each says which file it waits on (a TODO for the lead).
ALLOWED: frozenset[tuple[str, str]] = frozenset({
})


# -- the index of what exists ---------------------------------------------------------------------------------


@attrs.frozen
class ClassInfo:
    """One class of the package: the names it defines, and its bases by the names the source uses."""

    names: frozenset[str]
    bases: tuple[str, ...]


@attrs.frozen
class ModuleInfo:
    """One module of the package: its top-level names (imports too) and its classes."""

    names: frozenset[str]
    imported: frozenset[str]
    classes: dict[str, ClassInfo]


def _targets(node: ast.AST) -> Iterator[str]:
    """The names an assignment target binds (``a``, ``a, b``, ``self.a`` gives nothing here)."""
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, (ast.Tuple, ast.List)):
        for element in node.elts:
            yield from _targets(element)


def _class_info(node: ast.ClassDef) -> ClassInfo:
    names: set[str] = set()
    for statement in node.body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(statement.name)
        elif isinstance(statement, ast.Assign):
            for target in statement.targets:
                names.update(_targets(target))
        elif isinstance(statement, ast.AnnAssign):
            names.update(_targets(statement.target))
    for sub in ast.walk(node):  # self.x = ..., self.x: T = ..., wherever in a method
        if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
            if isinstance(sub.value, ast.Name) and sub.value.id in ("self", "cls"):
                names.add(sub.attr)
    bases = tuple(ast.unparse(base).rpartition(".")[2] for base in node.bases)
    return ClassInfo(frozenset(names), bases)


def _public_names(tree: ast.Module) -> set[str]:
    """The strings of ``__all__``, and the keys of a table it spreads (the root's names loaded on first use)."""
    tables = {
        target.id: node.value for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Name)
    }
    found: set[str] = set()
    listed = tables.get("__all__")
    for element in listed.elts if isinstance(listed, (ast.List, ast.Tuple)) else []:
        if isinstance(element, ast.Constant) and isinstance(element.value, str):
            found.add(element.value)
        elif isinstance(element, ast.Starred) and isinstance(element.value, ast.Name):
            table = tables.get(element.value.id)
            if isinstance(table, ast.Dict):
                found.update(k.value for k in table.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
    return found


def _module_info(path: Path) -> ModuleInfo:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    imported: set[str] = set()
    classes: dict[str, ClassInfo] = {}
    for node in ast.walk(tree):  # top level, and under if/try (TYPE_CHECKING, fallbacks)
        if isinstance(node, ast.ClassDef):
            classes.setdefault(node.name, _class_info(node))
    for node in tree.body:
        for statement in [node, *ast.walk(node)] if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(statement.name)
            elif isinstance(statement, ast.Assign):
                for target in statement.targets:
                    names.update(_targets(target))
            elif isinstance(statement, (ast.AnnAssign, ast.AugAssign)):
                names.update(_targets(statement.target))
            elif isinstance(statement, (ast.Import, ast.ImportFrom)):
                for alias in statement.names:
                    imported.add(alias.asname or alias.name.partition(".")[0])
    names.update(_public_names(tree))
    return ModuleInfo(frozenset(names), frozenset(imported), classes)


@functools.lru_cache(maxsize=1)
def index() -> dict[str, ModuleInfo]:
    """Every module of the package by dotted name (``yieldproxy.lot.parking``; a package by its ``__init__``)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = _module_info(path)
    return found


@functools.lru_cache(maxsize=1)
def classes() -> dict[str, list[ClassInfo]]:
    """Every class of the package by its name (several modules may each have one of a name)."""
    found: dict[str, list[ClassInfo]] = {}
    for module in index().values():
        for name, info in module.classes.items():
            found.setdefault(name, []).append(info)
    return found


def _class_has(info: ClassInfo, name: str, seen: frozenset[int] = frozenset()) -> bool:
    """Whether a class has ``name``: its own, or a base's; a base from outside the package may have anything."""
    if name in info.names or id(info) in seen:
        return True
    for base in info.bases:
        if base in ("object", "Protocol", "Generic") or base.startswith("Generic["):
            continue
        ours = classes().get(base)
        if not ours:
            return True  # an outside base (Enum, Exception, twisted's): not ours to judge
        if any(_class_has(b, name, seen | {id(info)}) for b in ours):
            return True
    return False


def _resolves_in_module(module: str, rest: list[str]) -> bool:
    """Whether ``rest`` names something in module ``module`` (a submodule, a name, a class's attribute)."""
    if not rest:
        return True
    head, tail = rest[0], rest[1:]
    if f"{module}.{head}" in index():
        return _resolves_in_module(f"{module}.{head}", tail)
    info = index()[module]
    if head in info.classes and head in info.names:
        return not tail or _class_has(info.classes[head], tail[0])
    return head in info.names or head in info.imported


@functools.lru_cache(maxsize=1)
def _config_keys() -> frozenset[tuple[str, ...]]:
    """Every key of the configuration file as its parts (``proxy``, ``upstream``), a class's as ``classes.*``."""
    keys = set()
    for section, _, key in config_keys():
        keys.add((*section.split("."), key))
        if section.startswith("classes."):
            keys.add(("classes", "*", key))
    return frozenset(keys)


def _is_config_key(parts: list[str]) -> bool:
    """``proxy.upstream`` is a key of the file, not the name ``upstream`` of package ``proxy``."""
    wild = (parts[0], "*", *parts[2:])
    return tuple(parts) in _config_keys() or wild in _config_keys() or tuple(parts[:2]) in _config_keys()


@functools.lru_cache(maxsize=None)
def _strings(module: str) -> frozenset[str]:
    """The string constants of a module (and of the package root: its log namespaces)."""
    path = PACKAGE.joinpath(*module.split(".")[1:])
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    if module == "yieldproxy":  # "yieldproxy.requestlog" is a namespace some module writes
        found |= {".".join(s.split(".")[1:2]) for m in index() if m != module for s in _strings(m)
                  if s.startswith("yieldproxy.")}
    return frozenset(found)


def name_problem(dotted: str) -> str | None:
    """Why a dotted name of ours does not resolve; None when it does, or when it is not ours."""
    parts = dotted.removesuffix("()").split(".")
    if parts[-1] in EXTENSIONS or len(parts) < 2 or _is_config_key(parts):
        return None
    if parts[0] in GONE_MODULES:
        return f"module {parts[0]} has left the package"
    if parts[0] == "yieldproxy":
        module, rest = "yieldproxy", parts[1:]
    elif f"yieldproxy.{parts[0]}.{parts[1]}" in index():
        # upstream.verdict.verdict; not clock.seconds or proxy.service (a variable named as a module often is)
        module, rest = f"yieldproxy.{parts[0]}.{parts[1]}", parts[2:]
    else:
        module, rest = "", []
    if module:
        if _resolves_in_module(module, rest) or (len(rest) == 1 and rest[0] in _strings(module)):
            return None  # a name, or a key the module writes (a status field, a log namespace)
        return f"no {'.'.join(rest)} in {module}"
    owners = classes().get(parts[0])
    if owners and parts[0][:1].isupper():
        if any(_class_has(info, parts[1]) for info in owners):
            return None
        return f"class {parts[0]} has no {parts[1]}"
    return None


# -- paths --------------------------------------------------------------------------------------------------

PATH = re.compile(
    rf"(?<![\w/.~-])((?:{'|'.join(re.escape(d) for d in OUR_DIRS)})/[\w./-]*\w)(?:::(\w+(?:::\w+)*)|:(\d+))?"
)


#: A module cited from inside the package: ``lot/parking.py``, ``upstream/pool/member.py:40``.
PACKAGE_PATH = re.compile(
    rf"(?<![\w/.~-])((?:{'|'.join(p.name for p in sorted(PACKAGE.iterdir()) if (p / '__init__.py').exists())})"
    r"/[\w/]*\w\.py)(?![\w/])(?::(\d+))?"
)


#: A file of a module that has left the package, by its name alone: ``forward.py``.
GONE_FILE = re.compile(rf"(?<![\w/.~-])({'|'.join(sorted(GONE_MODULES))})\.py\b")


def _defines(path: Path, names: list[str]) -> bool:
    """Whether a test file defines ``names`` (``test_x``, or ``TestX::test_y``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    body: list[ast.stmt] = tree.body
    for name in names:
        found = [n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                 and n.name == name]
        if not found:
            return False
        body = found[0].body if isinstance(found[0], ast.ClassDef) else []
    return True


@functools.lru_cache(maxsize=1)
def _package_dirs() -> dict[str, str]:
    """setup.cfg's ``package_dir``: a package of the wheel made from another directory (``yieldproxy/etc``)."""
    text = (ROOT / "setup.cfg").read_text(encoding="utf-8")
    block = re.search(r"^package_dir\s*=\s*\n((?:[ \t]+.*\n)+)", text, re.M)
    pairs = re.findall(r"^\s*([\w.]+)\s*=\s*(\S+)", block.group(1), re.M) if block else []
    return {package.replace(".", "/"): directory for package, directory in pairs if package}


def _source_of(path: str) -> str:
    """A path of the wheel (``yieldproxy/etc/x``) as the checkout has it (``etc/x``)."""
    for package, directory in _package_dirs().items():
        if path == package or path.startswith(package + "/"):
            return directory + path[len(package):]
    return path


def path_problem(path: str, function: str | None, line: str | None) -> str | None:
    """Why a cited path (with ``::test`` or ``:line``) does not exist; None when it does."""
    if path.startswith("tools/") and not (ROOT / "tools").exists():
        return None  # another project's tools/ (llama.cpp's tools/server/...): we have none at the top
    if re.search(r"(^|/)[A-Z]+(\.\w+)?(/|$)", path):
        return None  # a placeholder: tests/FILE.py
    target = ROOT / _source_of(path)
    if not target.exists():
        return f"{path} does not exist"
    if function and target.suffix == ".py" and not _defines(target, function.split("::")):
        return f"{path} has no {function}"
    if line and target.is_file() and int(line) > len(target.read_text(encoding="utf-8").splitlines()):
        return f"{path} has no line {line}"
    return None


# -- where the prose is -------------------------------------------------------------------------------------


def code_prose(path: Path) -> Iterator[tuple[int, str]]:
    """``(line, text)`` of every docstring and comment of a module."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                yield first.lineno, first.value.value
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


#: A dotted name: words joined by dots, not inside a path or a longer dotted run.
DOTTED = re.compile(r"(?<![\w./-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?(?![\w/-]|\.\w)")
#: In a page, names are only looked for in code spans (prose has "e.g." and "i.e.").
CODE_SPAN = re.compile(r"`([^`\n]+)`")


#: A Sphinx role in the package's prose: ``:class:`Name```, ``:meth:`~.link.Link.flushed```.
ROLE = re.compile(r":(?:py:)?(?:mod|func|class|meth|attr|data|exc|obj|const):`~?(\.?[A-Za-z_][\w.]*)`")


def _scopes(module: str) -> list[str]:
    """Where a role written in ``module`` looks a name up: the module, then each package above it."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


@functools.lru_cache(maxsize=1)
def _all_names() -> frozenset[str]:
    """Every name some module or class of the package defines (a bare ``:meth:`x``` names its own class's)."""
    found: set[str] = set()
    for module in index().values():
        found |= module.names
        for info in module.classes.values():
            found |= info.names
    return frozenset(found)


def role_problem(target: str, module: str) -> str | None:
    """Why a role's target written in ``module`` names nothing: ``.x.y`` (relative) or a bare ``Name``.

    A dotted target not starting with a dot is :func:`name_problem`'s.  A bare name must be in the module (its
    own or imported), a builtin, or a name some module or class of the package defines (a bare method's role
    names its own class's)."""
    if target.startswith("."):
        parts = target[1:].split(".")
        if any(_resolves_in_module(scope, parts) for scope in _scopes(module)):
            return None
        return f"no {target[1:]} in {module} or a package above it"
    if "." in target:
        return None
    info = index()[module]
    if target in info.names or target in info.imported or target in classes():
        return None
    if target in _all_names() or hasattr(builtins, target):
        return None
    return f"no {target} in {module} nor anywhere in the package"


def citations_in(
    text: str, in_page: bool, module: str | None = None
) -> Iterator[tuple[str, str | None]]:
    """``(citation, problem)`` for each path and dotted name of ours that ``text`` cites; the package's prose
    says which ``module`` it is in, for the roles that name a thing relative to it."""
    if module is not None:
        for m in ROLE.finditer(text):
            yield m.group(0), role_problem(m.group(1), module)
    for m in PATH.finditer(text):
        yield m.group(0), path_problem(m.group(1), m.group(2), m.group(3))
    for m in PACKAGE_PATH.finditer(text):
        yield m.group(0), path_problem("yieldproxy/" + m.group(1), None, m.group(2))
    for m in GONE_FILE.finditer(text):
        yield m.group(0), f"module {m.group(1)} has left the package"
    spans = [m.group(1) for m in CODE_SPAN.finditer(text)] if in_page else [text]
    for span in spans:
        for m in DOTTED.finditer(PATH.sub(" ", span)):
            yield m.group(1), name_problem(m.group(1).lstrip("~"))


@functools.lru_cache(maxsize=1)
def all_citations() -> tuple[tuple[str, int, str, str | None], ...]:
    """``(file, line, citation, problem)`` over the pages and the package's prose."""
    return tuple(_citations())


def _citations() -> Iterator[tuple[str, int, str, str | None]]:
    for page in PAGES:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for citation, problem in citations_in(line, in_page=True):
                yield str(page.relative_to(ROOT)), number, citation, problem
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for number, text in code_prose(path):
            for citation, problem in citations_in(text, in_page=False, module=module):
                yield path.relative_to(ROOT).as_posix(), number, citation, problem


def rotten() -> list[tuple[str, int, str, str]]:
    return [(f, n, c, p) for f, n, c, p in all_citations() if p is not None]


# -- the tests ----------------------------------------------------------------------------------------------


def test_every_citation_of_ours_exists():
    problems = [f"{f}:{n}: {c}: {p}" for f, n, c, p in rotten() if (f, c) not in ALLOWED]
    assert problems == [], "cited, but gone:\n" + "\n".join(problems)


def test_the_allowed_rot_is_still_there():
    """An entry of :data:`ALLOWED` that no longer rots goes, so the list only shrinks."""
    still = {(f, c) for f, _, c, _ in rotten()}
    assert sorted(ALLOWED - still) == []


def test_many_citations_are_checked():
    """The check reads what it should: paths and names of each kind are found in the prose."""
    found = {c for _, _, c, _ in all_citations()}
    assert len(found) > 200
    assert any(c.startswith("yieldproxy/") for c in found) and any(c.startswith("tests/") for c in found)
    assert any("::" in c for c in found)


@pytest.mark.parametrize("text, in_page", [
    ("see ``yieldproxy/upstream/verdicts.py``", False),
    ("`yieldproxy/lot/parking.py:99999`", True),
    ("tests/test_docs.py::test_no_such_test", False),
    ("the rule is ``upstream.verdict.no_such_function``", False),
    ("`UpstreamHealth.judge_outages_with`", True),
    ("``forward.classify_failure``", False),
    (":class:`~yieldproxy.lot.parking.NoSuchClass`", False),
    ("``lot.parking.ParkingLot.no_such_method``", False),
    ("the lot (lot/parkings.py)", True),
    ("as proxyresource.py did", False),
    ("`docs/no-such-page.md`", True),
])
def test_a_rotten_citation_fails(text, in_page):
    assert [p for _, p in citations_in(text, in_page) if p], text


@pytest.mark.parametrize("text", [
    ":meth:`~.link.Link.no_such_method`",
    ":mod:`.no_such_module`",
    ":class:`NoSuchClassAnywhere`",
])
def test_a_rotten_role_fails(text):
    assert [p for _, p in citations_in(text, False, "yieldproxy.lifecycle.succession.predecessor") if p], text


def test_a_role_that_names_something_passes():
    text = (":meth:`~.link.Link.flushed`, :func:`~.connections.divert`, :class:`ReloadRefused`, "
            ":meth:`Predecessor._take_back`, :class:`ValueError`, :mod:`.wire`, :mod:`twisted.internet.defer`")
    assert [p for _, p in citations_in(text, False, "yieldproxy.lifecycle.succession.predecessor") if p] == []


@pytest.mark.parametrize("text, in_page", [
    ("Ollama's server/routes.go:1234 and twisted/web/_newclient.py, h11's _state.py", False),
    ("llama.cpp's tools/server/server.cpp", False),
    ("`proxy.upstream` and `upstream.max_attempts` are keys of the config", True),
    ("see ``yieldproxy/upstream/verdict.py`` and tests/test_docs.py::test_metric_documented", False),
    ("``upstream.verdict.verdict`` and :class:`~yieldproxy.upstream.health.UpstreamHealth`", False),
    ("request.path, e.g. json.dumps, errors.py, self._clock.seconds()", False),
])
def test_what_is_not_ours_or_still_exists_passes(text, in_page):
    assert [p for _, p in citations_in(text, in_page) if p] == [], text


# -- module docstrings say what and why; the specification is in docs/ ----------------------------------------

#: A module docstring this long or longer is a specification: it goes to docs/, the docstring points there.
MAX_MODULE_DOCSTRING_LINES = 30
#: Modules whose docstrings are still specifications, in files being changed on other branches now.
#: TODO(lead): shorten each once its branch is merged (move what docs/ lacks to the page it belongs on).
LONG_DOCSTRINGS = frozenset({
})


def module_docstring_lines() -> dict[str, int]:
    """How many lines each module's docstring takes, by the module's path."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        first = tree.body[0] if tree.body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            found[path.relative_to(ROOT).as_posix()] = (first.end_lineno or first.lineno) - first.lineno + 1
    return found


def test_module_docstrings_are_short():
    long = {path for path, lines in module_docstring_lines().items() if lines >= MAX_MODULE_DOCSTRING_LINES}
    assert sorted(long - LONG_DOCSTRINGS) == [], "say what and why in a few lines; the specification goes to docs/"
    assert sorted(LONG_DOCSTRINGS - long) == [], "shortened: take it off LONG_DOCSTRINGS"
