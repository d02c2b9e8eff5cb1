"""The outbox consumer SDK: what a service imports.

Producing side (in the service's own transaction, never committing)::

    from consumer_sdk import write_event
    with conn.transaction():
        conn.execute("UPDATE orders SET state = 'paid' WHERE id = %s", [order_id])
        write_event(conn, topic="orders", key=str(order_id), payload={"paid": order_id})

Consuming side (each event's effect once, offsets after the database commit)::

    from consumer_sdk import InboxConfig, InboxConsumer
    InboxConsumer(InboxConfig(name="billing", dsn=dsn, bootstrap_servers=kafka,
                              topics=["orders"]), handler).run()

The SDK never imports the ``relay`` package; it reads the same ``sql/`` files.
"""

from __future__ import annotations

from consumer_sdk.aio import write_event as write_event_async
from consumer_sdk.aio import write_events as write_events_async
from consumer_sdk.config import InboxConfig
from consumer_sdk.errors import (
    ConfigError,
    ConsumerStopped,
    DatabaseUnavailable,
    DeadLetterBlocked,
    DeadLetterFailed,
    DuplicateEvent,
    FatalError,
    HandlerTransactionFailed,
    InboxGroupConflict,
    InvalidEvent,
    KafkaFatal,
    KafkaUnavailable,
    OutboxSdkError,
    PermanentError,
    RetriableError,
    SchemaMissing,
    TransactionConflict,
    TransactionRequired,
)
from consumer_sdk.inbox import Handler, InboxConsumer
from consumer_sdk.metrics import ConsumerMetrics
from consumer_sdk.model import (
    Action,
    BatchResult,
    DeadLetter,
    InboxMessage,
    KafkaRecord,
    RetryPolicy,
)
from consumer_sdk.outbox import (
    ConnectionClosed,
    OutboxEvent,
    new_event_id,
    write_event,
    write_events,
)
from consumer_sdk.processor import BatchHandler, StatementsHandler

# cleanup_inbox: the checked one (retention_s 0 or below deleted every dedup row).
from consumer_sdk.retention import RetentionFinding, cleanup_inbox, retention_safe
from consumer_sdk.store import PgInboxStore

__all__ = [
    "Action",
    "BatchResult",
    "ConfigError",
    "ConnectionClosed",
    "ConsumerMetrics",
    "ConsumerStopped",
    "DatabaseUnavailable",
    "DeadLetterBlocked",
    "DeadLetter",
    "DeadLetterFailed",
    "FatalError",
    "BatchHandler",
    "Handler",
    "HandlerTransactionFailed",
    "InboxConfig",
    "InboxConsumer",
    "InboxGroupConflict",
    "InboxMessage",
    "DuplicateEvent",
    "InvalidEvent",
    "KafkaFatal",
    "KafkaUnavailable",
    "KafkaRecord",
    "OutboxEvent",
    "OutboxSdkError",
    "PermanentError",
    "PgInboxStore",
    "RetentionFinding",
    "RetriableError",
    "RetryPolicy",
    "SchemaMissing",
    "StatementsHandler",
    "TransactionConflict",
    "TransactionRequired",
    "cleanup_inbox",
    "new_event_id",
    "retention_safe",
    "write_event",
    "write_event_async",
    "write_events",
    "write_events_async",
]
