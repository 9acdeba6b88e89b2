"""Test-wide setup: import the code under test from this checkout, and tests/helpers."""

import atexit
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
# The checkout first: a stale installed copy must not shadow the code being tested.
# (Tests that spawn twistd use the installed copy; `make test` installs it first.)
sys.path[:0] = [os.path.dirname(HERE), HERE]

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
