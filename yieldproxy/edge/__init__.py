"""The HTTP/1.1 edge: the proxy's own HTTP/1.1 server and client, and the sockets they run on.

The server, both listeners' (the proxy's and the admin API's):

* :mod:`.reader`: the I/O-free request reader, bytes in, events out;
* :mod:`.connection`: one client connection in named states, each owning its resources;
* :mod:`.request`, :mod:`.writer`, :mod:`.site`: a request answered here when it must
  never reach the app, what a connection writes and when the client has it, the
  factory of connections with its limits and timeouts;
* :mod:`.capacity`: the connection cap and the receiving budget;
* :mod:`.refusal`: the one answer the edge gives without the app, whoever refuses;
* :mod:`.hosts`: the ``Host`` policy and the cross-site check;
* :mod:`.listener`, :mod:`.listen_errors`, :mod:`.sockets`: a listener as a service,
  why one could not start, letting go of a socket a reload hands over.

The client, for the upstream hop: :mod:`.h1client` (persistent connections to one
server) and :mod:`.h1parse` (its incremental response parser).  :mod:`.h1wire` is
the framing both directions share; :mod:`.tcp` sets ``TCP_NODELAY`` on every
connection.

Layer 4.  The layers below (the core, servers/, observe/) it may import, but it
imports none of them but :mod:`yieldproxy.states` (the named-states idiom, standard
library only): otherwise only the standard library, attrs, twisted and
zope.interface (``tests/edge/test_edge_reader.py`` checks it), so that it can be
read, tested and fuzzed alone.
"""
