"""Both ends of the outbox in one service; tables orders(id, total), revenue(day PRIMARY KEY, total).
Run: OUTBOX_DSN=postgresql://... KAFKA=127.0.0.1:9092 python examples/service.py"""

from __future__ import annotations

import os
import signal

import psycopg

from consumer_sdk import InboxConfig, InboxConsumer, InboxMessage, PermanentError, write_event

TOPIC = "orders"


def place_order(conn: psycopg.Connection, order_id: int, total: float) -> None:
    """Producing side: the order and its event commit together, or neither does."""
    with conn.transaction():
        conn.execute("INSERT INTO orders (id, total) VALUES (%s, %s)", (order_id, total))
        write_event(conn, topic=TOPIC, key=str(order_id), payload={"id": order_id, "total": total})


def add_revenue(conn: psycopg.Connection, message: InboxMessage) -> None:
    """Consuming side: runs in the inbox's transaction, once per event_id however often it arrives."""
    order = message.json()
    if order["total"] < 0:
        raise PermanentError("negative total")  # dead-lettered at once; other errors are retried
    conn.execute("INSERT INTO revenue (day, total) VALUES (current_date, %s) ON CONFLICT (day) "
                 "DO UPDATE SET total = revenue.total + excluded.total", (order["total"],))


if __name__ == "__main__":
    dsn, kafka = os.environ["OUTBOX_DSN"], os.environ["KAFKA"]
    with psycopg.connect(dsn, autocommit=True) as conn:
        place_order(conn, 1, 9.5)
    config = InboxConfig(name="revenue", dsn=dsn, bootstrap_servers=kafka, topics=[TOPIC])
    consumer = InboxConsumer(config, add_revenue)
    signal.signal(signal.SIGTERM, lambda *_: consumer.stop())
    consumer.run()
