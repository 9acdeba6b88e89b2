"""The upstreams: one attempt at one, the verdict on it, and what is known of each.

Its modules and the facts each owns: docs/architecture.md ("The modules", "Who owns which fact").

Layer 6: it may import the core, servers/, observe/, edge/ and lot/; nothing of
the watchers', the proxy's or above.
"""
