"""The declared dependency floors as pip constraints, for .ci/floors.

``python floors_constraints.py setup.cfg`` prints one ``name==floor`` line per
``install_requires`` of setup.cfg, and fails on a requirement that declares no
``>=`` floor (every dependency must have one, and CI proves it).
``python floors_constraints.py --check FILE`` fails unless this Python has each
package of FILE installed at exactly its version.  Standard library only.
"""

from __future__ import annotations

import configparser
import re
import sys
from importlib import metadata

#: ``name[extras]>=floor``, then more specifiers (``,<3``) or a marker, if any.
REQUIREMENT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*>=\s*([0-9][0-9.]*)\s*(?:[,;].*)?$")


def floors(setup_cfg: str) -> list[tuple[str, str]]:
    """``(name, floor)`` for each install_requires; SystemExit on one without a floor."""
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(setup_cfg, encoding="utf-8")
    found = []
    for line in parser.get("options", "install_requires").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = REQUIREMENT.match(line)
        if match is None:
            raise SystemExit(f"floors: {setup_cfg}: install_requires {line!r} declares no >= floor")
        found.append((match.group(1), match.group(2)))
    if not found:
        raise SystemExit(f"floors: {setup_cfg}: no install_requires found")
    return found


def _release(version: str) -> tuple[int, ...]:
    """A release number without its trailing zeros: 26.10 and 26.10.0 are the same release."""
    parts = [int(p) for p in re.match(r"[0-9]+(?:\.[0-9]+)*", version).group(0).split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def check(constraints: str) -> None:
    """SystemExit unless each ``name==version`` of ``constraints`` is what is installed."""
    wrong = []
    with open(constraints, encoding="utf-8") as f:
        for line in f:
            name, _, version = line.strip().partition("==")
            try:
                installed = metadata.version(name)
            except metadata.PackageNotFoundError:
                installed = "nothing"
            if installed == "nothing" or _release(installed) != _release(version):
                wrong.append(f"{name}: {installed} installed, the floor is {version}")
            else:
                print(f"floors: {name} {installed}")
    if wrong:
        raise SystemExit("floors: " + "; ".join(wrong))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check"]:
        check(sys.argv[2])
    else:
        for name, floor in floors(sys.argv[1]):
            print(f"{name}=={floor}")
