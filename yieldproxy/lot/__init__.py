"""The parking lot: who holds the GPU, and what waits for it until when.

* :mod:`.state`: the yield state, who holds which upstream's GPU, why, until when;
* :mod:`.classify`: a request's class (interactive, batch, long, passthrough) from its route;
* :mod:`.parking`: the lot, a FIFO of Deferreds per class with deadlines, its entries in named
  states, and the hold bound;
* :mod:`.replay`: a drainer, the paced and capped release of the lot into one member (the
  scheduler, yieldproxy/schedule/, makes one per member and says what it takes).

Layer 5: it may import the core, servers/, observe/ and edge/; nothing of the upstream's, the
scheduler's or above.  It decides nothing about members.
"""
