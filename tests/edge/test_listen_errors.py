"""The one-line causes of listeners that cannot start (the cases a real process cannot easily stage).

The common cases run for real in tests/test_twistd.py and tests/tools/test_cli.py.
"""

from __future__ import annotations

import errno
import os
import socket

import pytest
from twisted.internet.error import CannotListenError

from yieldproxy.edge.listen_errors import interface_at_fault, why_cannot_listen


def _os_error(code: int, filename=None, filename2=None) -> OSError:
    return OSError(code, os.strerror(code), filename, None, filename2)


@pytest.mark.parametrize(
    "error, cause",
    [
        (CannotListenError("127.0.0.1", 80, _os_error(errno.EACCES)),
         "permission denied (ports below 1024 need root or CAP_NET_BIND_SERVICE)"),
        (CannotListenError(None, b"/run/x/admin.sock", _os_error(errno.EACCES)), "permission denied"),
        # A live process holds the unix socket's lock file.
        (CannotListenError(None, b"/run/x/admin.sock", "Cannot acquire lock"),
         "another process listens on this socket (its .lock file is held)"),
        # The lock file next to the socket cannot be made: its directory is missing.
        (FileNotFoundError(errno.ENOENT, "No such file or directory", "1234", None, b"/run/x/admin.sock.lock"),
         "the directory /run/x does not exist"),
        (CannotListenError(None, b"/run/x/admin.sock", _os_error(errno.ENOENT)), "the directory /run/x does not exist"),
        (CannotListenError("192.0.2.1", 11435, _os_error(errno.EADDRNOTAVAIL)),
         "the interface is not an address of this machine"),
        (CannotListenError("999.1.1.1", 11435, socket.gaierror(socket.EAI_NONAME, "Name or service not known")),
         "the interface is neither an IP address nor a host name that resolves"),
        (OverflowError("bind(): port must be 0-65535."), "the port must be 0-65535"),
        (CannotListenError("127.0.0.1", 11435, _os_error(errno.EMFILE)), os.strerror(errno.EMFILE)),
    ],
)
def test_causes(error, cause):
    assert why_cannot_listen(error) == cause


def test_interface_at_fault():
    assert interface_at_fault(CannotListenError("999.1.1.1", 1, socket.gaierror(socket.EAI_NONAME, "x")))
    assert interface_at_fault(CannotListenError("192.0.2.1", 1, _os_error(errno.EADDRNOTAVAIL)))
    assert not interface_at_fault(CannotListenError("127.0.0.1", 1, _os_error(errno.EADDRINUSE)))
    assert not interface_at_fault(OverflowError("bind(): port must be 0-65535."))


def test_a_listener_says_which_it_is_and_where_it_listens():
    """Both sites are ProxySites: Twisted's own "ProxySite starting on N" line does not say which is which."""
    from twisted.internet import reactor
    from twisted.logger import capturedLogs, formatEvent
    from twisted.web.resource import Resource
    from twisted.web.server import Site

    from yieldproxy.edge.listener import Listener

    listener = Listener(reactor, "admin.listen", "tcp:0:interface=127.0.0.1", Site(Resource()))
    with capturedLogs() as events:
        listener.startService()
    try:
        port = listener.port.getHost().port
        lines = [formatEvent(e) for e in events if "listening on" in formatEvent(e)]
        assert lines == [f"admin listening on 127.0.0.1:{port} (admin.listen = 'tcp:0:interface=127.0.0.1')"]
    finally:
        listener.stopService()


@pytest.mark.parametrize(
    "typed, meant",
    [
        ("22450", "tcp:22450"),
        ("127.0.0.1:22450", "tcp:22450:interface=127.0.0.1"),
        ("localhost:22450", "tcp:22450:interface=127.0.0.1"),
        ("http://127.0.0.1:22450/", "tcp:22450:interface=127.0.0.1"),
        ("[::1]:22450", "tcp:22450:interface=\\:\\:1"),
        ("bogus:x", None),
    ],
)
def test_an_endpoint_typed_as_a_port_or_an_address_gets_the_endpoint_meant(typed, meant):
    from yieldproxy.tap import endpoint_hint

    assert endpoint_hint(typed) == meant
