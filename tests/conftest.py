"""Test-wide setup: import the code under test from this checkout, and the tests' helpers by bare name."""

import atexit
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
# tests/ mirrors the package's layers (tests/edge/, tests/upstream/pool/, ...); its modules import
# their helpers and each other by bare name (``from helpers import ...``, ``from test_burst import
# Burst``) wherever they are, so tests/ and every directory under it are on the path.
TEST_DIRS = [HERE] + sorted(
    d for d, _, _ in os.walk(HERE)
    if d != HERE and not any(part.startswith((".", "__")) for part in os.path.relpath(d, HERE).split(os.sep))
)
# The checkout first: a stale installed copy must not shadow the code being tested.
# (Tests that spawn twistd use the installed copy; `make test` installs it first.)
sys.path[:0] = [os.path.dirname(HERE), *TEST_DIRS]

# Real processes (twistd, the CLI) keep their holds under $XDG_STATE_HOME (yieldproxy/lifecycle/holdstore.py):
# this run's own directory, not the user's, and no systemd StateDirectory= inherited.
_STATE_HOME = tempfile.mkdtemp(prefix="yieldproxy-tests-state-")
atexit.register(shutil.rmtree, _STATE_HOME, True)
os.environ["XDG_STATE_HOME"] = _STATE_HOME
os.environ.pop("STATE_DIRECTORY", None)


def pytest_collection_modifyitems(items):
    """Modules marked ``heavy`` (real processes or servers for many seconds) go first, in their order.

    scripts/test hands whole modules to its workers in this order
    (``--dist loadfile --no-loadscope-reorder``), so no worker starts a long
    module when the others are running out of work.
    """
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)
