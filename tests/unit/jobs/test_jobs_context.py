"""A JobContext's cooperative cancellation, without a database: the first reason wins, and
``sleep()`` wakes at once whether the cancellation came before it or during it (the context
makes its Event only when a handler first sleeps)."""

from __future__ import annotations

import threading
import time

import pytest

from consumer_sdk.jobs import LeaseLost
from consumer_sdk.jobs.context import JobContext
from consumer_sdk.jobs.model import ClaimedJob, JobId, Token


def _ctx() -> JobContext:
    job = ClaimedJob(id=JobId(7), run_id=None, owner_id="o", queue="q", kind="k", worker="w",
                     token=Token(1), attempts=1, max_attempts=3, payload=None, traceparent=None,
                     tracestate=None, wait_key=None, activation=None, created_epoch=0.0)
    return JobContext(job, deadline=0.0)


def test_the_first_reason_wins_and_check_raises_it():
    ctx = _ctx()
    assert not ctx.cancelled and ctx.cancel_reason is None
    ctx.check()
    assert ctx.cancel("lease_lost") and not ctx.cancel("shutdown")
    assert ctx.cancelled and ctx.cancel_reason == "lease_lost"
    with pytest.raises(LeaseLost) as caught:
        ctx.check()
    assert caught.value.reason == "lease_lost"


def test_a_sleep_after_the_cancellation_returns_at_once():
    ctx = _ctx()
    ctx.cancel("cancelled")
    started = time.monotonic()
    with pytest.raises(LeaseLost):
        ctx.sleep(30)
    assert time.monotonic() - started < 5


def test_a_cancellation_from_another_thread_wakes_a_sleep():
    for _ in range(20):  # the cancel lands before or during the sleep: both wake it
        ctx = _ctx()
        canceller = threading.Thread(target=ctx.cancel, args=("lease_lost",))
        started = time.monotonic()
        canceller.start()
        with pytest.raises(LeaseLost):
            ctx.sleep(30)
        canceller.join()
        assert time.monotonic() - started < 5


def test_a_sleep_without_cancellation_waits_and_returns():
    ctx = _ctx()
    ctx.sleep(0.01)
    ctx.sleep(0)
    assert not ctx.cancelled
