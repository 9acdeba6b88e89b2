"""Checking requests the way Ollama does."""

from __future__ import annotations

import re


class _BadRequest(Exception):
    """A 400 with this message, in the route's error shape."""


#: Names a Go template may call: text/template's builtins and keywords, and
#: the functions Ollama adds (``template/template.go``, ``funcs``).
_TEMPLATE_NAMES = frozenset(
    "if else end range with define template block break continue nil true false "
    "and or not len index slice eq ne lt le gt ge print printf println html js urlquery call "
    "json currentDate yesterdayDate toTypeScriptType".split()
)
_TEMPLATE_ACTION = re.compile(r"\{\{-?\s*(.*?)\s*-?\}\}", re.S)
_TEMPLATE_WORD = re.compile(r"(?:^|[|(\s])([A-Za-z_][A-Za-z0-9_]*)")
_TEMPLATE_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|`[^`]*`')


def template_error(text: str) -> str | None:
    """Go's parse error for a ``template`` Ollama could not parse, in Go's words; None if it parses.

    Only the two mistakes a caller makes most (an unknown function, an
    unclosed action) are recognised; the message quotes the caller's
    template, as Ollama's 500 does (``server/routes.go``: ``template.Parse``).
    """
    for number, line in enumerate(text.split("\n"), start=1):
        if line.count("{{") > line.count("}}"):
            return f"template: :{number}: unclosed action"
        for action in _TEMPLATE_ACTION.findall(line):
            for word in _TEMPLATE_WORD.findall(_TEMPLATE_STRING.sub('""', action)):
                if word not in _TEMPLATE_NAMES:
                    return f'template: :{number}: function "{word}" not defined'
    return None
