"""The scheduler: one room for every decision about where a request goes and when.

* :mod:`.routing`: which members may serve a request (its :class:`~.routing.Routing`, decided once);
* :mod:`.lines`: a line per member of the parked entries it is eligible for, by kind of request;
* :mod:`.scheduler`: admission (go now, park, or refuse), the choice of member, when a member's
  drainer may let an entry out, and release;
* :mod:`.words`: what a refused caller reads: when to come back, what kept it waiting.

It decides over the lot (yieldproxy/lot/: a FIFO of Deferreds with deadlines, which knows no
member) and the members (yieldproxy/upstream/pool/: what each knows of itself); neither of them
calls the other.  Layer 7, beside watchers/ (neither imports the other): it may import the core,
servers/, observe/, edge/, lot/ and upstream/; nothing of the proxy's, the lifecycle's or above.
"""
