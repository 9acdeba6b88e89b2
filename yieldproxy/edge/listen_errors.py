"""Why a listener could not start, in a few words for whoever configured it.

Binding fails for ordinary reasons (a port in use, a port out of range, an
interface that is not this machine's, a unix socket's directory missing), and
Twisted reports each as a traceback.  twistd and ``yieldproxy sim`` print
one line instead: the option, the value, and :func:`why_cannot_listen`.
"""

from __future__ import annotations

import errno
import os
import socket

from twisted.internet.error import CannotListenError

__all__ = ["why_cannot_listen", "interface_at_fault"]


def _cause(error: BaseException) -> object:
    """The underlying error: CannotListenError wraps the socket's (or a plain string)."""
    if isinstance(error, CannotListenError):
        return error.socketError
    return error


def interface_at_fault(error: BaseException) -> bool:
    """True when the interface (the address to listen on), not the port, is the problem."""
    cause = _cause(error)
    return isinstance(cause, socket.gaierror) or (
        isinstance(cause, OSError) and cause.errno == errno.EADDRNOTAVAIL
    )


def _unix_path(error: BaseException, cause: object) -> str | None:
    """The socket path of a failed unix listener, if the error tells it."""
    path = getattr(error, "port", None) if isinstance(error, CannotListenError) else None
    if path is None and isinstance(cause, OSError) and cause.filename2 is not None:
        # The lock file next to the socket (twisted.python.lockfile) failed first.
        path = cause.filename2
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if isinstance(path, str):
        return path.removesuffix(".lock")
    return None


def why_cannot_listen(error: BaseException) -> str:
    """A short cause for ``error``, raised while a server endpoint started listening."""
    cause = _cause(error)
    if isinstance(cause, str):
        # twisted.internet.unix: another live process holds the socket's lock file.
        if "lock" in cause:
            return "another process listens on this socket (its .lock file is held)"
        return cause
    if isinstance(cause, OverflowError):
        return "the port must be 0-65535"
    if isinstance(cause, socket.gaierror):
        return "the interface is neither an IP address nor a host name that resolves"
    if not isinstance(cause, OSError):
        return str(cause) or type(cause).__name__
    port = getattr(error, "port", None)
    if cause.errno == errno.EADDRINUSE:
        return "address already in use (another process listens there)"
    if cause.errno == errno.EADDRNOTAVAIL:
        return "the interface is not an address of this machine"
    if cause.errno in (errno.EACCES, errno.EPERM):
        if isinstance(port, int) and 0 < port < 1024:
            return "permission denied (ports below 1024 need root or CAP_NET_BIND_SERVICE)"
        return "permission denied"
    if cause.errno == errno.ENOENT:
        path = _unix_path(error, cause)
        if path:
            return f"the directory {os.path.dirname(path) or '.'} does not exist"
        return "no such file or directory"
    return cause.strerror or str(cause)
