"""The package's public face: ``yieldproxy.__all__``, each name loaded when first used, and the version written once."""

from __future__ import annotations

import configparser
import subprocess
import sys
from pathlib import Path

import pytest

import yieldproxy

ROOT = Path(__file__).resolve().parent.parent


def test_all_names_the_public_api_and_each_name_is_its_modules_own():
    from yieldproxy.clock import run_on_monotonic
    from yieldproxy.config import Config, ConfigError, load
    from yieldproxy.edge.listener import CannotListen
    from yieldproxy.service import Proxy, build
    from yieldproxy.tools.broker import Admin, AdminError, AdminUnreachable, AsyncAdmin

    public = {
        "Admin": Admin, "AsyncAdmin": AsyncAdmin, "AdminError": AdminError, "AdminUnreachable": AdminUnreachable,
        "build": build, "Proxy": Proxy, "CannotListen": CannotListen, "run_on_monotonic": run_on_monotonic,
        "Config": Config, "ConfigError": ConfigError, "load_config": load,
    }
    assert sorted(yieldproxy.__all__) == sorted(["__version__", *public])
    for name, value in public.items():
        assert getattr(yieldproxy, name) is value, name
    assert set(yieldproxy.__all__) <= set(dir(yieldproxy))
    namespace: dict = {}
    exec("from yieldproxy import *", namespace)
    assert {name: namespace[name] for name in public} == public


def test_a_name_the_package_does_not_have_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'yieldproxy' has no attribute 'Nothing'"):
        yieldproxy.Nothing
    with pytest.raises(ImportError):
        exec("from yieldproxy import Nothing", {})


def test_a_broker_importing_admin_imports_no_twisted():
    """``from yieldproxy import Admin`` loads the broker library alone: the standard library, no web stack."""
    code = (
        "import sys\n"
        "import yieldproxy\n"
        "loaded = set(sys.modules)\n"
        "from yieldproxy import Admin, AdminError, __version__\n"
        "assert Admin.__module__ == 'yieldproxy.tools.broker', Admin.__module__\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('twisted', 'klein', 'treq', 'attrs', 'werkzeug')))\n"
        "print(sorted(m for m in loaded if m.startswith('yieldproxy')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[]", "['yieldproxy']"]


def test_the_version_is_written_once():
    """In yieldproxy/__init__.py; setup.cfg reads it from there (tests/test_packaging.py: the artefacts carry it)."""
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg", encoding="utf-8")
    assert setup["metadata"]["version"] == "attr: yieldproxy.__version__"
    written = [
        path.relative_to(ROOT).as_posix() for path in sorted((ROOT / "yieldproxy").rglob("*.py"))
        if "__version__ = " in path.read_text(encoding="utf-8")
    ]
    assert written == ["yieldproxy/__init__.py"]
