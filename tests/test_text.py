"""Text from outside, shown safely: one helper, :func:`yieldproxy.text.printable`, for the log, the CLI and the demo."""

from __future__ import annotations

from yieldproxy.text import printable


def test_printable_escapes_control_characters_and_keeps_the_rest():
    assert printable("plain text, é, 日本") == "plain text, é, 日本"
    assert printable("a\nFAKE 200\x1b[2J") == "a\\nFAKE 200\\x1b[2J"
    assert printable(42) == "42"


def test_printable_bounds_the_text_it_shows():
    assert printable("x" * 50, 10) == "x" * 7 + "..."
    assert printable("x" * 10, 10) == "x" * 10
    # Escaped first, so the bound holds for what is shown, control characters included.
    assert len(printable("\x1b" * 100, 20)) == 20
