"""The scheduler: one room for every decision about where a request goes and when.

Its modules, and what each decides: docs/architecture.md, "The scheduler".

Layer 7, beside watchers/ (neither imports the other): it may import the core,
servers/, observe/, edge/, lot/ and upstream/; nothing of the proxy's, the lifecycle's or above.
"""
