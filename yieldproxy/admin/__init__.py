"""The admin listener's application: the admin API and the status page.

* :mod:`.api`: health, status, yield/resume, reload, metrics, and the page's routes;
* ``static/``: the status page itself (package data: HTML, CSS and JavaScript that
  poll ``/status`` and ``/history``).

Layer 10: it may import the core, servers/, observe/, edge/, lot/, upstream/,
watchers/, schedule/, proxy/ and lifecycle/; nothing of the composition roots' or the tools'.
"""
