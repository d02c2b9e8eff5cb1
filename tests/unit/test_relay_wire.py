"""relay/wire.py's pure parts: placeholders and parameter values (the statements themselves:
tests/integration/test_relay_prepared.py)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from relay import wire
from relay.queries import query


def test_the_psycopg_internals_are_there():
    """Else the store falls back to the cursor path: slower, and this says so."""
    assert wire.INTERNALS


def test_named_placeholders_become_positional_in_first_use_order():
    text, names = wire.positional("SELECT %(b)s, %(a)s::int %% 2, %(b)s -- 100%%")
    assert text == "SELECT $1, $2::int % 2, $1 -- 100%"
    assert names == ["b", "a"]


@pytest.mark.parametrize("name", ["claim_batch", "mark_published", "delete_published"])
def test_every_placeholder_of_the_cycle_statements_is_named(name):
    text, names = wire.positional(query("relay", name))
    assert "%(" not in text and "%%" not in text
    assert len(names) == len(set(names)) and names


def test_values_in_text_format():
    assert wire.text_value(None) is None
    assert wire.text_value(True) == b"t" and wire.text_value(False) == b"f"
    assert wire.text_value(12) == b"12" and wire.text_value("{1,2}") == b"{1,2}"
    assert wire.text_value(datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)) == b"2026-01-02T03:04:05+00:00"
    with pytest.raises(TypeError, match="float"):
        wire.text_value(1.5)
