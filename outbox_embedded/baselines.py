"""The bench's baselines (issue 18): a physical floor and a naive relay, measured in the
same run as the relay so the ratios mean something on a noisy machine.

* physical floor: the plain claim + mark loop on a minimal table (id, key, payload
  bytes, published_at, one partial index), one connection: ``SELECT ... FOR UPDATE SKIP
  LOCKED LIMIT n`` then ``UPDATE ... WHERE id = ANY``, a transaction per batch.
* naive relay: that loop plus produce and flush (idempotent, acks=all) before the mark:
  about the sixty lines a team would write instead of using this relay.

Both report rows per second and this process's CPU per row (µs), and, given a
:class:`~outbox_embedded.cpu_split.CpuSplit`, the database's and the broker's.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import psycopg

from outbox_embedded.cpu_split import CpuSplit
from outbox_embedded.queries import query
from relay.config import build_settings, producer_config


def _load(dsn: str, rows: int, keys: int, payload_bytes: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(query("bench", "bench_min_table"))
        conn.execute(query("bench", "bench_min_load"),
                     {"count": rows, "keys": keys, "payload_bytes": payload_bytes})
        conn.execute("VACUUM ANALYZE bench_min")


def plain_loop(dsn: str, *, rows: int, keys: int, payload_bytes: int, batch: int,
               bootstrap: str | None = None, topic: str = "",
               split: CpuSplit | None = None) -> dict[str, Any]:
    """Drain ``rows`` from a fresh minimal table; with ``bootstrap``, produce each batch and
    flush it before marking it (the naive relay).  With ``split``, also the servers' CPU per
    row during the loop (``cpu_split_us_per_row``, this process as ``client``)."""
    _load(dsn, rows, keys, payload_bytes)
    servers_before = split.snapshot() if split is not None else {}
    producer: Any = None
    if bootstrap is not None:
        from confluent_kafka import Producer

        settings = build_settings({"dsn": "postgresql://unused/x", "bootstrap_servers": bootstrap})
        producer = Producer(producer_config(settings))
    moved = 0
    cpu0, started = time.process_time(), time.perf_counter()
    with psycopg.connect(dsn) as conn:
        while True:
            with conn.transaction():
                found = conn.execute(query("bench", "bench_min_claim"), {"limit": batch}).fetchall()
                if not found:
                    break
                if producer is not None:
                    for row_id, key, payload in found:
                        producer.produce(topic, value=payload, key=key.encode(),
                                         headers=[("event_id", str(uuid.UUID(int=row_id)).encode())])
                    if producer.flush(60) != 0:
                        raise RuntimeError("the naive relay's batch was not acknowledged in 60 s")
                conn.execute(query("bench", "bench_min_mark"), {"ids": [r[0] for r in found]})
            moved += len(found)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu0
    figures: dict[str, Any] = {"events_per_s": moved / elapsed, "cpu_us_per_row": cpu / max(moved, 1) * 1e6}
    if split is not None:
        figures["cpu_split_us_per_row"] = {"client": round(figures["cpu_us_per_row"], 1),
                                           **CpuSplit.per_row(servers_before, split.snapshot(), moved)}
    return figures
