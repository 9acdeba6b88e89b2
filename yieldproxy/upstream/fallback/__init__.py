"""The CPU fallback: serves embeddings while the GPU is yielded, only once it has proved itself.

Vectors from a different model poison a vector store without any error, so
a silent, unverified fallback is worse than an honest wait.  This one is
checked against the primary while the primary is there to compare with: at
start, every ``fallback.verify_interval_seconds``, and on demand (``POST
/fallback/verify``, ``yieldproxy check-fallback``).  Each mapped model embeds
the same probe texts on both sides; after L2 normalisation every text must
give the same dimension and a cosine of at least ``fallback.min_cosine``.

A model whose fallback was never verified, whose last verification failed,
or whose verification is older than ``fallback.max_verification_age_seconds``
is not used: its requests park as they would without a fallback, and
``/status``, the log and the metrics say why.

The fallback is a pool member (upstream/pool/members.py ``fallback_member``): a
standby one, used while the primary is yielded, that serves the mapped
embedding models translated, at most ``fallback.concurrency`` at once.
Beyond that a request it may serve parks *in line for it*: its drainer lets
out the next request it may serve, in the lot's one drain order, each time a
slot frees.  When the GPU comes back the primary's drainer takes what is
left, as ever.  When the fallback fails on a request, that request goes back
to its place in the lot and waits for the primary; it is not given to the
fallback again.  A caller never sees a fallback error.

Its verification is the twin verifier's (upstream/pool/twins.py), the one
verifier of "same vectors": this package gives it the fallback's terms
(:func:`.contract.fallback_contract`) and keeps what only ``[fallback]``
promises.  The package: :mod:`.backend` (the embedding client of each side),
:mod:`.contract` (the ``[fallback]``'s contract over the verifier and its
counts), :mod:`.check` (``yieldproxy check-fallback``); the comparison of
vectors is :mod:`yieldproxy.upstream.vectors`.

Part of upstream/ (layer 6): it may import what upstream/ may, and the rest of upstream/.
"""

from __future__ import annotations

from ..vectors import ProbeRow, Verification, compare
from .backend import EmbedBackend
from .check import check, check_command, format_table
from .contract import RETRY_AFTER_ERROR_SECONDS, Fallback, NotNow, fallback_contract

__all__ = [
    "RETRY_AFTER_ERROR_SECONDS", "NotNow", "EmbedBackend", "ProbeRow", "Verification", "compare",
    "Fallback", "fallback_contract", "format_table", "check", "check_command",
]
