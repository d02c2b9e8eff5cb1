"""The dispatcher's lanes (consumer_sdk.jobs.lanes) against a fake listing that behaves as
claims.ready_lanes does: with more ready owners than a read lists, every owner is served in
turn.  Cut in owner_id order and planned from while the cache lasted, the owners after the
first max_owners_per_round waited until those had no work left (an audit of the pool)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from consumer_sdk.jobs import claims
from consumer_sdk.jobs.fairness import Limits
from consumer_sdk.jobs.lanes import Lanes
from consumer_sdk.jobs.model import ClaimedJob, JobId, Lane, Token


class FakeQueue:
    """Ready jobs per owner of one queue; ``read`` lists as the SQL does (after the cursor, wrapping)."""

    def __init__(self, jobs: dict[str, int]) -> None:
        self.jobs = dict(jobs)
        self.ids = itertools.count(1)

    def read(self, conn: Any, *, queues: list[str], max_owners: int, now: Any, after: dict[str, str]) -> list[Lane]:
        owners = sorted(o for o, n in self.jobs.items() if n > 0)
        cursor = after.get("bulk")
        if cursor is not None:
            owners = [o for o in owners if o > cursor] + [o for o in owners if o <= cursor]
        return [Lane("bulk", o, ready=self.jobs[o], running=0) for o in owners[:max_owners]]

    def claim(self, takes: list[Any]) -> list[ClaimedJob]:
        claimed = []
        for take in takes:
            for _ in range(min(take.n, self.jobs[take.owner_id])):
                self.jobs[take.owner_id] -= 1
                claimed.append(ClaimedJob(id=JobId(next(self.ids)), run_id=None, owner_id=take.owner_id, queue="bulk",
                                          kind="k", worker="w", token=Token(1), attempts=1, max_attempts=1,
                                          payload=None, traceparent=None, tracestate=None, wait_key=None,
                                          activation=None, created_epoch=0.0))
        return claimed


@pytest.mark.parametrize(("owners", "max_owners", "slots"), [(12, 5, 2), (31, 5, 2), (520, 500, 4), (7, 10, 3)])
def test_every_owner_gets_its_turn_whatever_their_number(monkeypatch: pytest.MonkeyPatch, owners: int,
                                                          max_owners: int, slots: int) -> None:
    fake = FakeQueue({f"o{i:03d}": 3 for i in range(owners)})
    monkeypatch.setattr(claims, "ready_lanes", fake.read)
    lanes = Lanes(queues=["bulk"], max_owners=max_owners, ttl_s=3600.0, clock=lambda: 0.0, db_now=lambda: None)
    limits = Limits(max_concurrency=slots)
    order: list[str] = []
    for clock in itertools.count():
        current = lanes.current(None)
        if not current:
            break
        takes = lanes.plan(current, busy={}, limits=limits)
        claimed = fake.claim(takes)
        order += [job.owner_id for job in claimed]
        lanes.after_round(current, takes, claimed, {}, limits, float(clock))
    assert len(order) == 3 * owners
    # Each list's turn ends in a round whose spare slots go to owners of that list again: at
    # most slots - 1 jobs more a list, ceil(owners / max_owners) lists a turn of every owner.
    lists = -(-owners // max_owners)
    firsts = [order.index(owner) for owner in fake.jobs]
    assert max(firsts) < owners + lists * (slots - 1), (max(firsts), order[:owners + lists * slots])
    assert lanes.reads <= 3 * lists + 3  # one read a turn of each list, not one a job
