"""The default probe texts include long ones, and a twin that differs only on them is told why (issue 20).

sentence-transformers and Infinity cut all-MiniLM-L6-v2 at 256 word pieces;
llama.cpp's llama-server reads up to 512.  Short probe texts alone call such
a pair twins (tests/test_llamacpp_real.py proves it with the real servers).
"""

from __future__ import annotations

from yieldproxy.config import DEFAULT_PROBE_TEXTS, LONG_PROBE_TEXTS, FallbackConfig, VerificationConfig
from yieldproxy.upstream.vectors import LONG_TEXT_CHARS, compare


def test_the_defaults_of_the_fallback_and_of_twin_verification_include_two_long_texts():
    assert VerificationConfig().probe_texts == FallbackConfig().probe_texts == DEFAULT_PROBE_TEXTS
    assert len(LONG_PROBE_TEXTS) == 2 and set(LONG_PROBE_TEXTS) <= set(DEFAULT_PROBE_TEXTS)
    # Over 256 word pieces (MiniLM's tokenizer: 303 and 451), under llama-server's batch of 512:
    # about 4.7 characters a word piece in this English.
    assert all(len(text) > LONG_TEXT_CHARS for text in LONG_PROBE_TEXTS)
    assert 1300 < len(LONG_PROBE_TEXTS[0]) < 1600 and 2000 < len(LONG_PROBE_TEXTS[1]) < 2300
    assert all(len(text) < LONG_TEXT_CHARS for text in DEFAULT_PROBE_TEXTS if text not in LONG_PROBE_TEXTS)


def test_a_twin_that_differs_only_on_the_long_texts_is_told_it_is_probably_truncation():
    texts = ["short", *LONG_PROBE_TEXTS]
    reference = [[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]]
    truncated = [[1.0, 0.0], [0.97, 0.24], [0.87, 0.49]]
    v = compare("m", "m", texts, reference, truncated, 0.99, at=0, sides=("llama", "infinity"))
    assert not v.ok
    assert v.reason.startswith("the long probe texts differ (over 1000 characters), the short ones agree: probably truncation")
    assert "2 of 3 probe texts differ; first: text 2" in v.reason


def test_a_twin_that_differs_on_a_short_text_too_is_not_called_truncation():
    texts = ["short", *LONG_PROBE_TEXTS]
    v = compare("m", "m", texts, [[1.0, 0.0]] * 3, [[0.0, 1.0]] * 3, 0.99, at=0)
    assert v.reason.startswith("3 of 3 probe texts differ") and "truncation" not in v.reason
