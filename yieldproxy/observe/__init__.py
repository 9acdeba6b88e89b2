"""What the proxy tells about itself: the metrics, the status page's history, the request log.

* :mod:`.metrics`: every Prometheus family (docs/metrics.md);
* :mod:`.history`: the ring buffer of samples the status page charts;
* :mod:`.requestlog`: one line per proxied request, and the JSON log format.

Layer 3: it may import the core (names, text, clock, periodic, callbacks,
errors, config) and servers/, nothing above; every layer above may import it.
"""
