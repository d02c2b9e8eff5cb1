"""``python -m outbox_embedded.mark_bench``: what the database pays per row for the relay's
claim and mark, on the schema the migrations make and on variants of it (issue 18: "measure
each schema and query choice: indexes each mark updates, HOT marks with a fillfactor, how
cleanup finds published rows").

For each variant, in rounds whose order rotates (the machine drifts): a fresh database with
the migrations applied and the variant's DDL, ``--rows`` pending rows loaded and vacuumed,
then the relay's own statements through its own store (relay/store.py), one connection:
claims of ``--batch-size`` until the backlog is claimed, then each batch's fenced mark.
Reported per variant (medians): claims and marks in rows/s, PostgreSQL's CPU per row for
each (its whole process tree, when the server is on this machine), the share of marks that
were HOT updates, the heap's size after the marks, and the indexes' sizes before and after
them.

Variants:

* ``migrated``: the schema as ``outbox-relay migrate`` leaves it (the partial index of
  pending rows, the back-off index, the cleanup's index of published rows; since migration
  0015 the two unique indexes at fillfactor 50);
* ``unique_ff90``: the two unique indexes at PostgreSQL's default fillfactor, as before
  migration 0015 (a mark's new entries split the leaves they go to);
* ``heap_ff50``: the migrated schema with the heap at fillfactor 50: marks stay non-HOT
  (every index as migrated) but each row's new version fits on its own page, so a mark
  neither extends the table (its extension lock) nor looks for free space elsewhere;
* ``no_published_index``: without the cleanup's index (one index fewer per mark);
* ``hot_ff50`` / ``hot_ff70``: no index naming ``published_at`` (the claim's index over
  all rows, the back-off index without it, cleanup by a BRIN index) and a fillfactor of
  50 / 70, so that a mark can be a HOT update: the design change the README describes as
  not made, priced (on PostgreSQL 15 and older the BRIN index still makes marks non-HOT);
* ``delete``: the mark of ``--keep-published false`` on the migrated schema;
* ``bytea_payload``: the migrated schema with each row's payload as bytes
  (``payload_bytes``, the jsonb's own text) instead of ``jsonb``: what the claim's output of
  a jsonb payload costs (the physical floor's payload is bytes);
* ``event_id_pending``: ``event_id`` unique among pending rows only (a partial unique
  index): a mark then writes no entry into that index, but a reused ``event_id`` is
  refused only while the first row is pending, not while it is kept;
* ``xid_id_index``: migration 0001's index of the pending rows by ``(xid, id)`` in place of
  migrate's ``(xid, id, shard)`` one (issue 18's forty-second pass): with ``--drain
  --replicas 4``, what the shard column is worth to four replicas (the same as
  ``migrated`` before PostgreSQL 17, where migrate keeps 0001's index);
* ``pk_only``: that, and cleanup by a BRIN index instead of the B-tree of published rows:
  the primary key is the one index a mark writes, as on the physical floor's table.

With ``--drain``, each round also runs the physical floor of ``outbox-relay bench``
(outbox_embedded/baselines.py) and, on each variant's schema, a real relay process draining
the backlog through a broker (``outbox-relay bench``'s drain: its rate, its ratio to that
round's floor, and every process's CPU per row): what a variant would make of the drain
target, end to end.

The durable embedded PostgreSQL of ``outbox-relay bench`` by default (``--dsn`` for
another), and with ``--drain`` a local tansu (``--bootstrap-servers`` for another).
Benchmarks are not tests: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg

from outbox_embedded.calibration import rotated, write_json
from outbox_embedded.cpu_split import CpuSplit
from outbox_embedded.pg import scratch_database
from outbox_embedded.queries import query
from relay import migrate
from relay.model import Cursor, Lease, OutboxRow, ShardId, Token
from relay.store import Store

VARIANTS: dict[str, tuple[str, ...]] = {
    "migrated": (),
    "no_published_index": ("mark_bench_drop_published_index",),
    "hot_ff50": ("mark_bench_drop_published_index", "mark_bench_drop_pending_index",
                 "mark_bench_claim_index_all_rows", "mark_bench_drop_retrying_index",
                 "mark_bench_retrying_index_without_published_at", "mark_bench_published_brin",
                 "mark_bench_fillfactor_50"),
    "hot_ff70": ("mark_bench_drop_published_index", "mark_bench_drop_pending_index",
                 "mark_bench_claim_index_all_rows", "mark_bench_drop_retrying_index",
                 "mark_bench_retrying_index_without_published_at", "mark_bench_published_brin",
                 "mark_bench_fillfactor_70"),
    "delete": (),
    "bytea_payload": (),
    "event_id_pending": ("mark_bench_event_id_unique_pending",
                         "mark_bench_event_id_unique_pending_index"),
    "pk_only": ("mark_bench_event_id_unique_pending", "mark_bench_event_id_unique_pending_index",
                "mark_bench_drop_published_index", "mark_bench_published_brin"),
    "unique_ff90": ("mark_bench_pkey_ff_default", "mark_bench_event_id_ff_default"),
    "heap_ff50": ("mark_bench_fillfactor_50",),
    "xid_id_index": ("mark_bench_drop_shard_index", "claim_bench_xid_id_index"),
}
#: Variants whose rows are loaded otherwise: bytea_payload's payload is bytes, not jsonb.
LOADS: dict[str, str] = {"bytea_payload": "bench_load_pending_bytes"}


def _load_query(variant: str) -> str:
    """The bench.sql query that loads ``variant``'s pending rows."""
    return LOADS.get(variant, "bench_load_pending")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dsn", default=None, help="PostgreSQL server (a database is created per "
                   "variant and round); default: an embedded durable one")
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--payload-bytes", type=int, default=512)
    p.add_argument("--keys", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--drain", action="store_true",
                   help="also the relay's drain on each variant's schema, next to the physical floor")
    p.add_argument("--replicas", type=int, default=1,
                   help="relay processes of --drain (more than 1: outbox-relay bench's settled "
                        "scale-out drain, the replicas holding their shares before the backlog)")
    p.add_argument("--exactly-once", action="store_true",
                   help="--drain in exactly-once mode (it claims one shard at a time), on a broker "
                        "with transactions")
    p.add_argument("--bootstrap-servers", default=None, help="Kafka for --drain (default: a local tansu)")
    p.add_argument("--json", dest="json_path", default=None)


@contextlib.contextmanager
def migrated_database(admin_dsn: str) -> Iterator[str]:
    """A scratch database with the schema the migrations make (dropped afterwards)."""
    with scratch_database(admin_dsn, "outbox_mark_bench_") as dsn:
        migrate.apply(dsn)
        yield dsn


def measure(admin_dsn: str, variant: str, args: argparse.Namespace, split: CpuSplit) -> dict[str, float]:
    """One variant once: claims, then marks, of a fresh backlog."""
    with migrated_database(admin_dsn) as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for name in VARIANTS[variant]:
                conn.execute(query("bench", name))
            conn.execute(query("bench", _load_query(variant)),
                         {"topic": "mark_bench", "keys": args.keys,
                          "payload_bytes": args.payload_bytes, "count": args.rows})
            conn.execute("VACUUM ANALYZE outbox")
            bytes_share = conn.execute(query("bench", "mark_bench_bytes_share")).fetchone()
            loaded = conn.execute(query("bench", "mark_bench_index_size")).fetchone()
            conn.execute("CHECKPOINT")  # each variant's marks start with the same WAL state
        store = Store(dsn, keep_published=variant != "delete")
        try:
            held = store.claim_shards(owner="mark-bench", limit=1 << 16, lease_s=3600)
            leases = [Lease(ShardId(s), Token(t), time.monotonic() + 3600) for s, t in held.items()]
            shards = sorted(ShardId(s) for s in held)
            claimed, claim = _timed(split, lambda: _claim_all(store, shards, args.batch_size))
            rows = sum(map(len, claimed))
            marked, mark = _timed(split, lambda: sum(
                len(store.mark_published(owner="mark-bench", leases=leases, rows=batch)[1])
                for batch in claimed))
        finally:
            store.close()
        if marked != rows or rows != args.rows:
            raise RuntimeError(f"{variant}: claimed {rows} and marked {marked} of {args.rows} rows")
        with psycopg.connect(dsn, autocommit=True) as conn:
            time.sleep(0.6)  # noqa: TID251 - the statistics collector's flush of the marks
            stats = conn.execute(query("bench", "mark_bench_table_stats")).fetchone()
    updates, hot, heap, indexes = stats if stats else (0, 0, 0, 0)
    return {"claim_rows_per_s": rows / claim[0], "mark_rows_per_s": rows / mark[0],
            **{f"claim_{k}": v / rows * 1e6 for k, v in claim[1].items()},
            **{f"mark_{k}": v / rows * 1e6 for k, v in mark[1].items()},
            "hot_share": hot / updates if updates else 0.0, "heap_mb": heap / 2**20,
            "indexes_loaded_mb": (loaded[0] if loaded else 0) / 2**20, "indexes_mb": indexes / 2**20,
            "bytes_payload_share": bytes_share[0] if bytes_share else 0.0}


def _claim_all(store: Store, shards: Sequence[ShardId], batch: int) -> list[list[OutboxRow]]:
    batches: list[list[OutboxRow]] = []
    cursor = Cursor()
    while True:
        rows, snapshot, _cut = store.claim(shards=shards, nshards=len(shards), after=cursor, limit=batch)
        if not rows:
            return batches
        batches.append(rows)
        cursor = cursor.advanced(rows[-1], snapshot or cursor.cur)


def _timed(split: CpuSplit, run: Any) -> tuple[Any, tuple[float, dict[str, float]]]:
    """(what ``run`` returned, (its wall seconds, {"postgres_cpu_us": CPU seconds of each tree}))."""
    before, started = split.snapshot(), time.perf_counter()
    value = run()
    elapsed, after = time.perf_counter() - started, split.snapshot()
    return value, (elapsed, {f"{name}_cpu_us": after[name] - before[name] for name in before})


def drain(bench: Any, variant: str, floor: float) -> dict[str, float]:
    """The relay's drain (a real process, ``outbox-relay bench``'s) on ``variant``'s schema."""
    statements = VARIANTS[variant]

    def apply(dsn: str) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for name in statements:
                conn.execute(query("bench", name))

    bench.schema_hook = apply
    loads_before, bench.pending_load = bench.pending_load, _load_query(variant)
    try:
        if bench.args.replicas > 1:
            if variant == "delete":
                raise SystemExit("mark_bench: --replicas drains keep published rows; drop the delete variant")
            if bench.args.exactly_once:
                raise SystemExit("mark_bench: --exactly-once drains with one relay (no --replicas)")
            rate = bench.scale_out(bench.args.replicas, settled=True)
            figures = {"events_per_s": rate,
                       "cpu_split_us_per_row": bench.scale_out_splits[bench.args.replicas][-1]}
        else:
            extra = {"keep_published": "false"} if variant == "delete" else {}
            if bench.args.exactly_once:
                from outbox_embedded.bench import exactly_once_settings

                extra.update(**exactly_once_settings())
            figures = bench.relay_drain(**extra)
    finally:
        bench.schema_hook = None
        bench.pending_load = loads_before
    return {"drain_events_per_s": figures["events_per_s"], "drain_ratio_to_floor": figures["events_per_s"] / floor,
            **{f"drain_{name}_cpu_us": us for name, us in figures.get("cpu_split_us_per_row", {}).items()}}


def run(args: argparse.Namespace, admin_dsn: str, bootstrap: str | None = None) -> dict[str, dict[str, float]]:
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"mark_bench: unknown variant(s) {', '.join(unknown)}; of {', '.join(VARIANTS)}")
    split = CpuSplit.of_servers(admin_dsn)
    bench = None
    if args.drain and bootstrap:
        from outbox_embedded.bench import Bench

        bench = Bench(args, admin_dsn, bootstrap)
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for r in range(max(1, args.rounds)):
        floor = _physical_floor(bench, args) if bench is not None else 0.0
        if bench is not None:
            print(f"round {r + 1} physical floor {floor:9.0f} events/s", flush=True)
        for variant in rotated(variants, r):
            figures = measure(admin_dsn, variant, args, split)
            if bench is not None:
                figures.update(drain(bench, variant, floor))
            runs[variant].append(figures)
            print(f"round {r + 1} {variant:20} " + _line(runs[variant][-1]), flush=True)
    result = {v: {k: round(_median([m[k] for m in ms]), 3) for k in ms[0]} for v, ms in runs.items()}
    print(f"\nmedians of {max(1, args.rounds)} rounds, {args.rows} rows of {args.payload_bytes} B, "
          f"batches of {args.batch_size}:")
    for variant, figures in result.items():
        print(f"  {variant:20} " + _line(figures))
    return result


def _physical_floor(bench: Any, args: argparse.Namespace) -> float:
    from outbox_embedded.baselines import plain_loop

    with bench.fresh_db() as dsn:
        return float(plain_loop(dsn, rows=args.rows, keys=args.keys, payload_bytes=args.payload_bytes,
                                batch=args.batch_size)["events_per_s"])


def _line(f: dict[str, float]) -> str:
    cpu = (f" (PostgreSQL {f['claim_postgres_cpu_us']:.1f} µs/row)" if "claim_postgres_cpu_us" in f else "")
    mark_cpu = (f" (PostgreSQL {f['mark_postgres_cpu_us']:.1f} µs/row)" if "mark_postgres_cpu_us" in f else "")
    line = (f"claim {f['claim_rows_per_s']:9.0f} rows/s{cpu}, mark {f['mark_rows_per_s']:9.0f} rows/s"
            f"{mark_cpu}, HOT {100 * f['hot_share']:.0f} %, heap {f['heap_mb']:.0f} MB, indexes "
            f"{f['indexes_loaded_mb']:.0f} MB pending -> {f['indexes_mb']:.0f} MB marked")
    if "drain_events_per_s" in f:
        split = " + ".join(f"{k[6:-7]} {v:.1f}" for k, v in f.items() if k.startswith("drain_") and k.endswith("_cpu_us"))
        line += (f"; drain {f['drain_events_per_s']:.0f} events/s = {f['drain_ratio_to_floor']:.2f} x the "
                 f"physical floor, CPU per row {split} µs")
    return line


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m outbox_embedded.mark_bench",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    add_arguments(p)
    args = p.parse_args(argv)
    with contextlib.ExitStack() as stack:
        admin_dsn, bootstrap = args.dsn, args.bootstrap_servers
        if not admin_dsn:
            from outbox_embedded import pg

            print("starting an embedded PostgreSQL (durable) ...", flush=True)
            server = pg.embedded_pg(durable=True)
            stack.callback(server.close)
            admin_dsn = server.dsn("postgres")
        if args.drain and not bootstrap:
            from outbox_embedded import broker

            print("starting a local Kafka-compatible broker (tansu) ...", flush=True)
            tansu = broker.tansu_broker()
            stack.callback(tansu.close)
            bootstrap = tansu.bootstrap
        result = run(args, admin_dsn, bootstrap)
    write_json(args.json_path, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
