"""The proxy listener's application: what the proxy does with each request it is sent.

* :mod:`.handler`: the Klein app (the listener's one entry), its site and the listener's refusals;
* :mod:`.resource`: the leaf its route hands each request to, which writes the handler's answer;
* :mod:`.target`: one request target, read the way Ollama's Go server reads it, or refused;
* :mod:`.admission`: what a request is: an answer now, a passthrough, or an entry for the scheduler;
* :mod:`.attempts`: the attempt loop of a gated request, acting on the verdict;
* :mod:`.back_in_line`: the verdicts that send a failed attempt back to its place, uncounted;
* :mod:`.passthrough`: routes that never park;
* :mod:`.calls`: a request's call as a member takes it, and what it tells the member's health;
* :mod:`.facts`, :mod:`.outcome`: a request's facts, its answers, its outcome written once.

Layer 8: it may import the core, servers/, observe/, edge/, lot/, upstream/ and
watchers/; nothing of the lifecycle's, the admin API's or above.
"""
