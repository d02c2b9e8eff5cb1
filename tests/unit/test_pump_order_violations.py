"""outbox_relay_order_violations_total counts what breaks the relay's per-key order, and only
that (README "Ordering"): a key's events in one topic reach Kafka in commit order.  Kafka
orders a partition; a key's rows in two topics go to two partitions, produced side by side
in one batch, so a row of one topic acknowledged while an earlier row of its key in another
topic failed (a topic the principal may not write, say) is no violation.  Counted as one
(an ERROR line and a critical alert) until an audit of the security paths found it."""

from __future__ import annotations

from relay.model import OutboxRow
from relay.publisher import Outcome
from tests.unit.pump_fakes import row
from tests.unit.test_loop import Relay

DENIED = Outcome(ok=False, error_class="topic_not_authorized", permanent=True,
                 message="Broker: Topic authorization failed")


def in_topic(i: int, topic: str) -> OutboxRow:
    return row(i, 0, key="k")._replace(topic=topic)


def violations(rows: list[OutboxRow]) -> tuple[Relay, float]:
    """Row 1 refused, the rest acknowledged, all of one claim; the counter after they settled."""
    relay = Relay(rows, outcomes={1: [DENIED]}, max_attempts=1, dead_letter_topic="dlq")
    relay.turn_until(lambda: not relay.store.pending and not relay.pump.busy(), limit=500)
    count = relay.pump.metrics.registry.get_sample_value("outbox_relay_order_violations_total") or 0.0
    return relay, count


def test_a_key_refused_in_one_topic_is_no_violation_in_another() -> None:
    relay, count = violations([in_topic(1, "denied"), in_topic(2, "allowed"), in_topic(3, "allowed")])
    assert relay.publisher.dead_letters == [(1, "dlq", "topic_not_authorized")]
    assert sorted(relay.store.marked) == [2, 3]
    assert count == 0 and relay.pump.totals.order_violations == 0  # before: 2


def test_a_later_row_of_the_key_acknowledged_in_the_same_topic_is_still_one() -> None:
    relay, count = violations([in_topic(1, "orders"), in_topic(2, "orders")])
    assert relay.publisher.dead_letters == [(1, "dlq", "topic_not_authorized")]
    assert count == 1 and relay.pump.totals.order_violations == 1
