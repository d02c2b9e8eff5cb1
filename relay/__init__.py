"""Transactional outbox relay: PostgreSQL outbox rows to Kafka, never losing one."""

__version__ = "0.1.0"
