"""A wrong password is fatal for the SDK, as for the relay: one clear error type, never
retried forever, and the password appears nowhere."""

from __future__ import annotations

from typing import Any

from structlog.testing import capture_logs

from consumer_sdk import InboxConfig, InboxConsumer
from consumer_sdk.errors import AuthenticationFailed, FatalError
from consumer_sdk.jobs import WorkerConfig, WorkerPool
from tests.fixtures.procs import wait_until
from tests.integration.sdk._support import ConsumerThread

WRONG = "wrong-s3cret"


def _dsn(server: Any) -> str:
    return f"postgresql://pw_sdk:{WRONG}@127.0.0.1:{server.port}/postgres"


def test_the_consumer_stops_on_rejected_credentials(password_role: Any) -> None:
    config = InboxConfig(name="svc-auth", dsn=_dsn(password_role), bootstrap_servers="127.0.0.1:1",
                         topics=["t"], db_backoff_initial_s=0.01, db_backoff_max_s=0.01)
    thread = ConsumerThread(InboxConsumer(config, lambda conn, message: None))
    with capture_logs() as logs:
        thread.start()
        try:  # before: DatabaseUnavailable, retried until stop()
            wait_until(lambda: not thread.thread.is_alive(), timeout_s=20, message="the consumer kept retrying")
        finally:
            thread.consumer.stop()
            thread.thread.join(10)
    error = thread.error
    assert isinstance(error, AuthenticationFailed) and isinstance(error, FatalError)
    assert "rejected the credentials" in str(error) and WRONG not in str(error) + repr(logs)


def test_the_worker_pool_stops_claiming_on_rejected_credentials(password_role: Any) -> None:
    pool = WorkerPool(WorkerConfig(dsn=_dsn(password_role), poll_interval_s=0.1, listen=True), {})
    with capture_logs() as logs:
        pool.start()
        try:
            wait_until(lambda: pool.error is not None, timeout_s=20, message="the pool kept retrying")
        finally:
            pool.stop(drain_timeout_s=0)
    assert isinstance(pool.error, AuthenticationFailed)
    assert not any(t.is_alive() for t in pool._threads["dispatch"])  # noqa: SLF001 - not retried forever
    assert WRONG not in repr(logs)
