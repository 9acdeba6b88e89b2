"""The HTTP/1.1 edge: the proxy's own HTTP/1.1 server (both listeners') and its client for the upstream hop.

What each module does: docs/architecture.md (*The HTTP edge*, *The modules*).

Layer 4.  The layers below (the core, servers/, observe/) it may import, but it
imports none of them but :mod:`yieldproxy.states` (the named-states idiom, standard
library only): otherwise only the standard library, attrs, twisted and
zope.interface (``tests/edge/test_edge_reader.py`` checks it), so that it can be
read, tested and fuzzed alone.
"""
