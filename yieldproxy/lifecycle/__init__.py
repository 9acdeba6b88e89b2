"""The process's life: its start, its stop, a restart and a reload.

What each module does: docs/architecture.md (*The modules*).

Layer 9: it may import the core, servers/, observe/, edge/, lot/, upstream/,
watchers/, schedule/ and proxy/; nothing of the admin API's, the composition roots' or the tools'.
"""
