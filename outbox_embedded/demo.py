"""``outbox-relay demo``: the whole pipeline on this machine, with nothing configured.

An embedded PostgreSQL and a local tansu broker start (unless ``--dsn`` /
``--bootstrap-servers`` point elsewhere), the schema is migrated, a writer plays
a service committing events in transactions at a steady rate, the relay runs,
and a verifying consumer reads the topic back.  Progress every second, a summary
at the end: written, published, received, duplicates, lost (must be 0) and the
commit-to-receipt latency.  Processes are cleaned up on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg

from outbox_embedded.options import plural
from outbox_embedded.queries import query
from relay import migrate

TOPIC = "demo.orders"


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    committed_at: dict[str, float] = field(default_factory=dict)
    received: set[str] = field(default_factory=set)
    duplicates: int = 0
    order_violations: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    last_seq: dict[str, int] = field(default_factory=dict)


@contextlib.contextmanager
def services(args: argparse.Namespace, *, durable: bool = False) -> Iterator[tuple[str, str]]:
    """Yield (dsn, bootstrap); embedded ones are stopped on exit.  ``durable``: the embedded
    PostgreSQL keeps fsync, synchronous commit and full-page writes on (benchmarks)."""
    from outbox_embedded import broker, pg

    with contextlib.ExitStack() as stack:
        dsn = getattr(args, "dsn", None)
        bootstrap = getattr(args, "bootstrap_servers", None)
        if not dsn:
            print("starting an embedded PostgreSQL ...", flush=True)
            server = pg.embedded_pg(durable=durable)
            stack.callback(server.close)
            dsn = server.create_database("outbox_demo_" + uuid.uuid4().hex[:8])
        if not bootstrap:
            print("starting a local Kafka-compatible broker (tansu) ...", flush=True)
            tansu = broker.tansu_broker()
            stack.callback(tansu.close)
            bootstrap = tansu.bootstrap
        yield dsn, bootstrap


def writer(dsn: str, tally: Tally, *, rate: float, keys: int, stop: threading.Event) -> None:
    """Commit 1-5 events per transaction at ``rate`` events/s, each with a per-key sequence."""
    seq: dict[str, int] = {}
    with psycopg.connect(dsn) as conn:
        started = time.monotonic()
        written = 0
        while not stop.is_set():
            due = started + written / rate
            delay = due - time.monotonic()
            if delay > 0:
                stop.wait(delay)
                continue
            events = []
            for _ in range(random.randint(1, 5)):
                key = f"customer-{random.randrange(keys)}"
                seq[key] = seq.get(key, 0) + 1
                events.append((str(uuid.uuid4()), key, json.dumps({"key": key, "seq": seq[key]})))
            with conn.transaction():
                conn.cursor().executemany(query("demo", "write_event"),
                                          [{"event_id": e, "topic": TOPIC, "key": k, "payload": p}
                                           for e, k, p in events])
            now = time.time()
            with tally.lock:
                for event_id, _, _ in events:
                    tally.committed_at[event_id] = now
            written += len(events)


def checker(bootstrap: str, tally: Tally, stop: threading.Event) -> None:
    """Read the topic from the start of every partition; count, dedupe, check per-key order."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "outbox-demo-checker",
                         "enable.auto.commit": False, "fetch.wait.max.ms": 10})
    try:
        meta = consumer.list_topics(TOPIC, timeout=10)
        consumer.assign([TopicPartition(TOPIC, p, 0) for p in meta.topics[TOPIC].partitions])
        while not stop.is_set():
            first = consumer.poll(0.1)  # returns as soon as a message is there
            if first is None:
                continue
            for msg in [first, *consumer.consume(1000, 0)]:
                if msg.error():
                    continue
                received = time.time()
                raw: Any = msg.headers() or []
                headers = {k: v for k, v in raw if isinstance(v, bytes)}
                event_id = headers.get("event_id", b"").decode()
                body = json.loads(msg.value() or b"{}")
                with tally.lock:
                    if event_id in tally.received:
                        tally.duplicates += 1
                        continue
                    tally.received.add(event_id)
                    if body["seq"] <= tally.last_seq.get(body["key"], 0):
                        tally.order_violations += 1
                    tally.last_seq[body["key"]] = body["seq"]
                    committed = tally.committed_at.get(event_id)
                    if committed is not None:
                        tally.latencies_ms.append(max(0.0, (received - committed) * 1000))
    finally:
        consumer.close()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def count_published(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(query("demo", "count_published")).fetchone()
        return int(row[0]) if row else 0


def main(args: argparse.Namespace) -> int:
    from relay.app import Relay
    from relay.config import build_settings
    from relay.metrics import RelayMetrics

    stop_writer, stop_checker = threading.Event(), threading.Event()
    tally = Tally()
    relay: Relay | None = None
    threads: list[threading.Thread] = []
    try:
        with services(args) as (dsn, bootstrap):
            migrate.apply(dsn)
            _create_topic(bootstrap)
            settings = build_settings({"dsn": dsn, "bootstrap_servers": bootstrap, "metrics_port": "0",
                                       "poll_interval_s": "1"})
            relay = Relay(settings, metrics=RelayMetrics())
            relay.start()
            threads = [threading.Thread(target=relay.run, name="relay", daemon=True),
                       threading.Thread(target=checker, args=(bootstrap, tally, stop_checker), daemon=True),
                       threading.Thread(target=writer, args=(dsn, tally), daemon=True,
                                        kwargs={"rate": args.rate, "keys": args.keys, "stop": stop_writer})]
            for t in threads:
                t.start()
            print(f"writing {args.rate:g} events/s over {plural(args.keys, 'key')} for {args.duration_s:g} s "
                  f"(Ctrl-C stops early)", flush=True)
            try:
                _progress(tally, dsn, until=time.monotonic() + args.duration_s, relay=relay)
                stop_writer.set()
                threads[2].join()
                _wait_all_received(tally, timeout_s=30.0)
                return _summary(tally, dsn)
            finally:
                _stop_all(relay, threads, stop_writer, stop_checker)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping and cleaning up", flush=True)
        return 130
    finally:
        _stop_all(relay, threads, stop_writer, stop_checker)


def _stop_all(relay: Any, threads: list[threading.Thread], *events: threading.Event) -> None:
    """Stop the writer, the checker and the relay (draining) before the services go away."""
    for event in events:
        event.set()
    if relay is not None:
        relay.stop()
        relay.stopped.wait(20)
    for t in threads:
        t.join(timeout=5)


def _create_topic(bootstrap: str) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(TOPIC, 3, 1)]).values():
        with contextlib.suppress(Exception):  # already exists is fine
            future.result(15)


def _progress(tally: Tally, dsn: str, *, until: float, relay: Any) -> None:
    while time.monotonic() < until:
        time.sleep(1.0)
        with tally.lock:
            written, received = len(tally.committed_at), len(tally.received)
            p50 = percentile(tally.latencies_ms[-2000:], 0.5)
        print(f"  written {written:>7}  published {count_published(dsn):>7}  received {received:>7}  "
              f"pending {relay.pending:>5}  p50 commit->receipt {p50:6.1f} ms", flush=True)


def _wait_all_received(tally: Tally, *, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with tally.lock:
            if tally.received >= set(tally.committed_at):
                return
        time.sleep(0.1)


def _summary(tally: Tally, dsn: str) -> int:
    with tally.lock:
        written = set(tally.committed_at)
        lost = len(written - tally.received)
        lat = tally.latencies_ms
        print("\nsummary")
        print(f"  written           {len(written)}")
        print(f"  published         {count_published(dsn)}")
        print(f"  received          {len(tally.received)}")
        print(f"  duplicates        {tally.duplicates}")
        print(f"  order violations  {tally.order_violations}")
        print(f"  lost              {lost}")
        if lat:
            print(f"  commit->receipt   p50 {percentile(lat, .5):.1f} ms  p95 {percentile(lat, .95):.1f} ms  "
                  f"p99 {percentile(lat, .99):.1f} ms  mean {statistics.fmean(lat):.1f} ms")
    ok = lost == 0 and tally.order_violations == 0
    print("  result            " + ("OK: nothing lost, per-key order held" if ok else "FAILED"))
    sys.stdout.flush()
    return 0 if ok else 1
