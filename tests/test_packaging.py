"""The release artefacts: what the sdist and the wheel carry, and a clean build.

Both are built here with the build backend pyproject.toml names
(``setuptools.build_meta``), from a copy of this source tree, in a child
process: a few seconds.  CI (``.ci/wheel-smoke``) also builds them with
``python -m build`` in an isolated environment, installs the wheel into a
fresh virtualenv and serves through it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

# Real processes for half a minute or more: scripts/test starts this module first (conftest.py).
pytestmark = pytest.mark.heavy

ROOT = Path(__file__).resolve().parent.parent

#: Files a tester or packager needs from the sdist, whatever else changes.
SDIST_MUST_HAVE = [
    "LICENSE", "README.md", "setup.cfg", "pyproject.toml", "MANIFEST.in", "Makefile",
    "scripts/run", "scripts/test", "scripts/ensure-venv", ".ci/run", ".ci/floors", ".ci/smoke-wheel",
    "docs/configuration.md", "docs/quickstart.md", "docs/operating.md",
    "etc/yieldproxy.toml", "etc/systemd/yieldproxy.service", "etc/prometheus/yieldproxy-rules.yml",
    "bench/README.md", "bench/soak.py",
    "tests/conftest.py", "tests/helpers.py", "tests/rawhttp.py", "tests/test_docs.py",
    "twisted_plugins/yieldproxy_plugin.py", "yieldproxy/__init__.py", "yieldproxy/admin/static/index.html",
]
#: Tracked files that are the repository's, not the release's (CI's scripts are released:
#: the docs name them, and tests/test_docs.py checks that what they name exists).
NOT_RELEASED = re.compile(r"^\.gitignore$")
#: Left out of the copy the artefacts are built from.
IGNORED = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "*.pyc", ".pytest_cache", ".hypothesis",
    "_trial_temp", "dropin.cache",
)


def _tracked_files() -> list[str] | None:
    """The files of this checkout git knows or would add, or None outside a git checkout."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        return None
    result = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    if result.returncode != 0:
        return None
    return [name for name in result.stdout.splitlines() if (ROOT / name).is_file()]


def _build(kind: str, source: Path, out: Path) -> tuple[Path, str]:
    """Build the sdist or the wheel of ``source`` into ``out``: the artefact and the backend's output."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    code = f"from setuptools import build_meta; print(build_meta.build_{kind}({str(out)!r}))"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=source, env=env, capture_output=True, text=True, timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return out / result.stdout.strip().splitlines()[-1], output


@pytest.fixture(scope="module")
def artefacts(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    pytest.importorskip("setuptools", minversion="70.1", reason="the build backend (the test extra installs it)")
    tmp = tmp_path_factory.mktemp("artefacts")
    source = tmp / "source"
    tracked = _tracked_files()
    if tracked is None:
        shutil.copytree(ROOT, source, ignore=IGNORED)
    else:
        for name in tracked:
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    return {kind: _build(kind, source, tmp / "dist") for kind in ("sdist", "wheel")}


def _sdist_names(path: Path) -> set[str]:
    with tarfile.open(path) as tar:
        return {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}


def test_build_gives_no_warnings(artefacts):
    """Issue 13: yieldproxy.static (admin/static/ now) used to be "absent from the packages configuration"."""
    for kind, (_, output) in artefacts.items():
        warnings = [line for line in output.splitlines() if "warn" in line.lower() or line.startswith("!!")]
        assert warnings == [], f"{kind}:\n{output}"


def test_sdist_has_what_the_tests_and_docs_need(artefacts):
    names = _sdist_names(artefacts["sdist"][0])
    assert [name for name in SDIST_MUST_HAVE if name not in names] == []
    tracked = _tracked_files()
    if tracked is not None:
        # Every file of the source tree is released, but CI's own.
        assert sorted(n for n in tracked if not NOT_RELEASED.match(n) and n not in names) == []
    # Nothing generated or cached by a run in the checkout.
    assert [n for n in names if "__pycache__" in n or n.endswith((".pyc", "dropin.cache"))] == []


@pytest.fixture(scope="module")
def unpacked_sdist(artefacts, tmp_path_factory) -> Path:
    """The sdist, unpacked as a packager or a tester has it."""
    tmp = tmp_path_factory.mktemp("unpacked")
    with tarfile.open(artefacts["sdist"][0]) as tar:
        tar.extractall(tmp, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    [unpacked] = tmp.iterdir()
    return unpacked


def _pytest_in(directory: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=directory, env=env, capture_output=True, text=True, timeout=180,
    )


def test_sdist_tests_collect(unpacked_sdist):
    """The sdist's tests import their helpers and the sdist's own code: collecting them all proves it."""
    result = _pytest_in(unpacked_sdist, "--collect-only", "tests")
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"^\d+ tests collected", result.stdout, re.M), result.stdout


def test_sdist_docs_tests_pass(unpacked_sdist):
    """Issue 19: the docs name .ci/ scripts, which the sdist lacked, so its own test_docs.py failed."""
    result = _pytest_in(unpacked_sdist, "tests/test_docs.py")
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"^\d+ passed", result.stdout, re.M), result.stdout


def test_wheel_carries_the_package_data_and_the_license(artefacts):
    with zipfile.ZipFile(artefacts["wheel"][0]) as wheel:
        names = set(wheel.namelist())
        example = wheel.read("yieldproxy/etc/yieldproxy.toml").decode("utf-8")
    assert example == (ROOT / "etc" / "yieldproxy.toml").read_text(encoding="utf-8")
    for name in ("index.html", "status.css", "status.js"):
        assert f"yieldproxy/admin/static/{name}" in names
    assert "twisted/plugins/yieldproxy_plugin.py" in names
    # Every module and static file of the source, subpackages too (a new one must be in setup.cfg).
    source = [
        p.relative_to(ROOT).as_posix() for p in (ROOT / "yieldproxy").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith(".pyc")
    ]
    assert "yieldproxy/watchers/outage.py" in source
    assert sorted(n for n in source if n not in names) == []
    assert [n for n in names if re.fullmatch(r"yieldproxy-[^/]+\.dist-info/(licenses/)?LICENSE", n)]
    # All of etc/, the ops files too (yieldproxy ops-files writes them out), as they are in the source;
    # the tests stay out of the wheel.
    etc = {p.relative_to(ROOT / "etc").as_posix(): p for p in (ROOT / "etc").rglob("*") if p.is_file()}
    assert sorted(n for n in names if n.startswith("yieldproxy/etc/")) == sorted(f"yieldproxy/etc/{n}" for n in etc)
    with zipfile.ZipFile(artefacts["wheel"][0]) as wheel:
        assert [n for n, p in etc.items() if wheel.read(f"yieldproxy/etc/{n}") != p.read_bytes()] == []
    assert not [n for n in names if n.startswith(("tests/", "docs/", "bench/", ".ci/"))]


def test_the_artefacts_carry_the_version_the_package_says(artefacts):
    """The version is written once, in yieldproxy/__init__.py (setup.cfg: ``attr:``); both artefacts carry it."""
    version = re.search(r'^__version__ = "([^"]+)"$', (ROOT / "yieldproxy" / "__init__.py").read_text(), re.M).group(1)
    with zipfile.ZipFile(artefacts["wheel"][0]) as wheel:
        [metadata] = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
        assert f"\nVersion: {version}\n" in wheel.read(metadata).decode("utf-8")
    assert artefacts["sdist"][0].name == f"yieldproxy-{version}.tar.gz"
    assert artefacts["wheel"][0].name.startswith(f"yieldproxy-{version}-")


def test_the_wheels_ops_files_command_writes_its_own_copies(artefacts, tmp_path):
    """yieldproxy ops-files run from the wheel alone (no source tree near it) writes etc/ of the source."""
    unpacked = tmp_path / "wheel"
    with zipfile.ZipFile(artefacts["wheel"][0]) as wheel:
        wheel.extractall(unpacked)
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(unpacked)
    code = "import sys, yieldproxy.tools.cli as c; print(c.__file__, file=sys.stderr); c.main(sys.argv[1:])"
    result = subprocess.run(
        [sys.executable, "-c", code, "ops-files", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr.strip() == str(unpacked / "yieldproxy" / "tools" / "cli.py")
    written = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    etc = {p.relative_to(ROOT / "etc").as_posix(): p.read_bytes() for p in (ROOT / "etc").rglob("*") if p.is_file()}
    assert written == etc
    assert (out / "probes" / "nvidia-game-probe.sh").stat().st_mode & 0o111


def _metadata(artefacts) -> dict[str, tuple[object, str]]:
    """Each artefact's core metadata (the wheel's METADATA, the sdist's PKG-INFO), parsed, and its description."""
    import email.parser

    found = {}
    with zipfile.ZipFile(artefacts["wheel"][0]) as wheel:
        [name] = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
        found["wheel"] = wheel.read(name).decode("utf-8")
    with tarfile.open(artefacts["sdist"][0]) as tar:
        [member] = [m for m in tar.getmembers() if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO")]
        found["sdist"] = tar.extractfile(member).read().decode("utf-8")
    parsed = {}
    for kind, text in found.items():
        message = email.parser.Parser().parsestr(text)
        parsed[kind] = (message, message.get_payload() or message.get("Description", ""))
    return parsed


def test_the_metadata_is_what_an_index_shows(artefacts):
    """What PyPI (and twine check) reads: the README as a Markdown description, the classifiers a search
    filters on (one per Python version the floor and CI say, the OS it is tested on), the Python floor."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    floor = re.search(r"^python_requires = >=(3\.\d+)$", (ROOT / "setup.cfg").read_text(), re.M).group(1)
    for kind, (message, description) in _metadata(artefacts).items():
        assert message["Description-Content-Type"] == "text/markdown", kind
        assert description.strip() == readme.strip(), kind
        assert message["Requires-Python"] == f">={floor}", kind
        classifiers = message.get_all("Classifier")
        for wanted in ("Framework :: Twisted", f"Programming Language :: Python :: {floor}",
                       "Programming Language :: Python :: 3 :: Only", "Operating System :: POSIX :: Linux",
                       "Topic :: Internet :: Proxy Servers"):
            assert wanted in classifiers, (kind, wanted)
        assert [c for c in classifiers if c.startswith("Development Status :: ")], kind
        try:
            from trove_classifiers import classifiers as known
        except ImportError:
            continue
        assert sorted(set(classifiers) - known) == [], kind


def test_twine_check_passes(artefacts):
    """``twine check --strict`` on both, as an upload would run it (where twine is installed: the release's
    tools, docs/operating.md, not the test extra's)."""
    pytest.importorskip("twine", reason="twine is not installed (pip install twine to run the release check)")
    result = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(artefacts["sdist"][0]), str(artefacts["wheel"][0])],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("PASSED") == 2, result.stdout
