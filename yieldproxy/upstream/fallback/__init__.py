"""The CPU fallback: serves embeddings while the GPU is yielded, only once it has proved itself.

Vectors from another model poison a vector store without any error, so the fallback serves
a model only while its vectors were verified equal to the primary's.  It is a standby pool
member (upstream/pool/members.py); its verification is the one twin verifier's
(upstream/pool/twins.py), given the fallback's terms by :func:`.contract.fallback_contract`.
This package keeps what only ``[fallback]`` promises: :mod:`.backend` (each side's
embedding client), :mod:`.contract` (the contract and its counts), :mod:`.check`
(``yieldproxy check-fallback``).  What it promises: docs/fallback.md.
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
