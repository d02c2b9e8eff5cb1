"""The end of a Kafka producer, decided once for the relay and the SDK.

A confluent-kafka client left to the garbage collector lives on while anything refers to
it, and its owner's error callback (a bound method, given to the client in its
configuration) makes a cycle: the client is freed only at a cyclic collection, and until
then its threads run and it reconnects to the cluster.  :func:`destroy_producer` ends it
now, every delivery report of its messages served first.
"""

from __future__ import annotations

import time

from confluent_kafka import Producer

#: How long the reports of purged messages are waited for when one is not there at once.
REPORTS_WAIT_S = 2.0


def destroy_producer(producer: Producer, wait_s: float = 0.0, *,
                     reports_wait_s: float = REPORTS_WAIT_S) -> int:
    """Wait up to ``wait_s`` for what is queued, give up on the rest (purged: its delivery
    reports come now, on the caller's thread, as failures), then destroy the client, its
    threads joined.  Returns how many messages were given up.

    The client is closed only once no message is left: ``close()`` flushes what is left
    without a bound (a client that cannot reach the cluster held the caller for ever).
    Should a purged message's report not come within ``reports_wait_s`` (never seen), the
    client is left to the garbage collector rather than the caller held.  A producer in a
    fatal state may raise at flush (SystemError from confluent-kafka): each step is tried
    on its own."""
    left = len(producer)
    if wait_s > 0 and left:
        left = _flush(producer, wait_s)
    if left:
        try:
            producer.purge()
        except Exception:  # noqa: BLE001, S110 - confluent-kafka raised SystemError at a fatal error
            pass
        deadline = time.monotonic() + reports_wait_s
        remaining = _flush(producer, 0)  # serves the purged messages' reports
        while remaining and time.monotonic() < deadline:
            remaining = _flush(producer, 0.05)
        if remaining:
            return left
    close = getattr(producer, "close", None)  # confluent-kafka >= 2.8; else freed when dropped
    if close is not None:
        try:
            close()
        except Exception:  # noqa: BLE001, S110 - best effort on a client that is going
            pass
    return left


def _flush(producer: Producer, timeout_s: float) -> int:
    """``producer.flush(timeout_s)``: the messages still outstanding (a fatal error raised
    at flush counts what the client still holds)."""
    try:
        return int(producer.flush(timeout_s))
    except Exception:  # noqa: BLE001 - confluent-kafka raised SystemError at a fatal error
        return len(producer)
