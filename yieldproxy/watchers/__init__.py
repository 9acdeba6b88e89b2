"""Yield-state watchers: the ways the proxy learns that the GPU is taken.

Each watcher is a named holder of the yield state and a child service of the
proxy's; what each watches, and its ``/status`` section: docs/watchers.md.  A
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
