"""scripts/run and scripts/test install only when needed, so a second start works offline.

They run for real here, on a copy of the project, against a stand-in venv
whose ``pip``, ``twistd`` and ``pytest`` only record how they were called
(a real install needs the network and a minute).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="the scripts are bash")


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


@pytest.fixture
def project(tmp_path):
    """A copy of what the scripts read, and a stand-in venv in ``tmp/venv``."""
    copy = tmp_path / "project"
    copy.mkdir()
    for name in ("setup.cfg", "pyproject.toml"):
        shutil.copy2(ROOT / name, copy / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "dropin.cache")
    for name in ("scripts", "yieldproxy", "twisted_plugins"):
        shutil.copytree(ROOT / name, copy / name, ignore=ignore)
    (copy / "etc").mkdir()
    shutil.copy2(ROOT / "etc" / "yieldproxy.toml", copy / "etc" / "yieldproxy.toml")
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    log = tmp_path / "calls.log"
    # The venv's python runs the scripts' own Python code; the plugin-cache one-liner is only recorded.
    _executable(bin_dir / "python", f'#!/bin/sh\nif [ "$1" = -c ]; then echo "python -c" >> {log}; exit 0; fi\n'
                                    f'exec {sys.executable} "$@"\n')
    for tool in ("pip", "twistd", "pytest", "ruff", "mypy"):
        # A stand-in exits with $FAIL_<TOOL> (0 when unset), to show what a failed check does.
        _executable(bin_dir / tool, f'#!/bin/sh\necho "{tool} $*" >> {log}\necho "{tool} $*"\n'
                                    f'exit ${{FAIL_{tool.upper()}:-0}}\n')
    return copy, tmp_path / "venv", log


def _run(
    project, script: str, *args: str, offline: bool = False, fail: str | None = None,
) -> tuple[subprocess.CompletedProcess, list[str]]:
    copy, venv, log = project
    before = log.read_text().splitlines() if log.exists() else []
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env["VENV"] = str(venv)
    if offline:
        env["PIP_NO_INDEX"] = "1"
    if fail is not None:
        env[f"FAIL_{fail.upper()}"] = "1"
    result = subprocess.run(
        [str(copy / "scripts" / script), *args], capture_output=True, text=True, env=env, timeout=60,
    )
    assert (result.returncode != 0) == (fail is not None), result.stdout + result.stderr
    calls = log.read_text().splitlines()[len(before):]
    return result, calls


def test_second_start_installs_nothing(project):
    first, calls = _run(project, "run", "--upstream", "http://127.0.0.1:11434")
    assert calls == [
        "pip install --quiet --upgrade pip",
        "pip install --quiet .",
        "python -c",
        "twistd -n --pidfile= yieldproxy --upstream http://127.0.0.1:11434",
    ]
    assert "Installing yieldproxy into" in first.stderr
    # Again, with no package index: straight to twistd, not a word from the install step.
    second, calls = _run(project, "run", "--upstream", "http://127.0.0.1:11434", offline=True)
    assert calls == ["twistd -n --pidfile= yieldproxy --upstream http://127.0.0.1:11434"]
    assert second.stderr == ""


def test_an_extra_or_a_changed_project_installs_again(project):
    copy, _, _ = project
    _run(project, "run")
    # scripts/test wants the test extra: installed once, then not again.
    _, calls = _run(project, "test", "-q")
    assert calls[:2] == ["pip install --quiet --upgrade pip", "pip install --quiet .[test]"]
    assert calls[-1] == "pytest -q"
    _, calls = _run(project, "test", "-q", offline=True)
    assert calls == [*STATIC_CHECKS, "pytest -q"]
    # scripts/run is content with a venv that has more.
    _, calls = _run(project, "run", offline=True)
    assert calls == ["twistd -n --pidfile= yieldproxy"]
    # A regular install copies the code: a changed source file means a new install, extras kept.
    with (copy / "yieldproxy" / "tap.py").open("a") as f:
        f.write("\n# changed\n")
    _, calls = _run(project, "run")
    assert "pip install --quiet .[test]" in calls
    # So does a changed setup.cfg.
    with (copy / "setup.cfg").open("a") as f:
        f.write("\n")
    _, calls = _run(project, "test")
    assert "pip install --quiet .[test]" in calls
    _, calls = _run(project, "test", offline=True)
    assert calls == [*STATIC_CHECKS, "pytest "]


#: What scripts/test runs before pytest: ruff (rules in pyproject.toml), then mypy (setup.cfg).
STATIC_CHECKS = ["ruff check --quiet yieldproxy twisted_plugins tests bench", "mypy "]


@pytest.mark.parametrize("check", ["ruff", "mypy"])
def test_a_failed_static_check_stops_the_tests(project, check):
    """ruff and mypy run first, in the README's test command, and a finding fails it before pytest starts."""
    _run(project, "test", "-q")
    result, calls = _run(project, "test", "-q", offline=True, fail=check)
    assert calls == STATIC_CHECKS[: [c.split()[0] for c in STATIC_CHECKS].index(check) + 1]
    assert not any(call.startswith("pytest") for call in calls)
