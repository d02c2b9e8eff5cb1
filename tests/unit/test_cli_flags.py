"""Boolean options are flags: `--exactly-once` alone means true (issue 20); a value still works."""

from __future__ import annotations

from relay.cli import build_parser


def test_a_bare_boolean_flag_means_true_and_a_value_is_still_read() -> None:
    parser = build_parser()
    assert parser.parse_args(["run", "--exactly-once"]).exactly_once == "true"
    args = parser.parse_args(["run", "--exactly-once", "false", "--batch-size", "5"])
    assert (args.exactly_once, args.batch_size) == ("false", "5")
    assert parser.parse_args(["run"]).exactly_once is None  # the environment may decide
