"""The parking lot: who holds the GPU, what waits for it, and who may go now.

* :mod:`.state`: the yield state, who holds which upstream's GPU, why, until when;
* :mod:`.classify`: a request's class (interactive, batch, long, passthrough) from its route;
* :mod:`.parking`: the lot, a line per pool member, the parked entries in named states,
  and the hold bound;
* :mod:`.gate`: go now (and where), park, or refuse with the reasons; it asks the pool
  through a Protocol of its own (:class:`~.gate.Upstreams`);
* :mod:`.replay`: each member's drainer, the paced release of the lot.

Layer 5: it may import the core, servers/, observe/ and edge/; nothing of the
upstream's or above (the gate's pool is a Protocol, not the pool's module).
"""
