"""One member of a ``cooperative-sticky`` consumer group as a real process, for
tests/integration/sdk/test_sdk_cooperative_rebalance.py, which SIGKILLs it mid-stream (its
partitions go to the other members once its session times out).  Applies each event with
the SDK tests' effect (a row in ``effects``, ``consumer`` = the member's label).  SIGTERM
stops it gracefully.

    python tests/integration/sdk/_cooperative_member.py --dsn ... --bootstrap ... --topic ... \
        --name ... --member c
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from consumer_sdk import InboxConfig, InboxConsumer, InboxMessage  # noqa: E402
from tests.integration.sdk._support import FAST_GROUP, record_effect  # noqa: E402

#: Seconds of simulated work per event, as the test's own members do.
WORK_S = 0.002


def main() -> int:
    parser = argparse.ArgumentParser()
    for option in ("--dsn", "--bootstrap", "--topic", "--name", "--member"):
        parser.add_argument(option, required=True)
    parser.add_argument("--batch-size", type=int, default=10)
    args = parser.parse_args()

    def handler(conn: Any, message: InboxMessage) -> None:
        time.sleep(WORK_S)  # noqa: TID251 - the handler's work takes this long
        record_effect(conn, message, consumer=args.member)

    config = InboxConfig(
        name=args.name, dsn=args.dsn, bootstrap_servers=args.bootstrap, topics=[args.topic],
        assignment="subscribe", batch_size=args.batch_size, poll_timeout_s=0.2, check_retention=False,
        kafka_properties={**FAST_GROUP, "partition.assignment.strategy": "cooperative-sticky"},
    )
    consumer = InboxConsumer(config, handler)
    signal.signal(signal.SIGTERM, lambda *_: consumer.stop())
    print(f"member_started member={args.member}", flush=True)
    consumer.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
