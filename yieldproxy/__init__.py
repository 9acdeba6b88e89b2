"""yieldproxy: park requests while the GPU is yielded, replay them when it returns.

The public API is :data:`__all__`, each name loaded from its module (``_PUBLIC``) when it is first used,
so that a broker's ``from yieldproxy import Admin`` imports the standard library only, not Twisted
(docs/embedding.md).  The package is in layers (``tests/test_layers.py``, docs/architecture.md); this
module is above them all, and any module may take :data:`__version__` from it, the one place the version
is written (setup.cfg reads it).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: Each public name: the module it lives in, and its name there.
_PUBLIC = {
    "Admin": ("yieldproxy.tools.broker", "Admin"),
    "AsyncAdmin": ("yieldproxy.tools.broker", "AsyncAdmin"),
    "AdminError": ("yieldproxy.tools.broker", "AdminError"),
    "AdminUnreachable": ("yieldproxy.tools.broker", "AdminUnreachable"),
    "build": ("yieldproxy.service", "build"),
    "Proxy": ("yieldproxy.service", "Proxy"),
    "CannotListen": ("yieldproxy.edge.listener", "CannotListen"),
    "run_on_monotonic": ("yieldproxy.clock", "run_on_monotonic"),
    "Config": ("yieldproxy.config", "Config"),
    "ConfigError": ("yieldproxy.config", "ConfigError"),
    "load_config": ("yieldproxy.config", "load"),
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> Any:
    """A public name, imported from its module the first time it is asked for (PEP 562)."""
    try:
        module, attribute = _PUBLIC[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
