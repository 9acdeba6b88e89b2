"""Named moments of a handover, where the tests of real processes act.

Each side calls :func:`reached` as it passes one of :data:`MOMENTS`; here it
does nothing.  tests/lifecycle/test_reload.py starts the proxy from a copy of
the package whose ``reached`` kills or stops a process at the moment a test
names, so that a death "at any moment of the handover" is a moment chosen,
not a race won.
"""

from __future__ import annotations

#: ``preparing``: the old process starts sending its lot;
#: ``held``: the new process holds a batch of parked requests (not read, not served);
#: ``commit``: the new process has the commit, and answers ``committed`` next;
#: ``committed``: the old process has read ``committed``, and lets go of its copies next.
MOMENTS = ("preparing", "held", "commit", "committed")


def reached(moment: str) -> None:
    """Nothing (see the module docstring)."""
