"""Yield-state watchers: the ways the proxy learns that the GPU is taken.

Each watcher is a named holder of the yield state (the GPU is yielded while
any source holds it) and a :class:`~twisted.application.service.Service`,
a child of the proxy's service (:func:`yieldproxy.service.build` makes the
enabled ones from the config):

* :mod:`.state_file` (source ``file``): a file exists;
* :mod:`.signals` (source ``signal``): SIGUSR1 / SIGUSR2;
* :mod:`.command` (source ``command``): a probe command exits 0;
* :mod:`.outage` (source ``outage``): the upstream, once reachable, fails.

Each has a ``status()`` for the ``watchers`` section of ``/status``.  A
watcher that stops leaves its hold in place: a yielded GPU stays yielded
through a shutdown.

Layer 7, beside schedule/ (neither imports the other): it may import the core, servers/,
observe/, edge/, lot/ and upstream/ (the outage watcher reads an upstream's health and asks its
control plane); nothing of the proxy's, the lifecycle's or above.
"""

from __future__ import annotations

from .command import CommandWatcher
from .outage import OutageWatcher, UpstreamProbe
from .signals import SignalWatcher
from .state_file import StateFileWatcher

__all__ = ["CommandWatcher", "OutageWatcher", "SignalWatcher", "StateFileWatcher", "UpstreamProbe"]
