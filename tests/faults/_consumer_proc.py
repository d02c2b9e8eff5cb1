"""A dedup consumer as a real process, for tests/faults/test_consumer_kill.py.

Applies each event by inserting a row into `effects` and incrementing `counters`
(the handler of the SDK integration tests), through a handler or, with ``--statements``,
a statements handler returning the same two statements (one round trip a message one at
a time, one a batch in batch mode).  With ``--kill-probability p`` it
SIGKILLs itself with probability p right after a database commit and before the
matching Kafka offset commit: exactly the window the inbox exists for.  SIGTERM
stops it gracefully.

    python tests/faults/_consumer_proc.py --dsn ... --bootstrap ... --topic ... --name ...
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

from consumer_sdk import InboxConfig, InboxConsumer, InboxMessage, KafkaRecord, RetryPolicy  # noqa: E402


def apply(conn: psycopg.Connection[Any], message: InboxMessage) -> None:
    body = message.json()
    conn.execute("INSERT INTO effects (event_id, consumer, n) VALUES (%s, 'c', %s)",
                 (message.event_id, body["n"]))
    conn.execute("INSERT INTO counters (name, value) VALUES ('c', 1) "
                 "ON CONFLICT (name) DO UPDATE SET value = counters.value + 1")


def statements(message: InboxMessage) -> list[tuple[str, Any]]:
    """``apply`` as a statements handler."""
    return [("INSERT INTO effects (event_id, consumer, n) VALUES (%s, 'c', %s)", (message.event_id, message.json()["n"])),
            ("INSERT INTO counters (name, value) VALUES ('c', 1) "
             "ON CONFLICT (name) DO UPDATE SET value = counters.value + 1", None)]


class SelfKillingConsumer(InboxConsumer):
    """Dies by SIGKILL, at random, between a database commit and its offset commit."""

    kill_probability = 0.0

    def _settled(self, records: Sequence[KafkaRecord]) -> None:
        if random.random() < self.kill_probability:
            print(f"self_kill before committing offsets of {len(records)} messages", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        super()._settled(records)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--kill-probability", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--statements", action="store_true", help="apply through a statements handler")
    args = parser.parse_args()
    random.seed(args.seed)
    config = InboxConfig(
        name=args.name, dsn=args.dsn, bootstrap_servers=args.bootstrap, topics=[args.topic],
        assignment="assign", batch_size=args.batch_size, poll_timeout_s=0.2, check_retention=False,
        retry=RetryPolicy(max_attempts=3, backoff_initial_s=0.05, backoff_max_s=0.2),
        kafka_properties={"fetch.wait.max.ms": 50, "logger": logging.getLogger("kafka")},
    )
    consumer = SelfKillingConsumer(config, statements=statements) if args.statements \
        else SelfKillingConsumer(config, apply)
    consumer.kill_probability = args.kill_probability
    signal.signal(signal.SIGTERM, lambda *_: consumer.stop())
    print(f"consumer_process_started handler={'statements' if args.statements else 'apply'}", flush=True)
    consumer.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
