"""Names several parts share, each written once: the request classes, the hold sources, model names.

A name that is a metric label, a config key's value or a hold source must be
spelt the same in every module that uses it; this module is where it is
spelt.  It imports nothing from the package, so any module may import it.
"""

from __future__ import annotations

import re
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
#: A pool member's own hold when it stays not ready past ``upstream.not_ready_max_seconds``
#: (upstream/pool/member.py): a key apart from the outage watcher's, so neither ends the other's hold.
LOADING_SOURCE = "loading"
#: Holds the proxy takes for an upstream's own trouble, not a GPU lent away: the upstream
#: reads ``outage`` under them alone, and no VRAM handover follows them.
TROUBLE_SOURCES = (OUTAGE_SOURCE, LOADING_SOURCE)
#: The hold a start takes when the holds file of the last run was refused (lifecycle/holdstore.py):
#: when in doubt, no work goes to a GPU that may be taken.
RESTART_SOURCE = "restart"
#: Sources of holds the proxy takes itself: never refused by ``admin.max_holds``.
OWN_SOURCES = (*WATCHER_SOURCES, LOADING_SOURCE, RESTART_SOURCE)
#: The sources yieldproxy itself uses: the watchers, the default of ``POST /yield``,
#: the restart hold and the demo.  Metrics name them; other sources count as ``other``.
BUILTIN_SOURCES = ("api", *OWN_SOURCES, "demo")
#: How long a hold source may be (:func:`check_source`).
MAX_SOURCE_LENGTH = 64
_SOURCE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_source(source: object) -> str:
    """``source`` if it is a valid hold source, else :class:`ValueError` saying why.

    Letters, digits, ``.``, ``_`` and ``-``, starting with a letter or a digit,
    at most 64 characters: safe in a log line, a metric label and a terminal.
    """
    if not isinstance(source, str):
        raise ValueError("source must be a string")
    if not source:
        raise ValueError("source must not be empty")
    if len(source) > MAX_SOURCE_LENGTH:
        raise ValueError(f"source is longer than {MAX_SOURCE_LENGTH} characters")
    if not _SOURCE.fullmatch(source):
        raise ValueError(
            "source may hold only letters, digits, '.', '_' and '-', and must start with a letter or a digit"
        )
    return source


#: Ollama's defaults for the parts a model name leaves out (``types/model/name.go``, ``DefaultName``).
OLLAMA_HOST = "registry.ollama.ai"
OLLAMA_NAMESPACE = "library"
OLLAMA_TAG = "latest"


def canonical_model(name: str) -> str:
    """One key per model as Ollama tells models apart: ``ALL-MINILM``, ``all-minilm:Latest`` and
    ``registry.ollama.ai/library/all-minilm:latest`` are all ``all-minilm:latest``.

    Ollama reads a name with ``ParseName`` (ollama/ollama ``types/model/name.go``,
    read at fb30760): ``ParseNameBare`` cuts the tag at the last ``:`` only
    when it comes after the last ``/`` (so ``registry:5000/library/m`` has
    none), then the model, the namespace and the host at each ``/`` from the
    right (a ``scheme://`` before the host is dropped); ``Merge`` with
    ``DefaultName`` fills the missing host, namespace and tag.  Two names are
    one model when their parts compare equal ignoring case (``Name.EqualFold``;
    ``getExistingName`` in ``server/routes.go`` maps a name onto the stored
    one that way).  The key is ``DisplayShortest``'s form of the parsed name
    (host and namespace only when they are not the defaults), lower-cased.
    Surrounding spaces go.
    """
    name = name.strip()
    tag = ""
    if name.rfind(":") > name.rfind("/"):
        name, _, tag = name.rpartition(":")
        # ``cutPromised``: a part promised by the tag's ':' but empty is missing (an invalid name), not the default.
        name, tag = name or "!MISSING!", tag or "!MISSING!"
    host = namespace = ""
    rest, slash, model = name.rpartition("/")
    if slash:
        # ``cutPromised``: a part promised by a separator but empty is Ollama's MissingPart.
        model = model or "!MISSING!"
        rest = rest or "!MISSING!"
        host_part, slash, namespace = rest.rpartition("/")
        if slash:
            namespace = namespace or "!MISSING!"
            host = host_part or "!MISSING!"
            # ``strings.Cut(s, "://")``: the scheme ends at the first ``://``.
            host = host.partition("://")[2] if "://" in host else host
        else:
            namespace = rest
    host = (host or OLLAMA_HOST).lower()
    namespace = (namespace or OLLAMA_NAMESPACE).lower()
    key = f"{model}:{tag or OLLAMA_TAG}".lower()
    if host != OLLAMA_HOST:
        return f"{host}/{namespace}/{key}"
    if namespace != OLLAMA_NAMESPACE:
        return f"{namespace}/{key}"
    return key


def name_tuple(names: Iterable[str]) -> tuple[str, ...]:
    """``tuple``, typed: an attrs converter for a field of names (mypy cannot type plain ``tuple`` there)."""
    return tuple(names)


def name_set(names: Iterable[str]) -> frozenset[str]:
    """``frozenset``, typed, as :func:`name_tuple`."""
    return frozenset(names)
