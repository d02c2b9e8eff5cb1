"""The relay's producer is destroyed when the relay is done with it, its threads joined,
not left to the garbage collector or to interpreter exit: there, librdkafka's threads
still ran (retrying a TLS handshake, say) while the process tore down, and a relay that
stopped on an untrusted certificate with rows queued died of SIGSEGV instead of exiting 1
(CI, PostgreSQL 15 tier, 2026-12-04). A real client on an address nobody listens on: no
broker is needed to queue a message and give it up."""

from __future__ import annotations

import sys

import pytest

from relay.config import build_settings, producer_config
from relay.model import OutboxRow
from relay.publisher import Outcome, Publisher
from tests.fixtures.procs import rdkafka_threads

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def row(n: int) -> OutboxRow:
    return OutboxRow(id=n, event_id=f"00000000-0000-7000-8000-{n:012d}", topic="t", key="k",
                     value=b"v", headers_json="{}", xid=1, shard=0, attempts=0, created_epoch=0.0,
                     size=1)


def test_close_gives_up_what_is_queued_reports_it_and_joins_the_client_threads() -> None:
    before = rdkafka_threads()
    settings = build_settings({"dsn": "postgresql://u@127.0.0.1:1/x", "bootstrap_servers": "127.0.0.1:1"})
    publisher = Publisher(producer_config(settings), on_client_error=lambda *a: None)
    reports: list[tuple[int, Outcome]] = []
    for n in (1, 2):
        publisher.send(row(n), lambda r, outcome: reports.append((r.id, outcome)))
    publisher.poll(0.05)
    assert rdkafka_threads() > before
    # Nobody listens: both still queued (len() counts the client's pending events too).
    assert publisher.in_flight() >= 2 and reports == []

    assert publisher.close(0) >= 2  # given up, not waited for
    # Each queued row was reported, as not acknowledged: its row stays pending.
    assert sorted(r for r, _ in reports) == [1, 2]
    assert all(not outcome.ok for _, outcome in reports)
    assert rdkafka_threads() == before  # the client is gone now, not at some later collection
    assert publisher.close(0) == 0  # idempotent
