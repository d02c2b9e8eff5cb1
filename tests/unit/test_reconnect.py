"""The database's own back-off (relay/reconnect.py): short, capped, jittered, reset."""

from __future__ import annotations

from relay.reconnect import DB_RECONNECT_INITIAL_S, DB_RECONNECT_MAX_S, Reconnects


def test_the_waits_double_from_half_a_second_to_the_cap_and_start_again_once_reset() -> None:
    reconnects = Reconnects(cap_s=30.0, rand=lambda: 0.0)  # no jitter: the ceilings
    waits = [reconnects.next_wait_s() for _ in range(6)]
    assert waits == [DB_RECONNECT_INITIAL_S, 1.0, DB_RECONNECT_MAX_S, 2.0, 2.0, 2.0]
    assert reconnects.reset() == 6
    assert reconnects.next_wait_s() == DB_RECONNECT_INITIAL_S


def test_jitter_draws_below_the_ceiling_and_a_lower_backoff_max_caps_it() -> None:
    assert Reconnects(cap_s=30.0, rand=lambda: 0.999).next_wait_s() < DB_RECONNECT_INITIAL_S * 0.51
    low = Reconnects(cap_s=0.3, rand=lambda: 0.0)
    assert [low.next_wait_s() for _ in range(3)] == [0.3, 0.3, 0.3]
