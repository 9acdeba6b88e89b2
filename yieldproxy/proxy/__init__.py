"""The proxy listener's application: what the proxy does with each request it is sent.

Its rooms, and what each decides: docs/architecture.md, "The proxy app" (and every module: "The modules").

Layer 8: it may import the core, servers/, observe/, edge/, lot/, upstream/ and
watchers/; nothing of the lifecycle's, the admin API's or above.
"""
