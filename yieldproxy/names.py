"""Names several parts share, each written once: the request classes, the hold sources, model names.

A name that is a metric label, a config key's value or a hold source must be
spelt the same in every module that uses it; this module is where it is
spelt.  It imports nothing from the package, so any module may import it.
"""

from __future__ import annotations

from typing import Iterable

#: The classes a parkable request may have (config.py gives each its policy and bounds).
CLASS_NAMES = ("interactive", "batch", "long")
#: The class of requests that never park (routes known to run no model).
PASSTHROUGH = "passthrough"
#: Every class a route rule may name.
ROUTE_CLASSES = (*CLASS_NAMES, PASSTHROUGH)

#: Hold sources of the proxy's own watchers (docs/watchers.md).
FILE_SOURCE = "file"
SIGNAL_SOURCE = "signal"
COMMAND_SOURCE = "command"
#: The outage watcher's: the upstream's own trouble, not a GPU lent away (no VRAM handover).
OUTAGE_SOURCE = "outage"
WATCHER_SOURCES = (FILE_SOURCE, SIGNAL_SOURCE, COMMAND_SOURCE, OUTAGE_SOURCE)
#: The sources yieldproxy itself uses: the watchers, the default of ``POST /yield``
#: and the demo.  Metrics name them; other sources count as ``other``.
BUILTIN_SOURCES = ("api", *WATCHER_SOURCES, "demo")


def canonical_model(name: str) -> str:
    """Ollama's full name for a model: ``all-minilm`` is listed as ``all-minilm:latest``.

    A tag is what follows the last ``:`` of the last path part
    (``registry:5000/library/m`` has none), and surrounding spaces go.
    """
    name = name.strip()
    return name if ":" in name.rsplit("/", 1)[-1] else name + ":latest"


def name_tuple(names: Iterable[str]) -> tuple[str, ...]:
    """``tuple``, typed: an attrs converter for a field of names (mypy cannot type plain ``tuple`` there)."""
    return tuple(names)


def name_set(names: Iterable[str]) -> frozenset[str]:
    """``frozenset``, typed, as :func:`name_tuple`."""
    return frozenset(names)
