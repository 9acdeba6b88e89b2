"""The upstreams: one attempt at one, the verdict on it, and what is known of each.

* :mod:`.attempt`: one attempt on an upstream, streamed back to the client (the hop);
  :mod:`.translated_attempt`: the same on a member of another dialect, translated
  there and back with :mod:`.translation`;
* :mod:`.verdict`: why an attempt failed and what becomes of its request (pure);
  :mod:`.evidence`: which evidence judges a failed model call;
* :mod:`.health`, :mod:`.served`, :mod:`.failing`: an upstream's health, what it is
  known to serve, the models judged failing alone on it;
* :mod:`.control`: control-plane calls (probes, ``/api/ps``, loads and unloads);
  :mod:`.vram`: the VRAM handover (unload when yielded, preload before the replay);
* :mod:`.vectors`: whether two servers give the same vectors;
* :mod:`.pool`: the members and where a request goes; :mod:`.fallback`: the CPU
  fallback's contract over its member.

Layer 6: it may import the core, servers/, observe/, edge/ and lot/; nothing of
the watchers', the proxy's or above.
"""
