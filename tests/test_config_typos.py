"""A misspelt name in the config file is answered with the nearest known one, as ``--listen 24445`` is."""

from __future__ import annotations

import tomllib

import attrs
import pytest
from hypothesis import assume, given, strategies as st

from yieldproxy.config import _SECTIONS, ConfigError, from_dict
from yieldproxy.names import CLASS_NAMES

#: (the table, the known names, how an unknown one is placed in a config).
PLACES = [
    *((f"[{section}]", sorted(attrs.fields_dict(cls)), lambda name, s=section: {s: {name: 1}})
      for section, cls in _SECTIONS.items()),
    ("sections", sorted([*_SECTIONS, "classes", "routes", "upstreams"]), lambda name: {name: {}}),
    ("[classes]", list(CLASS_NAMES), lambda name: {"classes": {name: {}}}),
]


def refused(data: dict) -> str:
    with pytest.raises(ConfigError) as e:
        from_dict(data, "yieldproxy.toml")
    return str(e.value)


def test_the_issue_s_typo():
    line = refused(tomllib.loads("[proxy]\nupstram = 'http://127.0.0.1:11434'\n"))
    assert line.startswith("yieldproxy.toml: proxy.upstram: unknown key; did you mean 'upstream'? (known keys: "), line
    assert refused({"parkng": {}}).startswith("yieldproxy.toml: parkng: unknown section; did you mean 'parking'?")
    assert "classes.bacth: unknown class; did you mean 'batch'? (known classes: " in refused({"classes": {"bacth": {}}})


@given(data=st.data())
def test_a_name_one_slip_from_a_known_one_is_answered_with_a_known_one(data):
    """Any name one key-slip (a letter dropped, doubled, swapped or changed) from a known name of its table."""
    where, known, place = data.draw(st.sampled_from(PLACES))
    name = data.draw(st.sampled_from([k for k in known if len(k) >= 4]))
    i = data.draw(st.integers(min_value=0, max_value=len(name) - 2))
    slip = data.draw(st.sampled_from(["drop", "double", "swap", "change"]))
    letter = data.draw(st.sampled_from("abcdefghijklmnopqrstuvwxyz_"))
    typo = {
        "drop": name[:i] + name[i + 1:],
        "double": name[:i] + name[i] + name[i:],
        "swap": name[:i] + name[i + 1] + name[i] + name[i + 2:],
        "change": name[:i] + letter + name[i + 1:],
    }[slip]
    assume(typo not in known)
    line = refused(place(typo))
    assert "\n" not in line
    suggested = line.split("did you mean '", 1)[1].split("'", 1)[0] if "did you mean '" in line else None
    assert suggested in known, (where, typo, line)


def test_a_name_near_none_lists_them_all_without_a_guess():
    line = refused({"proxy": {"zzzzzz": 1}})
    assert "did you mean" not in line and "(known keys: " in line
