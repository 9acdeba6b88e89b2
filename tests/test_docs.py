"""The documentation keeps up with the code.

* ``etc/yieldproxy.toml`` loads and sets every key to its default;
* every configuration key appears in ``etc/yieldproxy.toml`` and in
  ``docs/configuration.md``;
* every admin route (with each of its methods) appears in ``docs/admin-api.md``;
* every metric a fresh :class:`~yieldproxy.observe.metrics.Metrics` exports appears in
  ``docs/metrics.md``;
* every command the README and the docs show runs as shown: ``yieldproxy``
  subcommands and options, ``twistd`` and plugin options, a pid file for each
  twistd run, ``--kill-whom=main`` for ``systemctl kill``, scripts and make
  targets that exist.

The keys, routes and metrics are read from the code, so a new one fails
here until it is documented.
"""

from __future__ import annotations

import argparse
import ast
import functools
import os
import re
import shlex
import typing
from pathlib import Path

import attrs
import pytest
from hypothesis import given, strategies as st

from yieldproxy import config as config_module
from yieldproxy.admin.api import AdminApp
from yieldproxy.config import Config, load
from yieldproxy.observe.metrics import Metrics
from yieldproxy.tools import cli

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
        if field.metadata.get("section", True) is False:
            continue  # bookkeeping (Config.explicit), no key of the file
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


@given(hard=st.integers(min_value=256, max_value=2_000_000), soft_share=st.floats(min_value=0.0, max_value=1.0))
def test_the_example_starts_as_the_defaults_do_at_any_open_file_limit(hard, soft_share):
    """Used as it is, the example is the defaults at start too: a key it sets to a value the start would size
    (parking.max_parked) counts as asked for, and warned "the parked queue can never fill" where the defaults
    are sized in silence."""
    from yieldproxy.lifecycle.limits import fd_budget

    soft = max(64, int(hard * soft_share))

    def budget(config):
        return fd_budget(config, lambda _: (soft, hard), lambda _, limits: None)

    assert budget(load(EXAMPLE)) == budget(Config())


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


# -- (e) the commands the docs show exist as shown ---------------------------------------------

#: Pages whose commands a reader copies.
PAGES = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", *(ROOT / "docs").glob("*.md")])
#: Words that run the next word as the command, and their options that take a value.
PREFIXES = {"sudo": {"-u", "-g"}, "runuser": {"-u", "-g"}, "exec": set(), "nohup": set(), "env": set()}


#: Fenced blocks in these languages hold commands (an untagged block: only its "$ " lines).
SHELL_BLOCKS = {"sh", "bash", "shell", "console", "ini"}


def _code(text: str) -> tuple[list[str], list[str]]:
    """The command lines of the fenced code blocks, and the inline code spans of the prose."""
    parts = re.split(r"^```([^\n]*)\n", text, flags=re.M)
    # parts: prose, language, block, language (of the closing fence: empty), prose, ...
    prose, lines = parts[0::4], []
    for language, block in zip(parts[1::4], parts[2::4]):
        # Join continued lines.
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            if line.startswith("$ "):
                lines.append(line[2:])
            elif language.strip() in SHELL_BLOCKS:
                lines.append(line)
    spans = [m.group(1) for part in prose for m in re.finditer(r"`([^`\n]+)`", part)]
    return lines, spans


def _simple_commands(line: str) -> list[list[str]]:
    """A shell line's simple commands as word lists (split at ``&&``, ``|``, ``;``, redirections)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.commenters = "#"
    lexer.whitespace_split = True
    try:
        words = list(lexer)
    except ValueError:  # an unbalanced quote: not shell
        return []
    commands, current = [], []
    for word in words:
        if word and set(word) <= set("();<>|&"):
            commands.append(current)
            current = []
        else:
            current.append(word)
    commands.append(current)
    return [c for c in commands if c]


def _command_word(words: list[str]) -> tuple[str, list[str]] | None:
    """The program a simple command runs (by its base name), and its arguments."""
    i = 0
    while i < len(words):
        word = words[i]
        assignment = re.fullmatch(r"[A-Za-z_]+=(.*)", word)
        if assignment and "/" in assignment.group(1):
            # ExecStart=/opt/yieldproxy/venv/bin/twistd ... in a unit file.
            return os.path.basename(assignment.group(1)), words[i + 1:]
        if assignment:
            i += 1
        elif word in PREFIXES:
            takes_value = PREFIXES[word]
            i += 1
            while i < len(words) and words[i].startswith("-"):
                i += 2 if words[i] in takes_value else 1
        else:
            return os.path.basename(word), words[i + 1:]
    return None


def documented_commands() -> list[tuple[str, bool, str, list[str]]]:
    """``(page, in a code block, program, arguments)`` for every simple command shown."""
    found = []
    for page in PAGES:
        lines, spans = _code(page.read_text(encoding="utf-8"))
        for in_block, texts in ((True, lines), (False, spans)):
            for text in texts:
                for words in _simple_commands(text):
                    command = _command_word(words)
                    if command is not None:
                        found.append((str(page.relative_to(ROOT)), in_block, *command))
    return found


def _argparse_options(parser: argparse.ArgumentParser) -> dict[str, bool]:
    """Each option string of ``parser``, and whether it takes a value."""
    return {s: action.nargs != 0 for action in parser._actions for s in action.option_strings}


def _usage_options(options) -> dict[str, bool]:
    """Each option of a twisted.python.usage.Options, and whether it takes a value."""
    found = {}
    for name in options.longOpt:
        found["--" + name.rstrip("=")] = name.endswith("=")
        found["--" + name.rstrip("=").replace("_", "-")] = name.endswith("=")
    for i, char in enumerate(options.shortOpt):
        if char != ":":
            found["-" + char] = options.shortOpt[i + 1:i + 2] == ":"
    return found


def _check_options(words: list[str], known: dict[str, bool], what: str) -> list[str]:
    return [f"{what} has no option {w.split('=')[0]}" for w in words
            if w.startswith("-") and len(w) > 1 and w.split("=")[0] not in known]


def _yieldproxy_problems(args: list[str]) -> list[str]:
    from yieldproxy.tools.sim.command import build_parser as sim_parser

    parser = cli.build_parser()
    common = _argparse_options(parser)
    i = 0
    while i < len(args) and args[i].startswith("-"):
        name = args[i].split("=")[0]
        if name not in common:
            return [f"yieldproxy has no option {name} (before the command)"]
        i += 2 if common[name] and "=" not in args[i] else 1
    if i == len(args):
        return []
    [subparsers] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    command = args[i]
    if command not in subparsers.choices:
        return [f"yieldproxy has no command {command!r}"]
    if command == "serve":  # twistd -n --pidfile= yieldproxy [options]: the plugin's options
        from yieldproxy.tap import Options

        return _check_options(args[i + 1:], _usage_options(Options()), "yieldproxy serve")
    sub = sim_parser() if command == "sim" else subparsers.choices[command]
    return _check_options(args[i + 1:], _argparse_options(sub), f"yieldproxy {command}")


def _twistd_problems(args: list[str], in_block: bool) -> list[str]:
    from twisted.scripts.twistd import ServerOptions

    from yieldproxy.tap import Options

    own = _usage_options(ServerOptions())
    i, given = 0, set()
    while i < len(args) and args[i].startswith("-"):
        name = args[i].split("=")[0]
        if name not in own:
            return [f"twistd has no option {name}"]
        given.add(name)
        i += 2 if own[name] and "=" not in args[i] else 1
    if i == len(args) or args[i] != "yieldproxy":
        return []  # twistd --help, twistd --version
    plugin_args = args[i + 1:]
    problems = _check_options(plugin_args, _usage_options(Options()), "twistd yieldproxy")
    # A command to run (not prose about one) says where the pid file goes: twistd's
    # default, twistd.pid in the current directory, keeps a second instance from starting.
    if in_block and "--help" not in plugin_args and not {"--pidfile", "-p"} & given:
        problems.append("starts yieldproxy without --pidfile (twistd.pid would block a second instance)")
    return problems


def test_commands_found():
    programs = {(program, args[0] if args else "") for _, _, program, args in documented_commands()}
    assert ("yieldproxy", "yield") in programs and ("yieldproxy", "sim") in programs
    assert ("twistd", "-n") in programs and ("systemctl", "kill") in programs


def test_documented_commands_match_the_code():
    """Every yieldproxy subcommand and option, every twistd and plugin option the docs show exists;
    twistd runs say where the pid file goes; signals go to the main process only."""
    problems = []
    for page, in_block, program, args in documented_commands():
        found = []
        if program == "yieldproxy":
            found = _yieldproxy_problems(args)
        elif program == "twistd":
            found = _twistd_problems(args, in_block)
        elif program == "systemctl" and args[:1] == ["kill"]:
            if not any(re.fullmatch(r"--kill-whom?=main", a) for a in args):
                found = ["systemctl kill without --kill-whom=main signals every process of the unit"]
        elif program == "kill" and any("pgrep" in a for a in args):
            found = ["kill by pgrep pattern matches every yieldproxy on the machine"]
        problems += [f"{page}: {program} {' '.join(args)}: {p}" for p in found]
    assert problems == []


def test_documented_files_and_make_targets_exist():
    """scripts/..., bench/*.py and make targets named in the docs exist."""
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(encoding="utf-8"), re.M))
    problems = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for path in re.findall(r"(?<![\w/.])((?:scripts|bench|\.ci)/[\w.-]*\w)", text):
            if not (ROOT / path).exists():
                problems.append(f"{page.relative_to(ROOT)}: {path} does not exist")
        lines, spans = _code(text)
        for words in (w for line in lines + spans for w in _simple_commands(line)):
            if words[0] == "make" and len(words) > 1 and not words[1].startswith("-") and "=" not in words[1]:
                if words[1] not in targets:
                    problems.append(f"{page.relative_to(ROOT)}: make {words[1]}: no such target")
    assert problems == []


def test_docs_use_the_paths_everyone_else_uses():
    """No machine-specific paths, no placeholders left, one config path (issue 13's drift)."""
    problems = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        name = page.relative_to(ROOT)
        problems += [f"{name}: a machine path {m}" for m in re.findall(r"/work/\S+", text)]
        problems += [f"{name}: a placeholder {m}" for m in re.findall(r"\S*\bOWNER\b\S*", text)]
        problems += [f"{name}: {m} (the config is /etc/yieldproxy/yieldproxy.toml)"
                     for m in re.findall(r"(?<![\w./-])/etc/yieldproxy\.toml", text)]
    assert problems == []


def test_linked_pages_and_cited_tests_exist():
    """Relative links between the pages, and the test files they cite, point at files that exist."""
    problems = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#\s:]+)(?:#[^)]*)?\)", text):
            if not (page.parent / target).exists():
                problems.append(f"{page.relative_to(ROOT)}: link to {target}, which does not exist")
        for path in re.findall(r"(?<![\w/.])(tests/(?:\w+/)*test_\w+\.py)", text):
            if not (ROOT / path).exists():
                problems.append(f"{page.relative_to(ROOT)}: {path} does not exist")
    assert problems == []


# -- the error messages the docs quote are the code's --------------------------------------------------------


#: Where a template has a value, or a quote leaves something out (``...``, ``N``, ``M``).
ANY = "\x00"


def _template(node: ast.expr) -> str | None:
    """A string literal of the code as a pattern: each ``{value}`` of an f-string is :data:`ANY`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(
            part.value if isinstance(part, ast.Constant) and isinstance(part.value, str) else ANY
            for part in node.values
        )
    return None


@functools.lru_cache(maxsize=1)
def code_templates() -> list[str]:
    """Every string the package's code writes, as a pattern (:func:`_template`)."""
    found = []
    for path in sorted((ROOT / "yieldproxy").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                text = _template(node)
                if text and " " in text:
                    found.append(text)
    return sorted(set(found))


#: How a config error is composed (config.py): the file, the key, then the key's own message.
CONFIG_ERROR = re.compile(r"^\S+\.toml: [\w.\[\]]+: ")


def _quoted(message: str) -> str:
    """A message as a page quotes it, as a pattern: what it leaves out (``...``) or stands for (``N``) is ANY;
    a config error's file and key are the composition's (:data:`CONFIG_ERROR`)."""
    message = CONFIG_ERROR.sub(ANY, message.replace("\\\"", "\""))
    message = re.sub(r"\s*\.\.\.\s*", ANY, message)
    return re.sub(r"\b[NM]\b", ANY, message)


def could_be(a: str, b: str) -> bool:
    """Whether some text fits both patterns (each :data:`ANY` any text, the rest as it is)."""
    seen, todo = set(), [(0, 0)]
    while todo:
        i, j = todo.pop()
        if (i, j) in seen:
            continue
        seen.add((i, j))
        if i == len(a) and j == len(b):
            return True
        if i < len(a) and a[i] == ANY:
            todo += [(i + 1, j)] + ([(i, j + 1)] if j < len(b) else [])
        if j < len(b) and b[j] == ANY:
            todo += [(i, j + 1)] + ([(i + 1, j)] if i < len(a) else [])
        if i < len(a) and j < len(b) and a[i] == b[j] != ANY:
            todo.append((i + 1, j + 1))
    return False


def _literal_runs(pattern: str) -> list[str]:
    return [run for run in pattern.split(ANY) if run]


def matching_templates(quote: str, templates: list[str]) -> list[str]:
    """The code's templates that could write the quoted message (one sharing its longest literal run first)."""
    words = [w for run in _literal_runs(quote) for w in [run.split()] if len(w) >= 3]
    shingles = {" ".join(run[i:i + 3]) for run in words for i in range(len(run) - 2)}
    candidates = [
        t for t in templates
        if any(s in t for s in shingles) or any(len(r.split()) >= 2 and r.strip() in quote for r in _literal_runs(t))
    ]
    return [t for t in candidates if could_be(quote, t)]


#: Placeholders in the docs for "some message", no message of their own.
PLACEHOLDERS = {"...", "<message>", "MESSAGE"}


def documented_messages() -> list[tuple[str, str]]:
    """``(page, message)``: every error message the pages quote in an ``{"error": ...}`` (or OpenAI ``message``)
    body, and every one in the Message column of admin-api.md's table of the proxy's own errors."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for message in re.findall(r'"(?:error|message)": "((?:[^"\\\n]|\\.)*)"', text):
            if message not in PLACEHOLDERS:
                found.append((page.relative_to(ROOT).as_posix(), message))
    for code, messages in proxy_error_table().items():
        found += [("docs/admin-api.md", m) for m in messages]
    return found


def proxy_error_table() -> dict[str, list[str]]:
    """admin-api.md's table of the proxy's own errors: each reason (``code``) and the messages its row quotes."""
    text = ADMIN_MD.read_text(encoding="utf-8")
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and re.fullmatch(r"`\w+`", cells[1]) and re.match(r"\d", cells[0]):
            rows.setdefault(cells[1].strip("`"), []).extend(re.findall(r"`([^`]+)`", cells[2]))
    assert "shutdown" in rows and "queue_full" in rows, "admin-api.md: the table of the proxy's own errors moved"
    return rows


@pytest.mark.parametrize("page, message", documented_messages())
def test_a_quoted_error_message_is_one_the_code_writes(page, message):
    """Quoted in full (or with ``...`` for what it leaves out), a message must be one some string of the code
    can write whole: a quote that ends early (``the proxy is shutting down``, where the code says ``... while
    the GPU is yielded``) or says it in other words fails."""
    assert matching_templates(_quoted(message), code_templates()), f"{page}: no code writes {message!r}"


def _refusals() -> list[tuple[str, str]]:
    """``(reason, message)`` of every refusal the code makes with a literal message: ``Refused("reason", ...)``
    of the lot, and the scheduler's ``refuse_*_parked(...)`` (the reason ``shutdown``)."""
    found = []
    for path in sorted((ROOT / "yieldproxy").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            args = node.args
            if name == "Refused" and len(args) >= 2 and isinstance(args[0], ast.Constant):
                message = _template(args[1])
                if message is not None and isinstance(args[0].value, str):
                    found.append((args[0].value, message))
            elif name in ("refuse_all_parked", "refuse_held_parked") and args:
                message = _template(args[0])
                if message is not None:
                    found.append(("shutdown", message))
    return sorted(set(found))


def test_every_refusal_with_a_message_of_its_own_is_in_the_table_under_its_reason():
    """The other way round: each message the lot or a stop answers a request with is in admin-api.md's table, in
    the row of its reason (``code``)."""
    assert ("shutdown", "the proxy is shutting down while the GPU is yielded") in _refusals()
    table = proxy_error_table()
    missing = [
        f"{reason}: {message!r}" for reason, message in _refusals()
        if not any(could_be(_quoted(quoted), message) for quoted in table.get(reason, []))
    ]
    assert missing == [], "admin-api.md's table of the proxy's own errors lacks these (reason: message)"


def test_the_message_check_tells_a_quote_that_ends_early_or_differs_from_one_the_code_writes():
    templates = code_templates()
    for written in ("the proxy is shutting down while the GPU is yielded", "the proxy is shutting down",
                    "the proxy is shutting down while ...", "unknown field(s): foo",
                    "/etc/yieldproxy/yieldproxy.toml: replay.rate: must be >= 0, got -1.0"):
        assert matching_templates(_quoted(written), templates), written
    for never in ("the proxy is shutting down now", "the proxy shuts down", "unknown fields: foo",
                  "parked queue is full (10000 requests parked)"):
        assert not matching_templates(_quoted(never), templates), never
