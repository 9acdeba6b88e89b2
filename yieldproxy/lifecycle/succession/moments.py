"""Named moments of a handover, where the tests of real processes act.

Each side calls :func:`reached` as it passes one of :data:`MOMENTS`; here it
does nothing.  tests/lifecycle/test_reload.py starts the proxy from a copy of
the package whose ``reached`` kills or stops a process at the moment a test
names, so that a death "at any moment of the handover" is a moment chosen,
not a race won.  tests/lifecycle/test_reload_deaths.py acts at every one of
them, on either process.
"""

from __future__ import annotations

#: Every moment, in the order a handover passes them, with the process that passes it:
#: ``started``: the old process has started the new one (which has the listening sockets, nothing else);
#: ``ready``: the new process is up, and says ``ready`` next;
#: ``preparing``: the old process starts sending its lot;
#: ``held``: the new process holds a batch of parked requests (not read, not served);
#: ``commit``: the new process has the commit, and answers ``committed`` next;
#: ``acting``: ``committed`` has left the new process: it owns everything, and takes the holds and accepts next;
#: ``committed``: the old process has read ``committed``, and lets go of its copies next.
ORDER = (
    ("started", "old"),
    ("ready", "new"),
    ("preparing", "old"),
    ("held", "new"),
    ("commit", "new"),
    ("acting", "new"),
    ("committed", "old"),
)
MOMENTS = tuple(name for name, _side in ORDER)
#: Which process passes each moment.
SIDE = dict(ORDER)
#: The commit point: from this moment on the new process owns everything, before it the old one does.
COMMIT_POINT = "acting"


def reached(moment: str) -> None:
    """Nothing (see the module docstring)."""
