"""The one back-off of the connections that re-open themselves (relay/wakeup.py,
ReopenBackOff): the LISTEN connection's and the replays' (relay/reopening.py)."""

from __future__ import annotations

from relay.wakeup import REOPEN_BACKOFF_MAX_S, REOPEN_BACKOFF_S, ReopenBackOff


def test_each_failure_doubles_the_wait_up_to_the_cap_and_an_open_ends_the_streak() -> None:
    now = [100.0]
    back_off = ReopenBackOff(lambda: now[0])
    assert back_off.due() and back_off.failures == 0
    waits = []
    for failure in range(1, 8):
        first = back_off.failed()
        assert first is (failure == 1)  # only the first of a streak is worth a log line
        start = now[0]
        assert not back_off.due()
        while not back_off.due():
            now[0] += 0.25
        waits.append(now[0] - start)
    assert waits == [REOPEN_BACKOFF_S * 2**n if REOPEN_BACKOFF_S * 2**n < REOPEN_BACKOFF_MAX_S
                     else REOPEN_BACKOFF_MAX_S for n in range(7)]
    assert back_off.passed() == 7 and back_off.failures == 0
    assert back_off.passed() == 0
    assert back_off.failed() is True  # a new streak
    now[0] += REOPEN_BACKOFF_S
    assert back_off.due()
