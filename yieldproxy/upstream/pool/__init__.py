"""The upstream pool (issue 12): several upstreams, each with its own yield state.

Which one takes a request, and when, is the scheduler's (yieldproxy/schedule/).

* :mod:`.members`: each ``[[upstreams]]`` table (or ``proxy.upstream``, and
  an enabled ``[fallback]``) with its defaults resolved, and what the number
  of members decides (:class:`~.members.PoolShape`);
* :mod:`.models`: which models a member serves, configured or discovered;
* :mod:`.member`: one member as it runs (available or not, and why);
* :mod:`.routing`: the members made from their specs; which api serves which embedding route natively;
* :mod:`.twins`: which members may serve a model's embeddings (its reference, verified twins);
* :mod:`.lists`: ``GET /api/tags`` and ``/v1/models`` as the union of the members' lists;
* :mod:`.rename`: a body's model renamed to the one a member serves it as.

Part of upstream/ (layer 6): it may import what upstream/ may, and the rest of upstream/.
"""
