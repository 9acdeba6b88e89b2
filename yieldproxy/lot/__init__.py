"""The parking lot: who holds the GPU, and what waits for it until when.

Its modules (the yield state, a request's class, the lot, a member's drainer): docs/architecture.md,
"The modules"; what the lot leaves to the scheduler: "The scheduler".

Layer 5: it may import the core, servers/, observe/ and edge/; nothing of the upstream's, the
scheduler's or above.  It decides nothing about members.
"""
