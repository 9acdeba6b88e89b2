"""The documentation keeps up with the code.

* ``etc/yieldproxy.toml`` loads and sets every key to its default;
* every configuration key appears in ``etc/yieldproxy.toml`` and in
  ``docs/configuration.md``;
* every admin route (with each of its methods) appears in ``docs/admin-api.md``;
* every metric a fresh :class:`~yieldproxy.metrics.Metrics` exports appears in
  ``docs/metrics.md``.

The keys, routes and metrics are read from the code, so a new one fails
here until it is documented.
"""

from __future__ import annotations

import re
import typing
from pathlib import Path

import attrs
import pytest

from yieldproxy import config as config_module
from yieldproxy.admin import AdminApp
from yieldproxy.config import Config, load
from yieldproxy.metrics import Metrics

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "etc" / "yieldproxy.toml"
CONFIGURATION_MD = ROOT / "docs" / "configuration.md"
ADMIN_MD = ROOT / "docs" / "admin-api.md"
METRICS_MD = ROOT / "docs" / "metrics.md"

#: attrs field names that are spelled differently in the TOML file.
TOML_NAMES = {(config_module.RouteRule, "cls"): "class"}


def _toml_name(cls: type, field: attrs.Attribute) -> str:
    return TOML_NAMES.get((cls, field.name), field.name)


def _element_type(annotation) -> type | None:
    """The attrs class inside a field's type: ``X``, ``Mapping[str, X]`` or ``tuple[X, ...]``."""
    if attrs.has(annotation):
        return annotation
    for arg in typing.get_args(annotation):
        if isinstance(arg, type) and attrs.has(arg):
            return arg
    return None


def config_keys() -> list[tuple[str, type, str]]:
    """``(section, attrs class, toml key)`` for every key of every section of :class:`Config`.

    ``section`` is how the file names the table: ``proxy``, ``classes.batch``,
    ``routes`` (an array of tables).  Classes come from the defaults, so a new
    class is covered too.
    """
    hints = typing.get_type_hints(Config)
    defaults = Config()
    keys = []
    for field in attrs.fields(Config):
        cls = _element_type(hints[field.name])
        assert cls is not None, f"Config.{field.name}: no attrs class found in {hints[field.name]!r}"
        value = getattr(defaults, field.name)
        if isinstance(value, typing.Mapping):
            sections = [f"{field.name}.{name}" for name in value]
        else:
            sections = [field.name]
        for section in sections:
            for sub in attrs.fields(cls):
                keys.append((section, cls, _toml_name(cls, sub)))
    return keys


def _blocks(text: str, header: re.Pattern) -> dict[str, str]:
    """Text under each header line matched by ``header`` (group 1: the name), up to the next one."""
    matches = list(header.finditer(text))
    blocks: dict[str, str] = {}
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        blocks.setdefault(m.group(1), "")
        blocks[m.group(1)] += text[m.end():end]
    return blocks


def example_sections() -> dict[str, str]:
    """The example file's tables by name; a commented-out ``# [[routes]]`` counts as a table."""
    text = EXAMPLE.read_text(encoding="utf-8")
    return _blocks(text, re.compile(r"^#?[ \t]*\[\[?([A-Za-z0-9_.]+)\]\]?[ \t]*(?:#.*)?$", re.M))


# -- (a) the example is the defaults -------------------------------------------------


def test_example_loads_and_equals_the_defaults():
    assert load(EXAMPLE) == Config()


# -- (b) every key is in the example and in configuration.md ----------------------------------


@pytest.mark.parametrize(
    "section, key", [(s, k) for s, _, k in config_keys()], ids=[f"{s}.{k}" for s, _, k in config_keys()]
)
def test_key_in_example(section, key):
    sections = example_sections()
    assert section in sections, f"etc/yieldproxy.toml has no [{section}] table"
    # Set, or (for keys without a useful literal default) shown commented out.
    pattern = re.compile(rf"^[ \t]*(?:#[ \t]*)?{re.escape(key)}[ \t]*=", re.M)
    assert pattern.search(sections[section]), f"etc/yieldproxy.toml: [{section}] does not mention {key}"


def _doc_sections(text: str) -> dict[str, str]:
    """configuration.md's text under each heading, keyed by the heading."""
    return _blocks(text, re.compile(r"^#+[ \t]+(.*)$", re.M))


@pytest.mark.parametrize(
    "section, key", [(s, k) for s, _, k in config_keys()], ids=[f"{s}.{k}" for s, _, k in config_keys()]
)
def test_key_in_configuration_md(section, key):
    text = CONFIGURATION_MD.read_text(encoding="utf-8")
    if f"{section}.{key}" in text:
        return
    # Else a table row for the key under a heading that names the section
    # ("### `[proxy]`", "### `[classes.interactive]`, ...", "### `[[routes]]`").
    row = re.compile(rf"^\|[ \t]*`{re.escape(key)}`[ \t]*\|", re.M)
    for heading, body in _doc_sections(text).items():
        if (f"[{section}]" in heading or f"[[{section}]]" in heading) and row.search(body):
            return
    pytest.fail(f"docs/configuration.md documents neither {section}.{key} nor `{key}` in a [{section}] table")


def test_every_section_is_in_the_example_and_nothing_else():
    """No stale tables: every table of the example is a section of Config."""
    wanted = {section for section, _, _ in config_keys()}
    assert set(example_sections()) == wanted


# -- (c) every admin route is in admin-api.md -------------------------------------------------


def admin_routes() -> list[tuple[str, str]]:
    """``(method, path)`` for every route of the admin app; HEAD and OPTIONS go with GET."""
    routes = []
    for rule in AdminApp.app.url_map.iter_rules():
        for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}):
            routes.append((method, rule.rule))
    return routes


def test_admin_routes_found():
    assert ("GET", "/healthz") in admin_routes()
    assert ("POST", "/yield") in admin_routes()


@pytest.mark.parametrize("method, path", admin_routes(), ids=[f"{m} {p}" for m, p in admin_routes()])
def test_admin_route_documented(method, path):
    text = ADMIN_MD.read_text(encoding="utf-8")
    # "GET /status" followed by the end of the path: "GET /" must not be found in "GET /status".
    pattern = re.compile(rf"{method} {re.escape(path)}(?![\w/<.-])")
    assert pattern.search(text), f"docs/admin-api.md does not mention {method} {path}"


# -- (d) every metric is in metrics.md -------------------------------------------------------


def metric_names() -> list[str]:
    """The exposed names of every family a fresh :class:`Metrics` exports (counters end in ``_total``)."""
    names = []
    for family in Metrics().registry.collect():
        names.append(family.name + "_total" if family.type == "counter" else family.name)
    return sorted(names)


def test_metrics_found():
    assert "yieldproxy_yield_active" in metric_names()
    assert "yieldproxy_replay_total" in metric_names()


@pytest.mark.parametrize("name", metric_names())
def test_metric_documented(name):
    text = METRICS_MD.read_text(encoding="utf-8")
    assert re.search(rf"`{re.escape(name)}`", text), f"docs/metrics.md does not document {name}"
