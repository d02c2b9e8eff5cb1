"""The console's escaping: markup, and characters that hide or reorder what is shown."""

from __future__ import annotations

from datetime import UTC, datetime

from relay.console_views import e


def test_markup_is_escaped_and_none_is_a_dash() -> None:
    assert e('<b a="1">') == "&lt;b a=&quot;1&quot;&gt;"
    assert e(None) == "-"
    assert e(datetime(2026, 12, 6, 12, 0, 1, 500, tzinfo=UTC)) == "2026-12-06T12:00:01+00:00"


def test_characters_that_reorder_or_hide_text_are_shown_as_escapes() -> None:
    # A right-to-left override made "order-17\u202e71-redro" read as another key; a
    # zero-width space made two different keys look alike; a NUL or ESC showed nothing.
    assert e("order-17\u202e71") == "order-17\\u202e71"
    assert e("a\u200bb") == "a\\u200bb"
    assert e("x\u2066y\u2069") == "x\\u2066y\\u2069"
    assert e("\x00\x1b[31m\x7f") == "\\u0000\\u001b[31m\\u007f"
    assert e("\ufeffbom") == "\\ufeffbom"


def test_text_people_write_is_left_as_it_is() -> None:
    assert e("line one\nline two\tend") == "line one\nline two\tend"
    assert e("שלום عالم café 東京 🙂") == "שלום عالم café 東京 🙂"
