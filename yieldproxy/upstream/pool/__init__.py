"""The upstream pool: several upstreams, each with its own yield state (docs/pool.md).

Which one takes a request, and when, is the scheduler's (yieldproxy/schedule/).
Its modules: docs/architecture.md ("The modules").

Part of upstream/ (layer 6): it may import what upstream/ may, and the rest of upstream/.
"""
