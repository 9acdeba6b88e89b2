"""scripts/run and scripts/test install only when needed, so a second start works offline.

They run for real here, on a copy of the project, against a stand-in venv
whose ``pip``, ``twistd`` and ``pytest`` only record how they were called
(a real install needs the network and a minute), and whose Python has no
site-packages: every install needs the package index.  The reinstall after an
edit with no index reachable runs real pip, in a real venv that sees this test
run's packages (tests/test_scripts.py::test_offline_after_an_edit_and_after_reverting_it).
"""

from __future__ import annotations

import os
import shutil
import site
import socket
import subprocess
import sys
import time
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
    for name in ("setup.cfg", "pyproject.toml", "MANIFEST.in", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, copy / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "dropin.cache")
    for name in ("scripts", "yieldproxy", "twisted_plugins", "etc"):
        shutil.copytree(ROOT / name, copy / name, ignore=ignore)
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    log = tmp_path / "calls.log"
    # The venv's python runs the scripts' own Python code, without site-packages (nothing is installed
    # in the stand-in venv); the plugin-cache one-liner is only recorded.
    _executable(bin_dir / "python", f'#!/bin/sh\nif [ "$1" = -c ]; then echo "python -c" >> {log}; exit 0; fi\n'
                                    f'exec {sys.executable} -S "$@"\n')
    for tool in ("pip", "twistd", "pytest", "ruff", "mypy"):
        # A stand-in exits with $FAIL_<TOOL> (0 when unset), to show what a failed check does.
        _executable(bin_dir / tool, f'#!/bin/sh\necho "{tool} $*" >> {log}\necho "{tool} $*"\n'
                                    f'exit ${{FAIL_{tool.upper()}:-0}}\n')
    return copy, tmp_path / "venv", log


def _run(
    project, script: str, *args: str, offline: bool = False, fail: str | None = None, workers: str | None = None,
) -> tuple[subprocess.CompletedProcess, list[str]]:
    copy, venv, log = project
    before = log.read_text().splitlines() if log.exists() else []
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "YIELDPROXY_TEST_WORKERS")}
    env["VENV"] = str(venv)
    if workers is not None:
        env["YIELDPROXY_TEST_WORKERS"] = workers
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


#: pip, the first time: nothing to fall back on, so pip's own retries and timeout.
PIP_FIRST = "pip install --quiet"
#: pip, when it needs the package index and an install is there to fall back on: one try, a
#: short timeout (the machine may set PIP_DEFAULT_TIMEOUT=180).
PIP_INDEX = "pip install --quiet --retries 0 --timeout 10"
#: The build requirements (pyproject.toml) go into the venv with the project.
BUILD = "setuptools>=70.1"


def test_second_start_installs_nothing(project):
    first, calls = _run(project, "run", "--upstream", "http://127.0.0.1:11434")
    assert calls == [
        f"{PIP_FIRST} --upgrade pip",
        f"{PIP_FIRST} {BUILD} .",
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
    # (Nothing to fall back on for the tests: pip's own retries.)
    assert calls[:2] == [f"{PIP_FIRST} --upgrade pip", f"{PIP_FIRST} {BUILD} .[test]"]
    # On one worker more than the cores by default, whole modules each, the heavy ones first.
    assert calls[-1] == f"pytest -n {len(os.sched_getaffinity(0)) + 1} --dist loadfile --no-loadscope-reorder -q"
    _, calls = _run(project, "test", "-q", offline=True, workers="0")
    assert calls == [*STATIC_CHECKS, "pytest -n 0 --dist loadfile --no-loadscope-reorder -q"]
    # scripts/run is content with a venv that has more.
    _, calls = _run(project, "run", offline=True)
    assert calls == ["twistd -n --pidfile= yieldproxy"]
    # A regular install copies the code: a changed source file means a new install, extras kept.
    with (copy / "yieldproxy" / "tap.py").open("a") as f:
        f.write("\n# changed\n")
    _, calls = _run(project, "run")
    assert f"{PIP_INDEX} {BUILD} .[test]" in calls
    # So does a changed setup.cfg.
    with (copy / "setup.cfg").open("a") as f:
        f.write("\n")
    _, calls = _run(project, "test")
    assert f"{PIP_INDEX} {BUILD} .[test]" in calls
    _, calls = _run(project, "test", offline=True, workers="2")
    assert calls == [*STATIC_CHECKS, "pytest -n 2 --dist loadfile --no-loadscope-reorder"]


#: What scripts/test runs before pytest: ruff (rules in pyproject.toml), then mypy (setup.cfg).
STATIC_CHECKS = ["ruff check --quiet yieldproxy twisted_plugins tests bench", "mypy "]


@pytest.mark.parametrize("check", ["ruff", "mypy"])
def test_a_failed_static_check_stops_the_tests(project, check):
    """ruff and mypy run first, in the README's test command, and a finding fails it before pytest starts."""
    _run(project, "test", "-q")
    result, calls = _run(project, "test", "-q", offline=True, fail=check)
    assert calls == STATIC_CHECKS[: [c.split()[0] for c in STATIC_CHECKS].index(check) + 1]
    assert not any(call.startswith("pytest") for call in calls)


# -- a real reinstall, with no package index ---------------------------------------------------


def _real_venv(path: Path) -> Path:
    """A real venv with nothing installed in it, that sees this test run's packages (a .pth file).

    So its requirements and build requirements are met, as after a first
    ``scripts/run``, with no download; pip and twistd are this run's.
    """
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    [site_dir] = (path / "lib").glob("python3*/site-packages")
    (site_dir / "zz-outer.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    python = path / "bin" / "python"
    _executable(path / "bin" / "pip", f"#!{python}\nimport sys\nfrom pip._internal.cli.main import main\nsys.exit(main())\n")
    _executable(path / "bin" / "twistd", f"#!{python}\nfrom twisted.scripts.twistd import run\nrun()\n")
    return site_dir


def _ensure(copy: Path, venv: Path, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHONPATH"))}
    # No pip configuration of this machine (its extra indexes, its find-links): only what the test sets.
    full.update(PIP_CONFIG_FILE=os.devnull, PIP_DEFAULT_TIMEOUT="180", VENV=str(venv), **env)
    started = time.monotonic()
    result = subprocess.run(
        [str(copy / "scripts" / "ensure-venv")], capture_output=True, text=True, env=full, timeout=240,
    )
    return result, time.monotonic() - started


def test_offline_after_an_edit_and_after_reverting_it(project, tmp_path):
    """Issue 19: after an edit, with no index, the install failed and the marker was gone, even once reverted."""
    copy = project[0]
    venv = tmp_path / "real-venv"
    site_dir = _real_venv(venv)
    # The first run, with what it needs at hand (no index and no build isolation stand in for the network).
    first, _ = _ensure(copy, venv, PIP_NO_INDEX="1", PIP_NO_BUILD_ISOLATION="0")
    assert first.returncode == 0, first.stderr
    assert (site_dir / "yieldproxy" / "tap.py").read_text() == (copy / "yieldproxy" / "tap.py").read_text()
    installed = (venv / ".yieldproxy-installed").read_text()

    # An edit, and the index unreachable: the project alone is reinstalled, with no index.
    unreachable = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple"}
    with (copy / "yieldproxy" / "tap.py").open("a") as f:
        f.write("\n# edited offline\n")
    edited, _ = _ensure(copy, venv, **unreachable)
    assert edited.returncode == 0, edited.stderr
    assert "no package index needed" in edited.stderr
    assert (site_dir / "yieldproxy" / "tap.py").read_text().endswith("# edited offline\n")
    after_edit = (venv / ".yieldproxy-installed").read_text()
    assert after_edit != installed

    # A pull that needs a new dependency, and an index that accepts connections but never answers:
    # one try with a short timeout, then the install it has, said in one line.
    setup_cfg = (copy / "setup.cfg").read_text()
    (copy / "setup.cfg").write_text(setup_cfg.replace("install_requires =\n", "install_requires =\n    yieldproxy-absent-dependency>=1\n"))
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        index = f"http://127.0.0.1:{silent.getsockname()[1]}/simple"
        kept, elapsed = _ensure(copy, venv, PIP_INDEX_URL=index, YIELDPROXY_INDEX_TIMEOUT="2")
    assert kept.returncode == 0, kept.stderr
    lines = kept.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("Installing yieldproxy"), kept.stderr
    assert lines[1].startswith("ensure-venv: could not reinstall yieldproxy (") and "starting the install already in" in lines[1]
    assert elapsed < 60, f"{elapsed:.0f} s with an index that never answers"
    assert (venv / ".yieldproxy-installed").read_text() == after_edit
    assert (site_dir / "yieldproxy" / "tap.py").read_text().endswith("# edited offline\n")

    # Reverted: the venv is what the source is, so nothing to do and nothing said.
    (copy / "setup.cfg").write_text(setup_cfg)
    reverted, _ = _ensure(copy, venv, **unreachable)
    assert (reverted.returncode, reverted.stderr) == (0, "")
    # And scripts/run starts on it: twistd finds the installed plugin.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHONPATH"))}
    env.update(PIP_CONFIG_FILE=os.devnull, VENV=str(venv), **unreachable)
    started = subprocess.run(
        [str(copy / "scripts" / "run"), "--help"], capture_output=True, text=True, env=env, timeout=120,
    )
    assert started.returncode == 0 and "example-config" in started.stdout, started.stdout + started.stderr
