"""The SDK's exception hierarchy: every error it raises is an :class:`OutboxSdkError`.

Retryability lives in the type: the consumer waits out a :class:`RetriableError`
with back-off and stops on a :class:`FatalError`.  Each class's docstring is its
default message.  Driver errors are wrapped at the seam with ``raise ... from``.

:class:`PermanentError` is the one a *handler* raises: the message can never
succeed, so it is dead-lettered at once instead of retried.
"""

from __future__ import annotations


class OutboxSdkError(Exception):
    """The outbox SDK failed."""

    #: Process exit code when this error ends a command (the relay's codes: 1 failure,
    #: 2 configuration or usage, 3 schema missing, 4 credentials rejected).
    exit_code = 1

    def __init__(self, message: str | None = None) -> None:
        # A subclass of its own without a docstring (class NotFound(PermanentError): pass),
        # raised without a message, raised IndexError here instead of itself.
        lines = (self.__doc__ or "").strip().splitlines()
        super().__init__(message or (lines[0] if lines else type(self).__name__))


# -- producing side --------------------------------------------------------------------


class TransactionRequired(OutboxSdkError):
    """Writing an event needs a transaction: use `with conn.transaction():` or a non-autocommit connection."""


class InvalidEvent(OutboxSdkError, ValueError):
    """The event cannot be written to the outbox (topic, key, payload or headers)."""


class DuplicateEvent(OutboxSdkError):
    """An event with this event_id is in the outbox already: each event is written once.  The transaction is aborted."""


class SchemaMissing(OutboxSdkError):
    """The outbox schema is missing: run `outbox-relay migrate` first."""

    exit_code = 3


# -- consuming side --------------------------------------------------------------------


class ConfigError(OutboxSdkError, ValueError):
    """Invalid consumer configuration."""

    exit_code = 2


class InboxGroupConflict(ConfigError):
    """This inbox name belongs to another consumer group: one inbox name is one group."""


class PermanentError(OutboxSdkError):
    """Raised by a handler: this message can never succeed; dead-letter it without retrying."""


class HandlerTransactionFailed(OutboxSdkError):
    """The handler swallowed a database error: its transaction is aborted, so its writes were rolled back."""


class RetriableError(OutboxSdkError):
    """A passing problem; the consumer retries the unsettled messages with back-off."""


class DatabaseUnavailable(RetriableError):
    """The database cannot be reached right now."""


class KafkaUnavailable(RetriableError):
    """The Kafka cluster cannot be reached right now."""


class TransactionConflict(RetriableError):
    """The database aborted the transaction (serialization failure or deadlock); it is retried."""


class DeadLetterFailed(RetriableError):
    """A dead letter was not acknowledged by Kafka; the message stays unsettled."""


class DeadLetterBlocked(OutboxSdkError):
    """A dead letter could not be produced: its partition is paused until the letter is sent.

    The handler is never run again for the message: the letter (with the handler's
    error) is kept and only its sending is retried, with back-off.  ``letter`` is the
    :class:`~consumer_sdk.model.DeadLetter`; ``topic``, ``partition`` and ``offset``
    locate the source message.
    """

    def __init__(self, message: str, *, letter: object, topic: str, partition: int, offset: int) -> None:
        super().__init__(message)
        self.letter = letter
        self.topic = topic
        self.partition = partition
        self.offset = offset


class FatalError(OutboxSdkError):
    """A problem a person has to fix; retrying will not help."""


class AuthenticationFailed(FatalError):
    """The database rejected the credentials: fix the user or password; retrying will not help."""

    exit_code = 4


class KafkaFatal(FatalError):
    """The Kafka client reported a fatal error."""


class ConsumerStopped(FatalError):
    """A policy chose to stop the consumer; the offending message's offset was not committed.

    ``reason`` is the policy's reason (``invalid_event_id``, ``payload_mismatch``,
    ``retries_exhausted``, ``permanent_error``); ``topic``, ``partition`` and
    ``offset`` locate the message, which the next start receives again.
    """

    def __init__(self, message: str, *, reason: str, topic: str, partition: int, offset: int) -> None:
        super().__init__(message)
        self.reason = reason
        self.topic = topic
        self.partition = partition
        self.offset = offset
