"""Whether two embedding servers give the same vectors: probe texts compared one by one.

Vectors from a different model poison a vector store without any error, so
a copy (the CPU fallback, a pool member's twin) is used only once its
vectors were compared with the reference's: after L2 normalisation each
probe text must give the same dimension and a cosine of at least the
configured minimum.  Pure functions and values; the callers embed.
"""

from __future__ import annotations

import unicodedata
from typing import Any, Callable, Sequence

import attrs

from ..clock import same
from .translation import cosine, l2_normalise

#: A probe text longer than this (in characters: about 250 word pieces of English)
#: may pass a server's truncation limit: when only such texts differ, the reason says so.
LONG_TEXT_CHARS = 1000


@attrs.frozen
class ProbeRow:
    """One probe text compared on both sides."""

    text: str
    primary_dimension: int
    fallback_dimension: int
    #: None when the dimensions differ (no cosine to compute).
    cosine: float | None
    ok: bool


@attrs.frozen
class Verification:
    """The last word on one mapped model: may its fallback be used?"""

    model: str
    fallback_model: str
    ok: bool
    at: float
    #: The lowest cosine over the probe texts, when both sides answered.
    worst_cosine: float | None = None
    #: Why it failed ("" when it passed).
    reason: str = ""
    rows: tuple[ProbeRow, ...] = ()

    def as_json(self, now: float, shown: Callable[[float], float] = same) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "at": shown(self.at),
            "age_seconds": max(0.0, now - self.at),
            "worst_cosine": self.worst_cosine,
            "reason": self.reason or None,
            "dimension": self.rows[0].primary_dimension if self.rows else None,
            "texts": len(self.rows),
        }


def _width(text: str) -> int:
    """Terminal columns: wide (CJK, most emoji) characters take two."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def _short(text: str, limit: int = 40) -> str:
    """One line of at most ``limit`` columns."""
    flat = " ".join(text.split())
    if _width(flat) <= limit:
        return flat
    while _width(flat) > limit - 1:
        flat = flat[:-1]
    return flat + "…"


def compare(
    model: str,
    fallback_model: str,
    texts: Sequence[str],
    primary: Sequence[Sequence[float]],
    fallback: Sequence[Sequence[float]],
    min_cosine: float,
    at: float,
    sides: tuple[str, str] = ("the primary", "the fallback"),
) -> Verification:
    """Per text, after L2 normalisation: the same dimension and a cosine of at least ``min_cosine``.

    ``sides`` names the reference and the candidate in the reason.
    """
    rows = []
    for text, p, f in zip(texts, primary, fallback):
        if len(p) != len(f):
            rows.append(ProbeRow(text, len(p), len(f), None, False))
            continue
        c = cosine(l2_normalise(p), l2_normalise(f))
        rows.append(ProbeRow(text, len(p), len(f), c, c >= min_cosine))
    cosines = [r.cosine for r in rows if r.cosine is not None]
    worst = min(cosines) if cosines else None
    bad = [(i, r) for i, r in enumerate(rows) if not r.ok]
    reason = ""
    if bad:
        i, first = bad[0]
        if first.cosine is None:
            why = (
                f"dimension {first.fallback_dimension} on {sides[1]}, {first.primary_dimension} on {sides[0]}"
            )
        else:
            why = f"cosine {first.cosine:.4f} < {min_cosine:g}"
        reason = f"{len(bad)} of {len(rows)} probe texts differ; first: text {i + 1} {_short(first.text)!r}: {why}"
        if all(len(r.text) > LONG_TEXT_CHARS for _, r in bad) and len(bad) < len(rows):
            reason = (
                f"the long probe texts differ (over {LONG_TEXT_CHARS} characters), the short ones agree: "
                f"probably truncation at another length (sentence-transformers and Infinity cut MiniLM at 256 "
                f"tokens, llama-server reads up to its context); {reason}"
            )
    return Verification(model, fallback_model, not bad, at, worst, reason, tuple(rows))
