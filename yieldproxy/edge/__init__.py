"""The HTTP/1.1 edge: what turns bytes from a socket into requests and answers back.

It may import only the standard library, attrs and twisted: nothing of the
proxy's (``tests/test_edge_reader.py`` checks it), so that it can be read,
tested and fuzzed alone.

* :mod:`.h1wire`: the pieces of HTTP/1.1 framing the request reader and the
  upstream response parser (:mod:`yieldproxy.h1parse`) share: field lines,
  chunk-size lines, the state of a chunked body;
* :mod:`.reader`: the I/O-free request reader, bytes in, events out.
"""
