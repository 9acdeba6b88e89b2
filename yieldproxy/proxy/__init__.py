"""The proxy listener's application: what the proxy does with each request it is sent.

* :mod:`.target`: one request target, read the way Ollama's Go server reads it, or refused;
* :mod:`.handler`: classify, gate, park and forward to a pool member, acting on the verdict;
* :mod:`.resource`: the listener's resource, the handler called directly (Klein's router
  only for odd paths).

Layer 8: it may import the core, servers/, observe/, edge/, lot/, upstream/ and
watchers/; nothing of the lifecycle's, the admin API's or above.
"""
