"""SDK benchmark (issue 19): InboxConsumer and WorkerPool next to naive baselines, in one run.

    .venv/bin/python -m outbox_embedded.sdk_bench                       # embedded PostgreSQL + tansu
    .venv/bin/python -m outbox_embedded.sdk_bench --dsn postgresql://postgres@127.0.0.1:5432/postgres \
        --bootstrap-servers 127.0.0.1:9092 --runs 3 --json sdk-bench.json

Variants run round-robin, ``--runs`` times each; each figure is the median.  Ratios are
taken between figures of this same run (the machine is shared and noisy).  CPU per item
is this process's CPU time (``time.process_time``: every thread, librdkafka's included;
not PostgreSQL's or the broker's) divided by the items.

Consumers (``--messages`` of ``--payload-bytes`` over ``--partitions`` partitions, a
handler that inserts one row; every consumer reads every partition with ``assign``):

* naive: ``consume(500)``, one transaction per batch inserting the inbox rows ``ON
  CONFLICT DO NOTHING`` (unnest) and the effect rows of the new ones, DB commit, then a
  synchronous offset commit;
* InboxConsumer, ``batch_size=500``, with that handler (``inbox_batch``) and with a batch
  handler inserting the batch's effect rows in one statement as the naive one does
  (``inbox_batch_bh``), with a statements handler returning the same insert as the handler
  (``inbox_batch_statements``: every new message's insert in one round trip), and one message at a time (``batch_size=1``, on
  ``--single-messages`` messages) with the handler (``inbox_single``) and with a statements
  handler returning the same insert (``inbox_single_statements``: the inbox row, the
  insert and COMMIT in one round trip);
* each on new messages and on redeliveries (the same topic read again by the same inbox
  under a new consumer group).

Workers (``--jobs`` trivial jobs; the handler writes one row):

* naive: ``--threads`` threads, each looping claim one (SKIP LOCKED, running, token + 1),
  write one row, set succeeded: three statements a job;
* WorkerPool with ``max_concurrency=--threads``, the row written through
  ``ctx.fenced_transaction()`` (``worker_pool``: the insert with BEGIN and the fence, COMMIT)
  or through ``ctx.fenced_execute()`` (``worker_pool_execute``: the same in one round
  trip); the bench checks its progress every 20 ms (its own polling took ~10 % of the
  process's CPU at 5 ms), so a run may end up to 20 ms late.

Each round runs the three worker variants back to back, in an order that rotates, and
the consumer variants likewise.  Every ratio is reported three ways: between the medians
(``ratios``), in each round (``ratios_per_round``; for the pools also under their earlier
names ``worker_pool_vs_naive_per_run``, ``worker_pool_execute_vs_naive_per_run``) and as
the median of the rounds' (``ratios_round_median``); and the pool's jobs per dispatcher
round (``jobs_per_claim_round``).

Each round also times the machine's price of one round trip to PostgreSQL: ``SELECT 1``
(prepared) ``--round-trips`` times on one autocommit connection, its wall time and this
process's CPU time per trip (``round_trip``: the medians, and ``per_round``).  The
one-at-a-time consumer and the pools spend most of their time in round trips, and that
price moves with the load of the host (39 µs when issue 19 was filed, 100 µs and more
on a busy day): ``in_round_trips`` gives every figure's time per item in that round's
round trips (the median of the rounds'), a measure that moves less with the machine.

The last line on stdout is the JSON report (also written to ``--json``).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import json
import logging
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import structlog
from confluent_kafka import Consumer, Producer, TopicPartition

from consumer_sdk import InboxConfig, InboxConsumer, InboxMessage
from consumer_sdk.jobs import JobContext, NewJob, WorkerConfig, WorkerPool, enqueue
from outbox_embedded.calibration import ROUND_TRIPS, Measure, rotated, round_trip
from outbox_embedded.queries import query

ConfigT = TypeVar("ConfigT", InboxConfig, WorkerConfig)

KAFKA = {"fetch.wait.max.ms": 50, "logger": logging.getLogger("sdk_bench.kafka")}


def q(name: str) -> str:
    return query("inbox_bench", name)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dsn", default=None, help="PostgreSQL server (a database is created on it); "
                   "default: an embedded one")
    p.add_argument("--bootstrap-servers", default=None, help="Kafka to use (default: a local tansu)")
    p.add_argument("--messages", type=int, default=50_000)
    p.add_argument("--single-messages", type=int, default=10_000,
                   help="messages for the one-at-a-time consumer")
    p.add_argument("--payload-bytes", type=int, default=500)
    p.add_argument("--partitions", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=500)
    p.add_argument("--jobs", type=int, default=5_000)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--runs", type=int, default=3, help="round-robin repetitions (median shown)")
    p.add_argument("--only", choices=("consumer", "jobs"), default=None)
    p.add_argument("--variants", default=None,
                   help="comma-separated consumer variants to run (of naive, inbox_batch, inbox_batch_bh, "
                        "inbox_batch_statements, naive_single, inbox_single, inbox_single_statements; "
                        "default: all)")
    p.add_argument("--phases", default="new,redelivered", help="comma-separated: new, redelivered")
    p.add_argument("--round-trips", type=int, default=ROUND_TRIPS,
                   help="SELECT 1 round trips timed each round, the price of one (0: none)")
    p.add_argument("--db-spin-us", type=float, default=None,
                   help="the SDK's db_spin_us for its consumers and worker pools (default: the SDK's default; "
                        "0: off); the naive baselines never poll")
    p.add_argument("--json", dest="json_path", default=None)
    p.add_argument("--profile-dir", default=None,
                   help="write a cProfile (wall clock) of each InboxConsumer run to this folder")
    args = p.parse_args(argv)
    if args.round_trips < 0:
        p.error("--round-trips must be 0 (none) or more")
    return args


@contextlib.contextmanager
def services(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """(dsn of a fresh migrated database, bootstrap servers); embedded ones stopped on exit."""
    from outbox_embedded.broker import tansu_broker
    from outbox_embedded.pg import embedded_pg, external_pg
    from relay import migrate

    with contextlib.ExitStack() as stack:
        print("starting PostgreSQL ..." if not args.dsn else "using --dsn", flush=True)
        pg = external_pg(args.dsn) if args.dsn else embedded_pg()
        if not args.dsn:
            stack.callback(pg.close)
        name = f"sdk_bench_{uuid.uuid4().hex[:8]}"
        dsn = pg.create_database(name)
        stack.callback(pg.drop_database, name)
        bootstrap = args.bootstrap_servers
        if not bootstrap:
            print("starting tansu ...", flush=True)
            broker = tansu_broker()
            stack.callback(broker.close)
            bootstrap = broker.bootstrap
        migrate.apply(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(q("setup"))
        yield dsn, bootstrap


def produce(bootstrap: str, topic: str, count: int, payload_bytes: int) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "batch.num.messages": 5000,
                         "logger": logging.getLogger("sdk_bench.kafka")})
    pad = "x" * max(0, payload_bytes - 40)
    for n in range(count):
        value = json.dumps({"n": n, "pad": pad}).encode()
        while True:
            try:
                producer.produce(topic, value=value, key=f"k{n % 1000}".encode(),
                                 headers=[("event_id", str(uuid.uuid4()).encode())])
                break
            except BufferError:
                producer.poll(0.05)
        producer.poll(0)
    if producer.flush(60) != 0:
        raise RuntimeError("could not produce the benchmark's messages")


# -- consumers ---------------------------------------------------------------------------


def _assigned_consumer(bootstrap: str, topic: str, partitions: int, group: str) -> Consumer:
    """The naive consumers' Kafka side: every partition assigned, offsets committed by hand."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False,
                         "auto.offset.reset": "earliest", **KAFKA})
    consumer.assign([TopicPartition(topic, p) for p in range(partitions)])
    return consumer


def naive_consumer(dsn: str, bootstrap: str, topic: str, partitions: int, *, inbox: str, group: str,
                   count: int) -> dict[str, float]:
    """The ~40-line dedup consumer a team writes itself."""
    consumer = _assigned_consumer(bootstrap, topic, partitions, group)
    seen = 0
    with psycopg.connect(dsn) as conn, Measure() as m:
        while seen < count:
            msgs = [msg for msg in consumer.consume(500, timeout=1.0) if msg.error() is None]
            if not msgs:
                continue
            ids = [_event_id(msg) for msg in msgs]
            with conn.transaction():
                new = {row[0] for row in conn.execute(q("naive_inbox"), {
                    "consumer": inbox, "event_ids": ids, "topics": [msg.topic() for msg in msgs],
                    "partitions": [msg.partition() for msg in msgs],
                    "offsets": [msg.offset() for msg in msgs]})}
                if new:
                    fresh = [(i, json.loads(msg.value() or b"null")["n"]) for i, msg in zip(ids, msgs, strict=True)
                             if i in new]
                    conn.execute(q("naive_effects"), {"consumer": inbox, "event_ids": [i for i, _ in fresh],
                                                      "ns": [n for _, n in fresh]})
            consumer.commit(asynchronous=False)
            seen += len(msgs)
    consumer.close()
    return m.figures(count)


def naive_single_consumer(dsn: str, bootstrap: str, topic: str, partitions: int, *, inbox: str, group: str,
                          count: int) -> dict[str, float]:
    """The same, one transaction per message (BEGIN, the inbox row, the effect, COMMIT), the
    offsets committed after each poll: the one-at-a-time reference."""
    consumer = _assigned_consumer(bootstrap, topic, partitions, group)
    seen = 0
    with psycopg.connect(dsn) as conn, Measure() as m:
        while seen < count:
            msgs = [msg for msg in consumer.consume(500, timeout=1.0) if msg.error() is None]
            for msg in msgs:
                event_id = _event_id(msg)
                with conn.transaction():
                    if conn.execute(q("naive_inbox_one"), {
                            "consumer": inbox, "event_id": event_id, "topic": msg.topic(),
                            "partition": msg.partition(), "offset": msg.offset()}).fetchone():
                        conn.execute(q("effect"), {"event_id": event_id, "consumer": inbox,
                                                   "n": json.loads(msg.value() or b"null")["n"]})
            if msgs:
                consumer.commit(asynchronous=False)
            seen += len(msgs)
    consumer.close()
    return m.figures(count)


def _event_id(msg: Any) -> uuid.UUID:
    raw = dict(msg.headers() or [])["event_id"]
    return uuid.UUID(raw.decode() if isinstance(raw, bytes) else str(raw))


def sdk_consumer(dsn: str, bootstrap: str, topic: str, *, inbox: str, group: str, batch_size: int,
                 count: int, batched: bool = False, statements: bool = False,
                 profile: str | None = None, spin_us: float | None = None) -> dict[str, float]:
    def handler(conn: psycopg.Connection[Any], message: InboxMessage) -> None:
        conn.execute(q("effect"), {"event_id": message.event_id, "consumer": inbox,
                                   "n": message.json()["n"]})

    def effect_statements(message: InboxMessage) -> list[tuple[Any, Any]]:
        return [(q("effect"), {"event_id": message.event_id, "consumer": inbox, "n": message.json()["n"]})]

    def batch_handler(conn: psycopg.Connection[Any], messages: Sequence[InboxMessage]) -> None:
        conn.execute(q("naive_effects"), {"consumer": inbox, "event_ids": [m.event_id for m in messages],
                                          "ns": [m.json()["n"] for m in messages]})

    config = InboxConfig(name=inbox, group_id=group, dsn=dsn, bootstrap_servers=bootstrap, topics=[topic],
                         assignment="assign", batch_size=batch_size, poll_timeout_s=1.0,
                         check_retention=False, check_dead_letter_topics=False, kafka_properties=KAFKA)
    config = _spun(config, spin_us)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(q("rebind"), {"consumer": inbox, "group": group})
    if batched:
        consumer = InboxConsumer(config, batch_handler=batch_handler)
    elif statements:
        consumer = InboxConsumer(config, statements=effect_statements)
    else:
        consumer = InboxConsumer(config, handler)
    consumer.start()
    profiler = cProfile.Profile() if profile else None
    try:
        with Measure() as m:
            if profiler is not None:
                profiler.enable()
            while consumer.totals.settled < count:
                consumer.run_once()
            if profiler is not None:
                profiler.disable()
    finally:
        consumer.close()
    if profiler is not None and profile:
        profiler.dump_stats(profile)
    if consumer.totals.settled != count:
        raise RuntimeError(f"{inbox}: settled {consumer.totals.settled} of {count}")
    with psycopg.connect(dsn, autocommit=True) as conn:  # each message's effect once, in every phase
        row = conn.execute(q("counts"), {"consumer": inbox}).fetchone()
    if row is None or row[0] != count:
        raise RuntimeError(f"{inbox}: {row[0] if row else 0} effect rows for {count} messages")
    return m.figures(count)


#: The one-message-at-a-time variants (a smaller topic of their own).
SINGLE = frozenset({"inbox_single", "naive_single", "inbox_single_statements"})


def consumer_round(args: argparse.Namespace, dsn: str, bootstrap: str, run: int,
                   results: dict[str, list[dict[str, float]]]) -> None:
    """One round of every consumer variant, on new messages then on redeliveries."""
    tag = uuid.uuid4().hex[:6]
    topics = {}
    chosen = set(args.variants.split(",")) if args.variants else None
    sizes = [("big", args.messages)] if chosen is None or chosen - SINGLE else []
    if chosen is None or chosen & SINGLE:
        sizes.append(("small", args.single_messages))
    for size, count in sizes:
        topics[size] = f"sdk-bench-{size}-{tag}"
        from outbox_embedded.broker import create_topic

        create_topic(bootstrap, topics[size], partitions=args.partitions)
        produce(bootstrap, topics[size], count, args.payload_bytes)
    variants: list[tuple[str, Callable[[str, str, str | None], dict[str, float]]]] = [
        ("naive", lambda inbox, group, _profile: naive_consumer(
            dsn, bootstrap, topics["big"], args.partitions, inbox=inbox, group=group, count=args.messages)),
        ("inbox_batch", lambda inbox, group, profile: sdk_consumer(
            dsn, bootstrap, topics["big"], inbox=inbox, group=group, batch_size=args.batch_size,
            count=args.messages, profile=profile, spin_us=args.db_spin_us)),
        ("inbox_batch_bh", lambda inbox, group, profile: sdk_consumer(
            dsn, bootstrap, topics["big"], inbox=inbox, group=group, batch_size=args.batch_size,
            count=args.messages, batched=True, profile=profile, spin_us=args.db_spin_us)),
        ("inbox_batch_statements", lambda inbox, group, profile: sdk_consumer(
            dsn, bootstrap, topics["big"], inbox=inbox, group=group, batch_size=args.batch_size,
            count=args.messages, statements=True, profile=profile, spin_us=args.db_spin_us)),
        ("naive_single", lambda inbox, group, _profile: naive_single_consumer(
            dsn, bootstrap, topics["small"], args.partitions, inbox=inbox, group=group,
            count=args.single_messages)),
        ("inbox_single", lambda inbox, group, profile: sdk_consumer(
            dsn, bootstrap, topics["small"], inbox=inbox, group=group, batch_size=1,
            count=args.single_messages, profile=profile, spin_us=args.db_spin_us)),
        ("inbox_single_statements", lambda inbox, group, profile: sdk_consumer(
            dsn, bootstrap, topics["small"], inbox=inbox, group=group, batch_size=1,
            count=args.single_messages, statements=True, profile=profile, spin_us=args.db_spin_us)),
    ]
    if chosen is not None:
        unknown = chosen - {name for name, _ in variants}
        if unknown:
            raise SystemExit(f"unknown variant(s): {', '.join(sorted(unknown))}")
        variants = [v for v in variants if v[0] in chosen]
    for phase in args.phases.split(","):
        for name, call in rotated(variants, run):
            inbox = f"bench-{name}-{tag}"
            figures = call(inbox, f"{inbox}-{phase}", _profile_path(args, name, phase, run))
            results.setdefault(f"{name}_{phase}", []).append(figures)
            print(f"  run {run + 1} {name:13} {phase:11} {figures['rate']:10.0f} msg/s "
                  f"{figures['cpu_us']:7.1f} us CPU/msg", flush=True)


def _profile_path(args: argparse.Namespace, name: str, phase: str, run: int) -> str | None:
    if not args.profile_dir:
        return None
    Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
    return str(Path(args.profile_dir) / f"{name}_{phase}_{run + 1}.prof")


def _spun(config: ConfigT, spin_us: float | None) -> ConfigT:
    """``config`` with ``db_spin_us`` set (``--db-spin-us``); the SDK's default when None."""
    return config if spin_us is None else dataclasses.replace(config, db_spin_us=spin_us)


# -- workers -----------------------------------------------------------------------------


def naive_workers(dsn: str, *, queue: str, threads: int, count: int) -> dict[str, float]:
    def loop(worker: str) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while True:
                row = conn.execute(q("naive_claim"), {"worker": worker, "queue": queue}).fetchone()
                if row is None:
                    return
                params = {"id": row[0], "token": row[1], "worker": worker}
                conn.execute(q("naive_job_effect"), params)
                conn.execute(q("naive_done"), params)

    pool = [threading.Thread(target=loop, args=(f"naive-{i}",)) for i in range(threads)]
    with Measure() as m:
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    return m.figures(count)


def sdk_workers(dsn: str, *, queue: str, threads: int, count: int, one_trip: bool = False,
                spin_us: float | None = None) -> dict[str, float]:
    def handler(ctx: JobContext) -> None:
        with ctx.fenced_transaction() as conn:
            conn.execute(q("job_effect"), {"id": ctx.job.id, "token": ctx.job.token})

    def one_trip_handler(ctx: JobContext) -> None:
        ctx.fenced_execute(q("job_effect"), {"id": ctx.job.id, "token": ctx.job.token})

    config = _spun(WorkerConfig(dsn=dsn, queues=[queue], max_concurrency=threads, poll_interval_s=1.0), spin_us)
    pool = WorkerPool(config, {"bench": one_trip_handler if one_trip else handler})
    with Measure() as m:
        pool.start()
        while pool.outcomes["succeeded"] < count:  # a Counter the pool updates: cheap to read
            time.sleep(0.02)
    pool.stop()
    return {**m.figures(count), "jobs_per_round": count / max(1, pool.rounds)}


def jobs_round(args: argparse.Namespace, dsn: str, run: int, results: dict[str, list[dict[str, float]]]) -> None:
    variants: list[tuple[str, Callable[[str], dict[str, float]]]] = [
        ("naive_workers", lambda queue: naive_workers(dsn, queue=queue, threads=args.threads, count=args.jobs)),
        ("worker_pool", lambda queue: sdk_workers(dsn, queue=queue, threads=args.threads, count=args.jobs,
                                                  spin_us=args.db_spin_us)),
        ("worker_pool_execute", lambda queue: sdk_workers(dsn, queue=queue, threads=args.threads, count=args.jobs,
                                                           one_trip=True, spin_us=args.db_spin_us)),
    ]
    for name, call in rotated(variants, run):
        queue = f"bench-{uuid.uuid4().hex[:8]}"
        with psycopg.connect(dsn, autocommit=True) as conn:
            for start in range(0, args.jobs, 1000):
                enqueue(conn, [NewJob(owner_id=f"o{i % 50}", queue=queue, kind="bench", payload={"i": i})
                               for i in range(start, min(args.jobs, start + 1000))])
            conn.execute(q("vacuum_jobs"))
        figures = call(queue)
        results.setdefault(name, []).append(figures)
        extra = f" {figures['jobs_per_round']:5.1f} jobs/round" if "jobs_per_round" in figures else ""
        print(f"  run {run + 1} {name:19} {figures['rate']:10.0f} jobs/s {figures['cpu_us']:7.1f} us CPU/job{extra}",
              flush=True)


# -- report ------------------------------------------------------------------------------


#: Each ratio's figures: (numerator, denominator), both measured in every round.
RATIOS: dict[str, tuple[str, str]] = {
    "inbox_batch_new_vs_naive": ("inbox_batch_new", "naive_new"),
    "inbox_batch_redelivered_vs_naive": ("inbox_batch_redelivered", "naive_redelivered"),
    "inbox_batch_bh_new_vs_naive": ("inbox_batch_bh_new", "naive_new"),
    "inbox_batch_bh_redelivered_vs_naive": ("inbox_batch_bh_redelivered", "naive_redelivered"),
    "inbox_single_new_vs_naive_single": ("inbox_single_new", "naive_single_new"),
    "inbox_single_redelivered_vs_naive_single": ("inbox_single_redelivered", "naive_single_redelivered"),
    "inbox_batch_statements_new_vs_naive": ("inbox_batch_statements_new", "naive_new"),
    "inbox_batch_statements_redelivered_vs_naive": ("inbox_batch_statements_redelivered", "naive_redelivered"),
    "inbox_single_statements_new_vs_naive_single": ("inbox_single_statements_new", "naive_single_new"),
    "inbox_single_statements_new_vs_inbox_single": ("inbox_single_statements_new", "inbox_single_new"),
    "worker_pool_vs_naive": ("worker_pool", "naive_workers"),
    "worker_pool_execute_vs_naive": ("worker_pool_execute", "naive_workers"),
}


def summarize(args: argparse.Namespace, results: dict[str, list[dict[str, float]]],
              trips: Sequence[dict[str, float]] = ()) -> dict[str, Any]:
    """The report: each figure's medians, every ratio three ways, and with ``trips`` (one
    :func:`round_trip` a round) the price of a round trip and each figure in round trips."""
    trips = list(trips)
    med = {name: {k: round(statistics.median(r[k] for r in runs), 1) for k in ("rate", "cpu_us")}
           for name, runs in results.items()}
    report: dict[str, Any] = {"params": {k: v for k, v in vars(args).items() if k not in ("dsn", "json_path")},
                              "figures": med}
    report["ratios"] = {name: round(med[a]["rate"] / med[b]["rate"], 3) if a in med and b in med else None
                        for name, (a, b) in RATIOS.items()}
    # Each round's own ratio (its figures minutes apart at most), and their median: the
    # machine's speed drifts between rounds, so a ratio of medians can pair a fast round's
    # figure with a slow round's.
    per_round = {name: [round(x["rate"] / y["rate"], 3) for x, y in zip(results[a], results[b], strict=True)]
                 for name, (a, b) in RATIOS.items() if a in results and b in results}
    report["ratios_per_round"] = per_round
    report["ratios_round_median"] = {name: round(statistics.median(values), 3) for name, values in per_round.items()}
    for pool in ("worker_pool", "worker_pool_execute"):  # the names earlier reports used
        if f"{pool}_vs_naive" in per_round:
            report[f"{pool}_vs_naive_per_run"] = per_round[f"{pool}_vs_naive"]
    if "worker_pool" in results:
        report["jobs_per_claim_round"] = round(statistics.median(
            r["jobs_per_round"] for r in results["worker_pool"]), 1)
    if trips:
        report["round_trip"] = {key: round(statistics.median(t[key] for t in trips), 1) for key in ("wall_us", "cpu_us")}
        report["round_trip"]["per_round"] = trips
        # Each figure's time per item over its own round's round trip (figures of one round
        # are minutes apart at most), the median of the rounds'.
        report["in_round_trips"] = {
            name: round(statistics.median(1e6 / r["rate"] / t["wall_us"] for r, t in zip(runs, trips, strict=True)), 2)
            for name, runs in results.items() if len(runs) == len(trips)}
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    logging.getLogger("sdk_bench.kafka").setLevel(logging.ERROR)
    results: dict[str, list[dict[str, float]]] = {}
    trips: list[dict[str, float]] = []
    with services(args) as (dsn, bootstrap):
        for run in range(args.runs):
            if args.round_trips > 0:
                trips.append(round_trip(dsn, args.round_trips))
                print(f"  run {run + 1} round trip (SELECT 1) {trips[-1]['wall_us']:8.1f} us wall "
                      f"{trips[-1]['cpu_us']:7.1f} us CPU", flush=True)
            if args.only in (None, "consumer"):
                consumer_round(args, dsn, bootstrap, run, results)
            if args.only in (None, "jobs"):
                jobs_round(args, dsn, run, results)
    report = summarize(args, results, trips)
    print("\nmedians of", args.runs, "run(s):")
    if "round_trip" in report:
        print(f"  {'round trip (SELECT 1)':26} {report['round_trip']['wall_us']:10.1f} us wall "
              f"{report['round_trip']['cpu_us']:8.1f} us CPU")
    in_trips = report.get("in_round_trips", {})
    for name, fig in report["figures"].items():
        unit = "jobs/s" if "worker" in name else "msg/s"
        trips_each = f" {in_trips[name]:6.2f} round trips/item" if name in in_trips else ""
        print(f"  {name:26} {fig['rate']:10.0f} {unit:6} {fig['cpu_us']:8.1f} us CPU/item{trips_each}")
    for name, value in report["ratios"].items():
        rounds = report["ratios_per_round"].get(name)
        detail = "" if rounds is None else (f"  rounds {' / '.join(map(str, rounds))},"
                                            f" their median {report['ratios_round_median'][name]}")
        print(f"  {name:43} {value}{detail}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
