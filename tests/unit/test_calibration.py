"""The round trip's price: a count below one is refused before any connection is made."""

from __future__ import annotations

import pytest

from outbox_embedded.calibration import rotated, round_trip


def test_a_count_below_one_is_refused_without_connecting() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        round_trip("host=/nonexistent-socket-dir dbname=none connect_timeout=1", 0)


def test_each_round_starts_one_further_along() -> None:
    assert [rotated("abc", r) for r in range(4)] == [list("abc"), list("bca"), list("cab"), list("abc")]
    assert rotated([], 3) == []
