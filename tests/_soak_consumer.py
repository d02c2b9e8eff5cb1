"""A member of the chaos soak's dedup consumer group, as a real process (tests/soak/).

    python tests/_soak_consumer.py --dsn ... --bootstrap ... --topic ... --member c1

Runs an :class:`~consumer_sdk.InboxConsumer` (group ``soak``, subscribe mode, batches)
whose handler applies each event's effect in the inbox transaction: one row in
``soak_effects`` (no unique constraint, so a double apply shows as two rows) and the
per-key state in ``soak_keys`` (applied count, last seq, and ``regressions``: effects
applied out of the key's seq order).  With ``--job-every N`` the handler also enqueues
a durable job for every N-th seq of a key, in the same transaction (consumer_sdk.jobs).

Every duplicate the inbox drops is recorded in ``soak_dups`` in the same transaction,
so the soak counts dropped copies exactly even though members die by SIGKILL.

SIGTERM stops it gracefully (exit 0).  Logs are JSON lines on stdout, level info.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
import structlog  # noqa: E402

from consumer_sdk import InboxConfig, InboxConsumer, InboxMessage, PgInboxStore, RetryPolicy  # noqa: E402
from consumer_sdk.model import Claim  # noqa: E402
from consumer_sdk.store import connect_factory  # noqa: E402

GROUP = "soak"
#: Group timings that make tansu rebalance in seconds (the soak pauses members longer).
SESSION_TIMEOUT_MS = 6000
KAFKA = {
    "session.timeout.ms": SESSION_TIMEOUT_MS,
    "heartbeat.interval.ms": 300,
    "max.poll.interval.ms": 60000,
    "fetch.wait.max.ms": 50,
    "reconnect.backoff.ms": 50,
    "reconnect.backoff.max.ms": 1000,
}

APPLY_EFFECT = "INSERT INTO soak_effects (event_id, key, seq, member) VALUES (%s, %s, %s, %s)"
APPLY_KEY = """
INSERT INTO soak_keys AS k (key, applied, last_seq, regressions) VALUES (%(key)s, 1, %(seq)s, (%(seq)s <> 1)::int)
ON CONFLICT (key) DO UPDATE SET applied = k.applied + 1, last_seq = excluded.last_seq,
    regressions = k.regressions + (excluded.last_seq <> k.last_seq + 1)::int
"""
RECORD_DUP = "INSERT INTO soak_dups (event_id, member) VALUES (%s, %s)"
#: Every kill or pause of a worker with a running job costs an attempt: the soak asks for
#: "completed once", not for a give-up budget, so the budget is large.
JOB_MAX_ATTEMPTS = 100
JOB_EFFECT = "INSERT INTO soak_job_effects (job_id, event_id, token, member) VALUES (%s, %s, %s, %s)"


def configure_logs() -> None:
    structlog.configure(
        processors=[structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True),
                    structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stdout),
    )
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout)


class CountingStore(PgInboxStore):
    """The SDK's inbox store, plus a ``soak_dups`` row (same transaction) per dropped copy."""

    member = "?"

    def claim(self, *, consumer: str, message: InboxMessage, payload_sha256: bytes | None) -> Claim:
        outcome = super().claim(consumer=consumer, message=message, payload_sha256=payload_sha256)
        if outcome == "duplicate":
            self._active.execute(RECORD_DUP, (message.event_id, self.member))
        return outcome


class TracingConsumer(InboxConsumer):
    """Logs the offsets each poll returned (``soak_polled``: per partition, runs of offsets),
    so that an event left unapplied can be told apart: a member received its offset and
    went past it, or no member ever received it (the broker served the offsets around it).
    A partition whose offsets jump forward between two records this member received, with
    no rebalance between them, is logged as ``soak_offset_jump``: a topic written without
    transactions has no holes, so the broker served later offsets before earlier ones
    (tansu 0.6.0 does, with several producers on a partition)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._last: dict[int, int] = {}  # partition -> the last offset received

    def _on_assign(self, consumer: Any, partitions: list[Any]) -> None:
        super()._on_assign(consumer, partitions)
        self._last = {}  # a new position (the group's committed offset): no jump to see

    def _poll(self) -> list[Any]:
        records = super()._poll()
        last = self._last
        for record in records:
            before = last.get(record.partition)
            if before is not None and record.offset > before + 1:
                structlog.get_logger("soak").warning("soak_offset_jump", partition=record.partition,
                                                     after=before, to=record.offset)
            last[record.partition] = record.offset
        if records:
            runs: dict[int, list[list[int]]] = {}
            for record in records:
                spans = runs.setdefault(record.partition, [])
                if spans and spans[-1][1] + 1 == record.offset:
                    spans[-1][1] = record.offset
                else:
                    spans.append([record.offset, record.offset])
            structlog.get_logger("soak").info("soak_polled", offsets={
                f"p{p}": [f"{a}-{b}" for a, b in spans] for p, spans in sorted(runs.items())})
        return records


def make_handler(member: str, job_every: int) -> Any:
    enqueue_job = _job_enqueuer() if job_every else None

    def apply(conn: psycopg.Connection[Any], message: InboxMessage) -> None:
        body = message.json()
        key, seq = body["key"], int(body["seq"])
        conn.execute(APPLY_EFFECT, (message.event_id, key, seq, member))
        conn.execute(APPLY_KEY, {"key": key, "seq": seq})
        if enqueue_job is not None and seq % job_every == 0:
            enqueue_job(conn, str(message.event_id), key, seq)

    return apply


def _job_enqueuer() -> Any:
    """Enqueue one ``soak`` job per selected event, in the inbox transaction (exactly once)."""
    from consumer_sdk.jobs import queue as jobq
    from consumer_sdk.jobs.model import NewJob

    def enqueue(conn: psycopg.Connection[Any], event_id: str, key: str, seq: int) -> None:
        jobq.enqueue(conn, [NewJob(owner_id=f"owner-{key}", queue="soak", kind="soak.effect",
                                   payload={"event_id": event_id, "key": key, "seq": seq},
                                   max_attempts=JOB_MAX_ATTEMPTS)])

    return enqueue


def run_consumer(args: argparse.Namespace) -> int:
    config = InboxConfig(
        name=GROUP, dsn=args.dsn, bootstrap_servers=args.bootstrap, topics=[args.topic],
        assignment="subscribe", batch_size=args.batch_size, poll_timeout_s=0.2,
        check_retention=False, inbox_retention_s=None, dead_letter_timeout_s=10.0,
        # Handler errors here can only be passing ones: retry for as long as it takes.
        retry=RetryPolicy(max_attempts=None, backoff_initial_s=0.05, backoff_max_s=1.0),
        db_backoff_initial_s=0.05, db_backoff_max_s=1.0,
        kafka_properties={**KAFKA, "client.id": f"soak-{args.member}",
                          "logger": logging.getLogger("kafka")},
    )
    consumer = TracingConsumer(config, make_handler(args.member, args.job_every))
    store = CountingStore(connect_factory(args.dsn, application_name=f"outbox-consumer:{GROUP}"))
    store.member = args.member
    consumer.store = store  # before start(): the processor is built with it
    signal.signal(signal.SIGTERM, lambda *_: consumer.stop())
    structlog.get_logger("soak").info("soak_member_started", member=args.member, role="consumer")
    consumer.run()
    return 0


def run_worker(args: argparse.Namespace) -> int:
    """A job worker pool serving the ``soak`` queue.

    The job's effect is one ``soak_job_effects`` row written in a fenced transaction
    together with the result ``effect`` (by key): an attempt that finds the result
    (an earlier attempt committed it) skips the write, so the effect commits once
    across retries, takeovers and stale owners; the short sleep afterwards lets
    kills and pauses land on running jobs.
    """
    import random
    import threading

    from consumer_sdk.jobs import Backoff, JobContext, WorkerConfig, WorkerPool

    def soak_effect(ctx: JobContext) -> Any:
        if "effect" not in ctx.results():
            with ctx.fenced_transaction() as conn:
                conn.execute(JOB_EFFECT, (ctx.job.id, ctx.payload["event_id"], ctx.job.token, args.member))
                ctx.put_result("effect", {"by": args.member, "token": ctx.job.token})
        ctx.sleep(random.uniform(0.0, 0.2))
        return {"event_id": ctx.payload["event_id"]}

    config = WorkerConfig(dsn=args.dsn, worker_id=f"soak-{args.member}-{os.getpid()}", queues=("soak",),
                          max_concurrency=args.concurrency, lease_s=args.lease_s,
                          heartbeat_s=args.lease_s / 3, poll_interval_s=0.5, reconcile_interval_s=1.0,
                          drain_timeout_s=2.0, backoff=Backoff(initial_s=0.2, max_s=2.0))
    pool = WorkerPool(config, {"soak.effect": soak_effect})
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    pool.start()
    structlog.get_logger("soak").info("soak_member_started", member=args.member, role="worker")
    while not stopped.wait(0.5):
        pass
    pool.stop()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=("consumer", "worker"), default="consumer")
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--bootstrap", default="")
    parser.add_argument("--topic", default="")
    parser.add_argument("--member", required=True)
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--job-every", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--lease-s", type=float, default=3.0)
    args = parser.parse_args()
    configure_logs()
    return run_consumer(args) if args.role == "consumer" else run_worker(args)


if __name__ == "__main__":
    sys.exit(main())
