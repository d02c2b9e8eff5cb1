"""``python -m outbox_embedded.claim_bench``: what PostgreSQL spends per row executing the
relay's claim, next to a plain scan that returns the same columns (issue 18: "the claim
re-serialises jsonb payloads and probes the back-off index per row"; measure each query
choice).

A fresh database with the migrations applied and ``--rows`` pending rows loaded and
vacuumed; the relay's store claims the whole backlog once in batches of ``--batch-size``,
and each batch's parameters are kept.  Then, in rotating order, each variant runs at every
batch's position under ``EXPLAIN (ANALYZE, TIMING OFF)``, read only: the executor's own
time, summed and divided by the rows returned.  It leaves out parsing, planning and sending
the rows, which the variants share, and it is exact where a CPU-time sample of the server
(10 ms ticks) is not, for statements of a few milliseconds.

Variants:

* ``relay``: the claim as relay/store.py sends it (outbox_core/sql/queries/relay.sql);
* ``no_budget``: the same with the byte budget's running sum replaced by 0: what the
  budget's window costs (it copies every row, payload included, into a tuple store);
* ``plain``: the same columns from the pending index in (xid, id) order after the same
  position, and nothing else (outbox_embedded/sql/bench.sql, claim_bench_plain); only with
  every shard held (it takes every shard's rows);
* ``xid_id_index``: the relay's claim with migration 0001's index of the pending rows by
  ``(xid, id)`` in place of migrate's ``(xid, id, shard)`` one (issue 18's forty-second
  pass): a replica holding some of the shards then reads its peers' rows from the table and
  filters them out.  Each variant's statement runs in a transaction rolled back after it,
  which drops the other variant's index (claim_bench_hide_index): both are built once.

``--held K`` claims as a replica holding K of the 16 shards (spread: 0, 16/K, ...).

``--adopted`` loads the backlog into a Debezium outbox table that ``migrate
--debezium-table`` adopted (relay/adopt.py; the rows pending) and claims it through the view
it made, as a relay run with ``--table`` claims it.  Its variants: ``relay`` (the adopted
table's claim index for the shard count, relay/adopt_index.py), ``no_budget``, and
``xid_seq_index``, the relay's claim with the (relay_xid, relay_seq) index adopt built
before the adopted table's index carried the shard.

The durable embedded PostgreSQL of ``outbox-relay bench`` by default (``--dsn`` for
another).  Benchmarks are not tests: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import sys
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

from outbox_embedded.calibration import rotated, write_json
from outbox_embedded.mark_bench import migrated_database
from outbox_embedded.queries import query
from relay import adopt_index
from relay.adopt import DEFAULT_TOPIC_TEMPLATE, adopt
from relay.migrate import SHARD_COLUMN_SINCE, XID_ID_INDEX, pending_index
from relay.model import Cursor, ShardId
from relay.queries import compose
from relay.store import Store, claim_params

#: The shard count claim_bench_shard_index is built for: the migrations' default.
NSHARDS = 16
#: The budget's running sum in claim_batch (its window function), which no_budget replaces by 0.
RUNNING_SUM = re.compile(r"sum\(least\(s\.size, %\(max_bytes\)s\)\)\s+OVER \([^)]*\)")
#: The index each variant hides (drops inside its rolled-back transaction): the relay's
#: variants claim through migrate's index for 16 shards, xid_id_index through 0001's.
HIDDEN = {"xid_id_index": pending_index(NSHARDS)}
#: --adopted: the Debezium table, in a schema of its own, and the view the relay claims through.
ADOPTED = ("claim_bench", "outbox_events")
ADOPTED_VIEW = "claim_bench.outbox_events_relay"
#: --adopted's xid_seq_index variant's index: adopt's before relay/adopt_index.py.
ADOPTED_XID_SEQ = "outbox_events_relay_pending_idx"

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dsn", default=None, help="PostgreSQL server (a database is created per "
                   "round); default: an embedded durable one")
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--payload-bytes", type=int, default=512)
    p.add_argument("--keys", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=1000)
    p.add_argument("--held", type=int, default=NSHARDS, choices=(1, 2, 4, 8, 16),
                   help="shards of 16 the claiming replica holds (default: all)")
    p.add_argument("--adopted", action="store_true",
                   help="claim an adopted Debezium table through its view (see the module)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", dest="json_path", default=None)


def statements(conn: psycopg.Connection[Any], held: int, *, adopted: bool = False) -> dict[str, str]:
    """Each variant's statement text (plain only with every shard held, on the outbox)."""
    composed = compose("relay", "claim_batch", table=ADOPTED_VIEW if adopted else "outbox")
    relay = composed if isinstance(composed, str) else composed.as_string(conn)
    no_budget, found = RUNNING_SUM.subn("0::bigint", relay)
    if found != 1:
        raise SystemExit("claim_bench: claim_batch's running sum changed shape; update RUNNING_SUM")
    if adopted:
        return {"relay": relay, "no_budget": no_budget, "xid_seq_index": relay}
    texts = {"relay": relay, "no_budget": no_budget, "xid_id_index": relay}
    if held == NSHARDS:
        texts["plain"] = query("bench", "claim_bench_plain")
    return texts


def load_adopted(conn: psycopg.Connection[Any], dsn: str, args: argparse.Namespace) -> dict[str, sql.Composable]:
    """--adopted's backlog: the Debezium table loaded, adopted with its rows pending, and adopt's
    former (relay_xid, relay_seq) index built beside its claim index; returns the index each
    variant hides."""
    schema, table = ADOPTED
    conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    conn.execute(sql.SQL(query("bench", "debezium_table")).format(table=sql.Identifier(schema, table)))
    conn.execute(query("bench", "claim_bench_load_debezium"),
                 {"keys": args.keys, "payload_bytes": args.payload_bytes, "count": args.rows})
    adopt(conn, source=f"{schema}.{table}", view=ADOPTED_VIEW, topic_template=DEFAULT_TOPIC_TEMPLATE,
          ce_source=None, existing="pending", dsn=dsn, lock_timeout_s=5.0, tries=3, index_wait_s=300.0)
    source = sql.Identifier(schema, table)
    conn.execute(sql.SQL(adopt_index.blocks()["pending_index"]).format(
        index=sql.Identifier(ADOPTED_XID_SEQ), source=source), {})
    conn.execute(sql.SQL("VACUUM ANALYZE {}").format(source))
    claim_index = adopt_index.claim_index(table, conn.info.server_version, NSHARDS)
    hide = {"xid_seq_index": claim_index}
    return {v: sql.Identifier(schema, hide.get(v, ADOPTED_XID_SEQ)) for v in ("relay", "no_budget", "xid_seq_index")}


def held_shards(held: int) -> list[ShardId]:
    """``held`` of the 16 shards, spread over them."""
    return [ShardId(s) for s in range(0, NSHARDS, NSHARDS // held)]


def positions(dsn: str, batch: int, held: int, table: str = "outbox") -> list[dict[str, Any]]:
    """claim_batch's parameters at each batch of the backlog, as a replica holding ``held``
    shards claims it."""
    store = Store(dsn, table=table)
    try:
        every = store.claim_shards(owner="claim_bench", limit=1 << 16, lease_s=3600)
        if len(every) != NSHARDS:
            raise SystemExit(f"claim_bench: the database has {len(every)} shards, not {NSHARDS}")
        shards = held_shards(held)
        found: list[dict[str, Any]] = []
        cursor = Cursor()
        while True:
            params = claim_params(shards=shards, nshards=NSHARDS, after=cursor, limit=batch,
                                  max_bytes=1_000_000, budget_bytes=4 << 20, now=None)
            rows, snapshot, _cut = store.claim(shards=shards, nshards=NSHARDS, after=cursor, limit=batch)
            if not rows:
                return found
            params["cur"] = params["cur"] or snapshot
            found.append(params)
            cursor = cursor.advanced(rows[-1], snapshot or cursor.cur)
    finally:
        store.close()


def measure(admin_dsn: str, args: argparse.Namespace, round_: int) -> dict[str, float]:
    """One round: µs of executor time per claimed row, by variant."""
    with migrated_database(admin_dsn) as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            if conn.info.server_version < SHARD_COLUMN_SINCE:
                raise SystemExit("claim_bench compares the claim's index with the shard column against "
                                 "0001's (xid, id) one: migrate builds the former on PostgreSQL 17 and "
                                 f"later only, and this server is {conn.info.server_version}")
            if args.adopted:
                hidden = load_adopted(conn, dsn, args)
            else:
                conn.execute(query("bench", "bench_load_pending"),
                             {"topic": "claim_bench", "keys": args.keys, "payload_bytes": args.payload_bytes,
                              "count": args.rows})
                conn.execute(query("bench", "claim_bench_xid_id_index"))
                conn.execute("VACUUM ANALYZE outbox")
                hidden = {v: sql.Identifier(HIDDEN.get(v, XID_ID_INDEX))
                          for v in ("relay", "no_budget", "plain", "xid_id_index")}
        batches = positions(dsn, args.batch_size, args.held, ADOPTED_VIEW if args.adopted else "outbox")
        with psycopg.connect(dsn, autocommit=True) as conn:
            texts = statements(conn, args.held, adopted=args.adopted)
            spent = dict.fromkeys(texts, 0.0)
            rows = dict.fromkeys(texts, 0)
            for i, params in enumerate(batches):
                for variant in rotated(list(texts), round_ + i):
                    with conn.transaction(force_rollback=True):
                        conn.execute(sql.SQL(query("bench", "claim_bench_hide_index")).format(
                            index=hidden[variant]))
                        ((plan,),) = conn.execute("EXPLAIN (ANALYZE, TIMING OFF, FORMAT JSON) " + texts[variant],
                                                  params).fetchall()
                    spent[variant] += plan[0]["Execution Time"]
                    rows[variant] += plan[0]["Plan"]["Actual Rows"]
    if len(set(rows.values())) != 1 or (args.held == NSHARDS and rows["relay"] != args.rows):
        raise SystemExit(f"claim_bench: the variants did not each return the same rows (all {args.rows} "
                         f"with every shard held): {rows}")
    return {v: spent[v] * 1000 / rows[v] for v in texts}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m outbox_embedded.claim_bench",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    add_arguments(p)
    args = p.parse_args(argv)
    with contextlib.ExitStack() as stack:
        admin_dsn = args.dsn
        if not admin_dsn:
            from outbox_embedded import pg

            print("starting an embedded PostgreSQL (durable) ...", flush=True)
            server = pg.embedded_pg(durable=True)
            stack.callback(server.close)
            admin_dsn = server.dsn("postgres")
        runs: list[dict[str, float]] = []
        for r in range(max(1, args.rounds)):
            runs.append(measure(admin_dsn, args, r))
            print(f"round {r + 1}: " + ", ".join(f"{v} {us:.2f}" for v, us in runs[-1].items())
                  + " µs of execution a row", flush=True)
    medians = {v: round(statistics.median([m[v] for m in runs]), 3) for v in runs[0]}
    print(f"\nmedians of {len(runs)} rounds, {args.rows} rows of {args.payload_bytes} B, batches of "
          f"{args.batch_size}, {args.held} of {NSHARDS} shards held: " + ", ".join(f"{v} {us:.2f}" for v, us in medians.items())
          + " µs of execution a row")
    write_json(args.json_path, medians)
    return 0


if __name__ == "__main__":
    sys.exit(main())
