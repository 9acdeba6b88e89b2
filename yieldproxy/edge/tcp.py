"""TCP_NODELAY, set the same way on every connection the proxy, its clients and the sim make.

Nagle's algorithm holds a small write back until the last one is
acknowledged: on a proxied request/answer that costs milliseconds per hop
(STYLE pitfall 9).  Every end that writes small HTTP pieces turns it off.
"""

from __future__ import annotations

from typing import Any


def set_no_delay(transport: Any) -> None:
    """Turn Nagle's algorithm off on ``transport`` when it is TCP.

    Anything else (a unix socket, TLS over a wrapped transport, an in-memory
    transport in tests) has no ``setTcpNoDelay`` and is left alone; a socket
    that closed meanwhile is no error either.
    """
    set_option = getattr(transport, "setTcpNoDelay", None)
    if set_option is None:
        return
    try:
        set_option(True)
    except OSError:
        pass
