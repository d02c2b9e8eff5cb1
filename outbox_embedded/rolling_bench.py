"""``python -m outbox_embedded.rolling_bench``: what a rolling restart of the relay's replicas
does to the events going through them.

``--replicas`` relay processes share the shards of one database.  A writer commits ``--rate``
events a second, one a transaction, over ``--keys`` keys, for ``--seconds``.  From ``--gap-s``
in, each replica in turn is stopped (SIGTERM, as Kubernetes stops a pod; ``--kill``: SIGKILL,
a pod lost) and a new one started under another name (a new pod), ``--gap-s`` apart.

Reported, for each run (``--runs``):

* commit -> ack (the mark's ``published_at``) p50 / p99 / max of the events committed before
  the first stop, and of those committed from it to ``--gap-s`` after the last start;
* at each hand-over, the longest commit -> ack of the events committed in the ``--gap-s``
  after the stop;
* from a full read of the topic afterwards (from each partition's first offset to its end,
  not a reader at the head: tansu lets one skip records, see
  tests/integration/kafka/test_broker_offset_order.py), the events missing and duplicated.

``--exactly-once`` runs the relays in exactly-once mode (each run its own position topic and
transactional ids; a Kafka with transactions, given as ``--bootstrap-servers``) and reads the
topic ``read_committed``: a hand-over there also sets up the shard's transactional producer
and reads its last position record back.

Embedded PostgreSQL and tansu (durable, as ``outbox-relay bench`` runs them), or ``--dsn`` /
``--bootstrap-servers``.  Benchmarks are not tests: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg

from outbox_embedded import bench
from outbox_embedded.calibration import write_json
from outbox_embedded.queries import query

SPREAD_TIMEOUT_S = 60.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dsn", default=None, help="PostgreSQL to use (default: an embedded one)")
    p.add_argument("--bootstrap-servers", default=None, help="Kafka to use (default: a local tansu)")
    p.add_argument("--replicas", type=int, default=4, help="relay processes sharing the shards")
    p.add_argument("--rate", type=float, default=1000.0, help="events written a second")
    p.add_argument("--seconds", type=float, default=0.0,
                   help="how long the writer writes (default: long enough for every hand-over)")
    p.add_argument("--gap-s", type=float, default=4.0, help="time between two restarts")
    p.add_argument("--kill", action="store_true", help="SIGKILL the replicas instead of SIGTERM")
    p.add_argument("--exactly-once", action="store_true",
                   help="the relays in exactly-once mode (a Kafka with transactions: "
                        "--bootstrap-servers), the topic read read_committed")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--keys", type=int, default=1000)
    p.add_argument("--payload-bytes", type=int, default=512)
    p.add_argument("--json", dest="json_path", default=None, help="also write the figures here")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m outbox_embedded.rolling_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    if args.replicas < 1 or args.rate <= 0 or args.gap_s <= 0 or args.runs < 1:
        p.error("--replicas and --runs must be at least 1, --rate and --gap-s above 0")
    if not args.seconds:
        args.seconds = args.gap_s * (args.replicas + 1)
    from outbox_embedded.demo import services

    results = []
    with services(args, durable=True) as (dsn, bootstrap):
        runner = bench.Bench(_bench_args(args), bench._admin_dsn(dsn), bootstrap)
        for r in range(args.runs):
            figures = rolling_restart(runner, args)
            results.append(figures)
            print(f"run {r + 1}: {summary(figures)}", flush=True)
    write_json(args.json_path, {"args": {k: v for k, v in vars(args).items() if k not in ("dsn", "json_path")},
                                "runs": results})
    return 0


def _bench_args(args: argparse.Namespace) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(["--keys", str(args.keys), "--payload-bytes", str(args.payload_bytes)])


class Replica:
    """One relay process, stopped on its own (bench.relay_process runs it)."""

    def __init__(self, dsn: str, bootstrap: str, **env: str) -> None:
        self._stack = contextlib.ExitStack()
        self.proc, _ = self._stack.enter_context(bench.relay_process(dsn, bootstrap, **env))

    def stop(self, *, kill: bool) -> None:
        if kill:
            self.proc.sigkill()
        else:
            self.proc.sigterm()
        self.proc.wait(60)
        self._stack.close()


def rolling_restart(runner: bench.Bench, args: argparse.Namespace) -> dict[str, Any]:
    run = uuid.uuid4().hex[:6]
    env = ({"exactly_once": "true", "exactly_once_position_topic": f"{runner.topic}.positions.{run}",
            "exactly_once_transactional_id_prefix": f"rolling.{run}."}
           if args.exactly_once else {})  # each run its own positions: a fresh database each
    with runner.fresh_db() as dsn:
        replicas = [Replica(dsn, runner.bootstrap, **env) for _ in range(args.replicas)]
        try:
            bench._wait(lambda: bench._shards_spread(dsn, args.replicas), SPREAD_TIMEOUT_S,
                        replicas[0].proc, interval_s=0.2)
            topic = f"{runner.topic}.rolling.{run}"
            written: dict[str, dict[str, float]] = {}
            writer = threading.Thread(target=lambda: written.update(committed=bench._write_steadily(
                dsn, topic, args.rate, args.seconds, args.payload_bytes, args.keys)))
            writer.start()
            stops: list[float] = []
            time.sleep(args.gap_s)
            for _ in range(args.replicas):
                stops.append(time.time())
                replicas.pop(0).stop(kill=args.kill)
                replicas.append(Replica(dsn, runner.bootstrap, **env))
                time.sleep(args.gap_s)
            writer.join()
            committed = written["committed"]
            bench._wait(lambda: _pending(dsn) == 0, 120, replicas[0].proc, interval_s=0.1)
            with psycopg.connect(dsn) as conn:
                marked: dict[str, float] = dict(conn.execute(query("bench", "bench_latency"),
                                           {"event_ids": list(committed)}).fetchall())
        finally:
            for replica in replicas:
                replica.stop(kill=False)
    copies = read_topic(runner.bootstrap, topic, committed_only=args.exactly_once)
    return figures(committed, marked, copies, stops, gap_s=args.gap_s)


def _pending(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM outbox WHERE published_at IS NULL").fetchone()
    return int(row[0]) if row else 0


def figures(committed: dict[str, float], marked: dict[str, float], copies: dict[str, int],
            stops: list[float], *, gap_s: float) -> dict[str, Any]:
    """The run's figures from each event's commit and mark times, the copies of each event
    in the topic and the times the replicas were stopped (all Unix seconds)."""
    def ack_ms(events: Iterator[tuple[str, float]]) -> list[float]:
        return [(marked[e] - t) * 1000 for e, t in events if e in marked]

    first, last = stops[0], stops[-1] + gap_s
    before = ack_ms((e, t) for e, t in committed.items() if t < first)
    during = ack_ms((e, t) for e, t in committed.items() if first <= t < last)
    worst = [max(ack_ms((e, t) for e, t in committed.items() if stop <= t < stop + gap_s), default=0.0)
             for stop in stops]
    return {"events": len(committed),
            "missing": sum(1 for e in committed if not copies.get(e)),
            "duplicates": sum(n - 1 for e, n in copies.items() if e in committed and n > 1),
            "ack_ms_before": _spread(before), "ack_ms_during": _spread(during),
            "worst_ack_ms_per_hand_over": [round(w, 1) for w in worst]}


def _spread(values: list[float]) -> dict[str, float]:
    return {**bench.percentiles(values), "max": round(max(values), 2) if values else float("nan")}


def summary(f: dict[str, Any]) -> str:
    b, d = f["ack_ms_before"], f["ack_ms_during"]
    return (f"{f['events']} events, {f['missing']} missing, {f['duplicates']} duplicated; commit -> ack "
            f"before p50 {b['p50']:.1f} p99 {b['p99']:.1f} max {b['max']:.0f} ms, during p50 {d['p50']:.1f} "
            f"p99 {d['p99']:.1f} max {d['max']:.0f} ms; worst at each hand-over "
            + " / ".join(f"{w:.0f}" for w in f["worst_ack_ms_per_hand_over"]) + " ms")


def read_topic(bootstrap: str, topic: str, *, committed_only: bool = False) -> dict[str, int]:
    """event_id -> copies, reading every partition from its first offset to its end
    (``committed_only``: read_committed, to the last stable offset)."""
    from confluent_kafka import Consumer, KafkaError, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"rolling-{uuid.uuid4().hex}",
                         "enable.auto.commit": False, "enable.partition.eof": committed_only,
                         "isolation.level": "read_committed" if committed_only else "read_uncommitted"})
    copies: collections.Counter[str] = collections.Counter()
    try:
        meta = consumer.list_topics(topic, timeout=10).topics[topic]
        for partition in sorted(meta.partitions):
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)
            consumer.assign([TopicPartition(topic, partition, low)])
            offset, deadline, end = low, time.monotonic() + 60, False
            while offset < high and not end and time.monotonic() < deadline:
                for msg in consumer.consume(1000, 1.0):
                    err = msg.error()
                    if err is not None:  # the end: read_committed stops short of the high
                        # watermark when the last offset is a transaction's marker
                        end = end or err.code() == KafkaError._PARTITION_EOF
                        continue
                    offset = max(offset, (msg.offset() or 0) + 1)
                    raw: Any = msg.headers() or []
                    copies.update(v.decode() for k, v in raw if k == "event_id" and isinstance(v, bytes))
    finally:
        consumer.close()
    return dict(copies)


if __name__ == "__main__":
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    sys.exit(main())
