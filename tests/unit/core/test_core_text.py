"""Where input that is not UTF-8 text is, named without its value."""

from __future__ import annotations

from outbox_core.text import first_undecodable


def test_names_the_variable_the_flag_or_the_position_never_the_value() -> None:
    assert first_undecodable(["run", "--dsn", "x"], {"OUTBOX_RELAY_OWNER": "ok", "HOME": "\udcff"},
                             "OUTBOX_RELAY_") is None  # another program's variable is not ours
    assert first_undecodable([], {"OUTBOX_RELAY_DSN": "pw\udcff"}, "OUTBOX_RELAY_") == "OUTBOX_RELAY_DSN"
    assert first_undecodable([], {"OUTBOX_RELAY_\udcff": "x"}, "OUTBOX_RELAY_") == \
        "the environment variable 'OUTBOX_RELAY_\\udcff'"
    assert first_undecodable(["run", "--dsn=pw\udcff"], {}, "P_") == "the value of --dsn"
    assert first_undecodable(["run", "--dsn", "pw\udcff"], {}, "P_") == "the value after --dsn"
    assert first_undecodable(["replay", "ab\udcff"], {}, "P_") == "command-line argument 2"
    assert first_undecodable(["--dsn=a", "b\udcff"], {}, "P_") == "command-line argument 2"
